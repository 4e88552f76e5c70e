"""EAGLE: a feature-level draft decoder layer (drafters/eagle_layer.py) with EAGLE-2's confidence-ranked
dynamic trees, or a static tree.

Per step (all on the device, no host read):
1. the pending chunk: the positions the base model committed since the last step (after the prefill:
   the whole prompt, in prefill chunks), each fed fc(cat(E(next token), base feature)), go through the
   layer into its own KV buffer; the last one's output predicts the feature at the root, whose LM-head distribution gives the
   root's children (depth 1).
2. dynamic (EAGLE-2): at each further depth the top_k nodes of the previous depth by cumulative draft
   log-probability run the layer (each attending to the committed prefix and its own ancestors), each
   proposing top_k children; after `depth` levels every drafted node is ranked by its cumulative
   log-probability and the best total_tokens - 1 form the tree (a node never ranks above its parent:
   log-probabilities are <= 0 and ties keep the shallower, earlier node first, so the chosen set is
   closed under parents). Every sequence gets its own tree, all of size total_tokens.
   static: the nodes of a fixed Tree, depth by depth, each parent's top-k children by rank.
The accepted path's base features replace the drafted ones next step (step 1 again), as EAGLE does. A plain
step's chunk waits in a backlog and runs with the next draft's (drafters/backlog.py: one call for many plain steps).

EAGLE-3 (config feature_layers set; loaded from its original checkpoint, drafters/eagle_original.py)
drafts the same way with eagle_layer.Eagle3Layer: its base features are the residual streams entering
feature_layers of the base model (the loop captures them: Drafter.feature_layers), a node reads its
parent's predicted feature without fc, and its own LM head ranks a draft vocabulary (draft_vocab: the
target id of each draft index, EAGLE-3's index + d2t[index]).
Original EAGLE-1 checkpoints (config.json + pytorch_model.bin / model.safetensors) load too.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model.kv_cache import KVCache
from ..model.llama import chunked_prefill
from ..model.packed_linear import MAX_PACKED_ROWS
from ..ops.packed_linear import pack_linear_weight, packed_linear
from ..tree import Tree, TreeBatch, as_tree, run_subtree
from ..weight_cache import DerivedCache
from . import backlog
from .backlog import Backlog
from .eagle_layer import Eagle3Layer, EagleLayer
from .fit import DRAFT_PACK_DTYPE, check_device_dtype, draft_vocab_ids, pack_draft_linears
from .protocol import Drafter, Proposal, confidence_class, pending_outline


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's tree settings: total_tokens nodes (root included) chosen among the top_k children of
    the top_k best nodes of each of `depth` levels."""

    total_tokens: int = 8
    depth: int = 4
    top_k: int = 4

    def __post_init__(self):
        for name in ("total_tokens", "depth", "top_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"dynamic tree {name} must be a positive int, got {v!r}")
        if self.total_tokens < 2:
            raise ValueError("dynamic tree total_tokens must be >= 2 (the root and at least one draft)")
        if self.candidates < self.total_tokens - 1:
            raise ValueError(f"a dynamic tree of depth {self.depth} and top_k {self.top_k} drafts {self.candidates} "
                             f"nodes, fewer than total_tokens - 1 = {self.total_tokens - 1}: raise depth or top_k")

    @property
    def candidates(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k

    def bound(self) -> Tree:
        """A static tree with as many nodes and as deep: what bounds a step's KV rows and paths."""
        chain = [[0] * d for d in range(1, min(self.depth, self.total_tokens - 1) + 1)]
        rest = [[r] for r in range(1, self.total_tokens - len(chain))]
        t = Tree(chain + rest)
        t.dynamic = self
        return t


def as_dynamic(spec) -> DynamicTree | None:
    """generate()'s tree argument -> DynamicTree when it names one (a DynamicTree, or a dict with
    total_tokens / depth / top_k), else None (a static tree)."""
    if isinstance(spec, DynamicTree):
        return spec
    if isinstance(spec, dict):
        unknown = set(spec) - {"total_tokens", "depth", "top_k"}
        if unknown:
            raise ValueError(f"a dynamic tree takes total_tokens, depth and top_k; unknown: {sorted(unknown)}")
        return DynamicTree(**spec)
    return None


@dataclass
class EagleConfig:
    hidden_size: int
    vocab_size: int
    base_config: dict = field(repr=False)  # HF dict of the base model: the draft layer's shape
    input_norm: bool = False  # EAGLE-1: no RMSNorm before the layer's attention
    final_norm: bool = False  # EAGLE-1: the layer's output is the feature itself
    fc_bias: bool = True
    emb_scale: float = 1.0  # token embeddings scaled by this before fc (EagleLayer); 1.0 in EAGLE's own layers
    draft_vocab_size: int | None = None  # the draft ranks only these token ids (buffer draft_vocab)
    tree: dict = field(default_factory=lambda: asdict(DynamicTree()))  # default dynamic tree
    # EAGLE-3: the base model's layers whose inputs (residual streams) are the features, low to high;
    # None: EAGLE-1/2 (the final-normed hidden state)
    feature_layers: list[int] | None = None

    def __post_init__(self):
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")
        if self.feature_layers is not None:
            fl = list(self.feature_layers)
            if not fl or len(set(fl)) != len(fl) or any(not isinstance(k, int) or k < 0 for k in fl):
                raise ValueError(f"feature_layers must be distinct layer indices >= 0, got {self.feature_layers}")
            self.feature_layers = fl
        DynamicTree(**self.tree)

    def to_dict(self) -> dict:
        return asdict(self)


class EagleState:
    def __init__(self, model, backends, cache: KVCache, tree: Tree, batch_size: int):
        self.model, self.backends, self.cache = model, backends, cache
        self.dynamic: DynamicTree | None = getattr(tree, "dynamic", None)
        self.full_dynamic = self.dynamic  # the run's settings; set_budget may draft fewer nodes
        self.tree = self.full_tree = tree.to(model.device)
        self.subtrees: dict = {}
        self.pend_h: torch.Tensor | None = None  # [B, P, H] base features of the positions not yet drafted over
        self.pend_tok: torch.Tensor | None = None  # [B, P] the token after each (the last: the root, at propose)
        self.pend_n: torch.Tensor | None = None  # [B] valid pending positions
        self.host_len = [0] * batch_size  # committed base tokens per sequence, from observe_tokens
        self.prefill_tokens = True  # the first observe_tokens call brings the prompts' tokens
        self.first_pass = True  # the pending chunk is the prompts (the buffer is empty)
        self.backlog = Backlog()  # plain steps' chunks not run yet (skip_step)


class EagleDrafter(Drafter):
    """hk.new_drafter(model, kind="eagle", draft_vocab=None, tree=dict(total_tokens=8, depth=4, top_k=4))."""

    kinds = ("eagle",)
    config_class = EagleConfig

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.config = cfg
        if cfg.feature_layers is not None:  # EAGLE-3: its own LM head over the draft vocabulary
            self.layer = Eagle3Layer(cfg.base_config, len(cfg.feature_layers), cfg.draft_vocab_size or cfg.vocab_size)
        else:
            self.layer = EagleLayer(cfg.base_config, cfg.input_norm, cfg.final_norm, cfg.fc_bias, cfg.emb_scale)
        n = cfg.draft_vocab_size
        self.register_buffer("draft_vocab", torch.arange(n) if n else None)
        self.trees: dict[str, Tree] = {}  # static trees searched per device class (none by default)
        self.dynamic_trees: dict[str, DynamicTree] = {}  # dynamic settings searched per device class
        self._lm_slice = DerivedCache()
        self._lm_packed = DerivedCache()  # the same rows in bf16 panels for the CPU kernel
        self.packed = False

    @property
    def kind(self) -> str:
        return "eagle"

    @property
    def feature_layers(self) -> tuple[int, ...] | None:
        fl = self.config.feature_layers
        return None if fl is None else tuple(fl)

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def new(cls, model, kind: str = "eagle", *, draft_vocab=None, tree=None, input_norm: bool = False,
            final_norm: bool = False, feature_layers=None) -> "EagleDrafter":
        """feature_layers: None, an EAGLE-1/2 layer over the final-normed features; "eagle3" (the base layers
        EAGLE-3 reads: 2, L // 2, L - 3) or a list of layer indices, an EAGLE-3 layer over the residual
        streams entering them, with its own LM head over the draft vocabulary (input_norm / final_norm are
        then EAGLE-3's and may not be given)."""
        mc = model.config
        spec = as_dynamic(tree) or DynamicTree()
        if feature_layers is not None:
            if input_norm or final_norm:
                raise ValueError("input_norm / final_norm choose an EAGLE-1/2 layer's norms; an EAGLE-3 layer "
                                 "(feature_layers) has its own: leave them out")
            if feature_layers == "eagle3":
                from .eagle_original import eagle3_feature_layers

                feature_layers = eagle3_feature_layers(mc.num_layers)
            feature_layers = list(model.check_capture(feature_layers))
            emb_scale, fc_bias, input_norm = 1.0, False, True
        else:
            with torch.no_grad():  # features are final-normed: their RMS is about the final norm weight's
                rms = lambda w: float(w.float().pow(2).mean().sqrt())  # noqa: E731
                emb_scale = round(rms(model.norm.weight) / max(rms(model.embedding_weight()), 1e-6), 4)
            fc_bias = True
        ids = draft_vocab_ids(draft_vocab, mc.vocab_size, model.device) if draft_vocab is not None else None
        cfg = EagleConfig(hidden_size=mc.hidden_size, vocab_size=mc.vocab_size,
                          base_config=mc.to_hf_dict(include_extra=False), input_norm=input_norm,
                          final_norm=final_norm, fc_bias=fc_bias, draft_vocab_size=None if ids is None else len(ids),
                          tree=asdict(spec), emb_scale=emb_scale, feature_layers=feature_layers)
        drafter = cls(cfg)
        if ids is not None:
            drafter.draft_vocab.copy_(ids.cpu())
        drafter.init_from(model)
        drafter = drafter.to(model.device, model.dtype).eval()
        return drafter

    @torch.no_grad()
    def init_from(self, model) -> None:
        """Start as the copy f_{t+1} = f_t: the base model's last layer's weights with its two output
        projections (attention wo, MLP w2) zeroed, so the residual stream passes fc's output through, and
        fc reading the feature half as the identity. Measured on the self-generated answers: the base
        layer copied whole predicts features of RMS ~53 for targets of RMS ~2 (it expects the un-normed
        residual stream, not final-normed features), ~2300 after a second unrolled step, and training
        diverged from there (loss 2e5 after 30 steps); the copy starts at the features' own scale at
        every unroll depth (as Hydra++'s prefix layer starts, drafters/prefix.py)."""
        own = self.layer.block.state_dict()
        src = model.layers[-1].state_dict()
        same = {k: src[k].clone() for k in own if src[k].shape == own[k].shape}  # EAGLE-3's q/k/v read 2H
        self.layer.block.load_state_dict(same, strict=self.feature_layers is None)
        blk = self.layer.block
        for lin in (blk.attention.wo, blk.feed_forward.w2):
            lin.weight.zero_()
            if lin.bias is not None:
                lin.bias.zero_()
        H = self.config.hidden_size
        self.layer.fc.weight.zero_()
        if self.feature_layers is None:
            self.layer.fc.weight[:, H:] = torch.eye(H)
        else:
            self._init_eagle3(model, src)
        if self.layer.fc.bias is not None:
            self.layer.fc.bias.zero_()

    @torch.no_grad()
    def _init_eagle3(self, model, src: dict) -> None:
        """EAGLE-3's start, in the spirit of init_from: fc passes the highest feature layer's stream through
        (the predicted feature starts as that stream, a late layer's view of the next token); q/k/v read
        the feature half with the base layer's weights and the token half as zero; the output norm is the
        base model's final norm and the LM head its rows of the draft vocabulary (both trained after)."""
        H, layer = self.config.hidden_size, self.layer
        layer.fc.weight[:, -H:] = torch.eye(H)
        wqkv = src["attention.wqkv.weight"]
        layer.block.attention.wqkv.weight.zero_()
        layer.block.attention.wqkv.weight[:, H:] = wqkv
        layer.hidden_norm.weight.copy_(src["attention_norm.weight"])
        layer.logit_norm.weight.copy_(model.norm.weight.detach())
        w = model.lm_head_weight().detach().to("cpu", torch.float32)
        rows = w if self.draft_vocab is None else w.index_select(0, self.draft_vocab.cpu())
        layer.lm_head.weight.copy_(rows)

    # ---- checks before any work -----------------------------------------------------------------
    def check_model(self, model) -> None:
        """The draft meets the base model in the token embeddings, the features and (EAGLE-1/2) the LM
        head: vocabulary and hidden size must match; the layer's own shape (heads, MLP) is its own."""
        mc = model.config
        if (self.config.vocab_size, self.config.hidden_size) != (mc.vocab_size, mc.hidden_size):
            raise ValueError(f"EAGLE layer built for vocab {self.config.vocab_size} / hidden {self.config.hidden_size}, "
                             f"the model has {mc.vocab_size} / {mc.hidden_size}: it was trained for another model")
        fl = self.config.feature_layers
        if fl is not None and max(fl) >= mc.num_layers:
            raise ValueError(f"this EAGLE-3 draft reads the inputs of base layers {fl}, but the model has "
                             f"{mc.num_layers} layers: it was trained for another model")
        check_device_dtype(self, model)

    def resolve_tree(self, tree, device_type: str) -> Tree:
        """None: the dynamic tree searched for this device class (else the config's); a DynamicTree or a
        dict(total_tokens, depth, top_k): EAGLE-2's dynamic tree; anything hk.tree.as_tree takes (a Tree,
        Medusa-format choices, "chain-N", ...): that static tree. Returns the bound of every proposal."""
        if tree is None:
            tree = self.dynamic_trees.get(device_type) or self.trees.get(device_type) or DynamicTree(**self.config.tree)
        spec = as_dynamic(tree)
        vd = self.config.draft_vocab_size or self.config.vocab_size
        if spec is not None:
            if spec.top_k > vd:
                raise ValueError(f"the dynamic tree asks for the draft's top {spec.top_k} tokens, but it ranks {vd}: "
                                 f"lower top_k to at most {vd}")
            return spec.bound()
        t = as_tree(tree)
        k = max((p.topk for p in t.plans), default=0)
        if k > vd:
            raise ValueError(f"the tree asks for the draft's guess of rank {k - 1}, but it ranks {vd} tokens")
        return t

    # ---- the run ----------------------------------------------------------------------------------
    def rows_per_step(self, tree: Tree) -> int:
        """Draft KV rows a step's tree uses beyond the committed prefix."""
        d = getattr(tree, "dynamic", None)
        return (d.depth - 1) * d.top_k if d is not None else tree.num_nodes - 1

    def start(self, model, batch_size: int, max_seq_len: int, tree: Tree, backends) -> EagleState:
        self.use_packed_cpu_weights(backends.packed_linear)
        # rows: the prefix, the tree's rows, a pending chunk's padding (at most the accept width) and a backlog's
        rows = max_seq_len + self.rows_per_step(tree) + tree.depth + 2 + backlog.reserved_rows(tree.depth)
        cache = KVCache(self.layer.config, batch_size, rows, dtype=model.dtype, device=model.device)
        return EagleState(model, backends, cache, tree, batch_size)

    def use_packed_cpu_weights(self, on: bool) -> None:
        """Draft GEMVs on the packed CPU kernel with bf16 panels (fit.pack_draft_linears); the tied LM-head
        rows follow `self.packed`."""
        self.packed = on
        pack_draft_linears(self, on)

    def after_prefill(self, state: EagleState, hidden, lengths) -> None:
        state.pend_h, state.pend_n = hidden, lengths.long()
        state.pend_tok = None  # filled from the prompts' tokens (observe_tokens)
        state.backlog.expect_no_row()

    def observe_tokens(self, state: EagleState, new_tokens: list[list[int]], step_argmax=None) -> None:
        if state.prefill_tokens:  # prompt + root: the prefill chunk's next tokens are text[1:]
            state.prefill_tokens = False
            P = state.pend_h.shape[1]
            tok = torch.zeros(len(new_tokens), P, dtype=torch.long)
            for b, t in enumerate(new_tokens):
                state.host_len[b] = len(t) - 1
                tok[b, : len(t) - 1] = torch.tensor(t[1:])
            state.pend_tok = tok.to(state.pend_h.device, non_blocking=True)
            return
        for b, t in enumerate(new_tokens):
            state.host_len[b] += len(t)

    def after_step(self, state: EagleState, accepted_hidden, accepted_tokens, accept_lengths) -> None:
        state.pend_h, state.pend_n = accepted_hidden, accept_lengths.long()
        state.pend_tok = torch.cat((accepted_tokens[:, 1:], accepted_tokens[:, :1]), dim=1)  # last: root, at propose
        state.backlog.expect_no_row()

    def after_plain_step(self, state: EagleState, hidden: torch.Tensor, root: torch.Tensor) -> None:
        # the step's one position, kept by reference: its root comes at skip_step / propose
        state.backlog.hold_row(hidden)

    def budget_levels(self, tree: Tree) -> tuple[int, ...]:
        return tuple(range(1, tree.num_nodes + 1))

    def set_budget(self, state: EagleState, nodes: int) -> None:
        """Dynamic trees keep `nodes` nodes of the rerank and draft at most nodes - 1 levels deep; static
        trees draft their subtree (Tree.subtree)."""
        d = state.full_dynamic
        if d is None:
            state.tree = run_subtree(state.full_tree, nodes, state.subtrees, state.full_tree.parents.device)
        else:
            state.dynamic = d if nodes == d.total_tokens else DynamicTree(nodes, min(d.depth, nodes - 1), d.top_k)

    def skip_step(self, state: EagleState, root: torch.Tensor, seqlens: torch.Tensor) -> None:
        """A plain step: the pending positions wait in the backlog (drafters/backlog.py), run with the next
        draft's chunk or once BACKLOG_ROWS wait (the prompts' chunk too: it then runs first)."""
        for chunk in state.backlog.skip(state.pend_h, state.pend_tok, state.pend_n, root, state.first_pass):
            self._run_chunk(state, *chunk)

    def static_tree(self, state: EagleState) -> Tree | None:
        return state.tree if state.dynamic is None else None  # a dynamic tree is chosen by its drafting

    def propose(self, state: EagleState, root: torch.Tensor, seqlens: torch.Tensor) -> Proposal:
        """The signal for the adaptive budget: each node's probability under the layer at its parent (the root's: 1)."""
        y_root = self._chunk(state, root)  # [B, H]: the predicted feature at the root
        if state.dynamic is not None:
            tokens, parents, lp = self._dynamic(state, y_root, root)
            return Proposal(tokens, TreeBatch(parents, max_depth=state.dynamic.depth), signal=confidence_class(lp.exp()))
        tokens, lp = self._static(state, y_root, root)
        return Proposal(tokens, state.tree, signal=confidence_class(lp.exp()))

    def outline(self, state: EagleState, batch: int):
        """Drafter.outline: a static tree's, every node's class PENDING_SIGNAL (the layer's probability decides it);
        None for a dynamic tree (its drafting chooses it)."""
        return None if state.dynamic is not None else pending_outline(state.tree, batch)

    # ---- drafting ---------------------------------------------------------------------------------
    def _chunk(self, state: EagleState, root: torch.Tensor) -> torch.Tensor:
        """Run the plain steps' backlog and the pending positions (committed by the base model since the last
        draft; the last one's next token: the root) into the layer's buffer; returns the last one's output [B, H]
        per sequence and commits the positions."""
        for chunk in state.backlog.take_with(state.pend_h, state.pend_tok, state.pend_n, root):
            out = self._run_chunk(state, *chunk)  # the prompts' chunk first where it waits, then the rest
        return out

    def _run_chunk(self, state: EagleState, h: torch.Tensor, tok: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """h [B, P, H], tok [B, P], n [B] valid positions each (see _chunk)."""
        B, P = tok.shape
        dev = tok.device
        i = torch.arange(P, device=dev)
        cache = state.cache
        x = self.layer.fuse(state.model.tok_embeddings(tok), h)
        if state.first_pass:  # the prompts: in prefill chunks (flash attention), not one dense [P, P] mask
            state.first_pass = False
            y = chunked_prefill(lambda s, e, site: [self.layer.forward_full(x[:, s:e], s, site, cache.layers[0])],
                                n, P)[0]
        else:  # the steps' committed positions
            rows = cache.seqlens.long()[:, None] + i  # [B, P] = the positions
            kv_len = min(max(state.host_len) + P, cache.max_seq_len)
            causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril_()  # the chunk over itself, after the prefix
            y = self.layer.forward_tree(x, rows, cache.layers[0], cache.seqlens, None, causal, kv_len,
                                        state.backends["tree_attention"])  # [B, P, H]
            y = y[torch.arange(B, device=dev), (n - 1).clamp(min=0)]
        cache.advance(n.to(cache.seqlens.dtype))
        return y

    def _run_nodes(self, state: EagleState, tok: torch.Tensor, feat: torch.Tensor, depth: int, rows_rel: torch.Tensor,
                   anc: torch.Tensor) -> torch.Tensor:
        """Draft nodes at tree depth `depth` (>= 1): tok [B, n] their tokens, feat [B, n, H] their parents'
        predicted features, rows_rel [B, n] their rows after the committed prefix, anc bool [B, n, R] the
        tree rows each sees (ancestors and itself) -> their predicted features [B, n, H]."""
        cache = state.cache
        dlen = cache.seqlens.long()  # == the base model's committed length (after _chunk)
        B, n, R = anc.shape
        kv_len = min(max(state.host_len) + R, cache.max_seq_len)
        # the step's tree rows [0, R): the nodes' rows see their ancestors and themselves, the rest only itself
        mask = torch.eye(R, dtype=torch.bool, device=tok.device).expand(B, R, R).clone()
        mask[torch.arange(B, device=tok.device)[:, None], rows_rel] = anc
        positions = (dlen + depth - 1)[:, None].expand_as(rows_rel)
        x = self.layer.fuse_node(state.model.tok_embeddings(tok), feat)
        return self.layer.forward_tree(x, positions, cache.layers[0], cache.seqlens, rows_rel, mask, kv_len,
                                       state.backends["tree_attention"])

    def draft_log_probs(self, model, y: torch.Tensor) -> torch.Tensor:
        """Predicted features [..., H] -> log-probabilities [..., Vd] over the draft vocabulary (the base
        model's LM head rows; EAGLE-3: its own norm and LM head; column j is token draft_vocab[j])."""
        if self.layer.lm_head is not None:
            return F.log_softmax(self.layer.lm_head(self.layer.logit_input(y)).float(), dim=-1)
        w = self.lm_weight(model)
        if (self.packed and y.is_cpu and y.dtype is torch.float32 and not torch.is_grad_enabled()
                and y.numel() <= MAX_PACKED_ROWS * y.shape[-1] and w.dtype is torch.float32):
            panels = self._lm_packed.get((w,), lambda: pack_linear_weight(w.detach(), DRAFT_PACK_DTYPE),
                                         extra=(DRAFT_PACK_DTYPE,))
            return F.log_softmax(packed_linear(y, panels, w.shape[0]), dim=-1)
        return F.log_softmax(F.linear(y, w).float(), dim=-1)

    def lm_weight(self, model) -> torch.Tensor:
        """The LM head rows the draft ranks with (EAGLE-3: its own LM head's weight)."""
        if self.layer.lm_head is not None:
            return self.layer.lm_head.weight
        return self.base_lm_rows(model)

    def base_lm_rows(self, model) -> torch.Tensor:
        """The base model's LM-head rows of the draft vocabulary [Vd, H] (training's teacher)."""
        if self.draft_vocab is None:
            return model.lm_head_weight()
        return self._lm_slice.get((model.lm_head_source(), self.draft_vocab),
                                  lambda: model.lm_head_rows(self.draft_vocab))

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        return index if self.draft_vocab is None else self.draft_vocab[index]

    def _dynamic(self, state: EagleState, y_root: torch.Tensor, root: torch.Tensor):
        """EAGLE-2: -> tokens [B, T], parents [B, T] of each sequence's confidence-ranked tree, each node's log-probability
        at its parent [B, T] (the root's: 0)."""
        d, model = state.dynamic, state.model
        K, T = d.top_k, d.total_tokens
        B, dev = root.shape[0], root.device
        bidx = torch.arange(B, device=dev)[:, None]
        lp, idx = self.draft_log_probs(model, y_root).topk(K, dim=-1)  # [B, K]
        cand_tok, cand_score, cand_lp = [self.token_ids(idx)], [lp], [lp]
        cand_parent = [torch.full((B, K), -1, dtype=torch.long, device=dev)]  # -1: the root
        front_tok, front_score = cand_tok[0], lp  # [B, K] the nodes expanded next
        front_feat = y_root[:, None, :].expand(B, K, -1)  # their parents' predicted features
        front_id = torch.arange(K, device=dev).expand(B, K)  # their candidate indices
        R = (d.depth - 1) * K
        front_anc = torch.zeros(B, K, R, dtype=torch.bool, device=dev)
        n_cand = K
        for depth in range(1, d.depth):
            slot = (depth - 1) * K + torch.arange(K, device=dev)
            front_anc[:, torch.arange(K, device=dev), slot] = True  # each node sees itself
            y = self._run_nodes(state, front_tok, front_feat, depth, slot.expand(B, K), front_anc)  # [B, K, H]
            lp, idx = self.draft_log_probs(model, y).topk(K, dim=-1)  # [B, K, K]
            score = (front_score[:, :, None] + lp).flatten(1)  # [B, K*K] cumulative
            cand_tok.append(self.token_ids(idx).flatten(1))
            cand_score.append(score)
            cand_lp.append(lp.flatten(1))
            cand_parent.append(front_id[:, :, None].expand(B, K, K).flatten(1))
            best = score.topk(K, dim=-1).indices  # [B, K] the next depth's frontier
            par = best // K  # which frontier node each descends from
            front_tok = cand_tok[-1].gather(1, best)
            front_score = score.gather(1, best)
            front_feat = y[bidx, par]
            front_anc = front_anc[bidx, par]
            front_id = n_cand + best
            n_cand += K * K
        tok, score, parent, cond = (torch.cat(x, dim=1) for x in (cand_tok, cand_score, cand_parent, cand_lp))  # [B, C]
        # the best T-1 by cumulative log-prob; a stable sort keeps a parent (earlier index, score >= the
        # child's) ahead of its children, so the chosen set is closed under parents
        order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, : T - 1]
        chosen = order.sort(dim=1).values  # [B, T-1] ascending: parents before children
        node_of = torch.zeros(B, n_cand, dtype=torch.long, device=dev)
        node_of[bidx, chosen] = torch.arange(1, T, device=dev).expand(B, T - 1)
        cp = parent.gather(1, chosen)
        parents = torch.where(cp < 0, torch.zeros_like(cp), node_of.gather(1, cp.clamp(min=0)))
        tokens = torch.cat((root[:, None], tok.gather(1, chosen)), dim=1)
        parents = torch.cat((torch.full((B, 1), -1, dtype=torch.long, device=dev), parents), dim=1)
        return tokens, parents, torch.cat((cond.new_zeros(B, 1), cond.gather(1, chosen)), dim=1)

    def _static(self, state: EagleState, y_root: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        """The tokens [B, T] of the static tree (each parent's children are its draft top-k by rank) and each node's
        log-probability at its parent [B, T] (the root's: 0)."""
        tree, model = state.tree, state.model
        B, T, dev = root.shape[0], tree.num_nodes, root.device
        tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
        tokens[:, 0] = root
        lps = torch.zeros(B, T, dtype=torch.float32, device=dev)
        feats = y_root.new_zeros(B, T, y_root.shape[-1])  # each node's predicted feature (its children's input)
        feats[:, 0] = y_root
        anc = tree.mask[:, 1:]  # [T, T-1]: node i sees the rows (j - 1) of its non-root ancestors and itself
        for depth, plan in enumerate(tree.plans, start=1):
            if depth > 1:  # run the parents of this depth's nodes (at depth - 1) through the layer
                nodes = plan.parents
                y = self._run_nodes(state, tokens[:, nodes], feats[:, tree.parents[nodes]], depth - 1,
                                    (nodes - 1).expand(B, -1), anc[nodes].expand(B, -1, -1))
                feats[:, nodes] = y
            lp, idx = self.draft_log_probs(model, feats[:, plan.parents]).topk(plan.topk, dim=-1)  # [B, p, k]
            tokens[:, plan.children] = self.token_ids(idx[:, plan.child_slot, plan.child_rank])
            lps[:, plan.children] = lp[:, plan.child_slot, plan.child_rank].float()
        return tokens, lps

    # ---- checkpoints --------------------------------------------------------------------------------
    def save(self, path, dtype: torch.dtype | None = None) -> None:
        """Our format: config.json (+ "kind": "eagle") + model.safetensors + the searched trees
        (dynamic_<device>.json, tree_<device>.json)."""
        from .checkpoint import save_ours

        save_ours(self, path, dtype)
        for device_kind, spec in self.dynamic_trees.items():
            (Path(path) / f"dynamic_{device_kind}.json").write_text(json.dumps(asdict(spec)))

    @staticmethod
    def recognizes(cfg_dict: dict) -> bool:
        """An original EAGLE checkpoint's config.json: a one-layer Llama config (drafters/eagle_original.py)."""
        from .eagle_original import recognizes

        return recognizes(cfg_dict)

    @classmethod
    def load_original(cls, path: Path, cfg_dict: dict, model=None) -> "EagleDrafter":
        """An original EAGLE-1 or EAGLE-3 checkpoint (SafeAILab/EAGLE); needs the base model."""
        from .eagle_original import load_original

        return load_original(cls, path, cfg_dict, model)

    @classmethod
    def load_saved(cls, path: Path, cfg_dict: dict, model=None, load=None) -> "EagleDrafter":
        from .checkpoint import load_ours, read_json

        drafter = load_ours(cls, path, cfg_dict)
        for f in sorted(path.glob("dynamic_*.json")):
            spec = read_json(f)
            try:
                drafter.dynamic_trees[f.stem[len("dynamic_"):]] = DynamicTree(**spec)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{f} is not an EAGLE-2 dynamic tree (total_tokens, depth, top_k) ({e})") from e
        return drafter
