"""Drafter configuration: which heads, how deep, how the LM head is held."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

KINDS = ("medusa", "hydra", "hydra++")


@dataclass
class DrafterConfig:
    num_heads: int
    num_layers: int  # ResBlocks per head
    hidden_size: int
    vocab_size: int
    grounded: bool = True  # Hydra: head d sees cat(h, E(root), E(x1..x_{d-1})); Medusa: h only
    prefix_layer: bool = False  # Hydra++: one extra decoder layer over the committed hidden states
    # The prefix layer's output: True (original Hydra++) RMS-normed, which rescales each token's h to unit
    # RMS; False: h plus what the layer adds (no final norm), so a fresh layer hands the heads exactly h.
    prefix_final_norm: bool = True
    lm_head: str = "tied"  # "tied" (the base model's LM head), "per_head", or "shared" (one for all heads)
    lm_head_bias: bool = False
    shared_resblocks: bool = False  # original checkpoints: a head's repeated ResBlocks are one module
    # Heads rank only these many token ids (the buffer `draft_vocab`, most frequent first) instead of the
    # whole vocabulary: the draft LM head reads Vd rows, not V. Verification still uses the full model,
    # so output stays exact; a token outside the subset just cannot be drafted. None: the whole vocab.
    draft_vocab_size: int | None = None
    base_config: dict | None = field(default=None, repr=False)  # HF dict of the base model (prefix layer)

    def __post_init__(self):
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError(f"num_heads and num_layers must be >= 1, got {self.num_heads}, {self.num_layers}")
        if self.lm_head not in ("tied", "per_head", "shared"):
            raise ValueError(f"lm_head must be 'tied', 'per_head' or 'shared', got {self.lm_head!r}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}")
        if self.prefix_layer and self.base_config is None:
            raise ValueError("a prefix layer needs the base model's config (base_config)")

    @property
    def kind(self) -> str:
        if self.grounded:
            return "hydra++" if self.prefix_layer else "hydra"
        return "medusa+prefix" if self.prefix_layer else "medusa"

    def to_dict(self) -> dict:
        return asdict(self)
