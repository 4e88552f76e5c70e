"""tree_inputs (the verify step's tree tokens and positions from the drafter's candidates) on every
backend (reference, native) against its definition, with the static tree's depths [T] and with a tree per
sequence (depths [B, T], padded nodes at depth 0)."""
import pytest
import torch

import hydra_kernels as hk
from helpers import DEV, random_tree_batch

pytestmark = pytest.mark.backends("reference", "native", op="tree_inputs")


def definition(root, cand, node_source, depths, seqlens):
    """tokens[b, 0] = root[b], tokens[b, t] = cand[b, node_source[t]]; positions = seqlens[b] + depths[(b,) t]."""
    B, T = root.shape[0], node_source.shape[0]
    depths = depths.expand(B, T)
    tokens = torch.empty(B, T, dtype=torch.long)
    positions = torch.empty(B, T, dtype=torch.long)
    for b in range(B):
        for t in range(T):
            tokens[b, t] = root[b] if t == 0 else cand[b, node_source[t]]
            positions[b, t] = seqlens[b] + depths[b, t]
    return tokens, positions


def run(backend, *args):
    tokens, positions = hk.ops.tree_inputs(*(a.to(DEV) for a in args), backend=backend)
    return tokens.cpu(), positions.cpu()


@pytest.mark.parametrize("B,n_nodes", [(1, 0), (2, 10), (3, 63)])
def test_tree_inputs_static_tree(backend, B, n_nodes):
    tree = hk.tree.default_tree(n_nodes + 1, depth=4) if n_nodes else hk.Tree([])
    gen = torch.Generator().manual_seed(n_nodes)
    C = int(tree.flat_source.max()) + 1
    root = torch.randint(0, 1000, (B,), generator=gen)
    cand = torch.randint(0, 1000, (B, C), generator=gen)
    seqlens = torch.randint(0, 50, (B,), generator=gen).to(torch.int32)
    got = run(backend, root, cand, tree.flat_source, tree.depths, seqlens)
    want = definition(root, cand, tree.flat_source, tree.depths, seqlens)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].dtype == got[1].dtype == torch.long


@pytest.mark.parametrize("sizes", [[4], [1, 9, 5], [13, 2, 7, 1]])
def test_tree_inputs_per_sequence_depths(backend, sizes):
    """Each sequence's nodes sit at its own tree's depths; the same depths for every sequence give the
    static tree's result."""
    gen = torch.Generator().manual_seed(sum(sizes))
    _, batch = random_tree_batch(gen, sizes)
    B, T = batch.depths.shape
    node_source = torch.randint(0, 6, (T,), generator=gen)
    root = torch.randint(0, 1000, (B,), generator=gen)
    cand = torch.randint(0, 1000, (B, 6), generator=gen)
    seqlens = torch.randint(0, 50, (B,), generator=gen).to(torch.int32)
    got = run(backend, root, cand, node_source, batch.depths, seqlens)
    want = definition(root, cand, node_source, batch.depths, seqlens)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    same = run(backend, root, cand, node_source, batch.depths[-1].expand(B, T), seqlens)
    shared = run(backend, root, cand, node_source, batch.depths[-1], seqlens)
    assert torch.equal(same[0], shared[0]) and torch.equal(same[1], shared[1])


def test_tree_inputs_bad_inputs_are_named():
    root, cand = torch.zeros(2, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)
    src = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"depths \[T\] or \[B, T\] = \[2, 3\]"):
        hk.ops.tree_inputs(root, cand, src, torch.zeros(3, 3, dtype=torch.long), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_seqlens must be"):
        hk.ops.tree_inputs(root, cand, src, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.int32))
