"""Amphista (AMD; "Amphista: Bi-directional Multi-head Decoding for Accelerating LLM Inference", arXiv
2406.13170): Medusa-style heads that all draft from the last committed position, made to talk to each other.

Notation: committed tokens x_0..x_{n-1}, h_t the base model's final-normed hidden state at position t
(it predicts x_{t+1}); the root x_n is the base model's choice from h_{n-1}. Head d (0-based) proposes
x_{n+1+d}, the token at depth d+1 of a static tree (Medusa-format choices), like Medusa's head d.

1. Staged adaptation layers: two causal decoder layers of the base model's shape, each with its own KV
   buffer over the committed positions. Stage 1 reads fc_1(cat(h_t, E(x_{t+1}))) at position t; stage 2
   reads fc_2(cat(a1_t, E(x_{t+1}))), a1 being stage 1's output. At the last committed position
   t = n-1 the next token is the root, so the heads see the sampled token. Heads 0..split-1 (default
   split = ceil(K/2)) read stage 1's output a1_{n-1}, heads split..K-1 stage 2's a2_{n-1}.
2. Per-head MLPs: head d's ResBlock (y = x + SiLU(W_d x + b_d), as Medusa's) on its stage's state.
3. Auto-embedding block: the K head states stacked along a sequence axis of length K, plus learned position
   embeddings, through one decoder-shaped block whose attention is bi-directional (no mask, no RoPE)
   across the K positions.
4. LM head: "tied" (the base model's LM head, restricted to the draft vocabulary: no new weights), or
   "low_rank" (learned, H -> rank -> Vd, initialised from the tied head's truncated SVD); one LM head
   shared by the K positions. Each head's top-k fills its depth of the tree.
All K heads come out of one pass (whatever the tree's depth: the bi-directional block mixes all K), so
a draft costs the pending chunk through the two adaptation layers, K small ResBlocks, one block over K
rows and one LM-head top-k.

Per step, as EAGLE's pending chunk (drafters/eagle.py): the positions the base model committed since the
last draft (after the prefill: the prompt) wait with their base hidden states until propose(), where the
last one's next token (the root) is known; the chunk then runs through both adaptation layers into their
KV buffers (attention through the run's tree_attention op, causal over the chunk; the prompts' chunk in
prefill chunks, as the base model's prefill), and its last position's outputs feed the heads. The prompts'
next tokens come from the first observe_tokens call (host copies). A plain step's chunk waits in a backlog
and runs with the next draft's (or once backlog.BACKLOG_ROWS positions wait): one causal chunk over the
same positions, so the same buffers, at one call's cost (skip_step, drafters/backlog.py).

Our checkpoint format only (no public implementation exists): config.json + model.safetensors +
tree_<device>.json (trees searched per device class for these heads).
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..model.attention import AttentionSite
from ..model.config import LlamaConfig
from ..model.kv_cache import KVCache
from ..model.layers import TransformerBlock
from ..model.llama import chunked_prefill
from ..model.packed_linear import MAX_PACKED_ROWS, Linear
from ..model.rope import RopeCache
from ..tree import Tree, as_tree, default_tree, run_subtree
from . import backlog
from .backlog import Backlog
from .checkpoint import save_ours
from .draft_heads import ResBlock
from .fit import DRAFT_PACK_DTYPE, TiedLMHead, check_device_dtype, draft_vocab_ids, pack_draft_linears
from .protocol import Drafter, Proposal, confidence_class, pending_outline

LM_HEADS = ("tied", "low_rank")


@dataclass
class AmphistaConfig:
    hidden_size: int
    vocab_size: int
    base_config: dict = field(repr=False)  # HF dict of the base model: the decoder blocks' shape
    num_heads: int = 4  # K: head d proposes depth d+1
    stage_split: int | None = None  # heads fed by stage 1 (the rest: stage 2); None: ceil(K/2), stored resolved
    lm_head: str = "tied"  # "tied" | "low_rank"
    lm_head_rank: int = 256  # the low-rank head's inner width
    # the heads rank only these token ids (buffer draft_vocab, most frequent first); None: the whole vocab
    draft_vocab_size: int | None = None

    def __post_init__(self):
        for name in ("hidden_size", "vocab_size", "num_heads", "lm_head_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        K = self.num_heads
        if self.stage_split is None:
            self.stage_split = K - K // 2
        s = self.stage_split
        if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= K:
            raise ValueError(f"stage_split (heads fed by the first adaptation layer) must be an int in [1, "
                             f"num_heads={K}], got {s!r}")
        if self.lm_head not in LM_HEADS:
            raise ValueError(f"lm_head must be one of {LM_HEADS}, got {self.lm_head!r}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}")

    @property
    def num_stages(self) -> int:
        """Adaptation layers: 2, or 1 when stage 1 feeds every head."""
        return 1 if self.stage_split == self.num_heads else 2

    def to_dict(self) -> dict:
        return asdict(self)


class AmphistaState:
    """A run's drafting state: the adaptation layers' KV buffers (one KVCache, a layer per stage), the
    pending chunk (committed positions not yet run through them), the tree and its candidate layout."""

    def __init__(self, model, backends, cache: KVCache, tree: Tree):
        self.model, self.backends, self.cache = model, backends, cache
        self.full_tree = tree.to(model.device)  # the run's tree; set_budget may draft a subtree of it
        self.subtrees: dict = {}
        self.use_tree(self.full_tree)
        self.pend_h: torch.Tensor | None = None  # [B, P, H] base hidden states of the pending positions
        self.pend_tok: torch.Tensor | None = None  # [B, P] the token after each (the last valid one: the root)
        self.pend_n: torch.Tensor | None = None  # [B] valid pending positions
        self.prefill_tokens = True  # the first observe_tokens call brings the prompts' tokens
        self.first_pass = True  # the pending chunk is the prompts (the buffers are empty)
        self.backlog = Backlog()  # plain steps' chunks not run yet (skip_step)
        self.confidence = False  # proposals carry their guesses' confidence classes (set_parts: the adaptive budget asks)

    def use_tree(self, tree: Tree) -> None:
        self.tree = tree
        # one top-k of kmax per head; node t's token is column (depth-1) * kmax + rank of the flat candidates
        self.kmax = max([p.topk for p in tree.plans] + [1])
        self.source = torch.tensor([0] + [(len(c) - 1) * self.kmax + c[-1] for c in tree.choices],
                                   dtype=torch.long, device=tree.parents.device)


class AmphistaDrafter(Drafter):
    """hk.new_drafter(model, kind="amphista", num_heads=4, draft_vocab=None, lm_head="tied" | "low_rank",
    lm_head_rank=256, stage_split=None). `trees` maps a device type to the tree searched for it."""

    kinds = ("amphista",)
    config_class = AmphistaConfig

    def __init__(self, cfg: AmphistaConfig):
        super().__init__()
        self.config = cfg
        base = LlamaConfig.from_hf_dict(cfg.base_config)
        self.block_config = dataclasses.replace(base, num_layers=1)
        H, K = cfg.hidden_size, cfg.num_heads
        Vd = cfg.draft_vocab_size or cfg.vocab_size
        S = cfg.num_stages
        self.fc = nn.ModuleList(Linear(2 * H, H, bias=False, pack_dtype=DRAFT_PACK_DTYPE) for _ in range(S))
        self.adapt = nn.ModuleList(TransformerBlock(self.block_config) for _ in range(S))
        self.head_mlp = nn.ModuleList(ResBlock(H, H) for _ in range(K))
        self.pos_emb = nn.Parameter(torch.zeros(K, H))
        self.mixer = TransformerBlock(self.block_config)  # the auto-embedding block (bi-directional)
        if cfg.lm_head == "low_rank":
            self.lm_down = Linear(H, cfg.lm_head_rank, bias=False, pack_dtype=DRAFT_PACK_DTYPE)
            self.lm_up = Linear(cfg.lm_head_rank, Vd, bias=False, pack_dtype=DRAFT_PACK_DTYPE)
        else:
            self.lm_down = self.lm_up = None
        self.register_buffer("draft_vocab", torch.arange(Vd) if cfg.draft_vocab_size else None)
        self._rope = RopeCache(self.block_config)
        self._tied = TiedLMHead()  # the base LM head's rows of the draft vocabulary (and their CPU panels)
        self.packed = False
        self.trees: dict[str, Tree] = {}

    @property
    def kind(self) -> str:
        return "amphista"

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def new(cls, model, kind: str = "amphista", num_heads: int = 4, *, draft_vocab=None, lm_head: str = "tied",
            lm_head_rank: int = 256, stage_split: int | None = None) -> "AmphistaDrafter":
        """An untrained drafter for `model` (same device and dtype); see init_from for its start."""
        mc = model.config
        cfg = AmphistaConfig(hidden_size=mc.hidden_size, vocab_size=mc.vocab_size,
                             base_config=mc.to_hf_dict(include_extra=False), num_heads=num_heads,
                             stage_split=stage_split, lm_head=lm_head, lm_head_rank=lm_head_rank,
                             draft_vocab_size=None if draft_vocab is None else len(draft_vocab))
        ids = draft_vocab_ids(draft_vocab, mc.vocab_size)
        drafter = cls(cfg)
        if ids is not None:
            drafter.draft_vocab.copy_(ids)
        drafter.init_from(model)
        return drafter.to(model.device, model.dtype).eval()

    @torch.no_grad()
    def init_from(self, model) -> None:
        """Start as (almost) Medusa heads reading h_{n-1}: every decoder block is the base model's last
        layer with its output projections (attention wo, MLP w2) zeroed, so it passes its input through
        (Hydra++'s prefix-layer start, drafters/prefix.py); fc reads the state half as the identity and
        the token half as zero; ResBlocks start at x + SiLU(b) (W = 0); position embeddings small random
        (N(0, 0.02)) so the K rows differ; a low-rank LM head starts as the tied head's best rank-r
        approximation (truncated SVD of the base LM head's draft-vocabulary rows)."""
        src = {k: v.detach().to("cpu", torch.float32) for k, v in model.layers[-1].state_dict().items()}
        for blk in list(self.adapt) + [self.mixer]:
            blk.load_state_dict({k: src[k].clone() for k in blk.state_dict()})
            for lin in (blk.attention.wo, blk.feed_forward.w2):
                lin.weight.zero_()
                if lin.bias is not None:
                    lin.bias.zero_()
        H = self.config.hidden_size
        for fc in self.fc:
            fc.weight.zero_()
            fc.weight[:, :H] = torch.eye(H)
        g = torch.Generator().manual_seed(0)
        self.pos_emb.copy_(torch.randn(self.pos_emb.shape, generator=g) * 0.02)
        if self.lm_down is not None:
            w = model.lm_head_weight().detach().to("cpu", torch.float32)
            if self.draft_vocab is not None:
                w = w[self.draft_vocab.cpu()]
            U, S, Vh = torch.linalg.svd(w, full_matrices=False)
            r = min(self.config.lm_head_rank, S.numel())
            self.lm_down.weight.zero_()
            self.lm_up.weight.zero_()
            root = S[:r].sqrt()
            self.lm_down.weight[:r] = root[:, None] * Vh[:r]  # [r, H]
            self.lm_up.weight[:, :r] = U[:, :r] * root[None, :]  # [Vd, r]

    # ---- checks before any work -----------------------------------------------------------------
    def check_model(self, model) -> None:
        mc, c = model.config, self.block_config
        if (self.config.vocab_size, self.config.hidden_size) != (mc.vocab_size, mc.hidden_size):
            raise ValueError(f"amphista drafter built for vocab {self.config.vocab_size} / hidden "
                             f"{self.config.hidden_size}, the model has {mc.vocab_size} / {mc.hidden_size}: it was "
                             "trained for another model")
        shape = lambda x: (x.num_heads, x.num_kv_heads, x.head_dim, x.intermediate_size)  # noqa: E731
        if shape(c) != shape(mc):
            raise ValueError(f"amphista layer shape {shape(c)} (heads, kv heads, head_dim, intermediate) differs from "
                             f"the model's {shape(mc)}: it was trained for another model")
        check_device_dtype(self, model)

    def resolve_tree(self, tree, device_type: str) -> Tree:
        """None: the tree searched for this device class with these heads (self.trees), else the prior
        default of depth min(4, num_heads); otherwise anything hk.tree.as_tree takes. At most num_heads
        deep; a head ranks at most min(draft vocabulary, lm_head_topk's 64) guesses."""
        if tree is None:
            t = self.trees.get(device_type) or default_tree(depth=min(4, self.num_heads))
        else:
            t = as_tree(tree)
        t.check_heads(self.num_heads)
        ranks = min(self.config.draft_vocab_size or self.config.vocab_size, ops.LM_HEAD_TOPK_MAX_K)
        k = max((p.topk for p in t.plans), default=0)
        if k > ranks:
            raise ValueError(
                f"the tree asks a head for its guess of rank {k - 1}, but these heads rank at most {ranks} guesses "
                f"(draft vocabulary {self.config.draft_vocab_size or self.config.vocab_size}, lm_head_topk k <= "
                f"{ops.LM_HEAD_TOPK_MAX_K}); use ranks < {ranks}")
        return t

    # ---- the modules ------------------------------------------------------------------------------
    def adapt_full(self, model, hidden: torch.Tensor, next_tokens: torch.Tensor) -> list[torch.Tensor]:
        """No cache (training, tests): hidden [S, L, H] base hidden states of positions 0..L-1, next_tokens
        [S, L] the token after each -> each stage's outputs [S, L, H], causal over the L positions."""
        S, L, _ = hidden.shape
        pos = torch.arange(L, device=hidden.device).expand(S, L)
        cos, sin = self._rope(pos, L, hidden.dtype)
        emb = model.tok_embeddings(next_tokens)
        outs, x = [], hidden
        for fc, blk in zip(self.fc, self.adapt):
            x = blk(fc(torch.cat((x, emb), dim=-1)), cos, sin)
            outs.append(x)
        return outs

    def _adapt_chunk(self, state: AmphistaState, root: torch.Tensor) -> list[torch.Tensor]:
        """Run the plain steps' backlog and the pending positions (the last valid one's next token: the root)
        through the adaptation layers into their buffers, as one causal chunk -> each stage's output at each
        sequence's last position [B, H]; the positions are committed (the buffers' seqlens move by their count)."""
        for chunk in state.backlog.take_with(state.pend_h, state.pend_tok, state.pend_n, root):
            out = self._run_chunk(state, *chunk)  # the prompts' chunk first where it waits, then the rest
        return out

    def _run_chunk(self, state: AmphistaState, h: torch.Tensor, tok: torch.Tensor, n: torch.Tensor) -> list[torch.Tensor]:
        """h [B, P, H], tok [B, P], n [B] valid positions each (see _adapt_chunk)."""
        cache = state.cache
        B, P = tok.shape
        dev = tok.device
        i = torch.arange(P, device=dev)
        emb = state.model.tok_embeddings(tok)

        def run(x: torch.Tensor, emb: torch.Tensor, cos, sin, site) -> list[torch.Tensor]:
            outs = []
            for s, (fc, blk) in enumerate(zip(self.fc, self.adapt)):
                x = blk(fc(torch.cat((x, emb), dim=-1)), cos, sin, site, cache.layers[s])
                outs.append(x)
            return outs

        if state.first_pass:  # the prompts: in prefill chunks (flash attention), not one dense [P, P] mask
            state.first_pass = False

            def run_chunk(s: int, e: int, site) -> list[torch.Tensor]:
                cos, sin = self._rope(torch.arange(s, e, device=dev).expand(B, e - s), e, h.dtype)
                return run(h[:, s:e], emb[:, s:e], cos, sin, site)

            outs = chunked_prefill(run_chunk, n, P)
        else:  # the steps' committed positions, causal among themselves after the prefix
            rows = cache.seqlens.long()[:, None] + i  # [B, P] buffer rows = positions
            cos, sin = self._rope(rows, cache.max_seq_len, h.dtype)
            causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril_()
            site = AttentionSite(rows, cache.seqlens, causal, cache.max_seq_len,
                                 backend=state.backends["tree_attention"])
            last, bidx = (n - 1).clamp(min=0), torch.arange(B, device=dev)
            outs = [x[bidx, last] for x in run(h, emb, cos, sin, site)]
        cache.advance(n.to(cache.seqlens.dtype))
        return outs

    def head_states(self, stages: list[torch.Tensor]) -> torch.Tensor:
        """Each stage's adapted state [..., H] -> the K heads' states after the auto-embedding block
        [..., K, H] (what the LM head reads)."""
        split = self.config.stage_split
        s = torch.stack([mlp(stages[0 if d < split else 1]) for d, mlp in enumerate(self.head_mlp)], dim=-2)
        lead = s.shape[:-2]
        return self._mix(s.reshape(-1, *s.shape[-2:]) + self.pos_emb).reshape(*lead, *s.shape[-2:])

    def _mix(self, x: torch.Tensor) -> torch.Tensor:
        """The auto-embedding block on x [N, K, H]: pre-norm decoder block, attention bi-directional over the K
        rows (no mask, no RoPE: the learned position embeddings are already in x)."""
        blk = self.mixer
        a = blk.attention
        N, K, _ = x.shape
        q, k, v = a.wqkv(blk.attention_norm(x)).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = q.view(N, K, a.n_heads, a.head_dim).transpose(1, 2)
        k = k.view(N, K, a.n_kv_heads, a.head_dim).transpose(1, 2)
        v = v.view(N, K, a.n_kv_heads, a.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=a.n_heads != a.n_kv_heads)
        h = x + a.wo(o.transpose(1, 2).flatten(2))
        return h + blk.feed_forward(blk.ffn_norm(h))

    def tied_lm_weight(self, model) -> torch.Tensor:
        """The base model's LM head rows of the draft vocabulary [Vd, H] (kept until the weight or the
        vocabulary changes): the tied head, and the teacher in training whatever the head."""
        return self._tied.weight(model, self.draft_vocab)

    def logits(self, model, y: torch.Tensor) -> torch.Tensor:
        """Head states [..., H] -> logits [..., Vd] over the draft vocabulary (column j: token draft_vocab[j]).
        Training and test path (autograd)."""
        if self.lm_down is not None:
            return self.lm_up(self.lm_down(y))
        return F.linear(y, self.tied_lm_weight(model))

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        return index if self.draft_vocab is None else self.draft_vocab[index]

    def head_topk(self, model, y: torch.Tensor, k: int, backends) -> torch.Tensor:
        """Head states [..., H] -> token ids of their k best guesses [..., k]. The tied head runs the fused
        ops.lm_head_topk (no logits written), or on packed CPU weights the packed kernel."""
        return self.head_guesses(model, y, k, backends, with_probs=False)[0]

    def head_guesses(self, model, y: torch.Tensor, k: int, backends,
                     with_probs: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """head_topk's guesses [..., k] and, with_probs, their probabilities under their head (softmax over the draft
        vocabulary, fp32 [..., k]; else None): the adaptive budget's confidence signal. The guesses are head_topk's on
        every path (the fused kernel's too: its probabilities come from separate logits)."""
        logits = None
        if self.lm_down is not None:
            logits = self.logits(model, y)
            idx = logits.topk(k, dim=-1).indices
        elif (self.packed and y.is_cpu and y.dtype is torch.float32 and model.output.weight.dtype is torch.float32
              and not torch.is_grad_enabled() and y.numel() <= MAX_PACKED_ROWS * y.shape[-1]):
            logits = self._tied.packed_logits(model, self.draft_vocab, y)  # no fp32 slice
            idx = logits.topk(k, dim=-1).indices
        else:
            idx = ops.lm_head_topk(y, self.tied_lm_weight(model), k, backend=backends["lm_head_topk"])[1]
        probs = None
        if with_probs:
            if logits is None:  # the fused kernel wrote none
                logits = F.linear(y, self.tied_lm_weight(model))
            probs = logits.float().softmax(dim=-1).gather(-1, idx)
        return self.token_ids(idx), probs

    def use_packed_cpu_weights(self, on: bool) -> None:
        """Draft GEMVs on the packed CPU kernel with bf16 panels (fit.pack_draft_linears); the tied LM-head
        rows follow `self.packed`."""
        self.packed = on
        pack_draft_linears(self, on)

    # ---- the run ----------------------------------------------------------------------------------
    def prepare(self, model, backends) -> None:
        if self.lm_down is None:  # its heads rank with the base head's rows
            self._tied.prepare(model, self.draft_vocab, backends.packed_linear)

    def start(self, model, batch_size: int, max_seq_len: int, tree: Tree, backends) -> AmphistaState:
        self.use_packed_cpu_weights(backends.packed_linear)
        self.prepare(model, backends)
        # rows: the committed prefix plus a pending chunk's padding (at most the accept width, depth + 1)
        cfg = dataclasses.replace(self.block_config, num_layers=self.config.num_stages)
        # + the backlog's padding (skip_step): a chunk's padded rows run past its sequence's own
        rows = max_seq_len + tree.depth + 2 + backlog.reserved_rows(tree.depth)
        cache = KVCache(cfg, batch_size, rows, dtype=model.dtype, device=model.device)
        return AmphistaState(model, backends, cache, tree)

    def after_prefill(self, state: AmphistaState, hidden, lengths) -> None:
        state.pend_h, state.pend_n = hidden, lengths.long()
        state.pend_tok = None  # filled from the prompts' tokens (observe_tokens)
        state.backlog.expect_no_row()

    def observe_tokens(self, state: AmphistaState, new_tokens: list[list[int]], step_argmax=None) -> None:
        if not state.prefill_tokens:
            return
        state.prefill_tokens = False  # prompt + root: the prefill chunk's next tokens are text[1:]
        tok = torch.zeros(len(new_tokens), state.pend_h.shape[1], dtype=torch.long)
        for b, t in enumerate(new_tokens):
            tok[b, : len(t) - 1] = torch.tensor(t[1:])
        state.pend_tok = tok.to(state.pend_h.device, non_blocking=True)

    def after_step(self, state: AmphistaState, accepted_hidden, accepted_tokens, accept_lengths) -> None:
        state.pend_h, state.pend_n = accepted_hidden, accept_lengths.long()
        state.pend_tok = torch.cat((accepted_tokens[:, 1:], accepted_tokens[:, :1]), dim=1)  # last: root, at propose
        state.backlog.expect_no_row()

    def after_plain_step(self, state: AmphistaState, hidden: torch.Tensor, root: torch.Tensor) -> None:
        # the step's one position, kept by reference: its root comes at skip_step / propose
        state.backlog.hold_row(hidden)

    def budget_levels(self, tree: Tree) -> tuple[int, ...]:
        return tuple(range(1, tree.num_nodes + 1))  # any subtree (Tree.subtree)

    def set_budget(self, state: AmphistaState, nodes: int) -> None:
        state.use_tree(run_subtree(state.full_tree, nodes, state.subtrees, state.full_tree.parents.device))

    def skip_step(self, state: AmphistaState, root: torch.Tensor, seqlens: torch.Tensor) -> None:
        """A plain step: the pending positions wait in the backlog (drafters/backlog.py), run with the next
        draft's chunk or once BACKLOG_ROWS wait (the prompts' chunk too: it then runs first)."""
        for chunk in state.backlog.skip(state.pend_h, state.pend_tok, state.pend_n, root, state.first_pass):
            self._run_chunk(state, *chunk)

    def static_tree(self, state: AmphistaState) -> Tree:
        return state.tree

    def set_parts(self, state: AmphistaState, parts: tuple[bool, ...]) -> None:
        """Only the adaptive budget calls it: from here proposals carry each guess's confidence class (Proposal.signal),
        which it learns from (a softmax over the draft vocabulary per depth: not paid where no policy reads it).
        Amphista's drafts are always its heads' top-k, never sampled: a class is a function of the hidden states, not of
        a draw (HeadDrafter.reports_confidence's condition holds)."""
        state.confidence = True

    def outline(self, state: AmphistaState, batch: int):
        """Drafter.outline: the static tree; every node's class PENDING_SIGNAL where the proposal will report
        confidence classes (its head's probability decides it), else sibling ranks."""
        return pending_outline(state.tree, batch) if state.confidence else super().outline(state, batch)

    def propose(self, state: AmphistaState, root: torch.Tensor, seqlens: torch.Tensor | None) -> Proposal:
        """The signal for the adaptive budget (after set_parts): each node's probability under its depth's head (the
        root's: 1)."""
        if state.pend_tok is None:
            raise RuntimeError("amphista needs the prompts' tokens: call observe_tokens after after_prefill")
        tree = state.tree
        y = self.head_states(self._adapt_chunk(state, root))  # [B, K, H]
        top, probs = self.head_guesses(state.model, y[:, : max(tree.depth, 1)], state.kmax, state.backends,
                                       state.confidence)  # [B, D, kmax] each
        lens = state.cache.seqlens if seqlens is None else seqlens  # equal: the chunk committed up to the root
        tokens, positions = ops.tree_inputs(root, top.flatten(1), state.source, tree.depths, lens,
                                            backend=state.backends["tree_inputs"])
        signal = None
        if probs is not None:
            conf = probs.flatten(1)[:, state.source]  # node t's: its candidate's (node 0 gathers column 0: replaced)
            conf[:, 0] = 1.0
            signal = confidence_class(conf)
        return Proposal(tokens, tree, positions, signal=signal)

    # ---- checkpoints --------------------------------------------------------------------------------
    def save(self, path, dtype: torch.dtype | None = None) -> None:
        """Our format: config.json (+ "kind": "amphista") + model.safetensors + tree_<device>.json."""
        save_ours(self, path, dtype)
