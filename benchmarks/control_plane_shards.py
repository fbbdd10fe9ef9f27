"""Scale-out of the control plane: 1 vs 2 scheduler shards behind the step router, fake workers.

    python -m benchmarks.control_plane_shards                     # W=128, S=16384 and 65536: direct, 1 and 2 shards
    python -m benchmarks.control_plane_shards --workers 256 --samples 65536 --shards 1,2,4

Per row, everything fresh:
1. A redis-server (the shard registry); K schedulers as their CLI starts them
   (``python -m services.cli scheduler``, no history, no step log), each announcing
   itself there as a shard; W / K fake workers per shard (``benchmarks/fake_fleet.py``,
   the fleet of ``benchmarks/control_plane.py``: answered at once, ``--slots`` slots,
   ``--response-tokens`` tokens per sample).
2. The router (``python -m services.cli router``) once every shard announced its whole
   fleet; ``--settle-s`` idle seconds.
3. One trainer submits one step of S samples (S / ``--n`` prompts x n) to the router and
   reads the stream to the summary. Row ``direct``: the same with one scheduler and no
   router (the trainer talks to the scheduler): the baseline.

Reported per process: CPU-seconds over the step per 1k samples (utime + stime from
/proc/<pid>/stat) of the router and of each shard, their peak RSS; samples/s over the
step's wall time; every (prompt, sample) delivered once (lost, duplicated counted).
On a shared machine the fakes, the trainer, the shards and the router share the cores:
CPU-seconds per process are the honest figure; wall-clock rates are a lower bound, and
the load average is reported beside them.
Writes its rows into benchmarks/results/control_plane.json's ``"shards"`` key (``rows``,
note, device, commit, command; the rest of the file kept) and renders control_plane.md
again with a section for them (``benchmarks/control_plane.py`` keeps the key when it
rewrites the file).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.control_plane import RESULTS, ROOT, SchedulerProcess, cpu_seconds, peak_rss_mb, run_trainers
from benchmarks.fake_fleet import FakeFleet, FleetSpec
from benchmarks.provenance import cpu_name, git_commit
from benchmarks.report import markdown_table
from services.common.redis_server import EmbeddedRedis, free_port
from services.local import stop_process
from services.router.registry import ShardInfo, shard_prefix

COLUMNS = [("layout", "layout", "{}"), ("workers", "workers", "{}"), ("samples", "samples", "{}"),
           ("samples/s", "samples_per_s", "{:.0f}"), ("router CPU ms / 1k", "router_cpu_ms_per_1k", "{:.0f}"),
           ("each shard CPU ms / 1k", "shard_cpu_cell", "{}"), ("all schedulers CPU ms / 1k",
                                                               "schedulers_cpu_ms_per_1k", "{:.0f}"),
           ("router peak RSS MB", "router_peak_rss_mb", "{:.0f}"), ("shard peak RSS MB", "shard_rss_cell", "{}"),
           ("lost", "lost", "{}"), ("duplicated", "duplicated", "{}"), ("wall s", "wall_s", "{:.1f}"),
           ("load 1m", "load_1m", "{:.1f}")]


class RouterProcess:
    """``python -m services.cli router`` on a free port, reading the registry."""

    def __init__(self, registry_url: str, log_path: Path):
        self.port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RHYMERL_ROUTER_HOST": "127.0.0.1",
               "RHYMERL_ROUTER_PORT": str(self.port), "RHYMERL_ROUTER_METRICS_PORT": "0",
               "RHYMERL_ROUTER_REGISTRY_URL": registry_url, "RHYMERL_ROUTER_REFRESH_S": "0.5"}
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "services.cli", "router"], cwd=ROOT, env=env,
                                         stdout=log, stderr=subprocess.STDOUT)
        self.log_path = log_path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_serving(self, timeout_s: float = 60.0) -> None:
        """Until its RolloutService is SERVING (some shard can take work)."""
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the router exited: {self.log_path.read_text()[-2000:]}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(service="rhymerl.v1.RolloutService"),
                                  timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("the router did not serve")
                time.sleep(0.1)

    def stop(self) -> None:
        stop_process(self.proc, 30)


def wait_announced(registry_url: str, shards: int, capacity: int, timeout_s: float = 60.0) -> None:
    """Until ``shards`` shards announce ``capacity`` slots each."""
    client = redis.Redis.from_url(registry_url)
    deadline, prefix = time.monotonic() + timeout_s, shard_prefix()
    try:
        while True:
            infos = [ShardInfo.decode(raw) for raw in client.mget(client.keys(prefix + "*") or [prefix]) if raw]
            if len(infos) == shards and all(i.capacity == capacity for i in infos):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"shards not announced: {infos}")
            time.sleep(0.2)
    finally:
        client.close()


def run_row(layout: str, num_shards: int, workers: int, samples: int, *, n: int, slots: int, response_tokens: int,
            per_process: int, settle_s: float, policy: str, step_timeout_s: float, log_dir: Path | None) -> dict:
    """``layout`` "direct" (one scheduler, no router) or "router" (num_shards shards behind it)."""
    if samples % n or workers % num_shards:
        raise ValueError("samples must be a multiple of n, workers of the shards")
    with tempfile.TemporaryDirectory(prefix="control-plane-shards-") as tmp:
        logs = log_dir or Path(tmp)
        registry = EmbeddedRedis().start() if layout == "router" else None
        scheds, fleets, router = [], [], None
        try:
            for i in range(num_shards):
                env = {} if registry is None else {"RHYMERL_SCHEDULER_SHARD_REGISTRY_URL": registry.url,
                                                   "RHYMERL_SCHEDULER_SHARD_ID": f"shard-{i}"}
                sched = SchedulerProcess(policy, logs / f"{layout}-{num_shards}-shard-{i}.log", env)
                scheds.append(sched)
            for i, sched in enumerate(scheds):
                sched.wait_serving()
                fleets.append(FakeFleet(FleetSpec(sched.address, workers // num_shards, slots=slots,
                                                  response_tokens=response_tokens, per_process=per_process,
                                                  prefix=f"s{i}")).start())
            for sched in scheds:
                sched.wait_workers(workers // num_shards, timeout_s=120 + workers / 8)
            address = scheds[0].address
            if registry is not None:
                wait_announced(registry.url, num_shards, workers // num_shards * slots)
                router = RouterProcess(registry.url, logs / f"router-{num_shards}.log")
                router.wait_serving()
                address = router.address
            time.sleep(settle_s)
            pids = [s.proc.pid for s in scheds] + ([router.proc.pid] if router else [])
            before = [cpu_seconds(p) for p in pids]
            started = time.perf_counter()
            stream = run_trainers(address, f"shards-{layout}-{num_shards}-{samples}", samples, 1, n,
                                  max_tokens=4 * response_tokens, timeout_s=step_timeout_s)
            wall = time.perf_counter() - started
            cpu = [cpu_seconds(p) - b for p, b in zip(pids, before)]
            rss = [peak_rss_mb(p) for p in pids]
        finally:
            if router is not None:
                router.stop()
            for fleet in fleets:
                fleet.stop()
            for sched in scheds:
                sched.stop()
            if registry is not None:
                registry.stop()
    delivered = max(1, len(stream.keys))
    shard_cpu = cpu[:num_shards]
    per_1k = [1e6 * c / delivered for c in shard_cpu]
    row = {
        "layout": f"{num_shards} shard{'s' * (num_shards > 1)} + router" if router else "direct (no router)",
        "shards": num_shards, "router": router is not None, "workers": workers, "samples": samples, "n": n,
        "slots": slots, "response_tokens": response_tokens, "policy": policy,
        "delivered": len(stream.keys), "lost": samples - len(stream.keys), "duplicated": stream.duplicated,
        "aborted": stream.aborted, "summary": stream.summary is not None, "error": stream.error,
        "wall_s": wall, "samples_per_s": len(stream.keys) / wall,
        "router_cpu_s": cpu[-1] if router else None,
        "router_cpu_ms_per_1k": 1e6 * cpu[-1] / delivered if router else float("nan"),
        "router_peak_rss_mb": rss[-1] if router else float("nan"),
        "shard_cpu_s": shard_cpu, "shard_cpu_ms_per_1k": per_1k, "schedulers_cpu_ms_per_1k": sum(per_1k),
        "shard_peak_rss_mb": rss[:num_shards], "load_average_after": list(os.getloadavg()),
    }
    row["shard_cpu_cell"] = " / ".join(f"{v:.0f}" for v in per_1k)
    row["shard_rss_cell"] = " / ".join(f"{v:.0f}" for v in rss[:num_shards])
    row["load_1m"] = row["load_average_after"][0]
    return row


SECTION = "## Scheduler shards behind the step router"


def markdown_section(shards: dict) -> str:
    """The ``"shards"`` part of control_plane.md."""
    return (f"\n{SECTION}\n\n`{shards['command']}` at {shards['commit']} on {shards['device']}\n\n"
            f"{shards['note']}\n\n{markdown_table(shards['rows'], COLUMNS)}\n")


def write_into(shards: dict, out: Path, name: str) -> None:
    """``shards`` as the ``"shards"`` key of <out>/<name>.json, the rest of the file as it
    was, and as the last section of <name>.md (replacing the one there)."""
    out.mkdir(parents=True, exist_ok=True)
    path, md = out / f"{name}.json", out / f"{name}.md"
    result = json.loads(path.read_text()) if path.exists() else {}
    result["shards"] = shards
    path.write_text(json.dumps(result, indent=2) + "\n")
    text = md.read_text() if md.exists() else "# Control plane\n"
    md.write_text(text.split("\n" + SECTION)[0].rstrip("\n") + "\n" + markdown_section(shards))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=128, help="fake workers in all (split over the shards)")
    parser.add_argument("--samples", default="16384,65536", help="samples in the step, comma-separated")
    parser.add_argument("--shards", default="1,2", help="shard counts behind the router, comma-separated")
    parser.add_argument("--no-direct", action="store_true", help="skip the one-scheduler row without a router")
    parser.add_argument("--policy", default="rhymerl")
    parser.add_argument("--n", type=int, default=16, help="samples per prompt")
    parser.add_argument("--slots", type=int, default=256, help="max_num_seqs each fake worker registers")
    parser.add_argument("--response-tokens", type=int, default=16)
    parser.add_argument("--per-process", type=int, default=64, help="fake workers per process")
    parser.add_argument("--settle-s", type=float, default=3.0, help="idle seconds before the step")
    parser.add_argument("--step-timeout-s", type=float, default=1800.0)
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the processes' logs here")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--out-name", default="control_plane",
                        help="the control-plane results whose \"shards\" key these rows go into")
    args = parser.parse_args(argv)
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    layouts = [] if args.no_direct else [("direct", 1)]
    layouts += [("router", int(k)) for k in args.shards.split(",")]
    rows = []
    for samples, (layout, shards) in itertools.product([int(s) for s in args.samples.split(",")], layouts):
        row = run_row(layout, shards, args.workers, samples, n=args.n, slots=args.slots,
                      response_tokens=args.response_tokens, per_process=args.per_process, settle_s=args.settle_s,
                      policy=args.policy, step_timeout_s=args.step_timeout_s, log_dir=args.log_dir)
        rows.append(row)
        print(markdown_table([row], COLUMNS).splitlines()[-1], flush=True)
    load = os.getloadavg()
    result = {
        "rows": rows,
        "note": (f"{os.cpu_count()} cores shared by every scheduler, the router, {args.per_process} fake workers per "
                 f"process, the trainer (and other work on the machine: load average {load[0]:.1f} at the end): "
                 "CPU-seconds per process are the honest figure; samples/s is a lower bound. Each shard's CPU is "
                 "over the samples of the whole step (so the shards' figures add up to the schedulers' total)."),
        "load_average": load,
        "command": " ".join(["python -m benchmarks.control_plane_shards", *(sys.argv[1:] if argv is None else argv)]),
        "commit": git_commit(".", ":(exclude)benchmarks/results"), "device": f"CPU: {cpu_name()}",
    }
    print(markdown_table(rows, COLUMNS))
    write_into(result, args.out, args.out_name)
    return result


if __name__ == "__main__":
    out = main()
    sys.exit(0 if all(r["lost"] == 0 and r["duplicated"] == 0 and not r["error"] for r in out["rows"]) else 1)
