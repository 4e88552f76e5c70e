"""Hydra++'s prefix layer: one Llama decoder layer (+ final norm, optional) run over the base model's
committed hidden states, with its own static KV buffer; its output at the last position is the heads' h."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..model.attention import AttentionSite
from ..model.config import LlamaConfig
from ..model.kv_cache import KVCache
from ..model.layers import RMSNorm, TransformerBlock
from ..model.llama import chunked_prefill
from ..model.rope import RopeCache


class PrefixLayer(nn.Module):
    def __init__(self, base_config: dict, final_norm: bool = True):
        """final_norm: True (the original Hydra++: a one-layer LlamaModel) normalises the output; False
        returns the residual stream h + attention + MLP, so a layer whose output projections are zero is
        exactly the identity and the heads keep h's per-token scale (the tied LM head's confidence)."""
        super().__init__()
        cfg = LlamaConfig.from_hf_dict(base_config)
        self.config = dataclasses.replace(cfg, num_layers=1)
        self.block = TransformerBlock(self.config)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if final_norm else torch.nn.Identity()
        self._rope = RopeCache(self.config)

    @torch.no_grad()
    def init_identity(self, model) -> None:
        """Start as (almost) the identity on the base hidden states: the base model's last layer's
        weights, but its two output projections (attention wo, MLP w2) zeroed, so the residual stream
        passes h through untouched; the final RMSNorm (weight 1), if any, only rescales each token's h,
        which keeps its direction (and the argmax of the tied LM head). The heads see h from the first
        training step; attention over the past is learned from there. Copying the last layer whole
        instead scrambles h at the start (measured: worse head-1 accuracy)."""
        self.block.load_state_dict(model.layers[-1].state_dict())
        self.block.attention.wo.weight.zero_()
        self.block.feed_forward.w2.weight.zero_()
        for b in (self.block.attention.wo.bias, self.block.feed_forward.w2.bias):
            if b is not None:
                b.zero_()
        if isinstance(self.norm, RMSNorm):
            self.norm.weight.fill_(1.0)

    def load_hf_layer(self, sd: dict[str, torch.Tensor]) -> None:
        """Weights of a one-layer transformers LlamaModel (the original Hydra++ prefix_embeding_layer.*,
        embed_tokens ignored) -> this layer and its final norm, strictly by name."""
        from ..model.hf_names import hf_to_ours

        hf = {"model." + k: v for k, v in sd.items() if not k.startswith("embed_tokens")}
        ours = hf_to_ours(self.config, {**hf, "model.embed_tokens.weight": torch.zeros(1)},
                          allow_missing={"tok_embeddings.weight", "output.weight"})
        self.block.load_state_dict({k[len("layers.0."):]: v for k, v in ours.items() if k.startswith("layers.0.")})
        self.norm.load_state_dict({"weight": ours["norm.weight"]})

    def check_model(self, model) -> None:
        a, b = self.config, model.config
        shape = lambda c: (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size)
        if shape(a) != shape(b):
            raise ValueError(f"the prefix layer's shape {shape(a)} (hidden, heads, kv heads, head_dim, "
                             f"intermediate) does not match the model's {shape(b)}")

    def new_cache(self, batch_size: int, max_seq_len: int, model) -> KVCache:
        return KVCache(self.config, batch_size, max_seq_len, dtype=model.dtype, device=model.device)

    def forward_full(self, x: torch.Tensor) -> torch.Tensor:
        """No cache (training): x [B, L, H] base hidden states of positions 0..L-1 -> normed outputs."""
        B, L, _ = x.shape
        pos = torch.arange(L, device=x.device).expand(B, L)
        cos, sin = self._rope(pos, L, x.dtype)
        return self.norm(self.block(x, cos, sin))

    def forward_at(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """No cache (training): x [B, L, H] base hidden states of positions 0..L-1, rows [B, m] positions
        -> outputs [B, m, H] at those positions, equal to forward_full(x)[b, rows[b]]. Keys and values are
        computed for every position, but the attention output, wo and the MLP only for the m rows: the
        MLP and wo are ~85% of the layer's FLOPs, so training reads few rows of many sequences cheaply."""
        B, L, _ = x.shape
        pos = torch.arange(L, device=x.device)
        cos, sin = self._rope(pos.expand(B, L), L, x.dtype)
        blk = self.block
        q, k, v = blk.attention.qkv(blk.attention_norm(x), cos, sin)  # [B, L, H*, D]
        bidx = torch.arange(B, device=x.device)[:, None]
        q = q[bidx, rows]  # [B, m, Hq, D]
        mask = pos[None, None, :] <= rows[:, :, None]  # [B, m, L]: key j is in row i's past
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask[:, None], enable_gqa=q.shape[2] != k.shape[2])
        h = x[bidx, rows] + blk.attention.wo(o.transpose(1, 2).flatten(2))
        return self.norm(h + blk.feed_forward(blk.ffn_norm(h)))

    def prefill(self, x: torch.Tensor, lengths: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The prompts after the base model's prefill: x [B, L, H] their base hidden states (right-padded,
        lengths [B] real positions), the buffer empty -> normed outputs at each sequence's last real
        position [B, H]. In prefill chunks (model/llama.py chunked_prefill: flash attention, not one
        dense [L, L] tree mask); sets cache.seqlens = lengths."""
        B = x.shape[0]

        def run_chunk(s: int, e: int, site) -> list[torch.Tensor]:
            cos, sin = self._rope(torch.arange(s, e, device=x.device).expand(B, e - s), e, x.dtype)
            return [self.norm(self.block(x[:, s:e], cos, sin, site, cache.layers[0]))]

        out = chunked_prefill(run_chunk, lengths, x.shape[1])[0]
        cache.seqlens.copy_(lengths)
        return out

    def forward(self, x: torch.Tensor, cache: KVCache, backends) -> torch.Tensor:
        """x [B, T, H] base hidden states appended after cache.seqlens (causal among themselves) ->
        normed outputs [B, T, H]; attention through the run's backends["tree_attention"]. Writes K/V rows [seqlens, seqlens + T); the caller moves seqlens by
        the number of valid rows (the rest is overwritten next time)."""
        B, T, _ = x.shape
        dev = x.device
        start = cache.seqlens.long()[:, None]
        rows = start + torch.arange(T, device=dev)  # [B, T] cache rows = positions
        cos, sin = self._rope(rows, cache.max_seq_len, x.dtype)
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril_()
        site = AttentionSite(rows, cache.seqlens, causal, cache.max_seq_len, backend=backends["tree_attention"])
        return self.norm(self.block(x, cos, sin, site, cache.layers[0]))
