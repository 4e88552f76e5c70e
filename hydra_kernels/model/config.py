"""Llama-family model configuration, read from / written to HF ``config.json`` dicts."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Rope variants we implement exactly as transformers does (model/rope.py).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None for plain rope; else {"rope_type": "linear", "factor": f} or {"rope_type": "llama3", "factor": f,
    # "low_freq_factor": l, "high_freq_factor": h, "original_max_position_embeddings": n}.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict = field(default_factory=dict, repr=False)  # unknown HF keys, kept for round trips

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", "default")
            if kind not in SUPPORTED_ROPE_TYPES:
                raise NotImplementedError(
                    f"rope scaling type {kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
                )
            if kind == "default":
                self.rope_scaling = None

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    # ---- HF config.json ------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Parse an HF ``config.json`` dict (transformers 4.x and 5.x spellings)."""
        model_type = d.get("model_type")
        archs = d.get("architectures") or []
        if model_type != "llama" and not any(a.startswith("Llama") for a in archs):
            raise ValueError(
                f"not a Llama-family checkpoint: model_type={model_type!r}, architectures={archs}; "
                "hydra_kernels implements the Llama architecture (model_type 'llama') only"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (Llama uses 'silu')")
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(d.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or (rope if rope else None)
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.pop("rope_type", scaling.pop("type", "default"))
            scaling = {"rope_type": kind, **scaling} if kind != "default" else None
        known = {f.name for f in dataclasses.fields(cls)}
        hf_names = {
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
            "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias", "bos_token_id",
            "eos_token_id", "model_type", "architectures", "hidden_act",
        }
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or 0,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            # transformers' default for Llama is untied
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            extra={k: v for k, v in d.items() if k not in hf_names and k not in known},
        )

    def to_hf_dict(self, include_extra: bool = True) -> dict[str, Any]:
        """An HF ``config.json`` dict (4.x spelling, which transformers 5 also reads); include_extra
        keeps the unknown keys read from the original file."""
        d = dict(self.extra) if include_extra else {}
        d.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            hidden_act="silu",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.attention_bias,
            mlp_bias=self.mlp_bias,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
        )
        return d


# Real shapes, for benchmarks and GPU timing with random weights (timings do not depend on values).
NAMED_CONFIGS: dict[str, LlamaConfig] = {
    "smollm2-135m": LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    "llama-2-7b": LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
        num_kv_heads=32, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2,
    ),
    "llama-3-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
        bos_token_id=128000, eos_token_id=128009,
    ),
}
