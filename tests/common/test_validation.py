"""The request checks every boundary shares (services/common/validation.py)."""

import numpy as np
import pytest

from services.common.errors import InvalidArgument
from rhymerl.v1 import common_pb2

from services.common.validation import MAX_STOP_TOKEN_IDS, check_length, check_sampling, check_sampling_values


@pytest.mark.parametrize("kw,field", [
    (dict(temperature=float("nan")), "sampling.temperature"),
    (dict(temperature=-0.1), "sampling.temperature"),
    (dict(temperature=1e-38), "sampling.temperature"),  # logits / T overflows: NaN logprobs
    (dict(temperature=9e-6), "sampling.temperature"),
    (dict(top_p=1.5), "sampling.top_p"),
    (dict(top_k=-1), "sampling.top_k"),
    (dict(min_p=-0.1), "sampling.min_p"),
    (dict(max_tokens=0), "sampling.max_tokens"),
    (dict(min_tokens=9), "sampling.min_tokens"),
])
def test_each_out_of_range_value_names_its_field(kw, field):
    args = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=8, min_tokens=0) | kw
    with pytest.raises(InvalidArgument, match=f"^{field}: ") as err:
        check_sampling_values(**args)
    assert err.value.field == field and isinstance(err.value, ValueError)


def test_greedy_and_the_smallest_sampled_temperature_pass():
    for temperature in (0.0, 1e-5, float(np.float32(1e-5)), 1.0, 100.0):  # (1e-5 as a proto's float32 too)
        check_sampling_values(temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, max_tokens=8, min_tokens=0)


def test_length_names_the_prompt_when_it_leaves_no_room_else_max_tokens():
    check_length(10, 6, 16, "p", "m")
    check_length(10, 6, 0, "p", "m")  # unknown maximum: not checked
    with pytest.raises(InvalidArgument, match="^p: "):
        check_length(16, 1, 16, "p", "m")
    with pytest.raises(InvalidArgument, match="^m: "):
        check_length(10, 7, 16, "p", "m")


def test_stop_tokens_masking_the_whole_vocabulary_before_min_tokens_are_refused():
    """Before min_tokens every stop token is out of the distribution: stop tokens covering
    the whole vocabulary left nothing to sample (token 0 came back, its logprob NaN)."""
    every = list(range(46))
    with pytest.raises(InvalidArgument, match="^sampling.stop_token_ids: .*nothing is left to sample"):
        check_sampling(common_pb2.SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=every), vocab_size=46)
    check_sampling(common_pb2.SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=every[1:]), vocab_size=46)
    check_sampling(common_pb2.SamplingParams(max_tokens=4, min_tokens=0, stop_token_ids=every), vocab_size=46)
    check_sampling(common_pb2.SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=every), vocab_size=0)


def test_stop_tokens_are_bounded_as_every_chunk_of_every_sample_carries_them():
    """An unbounded list was copied into every WorkItem: a 600 KB list made a step of 16
    short samples move 115 MB to the workers."""
    check_sampling(common_pb2.SamplingParams(max_tokens=4, stop_token_ids=[3] * MAX_STOP_TOKEN_IDS), vocab_size=46)
    with pytest.raises(InvalidArgument, match=f"^sampling.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} "):
        check_sampling(common_pb2.SamplingParams(max_tokens=4, stop_token_ids=[3] * (MAX_STOP_TOKEN_IDS + 1)))
