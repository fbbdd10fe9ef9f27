"""The scheduler's hand-made protobuf encodings against protobuf's own, and the per-prompt
seed derivation against the per-sample one: the fast paths (no loop for one-, two- and
nine-byte varints; a prompt's seeds from one hashed prefix) must give the same bytes and
the same seeds as the general code."""

from __future__ import annotations

import random

import pytest
from rhymerl.v1 import common_pb2

from services.common import packed
from services.common.ids import sample_seed, sample_seeds


def _boundaries() -> list[int]:
    """Every varint size's first and last value, and their neighbours (0 to 2^64 - 1)."""
    values = {0, 1, 2**64 - 1, 2**64 - 2}
    for bits in range(7, 64, 7):
        values |= {2**bits - 2, 2**bits - 1, 2**bits, 2**bits + 1}
    values |= {2**63 - 1, 2**63, 2**56 - 1, 2**56}  # around the nine-byte (63-bit seed) path
    return sorted(values)


def _random_values() -> list[int]:
    rng = random.Random(31)
    return [rng.getrandbits(bits) for bits in range(1, 65) for _ in range(20)]


@pytest.mark.parametrize("values", [_boundaries(), _random_values()], ids=["boundaries", "random"])
def test_varints_are_protobufs_own(values):
    for n in values:
        # SamplingParams.seed is field 6, uint64: its key 0x30, then protobuf's varint of n
        expected = common_pb2.SamplingParams(seed=n).SerializeToString()
        assert b"\x30" + packed.varint(n) == expected, n
        assert packed.read_varint(packed.varint(n)) == n


def test_a_truncated_varint_is_refused():
    with pytest.raises(ValueError, match="not a whole varint"):
        packed.read_varint(packed.varint(2**40)[:-1])


@pytest.mark.parametrize("number", [1, 2, 9, 15, 16, 300])
@pytest.mark.parametrize("size", [1, 127, 128, 16_383, 16_384])
def test_length_delimited_fields_are_protobufs_own(number, size):
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    key = packed.varint(number << 3 | 2)
    assert packed.field(number, payload) == key + packed.varint(size) + payload
    assert packed.header(number, size) == key + packed.varint(size)
    assert packed.field(number, b"") == b""
    if number == 1:  # as protobuf writes a string field 1 (Prompt.prompt_id)
        assert packed.field(1, b"x" * size) == common_pb2.Prompt(prompt_id="x" * size).SerializeToString()


@pytest.mark.parametrize("step_seed", [None, 0, 1, 2**64 - 1])
def test_a_prompts_seeds_are_its_samples_seeds(step_seed):
    for step_id, prompt_id in [("step-a", "p0"), ("x:y", "é/1:2")]:
        assert sample_seeds(step_seed, step_id, prompt_id, 33) == [
            sample_seed(step_seed, step_id, prompt_id, k) for k in range(33)]


def test_seeds_are_what_they_always_were():
    """Pinned: a changed derivation would change every sample of every re-run step."""
    assert sample_seeds(1, "step-a", "p0", 16)[::15] == [8821235516785756605, 3267960237421979581]
    assert sample_seed(None, "step-a", "p0", 3) == 8927055582713361698
    assert sample_seed(2**64 - 1, "x", "é/1", 7) == 4087926543693849309


def test_ids_with_colons_never_share_a_samples_noise():
    """Step and prompt ids may hold ":": ("run:1", "p") and ("run", "1:p") drew the same
    noise for their samples when no seed was set, and a step id with ":" must not fall on
    one without (the key every release made for those stays, pinned above)."""
    pairs = [("run:1", "p"), ("run", "1:p"), ("5", "run:1:p"), ("run:1:p", ""), ("r", "un:1:p"),
             ("step/5", "run:1:p"), ("7", "run:1:p")]
    for index in (0, 12):
        seeds = [sample_seed(None, step_id, prompt_id, index) for step_id, prompt_id in pairs]
        assert len(set(seeds)) == len(pairs), list(zip(pairs, seeds))
