"""The task tokenizer: exact round trips, fixed special ids, and loadable by HF AutoTokenizer."""

from __future__ import annotations

from benchmarks.tiny_llm.examples import load_example
from benchmarks.tiny_llm.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, build_tokenizer, save_tokenizer

task = load_example("reasoning_task")


def test_round_trip_over_the_task():
    """decode(encode(text)) == text for every prompt and worked answer; no <unk>."""
    tokenizer = build_tokenizer()
    for problem in task.make_prompts(200, seed=0):
        text = problem.prompt + task.worked_answer(problem)
        ids = tokenizer.encode(text).ids
        assert ids[0] == BOS_ID and UNK_ID not in ids
        assert tokenizer.decode(ids) == text


def test_vocabulary_is_small_and_fixed():
    """Special ids are fixed (checkpoints' config.json names them); digits are single tokens."""
    tokenizer = build_tokenizer()
    assert tokenizer.get_vocab_size() < 64
    assert [tokenizer.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>", "<unk>")] == [PAD_ID, BOS_ID, EOS_ID, UNK_ID]
    assert tokenizer.encode("add 478 + 95\n", add_special_tokens=False).tokens == [
        "add", " ", "4", "7", "8", " ", "+", " ", "9", "5", "\n",
    ]
    assert build_tokenizer().to_str() == tokenizer.to_str()


def test_saved_tokenizer_loads_in_hf_autotokenizer(tmp_path):
    """What a trainer (veRL, TRL) does with the checkpoint directory gives the same ids."""
    from transformers import AutoTokenizer

    save_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    text = "gcd 84 36\n84 = 2 * 36 + 12\n"
    ids = hf(text).input_ids
    assert ids == build_tokenizer().encode(text).ids
    assert hf.decode(ids, skip_special_tokens=True) == text
