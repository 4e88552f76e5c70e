"""Tree buffers against a brute-force reading of the choices, plus validation."""
import pytest
import torch

from hydra_kernels.tree import Tree, as_tree, chain, default_tree


def random_choices(gen: torch.Generator, n: int, depth: int, max_rank: int = 4) -> list[list[int]]:
    """Random prefix-closed set of n paths (each added path extends an existing node)."""
    chosen: list[tuple[int, ...]] = []
    frontier = [()]
    while len(chosen) < n:
        base = frontier[int(torch.randint(0, len(frontier), (1,), generator=gen))]
        c = base + (int(torch.randint(0, max_rank, (1,), generator=gen)),)
        if c in chosen or len(c) > depth:
            continue
        chosen.append(c)
        frontier.append(c)
    order = torch.randperm(n, generator=gen).tolist()  # input order must not matter
    return [list(chosen[i]) for i in order]


@pytest.mark.parametrize("seed", range(12))
def test_buffers_match_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    choices = random_choices(gen, n=int(torch.randint(1, 40, (1,), generator=gen)), depth=5)
    t = Tree(choices)
    nodes = [()] + sorted((tuple(c) for c in choices), key=lambda c: (len(c), c))
    assert t.num_nodes == len(nodes) and t.depth == max(len(c) for c in nodes)
    for i, c in enumerate(nodes):
        assert t.depths[i] == len(c)
        assert t.parents[i] == (nodes.index(c[:-1]) if c else -1)
        for j, a in enumerate(nodes):  # ancestor-or-self: a is a prefix of c
            assert bool(t.mask[i, j]) == (c[: len(a)] == a)
        if c:
            assert t.ranks[i] == c[-1]
    # leaf paths: exactly the nodes no other node extends, each listed root -> leaf
    leaves = [c for c in nodes if not any(o[: len(c)] == c and len(o) > len(c) for o in nodes)]
    got = [[nodes[k] for k in row if k >= 0] for row in t.paths.tolist()]
    assert sorted(p[-1] for p in got) == sorted(leaves)
    for p in got:
        assert p == [p[-1][:d] for d in range(len(p[-1]) + 1)]
    # drafting plans: every non-root node drafted once, by its parent's slot and its rank
    drafted = set()
    for d, plan in enumerate(t.plans, start=1):
        for child, slot, rank in zip(plan.children.tolist(), plan.child_slot.tolist(), plan.child_rank.tolist()):
            assert nodes[child][:-1] == nodes[plan.parents[slot]] and nodes[child][-1] == rank
            assert len(nodes[child]) == d and rank < plan.topk
            drafted.add(child)
    assert drafted == set(range(1, len(nodes)))


@pytest.mark.parametrize("choices,msg", [
    ([[0], [0, 1], [0, 1]], "more than once"),
    ([[0], [1, 0]], r"prefix \[1\]"),
    ([[0], []], "empty"),
    ([[0], [-1]], "negative"),
])
def test_invalid_choices_are_named(choices, msg):
    with pytest.raises(ValueError, match=msg):
        Tree(choices)


def test_deeper_than_heads_is_a_clear_error():
    with pytest.raises(ValueError, match="3 deep but the drafter has 2 heads"):
        chain(3).check_heads(2)


def test_default_and_chain_trees():
    t = default_tree()
    assert t.num_nodes == 64 and t.depth == 4
    assert Tree(t.choices).choices == t.choices
    c = chain(3)
    assert c.choices == [(0,), (0, 0), (0, 0, 0)] and c.mask.equal(torch.ones(4, 4, dtype=torch.bool).tril())
    assert as_tree("chain-2").choices == [(0,), (0, 0)] and as_tree([[1], [0]]).choices == [(0,), (1,)]


def test_save_load_round_trip(tmp_path):
    t = default_tree(20, depth=3)
    t.save(tmp_path / "tree.json")
    assert as_tree(str(tmp_path / "tree.json")).choices == t.choices
