"""A minimal hand-written Llama with three entry points on the same weights:

- ``model(input_ids)``: full causal forward without a cache -> logits [B, L, V] (parity tests).
- ``model.prefill(tokens, lengths, cache)``: a right-padded ragged batch fills rows [0, L) of the
  static KV buffer, in chunks of positions (chunked_prefill, prefill_chunk_positions); returns the final hidden state
  at each sequence's last real token.
- ``model.step(tokens, cache, tree_mask, depths)``: T tokens per sequence appended after the
  committed prefix at positions ``seqlens + depths``; attention through ``hk.ops.tree_attention``,
  one tree for the batch or one per sequence.

Each also takes ``capture`` (layer indices k: the residual stream entering layer k, 0 = the token
embeddings), for drafters that read intermediate layers (EAGLE-3): it then returns the pair (its usual
output, those streams concatenated along the last dimension). Without it, nothing changes.

Each runs every TransformerBlock with its own AttentionSite (model/attention.py): none, a prefill
chunk's, or a step's rows / mask / backend.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..ops.backend import BackendPlan, plan_backends
from .attention import AttentionSite, prefill_site
from .config import LlamaConfig
from .decode_stack import run_stack
from .hf_names import hf_to_ours
from .kv_cache import KVCache, attention_rows
from .layers import RMSNorm, TransformerBlock
from ..ops.int8_dot_linear import Int8DotPanels, require_int8_dot_linear
from ..ops.quantized_linear import QuantizedPanels, quantized_linear_available
from .packed_linear import Linear, packed_linear_available
from .quantized_embedding import QuantizedEmbedding
from .rope import RopeCache


# Prefill tokens (batch x positions) per chunk, per device type (absent: the prompt in one piece). On the
# CPU a prefill in one piece allocates activations of ~30 KB per token per layer (the MLP's [N, 2I] alone
# is 12 KB); past glibc's mmap threshold each is mapped fresh from the kernel and page-faulted in, every
# layer: a 16 x 2048-token prefill took 55-65 s, 16M page faults and 35-44 s of system time (2 cores).
# Chunks of ~2k tokens reuse the same heap memory and stay in cache; attention over the chunks costs what
# one causal pass costs (two flash-attention parts, attention.suffix_causal_attention). A GPU keeps one
# piece: no page faults there, and one causal kernel call is its fastest prefill.
PREFILL_CHUNK_TOKENS = {"cpu": 2048}


def prefill_chunk_positions(device: torch.device, batch: int, length: int, chunk_tokens: int | None = None) -> int:
    """Positions per prefill chunk for a [batch, length] prompt on `device` (at least 1; length = one
    piece). chunk_tokens overrides the device's token budget."""
    budget = chunk_tokens or PREFILL_CHUNK_TOKENS.get(device.type)
    if budget is None:
        return max(1, length)
    return max(1, min(length, budget // max(batch, 1)))


def chunked_prefill(run_chunk, lengths: torch.Tensor, length: int, *, all_rows: bool = False,
                    chunk_tokens: int | None = None) -> list:
    """The chunk loop of a prefill, for any stack of layers that fills a static KV buffer from row 0: the
    base model's, and a drafter's own layers over the prompts after it (EAGLE, Amphista, Hydra++'s
    prefix layer), which would otherwise attend over the whole prompt as one dense tree-masked chunk.

    run_chunk(s, e, site) runs positions [s, e) of every sequence of the right-padded batch (rows [0, s)
    already written; site: the chunk's AttentionSite) and returns a list of outputs [B, e - s, *] (an
    entry may be None). lengths [B]: real positions per sequence; length: the padded length. Returns
    the list with each output at each sequence's last real position [B, *], or with all_rows=True at
    every position [B, length, *]."""
    B = lengths.shape[0]
    step = prefill_chunk_positions(lengths.device, B, length, chunk_tokens)
    last = (lengths.long() - 1).clamp(min=0)  # [B]: each sequence's last real position
    bidx = torch.arange(B, device=lengths.device)
    kept = None  # per output: every chunk's rows (all_rows), or the last real rows seen so far
    for s in range(0, length, step):
        e = min(length, s + step)
        outs = run_chunk(s, e, prefill_site(s))
        if all_rows:
            kept = [[o] for o in outs] if kept is None else [k + [o] for k, o in zip(kept, outs)]
            continue
        here = (last >= s) & (last < e)  # [B]: sequences whose last real position is in this chunk
        at = (last - s).clamp(0, e - s - 1)
        rows = [None if o is None else o[bidx, at] for o in outs]
        kept = rows if kept is None else [None if r is None else torch.where(here[:, None], r, k)
                                          for r, k in zip(rows, kept)]
    if not all_rows:
        return kept
    return [None if k[0] is None else (k[0] if len(k) == 1 else torch.cat(k, dim=1)) for k in kept]


class _SkipInit(torch.overrides.TorchFunctionMode):
    """Inside it the layers' init functions leave their tensors as they are (Llama.empty). A torch function
    mode is thread-local: other threads keep their initialisation."""

    SKIPPED = frozenset(getattr(torch.nn.init, n) for n in ("normal_", "uniform_", "kaiming_uniform_",
                                                             "trunc_normal_", "ones_", "zeros_"))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.SKIPPED:  # init.f(tensor, ...): the tensor, passed by position or by name
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self._rope = RopeCache(config)

    # ---- construction ---------------------------------------------------------------------------
    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        # a quantized embedding and LM head (quantized_embedding.py) each bring their fp32 values back for
        # .to(): tied, they share one copy again
        self.tie_weights()
        return out

    @classmethod
    def empty(cls, config: LlamaConfig) -> "Llama":
        """A Llama of meta parameters (shapes and dtypes only) for a loader to assign weights to, built
        without the layers' random initialisation: on the meta device torch routes init.normal_ through its
        Python refs, which import torch._dynamo and with it Triton, ~90 MB of resident memory in a CPU
        process that then runs neither."""
        with torch.device("meta"), _SkipInit():
            return cls(config)

    @classmethod
    def from_hf_state_dict(cls, config: LlamaConfig, hf_sd: dict[str, torch.Tensor], *, dtype=None,
                           device=None) -> "Llama":
        """A Llama holding the given HF-named weights (model/hf_names.py), without a throwaway random
        initialisation; on the CPU with the CPU layouts (input-major, packed) applied."""
        model = cls.empty(config)
        sd = hf_to_ours(config, hf_sd)
        if dtype is not None or device is not None:
            sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
        model.load_state_dict(sd, strict=False, assign=True)
        model.tie_weights()  # assign=True replaced the shared Parameter
        still_meta = [n for n, p in model.named_parameters() if p.is_meta]
        if still_meta:
            raise ValueError(f"checkpoint did not provide {still_meta[:5]}")
        if model.device.type == "cpu":
            # Input-major weights: MKL's M = 1 GEMV streams them ~2x faster (the fallback where the packed
            # kernel is unavailable). Then the packed small-M kernel for decode and verify steps: as fast as
            # MKL at M = 1 (~24 GB/s on 2 cores) and ~1.1x, not ~2x, the M = 1 time at M = 6 (a 6-node tree
            # verify step), with every row bit-identical to its M = 1 result (model/packed_linear.py).
            model.use_input_major_weights()
            model.use_packed_cpu_weights()
        return model.eval()

    @classmethod
    def from_hf(cls, hf_model) -> "Llama":
        """Our Llama on the weights of a transformers ``LlamaForCausalLM`` (same dtype and device)."""
        config = LlamaConfig.from_hf_dict(hf_model.config.to_dict())
        return cls.from_hf_state_dict(config, {k: v.detach() for k, v in hf_model.state_dict().items()})

    def use_input_major_weights(self) -> "Llama":
        """CPU layout choice: store every projection weight [out, in] as an [in, out] buffer seen
        through a transposed view. Shapes, names and the math are unchanged; on the CPU the M = 1
        GEMV of decoding then streams weights about 2x faster (MKL, measured: LM head 11 -> 23 GB/s,
        whole decode step ~1.7x), because decoding is bound by reading the weights from DRAM."""
        for mod in self.modules():
            if isinstance(mod, nn.Linear) and mod.weight.is_contiguous() and not mod.weight.is_meta:
                mod.weight.data = mod.weight.data.t().contiguous().t()
        self.tie_weights()
        return self

    def use_packed_cpu_weights(self) -> bool:
        """CPU speed choice: store every projection weight packed for the native kernel
        (model/packed_linear.py), the only copy of it (release_original; prefill runs the packed kernel
        too, its rows bit-identical to decode rows); the LM head is kept as is beside its packed copy (the
        ops and tied drafters read it; tied, it is the embedding). Returns False (and changes nothing)
        where the extension or its AVX-512 path is missing."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or not packed_linear_available():
            return False
        for mod in self.modules():
            if isinstance(mod, Linear):
                mod.pack_cpu()
                if mod is not self.output:  # the LM head's weight is read by the ops and tied drafters
                    mod.release_original()  # the panels are then the only copy (model/packed_linear.py)
        return True

    def use_quantized_cpu_weights(self, panels: dict[str, QuantizedPanels]) -> bool:
        """CPU layout choice for a quantized checkpoint (model/gguf_quantized.py): each named weight runs on
        its quantized panels (ops/quantized_linear.py), the only copy of it, except an LM head loaded with an
        fp32 weight (a caller's), which keeps it beside panels of the same values. Returns False (and changes
        nothing) where the kernel has no vector path on this CPU."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or not quantized_linear_available():
            return False
        for name, p in panels.items():
            mod = self.get_submodule(name.rsplit(".", 1)[0])
            # the LM head keeps its fp32 weight beside the panels where one is loaded; a GGUF's (tied or not)
            # loads none (model/gguf_quantized.py): the panels are all of it
            mod.use_quantized(p, keep_weight=mod is self.output and not self.output.weight.is_meta)
        return True

    def use_int8_activations(self) -> int:
        """CPU arithmetic choice for a model on quantized panels (a quantized GGUF, or weights="int8" / "int4"):
        every quantized projection, the LM head included, rounds its input to int8 per weight group and sums the
        products in integers (ops/int8_dot_linear.py, AVX-512 VNNI or AVX2), llama.cpp's scheme: ~2-3x faster projections at
        the step's few rows, and another model than the exact one (its tokens can differ from the fp32 model's;
        greedy speculative decoding still emits exactly its own plain decoding's tokens). The embedding and the
        drafters' LM-head rows keep the exact values (the head keeps its exact layout beside the dot one; a layer keeps
        only the dot layout: one copy of its weight). Where a layer would not run its panels (autograd, a tensor off
        the CPU, packed_kernel_off) it takes F.linear on the exact dequantized weight, as before. Returns the number
        of layers converted; raises where this CPU has neither AVX-512 VNNI nor AVX2, or the model holds no quantized
        panels."""
        require_int8_dot_linear()
        mods = [m for m in self.modules() if isinstance(m, Linear) and isinstance(m._panels, QuantizedPanels)]
        if not mods:
            raise ValueError("int8 activations run on quantized weights: load a quantized GGUF (weights='quantized') "
                             "or an HF directory with weights='int8' / 'int4'")
        return sum(m.use_int8_activations(keep_exact=m is self.output) for m in mods)

    # ---- properties -----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.norm.weight.device  # (a quantized embedding's weight is a meta placeholder)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's fp32 values [V, H] (tied: the embedding's). Where quantized panels are the only copy
        (a quantized GGUF on the CPU: model/gguf_quantized.py) a transient copy, ~113 MB for SmolLM2:
        callers that need a few rows take lm_head_rows."""
        return self.output.unpacked_weight() if self.output.released else self.output.weight

    def embedding_weight(self) -> torch.Tensor:
        """The token embedding's fp32 table [V, H] (a transient copy where a quantized embedding serves it from
        panels: model/quantized_embedding.py; lookups of a few rows take tok_embeddings(ids))."""
        emb = self.tok_embeddings
        return emb.dense() if isinstance(emb, QuantizedEmbedding) else emb.weight

    def lm_head_quantized(self) -> QuantizedPanels | None:
        """The LM head's quantized panels where they hold it (a quantized GGUF on the CPU), else None: always the exact
        kernel's (an int8-activation head's exact layout), so the drafters' logits over its rows are the same whenever
        use_int8_activations ran."""
        p = self.output.packed_weight() if self.output.released else None
        if isinstance(p, Int8DotPanels):
            return p.exact()
        return p if isinstance(p, QuantizedPanels) else None

    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The LM head's rows ids int64 [n] -> [n, H], their exact values, without a copy of the whole head."""
        p = self.lm_head_quantized()
        if p is not None:
            return p.rows(ids.reshape(-1).long().cpu()).to(ids.device)
        w = self.lm_head_weight().detach()
        return w.index_select(0, ids.to(w.device))

    def lm_head_source(self) -> torch.Tensor:
        """A tensor that changes (identity or version) whenever the LM head's values do: the key of caches
        derived from it (weight_cache.DerivedCache)."""
        if self.output.released:
            p = self.output.packed_weight()
            return p.packed if isinstance(p, QuantizedPanels) else p
        return self.output.weight

    @property
    def has_packed_weights(self) -> bool:
        """The LM head (and, with it, every projection) runs the native packed kernel (use_packed_cpu_weights):
        a model packed on the CPU and then moved to a GPU keeps its packed_on flags but runs F.linear there
        (H100, 2026-11-26: the GPU tier found this claiming True on CUDA)."""
        return self.output.packed_on and (self.output.weight.is_cpu or self.output.released)

    def backend_plan(self, backends: BackendPlan | str | None = None) -> BackendPlan:
        """backends as a BackendPlan: a plan is returned as is; a backend name ("auto" | "reference" |
        "triton" | "native"; None: "auto") is resolved for this model's device and packed weights.
        Resolve once per run and pass the plan down (step and greedy_tokens resolve a name on every call)."""
        if isinstance(backends, BackendPlan):
            return backends
        return plan_backends("auto" if backends is None else backends, self.device,
                             packed_weights=self.has_packed_weights)

    def new_kv_cache(self, batch_size: int, max_seq_len: int) -> KVCache:
        return KVCache(self.config, batch_size, max_seq_len, dtype=self.dtype, device=self.device)

    # ---- entry points ---------------------------------------------------------------------------
    def _capturing_layers(self, x, cos, sin, site, kvs, capture: tuple[int, ...]):
        """Every layer, keeping the residual stream entering layer k for each k in `capture` (each in
        [0, num_layers)) -> (the last layer's output, the kept streams concatenated [B, T, len(capture) * H])."""
        kept = {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                kept[i] = x
            x = layer(x, cos, sin, site, None if kvs is None else kvs[i])
        return x, torch.cat([kept[k] for k in capture], dim=-1)

    def check_capture(self, capture) -> tuple[int, ...]:
        """capture as a tuple of distinct layer indices in [0, num_layers) (ValueError otherwise)."""
        capture = tuple(capture)
        L = self.config.num_layers
        if not capture or len(set(capture)) != len(capture) or any(
                not isinstance(k, int) or not 0 <= k < L for k in capture):
            raise ValueError(f"capture must be distinct layer indices in [0, {L}), got {capture}")
        return capture

    def hidden_states(self, input_ids: torch.Tensor, capture=None):
        """Full causal forward, no cache: input_ids [B, L] -> final-normed hidden states [B, L, H]
        (with capture: the pair (them, the captured layers' inputs [B, L, len(capture) * H]))."""
        B, L = input_ids.shape
        x = self.tok_embeddings(input_ids)  # [B, L, H]
        pos = torch.arange(L, device=input_ids.device).expand(B, L)
        cos, sin = self._rope(pos, L, x.dtype)  # [B, L, D]
        if capture is not None:
            x, feats = self._capturing_layers(x, cos, sin, None, None, self.check_capture(capture))
            return self.norm(x), feats
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full causal forward, no cache: input_ids [B, L] -> logits [B, L, V]."""
        return self.output(self.hidden_states(input_ids))

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, cache: KVCache, *, all_hidden: bool = False,
                capture=None, chunk_tokens: int | None = None):
        """Prefill an empty cache with a right-padded ragged batch.

        tokens [B, L] (sequence b is real in [0, lengths[b]), padding after); lengths int [B] on the
        device. Right padding is exact under a causal mask: a real token only sees real tokens before
        it. Writes K/V rows [0, L) of every sequence and sets cache.seqlens = lengths. Runs in chunks of
        positions (prefill_chunk_positions; chunk_tokens overrides the device's tokens per chunk), each
        chunk attending to the rows before it: the same math as one causal pass.
        Returns the final-normed hidden state of each sequence's last real token [B, H], or with
        all_hidden=True the hidden states of every position [B, L, H]. capture (layer indices): the
        pair (that, the captured layers' inputs at the same positions, [B, len(capture) * H] or
        [B, L, len(capture) * H]).
        """
        B, L = tokens.shape
        if L == 0:
            raise ValueError("prefill needs at least one token per sequence (tokens is [B, 0])")
        capture = None if capture is None else self.check_capture(capture)

        def run_chunk(s: int, e: int, site: AttentionSite) -> list:
            x = self.tok_embeddings(tokens[:, s:e])  # [B, e - s, H]
            pos = torch.arange(s, e, device=tokens.device).expand(B, e - s)
            cos, sin = self._rope(pos, e, x.dtype)  # [B, e - s, D]
            feats = None
            if capture is not None:
                x, feats = self._capturing_layers(x, cos, sin, site, cache.layers, capture)
            else:
                for layer, kv in zip(self.layers, cache.layers):
                    x = layer(x, cos, sin, site, kv)
            return [self.norm(x), feats]

        h, feats = chunked_prefill(run_chunk, lengths, L, all_rows=all_hidden, chunk_tokens=chunk_tokens)
        cache.seqlens.copy_(lengths)
        return h if capture is None else (h, feats)

    def step(self, tokens: torch.Tensor, cache: KVCache, tree_mask: torch.Tensor | None = None,
             depths: torch.Tensor | None = None, *, positions: torch.Tensor | None = None, kv_len: int | None = None,
             backends: BackendPlan | str | None = None, capture=None):
        """Append T tokens per sequence after the committed prefix and run them through the model.

        tokens [B, T] (tree nodes in BFS order, node 0 the root). tree_mask bool [T, T] (one tree for
        the batch) or [B, T, T] (a tree per sequence, padded to a common T), ancestor-or-self; default:
        causal chain. depths int [T] or [B, T] (default arange(T)): node i of sequence b sits at
        position seqlens[b] + depths[(b,) i] and is written to cache row seqlens[b] + i.
        Does not move seqlens: committing is the caller's (KVCache.advance for plain decoding, commit_kv
        for trees). positions [B, T]: seqlens[b] + depths precomputed on the device (ops.tree_inputs);
        optional (depths are then unused). kv_len: a host-known bound on seqlens + T (attention reads
        only rows [0, kv_len)). backends: a BackendPlan (tree_attention's entry is used), or a backend
        name resolved here (see backend_plan).
        Returns final-normed hidden states [B, T, H]; with capture (layer indices), the pair (them, the
        captured layers' inputs [B, T, len(capture) * H]).
        """
        B, T = tokens.shape
        dev = tokens.device
        plan = self.backend_plan(backends)
        if tree_mask is None:
            tree_mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril_()
        start = cache.seqlens.long()[:, None]  # [B, 1] first free row of each sequence
        rows = start + torch.arange(T, device=dev)  # [B, T] cache rows of the new tokens
        if positions is None:
            if depths is None:
                depths = torch.arange(T, device=dev)
            elif depths.shape != (T,) and depths.shape != (B, T):
                raise ValueError(f"depths must be [T] = [{T}] or [B, T] = [{B}, {T}], got {tuple(depths.shape)}")
            positions = start + depths.long()  # [B, T]: one depth row for all, or one per sequence
        x = self.tok_embeddings(tokens)  # [B, T, H]
        cos, sin = self._rope(positions, cache.max_seq_len, x.dtype)  # [B, T, D]
        site = AttentionSite(rows, cache.seqlens, tree_mask, attention_rows(kv_len, cache.max_seq_len, dev),
                             plan["tree_attention"], layer_backend=self._layer_ops_backend(plan))
        feats, capture = None, (None if capture is None else self.check_capture(capture))
        stacked = run_stack(self, x, cos, sin, site, cache, capture)  # the CPU's native stack, where it applies
        if stacked is not None:
            x, feats = stacked
        elif capture is not None:
            x, feats = self._capturing_layers(x, cos, sin, site, cache.layers, capture)
        else:
            for layer, kv in zip(self.layers, cache.layers):
                x = layer(x, cos, sin, site, kv)
        if site.layer_kernels is not None:
            x = site.layer_kernels.rms_norm(x, self.norm.weight, self.norm.eps, None)
        else:
            x = self.norm(x)
        return x if capture is None else (x, feats)

    def _layer_ops_backend(self, plan: BackendPlan) -> str:
        """The backend of a step's layer ops (AttentionSite.layer_backend): the plan's, where the model's
        layers are plain (bf16/fp16/fp32 weights in one dtype, no packed or quantized CPU layout: those
        have their own native CPU stack, model/decode_stack.py), else "reference" (the modules)."""
        backend = plan["rms_norm"]
        if backend == "reference" or self.has_packed_weights or self.norm.weight.dtype != self.dtype:
            return "reference"
        return backend

    def greedy_tokens(self, h: torch.Tensor, backends: BackendPlan | str | None = None) -> torch.Tensor:
        """argmax of the LM head for final hidden states h [..., H] -> token ids [...] (first maximum on
        ties). Plain decoding and tree verification both pick tokens here, through one code path.
        backends (a BackendPlan, or a name resolved here): with plan.packed_linear on a packed CPU model,
        the native packed kernel (logits of <= 64 rows, a few MB); otherwise ops.lm_head_topk with k = 1
        on plan["lm_head_topk"] (the fused kernel on Triton: no logits)."""
        plan = self.backend_plan(backends)
        if self.output.bias is not None or (plan.packed_linear and self.has_packed_weights):
            return self.output(h).argmax(dim=-1)
        return ops.lm_head_topk(h, self.lm_head_weight(), 1, backend=plan["lm_head_topk"])[1][..., 0]  # no [.., V] logits
