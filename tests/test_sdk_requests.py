"""The SDK's requests: a value the wire message cannot hold fails in the trainer's process
naming the field it was given for, as the service's statuses name theirs (it once
raised protobuf's bare "Value out of range: -1" or "bad argument type for built-in
operation", naming nothing)."""

import re

import numpy as np
import pytest
from rhymerl import Prompt, SamplingParams
from rhymerl._calls import step_request


@pytest.mark.parametrize("prompts, n, sampling, error, field", [
    ([Prompt("a", [1, 2])], 1, SamplingParams(seed=-1), ValueError, "sampling.seed"),
    ([Prompt("a", [1, 2])], 1, SamplingParams(seed=2**64), ValueError, "sampling.seed"),
    ([Prompt("a", [1, 2])], 1, SamplingParams(max_tokens=1e3), TypeError, "sampling.max_tokens"),
    ([Prompt("a", [1, 2])], 1, SamplingParams(stop_token_ids=(5, 2**31)), ValueError, "sampling.stop_token_ids"),
    ([Prompt("a", [1, 2]), Prompt("b", [1, 2**31])], 1, SamplingParams(), ValueError, "prompts[1].token_ids"),
    ([Prompt(7, [1, 2])], 1, SamplingParams(), TypeError, "prompts[0].prompt_id"),
    ([Prompt("a", [1, 2])], 2.0, SamplingParams(), TypeError, "n"),
])
def test_a_value_the_request_cannot_hold_names_its_field(prompts, n, sampling, error, field):
    with pytest.raises(error, match="^" + re.escape(field) + ": "):
        step_request("s", prompts, n, sampling, 0)


def test_good_values_of_other_types_still_convert():
    request = step_request("s", [Prompt("", np.array([1, 2], dtype=np.int64))], np.int64(2),
                           SamplingParams(seed=2**64 - 1, stop_token_ids=[3]), 0)
    assert (request.n, list(request.prompts[0].token_ids), request.sampling.seed) == (2, [1, 2], 2**64 - 1)
    assert request.prompts[0].prompt_id.startswith("h") and list(request.sampling.stop_token_ids) == [3]


# --- Arguments of the wrong kind: a TypeError / ValueError naming the argument, raised in
# the trainer's process before any call (they were AttributeErrors about ``to_proto``,
# bare unpacking errors, gRPC's UNKNOWN "Exception iterating requests!", or, for a
# timeout_s <= 0, every call failing DEADLINE_EXCEEDED and re-sent for two minutes).

@pytest.mark.parametrize("prompts, sampling, field", [
    ([[1, 2, 3]], SamplingParams(), "prompts[0]"),  # token ids where a Prompt goes
    ("1 2 3", SamplingParams(), "prompts"),
    (None, SamplingParams(), "prompts"),
    ([Prompt("a", [1, 2])], {"temperature": 0}, "sampling"),
    ([Prompt("a", [1, 2])], None, "sampling"),
    ([Prompt("a", [1, 2])], SamplingParams(stop_token_ids=2), "sampling.stop_token_ids"),
])
def test_an_argument_of_the_wrong_kind_is_a_type_error_naming_it(prompts, sampling, field):
    with pytest.raises(TypeError, match="^" + re.escape(field) + ": must be "):
        step_request("s", prompts, 1, sampling, 0)


@pytest.mark.parametrize("kwargs, field", [
    (dict(timeout_s=0), "timeout_s"), (dict(timeout_s=-1), "timeout_s"), (dict(timeout_s=float("nan")), "timeout_s"),
    (dict(push_timeout_s=float("inf")), "push_timeout_s"), (dict(retry_window_s=-5), "retry_window_s"),
    (dict(max_retries=-1), "max_retries"), (dict(address=None), "address"),
])
def test_client_settings_that_would_fail_every_call_are_refused_where_the_client_is_made(kwargs, field):
    from rhymerl import AsyncRolloutClient, RolloutClient

    kwargs = {"address": "127.0.0.1:1", **kwargs}
    for cls in (RolloutClient, AsyncRolloutClient):
        with pytest.raises((ValueError, TypeError), match="^" + re.escape(field) + ": "):
            cls(**kwargs)


def test_rewards_logprobs_and_weights_of_the_wrong_kind_name_the_argument():
    from pathlib import Path

    from rhymerl import RolloutClient
    from rhymerl._calls import load_request, logprobs_request, rewards_request

    with pytest.raises(TypeError, match=r"^rewards\[1\]: must be \(prompt_id, sample_index, reward\)"):
        rewards_request("s", [("a", 0, 1.0), ("a", 1)])
    with pytest.raises(TypeError, match=r"^rewards\[0\]\.reward: must be a number"):
        rewards_request("s", [("a", 0, "1.0")])
    with pytest.raises(TypeError, match=r"^samples\[0\]\.logprobs: must be a sequence of numbers"):
        logprobs_request("s", [("a", 0, None)])
    assert rewards_request("s", [("a", np.int64(1), np.float32(0.5))]).rewards[0].reward == 0.5
    assert load_request(3, Path("/ckpt/model.safetensors")).path == "/ckpt/model.safetensors"
    with RolloutClient("127.0.0.1:1", max_retries=0) as client:  # nothing listens: raised before any call
        with pytest.raises(TypeError, match="^version: "):
            client.push_weights("1", b"payload")
        with pytest.raises(TypeError, match="^data: must be the safetensors payload as bytes"):
            client.push_weights(1, "payload")
