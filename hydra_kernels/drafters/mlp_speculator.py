"""MLPSpeculator (IBM, fms-extras; "Accelerating Production LLMs with Combined Token/Embedding
Speculators", arXiv 2404.19124): a chain of small MLP stages that reads the base model's last hidden
state and, like an RNN, the token the previous stage chose.

Stage i (0-based) maps (state, token) to a new state and a distribution over the next token:

    state <- GELU(norm_i(proj_i(state) + emb_weight / state_weight * emb_i(token))),  logits_i = head_i(state)

norm_i is fms' LayerNormParameterized as the speculator builds it: an RMS norm (no mean subtraction,
x * rsqrt(mean(x^2) + 1e-6)) with a learned scale and shift. Stage 0 starts from h, the base model's
final-normed hidden state at the last committed position (what fms' `return_embeds` gives), and the root
(the token the base model chose from h); scale_input first maps h to rms_norm(h) / sqrt(2) (no learned
weights). state_weight = 0.5 ** (0.5 / n_predict), emb_weight = sqrt((1 - state_weight^2) * inner_dim / 2);
the sum is written as fms writes it (proj + emb * emb_weight / state_weight, the norm removing the common
factor state_weight). tie_weights shares emb, head and norm across stages and proj over stages >= 1.

tie_base (ours, not in fms-extras): the stages read the base model's own token embedding and rank with its
own LM head (rows of the draft vocabulary), both frozen and never stored, so a checkpoint holds only the
stages' projections, output maps and norms (SmolLM2, 3 stages: ~2.0M parameters, 3.9 MB in bf16, where the
fms layout's per-stage 49152-row embeddings and 16k-row heads take 113M). The frozen head needs a signed,
final-norm-like input, which a GELU state is not, so each stage also maps its state to the base's hidden space:

    logits_i = W_base[draft_vocab] @ out_norm_i(out_i(state)),   out_i: Linear(inner, emb_dim),

out_norm_i the same scale-and-shift RMS norm, its scale starting as the base model's final norm weight.

Drafting (propose) is fms' generate_suffixes: stage i runs on the top-k_{i-1} states of the previous
stage (the prod(top_k[:i]) prefixes, batched), candidates are the prod(top_k) suffixes scored by their
summed log-probabilities, the best n_candidates are kept and merged into a per-sequence trie under the
root (shared prefixes are one node, nodes by depth then candidate rank, so a parent precedes its
children). Everything stays on the device: the trie's node ids come from prefix comparisons between the
candidates and the tree from its leaf paths (TreeBatch.from_paths), no host read. On the GPU the tree
keeps its bound, n_candidates * n_predict + 1 nodes, with the merged nodes as padding; on the CPU (no
sync to pay) it is cut to the largest trie of the batch. Log-probabilities are summed in fp32.

Original format (fms-extras' HF layout, e.g. ibm-fms/llama3-8b-accelerator; vLLM reads it too):
config.json with model_type "mlp_speculator", emb_dim, inner_dim (0: emb_dim), n_predict, vocab_size,
top_k_tokens_per_head, n_candidates, tie_weights, scale_input; model.safetensors or pytorch_model.bin
(or their sharded .index.json) holding speculator.{emb,proj,head}.{i}.weight and speculator.ln.{i}.weight
/ .bias, or the same names without "speculator." (fms' own and vLLM's naming). With tie_weights a
checkpoint stores the shared tensors once (safetensors cannot alias; vLLM's named_parameters) or under
every stage's name (torch.save of the state dict): both load, and copies that differ are refused.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..model.packed_linear import Linear
from ..tree import Tree, TreeBatch
from .checkpoint import read_weights, save_ours
from .fit import DRAFT_PACK_DTYPE, TiedLMHead, check_device_dtype, draft_vocab_ids, pack_draft_linears
from .protocol import Drafter, Proposal, confidence_class

EPS = 1e-6  # fms LayerNormParameterized's default, used by the speculator's norms
PREFIX = "speculator."  # the HF wrapper's attribute: fms-extras' hub checkpoints name weights with it
# fms-extras MLPSpeculatorConfig's defaults, for fields an original config.json leaves out
ORIGINAL_DEFAULTS = dict(vocab_size=32000, emb_dim=4096, inner_dim=0, n_predict=3, top_k_tokens_per_head=[5, 4, 3],
                         n_candidates=5, tie_weights=False, scale_input=False)


def default_top_k(n_predict: int) -> list[int]:
    """Candidates per stage when none are given: 4, 3, then 2 for every further stage."""
    return ([4, 3] + [2] * max(0, n_predict - 2))[:n_predict]


@dataclass
class MLPSpeculatorConfig:
    emb_dim: int  # the base model's hidden size
    vocab_size: int  # the base model's vocabulary
    n_predict: int = 3  # stages: tokens drafted per step
    inner_dim: int = 0  # the stages' width (0: emb_dim; stored resolved)
    top_k_tokens_per_head: list[int] | None = None  # stage i keeps its top k_i tokens per prefix (None: default_top_k)
    n_candidates: int | None = None  # suffixes kept of the prod(top_k) scored (None: min(8, prod(top_k)))
    tie_weights: bool = False  # one emb / head / norm for all stages, one proj for stages >= 1
    scale_input: bool = False  # h -> rms_norm(h) / sqrt(2) before stage 0
    tie_base: bool = False  # the base model's embedding and LM head (frozen, not stored) + an output map per stage
    # Heads rank only these many token ids (the buffer `draft_vocab`), as HeadDrafter's; None: the whole vocab
    draft_vocab_size: int | None = None
    _prod: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self):
        for name in ("emb_dim", "vocab_size", "n_predict"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if isinstance(self.inner_dim, bool) or not isinstance(self.inner_dim, int) or self.inner_dim < 0:
            raise ValueError(f"inner_dim must be an int >= 0 (0: emb_dim), got {self.inner_dim!r}")
        self.inner_dim = self.inner_dim or self.emb_dim
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}")
        topk = default_top_k(self.n_predict) if self.top_k_tokens_per_head is None else self.top_k_tokens_per_head
        if isinstance(topk, (str, bytes)) or not hasattr(topk, "__len__"):
            raise ValueError(f"top_k_tokens_per_head must be a list of ints, one per stage, got {topk!r}")
        topk = list(topk)
        if len(topk) != self.n_predict:
            raise ValueError(f"top_k_tokens_per_head needs one k per stage (n_predict={self.n_predict}), "
                             f"got {len(topk)}: {topk}")
        vd = self.draft_vocab_size or self.vocab_size
        for k in topk:
            if isinstance(k, bool) or not hasattr(k, "__index__") or not 1 <= k.__index__() <= vd:
                raise ValueError(f"top_k_tokens_per_head entries must be ints in [1, {vd}] (the draft vocabulary), "
                                 f"got {topk}")
        self.top_k_tokens_per_head = [k.__index__() for k in topk]
        self._prod = math.prod(self.top_k_tokens_per_head)
        n = min(8, self._prod) if self.n_candidates is None else self.n_candidates
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self._prod:
            raise ValueError(f"n_candidates must be an int in [1, prod(top_k_tokens_per_head) = {self._prod}], got {n!r}")
        self.n_candidates = n
        if self.tie_weights and self.n_predict < 2:
            raise ValueError("tie_weights shares weights between stages: it needs n_predict >= 2")
        if not isinstance(self.tie_base, bool):
            raise ValueError(f"tie_base must be a bool, got {self.tie_base!r}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("_prod")
        return d


class SpeculatorNorm(nn.Module):
    """fms LayerNormParameterized(use_mean=False, elementwise_scale=True, elementwise_shift=True): an RMS
    norm with a learned scale and shift, in the input's dtype."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return self.weight * rms_normalize(x) + self.bias


def rms_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


@dataclass
class SpeculatorState:
    """A run's drafting state: h [B, emb_dim], the base hidden state of each sequence's last committed
    token (the one the root was predicted from)."""

    device: torch.device
    h: torch.Tensor | None = None
    n_candidates: int | None = None  # set_budget: fewer candidates than the config's (None: all)
    model: object = None  # the base model (tie_base reads its embedding and LM head)
    size: int | None = None  # size_part: most nodes (root included) of the next draft (None: the budget's)


def candidate_trie(root: torch.Tensor, cand: torch.Tensor, trim: bool = False):
    """root [B], candidates [B, n, P] (distinct token suffixes, best first) -> (tokens [B, T], leaf paths
    [B, n, P+1], T): the trie of the suffixes under the root, every prefix one node, nodes by depth then
    by the rank of the first candidate holding the prefix (node 0: the root). Device ops only; T is the
    bound n*P + 1 (unused nodes: padding, token 0) unless trim, which reads the largest trie's size."""
    B, n, P = cand.shape
    dev = cand.device
    same = (cand[:, :, None, :] == cand[:, None, :, :]).long().cumprod(-1)  # [B, c, c', d]: same prefix to depth d
    owner = same.argmax(dim=2)  # [B, n, P] first candidate with c's prefix of depth d+1
    new = owner == torch.arange(n, device=dev)[None, :, None]  # that candidate: a node of its own
    new_by_depth = new.transpose(1, 2).reshape(B, P * n)  # depth-major: BFS order, parents first
    index = new_by_depth.long().cumsum(1).view(B, P, n).transpose(1, 2)  # [B, n, P] node id where new
    node = index.gather(1, owner)  # [B, n, P] node id of every candidate's prefix
    T = n * P + 1
    if trim:
        T = 1 + int(new_by_depth.sum(1).max())
    tokens = torch.zeros(B, n * P + 1, dtype=torch.long, device=dev)
    tokens.scatter_(1, node.reshape(B, -1), cand.reshape(B, -1).long())  # a shared prefix writes one token
    tokens[:, 0] = root
    paths = torch.cat([torch.zeros(B, n, 1, dtype=torch.long, device=dev), node], dim=2)
    return tokens[:, :T], paths, T


class MLPSpeculatorDrafter(Drafter):
    """hk.new_drafter(model, kind="mlp_speculator", n_predict=3, inner_dim=0, top_k_tokens_per_head=None,
    n_candidates=None, tie_weights=False, scale_input=False, tie_base=False, draft_vocab=None); hk.load_drafter
    reads our format and fms-extras' checkpoints."""

    kinds = ("mlp_speculator",)
    config_class = MLPSpeculatorConfig
    # on the CPU, cut each step's tree to its largest trie (a host read costs nothing there); False keeps
    # the bound with padded nodes, the GPU's form (tests run that form on the CPU)
    trim_cpu_trees = True

    def __init__(self, cfg: MLPSpeculatorConfig):
        super().__init__()
        self.config = cfg
        P, E, I, V = cfg.n_predict, cfg.emb_dim, cfg.inner_dim, cfg.vocab_size
        Vd = cfg.draft_vocab_size or V
        shared = 1 if cfg.tie_weights else P
        # nn.Linear's parameters; on a CPU run the stages' GEMVs take the packed kernel with bf16 panels
        # (start): drafting reads every head's [Vd, inner] weight once per step, the bulk of its time
        lin = lambda i, o: Linear(i, o, bias=False, pack_dtype=DRAFT_PACK_DTYPE)  # noqa: E731
        self.proj = nn.ModuleList([lin(E, I)] + [lin(I, I) for _ in range(min(shared, P - 1))])
        self.ln = nn.ModuleList(SpeculatorNorm(I) for _ in range(shared))
        if cfg.tie_base:  # the base model's embedding and LM head (base_head) instead of emb / head
            self.emb = self.head = None
            self.out = nn.ModuleList(lin(I, E) for _ in range(shared))
            self.out_norm = nn.ModuleList(SpeculatorNorm(E) for _ in range(shared))
        else:
            self.emb = nn.ModuleList(nn.Embedding(V, I) for _ in range(shared))
            self.head = nn.ModuleList(lin(I, Vd) for _ in range(shared))
            self.out = self.out_norm = None
        self.base_head = TiedLMHead()
        self.packed = False  # the base head's rows on the packed CPU kernel (start)
        self.state_weight = 0.5 ** (0.5 / P)
        self.emb_weight = math.sqrt((1 - self.state_weight**2) * (I / 2))
        # draft index -> token id (None: the identity over the whole vocabulary)
        self.register_buffer("draft_vocab", torch.arange(Vd) if cfg.draft_vocab_size else None)

    @property
    def kind(self) -> str:
        return "mlp_speculator"

    @property
    def n_predict(self) -> int:
        return self.config.n_predict

    @property
    def num_heads(self) -> int:
        """Tokens drafted per chain (n_predict): the columns of evaluate.head_ranks, as a head drafter's heads."""
        return self.config.n_predict

    # ---- the stages ---------------------------------------------------------------------------------
    def _module(self, i: int) -> int:
        return 0 if self.config.tie_weights else i

    def input_state(self, h: torch.Tensor) -> torch.Tensor:
        """The base hidden state as stage 0 reads it (scale_input: rms_norm(h) / sqrt(2))."""
        return rms_normalize(h) / (2**0.5) if self.config.scale_input else h

    def _base(self, model):
        if model is None:
            raise ValueError("this mlp_speculator has tie_base=True: it reads the base model's embedding and LM "
                             "head, so pass model= (the model it was built for)")
        return model

    def stage(self, i: int, state: torch.Tensor, tokens: torch.Tensor, model=None) -> torch.Tensor:
        """Stage i: state [..., in] and the previous token [...] (the root for stage 0) -> state [..., inner].
        model: the base model (tie_base only)."""
        m = self._module(i)
        z = self._base(model).tok_embeddings(tokens) if self.config.tie_base else self.emb[m](tokens)
        s = self.proj[min(i, 1) if self.config.tie_weights else i](state)
        s = torch.add(s, z, alpha=self.emb_weight / self.state_weight)
        return F.gelu(self.ln[m](s))

    def stage_logits(self, i: int, state: torch.Tensor, model=None) -> torch.Tensor:
        """Stage i's logits over the draft vocabulary (column j: token draft_vocab[j]). model: the base
        model (tie_base only: its LM head's rows, on the packed CPU kernel when drafting on the CPU)."""
        m = self._module(i)
        if not self.config.tie_base:
            return self.head[m](state)
        y = self.out_norm[m](self.out[m](state))
        return self.base_head.logits(self._base(model), self.draft_vocab, y, self.packed)

    def chain_logits(self, h: torch.Tensor, tokens: torch.Tensor, model=None) -> list[torch.Tensor]:
        """Teacher-forced stages (training): h [N, emb_dim] at positions p, tokens [N, n_predict] the true
        x_{p+1}, ..., x_{p+n_predict} -> per stage i the logits [N, Vd] for x_{p+2+i} (fms' forward).
        model: the base model (tie_base only)."""
        state, out = self.input_state(h), []
        for i in range(self.n_predict):
            state = self.stage(i, state, tokens[:, i], model)
            out.append(self.stage_logits(i, state, model))
        return out

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        return index if self.draft_vocab is None else self.draft_vocab[index]

    @torch.no_grad()
    def candidates(self, h: torch.Tensor, root: torch.Tensor, n: int | None = None,
                   model=None) -> tuple[torch.Tensor, torch.Tensor]:
        """fms' generate_suffixes: h [B, emb_dim], root [B] -> (the best n suffixes [B, n, P] (token ids,
        best first; n: the config's n_candidates when None), their summed log-probabilities [B, n] fp32).
        model: the base model (tie_base only)."""
        return self.scored_candidates(h, root, n, model)[:2]

    def scored_candidates(self, h: torch.Tensor, root: torch.Tensor, n: int | None = None, model=None,
                          top_k: list[int] | None = None):
        """candidates() and each suffix token's own log-probability at its prefix [B, n, P] fp32 (they sum to the
        suffix's score): the adaptive budget's confidence signal. top_k: the tokens kept per stage, its length the
        stages run (None: the config's, every stage; sized_draft's for a smaller draft)."""
        cfg = self.config
        n = cfg.n_candidates if n is None else n
        top_k = cfg.top_k_tokens_per_head if top_k is None else top_k
        B = h.shape[0]
        state = self.input_state(h)[:, None, :]  # [B, K, .] with K = 1 prefix so far
        prev = root.long()[:, None]  # [B, K] each prefix's last token
        scores = torch.zeros(B, 1, dtype=torch.float32, device=h.device)
        toks = torch.zeros(B, 1, 0, dtype=torch.long, device=h.device)
        lps = torch.zeros(B, 1, 0, dtype=torch.float32, device=h.device)
        for i, k in enumerate(top_k):
            state = self.stage(i, state, prev, model)  # [B, K, inner]
            lp, idx = F.log_softmax(self.stage_logits(i, state, model).float(), dim=-1).topk(k, dim=-1)  # [B, K, k]
            K = state.shape[1]
            ids = self.token_ids(idx)
            scores = (scores[:, :, None] + lp).reshape(B, K * k)  # suffix (parent, rank) at parent * k + rank
            toks = torch.cat([toks[:, :, None, :].expand(B, K, k, i), ids[..., None]], dim=3).reshape(B, K * k, i + 1)
            lps = torch.cat([lps[:, :, None, :].expand(B, K, k, i), lp[..., None]], dim=3).reshape(B, K * k, i + 1)
            state = state[:, :, None, :].expand(B, K, k, state.shape[-1]).reshape(B, K * k, -1)
            prev = ids.reshape(B, K * k)
        best = scores.topk(n, dim=1).indices  # [B, n], best first
        pick = best[..., None].expand(-1, -1, len(top_k))
        return toks.gather(1, pick), scores.gather(1, best), lps.gather(1, pick)

    def sized_draft(self, nodes: int, n_candidates: int | None = None) -> tuple[list[int], int] | None:
        """The draft of at most `nodes` >= 2 nodes (root included) that size_part asks for, as (top_k per stage run,
        candidates kept), or None where the whole draft fits: c chains of depth d under the root, d = min(n_predict,
        nodes - 1), c = the most that fit (at most the whole draft's candidates and stage 0's top k), stage 0 keeping
        its top c tokens and every later stage its top 1. Why: a stage's work grows with the prefixes it runs (stage i
        runs prod(top_k[:i]) of them, each scored over the draft vocabulary): EPYC VM, 2026-11-29, SmolLM2's shipped
        3 stages at batch 1 took 1.2 / 2.7 / 5.4 ms for depth 1 / 2 / 3, beside a ~6-8 ms plain step, where the
        adaptive budget's cut kept none or one node of most drafts (drafted whole, its trials cost ~1.5 plain steps)."""
        cfg = self.config
        whole_c = cfg.n_candidates if n_candidates is None else n_candidates
        if nodes - 1 >= whole_c * cfg.n_predict:
            return None
        d = max(1, min(cfg.n_predict, nodes - 1))
        c = max(1, min(whole_c, cfg.top_k_tokens_per_head[0], (nodes - 1) // d))
        return [c] + [1] * (d - 1), c

    # ---- the protocol --------------------------------------------------------------------------------
    def check_model(self, model) -> None:
        mc, cfg = model.config, self.config
        if cfg.emb_dim != mc.hidden_size:
            raise ValueError(f"mlp_speculator emb_dim ({cfg.emb_dim}) does not match the model's hidden size "
                             f"({mc.hidden_size}): this speculator was trained for another model")
        if cfg.vocab_size != mc.vocab_size:
            raise ValueError(f"mlp_speculator vocab ({cfg.vocab_size}) does not match the model's ({mc.vocab_size}): "
                             "this speculator was trained for another model")
        if cfg.tie_base and cfg.inner_dim != mc.hidden_size:  # unreachable from new(); a hand-made config
            raise ValueError(f"a tie_base mlp_speculator's stages read the model's embedding: inner_dim "
                             f"({cfg.inner_dim}) must be the hidden size ({mc.hidden_size})")
        check_device_dtype(self, model)

    def resolve_tree(self, tree, device_type: str) -> Tree:
        """The bound on every proposal: n_candidates chains of n_predict under the root."""
        if tree is not None:
            raise ValueError("the mlp_speculator drafter builds its own tree every step; pass tree=None and size it "
                             "with top_k_tokens_per_head / n_candidates")
        c = self.config
        return Tree([[r] + [0] * (d - 1) for r in range(c.n_candidates) for d in range(1, c.n_predict + 1)])

    def prepare(self, model, backends) -> None:
        if self.config.tie_base:  # its stages rank with the base head's rows
            self.base_head.prepare(model, self.draft_vocab, backends is not None and backends.packed_linear)

    def start(self, model, batch_size: int, max_seq_len: int, tree: Tree, backends) -> SpeculatorState:
        self.use_packed_cpu_weights(backends is not None and backends.packed_linear)  # None: fp32 F.linear (tests)
        self.prepare(model, backends)
        return SpeculatorState(model.device, model=model)

    def use_packed_cpu_weights(self, on: bool) -> None:
        """The stages' GEMVs on the packed CPU kernel with bf16 panels (fit.pack_draft_linears); tie_base's
        LM-head rows follow `self.packed`."""
        self.packed = on
        pack_draft_linears(self, on)

    def after_prefill(self, state: SpeculatorState, hidden, lengths) -> None:
        state.h = hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths.long() - 1]

    def after_step(self, state: SpeculatorState, accepted_hidden, accepted_tokens, accept_lengths) -> None:
        n = accept_lengths.long()
        last = accepted_hidden[torch.arange(n.shape[0], device=n.device), (n - 1).clamp(min=0)]
        state.h = torch.where((n > 0)[:, None], last, state.h)  # a finished sequence keeps its state

    def after_plain_step(self, state: SpeculatorState, hidden, root) -> None:
        state.h = hidden  # after_step's last row of one accepted token, every sequence active

    def budget_levels(self, tree: Tree) -> tuple[int, ...]:
        """A plain step, then the bounds of c candidates (c * n_predict + 1 nodes) for c = 1, 2, 4, ... and
        n_candidates: the best c suffixes of the same scoring (the stages' cost does not change with c)."""
        P, n = self.config.n_predict, self.config.n_candidates
        counts = sorted({min(2**i, n) for i in range(n.bit_length() + 1)})
        return (1, *(c * P + 1 for c in counts))

    def set_budget(self, state: SpeculatorState, nodes: int) -> None:
        """Keep the most candidates whose trie fits `nodes` (c * n_predict + 1 <= nodes)."""
        c = min(self.config.n_candidates, (nodes - 1) // self.config.n_predict)
        state.n_candidates = None if c == self.config.n_candidates else c

    def size_part(self, state: SpeculatorState, part: int, nodes: int | None) -> None:
        """Drafter.size_part: the next drafts hold at most `nodes` nodes (sized_draft; None: the budget's whole
        draft)."""
        state.size = nodes

    def propose(self, state: SpeculatorState, root: torch.Tensor, seqlens: torch.Tensor) -> Proposal:
        """The signal for the adaptive budget: each node's probability at its parent (the root's: 1); candidates that
        share a prefix share its nodes, and their tokens' probabilities there are the same."""
        sized = None if state.size is None else self.sized_draft(state.size, state.n_candidates)
        n, top_k = (state.n_candidates, None) if sized is None else (sized[1], sized[0])
        cand, _, lps = self.scored_candidates(state.h, root, n, state.model, top_k)
        tokens, paths, T = candidate_trie(root, cand, trim=self.trim_cpu_trees and state.device.type == "cpu")
        B = cand.shape[0]
        conf = torch.ones(B, paths.shape[1] * (paths.shape[2] - 1) + 1, dtype=torch.float32, device=cand.device)
        conf.scatter_(1, paths[:, :, 1:].reshape(B, -1), lps.exp().reshape(B, -1))
        return Proposal(tokens, TreeBatch.from_paths(paths, T), signal=confidence_class(conf[:, :T]))

    # ---- our format ----------------------------------------------------------------------------------
    @classmethod
    def new(cls, model, kind: str = "mlp_speculator", n_predict: int = 3, inner_dim: int = 0,
            top_k_tokens_per_head=None, n_candidates: int | None = None, tie_weights: bool = False,
            scale_input: bool = False, tie_base: bool = False, draft_vocab=None) -> "MLPSpeculatorDrafter":
        """An untrained speculator for `model` (same device and dtype), initialised as fms' reset_parameters
        (embeddings and linears N(0, 1/sqrt(inner_dim)), norms identity; tie_base: the output norms' scale
        is the model's final norm weight, so the frozen head first sees a final-normed-like state)."""
        if tie_base and inner_dim not in (0, model.config.hidden_size):
            raise ValueError(f"tie_base reads the model's embedding in the stages: inner_dim must be 0 or the hidden "
                             f"size ({model.config.hidden_size}), got {inner_dim}")
        mc = model.config
        cfg = MLPSpeculatorConfig(emb_dim=mc.hidden_size, vocab_size=mc.vocab_size, n_predict=n_predict,
                                  inner_dim=inner_dim, top_k_tokens_per_head=top_k_tokens_per_head,
                                  n_candidates=n_candidates, tie_weights=tie_weights, scale_input=scale_input,
                                  tie_base=tie_base, draft_vocab_size=None if draft_vocab is None else len(draft_vocab))
        d = cls(cfg)
        with torch.no_grad():
            for m in d.modules():
                if isinstance(m, (nn.Embedding, nn.Linear)):
                    nn.init.normal_(m.weight, 0.0, 1 / math.sqrt(cfg.inner_dim))
            for norm in d.out_norm or ():
                norm.weight.copy_(model.norm.weight)
        d = d.to(model.device, model.dtype).eval()
        if draft_vocab is not None:
            d.draft_vocab.copy_(draft_vocab_ids(draft_vocab, mc.vocab_size, model.device))
        return d

    def save(self, path, dtype: torch.dtype | None = None) -> None:
        """config.json ({"format": "hydra_kernels.drafter", "kind": "mlp_speculator", ...config}) +
        model.safetensors (tied weights stored once)."""
        save_ours(self, path, dtype)

    # ---- fms-extras' format --------------------------------------------------------------------------
    @staticmethod
    def recognizes(cfg_dict: dict) -> bool:
        return cfg_dict.get("model_type") == "mlp_speculator"

    @classmethod
    def load_original(cls, path: Path, cfg_dict: dict, model=None) -> "MLPSpeculatorDrafter":
        get = lambda k: cfg_dict.get(k, ORIGINAL_DEFAULTS[k])  # noqa: E731
        try:
            cfg = MLPSpeculatorConfig(emb_dim=get("emb_dim"), vocab_size=get("vocab_size"), n_predict=get("n_predict"),
                                      inner_dim=get("inner_dim"), top_k_tokens_per_head=get("top_k_tokens_per_head"),
                                      n_candidates=get("n_candidates"), tie_weights=bool(get("tie_weights")),
                                      scale_input=bool(get("scale_input")))
        except ValueError as e:
            raise ValueError(f"{path / 'config.json'}: {e}") from e
        raw, source = read_weights(Path(path), ("model.safetensors", "pytorch_model.bin"), "an mlp_speculator config.json")
        sd = _original_to_ours(raw, cfg, source)
        with torch.device("meta"):
            drafter = cls(cfg)
        drafter.load_state_dict(sd, strict=True, assign=True)
        return drafter


def _original_to_ours(raw: dict[str, torch.Tensor], cfg: MLPSpeculatorConfig, source: str) -> dict[str, torch.Tensor]:
    """An original checkpoint's tensors (with or without the "speculator." prefix) -> our state dict, strictly:
    a missing, unexpected or mis-shaped weight is a ValueError naming it; tied copies must be equal."""
    sd, prefix = {}, ""
    for k, v in raw.items():
        name = k[len(PREFIX):] if k.startswith(PREFIX) else k
        if k.startswith(PREFIX):
            prefix = PREFIX
        if name in sd:
            raise ValueError(f"{source}: weight {name!r} appears twice (with and without the {PREFIX!r} prefix)")
        sd[name] = v
    P, E, I, V, tied = cfg.n_predict, cfg.emb_dim, cfg.inner_dim, cfg.vocab_size, cfg.tie_weights
    groups: dict[str, list[str]] = {}  # our key -> the original names holding it (several when tied)
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(P):
        m = 0 if tied else i
        for ours, orig, shape in ((f"emb.{m}.weight", f"emb.{i}.weight", (V, I)),
                                  (f"proj.{min(i, 1) if tied else i}.weight", f"proj.{i}.weight", (I, E if i == 0 else I)),
                                  (f"head.{m}.weight", f"head.{i}.weight", (V, I)),
                                  (f"ln.{m}.weight", f"ln.{i}.weight", (I,)),
                                  (f"ln.{m}.bias", f"ln.{i}.bias", (I,))):
            groups.setdefault(ours, []).append(orig)
            shapes[orig] = shape
    what = (f"an MLPSpeculator with n_predict={P}, emb_dim={E}, inner_dim={I}, vocab_size={V}, "
            f"tie_weights={tied}, scale_input={cfg.scale_input}")
    unexpected = sorted(set(sd) - set(shapes))
    if unexpected:
        raise ValueError(f"{source}: unexpected weight(s) {[prefix + k for k in unexpected]}: not part of {what}")
    out = {}
    for ours, names in groups.items():
        present = [n for n in names if n in sd]
        missing = [n for n in names if n not in sd]
        if missing and (not tied or not present):
            raise ValueError(f"{source}: missing weight {prefix + missing[0]!r} of {what}")
        for n in present:
            if tuple(sd[n].shape) != shapes[n]:
                raise ValueError(f"{source}: weight {prefix + n!r} has shape {list(sd[n].shape)}, expected "
                                 f"{list(shapes[n])} for {what}")
            if not torch.equal(sd[n], sd[present[0]]):
                raise ValueError(f"{source}: tie_weights is true but {prefix + n!r} differs from {prefix + present[0]!r}")
        out[ours] = sd[present[0]]
    return out
