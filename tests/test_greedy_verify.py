"""greedy_verify on every backend (reference, Triton, native) against a brute-force per-path loop: one
static tree for the batch (paths [P, D+1]) and a tree per sequence (paths [B, P, D+1], trees of different
sizes padded to a common T): each sequence gets what it would get alone with its own tree, and a padded
node is never accepted, even when its token matches."""
import pytest
import torch

import hydra_kernels as hk
from helpers import DEV, assert_same_verification, planted, random_tree, random_tree_batch
from test_tree import random_choices

pytestmark = pytest.mark.backends("reference", "triton", "native", op="greedy_verify")


def brute_greedy(target, tokens, paths, b):
    """The accepted path of sequence b: walk every leaf path while each token equals the target after its
    parent; the first longest wins. paths [P, D+1] of that sequence's tree."""
    best, best_len = None, -1
    for row in paths.tolist():
        path = [n for n in row if n >= 0]
        k = 1
        while k < len(path) and tokens[b, path[k]] == target[b, path[k - 1]]:
            k += 1
        if k > best_len:  # strict: the first longest path wins
            best, best_len = path[:k], k
    return best


def check_against_brute_force(v, target, tokens, paths):
    """paths [P, D+1] (shared) or [B, P, D+1]."""
    B = target.shape[0]
    paths = paths.expand(B, *paths.shape[-2:])
    for b in range(B):
        path = brute_greedy(target, tokens, paths[b], b)
        n = len(path)
        assert v.accept_lengths[b] == n
        assert v.accept_indices[b, :n].tolist() == path and (v.accept_indices[b, n:] == -1).all()
        assert v.last_node[b] == path[-1] and v.next_root[b] == target[b, path[-1]]


def run(backend, target, tokens, paths):
    v = hk.ops.greedy_verify(target.to(DEV), tokens.to(DEV), paths.to(DEV), backend=backend)
    return type(v)(*(t.cpu() for t in v))


@pytest.mark.parametrize("seed", range(10))
def test_greedy_verify_matches_brute_force(backend, seed):
    gen = torch.Generator().manual_seed(seed)
    tree = hk.Tree(random_choices(gen, n=int(torch.randint(1, 30, (1,), generator=gen)), depth=4))
    B = 1 + seed % 4
    target, tokens = planted(gen, B, tree.parents, V=5)
    check_against_brute_force(run(backend, target, tokens, tree.paths), target, tokens, tree.paths)


@pytest.mark.parametrize("seed,B,n_nodes", [(0, 1, 0), (1, 1, 5), (2, 3, 20), (3, 4, 70), (4, 2, 100)])
def test_greedy_verify_equals_reference(backend, seed, B, n_nodes):
    gen = torch.Generator().manual_seed(seed)
    tree = hk.Tree(random_choices(gen, n=n_nodes, depth=5)) if n_nodes else hk.Tree([])
    target, tokens = planted(gen, B, tree.parents, V=4)
    ref = hk.ops.greedy_verify(target, tokens, tree.paths, backend="reference")
    assert_same_verification(run(backend, target, tokens, tree.paths), ref, backend)


# ---- a tree per sequence ------------------------------------------------------------------------
@pytest.mark.parametrize("seed,sizes", [(0, [6]), (1, [1, 9, 4]), (2, [13, 2, 7, 1]), (3, [31, 8]), (4, [3, 3, 3])])
def test_greedy_verify_per_sequence_trees(backend, seed, sizes):
    """Trees of different sizes in one batch: the brute force on each sequence's own tree, and the same
    result as verifying that sequence alone with its own static tree (same backend)."""
    gen = torch.Generator().manual_seed(100 + seed)
    trees, batch = random_tree_batch(gen, sizes)
    B = len(sizes)
    target, tokens = planted(gen, B, batch.parents, V=3)
    v = run(backend, target, tokens, batch.paths)
    check_against_brute_force(v, target, tokens, batch.paths)
    if max(sizes) >= 9:
        assert v.accept_lengths.max() >= 2  # the cases accept more than the root
    for b, tree in enumerate(trees):
        n = tree.num_nodes
        alone = run(backend, target[b:b + 1, :n], tokens[b:b + 1, :n], tree.paths)
        D1 = tree.paths.shape[1]
        assert v.accept_lengths[b] == alone.accept_lengths[0] and v.last_node[b] == alone.last_node[0]
        assert v.next_root[b] == alone.next_root[0], f"sequence {b}"
        assert torch.equal(v.accept_indices[b, :D1], alone.accept_indices[0]) and (v.accept_indices[b, D1:] == -1).all()


def test_greedy_verify_padded_nodes_are_never_accepted(backend):
    """Padded nodes carry the very token that would be accepted after the root (or after any node), yet
    no sequence accepts one: they lie on no leaf path."""
    gen = torch.Generator().manual_seed(7)
    trees, batch = random_tree_batch(gen, [1, 5, 12, 2])
    B, T = batch.parents.shape
    target = torch.zeros(B, T, dtype=torch.long)  # the base predicts token 0 after every node
    tokens = torch.where(batch.valid, torch.randint(1, 3, (B, T), generator=gen), 0)  # only padding matches
    v = run(backend, target, tokens, batch.paths)
    assert (v.accept_lengths == 1).all() and (v.last_node == 0).all()
    tokens[:, 1:] = 0  # now every real node matches too: the whole deepest path, still no padded node
    v = run(backend, target, tokens, batch.paths)
    for b, tree in enumerate(trees):
        assert v.accept_lengths[b] == tree.depth + 1
        got = v.accept_indices[b]
        assert (got[got >= 0] < tree.num_nodes).all(), f"sequence {b} accepted a padded node: {got.tolist()}"


def test_greedy_verify_same_tree_per_sequence_is_the_shared_result(backend):
    gen = torch.Generator().manual_seed(8)
    tree = random_tree(gen, 20)
    B = 3
    target, tokens = planted(gen, B, tree.parents, V=3)
    shared = run(backend, target, tokens, tree.paths)
    for paths in (tree.paths.expand(B, -1, -1).clone(), tree.paths.expand(B, -1, -1)):
        assert_same_verification(run(backend, target, tokens, paths), shared, "same tree per sequence")


# ---- inputs ----------------------------------------------------------------------------------------
def test_greedy_verify_bad_inputs_are_named():
    target = tokens = torch.zeros(2, 5, dtype=torch.long)
    paths = torch.tensor([[0, 1, 2], [0, 3, -1]])
    with pytest.raises(ValueError, match=r"paths must be int64 \[P, D\+1\].*or \[B=2, P, D\+1\]"):
        hk.ops.greedy_verify(target, tokens, paths.expand(3, 2, 3))
    with pytest.raises(ValueError, match="paths must be int64"):
        hk.ops.greedy_verify(target, tokens, paths.int())
    with pytest.raises(ValueError, match="paths index node 7 but the tree has 5 nodes"):
        hk.ops.greedy_verify(target, tokens, torch.tensor([[0, 7]]).expand(2, 1, 2))
    with pytest.raises(ValueError, match="target_tokens"):
        hk.ops.greedy_verify(target[:, :4], tokens, paths)


@pytest.mark.backends("native")
def test_greedy_verify_native_errors_are_clear(backend):
    ops = torch.ops.hydra_kernels
    with pytest.raises(RuntimeError, match="paths must be int64"):
        ops.greedy_verify(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long),
                          torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"or \[B, P, D\+1\]"):
        ops.greedy_verify(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long),
                          torch.zeros(2, 2, 2, dtype=torch.long))


@pytest.mark.backends("native")
def test_greedy_verify_native_traces_under_torch_compile_fake_mode(backend):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for paths in (torch.empty(3, 4, dtype=torch.long), torch.empty(2, 3, 4, dtype=torch.long)):
            out = torch.ops.hydra_kernels.greedy_verify(torch.empty(2, 5, dtype=torch.long),
                                                        torch.empty(2, 5, dtype=torch.long), paths)
            assert [tuple(t.shape) for t in out] == [(2,), (2, 4), (2,), (2,)]
