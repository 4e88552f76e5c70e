"""Head training (distillation + CE, checkpoint/resume), head ranks and tree search, on a tiny random
Llama (fast); the real-model recipes live in python/."""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.training import HiddenStates, compute_hidden_states, train_drafter
from hydra_kernels.generate import generate
from hydra_kernels.training.evaluate import UNRANKED, head_ranks, split_ranks, topk_accuracy
from hydra_kernels.training.tree_search import grow_tree, path_frequencies, replay_accept_lengths, time_tree_sizes
from hydra_kernels.tree import Tree
from helpers import assert_close_rel
from test_llama_vs_transformers import make_hf


@pytest.fixture(scope="module")
def tiny():
    model = hk.Llama.from_hf(make_hf("gqa3-tied", seed=3))
    V = model.config.vocab_size  # learnable text: arithmetic progressions mod V (next token = previous + stride)
    seqs = [[(start + stride * i) % V for i in range(n)] for start, stride, n in ((3, 7, 30), (50, 2, 17), (9, 7, 41))]
    return model, seqs, compute_hidden_states(model, seqs, progress=False, dtype=torch.float32)


@pytest.mark.parametrize("kind", ["medusa", "hydra", "hydra++"])
@pytest.mark.parametrize("distill_weight", [1.0, 0.5])
def test_training_lowers_the_loss(tiny, kind, distill_weight):
    model, _, data = tiny
    torch.manual_seed(0)
    dv = torch.arange(0, model.config.vocab_size, 2)  # a draft vocabulary of half the tokens
    d = hk.new_drafter(model, kind, num_heads=3, draft_vocab=dv)
    hist = train_drafter(model, d, data, steps=60, lr=1e-2, positions_per_step=32, distill_weight=distill_weight,
                         progress=False)
    first, last = sum(hist["loss"][:5]) / 5, sum(hist["loss"][-5:]) / 5
    assert last < 0.9 * first, (first, last)
    assert len(hist["head_loss"][0]) == 3 and not d.training


def test_checkpoint_resume_equals_one_run(tiny, tmp_path):
    model, _, data = tiny

    torch.manual_seed(0)
    a = hk.new_drafter(model, "hydra", num_heads=2)
    train_drafter(model, a, data, steps=12, positions_per_step=16, progress=False)
    ck = tmp_path / "ck.pt"
    torch.manual_seed(0)
    b = hk.new_drafter(model, "hydra", num_heads=2)
    hist = train_drafter(model, b, data, steps=12, positions_per_step=16, progress=False, checkpoint=ck,
                         checkpoint_every=5)
    assert ck.exists()
    state = torch.load(ck, weights_only=False)
    assert state["step"] == 12 and len(hist["loss"]) == 12
    # interrupt-and-resume: a run stopped at step 5 (its checkpoint) and continued gives the same heads
    torch.manual_seed(0)
    c = hk.new_drafter(model, "hydra", num_heads=2)
    ck2 = tmp_path / "ck2.pt"
    with pytest.raises(KeyboardInterrupt):
        _train_and_interrupt(model, c, data, ck2, stop_after=7)
    torch.manual_seed(0)
    c2 = hk.new_drafter(model, "hydra", num_heads=2)
    train_drafter(model, c2, data, steps=12, positions_per_step=16, progress=False, checkpoint=ck2, checkpoint_every=5)
    for (k, x), (_, y) in zip(a.state_dict().items(), c2.state_dict().items()):
        assert torch.allclose(x, y, atol=1e-6), k


def test_checkpoint_of_another_run_is_never_resumed(tiny, tmp_path):
    """A checkpoint carries its run's fingerprint: resuming it with other data or settings would hand
    back heads trained on something else, so that is refused before any step; checkpoint_dir names
    the file by the fingerprint, so a new run starts afresh beside the old one and a rerun resumes."""
    model, _, data = tiny
    ck = tmp_path / "ck.pt"
    torch.manual_seed(0)
    train_drafter(model, hk.new_drafter(model, "hydra", num_heads=2), data, steps=4, positions_per_step=16,
                  progress=False, checkpoint=ck)
    other_data = data.train_from([5, 0, 0])  # same tokens, other trained positions
    before = ck.read_bytes()
    for kw in ({"lr": 5e-3}, {"seqs_per_step": 3}):
        with pytest.raises(ValueError, match="different training run"):
            train_drafter(model, hk.new_drafter(model, "hydra", num_heads=2), data, steps=4, positions_per_step=16,
                          progress=False, checkpoint=ck, **kw)
    with pytest.raises(ValueError, match="different training run"):
        train_drafter(model, hk.new_drafter(model, "hydra", num_heads=2), other_data, steps=4, positions_per_step=16,
                      progress=False, checkpoint=ck)
    dv = torch.arange(1, model.config.vocab_size)  # other draft vocabulary, same shapes: its reversal
    ck_dv = tmp_path / "dv.pt"
    train_drafter(model, hk.new_drafter(model, "hydra", num_heads=2, draft_vocab=dv), data, steps=4,
                  positions_per_step=16, progress=False, checkpoint=ck_dv)
    with pytest.raises(ValueError, match="different training run"):
        train_drafter(model, hk.new_drafter(model, "hydra", num_heads=2, draft_vocab=dv.flip(0)), data, steps=4,
                      positions_per_step=16, progress=False, checkpoint=ck_dv)
    assert ck.read_bytes() == before

    runs = tmp_path / "runs"
    heads = {}
    for name, d_in in (("a", data), ("b", other_data), ("a again", data)):
        torch.manual_seed(0 if name != "a again" else 1)  # a resumed run must not depend on its initial weights
        d = hk.new_drafter(model, "hydra", num_heads=2)
        hist = train_drafter(model, d, d_in, steps=4, positions_per_step=16, progress=False, checkpoint_dir=runs)
        assert len(hist["loss"]) == 4
        heads[name] = d.state_dict()
    assert len(list(runs.glob("ckpt-hydra-*.pt"))) == 2
    assert all(torch.equal(heads["a"][k], heads["a again"][k]) for k in heads["a"])  # resumed the finished run
    assert not all(torch.equal(heads["a"][k], heads["b"][k]) for k in heads["a"])


def _train_and_interrupt(model, drafter, data, ckpt, stop_after):
    calls = {"n": 0}
    orig = torch.optim.AdamW.step

    def step(self, *a, **k):
        calls["n"] += 1
        if calls["n"] > stop_after:
            raise KeyboardInterrupt
        return orig(self, *a, **k)

    torch.optim.AdamW.step = step
    try:
        train_drafter(model, drafter, data, steps=12, positions_per_step=16, progress=False, checkpoint=ckpt,
                      checkpoint_every=5)
    finally:
        torch.optim.AdamW.step = orig


def test_bad_training_arguments(tiny):
    model, _, data = tiny
    with pytest.raises(ValueError, match="distill_weight"):
        train_drafter(model, hk.new_drafter(model, "hydra", num_heads=1), data, distill_weight=2.0)


def test_prefix_batches_draw_positions_uniformly(tiny):
    """Hydra++ trains on whole sequences (its prefix layer attends over their past): a sequence is drawn
    in proportion to its trainable positions, so every trainable position is (nearly) equally likely,
    as for heads without a prefix layer, whatever the sequence lengths."""
    from hydra_kernels.training.heads import _Batcher

    model, _, data = tiny  # sequences of 30, 17 and 41 tokens
    data = data.train_from([0, 0, 35])  # trainable: 29, 16 and 6 positions (q >= 1, and q >= 35 in the third)
    d = hk.new_drafter(model, "hydra++", num_heads=2)
    b = _Batcher(data, d, positions=4, seqs_per_step=1, gen=torch.Generator().manual_seed(0))
    counts = torch.zeros(data.num_tokens)
    with torch.no_grad():
        for _ in range(1500):
            q, hidden_at = b.sample("cpu", torch.float32)
            counts[q] += 1
    trainable = b.ok
    assert counts[~trainable].sum() == 0
    freq = counts[trainable] / counts.sum()
    n = int(trainable.sum())
    # ~118 hits per position: a rtol of 0.35 is ~4 standard deviations
    assert n == 51 and torch.allclose(freq, torch.full_like(freq, 1 / n), rtol=0.35), freq * n
    with pytest.raises(ValueError, match="no trainable position"):
        _Batcher(data.train_from([40, 40, 50]), d, positions=4, seqs_per_step=1, gen=torch.Generator())


def test_prefix_batches_read_the_prefix_layer_over_the_whole_past(tiny):
    """The rows a Hydra++ step reads (p = q-1-d, several sequences, one drawn twice possibly) equal the
    prefix layer run over each whole sequence (trained weights: random, so the past matters)."""
    from hydra_kernels.training.heads import _Batcher, _sequence_bounds
    from test_drafters import randomise

    model, _, data = tiny
    for final_norm in (True, False):
        d = randomise(hk.new_drafter(model, "hydra++", num_heads=3, prefix_final_norm=final_norm), 8)
        b = _Batcher(data, d, positions=10, seqs_per_step=4, gen=torch.Generator().manual_seed(1))
        starts, ends = _sequence_bounds(data)
        with torch.no_grad():
            full = torch.cat([d.prefix.forward_full(data.hidden[s:e][None])[0] for s, e in zip(starts, ends)])
            for _ in range(5):
                q, hidden_at = b.sample("cpu", torch.float32)
                assert q.numel() == 12  # 4 sequences x ceil(10 / 4)
                for dd in range(3):
                    p = q[b.before[q] >= dd + 1] - 1 - dd
                    assert_close_rel(hidden_at(p), full[p], 1e-5, f"rows of head {dd}")


def test_head_ranks_follow_the_teacher_forced_path(tiny):
    model, seqs, data = tiny
    torch.manual_seed(1)
    d = hk.new_drafter(model, "hydra", num_heads=2)
    r = head_ranks(model, d, seqs, [0, 5, 0], max_rank=4, data=data)
    assert r.shape == (28 + 10 + 39, 2)
    # brute force one entry: head 1 at position 3 of sequence 0
    ids = torch.tensor(seqs[0])
    h = data.hidden[:30]
    x = torch.cat([h[3], model.tok_embeddings(ids[4]), model.tok_embeddings(ids[5])])
    top = d.logits(model, 1, x[None])[0].topk(4).indices.tolist()
    want = top.index(int(ids[6])) if int(ids[6]) in top else UNRANKED
    assert int(r[3, 1]) == want
    assert r[27, 1] == -1  # position 27 of 30: head 1's target (29 + 1) is past the end
    acc = topk_accuracy(r, ks=(1, 4))
    assert [a["head"] for a in acc] == [1, 2] and all(0 <= a["top1"] <= a["top4"] <= 1 for a in acc)


def test_tree_search_greedy_growth():
    ranks = torch.tensor([[0, 0, 1], [0, 0, 0], [0, 1, -1], [1, 0, 5], [0, 0, 0], [7, 0, 0]])
    f = path_frequencies(ranks, max_rank=4)
    assert f[(0,)] == 4 and f[(0, 0)] == 3 and f[(0, 0, 0)] == 2 and f[(1, 0)] == 1 and (7,) not in f
    tree, expected = grow_tree(ranks, num_nodes=4, max_rank=4)
    assert tree.choices == [(0,), (0, 0), (0, 0, 0)]  # 4/6, 3/6, 2/6 of the positions
    assert expected == pytest.approx([1.0, 1 + 4 / 6, 1 + 7 / 6, 1 + 9 / 6])
    full, exp_full = grow_tree(ranks, num_nodes=100, max_rank=4)
    assert full.num_nodes == len(f) + 1
    # expected tokens per step = 1 + mean accepted depth, simulated directly
    sim = sum(1 + next((d for d in range(3, 0, -1) if tuple(row[:d]) in set(full.choices)), 0)
              for row in ranks.tolist()) / len(ranks)
    assert exp_full[-1] == pytest.approx(sim)


def test_time_tree_sizes_rows(tiny):
    """Interleaved timing of real decoding per tree size: one row per size, in the given order; size 1
    is plain decoding (1 token per step), a tree's measured tokens/step is within [1, depth + 1]."""
    model, seqs, data = tiny
    torch.manual_seed(2)
    d = hk.new_drafter(model, "hydra", num_heads=2)
    ranks = head_ranks(model, d, seqs, [0, 5, 0], max_rank=4, data=data)
    sizes = [1, 3, 5]
    rows = time_tree_sizes(model, d, ranks, sizes, [s[:6] for s in seqs], max_new_tokens=12, max_rank=4,
                           progress=False)
    assert [r["size"] for r in rows] == sizes
    assert rows[0]["tokens_per_step"] == 1.0 and rows[0]["expected_tokens_per_step"] == 1.0
    for r in rows:
        assert r["tokens_per_s"] > 0 and 1.0 <= r["tokens_per_step"] <= 3.0
        assert r["expected_tokens_per_step"] >= 1.0


@pytest.mark.parametrize("kind,prefix_final_norm", [("medusa", True), ("hydra", True), ("hydra++", True),
                                                  ("hydra++", False)])
def test_replay_equals_real_speculative_decoding(tiny, kind, prefix_final_norm):
    """Tokens per step replayed from head ranks on plain greedy answers (how eval_heads reports larger
    trees) equal real speculative decoding's accept lengths, step by step."""
    model, seqs, _ = tiny
    prompts = [s[:5] for s in seqs] + [seqs[0][7:9]]
    n = 24
    plain = generate(model, prompts, max_new_tokens=n).sequences
    full = [p + a for p, a in zip(prompts, plain)]
    data = compute_hidden_states(model, full, progress=False, dtype=torch.float32)
    torch.manual_seed(4)
    d = hk.new_drafter(model, kind, num_heads=3, prefix_final_norm=prefix_final_norm)
    train_drafter(model, d, data, steps=40, lr=1e-2, positions_per_step=32, progress=False)  # some acceptance
    starts = [len(p) - 1 for p in prompts]
    blocks = split_ranks(head_ranks(model, d, full, starts, max_rank=4, data=data), full, starts)
    assert [len(b) for b in blocks] == [len(a) - 1 for a in plain]
    tree = Tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)])
    out = generate(model, prompts, drafter=d, tree=tree, max_new_tokens=n)
    assert out.sequences == plain
    replay = [replay_accept_lengths(b, len(a), tree) for b, a in zip(blocks, plain)]
    assert replay == out.accept_lengths
    assert any(k > 2 for acc in replay for k in acc)  # depth >= 2 accepted somewhere: the test has teeth


def test_steps_within_a_time_budget_drops_fixed_costs():
    """training/loop.steps_within: an untimed warm-up probe, then the per-step cost from the difference of two
    probes (fixed costs drop out), or the longer probe's mean when noise makes that difference vanish."""
    from hydra_kernels.training.loop import steps_within

    calls = []

    def timed(n):  # 4 s of fixed cost (optimiser, warm-up), then 0.5 s a step
        calls.append(n)
        return 4.0 + 0.5 * n

    assert steps_within(30.0, timed) == 60 and calls == [3, 3, 13]
    assert steps_within(0.1, timed) == 1
    flat = iter([9.0, 5.0, 5.0])  # warm-up, then two probes timed alike: a step costs at most 5 s / 13
    assert steps_within(100.0, lambda n: next(flat)) == int(100 / (5.0 / 13))
    left = iter([30.0, -1.0])  # a deadline: the seconds left are asked after the probes, which spend from them
    calls.clear()
    assert steps_within(lambda: next(left), timed) == 60 and calls == [3, 3, 13]
    with pytest.raises(ValueError, match="no time is left to train"):
        steps_within(lambda: next(left), timed)
    for budget, probes, msg in [(0, (3, 13), "budget must be > 0"), (10, (5, 5), "0 < lo < hi"),
                                (10, (0, 4), "0 < lo < hi")]:
        with pytest.raises(ValueError, match=msg):
            steps_within(budget, timed, probes)
