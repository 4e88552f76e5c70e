"""Pure-PyTorch definitions of every op. Kernels are tested against these; they favour clarity.

Attention math is done in fp32 whatever the input dtype; outputs come back in the input dtype.

Tree buffers come in two forms: one tree shared by the batch (tree_mask [T, T], parents / depths [T],
paths [P, D+1]) or one tree per sequence, padded to a common T (tree_mask [B, T, T], parents / depths
[B, T], paths [B, P, D+1]). A padded node has parent -1, depth 0, only itself in its mask row, and lies on
no leaf path (a sequence with fewer leaves has [0, -1, ..., -1] rows: just the root), so it is never
accepted. Every function here takes either form.
"""
from __future__ import annotations

import torch

from ..sampling import inverse_cdf_sample, sampling_probs
from .philox import philox_uniform


def per_sequence(x: torch.Tensor, batch: int, inner_dims: int) -> torch.Tensor:
    """A tree buffer shared by the batch (inner_dims dims) or one per sequence ([B, ...]) -> [B, ...]
    (the shared one as an expanded view: no copy)."""
    return x.expand(batch, *x.shape[x.dim() - inner_dims:])


def tree_key_mask(cache_seqlens: torch.Tensor, tree_mask: torch.Tensor, s_max: int) -> torch.Tensor:
    """allowed[b, i, j]: may tree node i of sequence b attend to cache row j?  -> bool [B, T, S_max].

    Row j is the committed prefix when j < seqlens[b]; it is tree node j - seqlens[b] when that lies in
    [0, T), allowed when tree_mask[b, i, j - seqlens[b]] (ancestor-or-self); every other row is masked.
    tree_mask: bool [T, T] (shared) or [B, T, T] (per sequence).
    """
    B, T = cache_seqlens.shape[0], tree_mask.shape[-1]
    masks = per_sequence(tree_mask, B, 2)  # [B, T, T]
    pos = torch.arange(s_max, device=cache_seqlens.device)
    start = cache_seqlens.long()[:, None]  # [B, 1]
    rel = pos[None, :] - start  # [B, S]: index into the tree, valid where 0 <= rel < T
    in_prefix = rel < 0
    in_tree = (rel >= 0) & (rel < T)
    node = torch.arange(T, device=tree_mask.device)
    bidx = torch.arange(B, device=tree_mask.device)
    tree_allowed = masks[bidx[:, None, None], node[None, :, None], rel.clamp(0, T - 1)[:, None, :]]  # [B, T, S]
    return in_prefix[:, None, :] | (in_tree[:, None, :] & tree_allowed)


def tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, sm_scale=None):
    """out[b, i, h] = softmax_j(scale * q[b,i,h] . k[b,j,h//G]) v[b,j,h//G] over allowed rows j.

    q [B, T, Hq, D]; k_cache, v_cache [B, S_max, Hkv, D]; cache_seqlens int [B]; tree_mask bool [T, T]
    (shared) or [B, T, T] (per sequence). GQA: query head h reads KV head h // (Hq // Hkv).
    Returns [B, T, Hq, D] in q's dtype.
    """
    B, T, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    scale = D**-0.5 if sm_scale is None else sm_scale
    qf = q.float().reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    kf = k_cache.float().permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hkv, 1, S, D]
    vf = v_cache.float().permute(0, 2, 1, 3).unsqueeze(2)
    scores = (qf @ kf.transpose(-1, -2)) * scale  # [B, Hkv, G, T, S]
    allowed = tree_key_mask(cache_seqlens, tree_mask, S)[:, None, None]  # [B, 1, 1, T, S]
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf  # [B, Hkv, G, T, D]
    return out.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D).to(q.dtype)


def lm_head_topk(x, weight, k):
    """The k largest logits of x @ weight^T and their token ids, without keeping the logits.
    x [..., H], weight [V, H] -> (values fp32 [..., k], indices int64 [..., k]), largest first; for
    k = 1 the index is the first maximum (torch.argmax's tie rule)."""
    logits = torch.nn.functional.linear(x, weight).float()
    if k == 1:
        i = logits.argmax(dim=-1, keepdim=True)
        return logits.gather(-1, i), i
    v, i = logits.topk(k, dim=-1)
    return v, i


def hydra_first_layer(h, path_tokens, emb, w_lin, b_lin, w_res, b_res):
    """First ResBlock of Hydra head d on the nodes of one depth.
    h [B, H]; path_tokens int [B, n, d+1] (each node's path from the root, root first); emb [V, H];
    w_lin, w_res [H, (d+2)H]; b_lin, b_res [H] or None. With x = cat(h, E(t_0), ..., E(t_d)):
    returns R x + b_R + SiLU(W x + b_W), [B, n, H]."""
    B, n, D1 = path_tokens.shape
    x = torch.cat([h[:, None, :].expand(B, n, h.shape[-1]), emb[path_tokens].flatten(2)], dim=-1)
    lin = torch.nn.functional.linear(x, w_lin, b_lin)
    return torch.nn.functional.linear(x, w_res, b_res) + torch.nn.functional.silu(lin)


def resblock(x, weight, bias):
    """A draft head's H -> H ResBlock: x [..., H], weight [H, H], bias [H] or None ->
    x + SiLU(x weight^T + bias), [..., H]."""
    return x + torch.nn.functional.silu(torch.nn.functional.linear(x, weight, bias))


# ---- the base model's layer ops (a decoding step's elementwise work between its GEMMs) -----------------
def rms_norm(x, weight, eps, add=None):
    """RMSNorm as transformers computes it: y = weight * (h / sqrt(mean(h^2) + eps)), the statistic in fp32
    and the normalised row cast back to h's dtype before the weight multiplies it; h = x, or with `add`
    the residual sum h = x + add (in x's dtype). x, add [..., H]; weight [H]. Returns y, or (h, y)."""
    h = x if add is None else x + add
    hf = h.float()
    y = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return y if add is None else (h, y)


def apply_rope(x, cos, sin):
    """x [B, T, H, D] rotated (HF rotate-half layout): x * cos + rotate_half(x) * sin; cos/sin [B, T, D] in
    x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


def rope_write_kv(qkv, cos, sin, kv, rows, n_heads, n_kv_heads):
    """A step's attention inputs from the fused QKV projection. qkv [B, T, n_heads + 2 n_kv_heads, D] (q
    heads, then k, then v); cos/sin [B, T, D] in qkv's dtype; kv [2, B, S, n_kv_heads, D] one layer's cache;
    rows int64 [B, T] the cache row of each new token. Writes kv[0, b, rows[b, t]] = rope(k) and
    kv[1, b, rows[b, t]] = v; returns rope(q) [B, T, n_heads, D]."""
    qk = apply_rope(qkv[:, :, :n_heads + n_kv_heads], cos, sin)
    q, k = qk.split([n_heads, n_kv_heads], dim=2)
    batch = torch.arange(rows.shape[0], device=rows.device)[:, None]
    kv[:, batch, rows] = torch.stack((k, qkv[:, :, n_heads + n_kv_heads:]))
    return q


def silu_mul(gate_up):
    """SwiGLU's elementwise part: gate_up [..., 2I] (the fused W1 | W3 projection) -> silu(gate) * up [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# ---- verification -------------------------------------------------------------------------------
def _node_values(x, nodes):
    """x [B, T] read at node indices nodes [B, P, D] (>= 0) -> [B, P, D]: x[b, nodes[b, p, d]]."""
    return x.gather(1, nodes.flatten(1)).view(nodes.shape)


def _select_path(paths, accepted, score, next_tokens_fn):
    """Shared tail of the verifiers.

    paths [B, P, D+1] node indices (-1 padding); accepted [B, P] accepted drafted nodes along each path;
    score [B, P] tie-break among the longest (higher wins; first path on equal scores).
    Returns (accept_lengths [B], accept_indices [B, D+1] (-1 after the length), next_root [B], last_node [B]).
    """
    longest = accepted == accepted.max(dim=1, keepdim=True).values
    best = torch.where(longest, score, torch.full_like(score, float("-inf"))).argmax(dim=1)  # first max
    accept_len = accepted.gather(1, best[:, None])[:, 0] + 1  # + the root
    idx = paths[torch.arange(paths.shape[0], device=paths.device), best]  # [B, D+1]
    pos = torch.arange(idx.shape[1], device=idx.device)
    idx = torch.where(pos[None, :] < accept_len[:, None], idx, torch.full_like(idx, -1))
    last = idx.gather(1, (accept_len - 1)[:, None])[:, 0]
    return accept_len, idx, next_tokens_fn(last), last


def greedy_verify(target_tokens, tree_tokens, paths):
    """Greedy acceptance. Node j is accepted when its token equals the base argmax after its parent and
    its parent is accepted; the longest accepted root path wins (the first in `paths` on a tie); next
    root = base argmax after its last node. target_tokens [B, T] (base argmax after each node),
    tree_tokens [B, T], paths [P, D+1] (shared) or [B, P, D+1] (per sequence), -1 padded."""
    paths = per_sequence(paths, tree_tokens.shape[0], 2)  # [B, P, D+1]
    nodes = paths.clamp(min=0)  # padding reads node 0; masked by `valid`
    tok, tgt = _node_values(tree_tokens, nodes), _node_values(target_tokens, nodes)
    valid = paths[:, :, 1:] >= 0
    match = (tok[:, :, 1:] == tgt[:, :, :-1]) & valid  # [B, P, D]: node matches the target after its parent
    accepted = match.long().cumprod(dim=-1).sum(dim=-1)  # [B, P]
    score = torch.zeros_like(accepted, dtype=torch.float32)
    return _select_path(paths, accepted, score, lambda last: target_tokens.gather(1, last[:, None])[:, 0])


def typical_verify(logits, tree_tokens, paths, temperature, posterior_threshold=0.09, posterior_alpha=0.3,
                   generator=None):
    """Typical acceptance (Medusa). With p = softmax(logits / temperature) after the parent, node j is
    accepted when p(token_j) > min(posterior_threshold, posterior_alpha * exp(-entropy(p))) and its
    parent is accepted. Among the longest accepted paths, the highest summed log p wins; the next root
    is sampled from p after the last accepted node. logits [B, T, V] (base logits after each node);
    paths [P, D+1] or [B, P, D+1]."""
    B = logits.shape[0]
    paths = per_sequence(paths, B, 2)  # [B, P, D+1]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, T, V]
    probs = logp.exp()
    entropy = -torch.special.xlogy(probs, probs).sum(-1)  # [B, T]; 0 log 0 = 0
    threshold = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)  # [B, T]
    parent = paths[:, :, :-1].clamp(min=0)  # [B, P, D]
    child_tok = _node_values(tree_tokens, paths[:, :, 1:].clamp(min=0))  # [B, P, D]
    bidx = torch.arange(B, device=logits.device)[:, None, None]
    lp = logp[bidx, parent, child_tok]  # [B, P, D] log p(child | parent)
    valid = paths[:, :, 1:] >= 0
    ok = (lp.exp() > _node_values(threshold, parent)) & valid
    accepted_mask = ok.long().cumprod(dim=-1)
    accepted = accepted_mask.sum(dim=-1)
    score = (lp * accepted_mask).sum(dim=-1)

    def sample(last):
        return torch.multinomial(probs[torch.arange(B, device=logits.device), last], 1, generator=generator)[:, 0]

    return _select_path(paths, accepted, score, sample)


def tree_structure_from_paths(paths, num_nodes):
    """Leaf paths [B, P, D+1] (-1 padded) -> (parents [B, T], depths [B, T]) of the nodes they list;
    a node on no path (padding) gets parent -1 and depth 0. On the device, no host read."""
    B, P, D1 = paths.shape
    dev = paths.device
    sink = num_nodes  # a dummy column for the -1 entries, dropped below
    child = torch.where(paths[:, :, 1:] >= 0, paths[:, :, 1:], torch.full_like(paths[:, :, 1:], sink))
    parents = torch.full((B, num_nodes + 1), -1, dtype=torch.long, device=dev)
    parents.scatter_(1, child.flatten(1), paths[:, :, :-1].flatten(1))
    level = torch.arange(D1, device=dev).expand(B, P, D1)
    node = torch.where(paths >= 0, paths, torch.full_like(paths, sink))
    depths = torch.zeros((B, num_nodes + 1), dtype=torch.long, device=dev)
    depths.scatter_(1, node.flatten(1), level.flatten(1))
    return parents[:, :num_nodes], depths[:, :num_nodes]


def rejection_verify(logits, tree_tokens, paths, temperature, top_k=0, top_p=1.0, generator=None, draft_probs=None,
                     noise=None):
    """Lossless tree verification by recursive rejection sampling (the SpecInfer / EAGLE / Recursive
    Speculative Decoding family): the emitted tokens are distributed exactly as plain sampling from the
    base model, for deterministic drafts (draft_probs None) and for drafts sampled from a draft
    distribution q (draft_probs given: SpecInfer's multi-round speculative sampling).

    p(. | node) = sampling_probs(logits[b, node], temperature, top_k, top_p): the base distribution
    after the node, exactly as plain sampling (sampling.next_tokens) draws from it. The walk starts at
    the root. At the current node it tries the node's children in draft order (node index order, which
    is rank order for a static Tree), with a residual r that starts at r = p(. | node):
    - deterministic drafts: a child with token x is accepted with probability r(x) / sum(r); on
      rejection r(x) = 0 and the next child is tried;
    - sampled drafts, child j's token x drawn from q_j = draft_probs[b, j]: accepted with probability
      min(1, r(x) / q_j(x)) (r kept normalised); on rejection r <- max(r - q_j, 0), renormalised.
    An accepted child becomes the current node (r restarts from its own p). When every child is
    rejected (or a leaf is reached) the next root is drawn from r / sum(r).

    Why the deterministic rule is exact. The tokens of the children are fixed before this step's random
    numbers are drawn (they may depend on anything before: the prefix, earlier steps' outcomes, a
    drafter's own random draws). Let x_1..x_m be the children's distinct tokens, in the order tried,
    and R_i the mass removed before x_i (R_1 = 0, R_{i+1} = R_i + p(x_i)). Then
      P(emit x_i) = prod_{k<i} (1 - p(x_k) / (1 - R_k)) * p(x_i) / (1 - R_i) = p(x_i),
    since the product telescopes to (1 - R_i) (each factor is (1 - R_{k+1}) / (1 - R_k)); and for a
    token y drafted by no child, P(emit y) = (1 - R_{m+1}) * p(y) / (1 - R_{m+1}) = p(y). So the token
    after the current node is distributed exactly as p(. | node); if it is an accepted child the walk
    continues there with fresh random numbers, so by induction every emitted token is an exact draw
    from the base distribution given all tokens before it: the sequence has the plain sampler's law.
    (A repeated sibling token has r(x) = 0 when its turn comes: never accepted, removes nothing.) The
    argument conditions on the drafted tokens, so it also holds for randomly drawn drafts whose draws
    are independent of this step's acceptance draws: draft_probs buys acceptance rate, not exactness.

    Why the sampled rule is exact. Requirement: when child j is tried, its token x_j, given everything
    before (the prefix, the walk so far, its earlier siblings' tokens), is distributed as q_j. Children
    drawn i.i.d. (with replacement) from the parent's head distribution meet it with q_j the same row
    for all siblings; a deterministic child is q_j = the point mass at its token (then the rule is the
    deterministic one above, and siblings of both kinds may mix). Claim: the emitted token after the
    current node has law r, the residual when the first untried child's turn comes (r = p at the
    start). Induction on the number of children left. None left: the token is drawn from r. Otherwise
    the next child draws x ~ q; it is emitted with probability q(y) min(1, r(y) / q(y)) = min(q(y), r(y))
    for each y; it is rejected with probability 1 - sum_y min(q, r) = sum_y max(r - q, 0) =: Z, and then
    (induction: the later children see the residual max(r - q, 0) / Z, which does not depend on x) the
    token has law max(r - q, 0) / Z. Together: min(q, r) + Z max(r - q, 0) / Z = min(q, r) + max(r - q, 0)
    = r. At the start r = p(. | node); an accepted child becomes the current node and the argument
    repeats one level down (induction over depth, as above), so the sequence has the plain sampler's law.
    Edge cases. Z = 0 means r <= q everywhere, and both sum to 1, so r = q: every draw is accepted
    (min(1, r/q) = 1) and a rejection cannot happen; rounding aside, r is then kept. q_j(x_j) = 0: x_j
    cannot have been drawn from q_j; such a child is skipped (never tried, r unchanged), which keeps the
    law above for the other children (ops.rejection_verify refuses it where it checks values). Padded
    nodes of per-sequence trees lie on no path: never tried; their rows (and the root's) are ignored.

    logits [B, T, V]: base logits after each node; tree_tokens [B, T]; paths int64 [P, D+1] (one tree)
    or [B, P, D+1] (a tree per sequence; padded nodes lie on no path and are never tried); temperature
    > 0; generator: a torch.Generator on logits' device (the draw is reproducible from its state);
    draft_probs [B, T, V] (float) or None: row j is the distribution node j's token was drawn from
    (rows of the root and padded nodes are ignored).
    noise: None (the generator draws) or (u [B, T], u_root [B]): i.i.d. uniforms in [0, 1) the caller drew
    (a CUDA graph's device-side Philox stream): u[b, j] is node j's acceptance draw, u_root[b] draws the next
    root from the residual by inverse CDF (sampling.inverse_cdf_sample). The argument above needs only that
    the draws are independent uniforms drawn after the tokens were fixed.
    Returns (accept_lengths [B], accept_indices [B, D+1] (-1 after the length), next_root [B],
    last_node [B]). No host read: a loop of T small [B] (sampled: [B, V]) steps.
    """
    B, T, V = logits.shape
    dev = logits.device
    paths = per_sequence(paths, B, 2)  # [B, P, D+1]
    parents, depths = tree_structure_from_paths(paths, T)  # [B, T] each
    probs = sampling_probs(logits, temperature, top_k, top_p)  # [B, T, V]
    idx = torch.full((B, paths.shape[-1]), -1, dtype=torch.long, device=dev)
    idx[:, 0] = 0
    # one uniform per node: each is tried at most once
    u = torch.rand(B, T, generator=generator, device=dev) if noise is None else noise[0]
    if draft_probs is None:
        cur, r_res = _walk_deterministic(probs, tree_tokens, parents, idx, u)
    else:
        cur, r_res = _walk_sampled(probs, draft_probs, tree_tokens, parents, depths, idx, u)
    accept_len = depths.gather(1, cur[:, None])[:, 0] + 1
    if noise is None:
        next_root = torch.multinomial(r_res, 1, generator=generator)[:, 0]
    else:
        next_root = inverse_cdf_sample(r_res, noise[1])
    return accept_len, idx, next_root, cur


def _record(idx, depths, j: int, acc) -> None:
    """Node j accepted (acc [B]) -> idx[b, depth(j)] = j, in place."""
    col = depths[:, j].clamp(max=idx.shape[1] - 1)
    idx.scatter_(1, col[:, None], torch.where(acc, j, idx.gather(1, col[:, None])[:, 0])[:, None])


def _walk_children(p_child, u, tree_tokens, parents, idx):
    """The deterministic walk itself (rejection_verify, rejection_accept): p_child [B, T] = p(token_j |
    parent_j), u [B, T] node j's uniform, parents [B, T] -> (last accepted node [B], its depth [B]);
    records each accepted node j at idx[b, depth(j)]. A child repeating an earlier sibling's token is
    skipped (its residual is 0 when its turn comes)."""
    B, T = p_child.shape
    dev = p_child.device
    same = (parents[:, :, None] == parents[:, None, :]) & (tree_tokens[:, :, None] == tree_tokens[:, None, :])
    dup = (same & torch.ones(T, T, dtype=torch.bool, device=dev).tril(-1)).any(-1)  # [B, T]: repeats a sibling
    cur = torch.zeros(B, dtype=torch.long, device=dev)  # current node of the walk
    level = torch.zeros(B, dtype=torch.long, device=dev)  # its depth
    removed = torch.zeros(B, dtype=torch.float32, device=dev)  # mass of the current node's rejected children
    for j in range(1, T):  # children come after their parents: one pass in index order walks the tree
        tried = (parents[:, j] == cur) & ~dup[:, j]
        # accept with probability p(x) / (1 - removed): the residual renormalised
        acc = tried & (u[:, j] * (1.0 - removed).clamp(min=0.0) < p_child[:, j])
        removed = torch.where(acc, torch.zeros_like(removed), torch.where(tried, removed + p_child[:, j], removed))
        cur = torch.where(acc, torch.full_like(cur, j), cur)
        level = level + acc.long()
        col = level.clamp(max=idx.shape[1] - 1)[:, None]  # an accepted child's depth: its parent's + 1
        idx.scatter_(1, col, torch.where(acc, j, idx.gather(1, col)[:, 0])[:, None])
    return cur, level


def _walk_deterministic(probs, tree_tokens, parents, idx, u):
    """rejection_verify's walk for deterministic drafts -> (last accepted node [B], the residual there [B, V]);
    records the accepted nodes in idx. u [B, T]: node j's acceptance uniform."""
    B, T, V = probs.shape
    dev = probs.device
    bidx = torch.arange(B, device=dev)
    # p_child[b, j] = p(token_j | parent_j): the probability node j's token has under its parent
    p_child = probs[bidx[:, None], parents.clamp(min=0), tree_tokens]  # [B, T]
    cur, _ = _walk_children(p_child, u, tree_tokens, parents, idx)
    # residual at the last node: its children (all tried, all rejected) removed, renormalised
    r = probs[bidx, cur]  # [B, V]
    kids = parents == cur[:, None]  # [B, T]
    drop = torch.zeros(B, V, dtype=torch.int32, device=dev).scatter_add_(1, tree_tokens, kids.int()) > 0
    r_res = r.masked_fill(drop, 0.0)
    # rounding can leave no mass (the last child held all of it and was rejected with probability ~0)
    return cur, torch.where(r_res.sum(-1, keepdim=True) > 0, r_res, r)


def _walk_sampled(probs, draft_probs, tree_tokens, parents, depths, idx, u):
    """rejection_verify's walk for sampled drafts (child j drawn from q_j = draft_probs[:, j]) -> (last
    accepted node [B], the residual there [B, V]); records the accepted nodes in idx."""
    B, T, V = probs.shape
    dev = probs.device
    q = draft_probs.float()  # [B, T, V]
    q_x = q.gather(2, tree_tokens[:, :, None])[:, :, 0]  # [B, T]: q_j(x_j)
    drawn = q_x > 0  # q_j(x_j) = 0: x_j was not drawn from q_j; skipped (see the docstring)
    cur = torch.zeros(B, dtype=torch.long, device=dev)  # current node of the walk
    r = probs[:, 0]  # [B, V] the residual at the current node, normalised
    for j in range(1, T):  # children come after their parents: one pass in index order walks the tree
        tried = (parents[:, j] == cur) & drawn[:, j]
        r_x = r.gather(1, tree_tokens[:, j, None])[:, 0]  # [B]
        acc = tried & (u[:, j] * q_x[:, j] < r_x)  # P(u < r(x) / q(x)) = min(1, r(x) / q(x))
        rej = tried & ~acc
        r = torch.where(acc[:, None], probs[:, j], torch.where(rej[:, None], _residual_after_rejection(r, q[:, j]), r))
        cur = torch.where(acc, torch.full_like(cur, j), cur)
        _record(idx, depths, j, acc)
    return cur, r


def _residual_after_rejection(r, q):
    """r, q [B, V] distributions -> max(r - q, 0) renormalised: the law of the emitted token given that a
    draw from q was rejected. No mass left means r = q (a rejection then has probability 0; rounding
    aside): r is kept."""
    excess = (r - q).clamp(min=0.0)
    mass = excess.sum(-1, keepdim=True)
    return torch.where(mass > 0, excess / mass.clamp(min=torch.finfo(excess.dtype).tiny), r)


def lm_head_sample_stats(x, weight, temperature, seed):
    """What typical acceptance needs from the LM head, per row of x [..., H] with z = x W^T / temperature:
    (lse [...], entropy [...] of softmax(z), a token [...] drawn from softmax(z)). seed: int64 tensor [1]
    (the draw is seeded by it; the Triton kernel draws by Gumbel-max, same distribution, other values)."""
    z = torch.nn.functional.linear(x, weight).float() / temperature
    lse = z.logsumexp(dim=-1)
    logp = z - lse[..., None]
    entropy = -torch.special.xlogy(logp.exp(), logp.exp()).sum(-1)
    gen = torch.Generator(device=x.device).manual_seed(int(seed.reshape(-1)[0]))
    sample = torch.multinomial(logp.exp().reshape(-1, z.shape[-1]), 1, generator=gen).view(z.shape[:-1])
    return lse, entropy, sample


def child_logits(hidden, weight, tree_tokens, parents, temperature):
    """z of each node's own token under its parent's distribution: [B, T] with
    out[b, j] = hidden[b, parents[b, j]] . weight[tree_tokens[b, j]] / temperature (root and padded nodes,
    parent -1: 0). hidden [B, T, H]; weight [V, H]; parents [T] (shared) or [B, T] (per sequence)."""
    B, T, H = hidden.shape
    parents = per_sequence(parents, B, 1)  # [B, T]
    h_parent = hidden.gather(1, parents.clamp(min=0)[:, :, None].expand(B, T, H))  # [B, T, H]
    out = (h_parent.float() * weight[tree_tokens].float()).sum(-1) / temperature
    return out.masked_fill(parents < 0, 0.0)


def typical_accept(lse, entropy, child_logits, samples, paths, posterior_threshold=0.09, posterior_alpha=0.3):
    """typical_verify from statistics instead of logits: lse, entropy [B, T] of each node's next-token
    distribution (lm_head_sample_stats), child_logits [B, T] (child_logits()), samples [B, T] a token
    drawn after each node; paths [P, D+1] or [B, P, D+1]. Same acceptance, tie rules and outputs; the
    next root is samples[b, last]."""
    B = lse.shape[0]
    paths = per_sequence(paths, B, 2)  # [B, P, D+1]
    parent = paths[:, :, :-1].clamp(min=0)  # [B, P, D]
    lp = _node_values(child_logits.float(), paths[:, :, 1:].clamp(min=0)) - _node_values(lse.float(), parent)
    threshold = torch.clamp(posterior_alpha * torch.exp(-entropy.float()), max=posterior_threshold)  # [B, T]
    ok = (lp.exp() > _node_values(threshold, parent)) & (paths[:, :, 1:] >= 0)  # lp: [B, P, D] log p(child)
    accepted_mask = ok.long().cumprod(dim=-1)
    accepted = accepted_mask.sum(dim=-1)
    score = (lp * accepted_mask).sum(dim=-1)
    return _select_path(paths, accepted, score, lambda last: samples[torch.arange(B, device=lse.device), last])


# ---- lossless rejection sampling from LM-head samples (no [B, T, V] probabilities) ---------------
def child_tokens(tree_tokens, parents, width):
    """Each node's children's tokens, in child (index) order: int64 [B, T, width], -1 padded, with
    out[b, i, r] = the token of node i's r-th child. tree_tokens [B, T]; parents [T] (shared) or [B, T]
    (-1: root and padded nodes); width >= 1 and >= the largest number of children (Tree.max_children).
    The exclusion lists of lm_head_residual_sample. Device ops only, no host read."""
    B, T = tree_tokens.shape
    dev = tree_tokens.device
    parents = per_sequence(parents, B, 1)  # [B, T]
    earlier = torch.ones(T, T, dtype=torch.bool, device=dev).tril(-1)  # [j, i]: i < j
    rank = ((parents[:, :, None] == parents[:, None, :]) & earlier).sum(-1)  # [B, T]: earlier siblings
    kept = (parents >= 0) & (rank < width)
    row = torch.where(kept, parents, T)  # dropped entries go to a spare row T
    out = torch.full((B, T + 1, width), -1, dtype=torch.long, device=dev)
    bidx = torch.arange(B, device=dev)[:, None].expand(B, T)
    out[bidx, row, rank.clamp(max=width - 1)] = tree_tokens.long()
    return out[:, :T]


def lm_head_residual_sample(x, weight, temperature, seed, exclude):
    """Per row of x [..., H], with z = x W^T / temperature (fp32 [..., V]): (lse [...] = logsumexp(z),
    sample int64 [...] drawn from softmax(z) restricted to the tokens not in exclude[row]).

    The draw is a Gumbel-max: sample = argmax over allowed tokens v of z_v + G_v, G_v = -log(-log U_v),
    U_v = philox_uniform(seed, row * V + v) (row: the flat row index) -- an exact draw from softmax(z)
    renormalised over the allowed tokens, and the same noise the Triton kernel draws (tl.rand), so the
    two agree token for token. exclude: int64 [..., C] token ids (-1: no token), C < V so that a token
    always remains; seed: int64 tensor [1] on x's device (read there, no host sync)."""
    z = torch.nn.functional.linear(x, weight).float() / temperature  # [..., V]
    V = z.shape[-1]
    lse = z.logsumexp(dim=-1)
    z2 = z.reshape(-1, V)  # [N, V]
    ex = exclude.reshape(z2.shape[0], exclude.shape[-1]).long()  # [N, C]
    offsets = torch.arange(z2.shape[0], device=z.device)[:, None] * V + torch.arange(V, device=z.device)
    g = z2 - torch.log(-torch.log(philox_uniform(seed, offsets).clamp(min=1e-20)))
    g = torch.cat([g, g.new_zeros(g.shape[0], 1)], dim=1)  # a spare column V takes the -1 entries
    g = g.scatter(1, torch.where(ex >= 0, ex, V), float("-inf"))[:, :V]
    return lse, g.argmax(dim=-1).view(z.shape[:-1])


def rejection_accept(lse, child_logits, samples, uniforms, tree_tokens, parents, depth):
    """rejection_verify's walk from LM-head statistics instead of [B, T, V] probabilities (temperature
    only: p(x | node) = exp(z_x - lse[node]), z = logits / temperature).

    lse [B, T]: logsumexp of z after each node (lm_head_residual_sample); child_logits [B, T]: z of each
    node's token under its parent (child_logits()); samples int64 [B, T]: after each node, a token drawn
    from p(. | node) with that node's children's tokens removed (lm_head_residual_sample with exclude =
    child_tokens()); uniforms fp32 [B, T] in [0, 1): node j's acceptance draw; tree_tokens [B, T];
    parents [T] or [B, T] (-1: root, padding; a parent precedes its children); depth: the tree's depth D.

    The walk is rejection_verify's: at the current node its children are tried in index order, child j
    (token x) accepted when uniforms[j] * (1 - removed) < p(x) (removed: the mass of the node's rejected
    children; a child repeating a rejected sibling's token is skipped), an accepted child becomes the
    current node. When it stops at a node, every child of that node was rejected, so the residual there
    is p with exactly the children's tokens removed: samples[b, node] is an exact draw from it, and the
    next root. (Exactness of the walk itself: rejection_verify's docstring.)
    Returns (accept_lengths [B], accept_indices [B, D+1] (-1 after the length), next_root [B],
    last_node [B]), int64.
    """
    B, T = lse.shape
    dev = lse.device
    parents = per_sequence(parents, B, 1)  # [B, T]
    p = torch.exp(child_logits.float() - lse.float().gather(1, parents.clamp(min=0)))  # p(token_j | parent_j)
    idx = torch.full((B, depth + 1), -1, dtype=torch.long, device=dev)
    idx[:, 0] = 0
    cur, level = _walk_children(p, uniforms, tree_tokens, parents, idx)
    return level + 1, idx, samples.long().gather(1, cur[:, None])[:, 0], cur


# ---- KV commit ----------------------------------------------------------------------------------
def commit_kv(kv_cache, cache_seqlens, accept_indices, accept_lengths):
    """In place, every layer, K and V: row seqlens[b] + accept_indices[b, i] -> row seqlens[b] + i for
    i < accept_lengths[b]. kv_cache [n_layers, 2, B, S_max, Hkv, D]. Sources and destinations overlap
    (accept_indices[b, i] >= i), so every source row is gathered before any row is written."""
    B, K1 = accept_indices.shape
    dev = kv_cache.device
    start = cache_seqlens.long()[:, None]
    i = torch.arange(K1, device=dev)[None, :]
    valid = i < accept_lengths.long()[:, None]
    dst = start + i
    src = torch.where(valid, start + accept_indices.long().clamp(min=0), dst)  # invalid: row onto itself
    b = torch.arange(B, device=dev)[:, None]
    rows = kv_cache[:, :, b, src]  # advanced indexing copies: the gather completes before the write
    kv_cache[:, :, b, dst] = rows


# ---- step inputs --------------------------------------------------------------------------------
def tree_inputs(root, candidates, node_source, depths, cache_seqlens):
    """tokens [B, T]: node 0 = root, node t = candidates[b, node_source[t]]; positions [B, T] =
    seqlens[b] + depths[b, t]. candidates [B, C]: the drafter's per-depth top-k, concatenated;
    node_source [T]; depths [T] (shared tree) or [B, T] (per sequence)."""
    tokens = candidates[:, node_source.clamp(min=0)]
    tokens[:, 0] = root
    positions = cache_seqlens.long()[:, None] + depths.long()  # [B, 1] + [T] or [B, T]
    return tokens, positions


def int8_dot_linear(x, q, scales, offsets=None, bias=None):
    """A linear layer over quantized weights with int8 activations, the definition csrc/int8_dot_linear_cpu.cpp
    computes: x fp32 [M, K]; the weight q int [N, K] with scales (and offsets) fp32 [N, K / G], w = s q (+ o).
    Per row and group of G inputs: a = max |x|, d = a / 127, xq = round-half-even(x * (127 / a)) in [-127, 127]
    (0 where 127 / a is not finite: a = 0 or below ~3.7e-37; a group with an inf or NaN input: xq = 0, d = NaN),
    xs = sum xq; isum = q . xq (exact integers); then over the groups in order
    acc = fma(s d, isum, acc) and, with offsets, acc = fma(o, d xs, acc), from acc = bias (or 0).
    The fma is computed in float64 and rounded once to fp32 (exact: an fp32 product is exact in float64, so only
    the sum rounds, and float64's 53 bits then round again to fp32; a double rounding that can differ in the last
    bit, rarely): compare within a few fp32 ulps. -> [M, N] fp32."""
    M, K = x.shape
    N, NG = scales.shape
    G = K // NG
    xg = x.float().reshape(M, NG, G)
    a = xg.abs().amax(-1)  # [M, NG] (NaN where a group holds one)
    finite = torch.isfinite(a)
    inv = torch.tensor(127.0) / a
    scaled = finite & torch.isfinite(inv)  # a group with a finite scale: its inputs are rounded, the others are 0
    r = torch.round(xg * torch.where(scaled, inv, torch.zeros_like(inv))[..., None])  # round half to even
    xq = torch.where(scaled[..., None], r.clamp(-127, 127), torch.zeros_like(r)).to(torch.int64)
    d = torch.where(finite, a / torch.tensor(127.0), torch.full_like(a, float("nan")))
    xs = xq.sum(-1)  # [M, NG]
    isum = torch.einsum("mgk,ngk->mng", xq, q.to(torch.int64).reshape(N, NG, G))  # [M, N, NG], exact
    sd = scales[None].float() * d[:, None, :]  # [M, N, NG], fp32 products
    dxs = d * xs.float()  # [M, NG]
    acc = (bias.float() if bias is not None else torch.zeros(N)).expand(M, N).double()
    for g in range(NG):
        acc = (sd[:, :, g].double() * isum[:, :, g].double() + acc).float().double()
        if offsets is not None:
            acc = (offsets[None, :, g].double() * dxs[:, None, g].double() + acc).float().double()
    return acc.float()
