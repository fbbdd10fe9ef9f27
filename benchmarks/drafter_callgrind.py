"""The compiled drafter's C calls counted, not timed: a fixed lockstep replay to run under callgrind.

    python -m benchmarks.drafter_callgrind --build HISTO_CPP LIB_SO
    RHYMERL_DRAFTER_LIBRARY=LIB_SO valgrind --tool=callgrind --cache-sim=yes --callgrind-out-file=OUT \\
        --LL=1048576,16,64 python -m benchmarks.drafter_callgrind [--traces NPZ] [--epochs N]
    python -m benchmarks.drafter_callgrind --report OUT [OUT ...]

The first builds a histo.cpp as the release library is built but keeping its symbols
(so callgrind names rhd_step). The second replays the first `--epochs` epochs of a committed trace set through
`benchmarks.drafter_replay.replay` with the compiled drafter of drafter_bench's `rhymerl`
row (the worker's configuration), and prints a digest of its drafts (so two builds can be
checked to draft the same). Under callgrind (instruction counts and a simulated cache:
the machine's load does not move them) `--report` then prints, per output file, the
inclusive instructions (Ir) and last-level misses (ILmr + DLmr + DLmw) of `rhd_step`
(propose) and `rhd_commit` (a step's commits: rhd_commit and rhd_commit_bound), read with callgrind_annotate. The
simulated last level is set to 1 MiB, 16-way (callgrind would otherwise take this
machine's, hundreds of MiB, where an index of 184k tokens never misses).
$RHYMERL_DRAFTER_LIBRARY picks another build of the library (an A/B against another commit).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

NATIVE = Path(__file__).resolve().parents[1] / "services" / "rollout" / "drafter" / "native"
ENTRY_POINTS = ("rhd_step", "rhd_commit")
# the C functions each entry point's figures sum: a step's commits come through rhd_commit
# or, since ABI 5, rhd_commit_bound (its arguments in a bound block; the same work)
FUNCTIONS = {"rhd_step": ("rhd_step",), "rhd_commit": ("rhd_commit", "rhd_commit_bound")}


def run(traces_path: str, epochs: int) -> str:
    from benchmarks import drafter_bench as B
    from benchmarks import drafter_replay as R
    from services.rollout.engine.cost_model import CostModel

    traces = [t for t in R.load_traces(traces_path) if t.epoch < epochs]
    drafts: list = []
    row = R.replay(traces, B._ours(cost_model=CostModel()), R.stop_token(traces), B.RHYMERL, drafts_log=drafts)
    digest = hashlib.sha256(repr(drafts).encode()).hexdigest()[:16]
    return f"{len(drafts)} steps, accepted per verify {row['mean_accepted_drafts_per_step']:.4f}, drafts sha256 {digest}"


def build_profiled(source: Path, out: Path) -> Path:
    """The release build of `source` (build.py's flags) but not stripped, so callgrind names
    its functions (and with -g, its lines): the same instructions as the release library."""
    spec = importlib.util.spec_from_file_location("_histo_build", NATIVE / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    cmd = [arg for arg in build.command(out) if arg != "-s"]
    cmd = [str(source) if arg.endswith("histo.cpp") else arg for arg in cmd]
    # the source's own directory first: a copy of another commit's histo.cpp beside its histo.h
    subprocess.run([cmd[0], "-g", f"-I{source.parent}", *cmd[1:]], check=True)
    return out


def report(path: str) -> dict[str, dict[str, int]]:
    """{entry point: {"Ir": instructions, "LLmiss": last-level misses}}, inclusive. An entry
    point's body is its `guarded<...>` instance (rhd_step itself is a jump into it)."""
    events = ["Ir", "ILmr", "DLmr", "DLmw"]
    text = subprocess.run(["callgrind_annotate", "--auto=no", "--threshold=100", "--inclusive=yes",
                           f"--show={','.join(events)}", path], check=True, capture_output=True, text=True).stdout
    out = {name: {"Ir": 0, "LLmiss": 0} for name in ENTRY_POINTS}
    for line in text.splitlines():  # one line per (source file, function): summed per function
        for name in ENTRY_POINTS:
            if not any(re.search(rf"guarded<{fn}::|[:\s]{fn}\b", line) for fn in FUNCTIONS[name]):
                continue
            # the event columns before the "file:function" (a count, its share in parentheses, or ".": none)
            columns = re.split(r"\s{2,}(?=[/?.\w<][^\s(]*:)", line.strip(), maxsplit=1)[0]
            cells = re.findall(r"([\d,]+)(?: \(\s*[\d.]+%\))?|(?<!\S)\.(?!\S)", columns)
            numbers = [int(x.replace(",", "")) if x else 0 for x in cells]
            if len(numbers) == len(events):
                out[name]["Ir"] += numbers[0]
                out[name]["LLmiss"] += sum(numbers[1:])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default="benchmarks/data/tiny_grpo_service.npz")
    parser.add_argument("--epochs", type=int, default=8, help="replay epochs [0, N) of the trace set")
    parser.add_argument("--build", nargs=2, type=Path, metavar=("HISTO_CPP", "OUT_SO"),
                        help="build a histo.cpp for callgrind (release flags, symbols kept) and exit")
    parser.add_argument("--report", nargs="+", metavar="CALLGRIND_OUT")
    args = parser.parse_args()
    if args.build:
        print(build_profiled(*args.build))
        return
    if args.report:
        for path in args.report:
            counts = report(path)
            cells = "  ".join(f"{name}: {c['Ir'] / 1e6:.1f} M Ir, {c['LLmiss'] / 1e6:.3f} M LL misses"
                              for name, c in counts.items())
            print(f"{path}  {cells}")
        return
    print(run(args.traces, args.epochs))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
