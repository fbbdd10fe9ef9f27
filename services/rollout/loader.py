"""Hugging Face-format checkpoints <-> CausalLM.

A checkpoint is a directory with config.json and safetensors weights: one
model.safetensors, or shards listed by model.safetensors.index.json. This module knows
files and dtypes; what the tensors mean is CausalLM's business.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import safetensors.torch
import torch
from torch import Tensor

from services.common.errors import SettingError
from services.rollout.models.config import ModelConfig
from services.rollout.models.transformer import CausalLM

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of the checkpoint directory `path`.

    Stop tokens listed only in generation_config.json (chat models often end turns with a
    token that config.json does not name) are added to eos_token_ids.
    """
    path = Path(path)
    config_file = path / CONFIG_FILE
    try:
        config = ModelConfig.from_hf(json.loads(config_file.read_text()))
    except ValueError as exc:  # invalid JSON, or a field this decoder does not implement: name the file
        raise ValueError(f"{config_file}: {exc}") from exc
    generation_file = path / GENERATION_CONFIG_FILE
    if generation_file.exists():
        eos = json.loads(generation_file.read_text()).get("eos_token_id")
        extra = [] if eos is None else (eos if isinstance(eos, list) else [eos])
        eos_ids = tuple(dict.fromkeys([*config.eos_token_ids, *(int(e) for e in extra)]))
        config = dataclasses.replace(config, eos_token_ids=eos_ids)
    return config


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> CausalLM:
    """Builds the checkpoint's model on `device` in `dtype` (default: the config's dtype).

    Raises:
        FileNotFoundError: no config.json or no safetensors weights in `path`.
        ValueError: an unsupported config field, or a missing/mis-shaped/unknown tensor.
    """
    path = Path(path)
    config = read_config(path)
    if dtype is not None:
        config = dataclasses.replace(config, dtype=_dtype_name(dtype))
    model = _empty_model(config, device)
    model.load_weights(_read_checkpoint_tensors(path))
    return model


def worker_dtype(device: str | torch.device) -> torch.dtype | None:
    """The dtype a worker runs a checkpoint in by default: float32 on a CPU (bf16 matmuls
    are slow there), the checkpoint's own (None) on a GPU."""
    return torch.float32 if torch.device(device).type == "cpu" else None


def worker_device(device: str) -> torch.device:
    """The device a worker's ``device`` setting names: "auto" is CUDA when PyTorch sees a GPU,
    else the CPU. A CUDA device PyTorch cannot use (a CPU-only build, no GPU, an index past
    the last one) is a SettingError naming the setting, before anything loads on it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (resolved.index or 0) >= count:
            raise SettingError("device", f"device {device!r}: PyTorch sees {count} CUDA device(s) here "
                                         f"(torch {torch.__version__}); use cpu or auto")
    return resolved


def read_safetensors(source: str | Path | bytes) -> dict[str, Tensor]:
    """All tensors of one safetensors file, given as a path or as the file's bytes (on CPU)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return safetensors.torch.load(bytes(source))
    return safetensors.torch.load_file(str(source))


def save_model(model: CausalLM, path: str | Path, extra_config: dict | None = None) -> None:
    """Writes config.json and model.safetensors into the directory `path`.

    A tied lm_head is not written (it is the embedding). Each file is written under a
    temporary name and renamed, so a reader never sees half a file.

    Args:
        extra_config: keys merged into config.json (e.g. a policy version).

    Raises:
        FileExistsError: `path` holds a sharded checkpoint, whose index would shadow
            the new weights.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if (path / WEIGHTS_INDEX_FILE).exists():
        raise FileExistsError(f"{path / WEIGHTS_INDEX_FILE}: refusing to write a single-file checkpoint over a sharded one")
    # Copies: the fused layers' shards are views of one tensor, which safetensors refuses to write twice.
    tensors = {name: p.detach().to("cpu", copy=True).contiguous() for name, p in model.expected_weights().items()}
    hf = model.config.to_hf()
    weights_dtype = _dtype_name(model.model.embed_tokens.weight.dtype)
    hf["torch_dtype"] = hf["dtype"] = weights_dtype
    hf.update(extra_config or {})
    _write_atomically(path / WEIGHTS_FILE, lambda tmp: safetensors.torch.save_file(tensors, tmp, {"format": "pt"}))
    _write_atomically(path / CONFIG_FILE, lambda tmp: Path(tmp).write_text(json.dumps(hf, indent=2) + "\n"))


def init_random_model(config: ModelConfig, seed: int) -> CausalLM:
    """A CPU model in the config's dtype whose weights depend only on (config, seed).

    Matrices are N(0, 1/fan_in), so activations and logits stay O(1) at any width;
    biases are small and norm weights near 1 but not equal to it, so tests notice
    a bias or a norm that is skipped.
    """
    generator = torch.Generator().manual_seed(seed)
    model = _empty_model(dataclasses.replace(config, dtype="float32"), "cpu")
    with torch.no_grad():
        for name, param in model.expected_weights().items():  # by HF name: q/k/v drawn one by one
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.02 * noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[-1]))
    model.config = config
    return model.to(getattr(torch, config.dtype))


def _empty_model(config: ModelConfig, device: str | torch.device) -> CausalLM:
    """CausalLM in the config's dtype on `device`, weights uninitialised (skips the cost of
    a default init that loading overwrites anyway)."""
    with torch.device("meta"):
        model = CausalLM(config)
    model.to(dtype=getattr(torch, config.dtype))
    return model.to_empty(device=device)


def _read_checkpoint_tensors(path: Path) -> dict[str, Tensor]:
    index_file = path / WEIGHTS_INDEX_FILE
    if index_file.exists():
        files = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
        paths = [path / name for name in files]
    else:
        paths = sorted(path.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    tensors: dict[str, Tensor] = {}
    for file in paths:
        try:
            tensors.update(read_safetensors(file))
        except safetensors.SafetensorError as exc:  # truncated or not safetensors: name the file
            raise ValueError(f"{file}: {exc}") from exc
    return tensors


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _write_atomically(target: Path, write) -> None:
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        write(str(tmp))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
