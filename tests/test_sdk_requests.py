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
