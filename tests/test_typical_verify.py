"""typical_verify (Medusa's typical acceptance from the base logits; reference only) against a brute-force
per-path loop, with one static tree (paths [P, D+1]) and a tree per sequence (paths [B, P, D+1], padded):
each sequence gets what it would get alone with its own tree, and a padded node is never accepted."""
import math

import pytest
import torch

import hydra_kernels as hk
from helpers import DEV, assert_same_verification, planted, random_tree, random_tree_batch
from test_tree import random_choices

pytestmark = pytest.mark.backends("reference", op="typical_verify")


def brute_typical(logits, tokens, paths, b, temperature, thr, alpha):
    """Sequence b's accepted path: walk each leaf path (paths [P, D+1] of its tree) while p(child) >
    min(thr, alpha * exp(-entropy(parent))); the longest, then the highest summed log p, wins."""
    p = torch.softmax(logits[b].double() / temperature, -1)
    ent = -(p * torch.log(p)).sum(-1)
    cut = torch.clamp(alpha * torch.exp(-ent), max=thr)
    best, key = None, None
    for row in paths.tolist():
        path = [n for n in row if n >= 0]
        k, score = 1, 0.0
        while k < len(path) and p[path[k - 1], tokens[b, path[k]]] > cut[path[k - 1]]:
            score += math.log(p[path[k - 1], tokens[b, path[k]]])
            k += 1
        if key is None or (k, score) > key:
            best, key = path[:k], (k, score)
    return best


def likely_children(gen, logits, tokens, parents):
    """Make the parent's likeliest token common among the children (parents [T] or [B, T]), so paths of
    several lengths are accepted."""
    B, T = tokens.shape
    parents = parents.expand(B, T)
    likely = logits.argmax(-1).gather(1, parents.clamp(min=0))  # [B, T]
    hit = (torch.rand(B, T, generator=gen) < 0.5) & (parents >= 0)
    return torch.where(hit, likely, tokens)


def verify(backend, logits, tokens, paths, **kw):
    kw.setdefault("generator", torch.Generator(device=DEV).manual_seed(0))
    v = hk.ops.typical_verify(logits.to(DEV), tokens.to(DEV), paths.to(DEV), backend=backend, **kw)
    return type(v)(*(t.cpu() for t in v))


@pytest.mark.parametrize("seed", range(8))
def test_typical_verify_matches_brute_force(backend, seed):
    gen = torch.Generator().manual_seed(100 + seed)
    tree = hk.Tree(random_choices(gen, n=int(torch.randint(1, 25, (1,), generator=gen)), depth=4))
    B, V = 3, 6
    logits = torch.randn(B, tree.num_nodes, V, generator=gen) * 3
    _, tokens = planted(gen, B, tree.parents, V=V, p_accept=0.0)
    tokens = likely_children(gen, logits, tokens, tree.parents)
    v = verify(backend, logits, tokens, tree.paths, temperature=0.8, posterior_threshold=0.2, posterior_alpha=0.5)
    for b in range(B):
        path = brute_typical(logits, tokens, tree.paths, b, 0.8, 0.2, 0.5)
        assert v.accept_indices[b, : len(path)].tolist() == path, f"sequence {b}"
        assert v.accept_lengths[b] == len(path) and v.last_node[b] == path[-1]


def test_typical_limits_and_seeding(backend):
    gen = torch.Generator().manual_seed(7)
    tree = hk.tree.default_tree(30, depth=4)
    B, V = 4, 50
    logits = torch.randn(B, tree.num_nodes, V, generator=gen)
    tokens = torch.randint(0, V, (B, tree.num_nodes), generator=gen)
    run = lambda **kw: verify(backend, logits, tokens, tree.paths, temperature=1.0,  # noqa: E731
                              generator=torch.Generator(device=DEV).manual_seed(1), **kw)
    everything = run(posterior_threshold=0.0, posterior_alpha=0.0)  # every positive probability passes
    assert (everything.accept_lengths == tree.depth + 1).all()
    nothing = run(posterior_threshold=1e9, posterior_alpha=1e9)  # no probability exceeds 1
    assert (nothing.accept_lengths == 1).all() and (nothing.last_node == 0).all()
    a, b = run(), run()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    peaked = verify(backend, logits * 1e4, tokens, tree.paths, temperature=1.0, generator=None)  # ~one-hot root
    assert torch.equal(peaked.next_root, logits[torch.arange(B), peaked.last_node].argmax(-1))


# ---- a tree per sequence ------------------------------------------------------------------------
@pytest.mark.parametrize("seed,sizes", [(0, [5]), (1, [1, 9, 4]), (2, [13, 2, 7, 1]), (3, [24, 6])])
def test_typical_verify_per_sequence_trees(backend, seed, sizes):
    """Trees of different sizes in one batch: the brute force on each sequence's own tree, and the same
    accepted path as that sequence alone with its own static tree. With near one-hot logits the next
    root is the argmax after the last accepted node (no longer a draw), so it must agree too."""
    gen = torch.Generator().manual_seed(200 + seed)
    trees, batch = random_tree_batch(gen, sizes)
    B, T = batch.parents.shape
    V = 6
    logits = torch.randn(B, T, V, generator=gen) * 3
    tokens = likely_children(gen, logits, torch.randint(0, V, (B, T), generator=gen), batch.parents)
    kw = dict(temperature=0.8, posterior_threshold=0.2, posterior_alpha=0.5)
    v = verify(backend, logits, tokens, batch.paths, **kw)
    for b, tree in enumerate(trees):
        n, D1 = tree.num_nodes, tree.paths.shape[1]
        path = brute_typical(logits, tokens, tree.paths, b, 0.8, 0.2, 0.5)
        assert v.accept_indices[b, : len(path)].tolist() == path and (v.accept_indices[b, len(path):] == -1).all()
        alone = verify(backend, logits[b:b + 1, :n], tokens[b:b + 1, :n], tree.paths, **kw)
        assert v.accept_lengths[b] == alone.accept_lengths[0] and v.last_node[b] == alone.last_node[0]
        assert torch.equal(v.accept_indices[b, :D1], alone.accept_indices[0])
    if max(sizes) >= 9:
        assert v.accept_lengths.max() >= 2  # the cases accept more than the root
    peaked = logits * 1e4
    v = verify(backend, peaked, tokens, batch.paths, **kw)
    for b, tree in enumerate(trees):
        n = tree.num_nodes
        alone = verify(backend, peaked[b:b + 1, :n], tokens[b:b + 1, :n], tree.paths, **kw)
        assert v.last_node[b] == alone.last_node[0]
        assert v.next_root[b] == alone.next_root[0] == logits[b, v.last_node[b]].argmax()


def test_typical_verify_padded_nodes_are_never_accepted(backend):
    """Every probability passes (threshold 0), padded nodes hold the likeliest token: still only real
    nodes are accepted, each sequence its own tree's deepest path."""
    gen = torch.Generator().manual_seed(9)
    trees, batch = random_tree_batch(gen, [1, 6, 11])
    B, T = batch.parents.shape
    logits = torch.randn(B, T, 8, generator=gen)
    tokens = torch.where(batch.valid, torch.randint(0, 8, (B, T), generator=gen), logits[:, 0].argmax(-1, keepdim=True))
    v = verify(backend, logits, tokens, batch.paths, temperature=1.0, posterior_threshold=0.0, posterior_alpha=0.0)
    for b, tree in enumerate(trees):
        got = v.accept_indices[b]
        assert v.accept_lengths[b] == tree.depth + 1 and (got[got >= 0] < tree.num_nodes).all(), got.tolist()


def test_typical_verify_same_tree_per_sequence_is_the_shared_result(backend):
    gen = torch.Generator().manual_seed(10)
    tree = random_tree(gen, 15)
    B = 3
    logits = torch.randn(B, tree.num_nodes, 7, generator=gen) * 2
    tokens = likely_children(gen, logits, torch.randint(0, 7, (B, tree.num_nodes), generator=gen), tree.parents)
    shared = verify(backend, logits, tokens, tree.paths, temperature=0.7)
    for paths in (tree.paths.expand(B, -1, -1).clone(), tree.paths.expand(B, -1, -1)):
        assert_same_verification(verify(backend, logits, tokens, paths, temperature=0.7), shared, "same tree")


def test_typical_verify_bad_inputs_are_named():
    logits, tokens = torch.randn(2, 4, 5), torch.zeros(2, 4, dtype=torch.long)
    paths = torch.tensor([[0, 1, 3], [0, 2, -1]])
    with pytest.raises(ValueError, match=r"or \[B=2, P, D\+1\]"):
        hk.ops.typical_verify(logits, tokens, paths[None], temperature=1.0)
    with pytest.raises(ValueError, match="temperature > 0"):
        hk.ops.typical_verify(logits, tokens, paths, temperature=0.0)
    with pytest.raises(ValueError, match=r"logits must be \[B, T, V\]"):
        hk.ops.typical_verify(logits[:, :3], tokens, paths, temperature=1.0)
