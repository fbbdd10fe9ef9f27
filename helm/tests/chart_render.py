"""Rendering the chart with Helm itself, and validating what it renders (used by test_chart.py).

`render` is `helm template`: helm-python-sdk embeds Helm v4's own engine (templates,
sprig, `include`/`tpl`/`required`, coalescing the chart's defaults, where a null deletes
one, and the values.schema.json check), so no helm binary and no imitation of Helm is
involved. What the Helm CLI does before it calls the engine is done here the CLI's way:
values files and `--set` merged in order (`--set` parsed by Helm's own strvals parser).
`lint` is `helm lint --strict` with a values file.
`validate` checks one rendered object against the Kubernetes API types of the
`kubernetes` Python client, strictly: an unknown field, a wrong scalar type or a
missing required field fails (the client itself silently drops unknown fields).
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import helm_python
import yaml
from helm_python import _native

HERE = Path(__file__).parent
CHART = HERE.parent / "rhymerl"
MONITORING_API = "monitoring.coreos.com/v1"
KUBE_VERSION = "v1.30.0"


class RenderError(Exception):
    """The chart refused the values (a `fail`, `required`, schema or template error)."""


def merge_values(base: dict, override: dict) -> dict:
    """The Helm CLI's merge of values sources: maps merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in override.items():
        out[key] = merge_values(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out


def user_values(values_files=(), set: dict | None = None) -> dict:
    """What `-f a.yaml -f b.yaml --set-json k=v ...` hands to Helm, in that order."""
    values: dict = {}
    for path in values_files:
        values = merge_values(values, yaml.safe_load(Path(path).read_text()) or {})
    for key, value in (set or {}).items():
        values = merge_values(values, helm_python.parse_set_json(f"{key}={json.dumps(value)}"))
    return values


def render_manifests(chart: Path, values: dict, *, name: str, namespace: str, kube_version: str = KUBE_VERSION,
                     api_versions=()) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` renders it for an install."""
    loaded = helm_python.Chart.load(chart)
    # Chart.render (helm-python-sdk 0.2.2) does not expose the engine's kube_version and
    # api_versions options (`helm template --kube-version --api-versions`); the native call does.
    options = {"name": name, "namespace": namespace, "is_install": True, "kube_version": kube_version,
               "api_versions": list(api_versions)}
    try:
        return json.loads(_native.call_string("helm_render", loaded._raw(), json.dumps(values), json.dumps(options)))
    except helm_python.HelmError as err:
        raise RenderError(str(err)) from None
    finally:
        loaded.close()


def make_renderer():
    """Returns render(*values_files, set={...}, api_versions=[...]) -> list of rendered objects."""

    def run(*values_files: Path, set: dict | None = None, api_versions=(), name="rhymerl",
            namespace="rollout", chart: Path = CHART, kube_version=KUBE_VERSION) -> list[dict]:
        manifests = render_manifests(chart, user_values(values_files, set), name=name, namespace=namespace,
                                     kube_version=kube_version, api_versions=api_versions)
        return [doc for path, text in sorted(manifests.items()) if not path.endswith("NOTES.txt")
                for doc in yaml.safe_load_all(text) if doc is not None]

    return run


def lint(values_file: Path | None = None, chart: Path = CHART) -> list[str]:
    """`helm lint --strict` (warnings are errors): the findings above info level."""
    values = yaml.safe_load(values_file.read_text()) if values_file else None
    report = helm_python.lint(chart, values, strict=True, kube_version=KUBE_VERSION)
    return [f"{m['path']}: {m['error'].strip()}" for m in report["messages"] if m["severity"] > 1] + \
        [e.strip() for e in report["errors"]]


# --- strict validation against the kubernetes client's models -------------------------

SCALARS = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "datetime": (str,),
           "date": (str,)}


def check_type(value, type_name: str, path: str, errors: list[str]) -> None:
    from kubernetes import client

    if type_name == "object":  # IntOrString, RawExtension: anything goes
        return
    # the client spells containers `list[T]`/`dict(str, T)` (older) or `List[T]`/`Dict[str, T]`
    list_of = re.fullmatch(r"[lL]ist\[(.*)\]", type_name)
    if list_of:
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        for i, item in enumerate(value):
            check_type(item, list_of.group(1), f"{path}[{i}]", errors)
        return
    map_of = re.fullmatch(r"dict\(str, (.*)\)|Dict\[str, (.*)\]", type_name)
    if map_of:
        inner = map_of.group(1) or map_of.group(2)
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a map, got {type(value).__name__}")
            return
        for k, v in value.items():
            check_type(v, inner, f"{path}.{k}", errors)
        return
    if type_name in SCALARS:
        if not isinstance(value, SCALARS[type_name]) or (type_name == "int" and isinstance(value, bool)):
            errors.append(f"{path}: expected {type_name}, got {value!r}")
        return
    klass = getattr(client.models, type_name)
    if not isinstance(value, dict):
        errors.append(f"{path}: expected a {type_name} object, got {value!r}")
        return
    by_json = {json_name: attr for attr, json_name in klass.attribute_map.items()}
    for key, item in value.items():
        attr = by_json.get(key)
        if attr is None:
            errors.append(f"{path}.{key}: unknown field of {type_name}")
            continue
        check_type(item, klass.openapi_types[attr], f"{path}.{key}", errors)


def model_name(obj: dict) -> str:
    version = obj["apiVersion"].split("/")[-1]
    return version[0].upper() + version[1:] + obj["kind"]


def make_validator():
    """Returns validate(obj): raises AssertionError listing every schema violation of a built-in object."""
    from kubernetes import client

    api = client.ApiClient()
    takes_text = "content_type" in inspect.signature(api.deserialize).parameters  # kubernetes >= 34

    class _Response:  # older clients' ApiClient.deserialize reads `.data`
        def __init__(self, obj):
            self.data = json.dumps(obj)

    def run(obj: dict):
        name = model_name(obj)
        assert hasattr(client.models, name), f"{obj['kind']} {obj['apiVersion']}: not a Kubernetes API type"
        errors: list[str] = []
        check_type(obj, name, obj["kind"], errors)
        assert not errors, f"{obj['kind']}/{obj['metadata'].get('name')}:\n  " + "\n  ".join(errors)
        # The models' own checks: required fields, enum values the client knows.
        if takes_text:
            return api.deserialize(json.dumps(obj), name, "application/json")
        return api.deserialize(_Response(obj), name)

    return run
