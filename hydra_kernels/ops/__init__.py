"""Public ops. Each checks its inputs, then dispatches to a backend (see ops/backend.py).

The tree ops take one tree for the whole batch (tree_mask [T, T], depths [T], paths [P, D+1]: a static
tree) or a tree per sequence padded to a common T (tree_mask [B, T, T], depths [B, T], paths
[B, P, D+1]: dynamic trees; a padded node sees only itself, has depth 0 and lies on no leaf path, so it
is never accepted; a sequence with fewer leaves has [0, -1, ..., -1] rows). Every backend reads the
shared form in place with batch stride 0 (no per-step expansion or copy).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import reference
from .packed_linear import pack_linear_weight, packed_linear, packed_linear_available
from .backend import BACKENDS, limit, native_available, register, resolve, resolved_name, triton_available

__all__ = ["tree_attention", "check_tree_attention", "lm_head_topk", "hydra_first_layer", "resblock", "lm_head_sample_stats", "typical_accept",
           "lm_head_residual_sample", "rejection_accept",
           "greedy_verify", "typical_verify", "rejection_verify", "commit_kv", "tree_inputs", "pack_linear_weight",
           "packed_linear", "packed_linear_available", "Verification", "BACKENDS", "native_available", "triton_available",
           "reference", "LM_HEAD_TOPK_MAX_K", "rms_norm", "rope_write_kv", "silu_mul"]

register("tree_attention", "reference", reference.tree_attention)
register("greedy_verify", "reference", reference.greedy_verify)
register("typical_verify", "reference", reference.typical_verify)
register("rejection_verify", "reference", reference.rejection_verify)
register("commit_kv", "reference", reference.commit_kv)
register("tree_inputs", "reference", reference.tree_inputs)
register("lm_head_topk", "reference", reference.lm_head_topk)
register("hydra_first_layer", "reference", reference.hydra_first_layer)
register("resblock", "reference", reference.resblock)
register("lm_head_sample_stats", "reference", reference.lm_head_sample_stats)
register("typical_accept", "reference", reference.typical_accept)
register("lm_head_residual_sample", "reference", reference.lm_head_residual_sample)
register("rejection_accept", "reference", reference.rejection_accept)
from .layer_ops import rms_norm, rope_write_kv, silu_mul  # noqa: E402  (registers their reference forms)
from . import native  # noqa: E402  (registers the "native" backend when the extension is built)
from . import triton as _triton_kernels  # noqa: E402,F401  (registers the "triton" backend when triton is installed)


class Verification(NamedTuple):
    """Result of verifying one step's tree, per sequence (all on the device)."""

    accept_lengths: torch.Tensor  # int64 [B]: root + accepted drafted nodes (>= 1)
    accept_indices: torch.Tensor  # int64 [B, D+1]: accepted node indices along the path; -1 after
    next_root: torch.Tensor  # int64 [B]: the base model's token after the last accepted node
    last_node: torch.Tensor  # int64 [B]: last accepted node (its hidden state feeds the drafter)


LM_HEAD_TOPK_MAX_K = 64  # lm_head_topk ranks at most this many tokens (its kernels keep k candidates per tile)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def values_checkable(t: torch.Tensor) -> bool:
    """May an op's precondition read `t`'s values on the host? Only for an eager call on a CPU tensor.
    On a GPU the read would sync the host inside every step (and cannot be captured in a CUDA graph);
    under torch.compile it would break the step's graph (Tensor.item / tolist are graph breaks), so a
    traced step skips it as a GPU step does: the checks on shapes, dtypes and devices (host metadata,
    evaluated once at trace time and guarded) still run, and an eager call of the same function (or
    of the op) checks the values as before."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, *, sm_scale=None, backend="auto"):
    """Attention of T packed tree tokens over a committed prefix plus their tree ancestors.

    Parameters
    ----------
    q : [B, T, Hq, D] queries of the tree nodes (node 0 is the root; T == 1 is plain decode).
    k_cache, v_cache : [B, S_max, Hkv, D] with the tree's K/V already written at rows
        [cache_seqlens[b], cache_seqlens[b] + T). Hq % Hkv == 0 (GQA).
    cache_seqlens : int32/int64 [B], committed prefix length of each sequence.
    tree_mask : bool [T, T] (one tree for the batch) or [B, T, T] (a tree per sequence, padded to a common
        T; a padded node i has only tree_mask[b, i, i]): tree_mask[(b,) i, j] when node j is an ancestor
        of node i or i itself.
    sm_scale : softmax scale, default D ** -0.5.

    Returns
    -------
    [B, T, Hq, D] in q's dtype: node i of sequence b attends to keys [0, seqlens[b]) and to tree keys j
    with tree_mask[(b,) i, j].
    """
    check_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask)
    fn = resolve("tree_attention", backend, q.device)
    return fn(q, k_cache, v_cache, cache_seqlens, tree_mask, sm_scale=sm_scale)


def check_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask) -> None:
    """tree_attention's preconditions (shapes, dtypes, devices; in an eager call on CPU tensors also the
    seqlens values: values_checkable).
    A caller that runs the op on every layer with the same seqlens and mask (Llama.step) checks once
    and then calls the resolved kernel (`resolve("tree_attention", backend, device)`) directly."""
    _check(q.dim() == 4, f"q must be [B, T, Hq, D], got shape {tuple(q.shape)}")
    B, T, Hq, D = q.shape
    _check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
           f"k_cache and v_cache must both be [B, S_max, Hkv, D], got {tuple(k_cache.shape)} and "
           f"{tuple(v_cache.shape)}")
    _check(k_cache.shape[0] == B and k_cache.shape[3] == D,
           f"k_cache {tuple(k_cache.shape)} does not match q {tuple(q.shape)} in batch or head_dim")
    _check(Hq % k_cache.shape[2] == 0, f"Hq={Hq} is not a multiple of Hkv={k_cache.shape[2]}")
    _check(T <= k_cache.shape[1], f"T={T} tree tokens do not fit a cache of {k_cache.shape[1]} rows")
    _check(q.dtype == k_cache.dtype == v_cache.dtype,
           f"q, k_cache, v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    _check(tuple(tree_mask.shape) in ((T, T), (B, T, T)) and tree_mask.dtype == torch.bool,
           f"tree_mask must be bool [T, T] = [{T}, {T}] (one tree) or [B, T, T] = [{B}, {T}, {T}] (a tree per "
           f"sequence), got {tree_mask.dtype} {tuple(tree_mask.shape)}")
    _check(tuple(cache_seqlens.shape) == (B,) and cache_seqlens.dtype in (torch.int32, torch.int64),
           f"cache_seqlens must be int32/int64 [B] = [{B}], got {cache_seqlens.dtype} "
           f"{tuple(cache_seqlens.shape)}")
    devs = {t.device for t in (q, k_cache, v_cache, cache_seqlens, tree_mask)}
    _check(len(devs) == 1, f"all inputs must be on one device, got {sorted(map(str, devs))}")
    if values_checkable(cache_seqlens):  # eager CPU only (values_checkable says why)
        lens = cache_seqlens.tolist()  # B values: cheaper than tensor reductions (this runs once per layer)
        S = k_cache.shape[1]
        for b, n in enumerate(lens):
            _check(0 <= n <= S - T, f"cache_seqlens[{b}] = {n}: the tree's rows [{n}, {n + T}) must lie in the "
                                    f"cache's [0, {S}) (seqlens >= 0, seqlens + T <= S_max)")


def lm_head_topk(x, weight, k, *, backend="auto"):
    """The k best tokens of an LM head, with the logits never materialised (Triton).

    Parameters
    ----------
    x : [..., H] hidden states (e.g. [B, n_nodes, H] for drafting, [B, T, H] for verification).
    weight : [V, H] LM head (any strides: the model's input-major CPU layout works; on the Triton
        backend a draft-vocabulary slice is just a smaller V).
    k : 1 <= k <= 64. k = 1 is the greedy argmax (ties: the lowest token id, like torch.argmax).

    Returns
    -------
    (values fp32 [..., k], indices int64 [..., k]), largest first.
    """
    _check(x.dim() >= 1 and weight.dim() == 2 and x.shape[-1] == weight.shape[1],
           f"x [..., H] and weight [V, H] must share H, got {tuple(x.shape)} and {tuple(weight.shape)}")
    _check(isinstance(k, int) and 1 <= k <= min(LM_HEAD_TOPK_MAX_K, weight.shape[0]),
           f"k must be an int in [1, min({LM_HEAD_TOPK_MAX_K}, V={weight.shape[0]})], got {k!r}")
    _check(x.dtype == weight.dtype, f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    _check(x.device == weight.device, f"x and weight must be on one device, got {x.device} and {weight.device}")
    fn = resolve("lm_head_topk", backend, x.device)
    return fn(x, weight, k)


def hydra_first_layer(h, path_tokens, emb, w_lin, b_lin, w_res, b_res, *, backend="auto"):
    """First ResBlock of a Hydra head without materialising its concatenated input (Triton).

    Parameters
    ----------
    h : [B, H] the drafter's hidden state per sequence.
    path_tokens : int [B, n, d+1] token ids of each node's path from the root (root first).
    emb : [V, H] the base model's input embedding table (rows gathered by id).
    w_lin, w_res : [H, (d+2)H] the block's linear and residual-projection weights; b_lin, b_res : [H] or None.

    Returns
    -------
    [B, n, H] = R x + b_R + SiLU(W x + b_W) with x = cat(h, E(t_0), ..., E(t_d)).
    """
    _check(h.dim() == 2 and path_tokens.dim() == 3 and path_tokens.shape[0] == h.shape[0],
           f"h must be [B, H] and path_tokens [B, n, d+1], got {tuple(h.shape)} and {tuple(path_tokens.shape)}")
    H, D1 = h.shape[1], path_tokens.shape[2]
    _check(not path_tokens.dtype.is_floating_point, f"path_tokens must be integer, got {path_tokens.dtype}")
    _check(emb.dim() == 2 and emb.shape[1] == H, f"emb must be [V, H={H}], got {tuple(emb.shape)}")
    for name, w in (("w_lin", w_lin), ("w_res", w_res)):
        _check(tuple(w.shape) == (H, (D1 + 1) * H),
               f"{name} must be [H, (d+2)H] = [{H}, {(D1 + 1) * H}] for paths of {D1} tokens, got {tuple(w.shape)}")
    for name, b in (("b_lin", b_lin), ("b_res", b_res)):
        _check(b is None or tuple(b.shape) == (H,), f"{name} must be [H={H}] or None, got {getattr(b, 'shape', b)}")
    ts = [t for t in (h, emb, w_lin, w_res, b_lin, b_res) if t is not None]
    _check(len({t.dtype for t in ts}) == 1, f"h, emb and the weights must share a dtype, got {[t.dtype for t in ts]}")
    _check(len({t.device for t in ts + [path_tokens]}) == 1, "all inputs must be on one device")
    fn = resolve("hydra_first_layer", backend, h.device)
    return fn(h, path_tokens, emb, w_lin, b_lin, w_res, b_res)


def resblock(x, weight, bias=None, *, backend="auto"):
    """One H -> H ResBlock of a draft head (the blocks after a Hydra head's first layer, Medusa's blocks),
    fused: matmul, bias, SiLU and the identity residual in one launch (Triton).

    Parameters
    ----------
    x : [..., H] inputs (e.g. [B, n_nodes, H], all nodes of one depth).
    weight : [H, H] the block's linear weight (any strides); bias : [H] or None.

    Returns
    -------
    [..., H] = x + SiLU(x weight^T + bias), in x's dtype.
    """
    _check(x.dim() >= 1 and weight.dim() == 2 and tuple(weight.shape) == (x.shape[-1], x.shape[-1]),
           f"weight must be [H, H] with H = x.shape[-1] = {x.shape[-1]}, got {tuple(weight.shape)}")
    _check(bias is None or tuple(bias.shape) == (x.shape[-1],), f"bias must be [H={x.shape[-1]}] or None")
    ts = [t for t in (x, weight, bias) if t is not None]
    _check(len({t.dtype for t in ts}) == 1, f"x, weight and bias must share a dtype, got {[t.dtype for t in ts]}")
    _check(len({t.device for t in ts}) == 1, "x, weight and bias must be on one device")
    fn = resolve("resblock", backend, x.device)
    return fn(x, weight, bias)


def _check_paths(paths, B: int, T: int, device) -> None:
    """paths: int64 leaf paths [P, D+1] (one tree) or [B, P, D+1] (a tree per sequence), -1 padded."""
    _check(paths.dtype == torch.long and paths.dim() in (2, 3) and paths.shape[-1] >= 1
           and (paths.dim() == 2 or paths.shape[0] == B),
           f"paths must be int64 [P, D+1] leaf paths (Tree.paths) or [B={B}, P, D+1] (a tree per sequence), "
           f"got {paths.dtype} {tuple(paths.shape)}")
    _check(paths.device == device, f"paths on {paths.device}, the tree's other inputs on {device}")
    if values_checkable(paths):  # eager CPU only (values_checkable says why)
        top = int(paths.max())
        _check(top < T, f"paths index node {top} but the tree has {T} nodes")


def _check_tree_inputs(tree_tokens, paths):
    _check(tree_tokens.dim() == 2 and not tree_tokens.dtype.is_floating_point,
           f"tree_tokens must be integer [B, T], got {tree_tokens.dtype} {tuple(tree_tokens.shape)}")
    _check_paths(paths, tree_tokens.shape[0], tree_tokens.shape[1], tree_tokens.device)


def greedy_verify(target_tokens, tree_tokens, paths, *, backend="auto") -> Verification:
    """Greedy acceptance of one step's tree.

    target_tokens [B, T]: the base model's argmax after each tree node; tree_tokens [B, T]: the drafted
    tokens (node 0 = root); paths int64 [P, D+1]: the tree's leaf paths (Tree.paths, -1 padded), or
    [B, P, D+1], a tree per sequence. Node j is accepted when tree_tokens[j] == target_tokens[parent(j)]
    and its parent is accepted; the longest accepted path wins (first in `paths` on a tie) and
    next_root = target_tokens[last node]. Returns a Verification (accept_indices [B, D+1]).
    """
    _check_tree_inputs(tree_tokens, paths)
    _check(target_tokens.shape == tree_tokens.shape,
           f"target_tokens {tuple(target_tokens.shape)} must match tree_tokens {tuple(tree_tokens.shape)}")
    fn = resolve("greedy_verify", backend, tree_tokens.device)
    return Verification(*fn(target_tokens, tree_tokens, paths))


def typical_verify(logits, tree_tokens, paths, *, temperature, posterior_threshold=0.09, posterior_alpha=0.3,
                   generator=None, backend="auto") -> Verification:
    """Typical acceptance (Medusa's criterion) of one step's tree; see reference.typical_verify.

    logits [B, T, V]: base logits after each node; tree_tokens [B, T]; paths int64 [P, D+1] or
    [B, P, D+1] (a tree per sequence); temperature > 0; the next root is sampled with `generator` from
    the distribution after the last accepted node.
    """
    _check_tree_inputs(tree_tokens, paths)
    _check(logits.dim() == 3 and logits.shape[:2] == tree_tokens.shape,
           f"logits must be [B, T, V] with [B, T] = {tuple(tree_tokens.shape)}, got {tuple(logits.shape)}")
    _check(temperature > 0, f"typical acceptance needs temperature > 0, got {temperature}")
    fn = resolve("typical_verify", backend, tree_tokens.device)
    return Verification(*fn(logits, tree_tokens, paths, temperature, posterior_threshold, posterior_alpha, generator))


def rejection_verify(logits, tree_tokens, paths, *, temperature, top_k=0, top_p=1.0, generator=None,
                     draft_probs=None, noise=None, backend="auto") -> Verification:
    """Lossless acceptance of one step's tree by recursive rejection sampling: the emitted tokens are
    distributed exactly as plain sampling with the same temperature / top_k / top_p
    (sampling.sampling_probs); see reference.rejection_verify for the rules and why they are exact.

    logits [B, T, V]: base logits after each node; tree_tokens int64 [B, T] (fixed before this call's
    random draws); paths int64 [P, D+1] or [B, P, D+1] (a tree per sequence), nodes numbered so that a
    parent precedes its children, siblings tried in index order; temperature > 0; top_k >= 0 (0: off);
    0 < top_p <= 1; generator on logits' device seeds the draws (reproducible).
    draft_probs: None (deterministic drafts: a child with token x is accepted with probability
    residual(x)) or float32/float64 [B, T, V] for sampled drafts: row j is the distribution q_j node j's
    token was drawn from (children drawn i.i.d. from their parent's draft distribution share one row;
    a deterministic child is a one-hot row), accepted with probability min(1, residual(x) / q_j(x)).
    Rows of the root and of padded nodes are ignored; the other rows must be distributions holding
    their node's token (checked in eager calls on CPU tensors: values_checkable). Sampled drafts run the
    reference walk (a [B, V] residual per step).
    noise: None (the generator draws) or (u float [B, T], u_root float [B]): the caller's uniforms in [0, 1)
    (device-side Philox in a CUDA graph, where a generator cannot be replayed): node j's acceptance draw and
    the next root's inverse-CDF draw.
    """
    _check_tree_inputs(tree_tokens, paths)
    _check(tree_tokens.dtype == torch.long, f"tree_tokens must be int64, got {tree_tokens.dtype}")
    _check(logits.dim() == 3 and logits.shape[:2] == tree_tokens.shape,
           f"logits must be [B, T, V] with [B, T] = {tuple(tree_tokens.shape)}, got {tuple(logits.shape)}")
    _check(temperature > 0, f"rejection sampling needs temperature > 0, got {temperature}")
    _check(isinstance(top_k, int) and top_k >= 0, f"top_k must be an int >= 0, got {top_k!r}")
    _check(0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p!r}")
    if noise is not None:
        B, T = tree_tokens.shape
        _check(isinstance(noise, (tuple, list)) and len(noise) == 2
               and all(torch.is_tensor(x) and x.is_floating_point() and x.device == logits.device for x in noise)
               and tuple(noise[0].shape) == (B, T) and tuple(noise[1].shape) == (B,),
               f"noise must be (u float [B, T] = [{B}, {T}], u_root float [B] = [{B}]) on {logits.device}")
    if draft_probs is None:
        fn = resolve("rejection_verify", backend, tree_tokens.device)
        return Verification(*fn(logits, tree_tokens, paths, temperature, top_k, top_p, generator, noise=noise))
    _check_draft_probs(draft_probs, logits, tree_tokens, paths)
    resolved_name("rejection_verify", backend, tree_tokens.device)  # a bad backend is refused all the same
    return Verification(*reference.rejection_verify(logits, tree_tokens, paths, temperature, top_k, top_p, generator,
                                                    draft_probs, noise))


DRAFT_PROBS_SUM_TOL = 1e-4  # |sum(q_j) - 1| allowed for a drafted node's row of draft_probs


def _check_draft_probs(draft_probs, logits, tree_tokens, paths) -> None:
    """rejection_verify's draft_probs: float [B, T, V] like logits; in an eager call on CPU tensors also its values."""
    _check(torch.is_tensor(draft_probs) and draft_probs.shape == logits.shape
           and draft_probs.dtype in (torch.float32, torch.float64),
           f"draft_probs must be float32/float64 [B, T, V] = {tuple(logits.shape)} like logits (row j: the "
           f"distribution node j's token was drawn from), got {getattr(draft_probs, 'dtype', type(draft_probs))} "
           f"{tuple(getattr(draft_probs, 'shape', ()))}")
    _check(draft_probs.device == logits.device, f"draft_probs on {draft_probs.device}, logits on {logits.device}")
    if not values_checkable(draft_probs):  # eager CPU only (values_checkable says why)
        return
    _check(bool((draft_probs >= 0).all()), "draft_probs must be probabilities: >= 0, no NaN")  # NaN >= 0 is False
    parents, _ = reference.tree_structure_from_paths(reference.per_sequence(paths, logits.shape[0], 2),
                                                     logits.shape[1])
    drafted = parents >= 0  # [B, T]: the nodes that are tried (not the root, not padding)
    sums = draft_probs.sum(-1)  # [B, T]; inf fails here in a drafted row, and is ignored elsewhere
    bad = drafted & ((sums - 1).abs() > DRAFT_PROBS_SUM_TOL)
    if bool(bad.any()):
        b, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"draft_probs[{b}, {j}] sums to {float(sums[b, j]):.6g}: each drafted node's row must be "
                         f"the distribution its token was drawn from (sum 1 within {DRAFT_PROBS_SUM_TOL})")
    q_x = draft_probs.gather(2, tree_tokens[:, :, None])[:, :, 0]  # [B, T]
    bad = drafted & (q_x <= 0)
    if bool(bad.any()):
        b, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"tree_tokens[{b}, {j}] = {int(tree_tokens[b, j])} has probability 0 under draft_probs[{b}, "
                         f"{j}], the distribution it was drawn from: the draft and its draft_probs disagree")


def _check_sampling_lm_head(x, weight, temperature, seed) -> None:
    """The LM-head sampling ops' shared arguments: x [..., H] and weight [V, H] of one dtype, temperature
    > 0, seed an int64 tensor [1] on x's device."""
    _check(x.dim() >= 1 and weight.dim() == 2 and x.shape[-1] == weight.shape[1],
           f"x [..., H] and weight [V, H] must share H, got {tuple(x.shape)} and {tuple(weight.shape)}")
    _check(temperature > 0, f"temperature must be > 0, got {temperature}")
    _check(x.dtype == weight.dtype, f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    _check(torch.is_tensor(seed) and seed.numel() == 1 and seed.dtype == torch.int64 and seed.device == x.device,
           "seed must be an int64 tensor of one element on x's device")


def lm_head_sample_stats(x, weight, temperature, seed, *, backend="auto"):
    """Per row of x [..., H], with z = x weight^T / temperature: (lse fp32 [...], entropy fp32 [...],
    sample int64 [...] drawn from softmax(z)), in one pass over the vocabulary (Triton: the logits are
    never written). weight [V, H]; temperature > 0; seed int64 tensor [1] on x's device (no host read)."""
    _check_sampling_lm_head(x, weight, temperature, seed)
    fn = resolve("lm_head_sample_stats", backend, x.device)
    return fn(x, weight, temperature, seed)


def typical_accept(lse, entropy, child_logits, samples, paths, *, posterior_threshold=0.09, posterior_alpha=0.3,
                   backend="auto") -> Verification:
    """Typical acceptance from LM-head statistics (no [B, T, V] logits): lse, entropy, child_logits
    (reference.child_logits), samples, all [B, T]; paths int64 [P, D+1] or [B, P, D+1] (a tree per
    sequence). Same acceptance as typical_verify; the next root is samples[b, last accepted node].
    One Triton launch for the batch."""
    _check(lse.dim() == 2 and lse.shape == entropy.shape == child_logits.shape == samples.shape,
           f"lse, entropy, child_logits, samples must all be [B, T], got {tuple(lse.shape)}, {tuple(entropy.shape)}, "
           f"{tuple(child_logits.shape)}, {tuple(samples.shape)}")
    _check(int(lse.shape[1]) >= 1, "need at least the root")
    _check_paths(paths, lse.shape[0], lse.shape[1], lse.device)
    fn = resolve("typical_accept", backend, lse.device)
    return Verification(*fn(lse, entropy, child_logits, samples, paths, posterior_threshold, posterior_alpha))


def lm_head_residual_sample(x, weight, temperature, seed, exclude, *, backend="auto"):
    """Per row of x [..., H], with z = x weight^T / temperature: (lse fp32 [...], sample int64 [...]
    drawn from softmax(z) with the tokens exclude[row] removed), in one pass over the vocabulary
    (Triton: the logits are never written). weight [V, H]; temperature > 0; seed int64 tensor [1] on
    x's device (no host read); exclude int64 [..., C] token ids, -1 padded, C < V (a token always
    remains). The draw is a Gumbel-max over counter-based noise (reference.lm_head_residual_sample):
    every backend draws the same token from the same seed. Rejection sampling's residual draw
    (rejection_accept) with exclude = a node's children's tokens (reference.child_tokens)."""
    _check_sampling_lm_head(x, weight, temperature, seed)
    V = weight.shape[0]
    _check(torch.is_tensor(exclude) and exclude.dtype == torch.int64 and exclude.dim() == x.dim()
           and exclude.shape[:-1] == x.shape[:-1] and exclude.shape[-1] < V,
           f"exclude must be int64 [..., C] with [...] = {tuple(x.shape[:-1])} and C < V = {V}, got "
           f"{getattr(exclude, 'dtype', type(exclude))} {tuple(getattr(exclude, 'shape', ()))}")
    _check(exclude.device == x.device, f"exclude is on {exclude.device}, x on {x.device}")
    if values_checkable(exclude) and exclude.numel():  # eager CPU only (values_checkable says why)
        _check(bool(((exclude >= -1) & (exclude < V)).all()), f"exclude must hold token ids in [0, V = {V}) or -1")
    fn = resolve("lm_head_residual_sample", backend, x.device)
    return fn(x, weight, temperature, seed, exclude)


def rejection_accept(lse, child_logits, samples, uniforms, tree_tokens, parents, *, depth,
                     backend="auto") -> Verification:
    """Lossless acceptance by recursive rejection sampling (temperature only: no top-k / top-p) from
    LM-head statistics, no [B, T, V] probabilities: the walk of rejection_verify with
    p(x | node) = exp(z_x - lse[node]), the next root the residual draw samples[b, last node]; see
    reference.rejection_accept. One Triton launch for the batch.

    lse fp32 [B, T] and samples int64 [B, T] (lm_head_residual_sample with exclude = child_tokens),
    child_logits [B, T] (reference.child_logits), uniforms fp32 [B, T] in [0, 1) (one acceptance draw
    per node), tree_tokens int64 [B, T], parents int64 [T] or [B, T] (-1: root, padding; a parent
    precedes its children), depth: the tree's depth D (accept_indices is [B, D+1]).
    """
    _check(lse.dim() == 2 and lse.shape == child_logits.shape == samples.shape == uniforms.shape == tree_tokens.shape,
           f"lse, child_logits, samples, uniforms, tree_tokens must all be [B, T], got {tuple(lse.shape)}, "
           f"{tuple(child_logits.shape)}, {tuple(samples.shape)}, {tuple(uniforms.shape)}, {tuple(tree_tokens.shape)}")
    B, T = lse.shape
    _check(T >= 1, "need at least the root")
    for name, t, dt in (("lse", lse, torch.float32), ("child_logits", child_logits, torch.float32),
                        ("uniforms", uniforms, torch.float32), ("samples", samples, torch.int64),
                        ("tree_tokens", tree_tokens, torch.int64), ("parents", parents, torch.int64)):
        _check(t.dtype == dt, f"{name} must be {dt}, got {t.dtype}")
        _check(t.device == lse.device, f"{name} is on {t.device}, lse on {lse.device}")
    _check(tuple(parents.shape) in ((T,), (B, T)),
           f"parents must be [T] = [{T}] (one tree) or [B, T] = [{B}, {T}] (a tree per sequence), got "
           f"{tuple(parents.shape)}")
    _check(isinstance(depth, int) and 0 <= depth < T, f"depth must be an int in [0, T = {T}), got {depth!r}")
    if values_checkable(parents):  # eager CPU only (values_checkable says why)
        node = torch.arange(T)
        _check(bool((parents < node).all()) and bool((parents >= -1).all()),
               "parents[j] must be -1 or a node index < j (children come after their parents)")
        par = parents.expand(B, T)
        level = torch.zeros(B, T, dtype=torch.long)
        for j in range(1, T):
            level[:, j] = torch.where(par[:, j] >= 0, level.gather(1, par[:, j:j + 1].clamp(min=0))[:, 0] + 1, 0)
        _check(int(level.max()) <= depth, f"the tree is {int(level.max())} deep, more than depth = {depth}")
    fn = resolve("rejection_accept", backend, lse.device)
    return Verification(*fn(lse, child_logits, samples, uniforms, tree_tokens, parents, depth))


def commit_kv(kv_cache, cache_seqlens, accept_indices, accept_lengths, *, backend="auto") -> None:
    """Move each sequence's accepted tree rows down to follow its committed prefix, in place.

    kv_cache [n_layers, 2, B, S_max, Hkv, D]; cache_seqlens int [B]; accept_indices int [B, K+1];
    accept_lengths int [B]. For every layer, K and V: row seqlens[b] + accept_indices[b, i] ->
    row seqlens[b] + i for i < accept_lengths[b] (sources are read before anything is written).
    Does not change cache_seqlens. Requires seqlens[b] + K + 1 <= S_max.
    """
    _check(kv_cache.dim() == 6 and kv_cache.shape[1] == 2,
           f"kv_cache must be [n_layers, 2, B, S_max, Hkv, D], got {tuple(kv_cache.shape)}")
    B = kv_cache.shape[2]
    _check(accept_indices.dim() == 2 and accept_indices.shape[0] == B,
           f"accept_indices must be [B={B}, K+1], got {tuple(accept_indices.shape)}")
    _check(tuple(accept_lengths.shape) == (B,) and tuple(cache_seqlens.shape) == (B,),
           f"accept_lengths and cache_seqlens must be [B={B}], got {tuple(accept_lengths.shape)} and "
           f"{tuple(cache_seqlens.shape)}")
    for name, t in (("cache_seqlens", cache_seqlens), ("accept_indices", accept_indices),
                    ("accept_lengths", accept_lengths)):
        _check(t.dtype in (torch.int32, torch.int64), f"{name} must be int32 or int64, got {t.dtype}")
        _check(t.device == kv_cache.device, f"{name} is on {t.device}, kv_cache on {kv_cache.device}")
    name = resolved_name("commit_kv", backend, kv_cache.device)
    rows = limit("commit_kv", name, "accepted_rows")
    K1 = accept_indices.shape[1]
    _check(rows is None or K1 <= rows, f"the {name} commit_kv moves at most {rows} rows per sequence, got "
                                       f"accept_indices [B, {K1}]")
    if values_checkable(kv_cache):  # eager CPU only (values_checkable says why)
        S = kv_cache.shape[3]
        s, n = cache_seqlens.long(), accept_lengths.long()
        _check(bool(((n >= 0) & (n <= K1)).all()), f"accept_lengths must lie in [0, K+1 = {K1}], got {n.tolist()}")
        _check(bool(((s >= 0) & (s + n <= S)).all()),
               f"cache_seqlens + accept_lengths must lie in [0, S_max = {S}], got seqlens {s.tolist()} and "
               f"accept_lengths {n.tolist()}")
        used = torch.arange(K1) < n[:, None]  # [B, K+1]: the rows each sequence moves
        src = s[:, None] + accept_indices.long()
        _check(bool((~used | ((accept_indices >= 0) & (src < S))).all()),
               f"accept_indices name a row outside [seqlens[b], S_max = {S}) among the first accept_lengths[b] "
               "entries of a sequence")
    fn = resolve("commit_kv", name, kv_cache.device)
    fn(kv_cache, cache_seqlens, accept_indices, accept_lengths)


def tree_inputs(root, candidates, node_source, depths, cache_seqlens, *, backend="auto"):
    """The verify step's inputs from the drafter's candidates, on the device.

    root [B]; candidates [B, C] (the drafter's per-depth top-k tokens, concatenated); node_source int64
    [T] (index into candidates of each node; node 0 ignored: it is the root); depths [T] (one tree) or
    [B, T] (a tree per sequence); cache_seqlens [B]. Returns tokens int64 [B, T] (node 0 = root, node
    t = candidates[b, node_source[t]]) and positions int64 [B, T] = seqlens[b] + depths[(b,) t].
    """
    _check(root.dim() == 1 and candidates.dim() == 2 and candidates.shape[0] == root.shape[0],
           f"root must be [B] and candidates [B, C], got {tuple(root.shape)} and {tuple(candidates.shape)}")
    B, T = root.shape[0], node_source.shape[-1]
    _check(node_source.dim() == 1 and tuple(depths.shape) in ((T,), (B, T)),
           f"node_source must be [T] and depths [T] or [B, T] = [{B}, {T}], got {tuple(node_source.shape)} and "
           f"{tuple(depths.shape)}")
    _check(tuple(cache_seqlens.shape) == tuple(root.shape), f"cache_seqlens must be [B], got {tuple(cache_seqlens.shape)}")
    _check(not node_source.dtype.is_floating_point, f"node_source must be integer, got {node_source.dtype}")
    if values_checkable(node_source) and T > 1:  # eager CPU only (values_checkable says why)
        C, src = candidates.shape[1], node_source[1:]
        _check(bool(((src >= 0) & (src < C)).all()), f"node_source must index candidates' [0, C = {C}) columns")
    fn = resolve("tree_inputs", backend, root.device)
    return fn(root, candidates, node_source, depths, cache_seqlens)
