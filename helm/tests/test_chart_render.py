"""The chart passes `helm lint --strict` with every values file, and the render harness
hands Helm what the Helm CLI would: values files then `--set`, merged in order.

Rendering itself is Helm's own engine (helm-python-sdk); these tests check the few steps
the harness does around it, on a toy chart, and that lint can fail.
"""

from __future__ import annotations

import pytest
import yaml
from chart_render import HERE, RenderError, lint

VALUES_FILES = [None, HERE / "values-gpu.yaml", HERE / "values-8gpu-node.yaml"]

TEMPLATE = """\
{{- define "t.name" -}}{{ .Release.Name }}-{{ .Chart.Name }}{{- end -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "t.name" . }}
  namespace: {{ .Release.Namespace }}
data:
  kept: {{ .Values.keep | quote }}
  dropped: {{ hasKey .Values "drop" | quote }}
  nested: {{ .Values.nested | toYaml | quote }}
  monitoring: {{ .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" | quote }}
"""


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=lambda f: f.name if f else "defaults")
def test_chart_passes_strict_lint(values_file):
    assert lint(values_file) == []


def test_strict_lint_reports_values_the_schema_refuses(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"worker": {"replicas": "many"}}))
    findings = lint(bad)
    assert findings and any("/worker/replicas" in f for f in findings)


@pytest.fixture
def chart(tmp_path):
    (tmp_path / "templates").mkdir()
    (tmp_path / "Chart.yaml").write_text("apiVersion: v2\nname: toy\nversion: 1.0.0\n")
    (tmp_path / "values.yaml").write_text("keep: k\ndrop: d\nnested: {a: 1, b: [x]}\nneed: ''\n")
    (tmp_path / "templates" / "cm.yaml").write_text(TEMPLATE)
    (tmp_path / "templates" / "NOTES.txt").write_text("not an object\n")
    (tmp_path / "templates" / "need.yaml").write_text(
        "{{- if .Values.strict }}{{ required \"need is required\" .Values.need }}{{ end }}\n")
    return tmp_path


def test_values_files_then_sets_merge_deeply_and_null_deletes_a_default(render, chart, tmp_path_factory):
    extra = tmp_path_factory.mktemp("v") / "extra.yaml"
    extra.write_text("nested: {b: [z], c: 3}\n")
    (cm,) = render(extra, chart=chart, name="rel", namespace="ns", set={"nested.a": 7, "drop": None},
                   api_versions=["monitoring.coreos.com/v1"])
    assert cm["metadata"] == {"name": "rel-toy", "namespace": "ns"}
    assert cm["data"] == {"kept": "k", "dropped": "false", "nested": "a: 7\nb:\n- z\nc: 3", "monitoring": "true"}
    (cm,) = render(chart=chart)
    assert cm["data"]["monitoring"] == "false" and cm["data"]["dropped"] == "true"


def test_required_fail_and_unknown_templates_stop_the_render(render, chart):
    with pytest.raises(RenderError, match="need is required"):
        render(chart=chart, set={"strict": True})
    (chart / "templates" / "bad.yaml").write_text('{{ fail "no way" }}\n')
    with pytest.raises(RenderError, match="no way"):
        render(chart=chart)
    (chart / "templates" / "bad.yaml").write_text('{{ include "nope" . }}\n')
    with pytest.raises(RenderError, match="nope"):
        render(chart=chart)

