"""What the head families (Medusa, Hydra, Hydra++) share: ResBlocks, a head, the LM head over the
draft vocabulary, the hidden state the heads start from, and our checkpoint format.

Head d (0-based) proposes the tokens at depth d+1 of a static tree (Medusa-format choices). The
families differ only in a head's input: Medusa's head sees h, the drafter's hidden state for the last
committed position; Hydra's sees cat(h, E(root), E(x1), ..., E(x_d)). Hydra++ adds a prefix decoder
layer that turns the base model's hidden states into h (drafters/prefix.py).

Drafts are deterministic by default: a node's children are its head's top-k guesses, child of rank r
the r-th best. With draft_temperature > 0 they are sampled instead: a node with k child slots gets k
draws, i.i.d. with replacement, from q = softmax(head logits / draft_temperature), and the proposal
carries q for each drafted node (Proposal.draft_probs), so that rejection acceptance accepts with
min(1, p/q) (ops.rejection_verify). The tree's shape stays the static one: rank r now names draw r.

On the CPU (a run whose BackendPlan has packed_linear) the heads' Linear layers and the tied LM-head
slice run the native packed small-M kernel with bf16 panels, the way model/packed_linear.py runs the
base model: a CPU drafting step is bound by reading weights (a Hydra head's first block is 2.7-6.6 MB
in fp32 for SmolLM2; the draft LM-head slice, 16k x 576, 38 MB in fp32, is read at every depth), and in
bf16 the slice (19 MB) stays in a 32 MB L3 across depths. Measured on the 2-core dev CPU: draft 11 ->
2.2 ms per step. Drafting precision never changes what generate() emits (verification is the base
model's); it can only change which guesses are proposed (the heads train under bf16 autocast).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..model.kv_cache import KVCache
from ..model.packed_linear import MAX_PACKED_ROWS, Linear
from ..tree import Tree, as_tree, default_tree, run_subtree
from .config import DrafterConfig
from .fit import DRAFT_PACK_DTYPE, TiedLMHead, check_device_dtype, draft_vocab_ids
from .prefix import PrefixLayer
from .protocol import Drafter, pending_outline


def _draft_linear(in_features: int, out_features: int, bias: bool = True) -> Linear:
    return Linear(in_features, out_features, bias=bias, pack_dtype=DRAFT_PACK_DTYPE)


class ResBlock(nn.Module):
    """y = R x + SiLU(W x + b); R is the identity when widths match, else a learned projection
    (Hydra's first block maps (d+2)H -> H). W starts at zero so a fresh block is R x + SiLU(b)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = _draft_linear(in_features, out_features)
        self.res_connection = _draft_linear(in_features, out_features) if in_features != out_features else None
        nn.init.zeros_(self.linear.weight)

    def forward(self, x):
        res = x if self.res_connection is None else self.res_connection(x)
        return res + F.silu(self.linear(x))

    def infer(self, x, backends):
        """Inference: on packed CPU weights the module itself; else an H -> H block as the fused
        ops.resblock (matmul, bias, SiLU, residual in one launch for all nodes of a depth)."""
        if self.res_connection is None and not self.linear.packed_on:
            return ops.resblock(x, self.linear.weight, self.linear.bias, backend=backends["resblock"])
        return self(x)


class DraftHead(nn.Module):
    """ResBlocks applied in `schedule` order (a repeated index = one shared module), then its LM head
    (None: the drafter's shared or tied one)."""

    def __init__(self, cfg: DrafterConfig, index: int):
        super().__init__()
        H, L = cfg.hidden_size, cfg.num_layers
        in_features = H * (index + 2) if cfg.grounded else H
        if not cfg.shared_resblocks:
            self.blocks = nn.ModuleList([ResBlock(in_features, H)] + [ResBlock(H, H) for _ in range(L - 1)])
            self.schedule = list(range(L))
        elif in_features != H:  # Hydra original: a first block, then one block repeated L-1 times
            self.blocks = nn.ModuleList([ResBlock(in_features, H)] + ([ResBlock(H, H)] if L > 1 else []))
            self.schedule = [0] + [1] * (L - 1)
        else:  # Medusa original: one block repeated L times
            self.blocks = nn.ModuleList([ResBlock(H, H)])
            self.schedule = [0] * L
        V = cfg.draft_vocab_size or cfg.vocab_size
        self.lm_head = _draft_linear(H, V, bias=cfg.lm_head_bias) if cfg.lm_head == "per_head" else None

    def hidden(self, x):
        """Training path (autograd through the modules): x [..., in_features] -> [..., H]."""
        for i in self.schedule:
            x = self.blocks[i](x)
        return x

    def infer(self, x, backends, first: int = 0):
        """Inference path: the blocks of schedule[first:] on x [..., in] -> [..., H]."""
        for i in self.schedule[first:]:
            x = self.blocks[i].infer(x, backends)
        return x


@dataclass
class HeadState:
    """A run's drafting state: the hidden state h [B, H] the next draft starts from, the static tree,
    the Hydra++ prefix layer's KV buffer."""

    model: object
    backends: object
    tree: Tree
    prefix_cache: KVCache | None
    h: torch.Tensor | None = None
    full_tree: Tree | None = None  # the run's tree; `tree` is it or a subtree of it (set_budget)
    subtrees: dict = field(default_factory=dict)
    budget: int | None = None  # set_budget's node count (None: the full tree); size_part bounds within it
    draft_temperature: float = 0.0  # the drafter's at start(): 0 = top-k drafts, > 0 = sampled drafts
    confidence: bool = False  # proposals carry their guesses' confidence classes (set_parts: the adaptive budget asks)
    generator: torch.Generator | None = None  # the draws of sampled drafts (use_generator)


class HeadDrafter(Drafter):
    """All heads of one drafter (Medusa / Hydra / Hydra++ subclass it), plus the Hydra++ prefix layer.
    `trees` maps a device type ("cpu", "cuda") to the tree searched for it, saved with the heads."""

    config_class = DrafterConfig

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.heads = nn.ModuleList(DraftHead(cfg, i) for i in range(cfg.num_heads))
        V = cfg.draft_vocab_size or cfg.vocab_size
        self.shared_lm_head = _draft_linear(cfg.hidden_size, V, bias=cfg.lm_head_bias) if cfg.lm_head == "shared" else None
        self.prefix = PrefixLayer(cfg.base_config, cfg.prefix_final_norm) if cfg.prefix_layer else None
        # draft index -> token id (None: the identity over the whole vocabulary)
        self.register_buffer("draft_vocab", torch.arange(V) if cfg.draft_vocab_size else None)
        self._tied = TiedLMHead()  # the base LM head's rows of the draft vocabulary (and their CPU panels)
        self.trees: dict[str, Tree] = {}
        self._draft_temperature = 0.0

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def draft_temperature(self) -> float:
        """0 (default): each node's children are its head's top-k guesses. > 0: they are drawn i.i.d.
        (with replacement) from softmax(head logits / draft_temperature), and proposals carry those
        distributions (Proposal.draft_probs). A run-time choice, read at start(), not saved."""
        return self._draft_temperature

    @draft_temperature.setter
    def draft_temperature(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
            raise ValueError(f"draft_temperature must be a finite number >= 0 (0: top-k drafts), got {value!r}")
        self._draft_temperature = float(value)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    # ---- checks before any work -----------------------------------------------------------------
    def check_model(self, model) -> None:
        mc = model.config
        if self.vocab_size != mc.vocab_size:
            raise ValueError(f"drafter vocab ({self.vocab_size}) does not match the model's ({mc.vocab_size}): "
                             "these heads were trained for another model")
        if self.hidden_size != mc.hidden_size:
            raise ValueError(f"drafter hidden size ({self.hidden_size}) does not match the model's "
                             f"({mc.hidden_size}): these heads were trained for another model")
        if self.prefix is not None:
            self.prefix.check_model(model)
        check_device_dtype(self, model)

    def resolve_tree(self, tree, device_type: str) -> Tree:
        """None: the tree searched for this device class with these heads (self.trees), else the prior
        default; otherwise a Tree, Medusa-format choices, a JSON file, "default" or "chain-N"."""
        if tree is None:
            t = self.trees.get(device_type) or default_tree(depth=min(4, self.num_heads))
        else:
            t = as_tree(tree)
        t.check_heads(self.num_heads)
        # a head ranks its guesses over the draft vocabulary, with lm_head_topk (at most 64) on most paths:
        # one bound for every backend, so a tree that runs on one runs on all
        ranks = min(self.config.draft_vocab_size or self.vocab_size, ops.LM_HEAD_TOPK_MAX_K)
        k = max((p.topk for p in t.plans), default=0)
        if k > ranks:
            raise ValueError(
                f"the tree asks a head for its guess of rank {k - 1}, but these heads rank at most {ranks} guesses "
                f"(draft vocabulary {self.config.draft_vocab_size or self.vocab_size}, lm_head_topk k <= "
                f"{ops.LM_HEAD_TOPK_MAX_K}); use ranks < {ranks}")
        return t

    # ---- the run ----------------------------------------------------------------------------------
    def prepare(self, model, backends) -> None:
        if self.shared_lm_head is None and any(h.lm_head is None for h in self.heads):  # a head reads the tied rows
            self._tied.prepare(model, self.draft_vocab, backends.packed_linear)

    def start(self, model, batch_size: int, max_seq_len: int, tree: Tree, backends) -> HeadState:
        self.use_packed_cpu_weights(backends.packed_linear)
        self.prepare(model, backends)
        cache = self.prefix.new_cache(batch_size, max_seq_len, model) if self.prefix is not None else None
        tree = tree.to(model.device)
        return HeadState(model, backends, tree, cache, full_tree=tree, draft_temperature=self.draft_temperature)

    def use_generator(self, state: HeadState, generator: torch.Generator | None) -> None:
        if state.draft_temperature > 0:  # at temperature 0 (greedy: exact for any draft) a fixed seed
            state.generator = generator if generator is not None else \
                torch.Generator(device=state.model.device).manual_seed(0)

    def budget_levels(self, tree: Tree) -> tuple[int, ...]:
        return tuple(range(1, tree.num_nodes + 1))  # any subtree (Tree.subtree): heads draft per node

    def set_budget(self, state: HeadState, nodes: int) -> None:
        state.budget = nodes
        state.tree = run_subtree(state.full_tree, nodes, state.subtrees, state.model.device)

    def size_part(self, state: HeadState, part: int, nodes: int | None) -> None:
        """A head runs per depth: the adaptive budget's bound is the subtree of that many nodes (None: the run's)."""
        cap = state.full_tree.num_nodes if state.budget is None else state.budget
        n = cap if nodes is None else max(1, min(nodes, cap))
        if state.tree.num_nodes != n:
            state.tree = run_subtree(state.full_tree, n, state.subtrees, state.model.device)

    def static_tree(self, state: HeadState) -> Tree:
        return state.tree

    def set_parts(self, state: HeadState, parts: tuple[bool, ...]) -> None:
        """Only the adaptive budget calls it: from here proposals of top-k drafts carry each guess's confidence class
        (Proposal.signal), which it learns from (the probabilities cost a softmax over the draft vocabulary a depth,
        and on the fused GPU kernel's path the logits themselves: not paid where no policy reads them)."""
        state.confidence = True

    def reports_confidence(self, state: HeadState) -> bool:
        """Do this run's proposals carry confidence classes? Top-k drafts where the adaptive budget asked. Never
        sampled drafts: a class would be a function of the token drawn, and a policy that keeps or cuts a node by it
        would bias rejection acceptance's min(1, p / q), which needs the kept token to follow q (sibling ranks
        then, the policy's default)."""
        return state.confidence and state.draft_temperature == 0

    def outline(self, state: HeadState, batch: int):
        """Drafter.outline: the static tree; every node's class PENDING_SIGNAL where the proposal will report
        confidence classes (its head's probability decides it; the root's is that of p = 1), else sibling ranks."""
        return pending_outline(state.tree, batch) if self.reports_confidence(state) else super().outline(state, batch)

    def after_prefill(self, state: HeadState, hidden, lengths) -> None:
        if self.prefix is None:
            state.h = _at(hidden, lengths.long() - 1)
        else:
            state.h = self.prefix.prefill(hidden, lengths, state.prefix_cache)

    def after_step(self, state: HeadState, accepted_hidden, accepted_tokens, accept_lengths) -> None:
        out = accepted_hidden if self.prefix is None else self.prefix(accepted_hidden, state.prefix_cache, state.backends)
        if state.prefix_cache is not None:
            state.prefix_cache.advance(accept_lengths.to(state.prefix_cache.seqlens.dtype))
        # the last accepted row (row 0 for a finished sequence); a plain step's one row needs no gather
        state.h = out[:, 0] if out.shape[1] == 1 else _at(out, (accept_lengths.long() - 1).clamp(min=0))

    def after_plain_step(self, state: HeadState, hidden, root) -> None:
        if self.prefix is not None:  # Hydra++'s prefix layer runs over the row
            return super().after_plain_step(state, hidden, root)
        state.h = hidden  # after_step's out[:, 0] of hidden[:, None]: the same values

    def draft(self, model, h: torch.Tensor, root: torch.Tensor, tree: Tree, backends=None) -> torch.Tensor:
        """The tokens of `tree` [B, T] (node 0 = root [B]) drafted from h [B, H], outside a run (tests,
        evaluation); backends: a BackendPlan, a backend name or None ("auto")."""
        backends = model.backend_plan(backends)
        self.use_packed_cpu_weights(backends.packed_linear)
        return self._draft(model, h, root, tree, backends)

    def use_packed_cpu_weights(self, on: bool) -> None:
        """Run this drafter's Linear layers (and the tied LM-head slice) on the packed CPU kernel, or not."""
        for m in self.modules():
            if isinstance(m, Linear) and m.packed_on != on:
                m.pack_cpu(on)

    # ---- heads -----------------------------------------------------------------------------------
    def logits(self, model, head: int, x: torch.Tensor) -> torch.Tensor:
        """Head `head` on inputs x [..., in_features] -> logits [..., Vd] over the draft vocabulary
        (column j is token draft_vocab[j]; the whole vocabulary when draft_vocab is None). Training
        and evaluation path (autograd)."""
        hidden = self.heads[head].hidden(x)
        lm = self.heads[head].lm_head or self.shared_lm_head
        if lm is not None:
            return lm(hidden)
        return F.linear(hidden, self.tied_lm_weight(model))

    def tied_lm_weight(self, model) -> torch.Tensor:
        """The base model's LM head rows of the draft vocabulary [Vd, H], gathered once and kept until
        the model's weight or the vocabulary changes. On the CPU the slice is stored input-major like
        the model's weights: the small-M GEMV streams it ~2x faster."""
        return self._tied.weight(model, self.draft_vocab)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> token ids."""
        return index if self.draft_vocab is None else self.draft_vocab[index]

    def head_topk(self, model, head: int, hidden: torch.Tensor, k: int, backends) -> torch.Tensor:
        """Head output [..., H] -> token ids of its k best guesses [..., k]. The tied LM head runs the
        fused ops.lm_head_topk (no logits written), or on packed CPU weights the packed kernel."""
        return self.head_guesses(model, head, hidden, k, backends, with_probs=False)[0]

    def head_guesses(self, model, head: int, hidden: torch.Tensor, k: int, backends,
                     with_probs: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """head_topk's guesses [..., k] and, with_probs, their probabilities under the head (softmax over the
        draft vocabulary, fp32 [..., k]; else None): the adaptive budget's confidence signal. The guesses are
        head_topk's on every path (the fused kernel's too: its probabilities come from separate logits)."""
        lm = self.heads[head].lm_head or self.shared_lm_head
        logits = None
        if lm is not None:
            logits = lm(hidden)
            idx = logits.topk(k, dim=-1).indices
        elif self._packed_tied(hidden, backends):
            logits = self._packed_tied_logits(model, hidden)
            idx = logits.argmax(dim=-1, keepdim=True) if k == 1 else logits.topk(k, dim=-1).indices
        else:
            idx = ops.lm_head_topk(hidden, self.tied_lm_weight(model), k, backend=backends["lm_head_topk"])[1]
        probs = None
        if with_probs:
            if logits is None:  # the fused kernel wrote none: the logits of the draft vocabulary (all of it where none)
                logits = F.linear(hidden, self.tied_lm_weight(model))
            probs = logits.float().softmax(dim=-1).gather(-1, idx)
        return self.token_ids(idx), probs

    def head_draws(self, model, head: int, hidden: torch.Tensor, k: int, state: HeadState):
        """Head output [..., H] -> (token ids [..., k] drawn i.i.d. with replacement from
        q = softmax(logits / state.draft_temperature), q fp32 [..., V] over the whole vocabulary (0
        outside the draft vocabulary)). Draws from state.generator."""
        lm = self.heads[head].lm_head or self.shared_lm_head
        if lm is not None:
            logits = lm(hidden)
        elif self._packed_tied(hidden, state.backends):
            logits = self._packed_tied_logits(model, hidden)
        else:
            logits = F.linear(hidden, self.tied_lm_weight(model))
        q = (logits.float() / state.draft_temperature).softmax(dim=-1)  # [..., Vd]
        idx = torch.multinomial(q.reshape(-1, q.shape[-1]), k, replacement=True, generator=state.generator)
        idx = self.token_ids(idx.view(*q.shape[:-1], k))
        if self.draft_vocab is not None:  # draft-vocabulary columns -> their token ids' columns
            q = q.new_zeros(*q.shape[:-1], self.vocab_size).scatter_(-1, self.draft_vocab.expand_as(q), q)
        return idx, q

    def _packed_tied(self, hidden: torch.Tensor, backends) -> bool:
        """Does the tied LM head run the packed CPU kernel on `hidden`? (the rule of model/packed_linear.Linear)"""
        return (backends.packed_linear and hidden.is_cpu and hidden.dtype is torch.float32
                and not torch.is_grad_enabled() and hidden.numel() <= MAX_PACKED_ROWS * hidden.shape[-1])

    def _packed_tied_logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        """The tied LM-head slice on packed CPU weights: hidden [..., H] -> logits [..., Vd]."""
        return self._tied.packed_logits(model, self.draft_vocab, hidden)

    # ---- our checkpoint format --------------------------------------------------------------------
    @classmethod
    def new(cls, model, kind: str, num_heads: int = 4, num_layers: int = 1, *, lm_head: str = "tied",
            lm_head_bias: bool = False, draft_vocab=None, prefix_final_norm: bool = True) -> "HeadDrafter":
        """An untrained drafter of `kind` for `model` (same device and dtype); see hk.new_drafter."""
        mc = model.config
        cfg = DrafterConfig(num_heads=num_heads, num_layers=num_layers, hidden_size=mc.hidden_size,
                            vocab_size=mc.vocab_size, grounded=kind != "medusa", prefix_layer=kind == "hydra++",
                            prefix_final_norm=prefix_final_norm, lm_head=lm_head, lm_head_bias=lm_head_bias,
                            draft_vocab_size=None if draft_vocab is None else len(draft_vocab),
                            base_config=mc.to_hf_dict(include_extra=False) if kind == "hydra++" else None)
        drafter = cls(cfg).to(model.device, model.dtype).eval()
        if draft_vocab is not None:
            drafter.draft_vocab.copy_(draft_vocab_ids(draft_vocab, mc.vocab_size, model.device))
        if drafter.prefix is not None:
            drafter.prefix.init_identity(model)
        return drafter

    def save(self, path, dtype: torch.dtype | None = None) -> None:
        from .checkpoint import save_ours

        save_ours(self, path, dtype)


def _at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, L, H], index [B] -> x[b, index[b]] [B, H]."""
    return x[torch.arange(x.shape[0], device=x.device), index]
