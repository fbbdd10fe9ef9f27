"""The GPU machine's Python plus the bundle: an environment the project's commands run in.

Knows the bundle's layout (deploy/gpu/bundle.py) and nothing about what runs in it.
Standard library only: it runs before the bundle's packages are installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


class NotReady(RuntimeError):
    """A piece the run needs is missing; the message is the one line the user sees."""


# Imports every module of the project in one interpreter; prints one JSON line of failures.
_IMPORT_ALL = """
import importlib, json, pkgutil, sys
failed = {}
for package in ("services", "kernels", "benchmarks", "rhymerl"):
    names = [package]
    try:
        module = importlib.import_module(package)
        for m in pkgutil.walk_packages(module.__path__, package + "."):
            spec = m.module_finder.find_spec(m.name)
            if m.ispkg or (spec and (spec.origin or "").endswith(".py")):
                names.append(m.name)  # not a shared library beside the sources (libhisto.so)
    except Exception as exc:
        failed[package] = exc
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = exc
print(json.dumps({name: [type(e).__name__, getattr(e, "name", None) or str(e)[:200]]
                  for name, e in failed.items()}))
"""

_DEVICE = """
import json, torch
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = None
cuda = torch.cuda.is_available()
print(json.dumps(dict(torch=torch.__version__, cuda_build=torch.version.cuda, triton=triton_version,
                      cuda_available=cuda, device=torch.cuda.get_device_name() if cuda else None)))
"""


class GPURuntime:
    """Installs the bundle for this Python (once per bundle) and builds the environment
    every command runs in: the bundle's packages and the SDK first on PYTHONPATH, the
    bundle's redis-server first on PATH."""

    def __init__(self, bundle: Path, site: Path | None = None):
        self.bundle = bundle.resolve()
        manifest = self.bundle / "manifest.json"
        if not manifest.exists():
            raise NotReady(f"no GPU bundle at {self.bundle} (build it with `make gpu-bundle` where there is network, "
                           f"and carry it)")
        self.manifest = json.loads(manifest.read_text())
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        if self.manifest["python"] != here:
            raise NotReady(f"the bundle {self.bundle} is for Python {self.manifest['python']}, this is {here}: "
                           f"rebuild it with `python3 deploy/gpu/bundle.py --python {here}`")
        stamp = "".join(f["sha256"][:4] for f in self.manifest["files"].values())[:16]
        self.site = (site or Path("/tmp") / f"rhymerl-gpu-site-{stamp}").resolve()

    def install(self) -> None:
        """pip-installs the bundle's wheels into the site folder (no index, no network) and
        puts the SDK there with the bundle's generated gRPC code."""
        done_marker = self.site / ".installed"
        if not done_marker.exists():
            wheels = sorted(str(p) for p in (self.bundle / "wheels").glob("*.whl"))
            print(f"installing {len(wheels)} bundled wheels into {self.site} (pip --no-index)", flush=True)
            done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                   "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(self.site), *wheels],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise NotReady(f"installing the bundle failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
            done_marker.touch()
        sdk = self.site / "rhymerl"  # refreshed every run: the SDK's code is the working tree's
        shutil.rmtree(sdk, ignore_errors=True)
        shutil.copytree(ROOT / "clients/python/src/rhymerl", sdk, ignore=shutil.ignore_patterns("v1", "__pycache__"))
        shutil.copytree(self.bundle / "proto/rhymerl/v1", sdk / "v1")

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        paths = [str(self.site), str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["PATH"] = os.pathsep.join([str(self.bundle / "bin"), sysconfig.get_path("scripts"), env.get("PATH", "")])
        env["PYTHONUNBUFFERED"] = "1"
        # The bundle's commit names what was measured: a copy of the tree may carry a .git
        # whose HEAD is older than its files (seen on the lent H100: results said the
        # session's first commit, "-dirty"). Recorded as it is (a short hash, "-dirty" when
        # the bundle was built from a changed tree), so result files need no editing.
        if "RHYMERL_COMMIT" not in env and self.manifest.get("commit"):
            env["RHYMERL_COMMIT"] = self.manifest["commit"]
        return env

    def python(self, code: str, timeout_s: float = 300) -> str:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=self.env(), capture_output=True, text=True,
                              timeout=timeout_s)
        if done.returncode != 0:
            raise NotReady(f"python failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        return done.stdout.strip().splitlines()[-1]

    def check_imports(self) -> None:
        """Every module of services/, kernels/, benchmarks/ and the SDK imports."""
        failed = json.loads(self.python(_IMPORT_ALL))
        for name, (kind, what) in sorted(failed.items()):
            print(f"  {name}: {kind}: {what}", flush=True)
        if failed:
            name, (kind, what) = next(iter(sorted(failed.items())))
            if kind == "ModuleNotFoundError":
                raise NotReady(f"package {what!r} (imported by {name}) is neither on this machine nor in the "
                               f"bundle: add it to deploy/gpu/requirements.txt")
            raise NotReady(f"{len(failed)} modules fail to import, first {name}: {kind}: {what}")

    def check_redis(self) -> tuple[str, str]:
        """(the redis-server that runs, its version line)."""
        server = shutil.which("redis-server", path=self.env()["PATH"])
        if server is None:
            raise NotReady("no redis-server: neither on this machine nor in the bundle's bin/")
        done = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=10)
        if done.returncode != 0:
            raise NotReady(f"{server} does not run here: {done.stderr.strip()}")
        return server, done.stdout.strip()

    def device(self) -> dict:
        return json.loads(self.python(_DEVICE))
