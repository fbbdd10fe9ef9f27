"""VllmEngine: vLLM's V1 LLMEngine with the interface EngineLoop and WorkerServicer
drive (add_request, step, abort, reset, load_weights, counters), so the worker,
its chunks, seeds, stops, per-item errors, drain and metrics stay the same.

Samples as rhymerl defines them: every chunk is one vLLM request with n=1 and
its own seed, derived from the sample's seed and the chunk's start position, so
a chunk resumed on another worker (prompt + partial output re-prefilled) draws
exactly what it would have drawn here. See docs/vllm.md for what vLLM does and
does not guarantee bit for bit.
"""

from __future__ import annotations

import hashlib
import logging
import time
import types
from dataclasses import dataclass, field

from services.rollout.engine.metrics import EngineMetrics
from services.rollout.engine.request import EngineRequest, RequestOutput
from services.rollout.vllm_engine.proposer import Registration, call
from services.rollout.vllm_engine.stats import EngineStats

log = logging.getLogger(__name__)


def chunk_seed(seed: int, num_generated: int) -> int:
    """The vLLM seed of the chunk starting after ``num_generated`` tokens."""
    if num_generated == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{num_generated}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def check_logprobs_mode(req: EngineRequest, vocab_size: int) -> None:
    """Refuse logprobs this engine cannot return as rhymerl defines them.

    vLLM's logprobs mode is engine-wide, and its "raw" ignores the temperature, so the
    engine runs in "processed_logprobs": log softmax(logits / T) after min_p, then
    top-k, then top-p (stop tokens masked before min_tokens, as ours). With no filter
    that is rhymerl's raw and processed alike; with filters it is processed, except
    that vLLM applies min_p before top-k/top-p and rhymerl after.
    """
    if not req.logprobs:
        return
    topk = 0 < req.top_k < vocab_size
    topp = req.top_p < 1.0
    filtered = topk or topp or req.min_p > 0
    if req.temperature == 0:
        # greedy: T' = 1; vLLM returns log softmax(logits) over the whole vocabulary (it
        # samples greedy requests without the filters): rhymerl's raw, not its processed
        if req.logprobs_mode == "processed" and filtered:
            raise ValueError("logprobs_mode: processed logprobs of greedy samples with top_k / top_p / min_p are "
                             "not available on a vLLM worker (it returns them over the whole vocabulary); ask "
                             "for raw or drop the filters")
        return
    if req.logprobs_mode == "raw" and filtered:
        raise ValueError("logprobs_mode: raw logprobs with top_k / top_p / min_p are not available on a vLLM "
                         "worker (its logprobs mode is engine-wide); ask for processed or drop the filters")
    if req.logprobs_mode == "processed" and req.min_p > 0 and (topk or topp):
        raise ValueError("logprobs_mode: processed logprobs with min_p and top_k / top_p are not available on a "
                         "vLLM worker (it applies min_p first, rhymerl last)")
    if req.logprobs_mode not in ("raw", "processed"):
        raise ValueError(f"logprobs_mode: {req.logprobs_mode!r} is not one of ('raw', 'processed')")


# vLLM's SamplingParams raises any temperature in (0, 0.01) to 0.01 (vllm.sampling_params._MAX_TEMP)
MIN_VLLM_TEMPERATURE = 1e-2


def check_temperature(req: EngineRequest) -> None:
    """Refuse a temperature vLLM would not sample at: below 0.01 (greedy, 0, aside) its
    SamplingParams silently samples at 0.01 instead, and returns logprobs at 0.01. 0.01 itself
    passes as the wire's float32 gives it (0.0099999998), which vLLM raises by a rounding error."""
    if 0 < req.temperature < MIN_VLLM_TEMPERATURE * (1 - 1e-6):
        raise ValueError(f"temperature: {req.temperature:g} is below {MIN_VLLM_TEMPERATURE:g}, which a vLLM worker "
                         f"samples at {MIN_VLLM_TEMPERATURE:g} (vLLM raises it); ask for 0 (greedy) or at least "
                         f"{MIN_VLLM_TEMPERATURE:g}")


@dataclass
class _Running:
    req: EngineRequest
    vllm_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class VllmEngine:
    def __init__(self, llm_engine, *, speculative: bool, eos_token_ids: frozenset[int], max_model_len: int,
                 stats: EngineStats | None = None,
                 weight_specs: dict[str, tuple[tuple[int, ...], str]] | None = None,
                 worker_id: str = "vllm"):
        self.llm = llm_engine
        self.stats = stats or EngineStats()  # filled by vLLM's scheduler stats each step
        hf = llm_engine.model_config.hf_config
        self.model = types.SimpleNamespace(config=hf)  # what the servicer reads: vocab, max length
        self.max_model_len = max_model_len
        self.weight_specs = weight_specs or {}  # name: (shape, safetensors dtype), the starting checkpoint's
        self.metrics = EngineMetrics(worker_id)  # the same rhymerl:* series as the native engine
        self.eos_token_ids = eos_token_ids
        self.speculative = speculative
        self._running: dict[str, _Running] = {}
        self._aborted: list[RequestOutput] = []
        self.drafter = _RemoteDrafter(llm_engine) if speculative else None
        if self.drafter is not None:
            self.drafter.attached = bool(self._rpc("attach")[0])

    def _rpc(self, method: str, *args):
        return self.llm.collective_rpc(call, args=(method, *args))

    # --- requests ------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if req.request_id in self._running:
            raise ValueError(f"request_id: {req.request_id!r} is already in the engine")
        context = list(req.prompt_token_ids) + list(req.generated_token_ids)
        if len(context) + req.max_new_tokens > self.max_model_len:
            raise ValueError(f"max_new_tokens: the chunk would pass the maximum length {self.max_model_len}")
        check_temperature(req)
        check_logprobs_mode(req, self.model.config.vocab_size)
        stops = set(req.stop_token_ids) | (set() if req.ignore_eos else set(self.eos_token_ids))
        # The sample's min_tokens left after its earlier chunks, at most this chunk's budget: vLLM
        # refuses min_tokens > max_tokens (VLLMValidationError, every sample of a step whose
        # min_tokens exceeds the chunk aborted), and masking the whole chunk is what it means.
        min_tokens = min(max(0, req.min_tokens - len(req.generated_token_ids)), req.max_new_tokens)
        params = SamplingParams(
            n=1, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            seed=chunk_seed(req.seed, len(req.generated_token_ids)), max_tokens=req.max_new_tokens,
            min_tokens=min_tokens, stop_token_ids=sorted(stops),
            ignore_eos=req.ignore_eos, logprobs=0 if req.logprobs else None, detokenize=False,
            output_kind=RequestOutputKind.CUMULATIVE)
        vllm_id = self.llm.add_request(req.request_id, {"prompt_token_ids": context}, params)
        self._running[req.request_id] = _Running(req, vllm_id)
        if self.drafter is not None:
            self._rpc("register", vllm_id, Registration(req.prompt_id, len(req.prompt_token_ids),
                                                        len(context) + req.max_new_tokens, frozenset(stops)))

    def abort(self, request_id: str) -> bool:
        run = self._running.get(request_id)
        if run is None:
            return False
        self.llm.abort_request([run.vllm_id], internal=True)
        self._aborted.append(self._finish(run, "abort"))
        return True

    def reset(self) -> list[str]:
        dropped = list(self._running)
        for rid in dropped:
            self.abort(rid)
        self._aborted = []
        return dropped

    def has_unfinished(self) -> bool:
        return bool(self._running) or bool(self._aborted)

    def num_running(self) -> int:
        return len(self._running)

    def num_waiting(self) -> int:
        return self.stats.num_waiting

    def kv_cache_usage(self) -> float:
        return self.stats.kv_cache_usage

    def load_weights(self, state_dict) -> None:
        """Between samples (the loop calls it while idle): vLLM's model takes HF names.

        vLLM loads whatever names it is given and keeps the rest, and converts whatever
        dtype it is given, so a push is checked whole against the starting checkpoint
        first: a partial one would mix versions, and an integer (or bool, or complex)
        tensor where the checkpoint has a floating-point one would be truncated into the
        weights. A floating-point push of another precision is converted, as rhymerl's
        engine does.
        """
        if self.weight_specs:
            specs = self.weight_specs
            missing = sorted(set(specs) - set(state_dict))
            unknown = sorted(set(state_dict) - set(specs))
            both = sorted(set(state_dict) & set(specs))
            bad = [n for n in both if tuple(state_dict[n].shape) != specs[n][0]]
            wrong = [f"{n} ({str(state_dict[n].dtype).removeprefix('torch.')}, expected {specs[n][1]})"
                     for n in both if not _dtype_fits(state_dict[n], specs[n][1])]
            if missing or unknown or bad or wrong:
                raise ValueError(f"weights do not match the model: missing {missing[:3]}, unknown {unknown[:3]}, "
                                 f"mis-shaped {bad[:3]}, wrong dtype {wrong[:3]}")
        self.llm.collective_rpc(_load_weights, args=(state_dict,))
        self.llm.reset_prefix_cache()

    # --- the loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        started = time.perf_counter()
        step_outputs = self.llm.step()
        st = self.stats
        self.metrics.on_step("prefill" if st.step_prompt_tokens else "decode", time.perf_counter() - started,
                             st.step_prompt_tokens, st.step_generation_tokens, st.num_running, st.num_waiting,
                             st.kv_cache_usage)
        if st.step_spec is not None:  # every proposer alike (ngram, suffix, ours): rhymerl:spec_decode_*
            spec = st.step_spec
            self.metrics.on_verifies(spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                                     list(spec.num_accepted_tokens_per_pos))
        for out in step_outputs:
            run = self._running.get(out.request_id)  # vLLM reports the id we passed, not its own
            if run is None:
                continue
            completion = out.outputs[0]
            run.token_ids = list(completion.token_ids)
            if run.req.logprobs and completion.logprobs is not None:
                run.logprobs = [float(lp[t].logprob) for t, lp in zip(run.token_ids, completion.logprobs)]
            if out.finished:
                outputs.append(self._finish(run, self._reason(run, completion.finish_reason)))
        return outputs

    def _reason(self, run: _Running, vllm_reason: str | None) -> str | None:
        if vllm_reason == "stop":
            return "stop"
        total = len(run.req.prompt_token_ids) + len(run.req.generated_token_ids) + len(run.token_ids)
        if len(run.req.generated_token_ids) + len(run.token_ids) >= run.req.max_tokens or total >= self.max_model_len:
            return "length"
        return None  # the chunk's budget is spent; the sample goes on elsewhere

    def _finish(self, run: _Running, reason: str | None) -> RequestOutput:
        self._running.pop(run.req.request_id, None)
        steps = drafts = accepted = 0
        if self.drafter is not None:
            steps, drafts, accepted = self._rpc("counters", run.vllm_id)[0] or (0, 0, 0)
        return RequestOutput(request_id=run.req.request_id, token_ids=run.token_ids,
                             logprobs=run.logprobs if run.req.logprobs else [], finish_reason=reason,
                             num_verify_steps=steps, num_draft_tokens=drafts, num_accepted_tokens=accepted)


class _RemoteDrafter:
    """What the servicer calls to load history: forwarded to the proposer's drafter."""

    def __init__(self, llm_engine):
        self.llm = llm_engine
        self.attached = False

    def load_history(self, prompt_id, responses, **kw) -> None:
        responses = [[int(t) for t in r] for r in responses]
        self.llm.collective_rpc(call, args=("load_history", prompt_id, responses), kwargs=kw)

    def release_prompt(self, prompt_id: str) -> None:
        self.llm.collective_rpc(call, args=("release_prompt", prompt_id))


def _dtype_fits(tensor, checkpoint_dtype: str) -> bool:
    """A floating-point tensor where the checkpoint's is floating point (F16, BF16, F32,
    F64, F8_*: converted on load), else the checkpoint's own dtype."""
    if checkpoint_dtype.startswith(("F", "BF")):
        return tensor.is_floating_point()
    return str(tensor.dtype).removeprefix("torch.") == _SAFETENSORS_DTYPES.get(checkpoint_dtype, checkpoint_dtype)


_SAFETENSORS_DTYPES = {"I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "U8": "uint8", "BOOL": "bool"}


def _load_weights(worker, state_dict) -> None:
    # vLLM's in-place reload: on the CPU, loading repacks linear layers into its kernels'
    # layout, which drops the loaders a plain model.load_weights would need a second time.
    worker.model_runner.reload_weights(weights_iterator=iter(state_dict.items()), is_checkpoint_format=True)
