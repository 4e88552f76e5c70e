"""typical_accept (typical acceptance from LM-head statistics, no [B, T, V] logits) on every backend
against the reference, and the reference against the logits-based definition (ops.typical_verify), with
one static tree and with a tree per sequence (paths [B, P, D+1], parents [B, T] for child_logits)."""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.ops import reference
from helpers import DEV, assert_close_rel, assert_same_verification, random_tree, random_tree_batch
from test_tree import random_choices

pytestmark = pytest.mark.backends("reference", "triton", op="typical_accept")
V, H, TEMP = 12, 16, 0.9


def statistics(gen, B, parents, likely_share=0.7):
    """(logits [B, T, V], lse, entropy, child_logits, samples [B, T], tokens [B, T]) of random hidden
    states; most children are their parent's likely tokens, so paths of several lengths are accepted.
    parents [T] or [B, T]."""
    T = parents.shape[-1]
    w = torch.randn(V, H, generator=gen)
    hidden = torch.randn(B, T, H, generator=gen) * 2
    tokens = torch.randint(0, V, (B, T), generator=gen)
    par = parents.expand(B, T)
    likely = (hidden @ w.T).argmax(-1).gather(1, par.clamp(min=0))
    pick = (torch.rand(B, T, generator=gen) < likely_share) & (par >= 0)
    tokens = torch.where(pick, likely, tokens)
    lse, ent, _ = reference.lm_head_sample_stats(hidden, w, TEMP, torch.tensor([0]))
    samples = torch.randint(0, V, (B, T), generator=gen)
    cl = reference.child_logits(hidden, w, tokens, parents, TEMP)
    return hidden @ w.T, lse, ent, cl, samples, tokens


def accept(backend, lse, ent, cl, samples, paths):
    args = [t.to(DEV) for t in (lse, ent, cl, samples, paths)]
    v = hk.ops.typical_accept(*args, posterior_threshold=0.09, posterior_alpha=0.3, backend=backend)
    return type(v)(*(t.cpu() for t in v))


@pytest.mark.parametrize("seed,B,n_nodes", [(0, 1, 0), (1, 2, 6), (2, 3, 30), (3, 1, 64)])
def test_typical_accept_equals_reference_and_the_definition(backend, seed, B, n_nodes):
    gen = torch.Generator().manual_seed(seed)
    tree = hk.Tree(random_choices(gen, n=n_nodes, depth=4)) if n_nodes else hk.Tree([])
    logits, lse, ent, cl, samples, tokens = statistics(gen, B, tree.parents)
    out = accept(backend, lse, ent, cl, samples, tree.paths)
    ref = accept("reference", lse, ent, cl, samples, tree.paths)
    assert_same_verification(out, ref, backend)
    # the definition from logits: same lengths and paths (its next root is its own draw)
    d = hk.ops.typical_verify(logits, tokens, tree.paths, temperature=TEMP, backend="reference")
    assert torch.equal(d.accept_lengths, ref.accept_lengths)
    assert torch.equal(d.accept_indices, ref.accept_indices)
    if n_nodes >= 30:
        assert ref.accept_lengths.max() >= 2
    assert torch.equal(ref.next_root, samples[torch.arange(B), ref.last_node])


@pytest.mark.parametrize("seed,sizes", [(0, [7]), (1, [1, 12, 5]), (2, [30, 3, 9, 1])])
def test_typical_accept_per_sequence_trees(backend, seed, sizes):
    """Trees of different sizes in one batch: the reference's result, the logits-based definition's
    paths, and for each sequence the result of verifying it alone with its own static tree."""
    gen = torch.Generator().manual_seed(50 + seed)
    trees, batch = random_tree_batch(gen, sizes)
    B = len(sizes)
    logits, lse, ent, cl, samples, tokens = statistics(gen, B, batch.parents)
    v = accept(backend, lse, ent, cl, samples, batch.paths)
    assert_same_verification(v, accept("reference", lse, ent, cl, samples, batch.paths), backend)
    d = hk.ops.typical_verify(logits, tokens, batch.paths, temperature=TEMP, backend="reference")
    assert torch.equal(d.accept_lengths, v.accept_lengths) and torch.equal(d.accept_indices, v.accept_indices)
    if max(sizes) >= 12:
        assert v.accept_lengths.max() >= 2
    for b, tree in enumerate(trees):
        n, D1 = tree.num_nodes, tree.paths.shape[1]
        alone = accept(backend, *(t[b:b + 1, :n] for t in (lse, ent, cl, samples)), tree.paths)
        assert v.accept_lengths[b] == alone.accept_lengths[0] and v.last_node[b] == alone.last_node[0]
        assert v.next_root[b] == alone.next_root[0]
        assert torch.equal(v.accept_indices[b, :D1], alone.accept_indices[0]) and (v.accept_indices[b, D1:] == -1).all()


def test_typical_accept_padded_nodes_are_never_accepted(backend):
    """Padded nodes get a huge child logit (certain acceptance if they were on a path): never accepted."""
    gen = torch.Generator().manual_seed(60)
    trees, batch = random_tree_batch(gen, [1, 8, 4])
    _, lse, ent, cl, samples, _ = statistics(gen, 3, batch.parents, likely_share=0.0)
    cl = torch.where(batch.valid, cl - 1e3, lse + 10.0)  # real nodes: p ~ 0; padded: p(child) = e^10 > any threshold
    v = accept(backend, lse, ent, cl, samples, batch.paths)
    assert (v.accept_lengths == 1).all() and (v.last_node == 0).all()


def test_typical_accept_same_tree_per_sequence_is_the_shared_result(backend):
    gen = torch.Generator().manual_seed(61)
    tree = random_tree(gen, 18)
    B = 3
    _, lse, ent, cl, samples, _ = statistics(gen, B, tree.parents)
    shared = accept(backend, lse, ent, cl, samples, tree.paths)
    for paths in (tree.paths.expand(B, -1, -1).clone(), tree.paths.expand(B, -1, -1)):
        assert_same_verification(accept(backend, lse, ent, cl, samples, paths), shared, "same tree")


def test_child_logits_per_sequence_parents():
    """reference.child_logits with parents [B, T]: each node's token logit under its own parent's hidden
    state; roots and padded nodes (parent -1) are 0; shared parents [T] equal their [B, T] expansion."""
    gen = torch.Generator().manual_seed(62)
    trees, batch = random_tree_batch(gen, [1, 6, 3])
    B, T = batch.parents.shape
    hidden, w = torch.randn(B, T, H, generator=gen), torch.randn(V, H, generator=gen)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    out = reference.child_logits(hidden, w, tokens, batch.parents, TEMP)
    for b in range(B):
        for j in range(T):
            p = int(batch.parents[b, j])
            want = 0.0 if p < 0 else float(hidden[b, p] @ w[tokens[b, j]]) / TEMP
            assert abs(float(out[b, j]) - want) <= 1e-5 * max(1.0, abs(want)), (b, j)
    shared = trees[1].parents
    a = reference.child_logits(hidden[:, :6], w, tokens[:, :6], shared, TEMP)
    assert_close_rel(a, reference.child_logits(hidden[:, :6], w, tokens[:, :6], shared.expand(B, 6), TEMP), 0, "shared")


def test_typical_accept_bad_inputs_are_named():
    x = torch.zeros(2, 4)
    paths = torch.tensor([[0, 1, 3], [0, 2, -1]])
    with pytest.raises(ValueError, match=r"or \[B=2, P, D\+1\]"):
        hk.ops.typical_accept(x, x, x, x.long(), paths.expand(3, 2, 3))
    with pytest.raises(ValueError, match="must all be"):
        hk.ops.typical_accept(x, x[:, :3], x, x.long(), paths)
