"""rejection_verify (lossless acceptance by recursive rejection sampling) and its wiring into generate():
seeding, padded nodes, top-k / top-p in every sampling kind, defaults and bad input. That its samples
follow the base distribution exactly is shown statistically in test_sampling_exactness.py."""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels import ops
from hydra_kernels.generate import generate
from hydra_kernels.tree import TreeBatch
from test_llama_vs_transformers import make_hf

TREE = hk.Tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12], [40, 41, 40, 41, 40]]


@pytest.fixture(scope="module")
def model():
    return hk.Llama.from_hf(make_hf("gqa3-tied", seed=5))


@pytest.fixture(scope="module")
def drafter(model):
    torch.manual_seed(0)
    return hk.new_drafter(model, kind="medusa", num_heads=3, num_layers=1)  # fresh: drafts what the model repeats


def _inputs(B=5, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, TREE.num_nodes, V, generator=g) * 2, torch.randint(V, (B, TREE.num_nodes), generator=g)


def test_seeded_and_reproducible():
    logits, tokens = _inputs()
    run = lambda s: ops.rejection_verify(logits, tokens, TREE.paths, temperature=0.9,  # noqa: E731
                                         generator=torch.Generator().manual_seed(s))
    a, b = run(3), run(3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    draws = [run(s) for s in range(20)]  # other seeds, other outcomes
    assert len({tuple(torch.cat([v.accept_indices.flatten(), v.next_root]).tolist()) for v in draws}) > 1


def test_accepted_path_is_a_root_path_and_lengths_agree():
    logits, tokens = _inputs(B=64)
    v = ops.rejection_verify(logits, tokens, TREE.paths, temperature=1.0, generator=torch.Generator().manual_seed(1))
    for b in range(64):
        n = int(v.accept_lengths[b])
        idx = v.accept_indices[b].tolist()
        assert idx[0] == 0 and all(i == -1 for i in idx[n:]) and idx[n - 1] == int(v.last_node[b])
        for d in range(1, n):
            assert int(TREE.parents[idx[d]]) == idx[d - 1]
        # the next root is never a token a rejected child of the last node held
        kids = [j for j in range(TREE.num_nodes) if int(TREE.parents[j]) == idx[n - 1]]
        assert int(v.next_root[b]) not in {int(tokens[b, j]) for j in kids}
    assert (v.accept_lengths > 1).any() and (v.accept_lengths == 1).any()


def test_top_k_1_is_greedy_and_padded_nodes_are_never_accepted():
    """top_k = 1: the base law is the argmax, so exactly the greedy path is accepted; padded nodes carry
    the argmax token and must still never be accepted."""
    B, T, V = 6, 6, 9
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(B, T, V, generator=g)
    best = logits.argmax(-1)  # [B, T]
    parents = torch.tensor([-1, 0, 0, 1, 2, 3]).expand(B, T).clone()
    valid = torch.arange(T)[None, :] < torch.tensor([6, 4, 3, 2, 6, 1])[:, None]
    tree = TreeBatch(parents, valid)
    tokens = best.gather(1, parents.clamp(min=0))  # every node holds its parent's argmax: all acceptable
    tokens[:, 1] = (tokens[:, 1] + 1) % V  # except node 1: the walk must take node 2's branch
    v = ops.rejection_verify(logits, tokens, tree.paths, temperature=0.7, top_k=1, generator=g)
    greedy = ops.greedy_verify(best, tokens, tree.paths)
    assert torch.equal(v.accept_indices, greedy.accept_indices) and torch.equal(v.next_root, greedy.next_root)
    assert not ((v.accept_indices[:, :, None] == torch.arange(T)) & ~valid[:, None, :]).any()


@pytest.mark.parametrize("acceptance", ["rejection", "typical"])
@pytest.mark.parametrize("filt", [dict(top_k=1), dict(top_p=1e-6)])
def test_top_k_top_p_are_honoured_by_speculative_sampling(model, drafter, acceptance, filt):
    """Issue 25, item 1: top_k=1 (or a tiny top_p) with a drafter equals greedy, as plain sampling does."""
    greedy = generate(model, PROMPTS, max_new_tokens=16, eos_token_id=[]).sequences
    plain = generate(model, PROMPTS, max_new_tokens=16, eos_token_id=[], temperature=0.7, seed=3, **filt).sequences
    spec = generate(model, PROMPTS, drafter=drafter, tree=TREE, max_new_tokens=16, eos_token_id=[], temperature=0.7,
                    acceptance=acceptance, seed=3, **filt)
    assert plain == greedy and spec.sequences == greedy
    assert spec.mean_accepted_tokens > 1  # the drafts were used, not bypassed


def test_rejection_is_the_default_for_sampling_and_seeded(model, drafter, monkeypatch):
    kw = dict(drafter=drafter, tree=TREE, max_new_tokens=12, eos_token_id=[], temperature=0.9)
    a = generate(model, PROMPTS, seed=5, **kw)
    assert a.sequences == generate(model, PROMPTS, seed=5, acceptance="rejection", **kw).sequences
    assert a.sequences != generate(model, PROMPTS, seed=6, **kw).sequences
    calls = []
    real = ops.rejection_verify
    monkeypatch.setattr(ops, "rejection_verify", lambda *x, **k: calls.append(1) or real(*x, **k))
    assert generate(model, PROMPTS, seed=5, **kw).sequences == a.sequences and calls


def test_bad_input_is_refused():
    logits, tokens = _inputs()
    with pytest.raises(ValueError, match="temperature > 0"):
        ops.rejection_verify(logits, tokens, TREE.paths, temperature=0.0)
    with pytest.raises(ValueError, match=r"logits must be \[B, T, V\]"):
        ops.rejection_verify(logits[:, :3], tokens, TREE.paths, temperature=1.0)
    with pytest.raises(ValueError, match="top_k"):
        ops.rejection_verify(logits, tokens, TREE.paths, temperature=1.0, top_k=1.5)
    with pytest.raises(ValueError, match="top_p"):
        ops.rejection_verify(logits, tokens, TREE.paths, temperature=1.0, top_p=0.0)
