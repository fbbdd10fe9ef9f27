"""Imports run one way: services <- benchmarks <- devtools. Services never import
benchmarks, devtools or the SDK's example scripts, nor start or load them by name
(a `-m benchmarks...` argument, an `examples/` path); benchmarks never import devtools;
only the simulator (and its tests) import the simulator, so the live scheduler does not
depend on offline tooling. Breaks when an import or a path reference turns the wrong way."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A string in services/ that names offline tooling: a module to run (`-m benchmarks.x`,
# "benchmarks.tiny_llm.train_sft"), a path into benchmarks/ or the SDK examples, or a
# path segment of either ("examples", as in ROOT / "clients" / "python" / "examples").
TOOLING = re.compile(r"-m\s+(benchmarks|devtools)\b|\b(benchmarks|devtools)[./]|\bexamples[/.]|"
                     r"^(benchmarks|devtools|examples)$|\b(grpo_trainer|reasoning_task|tiny_llm)\b")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def tooling_strings(source: str, filename: str = "<source>") -> list[str]:
    """The string literals (docstrings aside: they may say where things live) naming
    benchmarks, devtools or the SDK examples."""
    tree = ast.parse(source, filename)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            and TOOLING.search(node.value)]


def _services() -> list[Path]:
    return sorted((ROOT / "services").rglob("*.py"))


def test_services_import_neither_benchmarks_nor_devtools_nor_examples():
    wrong = [f"{p.relative_to(ROOT)}: {name}" for p in _services() for name in _imports(p)
             if name.split(".")[0] in ("benchmarks", "devtools", "clients", "grpo_trainer", "reasoning_task")]
    assert wrong == []


def test_services_neither_run_nor_load_benchmarks_or_examples_by_name():
    wrong = [f"{p.relative_to(ROOT)}: {text!r}" for p in _services()
             for text in tooling_strings(p.read_text(), str(p))]
    assert wrong == []


def test_benchmarks_do_not_import_devtools():
    wrong = [f"{p.relative_to(ROOT)}: {name}" for p in sorted((ROOT / "benchmarks").rglob("*.py"))
             for name in _imports(p) if name.split(".")[0] == "devtools"]
    assert wrong == []


def test_only_the_simulator_imports_the_simulator():
    simulator = ROOT / "services" / "scheduler" / "simulator"
    wrong = [f"{p.relative_to(ROOT)}: {name}" for p in _services()
             if simulator not in p.parents
             for name in _imports(p) if name.startswith("services.scheduler.simulator")]
    assert wrong == []


def test_the_walk_sees_imports():
    """The import checks above would pass vacuously if the walk found nothing."""
    names = _imports(ROOT / "services" / "scheduler" / "simulator" / "workload.py")
    assert "services.common.traces" in names


def test_the_string_check_sees_what_services_once_did():
    """What services/local.py held before the driver moved out is caught; docstrings
    and ordinary strings are not."""
    old = '''
def ensure_model(model_dir):
    """Trains it with benchmarks/tiny_llm/train_sft.py."""
    subprocess.run([sys.executable, "-m", "benchmarks.tiny_llm.train_sft", "--out", model_dir])


def load_example(name):
    path = str(ROOT / "clients" / "python" / "examples")
    return runpy.run_path(f"{path}/{name}.py")


def summary():
    return "run `python -m benchmarks.engine_bench --device cuda` for the GPU figures"
'''
    assert sorted(tooling_strings(old)) == ["benchmarks.tiny_llm.train_sft", "examples",
                                            "run `python -m benchmarks.engine_bench --device cuda` for the GPU figures"]
    assert tooling_strings('"""See benchmarks/results."""\nNAME = "worker-examples"\nX = "-m services.cli"\n') == []
