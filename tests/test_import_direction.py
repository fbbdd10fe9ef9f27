"""Imports run one way: services never import benchmarks or the SDK's example scripts,
and only the simulator (and its tests) import the simulator, so the live scheduler does
not depend on offline tooling. Breaks when an import turns the wrong way."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_services_import_neither_benchmarks_nor_examples():
    wrong = [f"{p.relative_to(ROOT)}: {name}" for p in sorted((ROOT / "services").rglob("*.py"))
             for name in _imports(p)
             if name.split(".")[0] in ("benchmarks", "clients", "grpo_trainer", "reasoning_task")]
    assert wrong == []


def test_only_the_simulator_imports_the_simulator():
    simulator = ROOT / "services" / "scheduler" / "simulator"
    wrong = [f"{p.relative_to(ROOT)}: {name}" for p in sorted((ROOT / "services").rglob("*.py"))
             if simulator not in p.parents
             for name in _imports(p) if name.startswith("services.scheduler.simulator")]
    assert wrong == []


def test_the_walk_sees_imports():
    """The checks above would pass vacuously if the walk found nothing."""
    names = _imports(ROOT / "services" / "scheduler" / "simulator" / "workload.py")
    assert "services.common.traces" in names
