"""Builds the SDK, generating the gRPC code from protos/ first.

The generated modules (src/rhymerl/v1/*_pb2*.py) are build output: they are
never committed and never edited; `make proto` or any pip install regenerates them.
"""

import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).parent
PROTO_ROOTS = [HERE / "protos", HERE.parent.parent / "protos"]  # sdist copy, then the repo


def generate(out: str | pathlib.Path = HERE / "src") -> None:
    """Writes rhymerl/v1/*_pb2*.py under ``out`` (the GPU bundle passes its own folder)."""
    from grpc_tools import protoc  # a build requirement (pyproject.toml)
    import grpc_tools

    root = next((p for p in PROTO_ROOTS if p.is_dir()), None)
    out = pathlib.Path(out)
    if root is None:
        if (out / "rhymerl" / "v1" / "common_pb2.py").exists():
            return
        raise RuntimeError("protos/ not found next to the SDK; build from a rhymerl checkout")
    out.mkdir(parents=True, exist_ok=True)
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*.proto"))
    args = ["protoc", f"-I{root}", f"-I{include}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}", *files]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    (out / "rhymerl" / "v1" / "__init__.py").touch()


class BuildWithProtos(build_py):
    def run(self):
        generate()
        super().run()


if __name__ == "__main__":
    setup(cmdclass={"build_py": BuildWithProtos})
