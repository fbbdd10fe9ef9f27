"""The CPU sampler (compiled RNG, screened Gumbel-max) against the PyTorch reference, side by side.

    python -m benchmarks.cpu_sampler [--repeats 5] [--threads 2]

A CPU worker samples every step through ``kernels.sampling.sample``: the argmax of the
scaled logits plus Gumbel noise, and the token's logprob. The reference
(``sample_reference``) computes the noise over the whole vocabulary with int64 hashing in
PyTorch; the CPU path (``sample``) uses the compiled RNG (``kernels/gumbel_native.py``),
and for rows without truncation (these rows: T=1) the screened Gumbel-max, which
computes the noise of a few candidate tokens per row only. For each (rows, vocabulary)
it reports the median process CPU time and wall time of a whole call of each, their
ratio, and whether the tokens and logprobs are identical (they must be). Vocabularies:
SmolLM2's 49,152 and Qwen's 151,936; rows 1 to 256 (a decode batch).

Writes benchmarks/results/cpu_sampler.md and .json (device, commit, command). A CPU
ratio: it says how much of a CPU worker's step the RNG was, not how a GPU samples.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.provenance import cpu_name, git_commit
from kernels import gumbel_native
from kernels import sampling as sp

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = [(1, 49152), (16, 49152), (64, 49152), (256, 49152), (1, 151936), (64, 151936)]


def timed(fn, repeats: int) -> tuple[float, float, object]:
    """(median CPU ms, median wall ms, the last result) over ``repeats`` calls after one warm-up."""
    out = fn()
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        cpu.append((time.process_time() - c0) * 1e3)
        wall.append((time.perf_counter() - w0) * 1e3)
    return statistics.median(cpu), statistics.median(wall), out


def side_by_side(reference, compiled, repeats: int) -> tuple[dict, object, object]:
    """Both callables ``timed``: a results row's time fields (median CPU and wall ms of each,
    their ratios) and the last result of each."""
    ref_cpu, ref_wall, ref = timed(reference, repeats)
    new_cpu, new_wall, out = timed(compiled, repeats)
    return dict(reference_cpu_ms=round(ref_cpu, 2), compiled_cpu_ms=round(new_cpu, 2),
                reference_wall_ms=round(ref_wall, 2), compiled_wall_ms=round(new_wall, 2),
                cpu_ratio=round(ref_cpu / max(new_cpu, 1e-9), 2),
                wall_ratio=round(ref_wall / max(new_wall, 1e-9), 2)), ref, out


def compiled_cli(doc: str, argv: list[str] | None, library, what: str) -> argparse.Namespace | None:
    """The arguments of a compiled-vs-reference CPU benchmark (--repeats, --threads, --out),
    torch's threads set; None, after one line naming `make install`, when ``library`` (a
    kernels module with ``available`` and ``library_path``) does not load."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (a CPU worker's)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not library.available():
        print(f"{what} {library.library_path()} does not load: run `make install`", file=sys.stderr)
        return None
    torch.set_num_threads(args.threads)
    return args


def case(rows: int, vocab: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = torch.randn(rows, vocab, generator=gen) * 3  # [rows, vocab]
    args = (torch.ones(rows), torch.zeros(rows, dtype=torch.int32), torch.zeros(rows), torch.zeros(rows),
            torch.arange(rows, dtype=torch.int64) * 7919 + 11, torch.arange(rows, dtype=torch.int64) + 300)
    times, (ref_tok, ref_lp), (tok, lp) = side_by_side(lambda: sp.sample_reference(logits, *args),
                                                       lambda: sp.sample(logits, *args), repeats)
    identical = bool(torch.equal(tok, ref_tok) and torch.equal(lp.view(torch.int32), ref_lp.view(torch.int32)))
    return dict(rows=rows, vocab=vocab, **times, identical=identical)


def main(argv: list[str] | None = None) -> int:
    args = compiled_cli(__doc__, argv, gumbel_native, "the compiled RNG")
    if args is None:
        return 1
    rows = []
    print(f"{'rows':>5} {'vocab':>7} | {'ref CPU ms':>10} {'compiled':>9} {'ratio':>6} | "
          f"{'ref wall ms':>11} {'compiled':>9} {'ratio':>6} | identical")
    for n, vocab in SHAPES:
        r = case(n, vocab, args.repeats)
        rows.append(r)
        print(f"{n:>5} {vocab:>7} | {r['reference_cpu_ms']:>10} {r['compiled_cpu_ms']:>9} {r['cpu_ratio']:>5}x | "
              f"{r['reference_wall_ms']:>11} {r['compiled_wall_ms']:>9} {r['wall_ratio']:>5}x | {r['identical']}",
              flush=True)
    meta = dict(device=f"cpu: {cpu_name()}", commit=git_commit(), python=platform.python_version(),
                torch=torch.__version__, threads=args.threads, repeats=args.repeats,
                command="python -m benchmarks.cpu_sampler " + " ".join(argv if argv is not None else sys.argv[1:]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_sampler.json").write_text(json.dumps(dict(meta, rows=rows), indent=1) + "\n")
    lines = ["# CPU sampler: the CPU path (compiled RNG, screened Gumbel-max) vs the PyTorch reference", "",
             f"`{meta['command']}` at commit {meta['commit']} on {meta['device']} ({args.threads} torch threads, "
             f"median of {args.repeats}). A whole `sample` call (noise, argmax, logprob) at T=1; CPU time is the "
             "process's, so it counts every torch thread. Ratios are this CPU's.", "",
             "| rows | vocab | reference CPU ms | compiled CPU ms | CPU ratio | reference wall ms | compiled wall ms "
             "| wall ratio | identical tokens and logprobs |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['vocab']} | {r['reference_cpu_ms']} | {r['compiled_cpu_ms']} | {r['cpu_ratio']}x | "
              f"{r['reference_wall_ms']} | {r['compiled_wall_ms']} | {r['wall_ratio']}x | {r['identical']} |"
              for r in rows]
    (args.out / "cpu_sampler.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / 'cpu_sampler.md'} and .json")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
