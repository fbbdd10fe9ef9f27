"""Rendering the chart without Helm, and validating what it renders (used by test_chart.py).

`render` runs the Go renderer (helm/tests/renderer: text/template + sprig + Helm's
functions), built once into helm/tests/bin/ and rebuilt when its source changes.
`validate` checks one rendered object against the Kubernetes API types of the
`kubernetes` Python client, strictly: an unknown field, a wrong scalar type or a
missing required field fails (the client itself silently drops unknown fields).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).parent
CHART = HERE.parent / "rhymerl"
RENDERER_SRC = HERE / "renderer"
BIN = HERE / "bin"
MONITORING_API = "monitoring.coreos.com/v1"


def _build_renderer() -> Path:
    go = shutil.which("go")
    if go is None:
        pytest.fail("the chart tests need Go (Debian golang-go); `make install` installs it")
    source = b"".join(p.read_bytes() for p in sorted(RENDERER_SRC.glob("*.go")))
    digest = hashlib.sha256(source).hexdigest()[:16]
    binary = BIN / f"render-{digest}"
    if not binary.exists():
        BIN.mkdir(exist_ok=True)
        for old in BIN.glob("render-*"):
            old.unlink()
        env = {**os.environ, "GO111MODULE": "off", "GOPATH": "/usr/share/gocode", "GOPROXY": "off",
               "GOFLAGS": "", "CGO_ENABLED": "0"}
        env.setdefault("GOCACHE", str(Path.home() / ".cache" / "go-build"))
        partial = binary.with_suffix(".partial")  # renamed when complete: an interrupted build is not cached
        subprocess.run([go, "build", "-o", str(partial), "."], cwd=RENDERER_SRC, env=env, check=True,
                       timeout=240)
        partial.rename(binary)
    return binary


class RenderError(Exception):
    """The chart refused the values (a `fail`, `required` or template error)."""


def make_renderer():
    """Returns render(*values_files, set={...}, api_versions=[...]) -> list of rendered objects."""
    binary = _build_renderer()

    def run(*values_files: Path, set: dict | None = None, api_versions=(), name="rhymerl",
            namespace="rollout", chart: Path = CHART, kube_version="v1.30.0") -> list[dict]:
        args = [str(binary), "-chart", str(chart), "-name", name, "-namespace", namespace,
                "-kube-version", kube_version]
        for f in values_files:
            args += ["-f", str(f)]
        for key, value in (set or {}).items():
            args += ["-set", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
        for api in api_versions:
            args += ["-api-versions", api]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RenderError(proc.stderr.strip())
        return [doc for doc in yaml.safe_load_all(proc.stdout) if doc is not None]

    return run


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
