"""ModelConfig: the decoder shape a checkpoint's config.json describes, as plain values.

Knows the config.json dialects of the Llama, Qwen2 and Qwen3 families (Hugging Face
transformers 4.x `rope_theta` + `rope_scaling`, 5.x `rope_parameters`) and nothing about
tensors, files or devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# architecture -> (HF class name, model_type)
_HF_NAMES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
_ARCHITECTURE_BY_HF_CLASS = {hf_class: arch for arch, (hf_class, _) in _HF_NAMES.items()}
_ARCHITECTURE_BY_MODEL_TYPE = {model_type: arch for arch, (_, model_type) in _HF_NAMES.items()}

# Values transformers assumes when config.json leaves a field out (per family).
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, "head_dim": None},
    "qwen2": {"max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None, "head_dim": None},
    "qwen3": {"max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None, "head_dim": 128},
}

SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")
# rope_type -> the keys its parameters need besides `factor`
_ROPE_SCALING_KEYS = {
    "linear": (),
    "llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # 'llama' | 'qwen2' | 'qwen3'
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; else {"rope_type": "linear" | "llama3", "factor": ..., (llama3 keys)}
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    # q/k/v projections carry a bias (Qwen2 always; Llama/Qwen3 also give o_proj one)
    attention_bias: bool
    # per-head RMSNorm on q and k before RoPE (Qwen3)
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: str  # 'bfloat16' | 'float16' | 'float32'

    def __post_init__(self) -> None:
        if self.architecture not in _HF_NAMES:
            raise ValueError(f"architecture: unsupported {self.architecture!r}, expected one of {sorted(_HF_NAMES)}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype: unsupported {self.dtype!r}, expected one of {SUPPORTED_DTYPES}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        if self.qk_norm != (self.architecture == "qwen3"):
            raise ValueError(f"qk_norm: {self.qk_norm} does not match architecture {self.architecture!r}")
        if self.architecture == "qwen2" and not self.attention_bias:
            raise ValueError("attention_bias: Qwen2 always has q/k/v biases")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling)

    @property
    def o_proj_bias(self) -> bool:
        """Llama and Qwen3 put attention_bias on o_proj too; Qwen2 never does."""
        return self.attention_bias and self.architecture != "qwen2"

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Builds the config from a config.json's contents.

        Raises:
            ValueError: naming the field, when the checkpoint uses something this decoder
                does not implement (another architecture, sliding windows, yarn RoPE, ...).
        """
        architecture = _architecture(hf)
        defaults = _HF_DEFAULTS[architecture]
        for name in _REQUIRED_FIELDS:
            if hf.get(name) is None:
                raise ValueError(f"{name}: missing from config.json")
        _reject_unsupported(hf)

        num_heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim")
        if head_dim is None:
            head_dim = defaults["head_dim"] or int(hf["hidden_size"]) // num_heads
        max_positions = int(hf.get("max_position_embeddings") or defaults["max_position_embeddings"])
        rope_theta, rope_scaling = _rope(hf, max_positions)
        eos = hf.get("eos_token_id", defaults["eos_token_id"])
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        return cls(
            architecture=architecture,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=True if architecture == "qwen2" else bool(hf.get("attention_bias", False)),
            qk_norm=architecture == "qwen3",
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id", defaults["bos_token_id"]),
            dtype=_dtype(hf),
        )

    def to_hf(self) -> dict:
        """A config.json that transformers 4.45+ and 5.x load as the same model.

        RoPE is written both ways: `rope_theta`/`rope_scaling` (read by 4.x, and by 5.x in
        preference) and 5.x's `rope_parameters`.
        """
        hf_class, model_type = _HF_NAMES[self.architecture]
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling or {})}
        eos: int | list[int] | None = list(self.eos_token_ids) or None
        if eos is not None and len(eos) == 1:
            eos = eos[0]
        hf = {
            "architectures": [hf_class],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": self.dtype,
            "dtype": self.dtype,
        }
        if self.architecture == "llama":
            hf["mlp_bias"] = False
        else:
            hf["use_sliding_window"] = False
        if self.architecture != "qwen2":
            hf["attention_bias"] = self.attention_bias
        return hf


def _architecture(hf: dict) -> str:
    architectures = hf.get("architectures") or []
    for hf_class in architectures:
        if hf_class in _ARCHITECTURE_BY_HF_CLASS:
            return _ARCHITECTURE_BY_HF_CLASS[hf_class]
    if architectures:
        raise ValueError(
            f"architectures: unsupported {architectures}, expected one of {sorted(_ARCHITECTURE_BY_HF_CLASS)}"
        )
    model_type = hf.get("model_type")
    if model_type in _ARCHITECTURE_BY_MODEL_TYPE:
        return _ARCHITECTURE_BY_MODEL_TYPE[model_type]
    raise ValueError(f"model_type: unsupported {model_type!r}, expected one of {sorted(_ARCHITECTURE_BY_MODEL_TYPE)}")


def _reject_unsupported(hf: dict) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: unsupported {hf['hidden_act']!r}, only 'silu' (SwiGLU)")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias: MLP biases are not supported")
    if hf.get("use_sliding_window"):
        raise ValueError("use_sliding_window: sliding-window attention is not supported")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor: partial RoPE is not supported")
    layer_types = hf.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError("layer_types: only 'full_attention' layers are supported")


def _rope(hf: dict, max_positions: int) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either dialect; plain RoPE scaling comes back as None."""
    parameters = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta") or parameters.get("rope_theta") or 10000.0
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    if rope_type not in _ROPE_SCALING_KEYS:
        raise ValueError(f"{field}: unsupported rope_type {rope_type!r}, expected one of {sorted(_ROPE_SCALING_KEYS)}")
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": parameters.get("factor")}
    for key in _ROPE_SCALING_KEYS[rope_type]:
        scaling[key] = parameters.get(key)
    if rope_type == "llama3" and scaling["original_max_position_embeddings"] is None:
        scaling["original_max_position_embeddings"] = max_positions
    missing = [key for key, value in scaling.items() if value is None]
    if missing:
        raise ValueError(f"{field}: {rope_type} RoPE needs {missing}")
    return float(theta), scaling


def _check_rope_scaling(scaling: dict) -> None:
    rope_type = scaling.get("rope_type")
    if rope_type not in _ROPE_SCALING_KEYS:
        raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r}, expected one of {sorted(_ROPE_SCALING_KEYS)}")
    missing = [key for key in ("factor", *_ROPE_SCALING_KEYS[rope_type]) if scaling.get(key) is None]
    if missing:
        raise ValueError(f"rope_scaling: {rope_type} RoPE needs {missing}")


def _dtype(hf: dict) -> str:
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"torch_dtype: unsupported {dtype!r}, expected one of {SUPPORTED_DTYPES}")
    return dtype
