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


# ---- sampled drafts: draft_probs, the min(1, p/q) rule ------------------------------------------------
def _sampled_inputs(B=5, V=11, seed=0):
    """Random logits, per-node draft distributions q [B, T, V] (full support) and tokens drawn from them."""
    logits, _ = _inputs(B, V, seed)
    g = torch.Generator().manual_seed(seed + 100)
    q = torch.rand(B, TREE.num_nodes, V, generator=g) ** 2 + 1e-3
    q = q / q.sum(-1, keepdim=True)
    tokens = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, TREE.num_nodes)
    return logits, tokens, q


def test_sampled_drafts_seeded_and_reproducible():
    logits, tokens, q = _sampled_inputs()
    run = lambda s: ops.rejection_verify(logits, tokens, TREE.paths, temperature=0.9, draft_probs=q,  # noqa: E731
                                         generator=torch.Generator().manual_seed(s))
    a, b = run(3), run(3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    draws = [run(s) for s in range(20)]
    assert len({tuple(torch.cat([v.accept_indices.flatten(), v.next_root]).tolist()) for v in draws}) > 1


def test_q_equal_to_p_accepts_every_first_child():
    """q = p after the parent: min(1, p/q) = 1, so the first child of every node is accepted and the walk
    runs down the first-child path to its leaf (0 -> 1 -> 4 -> 7 in TREE); the deterministic rule
    accepts the same tokens only with probability p(x)."""
    logits, tokens = _inputs(B=32)
    p = hk.sampling.sampling_probs(logits, 0.8)
    q = p[:, TREE.parents.clamp(min=0)]  # [B, T, V]: row j = p after node j's parent
    v = ops.rejection_verify(logits, tokens, TREE.paths, temperature=0.8, draft_probs=q,
                             generator=torch.Generator().manual_seed(0))
    assert v.accept_indices.tolist() == [[0, 1, 4, 7]] * 32
    det = ops.rejection_verify(logits, tokens, TREE.paths, temperature=0.8, generator=torch.Generator().manual_seed(0))
    assert (det.accept_lengths < 4).any()


def test_one_hot_q_is_the_deterministic_rule():
    """A deterministic draft is q = the one-hot row of its token: the sampled rule then accepts with
    r(x) and removes x, the deterministic rule's decisions (same uniforms, same seed)."""
    logits, tokens = _inputs(B=64)
    q = torch.nn.functional.one_hot(tokens, logits.shape[-1]).float()
    run = lambda **kw: ops.rejection_verify(logits, tokens, TREE.paths, temperature=1.0, top_p=0.9,  # noqa: E731
                                            generator=torch.Generator().manual_seed(4), **kw)
    a, b = run(), run(draft_probs=q)
    assert torch.equal(a.accept_indices, b.accept_indices) and torch.equal(a.accept_lengths, b.accept_lengths)


def _per_sequence_top_k_1_case():
    """TreeBatch with padding; every node holds its parent's argmax except node 1; q rows of drafted nodes
    random with full support, the root's and padded nodes' rows 0 (ignored)."""
    B, T, V = 6, 6, 9
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(B, T, V, generator=g)
    parents = torch.tensor([-1, 0, 0, 1, 2, 3]).expand(B, T).clone()
    valid = torch.arange(T)[None, :] < torch.tensor([6, 4, 3, 2, 6, 1])[:, None]
    tokens = logits.argmax(-1).gather(1, parents.clamp(min=0))
    tokens[:, 1] = (tokens[:, 1] + 1) % V  # the walk must take node 2's branch
    q = torch.rand(B, T, V, generator=g) + 0.05
    q = q / q.sum(-1, keepdim=True)
    q[:, 0] = 0.0
    q[~valid] = 0.0
    return logits, tokens, TreeBatch(parents, valid), q, valid


def test_sampled_top_k_1_is_greedy_and_padded_nodes_are_never_accepted():
    """top_k = 1: p is the argmax's point mass, min(1, p/q) is 1 for the argmax and 0 for any other
    token, and max(p - q, 0) keeps only the argmax: exactly greedy acceptance."""
    logits, tokens, tree, q, valid = _per_sequence_top_k_1_case()
    v = ops.rejection_verify(logits, tokens, tree.paths, temperature=0.7, top_k=1, draft_probs=q,
                             generator=torch.Generator().manual_seed(1))
    greedy = ops.greedy_verify(logits.argmax(-1), tokens, tree.paths)
    assert torch.equal(v.accept_indices, greedy.accept_indices) and torch.equal(v.next_root, greedy.next_root)
    assert (v.accept_lengths > 1).any()
    assert not ((v.accept_indices[:, :, None] == torch.arange(tokens.shape[1])) & ~valid[:, None, :]).any()


def test_a_token_q_cannot_draw_is_skipped_by_the_reference():
    """q_j(x_j) = 0: x_j was not drawn from q_j. The reference walk skips that child (never accepted, the
    residual unchanged), though p gives its token all the mass; the public op refuses it (below)."""
    logits, tokens, tree, q, _ = _per_sequence_top_k_1_case()
    q[:, 2] = 1.0
    q[torch.arange(q.shape[0]), 2, tokens[:, 2]] = 0.0  # node 2 holds the argmax but q_2 gives it nothing
    q[:, 2] /= q[:, 2].sum(-1, keepdim=True)
    acc, idx, nxt, last = ops.reference.rejection_verify(logits, tokens, tree.paths, 0.7, 1, 1.0,
                                                         torch.Generator().manual_seed(1), q)
    assert (acc == 1).all() and torch.equal(nxt, logits[:, 0].argmax(-1))


@pytest.mark.parametrize("case,msg", [
    ("shape", r"draft_probs must be float32/float64 \[B, T, V\]"),
    ("dtype", r"draft_probs must be float32/float64 \[B, T, V\]"),
    ("negative", "draft_probs must be probabilities: >= 0, no NaN"),
    ("nan", "draft_probs must be probabilities: >= 0, no NaN"),
    ("inf", r"draft_probs\[0, 2\] sums to inf"),
    ("not normalised", r"draft_probs\[1, 3\] sums to 2: each drafted node's row must be"),
    ("token not drawable", r"tree_tokens\[2, 4\] = \d+ has probability 0 under draft_probs\[2, 4\]"),
])
def test_bad_draft_probs_are_refused(case, msg):
    logits, tokens, q = _sampled_inputs()
    q[:, 0] = 0.0  # the root's row is ignored: never refused
    if case == "shape":
        q = q[..., :-1]
    elif case == "dtype":
        q = q.half()
    elif case == "negative":
        q[0, 2, 0] = -0.1
    elif case == "nan":
        q[0, 2, 0] = float("nan")
    elif case == "inf":
        q[0, 2, 0] = float("inf")
    elif case == "not normalised":
        q[1, 3] *= 2
    else:
        q[2, 4] = (q[2, 4] + 1.0 / q.shape[-1]).index_fill(0, tokens[2, 4], 0.0)
        q[2, 4] /= q[2, 4].sum()
    with pytest.raises(ValueError, match=msg):
        ops.rejection_verify(logits, tokens, TREE.paths, temperature=1.0, draft_probs=q)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_sampled_head_drafts_through_generate(model, kind, monkeypatch):
    """The head drafters with draft_temperature > 0 at temperature > 0: each step's proposal carries its
    draft distributions to rejection_verify; seeded runs repeat; drafts are accepted."""
    torch.manual_seed(0)
    d = hk.new_drafter(model, kind=kind, num_heads=3, num_layers=1)
    d.draft_temperature = 0.5
    seen = []
    real = ops.rejection_verify
    monkeypatch.setattr(ops, "rejection_verify", lambda *x, **k: seen.append(k["draft_probs"]) or real(*x, **k))
    kw = dict(drafter=d, tree=TREE, max_new_tokens=12, eos_token_id=[], temperature=0.9)
    a = generate(model, PROMPTS, seed=5, **kw)
    assert seen and all(q is not None and q.shape[1] == TREE.num_nodes for q in seen)
    assert a.sequences == generate(model, PROMPTS, seed=5, **kw).sequences
    assert a.sequences != generate(model, PROMPTS, seed=6, **kw).sequences
    assert a.mean_accepted_tokens > 1


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_sampled_head_drafts_keep_greedy_exact(model, kind):
    """top_k = 1 with rejection acceptance, and greedy acceptance at temperature 0 (exact for any draft):
    sampled drafts emit exactly the plain greedy tokens."""
    torch.manual_seed(0)
    d = hk.new_drafter(model, kind=kind, num_heads=3, num_layers=1)
    d.draft_temperature = 0.5
    greedy = generate(model, PROMPTS, max_new_tokens=16, eos_token_id=[]).sequences
    top1 = generate(model, PROMPTS, drafter=d, tree=TREE, max_new_tokens=16, eos_token_id=[], temperature=0.7,
                    top_k=1, seed=3)
    assert top1.sequences == greedy
    if kind == "medusa":  # fresh Medusa heads draft what the model repeats: its draws are the argmax at times
        assert top1.mean_accepted_tokens > 1
    assert generate(model, PROMPTS, drafter=d, tree=TREE, max_new_tokens=16, eos_token_id=[]).sequences == greedy


def test_draft_temperature_is_checked_and_off_by_default(model, drafter):
    assert drafter.draft_temperature == 0.0
    for bad in (-0.1, float("nan"), "1", True):
        with pytest.raises(ValueError, match="draft_temperature must be a finite number >= 0"):
            drafter.draft_temperature = bad
    state = drafter.start(model, 2, 32, TREE, model.backend_plan(None))
    drafter.use_generator(state, torch.Generator().manual_seed(0))
    state.h = torch.randn(2, model.config.hidden_size)
    prop = drafter.propose(state, torch.tensor([1, 2]), torch.tensor([4, 4], dtype=torch.int32))
    assert prop.draft_probs is None  # top-k drafts: the deterministic rule
