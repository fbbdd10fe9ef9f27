"""Checks of client input; each failure names the offending field.

Every rule lives here once: the scheduler's intake checks a step, the rollout worker a
work item, the engine an EngineRequest, all with these functions. What only one engine
refuses (vLLM's logprobs modes) stays with that engine.
"""

from __future__ import annotations

import math
import struct

from rhymerl.v1 import common_pb2

from services.common.errors import InvalidArgument

MAX_N = 4096
# Stop tokens a step may name. SamplingParams travels whole in every chunk of every sample
# (WorkItem.sampling), so an unbounded list was an amplifier: a 600 KB list made a step of
# 16 short samples move 115 MB to the workers and run 5x slower, every step beside it too.
MAX_STOP_TOKEN_IDS = 4096
# Step and prompt ids are copied into every sample, history key and step-log entry.
MAX_ID_BYTES = 256
# The smallest temperature sampled at (0 is greedy). Below it logits / T overflows float32
# (from about 1e-38 every logprob came back NaN); vLLM turns temperatures under the same
# 1e-5 into greedy decoding, which would leave a sample's logprobs unlike its T's: refused.
MIN_TEMPERATURE = 1e-5
_MIN_TEMPERATURE_F32 = struct.unpack("f", struct.pack("f", MIN_TEMPERATURE))[0]  # as SamplingParams' float carries it


def check_sampling(p: common_pb2.SamplingParams, field: str = "sampling", vocab_size: int = 0) -> None:
    """Raises InvalidArgument for out-of-range sampling parameters."""
    check_sampling_values(p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.min_tokens, field)
    if p.logprobs_mode not in common_pb2.LogprobsMode.values():
        raise InvalidArgument(f"unknown LogprobsMode {p.logprobs_mode}", f"{field}.logprobs_mode")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(f"at most {MAX_STOP_TOKEN_IDS} stop tokens, got {len(p.stop_token_ids)}",
                              f"{field}.stop_token_ids")
    check_token_ids(p.stop_token_ids, f"{field}.stop_token_ids", vocab_size, allow_empty=True)
    check_stops_leave_a_token(p.stop_token_ids, p.min_tokens, vocab_size, f"{field}.stop_token_ids")


def check_stops_leave_a_token(stop_token_ids, min_tokens: int, vocab_size: int, field: str) -> None:
    """Before min_tokens, stop tokens are out of the distribution (logits -inf): stop tokens
    covering every token of the vocabulary (0: unknown, not checked) would leave none to
    sample, and the sampler would return token 0 with a NaN logprob."""
    if min_tokens > 0 and vocab_size and len(set(stop_token_ids)) >= vocab_size:
        raise InvalidArgument(f"with min_tokens {min_tokens} > 0 stop tokens are masked until then, and these "
                              f"cover all {vocab_size} tokens of the vocabulary: nothing is left to sample", field)


def check_sampling_values(temperature: float, top_p: float, top_k: int, min_p: float, max_tokens: int,
                          min_tokens: int, field: str = "sampling") -> None:
    """The ranges of the sampling parameters, wherever they arrive from."""
    prefix = f"{field}." if field else ""
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidArgument(f"must be a finite number >= 0, got {temperature}", f"{prefix}temperature")
    if 0 < temperature < _MIN_TEMPERATURE_F32:
        raise InvalidArgument(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature:g}",
                              f"{prefix}temperature")
    if not 0.0 <= top_p <= 1.0:
        raise InvalidArgument(f"must be in [0, 1], got {top_p}", f"{prefix}top_p")
    if top_k < 0:
        raise InvalidArgument(f"must be >= 0, got {top_k}", f"{prefix}top_k")
    if not 0.0 <= min_p <= 1.0:
        raise InvalidArgument(f"must be in [0, 1], got {min_p}", f"{prefix}min_p")
    if max_tokens < 1:
        raise InvalidArgument(f"must be >= 1, got {max_tokens}", f"{prefix}max_tokens")
    if min_tokens < 0 or min_tokens > max_tokens:
        raise InvalidArgument(f"must be in [0, max_tokens], got {min_tokens}", f"{prefix}min_tokens")


def check_id(value: str, field: str) -> None:
    """A step or prompt id: non-empty, at most MAX_ID_BYTES bytes of UTF-8."""
    if not value:
        raise InvalidArgument("must be non-empty", field)
    size = len(value.encode())
    if size > MAX_ID_BYTES:
        raise InvalidArgument(f"must be at most {MAX_ID_BYTES} bytes, got {size}", field)


def check_host_port(value: str, field: str) -> None:
    """A gRPC address: host:port, the host non-empty and without spaces ("[::1]" for IPv6),
    the port in [1, 65535], at most MAX_ID_BYTES bytes in all."""
    check_id(value, field)
    host, _, port = value.rpartition(":")
    if not host or any(c.isspace() for c in host) or not (port.isascii() and port.isdigit()) \
            or not 1 <= int(port) <= 65535:
        raise InvalidArgument(f"must be host:port (a port in [1, 65535]), got {value!r}", field)
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise InvalidArgument(f"an IPv6 host must be in brackets ([::1]:port), got {value!r}", field)


def check_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int, prompt_field: str,
                 max_tokens_field: str) -> None:
    """A prompt and its max_tokens must fit the model's maximum length (0: unknown, not checked)."""
    if not max_model_len:
        return
    if num_prompt_tokens >= max_model_len:
        raise InvalidArgument(f"prompt length {num_prompt_tokens} leaves no room to generate within the model's "
                              f"maximum length {max_model_len}", prompt_field)
    if num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidArgument(f"prompt length {num_prompt_tokens} + max_tokens {max_tokens} exceeds the "
                              f"model's maximum length {max_model_len}", max_tokens_field)



def check_token_ids(ids, field: str, vocab_size: int = 0, allow_empty: bool = False) -> None:
    """Token ids must be non-empty (unless allowed) and in [0, vocab_size)."""
    if not ids and not allow_empty:
        raise InvalidArgument("must be non-empty", field)
    if not ids:
        return
    lo, hi = min(ids), max(ids)
    if lo < 0:
        raise InvalidArgument(f"token id {lo} is negative", field)
    if vocab_size and hi >= vocab_size:
        raise InvalidArgument(f"token id {hi} is out of range [0, {vocab_size})", field)
