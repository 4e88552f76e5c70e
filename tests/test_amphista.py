"""Amphista drafter: drafting (adaptation layers through their KV buffers, pending chunks, heads, the
bi-directional block, the LM head) equals a brute-force, cache-free computation over the whole committed
sequence, across two steps of a ragged batch; greedy output is plain greedy's; checkpoints round-trip;
bad input is refused before work; training lowers the loss and resumes."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import hydra_kernels as hk
from hydra_kernels.drafters import AmphistaDrafter
from hydra_kernels.generate import generate
from hydra_kernels.model.llama import PREFILL_CHUNK_TOKENS
from hydra_kernels.model.rope import rope_inv_freq, rope_table
from hydra_kernels.training import HiddenStates, train_amphista
from hydra_kernels.training.evaluate import head_ranks
from helpers import assert_close_rel
from test_llama_vs_transformers import make_hf


@pytest.fixture(scope="module")
def model():
    return hk.Llama.from_hf(make_hf("gqa3-tied", seed=5))


def randomised(model, seed=0, **opts) -> AmphistaDrafter:
    d = hk.new_drafter(model, kind="amphista", **opts)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():  # norms near 1, the rest random (zero-initialised parts too)
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim > 1 else 0.2) + (1.0 if "norm" in name else 0.0))
    return d


@torch.no_grad()
def brute_force(model, d: AmphistaDrafter, text: list[int]):
    """text: the committed tokens then the root -> (head states [K, H], logits [K, Vd]), written out from the
    definition: each stage a causal decoder layer over the whole sequence (no cache), head d's ResBlock on
    its stage's last state, then attention over all K rows with explicit softmax loops."""
    hidden = model.hidden_states(torch.tensor([text[:-1]]))[0]  # h_t, t < n
    emb = model.tok_embeddings(torch.tensor(text[1:]))  # E(x_{t+1})
    n = hidden.shape[0]
    cos, sin = rope_table(rope_inv_freq(d.block_config), n)
    x, last = hidden, []
    for fc, blk in zip(d.fc, d.adapt):
        x = blk((torch.cat([x, emb], -1) @ fc.weight.T)[None], cos[None], sin[None])[0]  # causal, no cache
        last.append(x[-1])
    K, split = d.num_heads, d.config.stage_split
    rows = []
    for k in range(K):
        a = last[0 if k < split else 1]
        lin = d.head_mlp[k].linear
        rows.append(a + F.silu(a @ lin.weight.T + lin.bias))
    x = torch.stack(rows) + d.pos_emb  # [K, H]
    blk, att = d.mixer, d.mixer.attention
    Hq, Hkv, D = att.n_heads, att.n_kv_heads, att.head_dim
    q, k_, v = (blk.attention_norm(x) @ att.wqkv.weight.T).split([Hq * D, Hkv * D, Hkv * D], -1)
    o = torch.zeros(K, Hq, D)
    for j in range(Hq):
        g = j // (Hq // Hkv)
        for i in range(K):
            qi = q[i, j * D:(j + 1) * D]
            s = torch.tensor([float(qi @ k_[r, g * D:(g + 1) * D]) / math.sqrt(D) for r in range(K)])
            p = torch.softmax(s, 0)  # over all K rows: no mask
            o[i, j] = sum(p[r] * v[r, g * D:(g + 1) * D] for r in range(K))
    h = x + o.flatten(1) @ att.wo.weight.T
    y = h + blk.feed_forward(blk.ffn_norm(h))
    if d.lm_down is not None:
        logits = y @ d.lm_down.weight.T @ d.lm_up.weight.T
    else:
        w = model.output.weight if d.draft_vocab is None else model.output.weight[d.draft_vocab]
        if d.packed:  # the run read the tied rows from bf16 panels (draft_heads.DRAFT_PACK_DTYPE)
            w = w.bfloat16().float()
        logits = y @ w.T
    return y, logits


def tree_tokens(d, logits, tree: hk.tree.Tree, root: int) -> list[int]:
    """Node by node: node c's token is head len(c)-1's guess of rank c[-1]."""
    out = [root]
    for c in tree.choices:
        idx = logits[len(c) - 1].topk(c[-1] + 1).indices[c[-1]]
        out.append(int(d.token_ids(idx)))
    return out


def run_two_proposals(model, d, prompts, accepted, roots, tree, backend):
    """prefill -> propose (root = roots[0]) -> accept `accepted[b]` tokens (root first) -> propose
    (root = roots[1]); returns the proposals, the head states each computed, the texts after step 1."""
    B = len(prompts)
    plan = model.backend_plan(backend)
    bound = d.resolve_tree(tree, "cpu")
    state = d.start(model, B, 64, bound, plan)
    seen = []
    orig = d.head_states
    d.head_states = lambda stages: seen.append(orig(stages)) or seen[-1]
    try:
        L = max(map(len, prompts))
        ids = torch.tensor([p + [0] * (L - len(p)) for p in prompts])
        lens = torch.tensor([len(p) for p in prompts])
        d.after_prefill(state, model.hidden_states(ids), lens)
        d.observe_tokens(state, [p + [r] for p, r in zip(prompts, roots[0])])
        p1 = d.propose(state, torch.tensor(roots[0]), lens.int())
        W = max(map(len, accepted))
        texts = [p + a for p, a in zip(prompts, accepted)]
        hidden = torch.zeros(B, W, model.config.hidden_size)
        tok = torch.zeros(B, W, dtype=torch.long)
        for b, (p, a) in enumerate(zip(prompts, accepted)):
            hidden[b, : len(a)] = model.hidden_states(torch.tensor([texts[b]]))[0, len(p):]
            tok[b, : len(a)] = torch.tensor(a)
        d.after_step(state, hidden, tok, torch.tensor([len(a) for a in accepted]))
        d.observe_tokens(state, [a[1:] + [r] for a, r in zip(accepted, roots[1])])
        p2 = d.propose(state, torch.tensor(roots[1]), torch.tensor([len(t) for t in texts], dtype=torch.int32))
    finally:
        del d.head_states
    return (p1, p2), seen, texts


@pytest.mark.parametrize("opts,tree", [
    (dict(), [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2], [0, 0, 0, 0]]),
    (dict(num_heads=3, lm_head="low_rank", lm_head_rank=16, draft_vocab=list(range(100, 0, -3))), "chain-3"),
    (dict(num_heads=5, stage_split=5), [[0], [3], [0, 2], [0, 2, 1]]),  # one adaptation stage, tree shallower than K
])
@pytest.mark.backends("reference", "native")
def test_drafting_equals_brute_force(model, opts, tree, backend):
    d = randomised(model, seed=3, **opts)
    if backend == "native":  # a packed CPU plan holds the drafter's linears in bf16 panels: make them bf16 values
        with torch.no_grad():
            for p in d.parameters():
                p.copy_(p.bfloat16().float())
    check_two_steps_equal_brute_force(model, d, tree, backend)


@pytest.mark.parametrize("chunk_tokens", [3, 6])
def test_prompts_first_pass_in_prefill_chunks(model, monkeypatch, chunk_tokens):
    """The prompts' first pass through the adaptation layers runs in prefill chunks (model/llama.py
    chunked_prefill): 1 or 2 positions per chunk for 3 sequences, so the last real positions (6, 1, 4)
    fall in different chunks; the drafts still equal the brute force's, at both steps."""
    monkeypatch.setitem(PREFILL_CHUNK_TOKENS, "cpu", chunk_tokens)
    check_two_steps_equal_brute_force(model, randomised(model, seed=4), [[0], [1], [0, 0], [1, 0], [0, 0, 0]],
                                      "reference")


def check_two_steps_equal_brute_force(model, d, tree, backend):
    t = d.resolve_tree(tree, "cpu")
    prompts = [[5, 17, 3, 44, 9, 21, 7], [2, 8], [60, 61, 62, 63, 64]]  # ragged
    accepted = [[30, 31, 32], [40], [50, 51]]  # root first; different accept lengths
    roots = [[30, 40, 50], [33, 41, 52]]
    props, seen, texts = run_two_proposals(model, d, prompts, accepted, roots, tree, backend)
    for step, (prop, step_texts, step_roots) in enumerate(zip(props, (prompts, texts), roots)):
        assert prop.tokens.shape == (3, t.num_nodes)
        for b in range(3):
            y, logits = brute_force(model, d, step_texts[b] + [step_roots[b]])
            assert_close_rel(seen[step][b], y, 1e-4, f"step {step} sequence {b}: head states")
            assert prop.tokens[b].tolist() == tree_tokens(d, logits, t, step_roots[b]), f"step {step} sequence {b}"
            assert prop.positions[b].tolist() == (len(step_texts[b]) + t.depths).tolist()


@pytest.mark.parametrize("opts,tree", [
    (dict(), None),
    (dict(), [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
    (dict(num_heads=3, lm_head="low_rank", lm_head_rank=8, draft_vocab=list(range(0, 101, 2))), "chain-3"),
])
@pytest.mark.backends("reference", "native")
def test_greedy_output_is_plain_greedy(model, opts, tree, backend):
    d = randomised(model, seed=1, **opts)
    prompts = [[5, 17, 3, 44, 9], [2, 8], [60, 61, 62, 63, 64, 65, 66, 67]]
    ref = generate(model, prompts, max_new_tokens=24, backend=backend)
    out = generate(model, prompts, drafter=d, max_new_tokens=24, tree=tree, backend=backend)
    assert out.sequences == ref.sequences


def test_combined_with_ngram_is_plain_greedy(model):
    """The combined drafter forwards observe_tokens, which brings amphista its prompts' next tokens."""
    prompts = [[5, 17, 3, 5, 17, 3, 5], [2, 8, 2, 8]]  # repeats: the n-gram side proposes too
    ref = generate(model, prompts, max_new_tokens=20, eos_token_id=[])
    ng = hk.new_drafter(model, kind="ngram", max_ngram=3, num_tokens=4)
    d = hk.new_drafter(model, kind="combined", drafters=[randomised(model, seed=2, num_heads=2), ng], node_budget=5)
    out = generate(model, prompts, drafter=d, max_new_tokens=20, eos_token_id=[], tree=[[0], [1], [0, 0]])
    assert out.sequences == ref.sequences


def test_head_ranks_are_the_drafting_ranks(model):
    """evaluate.head_ranks (tree search's input) ranks each head's true token as drafting ranks it at p."""
    d = randomised(model, seed=7, num_heads=3)
    seq = [5, 17, 3, 44, 9, 21, 7, 11, 13, 2]
    data = HiddenStates(torch.tensor(seq), model.hidden_states(torch.tensor([seq]))[0],  # fp32, not the bf16 cache
                        torch.arange(len(seq) - 1, -1, -1))
    ranks = head_ranks(model, d, [seq], [2], max_rank=101, data=data)  # the whole vocabulary: every token ranked
    assert ranks.shape == (len(seq) - 4, 3)
    for i, p in enumerate(range(2, len(seq) - 2)):
        _, logits = brute_force(model, d, seq[: p + 2])  # committed x_0..x_p, root x_{p+1}
        for k in range(3):
            if p + 2 + k >= len(seq):
                assert ranks[i, k] == -1
                continue
            z = logits[k][seq[p + 2 + k]]  # the true token's logit; ranks between near-ties may swap
            tol = 1e-4 * logits[k].abs().max()
            assert int((logits[k] > z + tol).sum()) <= ranks[i, k] <= int((logits[k] > z - tol).sum()) - 1, (p, k)


def test_checkpoint_round_trip_and_device_trees(model, tmp_path):
    d = randomised(model, seed=5, num_heads=3, lm_head="low_rank", lm_head_rank=12, stage_split=1,
                   draft_vocab=list(range(0, 101, 2)))
    d.trees["cpu"] = hk.tree.Tree([[0], [1], [0, 0], [0, 0, 0]])
    d.save(tmp_path / "a")
    e = hk.load_drafter(tmp_path / "a", model=model)
    assert isinstance(e, AmphistaDrafter) and e.config == d.config
    assert e.resolve_tree(None, "cpu").choices == d.trees["cpu"].choices
    assert e.resolve_tree(None, "cuda").depth == 3  # no tree searched there: the default of depth min(4, K)
    for k, v in d.state_dict().items():
        assert torch.equal(v, e.state_dict()[k]), k
    assert set(d.state_dict()) == set(e.state_dict())
    prompts = [[5, 17, 3, 44, 9]]
    a = generate(model, prompts, drafter=d, max_new_tokens=12)
    b = generate(model, prompts, drafter=e, max_new_tokens=12)
    assert a.sequences == b.sequences and a.num_steps == b.num_steps


def test_a_fresh_drafter_starts_from_the_base_states(model):
    """init_from: adaptation layers and the auto-embedding block pass their input through, fc reads the state
    half, the low-rank head is the tied head's truncated SVD (exact at full rank)."""
    d = hk.new_drafter(model, kind="amphista", num_heads=2, lm_head="low_rank", lm_head_rank=model.config.hidden_size)
    h = model.hidden_states(torch.tensor([[5, 17, 3, 44, 9]]))
    outs = d.adapt_full(model, h, torch.tensor([[17, 3, 44, 9, 21]]))
    for o in outs:
        assert_close_rel(o, h, 1e-5, "a fresh adaptation stage")
    y = torch.randn(4, model.config.hidden_size)
    assert_close_rel(d.logits(model, y), y @ model.output.weight.T, 1e-4, "full-rank low-rank head")


def test_bad_input_is_refused_before_work(model):
    d = hk.new_drafter(model, kind="amphista", num_heads=2)
    with pytest.raises(ValueError, match="deep"):
        d.resolve_tree("chain-3", "cpu")
    with pytest.raises(ValueError, match="deep"):
        generate(model, [[1, 2, 3]], drafter=d, tree="default", max_new_tokens=4)
    small = hk.new_drafter(model, kind="amphista", num_heads=2, draft_vocab=[3, 4, 5])
    with pytest.raises(ValueError, match="rank"):
        small.resolve_tree([[0], [3]], "cpu")
    with pytest.raises(ValueError, match="lm_head"):
        hk.new_drafter(model, kind="amphista", lm_head="per_head")
    with pytest.raises(ValueError, match="stage_split"):
        hk.new_drafter(model, kind="amphista", num_heads=4, stage_split=5)
    with pytest.raises(ValueError, match="num_heads"):
        hk.new_drafter(model, kind="amphista", num_heads=0)
    with pytest.raises(ValueError, match="draft_vocab"):
        hk.new_drafter(model, kind="amphista", draft_vocab=[1, 1, 2])
    other = hk.Llama.from_hf(make_hf("mha-untied"))
    with pytest.raises(ValueError, match="another model"):
        generate(other, [[1, 2, 3]], drafter=d, max_new_tokens=4)
    with pytest.raises(ValueError, match="to\\(model.device, model.dtype\\)"):
        generate(model, [[1, 2, 3]], drafter=hk.new_drafter(model, kind="amphista").double(), max_new_tokens=4)
    with pytest.raises(ValueError, match="amphista drafter"):
        train_amphista(model, hk.new_drafter(model, kind="medusa"), None, steps=1)


def _data(model):
    torch.manual_seed(0)
    seqs = [torch.randint(0, 101, (n,)).tolist() for n in (40, 33, 57, 25)]
    h = torch.cat([model.hidden_states(torch.tensor([s]))[0] for s in seqs])
    after = torch.cat([torch.arange(len(s) - 1, -1, -1) for s in seqs])
    return HiddenStates(torch.tensor([t for s in seqs for t in s]), h, after)


def test_training_lowers_the_loss_and_resumes(model, tmp_path, monkeypatch):
    data = _data(model)
    d = hk.new_drafter(model, kind="amphista", num_heads=3)
    hist = train_amphista(model, d, data, steps=30, lr=3e-3, seqs_per_step=3, window=32, loss_positions=64, warmup=2,
                          progress=False)
    assert len(hist["head_loss"][0]) == 3 and len(hist["accuracy"][-1]) == 3
    assert sum(hist["loss"][-5:]) < sum(hist["loss"][:5])

    def run(folder):
        torch.manual_seed(1)  # the ResBlocks' biases start from torch's global generator
        d = hk.new_drafter(model, kind="amphista", num_heads=3, lm_head="low_rank", lm_head_rank=8)
        h = train_amphista(model, d, data, steps=4, seqs_per_step=2, window=16, checkpoint_dir=folder,
                           checkpoint_every=2, progress=False)
        return d, h

    d_all, h_all = run(tmp_path / "whole")  # 4 steps at once
    real_step = torch.optim.AdamW.step
    calls = []

    def interrupted(self, *a, **k):  # the third optimiser step never happens: the step-2 checkpoint is left
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut")
    monkeypatch.undo()
    assert len(list((tmp_path / "cut").glob("ckpt-amphista-*.pt"))) == 1
    d_res, h_res = run(tmp_path / "cut")  # resumes at step 2
    assert len(h_res["loss"]) == 4
    assert h_res["loss"] == pytest.approx(h_all["loss"], rel=1e-5)
    for k, v in d_all.state_dict().items():
        assert torch.allclose(v, d_res.state_dict()[k], rtol=1e-5, atol=1e-6), k
    d_again, h_again = run(tmp_path / "whole")  # finished run: nothing left to do, same weights
    assert h_again["loss"] == h_all["loss"]
    for k, v in d_all.state_dict().items():
        assert torch.equal(v, d_again.state_dict()[k]), k
