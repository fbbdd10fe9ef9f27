"""scheduler_bench's live rows: every policy on real CPU (or GPU) workers in one process."""

from __future__ import annotations

import time
from pathlib import Path


def live_rows(args, policies: list[str]) -> list[dict]:
    """Each policy on the in-process cluster (tests/e2e/cluster.py): ``--live-workers`` CPU
    workers with the tiny random model, a real redis-server, loopback gRPC. Per policy a
    fresh cluster runs two steps of the same prompts with different seeds; the first
    fills the history service, the second (epoch 1, history available) is reported from
    its StepSummary (the scheduler's own StepTimeline)."""
    import os
    import tempfile

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from rhymerl import Prompt, RolloutClient, SamplingParams

    from services.common.redis_server import EmbeddedRedis
    from tests.e2e.cluster import Cluster, save_tiny_model

    prompts = [Prompt(f"p{i}", [2 + (7 * i + 3 * j) % 90 for j in range(6)]) for i in range(args.live_prompts)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="sched-live-") as tmp, EmbeddedRedis() as redis:
        model_dir = save_tiny_model(Path(tmp) / "tiny")
        for policy in policies:
            cluster = Cluster(model_dir=model_dir, redis_url=redis.url, num_workers=args.live_workers,
                              policy=policy, chunk_tokens=args.live_chunk, speculative=False,
                              device=args.live_device).start()
            try:
                with RolloutClient(cluster.address, timeout_s=600) as client:
                    for epoch in range(2):
                        sampling = SamplingParams(temperature=1.0, max_tokens=args.live_max_tokens, seed=1 + epoch)
                        started = time.perf_counter()
                        result = client.rollout(f"{policy}-e{epoch}", prompts, n=args.n_live, sampling=sampling)
                        wall = time.perf_counter() - started
            finally:
                cluster.stop()
            s = result.summary
            lengths = sorted(len(x.token_ids) for x in result.samples)
            median = lengths[len(lengths) // 2]
            heavy = lengths[-1] >= 20 * median
            rows.append({"policy": policy, "workers": args.live_workers,
                         "workload": "heavy_tail" if heavy else "tiny_model", "mode": "live",
                         "makespan_s": s.makespan_s, "bubble_ratio": s.bubble_ratio, "tail_s": s.tail_time_s,
                         "samples": len(result.samples), "migrations": s.num_migrations, "wall_s": wall,
                         "median_len": median, "max_len": lengths[-1],
                         "generated_tokens": s.num_generated_tokens, "seeds": 1})
            print(f"live {policy}: makespan {s.makespan_s:.2f} s, bubble {s.bubble_ratio:.3f}, "
                  f"tail {s.tail_time_s:.2f} s, {len(result.samples)} samples (median {median}, max "
                  f"{lengths[-1]} tokens)", flush=True)
    return rows
