"""EngineStats: what vLLM's scheduler reports each step (queue, KV cache use, its own
speculative-decoding counts), kept for the worker's metrics and the benchmark.

vLLM sends these scheduler stats with every step's outputs, in-process or from its
engine-core process alike, to the stat loggers it is given; this is one of them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    # vLLM's own speculative-decoding counts since start (any proposer: ngram, suffix, ours)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # tokens of the last step (vLLM's iteration stats), for the worker's rhymerl:* series
    step_prompt_tokens: int = 0
    step_generation_tokens: int = 0
    step_spec: object = None  # the last step's vLLM SpecDecodingStats (None: no drafts verified)

    def logger_factory(self):
        """A vLLM StatLoggerFactory whose loggers write into this object."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self

        class _Recorder(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                stats.step_spec = None
                if scheduler_stats is not None:
                    stats.update(scheduler_stats)
                stats.step_prompt_tokens = iteration_stats.num_prompt_tokens if iteration_stats else 0
                stats.step_generation_tokens = iteration_stats.num_generation_tokens if iteration_stats else 0

            def log_engine_initialized(self):
                pass

        return _Recorder

    def update(self, s) -> None:
        self.num_running = s.num_running_reqs
        self.num_waiting = s.num_waiting_reqs + s.num_skipped_waiting_reqs
        self.kv_cache_usage = float(s.kv_cache_usage)
        spec = s.spec_decoding_stats
        self.step_spec = spec
        if spec is not None:
            self.num_drafts += spec.num_drafts
            self.num_draft_tokens += spec.num_draft_tokens
            self.num_accepted_tokens += spec.num_accepted_tokens
