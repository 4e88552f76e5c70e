"""EAGLE's draft model: one decoder layer of the base model's architecture over fused (token, feature) inputs.

At draft position t the input is fc(cat(E(x_{t+1}), f_t)): the embedding of the next token and the
base model's feature at t (its final-normed last hidden state, the vector its LM head reads). The layer
predicts f_{t+1}; the base model's frozen LM head turns that into the distribution of x_{t+2}.
EAGLE-1's layer has no input RMSNorm (its fc output goes straight into attention) and no final norm.
EAGLE-3 (`Eagle3Layer`) differs in what it reads and predicts; see its docstring.

Two ways to run it:
- `forward_full(x)` (and `qkv` + `attend` with a dense mask, the training unroll): causal over whole
  sequences, no cache; with a prefill site and the buffer, the prompts' first pass in prefill chunks;
- `forward_tree(x, positions, kv, seqlens, slots, tree_mask, kv_len, backend)` (drafting): the inputs'
  keys/values written to the drafter's own KV buffer at rows seqlens[b] + slots, each query attending to
  the committed prefix and the tree rows its mask allows, through ops.tree_attention (the run's backend:
  the native CPU kernel reads each K/V row once per GQA group). Drafting's queries are a few rows of a
  larger tree (the pending chunk: all of its rows; a depth: top_k nodes among the step's tree rows), so
  the op gets the tree rows [0, T) with queries only at `slots` (the other rows padding that sees itself).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..model.attention import AttentionSite
from ..model.config import LlamaConfig
from ..model.layers import RMSNorm, TransformerBlock
from ..model.packed_linear import Linear
from ..model.rope import RopeCache


class EagleLayer(nn.Module):
    def __init__(self, base_config: dict, input_norm: bool = False, final_norm: bool = False, fc_bias: bool = True,
                 emb_scale: float = 1.0):
        """emb_scale: the token embedding is multiplied by it before fc (1.0: EAGLE's own layer). Ours
        sets it so the embedding half of fc's input has the features' RMS: Adam moves every weight by
        ~lr per step whatever its input's scale, so with embeddings ~15x smaller than the features
        (SmolLM2: RMS 0.136 vs 1.99) fc needed ~15x more steps to read the next token."""
        super().__init__()
        self.emb_scale = emb_scale
        cfg = LlamaConfig.from_hf_dict(base_config)
        self.config = dataclasses.replace(cfg, num_layers=1)
        H = cfg.hidden_size
        self.fc = Linear(2 * H, H, bias=fc_bias, pack_dtype=torch.bfloat16)
        self.block = TransformerBlock(self.config)
        if not input_norm:  # EAGLE-1: layer 0 has no input_layernorm
            self.block.attention_norm = nn.Identity()
        self.norm = RMSNorm(H, cfg.rms_norm_eps) if final_norm else nn.Identity()
        self.lm_head = None  # EAGLE-1/2 rank tokens with the base model's LM head (EAGLE-3: its own)
        self._rope = RopeCache(self.config)

    def fuse(self, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """emb, feat [..., H] -> fc(cat(emb, feat)) [..., H] (EAGLE's order: the token embedding first).
        feat: a base-model feature (a committed position)."""
        if self.emb_scale != 1.0:
            emb = emb * self.emb_scale
        return self.fc(torch.cat((emb, feat), dim=-1))

    def fuse_node(self, emb: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The input of a draft node: its token's embedding and its parent's predicted feature y."""
        return self.fuse(emb, y)

    def logit_input(self, y: torch.Tensor) -> torch.Tensor:
        """A predicted feature -> what the LM head reads (EAGLE-1/2: the feature itself)."""
        return y

    def _attn_in(self, x: torch.Tensor) -> torch.Tensor:
        return self.block.attention_norm(x)

    def _residual(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        blk = self.block
        return self.norm(h + blk.feed_forward(blk.ffn_norm(h)))

    def forward_full(self, x: torch.Tensor, start: int = 0, site: AttentionSite | None = None,
                     kv: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, L, *] fused inputs of positions start..start+L-1 -> predicted features [B, L, H], causal.
        No cache (site None: start must be 0), or a prefill chunk's site (model/attention.py) writing
        kv [2, B, S_max, Hkv, D] rows [start, start + L) and attending to the rows before them too."""
        B, L, _ = x.shape
        pos = torch.arange(start, start + L, device=x.device).expand(B, L)
        cos, sin = self._rope(pos, start + L, x.dtype)
        h = self._residual(x) + self.block.attention(self._attn_in(x), cos, sin, site, kv)
        return self._mlp(h)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, max_pos: int):
        cos, sin = self._rope(positions, max_pos, x.dtype)
        return self.block.attention.qkv(self._attn_in(x), cos, sin)

    def attend(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """Fused inputs x [B, Tq, *] (their residual part), roped q [B, Tq, Hq, D], keys/values [B, S, Hkv, D],
        mask bool [B, Tq, S] (True: visible) -> predicted features [B, Tq, H]."""
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask[:, None], enable_gqa=q.shape[2] != k.shape[2])
        h = self._residual(x) + self.block.attention.wo(o.transpose(1, 2).flatten(2))
        return self._mlp(h)

    def forward_tree(self, x: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor, seqlens: torch.Tensor,
                     slots: torch.Tensor | None, tree_mask: torch.Tensor, kv_len: int, backend: str) -> torch.Tensor:
        """x [B, n, *] fused inputs at rope positions [B, n]; kv [2, B, S_max, Hkv, D] the drafter's buffer
        with seqlens [B] committed rows; slots [B, n] the inputs' tree rows (their K/V go to buffer rows
        seqlens + slots; None: slots 0..n-1); tree_mask bool [T, T] or [B, T, T] over the tree rows [0, T)
        (ancestor-or-self; rows that are not in `slots` see themselves only); kv_len >= seqlens + T, a
        host-known bound on the buffer rows read -> predicted features [B, n, H]."""
        B, n = x.shape[:2]
        q, k, v = self.qkv(x, positions, kv.shape[2])
        bidx = torch.arange(B, device=x.device)[:, None]
        rows = seqlens.long()[:, None] + (torch.arange(n, device=x.device) if slots is None else slots)
        kv[:, bidx, rows] = torch.stack((k, v))
        T = tree_mask.shape[-1]
        if slots is not None:  # the queries at their tree rows, zeros elsewhere (padding rows)
            q = q.new_zeros(B, T, *q.shape[2:]).index_put_((bidx, slots), q)
        o = ops.tree_attention(q, kv[0, :, :kv_len], kv[1, :, :kv_len], seqlens, tree_mask, backend=backend)
        if slots is not None:
            o = o[bidx, slots]
        h = self._residual(x) + self.block.attention.wo(o.flatten(2))
        return self._mlp(h)


class Eagle3Layer(EagleLayer):
    """EAGLE-3's draft layer (SafeAILab/EAGLE eagle/model/cnets.py, `Model` with its `midlayer`).

    A committed position t reads g_t = cat of the base model's residual streams entering a few layers
    (feature_layers, low to high) and h_t = fc(g_t) (nH -> H, no bias); a draft node reads h = its
    parent's predicted feature as is (no fc). With e = the embedding of the next token, the layer is
        a = attention(cat(input_layernorm(e), hidden_norm(h)))   (q/k/v read 2H, no biases)
        y = (h + a) + mlp(post_attention_layernorm(h + a))        (the residual is h, not e)
    and y is the predicted feature; the tokens are ranked by lm_head(norm(y)) over a draft vocabulary
    of `lm_rows` tokens (its own LM head, not the base model's). The fused input this class passes
    around is cat(e, h) [..., 2H]. Parameter names: block.attention_norm = input_layernorm,
    block.ffn_norm = post_attention_layernorm."""

    def __init__(self, base_config: dict, num_features: int, lm_rows: int):
        super().__init__(base_config, input_norm=True, final_norm=False, fc_bias=False)
        c, H = self.config, self.config.hidden_size
        self.fc = Linear(num_features * H, H, bias=False, pack_dtype=torch.bfloat16)
        out = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.block.attention.wqkv = Linear(2 * H, out, bias=c.attention_bias)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.logit_norm = RMSNorm(H, c.rms_norm_eps)
        self.lm_head = Linear(H, lm_rows, bias=False, pack_dtype=torch.bfloat16)

    def fuse(self, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """emb [..., H], feat [..., nH] the base features of a committed position -> cat(emb, fc(feat))."""
        return torch.cat((emb, self.fc(feat)), dim=-1)

    def fuse_node(self, emb: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cat((emb, y), dim=-1)

    def logit_input(self, y: torch.Tensor) -> torch.Tensor:
        return self.logit_norm(y)

    def _attn_in(self, x: torch.Tensor) -> torch.Tensor:
        emb, h = x.chunk(2, dim=-1)
        return torch.cat((self.block.attention_norm(emb), self.hidden_norm(h)), dim=-1)

    def _residual(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., x.shape[-1] // 2:]
