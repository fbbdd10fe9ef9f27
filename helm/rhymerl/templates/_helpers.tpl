{{/* Names, labels and the pieces every component shares. */}}

{{- define "rhymerl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "rhymerl.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<component>": call with (list $ "history"). */}}
{{- define "rhymerl.componentName" -}}
{{- $root := index . 0 }}
{{- printf "%s-%s" (include "rhymerl.fullname" $root | trunc 50 | trimSuffix "-") (index . 1) }}
{{- end }}

{{/* (list $ "scheduler"), or (list $ "scheduler" "2"): one shard's pods only (sharding). */}}
{{- define "rhymerl.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "rhymerl.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- if and (gt (len .) 2) (ne (index . 2) "") }}
rhymerl.io/shard: {{ index . 2 | quote }}
{{- end }}
{{- end }}

{{- define "rhymerl.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "rhymerl.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: rhymerl
{{- with $root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* An image reference: call with (list $ .Values.image.service). */}}
{{- define "rhymerl.image" -}}
{{- $root := index . 0 }}
{{- $image := index . 1 }}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) }}
{{- end }}

{{- define "rhymerl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rhymerl.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "rhymerl.historyAddress" -}}
{{- printf "%s:%d" (include "rhymerl.componentName" (list . "history")) (int .Values.history.port) }}
{{- end }}

{{/* The Service trainers call: the step router when sharded, else the scheduler. */}}
{{- define "rhymerl.schedulerAddress" -}}
{{- if .Values.sharding.enabled }}
{{- printf "%s:%d" (include "rhymerl.componentName" (list . "router")) (int .Values.router.port) }}
{{- else }}
{{- printf "%s:%d" (include "rhymerl.componentName" (list . "scheduler")) (int .Values.scheduler.port) }}
{{- end }}
{{- end }}

{{/* The Secret holding the trainers' tokens and the workers' token (auth.enabled). */}}
{{- define "rhymerl.authSecretName" -}}
{{- .Values.auth.existingSecret | default (include "rhymerl.componentName" (list . "auth")) }}
{{- end }}

{{/* The workers' token, as an env var's valueFrom under `name` (auth.enabled): the
     scheduler's RegistryService asks it of every worker; (list $ "RHYMERL_WORKER_SCHEDULER_TOKEN"). */}}
{{- define "rhymerl.workerTokenEnv" -}}
{{- $root := index . 0 }}
{{- if $root.Values.auth.enabled }}
- name: {{ index . 1 }}
  valueFrom:
    secretKeyRef:
      name: {{ include "rhymerl.authSecretName" $root }}
      key: {{ $root.Values.auth.workerTokenKey }}
{{- end }}
{{- end }}

{{/* What `helm test` asks: the Service trainers call (the router when sharded, else the
     scheduler), on a port that speaks plaintext: the gRPC port, or with TLS the health
     port (the scheduler's health process; the router's tls.healthPort), since
     rhymerl-healthcheck speaks no TLS. */}}
{{- define "rhymerl.testTarget" -}}
{{- if .Values.sharding.enabled }}
{{- printf "%s:%d" (include "rhymerl.componentName" (list . "router")) (int (include "rhymerl.probePort" (list . .Values.router.port))) }}
{{- else if .Values.tls.enabled }}
{{- printf "%s:%d" (include "rhymerl.componentName" (list . "scheduler")) (int .Values.scheduler.healthPort) }}
{{- else }}
{{- include "rhymerl.schedulerAddress" . }}
{{- end }}
{{- end }}

{{/* The shards as a JSON list: [""] unsharded (the names as ever), else ["0", .., "N-1"]. */}}
{{- define "rhymerl.shards" -}}
{{- $shards := list "" }}
{{- if .Values.sharding.enabled }}
{{- $shards = list }}
{{- range $i := until (int .Values.sharding.shards) }}
{{- $shards = append $shards (toString $i) }}
{{- end }}
{{- end }}
{{- toJson $shards }}
{{- end }}

{{/* One shard's scheduler (or worker) name: (list $ "scheduler" shard). */}}
{{- define "rhymerl.shardName" -}}
{{- $base := include "rhymerl.componentName" (list (index . 0) (index . 1)) }}
{{- if eq (index . 2) "" }}{{ $base }}{{ else }}{{ printf "%s-%s" $base (index . 2) }}{{ end }}
{{- end }}

{{/* Whether the release has a Redis the scheduler can share (the step log, the shard
     registry): scheduler.redisUrl, or history's (external, Secret or bundled); not when
     history embeds its own. */}}
{{- define "rhymerl.hasRedis" -}}
{{- $h := .Values.history }}
{{- if or .Values.scheduler.redisUrl $h.redisUrlSecret.name .Values.redis.enabled $h.redisUrl }}yes{{ end }}
{{- end }}

{{/* That Redis's URL as an env var's value or valueFrom. */}}
{{- define "rhymerl.redisUrlValue" -}}
{{- $h := .Values.history }}
{{- if .Values.scheduler.redisUrl }}
value: {{ .Values.scheduler.redisUrl | quote }}
{{- else if $h.redisUrlSecret.name }}
valueFrom:
  secretKeyRef:
    name: {{ $h.redisUrlSecret.name }}
    key: {{ $h.redisUrlSecret.key }}
{{- else if .Values.redis.enabled }}
value: {{ printf "redis://%s:%d/0" (include "rhymerl.componentName" (list . "redis")) (int .Values.redis.port) | quote }}
{{- else }}
value: {{ $h.redisUrl | quote }}
{{- end }}
{{- end }}

{{/* Pod-spec fields every component shares. */}}
{{- define "rhymerl.podCommon" -}}
serviceAccountName: {{ include "rhymerl.serviceAccountName" . }}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* nodeSelector, tolerations and affinity of one component's values. */}}
{{- define "rhymerl.placement" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Writable scratch space: root filesystems are read-only. */}}
{{- define "rhymerl.tmpEnv" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
{{- end }}

{{/* TLS settings of one component, by its env prefix: (list $ "SCHEDULER"). */}}
{{- define "rhymerl.tlsEnv" -}}
{{- $root := index . 0 }}
{{- $prefix := index . 1 }}
{{- /* a third element: the service has a health port of its own (the scheduler) */}}
{{- $ownHealthPort := gt (len .) 2 }}
{{- with $root.Values.tls }}
{{- if .enabled }}
- name: RHYMERL_{{ $prefix }}_TLS_CERT_FILE
  value: /etc/rhymerl/tls/tls.crt
- name: RHYMERL_{{ $prefix }}_TLS_KEY_FILE
  value: /etc/rhymerl/tls/tls.key
- name: RHYMERL_{{ $prefix }}_TLS_CA_FILE
  value: /etc/rhymerl/tls/{{ .caKey }}
- name: RHYMERL_{{ $prefix }}_TLS_SERVER_NAME
  value: {{ .serverName | quote }}
{{- if not $ownHealthPort }}
- name: RHYMERL_{{ $prefix }}_HEALTH_PORT
  value: {{ .healthPort | int | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "rhymerl.tlsVolumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/rhymerl/tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "rhymerl.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ required "tls.secretName is required when tls.enabled" .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{/* The port the kubelet probes: the gRPC port, or with TLS the plaintext health port. */}}
{{- define "rhymerl.probePort" -}}
{{- $root := index . 0 }}
{{- if $root.Values.tls.enabled }}{{ $root.Values.tls.healthPort | int }}{{ else }}{{ index . 1 | int }}{{ end }}
{{- end }}

{{/* grpc probes of a server on `port` for `service`: (dict "port" 1 "service" "x"). */}}
{{- define "rhymerl.grpcProbes" -}}
readinessProbe:
  grpc:
    port: {{ .port }}
    service: {{ .service }}
  periodSeconds: 5
  failureThreshold: 3
livenessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end }}

{{/* A NetworkPolicy peer: the pods of one component, (list $ "worker"). */}}
{{- define "rhymerl.peer" -}}
- podSelector:
    matchLabels:
      {{- include "rhymerl.selectorLabels" . | nindent 6 }}
{{- end }}

{{/* The ingress rule that lets the `helm test` pod ask the plaintext health port: (list $). */}}
{{- define "rhymerl.testHealthRule" -}}
{{- $root := index . 0 -}}
- ports:
    - port: health
  from:
    {{- include "rhymerl.peer" (list $root "test") | nindent 4 }}
{{- end }}

{{/* The ingress rule that lets Prometheus scrape: (list $). */}}
{{- define "rhymerl.metricsRule" -}}
{{- $root := index . 0 -}}
- ports:
    - port: metrics
  {{- with $root.Values.networkPolicy.metricsFrom }}
  from:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* Which pods Prometheus Operator scrapes. */}}
{{- define "rhymerl.monitorSelector" -}}
matchLabels:
  app.kubernetes.io/name: {{ include "rhymerl.name" . }}
  app.kubernetes.io/instance: {{ .Release.Name }}
matchExpressions:
  - key: app.kubernetes.io/component
    operator: In
    values: [history, scheduler, worker{{ if .Values.sharding.enabled }}, router{{ end }}]
{{- end }}

{{- define "rhymerl.componentRelabel" -}}
# the `component` label the dashboards and rules select on (as in docker-compose)
- sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_component]
  targetLabel: component
{{- end }}
