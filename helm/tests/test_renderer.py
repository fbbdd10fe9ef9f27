"""The Go renderer behaves like `helm template` where the chart relies on it.

If these fail, test_chart.py may pass on a chart that real Helm renders differently:
values merging (a null deletes a default), include/tpl/required/fail, toYaml/fromYaml,
.Files.Get, .Capabilities.APIVersions.Has, .Release/.Chart, and dropping empty output.
"""

from __future__ import annotations

import pytest
from chart_render import RenderError

TEMPLATE = """\
{{- define "t.name" -}}{{ .Release.Name }}-{{ .Chart.Name }}{{- end -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "t.name" . }}
  namespace: {{ .Release.Namespace }}
data:
  version: {{ .Chart.AppVersion | quote }}
  kept: {{ .Values.keep | quote }}
  dropped: {{ hasKey .Values "drop" | quote }}
  nested: {{ .Values.nested | toYaml | quote }}
  rendered: {{ tpl .Values.greeting . | quote }}
  file: {{ (.Files.Get "files/f.yaml" | fromYaml).answer | quote }}
  monitoring: {{ .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" | quote }}
  port: {{ .Values.port | int | quote }}
  missing: "{{ .Values.nothing }}"
"""


@pytest.fixture
def chart(tmp_path):
    (tmp_path / "templates").mkdir()
    (tmp_path / "files").mkdir()
    (tmp_path / "Chart.yaml").write_text("apiVersion: v2\nname: toy\nversion: 1.0.0\nappVersion: '2.1'\n")
    (tmp_path / "values.yaml").write_text(
        "keep: k\ndrop: d\nnested: {a: 1, b: [x]}\ngreeting: 'hi {{ .Release.Name }}'\nport: 50051\nneed: ''\n")
    (tmp_path / "files" / "f.yaml").write_text("answer: 42\n")
    (tmp_path / "templates" / "cm.yaml").write_text(TEMPLATE)
    (tmp_path / "templates" / "empty.yaml").write_text("{{- if .Values.never }}\nkind: X\n{{- end }}\n")
    (tmp_path / "templates" / "need.yaml").write_text(
        "{{- if .Values.strict }}{{ required \"need is required\" .Values.need }}{{ end }}\n")
    return tmp_path


def test_renders_helm_objects_and_functions(render, chart):
    (cm,) = render(chart=chart, name="rel", namespace="ns", set={"drop": None},
                   api_versions=["monitoring.coreos.com/v1"])
    assert cm["metadata"] == {"name": "rel-toy", "namespace": "ns"}
    assert cm["data"] == {
        "version": "2.1", "kept": "k", "dropped": "false", "nested": "a: 1\nb:\n- x",
        "rendered": "hi rel", "file": "42", "monitoring": "true", "port": "50051", "missing": "",
    }


def test_values_files_and_sets_merge_deeply(render, chart, tmp_path_factory):
    extra = tmp_path_factory.mktemp("v") / "extra.yaml"
    extra.write_text("nested: {b: [z], c: 3}\n")
    (cm,) = render(extra, chart=chart, set={"nested.a": 7})
    assert cm["data"]["nested"] == "a: 7\nb:\n- z\nc: 3"
    assert cm["data"]["monitoring"] == "false"


def test_required_and_fail_stop_the_render(render, chart):
    with pytest.raises(RenderError, match="need is required"):
        render(chart=chart, set={"strict": True})
    (chart / "templates" / "bad.yaml").write_text('{{ fail "no way" }}\n')
    with pytest.raises(RenderError, match="no way"):
        render(chart=chart)
    (chart / "templates" / "bad.yaml").write_text('{{ include "nope" . }}\n')
    with pytest.raises(RenderError, match="nope"):
        render(chart=chart)
