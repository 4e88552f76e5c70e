"""Verification (greedy, typical) and commit_kv reference ops against brute-force per-path loops."""
import math

import pytest
import torch

import hydra_kernels as hk
from test_tree import random_choices


def planted(gen, B, tree, V, p_accept=0.6):
    """Random target tokens; each node copies its parent's target with probability p_accept."""
    T = tree.num_nodes
    target = torch.randint(0, V, (B, T), generator=gen)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    for i in range(1, T):
        hit = torch.rand(B, generator=gen) < p_accept
        tokens[:, i] = torch.where(hit, target[:, tree.parents[i]], tokens[:, i])
    return target, tokens


def brute_greedy(target, tokens, tree, b):
    best, best_len = None, -1
    for row in tree.paths.tolist():
        path = [n for n in row if n >= 0]
        k = 1
        while k < len(path) and tokens[b, path[k]] == target[b, path[k - 1]]:
            k += 1
        if k > best_len:  # strict: the first longest path wins
            best, best_len = path[:k], k
    return best


@pytest.mark.parametrize("seed", range(10))
def test_greedy_verify_matches_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    tree = hk.Tree(random_choices(gen, n=int(torch.randint(1, 30, (1,), generator=gen)), depth=4))
    B = 1 + seed % 4
    target, tokens = planted(gen, B, tree, V=5)
    v = hk.ops.greedy_verify(target, tokens, tree.paths)
    for b in range(B):
        path = brute_greedy(target, tokens, tree, b)
        n = len(path)
        assert v.accept_lengths[b] == n
        assert v.accept_indices[b, :n].tolist() == path and (v.accept_indices[b, n:] == -1).all()
        assert v.last_node[b] == path[-1] and v.next_root[b] == target[b, path[-1]]


def brute_typical(logits, tokens, tree, b, temperature, thr, alpha):
    p = torch.softmax(logits[b].double() / temperature, -1)
    ent = -(p * torch.log(p)).sum(-1)
    cut = torch.clamp(alpha * torch.exp(-ent), max=thr)
    best, key = None, None
    for row in tree.paths.tolist():
        path = [n for n in row if n >= 0]
        k, score = 1, 0.0
        while k < len(path) and p[path[k - 1], tokens[b, path[k]]] > cut[path[k - 1]]:
            score += math.log(p[path[k - 1], tokens[b, path[k]]])
            k += 1
        if key is None or (k, score) > key:
            best, key = path[:k], (k, score)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_typical_verify_matches_brute_force(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    tree = hk.Tree(random_choices(gen, n=int(torch.randint(1, 25, (1,), generator=gen)), depth=4))
    B, V = 3, 6
    logits = torch.randn(B, tree.num_nodes, V, generator=gen) * 3
    _, tokens = planted(gen, B, tree, V=V, p_accept=0.0)
    for i in range(1, tree.num_nodes):  # make the parent's likeliest token common among children
        hit = torch.rand(B, generator=gen) < 0.5
        tokens[:, i] = torch.where(hit, logits[:, tree.parents[i]].argmax(-1), tokens[:, i])
    v = hk.ops.typical_verify(logits, tokens, tree.paths, temperature=0.8, posterior_threshold=0.2,
                              posterior_alpha=0.5, generator=torch.Generator().manual_seed(0))
    for b in range(B):
        path = brute_typical(logits, tokens, tree, b, 0.8, 0.2, 0.5)
        assert v.accept_indices[b, : len(path)].tolist() == path, f"sequence {b}"
        assert v.accept_lengths[b] == len(path) and v.last_node[b] == path[-1]


def test_typical_limits_and_seeding():
    gen = torch.Generator().manual_seed(7)
    tree = hk.tree.default_tree(30, depth=4)
    B, V = 4, 50
    logits = torch.randn(B, tree.num_nodes, V, generator=gen)
    tokens = torch.randint(0, V, (B, tree.num_nodes), generator=gen)
    run = lambda **kw: hk.ops.typical_verify(logits, tokens, tree.paths, temperature=1.0,
                                             generator=torch.Generator().manual_seed(1), **kw)
    everything = run(posterior_threshold=0.0, posterior_alpha=0.0)  # every positive probability passes
    assert (everything.accept_lengths == tree.depth + 1).all()
    nothing = run(posterior_threshold=1e9, posterior_alpha=1e9)  # no probability exceeds 1
    assert (nothing.accept_lengths == 1).all() and (nothing.last_node == 0).all()
    a, b = run(), run()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    peaked = hk.ops.typical_verify(logits * 1e4, tokens, tree.paths, temperature=1.0)  # ~one-hot next root
    assert torch.equal(peaked.next_root, logits[torch.arange(B), peaked.last_node].argmax(-1))


@pytest.mark.parametrize("B,K1,lens", [(1, 1, [1]), (1, 5, [5]), (3, 4, [1, 4, 2]), (4, 6, [6, 3, 1, 5])])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_commit_kv_matches_row_by_row_copy(B, K1, lens, index_dtype):
    gen = torch.Generator().manual_seed(B * 10 + K1)
    T, S = 12, 40
    kv = torch.randn(3, 2, B, S, 2, 8, generator=gen)
    seqlens = torch.randint(0, S - T, (B,), generator=gen).to(torch.int32)
    # accepted node indices: increasing, first is the root (0), each >= its position (overlap!)
    idx = torch.full((B, K1), -1, dtype=torch.long)
    for b in range(B):
        picks = sorted(torch.randperm(T - 1, generator=gen)[: lens[b] - 1].add(1).tolist())
        idx[b, : lens[b]] = torch.tensor([0] + picks)
    expected = kv.clone()
    for b in range(B):
        s = int(seqlens[b])
        src = [kv[:, :, b, s + int(idx[b, i])].clone() for i in range(lens[b])]
        for i, row in enumerate(src):
            expected[:, :, b, s + i] = row
    hk.ops.commit_kv(kv, seqlens, idx.to(index_dtype), torch.tensor(lens, dtype=index_dtype))
    assert torch.equal(kv, expected)


def test_commit_kv_bad_inputs():
    kv = torch.zeros(1, 2, 2, 8, 1, 4)
    with pytest.raises(ValueError, match="accept_indices must be"):
        hk.ops.commit_kv(kv, torch.zeros(2, dtype=torch.int32), torch.zeros(3, 2, dtype=torch.long), torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="int32 or int64"):
        hk.ops.commit_kv(kv, torch.zeros(2), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, dtype=torch.long))
