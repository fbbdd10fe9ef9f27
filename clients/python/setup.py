"""Builds the SDK, generating the gRPC code from protos/ first.

The generated modules (src/rhymerl/v1/*_pb2*.py) are build output: never committed, never
edited. They are generated when setuptools loads this file, before it lists the packages,
so every way of installing packages them: `pip install ./clients/python`, a wheel, an
sdist (which carries a copy of protos/ and regenerates from it) and an editable install.

The generated code checks at import that the grpcio and protobuf it runs on are at least
the versions that generated it, so those are the SDK's requirements, read from the code.
"""

import pathlib
import re
import shutil

from setuptools import setup
from setuptools.command.sdist import sdist

HERE = pathlib.Path(__file__).parent
REPO_PROTOS = HERE.parent.parent / "protos"
PROTO_ROOTS = [HERE / "protos", REPO_PROTOS]  # an sdist's copy, then the repository's
OUT = HERE / "src"
GENERATED = OUT / "rhymerl" / "v1"


def generate(out: str | pathlib.Path = OUT) -> None:
    """Regenerates rhymerl/v1/*_pb2*.py under ``out`` from protos/ (kept as they are when
    there are no protos). The GPU bundle passes its own folder."""
    from grpc_tools import protoc  # a build requirement (pyproject.toml)
    import grpc_tools

    out = pathlib.Path(out)
    generated = out / "rhymerl" / "v1"
    root = next((p for p in PROTO_ROOTS if p.is_dir()), None)
    if root is None:
        if (generated / "common_pb2.py").exists():
            return
        raise RuntimeError("protos/ not found next to the SDK; build from a rhymerl checkout or its sdist")
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*.proto"))
    shutil.rmtree(generated, ignore_errors=True)  # no module of a deleted .proto survives
    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{root}", f"-I{include}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}", *files]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    (generated / "__init__.py").touch()


def runtime_requirements() -> list[str]:
    """grpcio and protobuf at least as new as the generated code's own version checks."""
    pb2 = (GENERATED / "common_pb2.py").read_text()
    major, minor, patch = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)", pb2).groups()
    grpc = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", (GENERATED / "common_pb2_grpc.py").read_text())
    return [f"grpcio>={grpc.group(1)}", f"protobuf>={major}.{minor}.{patch},<{int(major) + 1}", "numpy>=1.24"]


class SdistWithProtos(sdist):
    """The sdist carries protos/, so a wheel built from it generates its own code."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        if REPO_PROTOS.is_dir():
            shutil.copytree(REPO_PROTOS, pathlib.Path(base_dir) / "protos", dirs_exist_ok=True)


if __name__ == "__main__":  # setuptools runs this file as __main__; `make proto` imports it
    generate()
    setup(packages=["rhymerl", "rhymerl.v1"], package_dir={"": "src"},
          package_data={"rhymerl.v1": ["*.pyi"]}, install_requires=runtime_requirements(),
          cmdclass={"sdist": SdistWithProtos})
