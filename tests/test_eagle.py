"""EAGLE drafter: drafting (dynamic EAGLE-2 trees and static trees) equals a brute-force replay through the
layer's cache-free forward, across two steps and a ragged batch; greedy output is plain greedy's;
the training unroll computes what drafting computes; checkpoints round-trip; bad input is refused."""
from __future__ import annotations

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.drafters.eagle import DynamicTree, EagleDrafter
from hydra_kernels.generate import generate
from hydra_kernels.model.llama import PREFILL_CHUNK_TOKENS
from hydra_kernels.training import HiddenStates
from hydra_kernels.training.eagle import fuse_next_inputs, train_eagle, unrolled_features
from hydra_kernels.training.hidden_cache import compute_hidden_states
from helpers import assert_close_rel, load_script
from test_llama_vs_transformers import make_hf


@pytest.fixture(scope="module")
def model():
    return hk.Llama.from_hf(make_hf("gqa3-tied", seed=5))


def randomised(model, seed=0, **opts) -> EagleDrafter:
    d = hk.new_drafter(model, kind="eagle", **opts)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():  # norms near 1, biases and matrices random
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim > 1 else 0.2) + (1.0 if "norm" in name else 0.0))
    return d


def base_features(model, drafter, ids: torch.Tensor) -> torch.Tensor:
    """What the drafter reads of the base model at every position of ids [B, L]: its final hidden
    states, or (EAGLE-3) the inputs of its feature layers, concatenated."""
    if drafter.feature_layers is None:
        return model.hidden_states(ids)
    return model.hidden_states(ids, capture=drafter.feature_layers)[1]


class Replay:
    """Brute force: each draft node's feature from the layer's causal forward over the whole path
    (committed positions with true features, then the node's ancestors with predicted ones)."""

    def __init__(self, model, drafter, text: list[int]):
        # text: the committed tokens followed by the root; features of the committed ones from the base model
        self.model, self.d = model, drafter
        feats = base_features(model, drafter, torch.tensor([text[:-1]]))[0]
        emb = model.tok_embeddings(torch.tensor(text[1:]))
        self.prefix = drafter.layer.fuse(emb, feats)  # [L, H] inputs of positions 0..L-1

    def feature(self, path: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """path: (token, its parent's predicted feature) of each ancestor, the node last -> its feature."""
        extra = [self.d.layer.fuse_node(self.model.tok_embeddings(torch.tensor(t)), f) for t, f in path]
        x = torch.cat([self.prefix] + [e[None] for e in extra])[None]
        return self.d.layer.forward_full(x)[0, -1]

    def log_probs(self, y):
        return self.d.draft_log_probs(self.model, y)

    def dynamic(self, spec: DynamicTree):
        """EAGLE-2 on one sequence, node by node -> (tokens, parents) of the chosen tree."""
        K = spec.top_k
        y_root = self.feature([])
        lp, idx = self.log_probs(y_root).topk(K)
        # candidate: (token, score, parent candidate or -1, path to it [(token, parent feature)])
        cands = [(int(self.d.token_ids(i)), float(s), -1, [(int(self.d.token_ids(i)), y_root)]) for s, i in zip(lp, idx)]
        front = list(range(K))
        for _ in range(1, spec.depth):
            children = []
            for c in front:
                tok, score, _, path = cands[c]
                y = self.feature(path)
                lp, idx = self.log_probs(y).topk(K)
                for s, i in zip(lp, idx):
                    t = int(self.d.token_ids(i))
                    children.append((t, score + float(s), c, path + [(t, y)]))
            base = len(cands)
            cands += children
            order = sorted(range(len(children)), key=lambda j: -children[j][1])[:K]
            front = [base + j for j in order]
        chosen = sorted(sorted(range(len(cands)), key=lambda j: -cands[j][1])[: spec.total_tokens - 1])
        node = {c: i + 1 for i, c in enumerate(chosen)}
        return [cands[c][0] for c in chosen], [0 if cands[c][2] < 0 else node[cands[c][2]] for c in chosen]


def run_two_proposals(model, drafter, prompts, accepted, roots, tree):
    """prefill -> propose (root = roots[0]) -> accept `accepted[b]` tokens (root first) -> propose
    (root = roots[1]); returns the two proposals."""
    B = len(prompts)
    plan = model.backend_plan("reference")
    bound = drafter.resolve_tree(tree, "cpu")
    state = drafter.start(model, B, 64, bound, plan)
    L = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (L - len(p)) for p in prompts])
    drafter.after_prefill(state, base_features(model, drafter, ids), torch.tensor([len(p) for p in prompts]))
    drafter.observe_tokens(state, [p + [r] for p, r in zip(prompts, roots[0])])
    p1 = drafter.propose(state, torch.tensor(roots[0]), None)
    W = max(map(len, accepted))
    texts = [p + a for p, a in zip(prompts, accepted)]
    F = model.config.hidden_size * len(drafter.feature_layers or [0])
    hidden = torch.zeros(B, W, F)
    tok = torch.zeros(B, W, dtype=torch.long)
    for b, (p, a) in enumerate(zip(prompts, accepted)):
        hidden[b, : len(a)] = base_features(model, drafter, torch.tensor([texts[b]]))[0, len(p):]
        tok[b, : len(a)] = torch.tensor(a)
    drafter.after_step(state, hidden, tok, torch.tensor([len(a) for a in accepted]))
    drafter.observe_tokens(state, [a[1:] + [r] for a, r in zip(accepted, roots[1])])
    p2 = drafter.propose(state, torch.tensor(roots[1]), None)
    return p1, p2, texts


@pytest.mark.parametrize("spec", [DynamicTree(8, 3, 3), DynamicTree(5, 2, 2), DynamicTree(12, 4, 2)])
@pytest.mark.parametrize("draft_vocab", [None, list(range(100, 0, -3))])
def test_dynamic_tree_equals_brute_force_replay(model, spec, draft_vocab):
    torch.manual_seed(0)
    check_two_steps_equal_brute_force(model, randomised(model, draft_vocab=draft_vocab), spec)


@pytest.mark.parametrize("chunk_tokens", [3, 6])
@pytest.mark.parametrize("feature_layers", [None, "eagle3"])
def test_prompts_first_pass_in_prefill_chunks(model, monkeypatch, chunk_tokens, feature_layers):
    """The prompts' first pass through the layer runs in prefill chunks (model/llama.py chunked_prefill):
    1 or 2 positions per chunk for 3 sequences, so the last real positions (6, 1, 4) fall in different
    chunks; the drafts still equal the brute-force replay's, at both steps."""
    monkeypatch.setitem(PREFILL_CHUNK_TOKENS, "cpu", chunk_tokens)
    d = randomised(model, seed=2, **({} if feature_layers is None else dict(feature_layers=feature_layers)))
    check_two_steps_equal_brute_force(model, d, DynamicTree(6, 3, 2))


def check_two_steps_equal_brute_force(model, d, spec):
    prompts = [[5, 17, 3, 44, 9, 21, 7], [2, 8], [60, 61, 62, 63, 64]]  # ragged
    accepted = [[30, 31, 32], [40], [50, 51]]  # root first; different accept lengths
    roots = [[30, 40, 50], [33, 41, 52]]
    p1, p2, texts = run_two_proposals(model, d, prompts, accepted, roots, spec)
    for prop, step_texts, step_roots in ((p1, prompts, roots[0]), (p2, texts, roots[1])):
        assert prop.tokens.shape == (3, spec.total_tokens)
        for b in range(3):
            toks, parents = Replay(model, d, step_texts[b] + [step_roots[b]]).dynamic(spec)
            assert prop.tokens[b, 0] == step_roots[b]
            assert prop.tokens[b, 1:].tolist() == toks, f"sequence {b}"
            assert prop.tree.parents[b, 1:].tolist() == parents, f"sequence {b}"
            assert bool(prop.tree.valid[b].all())


def test_static_tree_equals_brute_force_replay(model):
    d = randomised(model, seed=3)
    choices = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2]]
    tree = hk.tree.Tree(choices)
    prompts = [[5, 17, 3, 44], [2, 8, 9, 10, 11, 12]]
    accepted = [[30, 31], [40, 41, 42]]
    roots = [[30, 40], [33, 43]]
    p1, p2, texts = run_two_proposals(model, d, prompts, accepted, roots, choices)
    for prop, step_texts, step_roots in ((p1, prompts, roots[0]), (p2, texts, roots[1])):
        for b in range(2):
            r = Replay(model, d, step_texts[b] + [step_roots[b]])
            feats = {0: r.feature([])}
            paths = {0: []}
            for i in range(1, tree.num_nodes):
                par, rank = int(tree.parents[i]), int(tree.ranks[i])
                want = int(d.token_ids(r.log_probs(feats[par]).topk(rank + 1).indices[rank]))
                assert int(prop.tokens[b, i]) == want, f"sequence {b} node {i}"
                paths[i] = paths[par] + [(want, feats[par])]
                feats[i] = r.feature(paths[i])


@pytest.mark.parametrize("feature_layers", [None, "eagle3"])
def test_training_unroll_is_what_drafting_computes(model, feature_layers):
    """Unroll step s at position t == a depth-(s-1) node drafted after committing positions < t-s+2 (EAGLE-3:
    a layer built by new_drafter(feature_layers=...), as training builds it)."""
    d = randomised(model, seed=4, feature_layers=feature_layers)
    text = [5, 17, 3, 44, 9, 21, 7, 11, 13, 2]
    feats = base_features(model, d, torch.tensor([text]))  # [1, L, n*H]
    emb = model.tok_embeddings(torch.tensor([text[1:]]))
    x1 = d.layer.fuse(emb, feats[:, :-1])
    ys = unrolled_features(d.layer, x1, fuse_next_inputs(d.layer, emb), 3)
    for s in (2, 3):
        for t in range(s - 1, len(text) - 1):
            c = t - s + 2  # committed positions 0..c-1; root = text[c]
            r = Replay(model, d, text[: c + 1])
            path, f = [], r.feature([])
            for j in range(1, s):  # ancestors: the true next tokens, fed the predicted features
                path = path + [(text[c + j], f)]
                f = r.feature(path)
            assert_close_rel(ys[s - 1][0, t], f, 1e-4, f"step {s} position {t}")


@pytest.mark.parametrize("tree", [None, dict(total_tokens=6, depth=3, top_k=2), "chain-3", [[0], [1], [0, 0]]])
@pytest.mark.backends("reference", "native")
def test_greedy_output_is_plain_greedy(model, tree, backend):
    d = randomised(model, seed=1)
    prompts = [[5, 17, 3, 44, 9], [2, 8], [60, 61, 62, 63, 64, 65, 66, 67]]
    ref = generate(model, prompts, max_new_tokens=24, backend=backend)
    out = generate(model, prompts, drafter=d, max_new_tokens=24, tree=tree, backend=backend)
    assert out.sequences == ref.sequences


@pytest.mark.backends("triton")
def test_greedy_output_is_plain_greedy_on_triton(model, backend):
    """The interpreter is slow: one dynamic tree, a few steps (every verify op of a TreeBatch runs)."""
    d = randomised(model, seed=1)
    prompts = [[5, 17, 3, 44, 9], [2, 8]]
    ref = generate(model, prompts, max_new_tokens=6, backend=backend)
    out = generate(model, prompts, drafter=d, max_new_tokens=6, tree=dict(total_tokens=5, depth=2, top_k=2),
                   backend=backend)
    assert out.sequences == ref.sequences


@pytest.mark.parametrize("ragged", [False, True])
def test_an_oracle_layer_is_accepted(model, ragged):
    """A drafter whose top-1 is always the base model's next token is accepted to full depth: the
    drafted tree reaches the verifier intact (a self-check of propose -> verify -> commit). Ragged: three
    prompts of different lengths in one batch, whose oracles know the next 3, 1 and 0 tokens, so every
    step accepts a different number of tokens per sequence; each output is still plain greedy's."""
    d = randomised(model, seed=2)
    prompts = [[5, 17, 3, 44, 9], [8, 1], [60, 2, 7, 7, 3, 1, 9, 4]] if ragged else [[5, 17, 3, 44, 9]]
    known = [3, 1, 0] if ragged else [3]  # how deep each sequence's oracle sees
    ref = generate(model, prompts, max_new_tokens=30).sequences
    texts = [p + r for p, r in zip(prompts, ref)]

    def oracle_propose(state, root, seqlens, _orig=d.propose):
        p = _orig(state, root, seqlens)
        toks = p.tokens.clone()
        for b, text in enumerate(texts):
            n = state.host_len[b]  # committed tokens; root at n
            par = p.tree.parents[b].tolist()
            for i in range(1, toks.shape[1]):  # the right tokens along root -> first child -> its first child ...
                depth = int(p.tree.depths[b, i])
                if depth <= known[b] and _first_child_chain(par, i) and n + depth < len(text):
                    toks[b, i] = text[n + depth]
        return type(p)(toks, p.tree, p.positions)

    d.propose = oracle_propose
    out = generate(model, prompts, drafter=d, max_new_tokens=30, tree=dict(total_tokens=6, depth=3, top_k=2))
    assert out.sequences == ref
    per_seq = [sum(a) / len(a) for a in out.accept_lengths]  # tokens per step of each sequence
    assert len(out.accept_lengths[0]) <= 30 // 3 + 2 and per_seq[0] >= 3.0, per_seq  # ~depth + 1 a step
    if ragged:  # ~4, ~2 and ~1 tokens per step (the random layer alone guesses a repetitive text at times)
        assert per_seq[0] > per_seq[1] >= 1.8 and per_seq[1] > per_seq[2], per_seq


def _first_child_chain(parents: list[int], i: int) -> bool:
    """Node i lies on the chain root -> its first child -> that node's first child -> ..."""
    while i > 0:
        p = parents[i]
        if parents.index(p, 1) != i:
            return False
        i = p
    return True


def test_checkpoint_round_trip_and_device_trees(model, tmp_path):
    d = randomised(model, seed=5, draft_vocab=list(range(0, 101, 2)))
    d.dynamic_trees["cpu"] = DynamicTree(6, 3, 2)
    d.save(tmp_path / "e")
    e = hk.load_drafter(tmp_path / "e", model=model)
    assert isinstance(e, EagleDrafter) and e.dynamic_trees == {"cpu": DynamicTree(6, 3, 2)}
    assert e.resolve_tree(None, "cpu").dynamic == DynamicTree(6, 3, 2)
    for k, v in d.state_dict().items():
        assert torch.equal(v, e.state_dict()[k]), k
    prompts = [[5, 17, 3, 44, 9]]
    assert (generate(model, prompts, drafter=d, max_new_tokens=12).num_steps
            == generate(model, prompts, drafter=e, max_new_tokens=12).num_steps)


def test_bad_input_is_refused_before_work(model):
    d = hk.new_drafter(model, kind="eagle")
    with pytest.raises(ValueError, match="fewer than total_tokens"):
        d.resolve_tree(dict(total_tokens=40, depth=2, top_k=2), "cpu")
    with pytest.raises(ValueError, match="unknown"):
        d.resolve_tree(dict(total_tokens=4, width=2), "cpu")
    with pytest.raises(ValueError, match="positive int"):
        DynamicTree(4, 0, 2)
    small = hk.new_drafter(model, kind="eagle", draft_vocab=[1, 2, 3])
    with pytest.raises(ValueError, match="lower top_k to at most 3"):
        generate(model, [[1, 2, 3]], drafter=small, max_new_tokens=4, tree=dict(total_tokens=5, depth=2, top_k=4))
    other = hk.Llama.from_hf(make_hf("mha-untied"))
    with pytest.raises(ValueError, match="another model"):
        generate(other, [[1, 2, 3]], drafter=d, max_new_tokens=4)


def test_training_lowers_the_loss_and_resumes(model, tmp_path):
    torch.manual_seed(0)
    seqs = [torch.randint(0, 101, (n,)).tolist() for n in (40, 33, 57, 25)]
    h = torch.cat([model.hidden_states(torch.tensor([s]))[0] for s in seqs])
    after = torch.cat([torch.arange(len(s) - 1, -1, -1) for s in seqs])
    data = HiddenStates(torch.tensor([t for s in seqs for t in s]), h, after)
    d = hk.new_drafter(model, kind="eagle")
    hist = train_eagle(model, d, data, steps=30, lr=3e-3, seqs_per_step=3, window=32, loss_positions=64, unroll=2,
                       warmup=2, progress=False)
    assert sum(hist["loss"][-5:]) < sum(hist["loss"][:5])
    d2 = hk.new_drafter(model, kind="eagle")
    train_eagle(model, d2, data, steps=4, seqs_per_step=2, window=16, unroll=2, checkpoint_dir=tmp_path,
                checkpoint_every=2, progress=False)
    d3 = hk.new_drafter(model, kind="eagle")  # resumes at step 4 of 4: nothing left to do, same weights
    h3 = train_eagle(model, d3, data, steps=4, seqs_per_step=2, window=16, unroll=2, checkpoint_dir=tmp_path,
                     checkpoint_every=2, progress=False)
    assert len(h3["loss"]) == 4
    for k, v in d2.state_dict().items():
        assert torch.equal(v, d3.state_dict()[k]), k


def test_draft_vocab_prefix_ranks_the_first_ids_and_stays_lossless(model):
    """fit.draft_vocab_prefix: the cut drafter's log-probabilities are the full one's over the first `size`
    ids renormalised (same layer, fewer LM-head rows); greedy output is still plain greedy's; drafters
    without a draft vocabulary, bad sizes and weights sized by the vocabulary are refused."""
    from hydra_kernels.drafters.fit import draft_vocab_prefix

    vocab = torch.randperm(101, generator=torch.Generator().manual_seed(3))[:60]
    d = randomised(model, seed=7, draft_vocab=vocab.tolist())
    cut = draft_vocab_prefix(d, 23)
    assert cut.config.draft_vocab_size == 23 and torch.equal(cut.draft_vocab, vocab[:23])
    y = torch.randn(4, model.config.hidden_size)
    full = d.draft_log_probs(model, y)[:, :23]
    assert_close_rel(cut.draft_log_probs(model, y), torch.log_softmax(full, dim=-1), 1e-5)
    prompts = [[5, 17, 3, 44, 9], [8, 1, 60]]
    plain = generate(model, prompts, max_new_tokens=14).sequences
    assert generate(model, prompts, drafter=cut, max_new_tokens=14, tree=DynamicTree(5, 3, 2)).sequences == plain
    with pytest.raises(ValueError, match="no draft vocabulary"):
        draft_vocab_prefix(hk.new_drafter(model, kind="eagle"), 10)
    for bad in (0, 61, 2.5):
        with pytest.raises(ValueError, match=r"size must be an int in \[1, 60\]"):
            draft_vocab_prefix(d, bad)
    untied = hk.new_drafter(model, kind="mlp_speculator", n_predict=2, draft_vocab=vocab.tolist())
    with pytest.raises(ValueError, match="weights sized by its draft vocabulary"):
        draft_vocab_prefix(untied, 10)


@pytest.mark.parametrize("feature_layers", [None, "eagle3"])
def test_agreement_is_brute_force_top1_per_depth(model, feature_layers):
    """training.eagle.agreement == per position, a brute-force replay of the depth-d node (true ancestor
    tokens, predicted features) whose top draft token is compared with the base model's greedy token."""
    from hydra_kernels.training.eagle import agreement

    d = randomised(model, seed=9, draft_vocab=list(range(0, 101, 3)), feature_layers=feature_layers)
    text, start = [5, 17, 3, 44, 9, 21, 7, 11, 13, 2, 33], 3
    logits = model(torch.tensor([text]))[0]  # [L, V]: position q's greedy token is logits[q].argmax()
    got = agreement(model, d, [text], [start], unroll=2)
    for depth in (1, 2):
        hits, n = 0, 0
        for q in range(max(start, depth), len(text)):  # the node at depth `depth` guesses token q+1
            c = q - depth + 1  # committed positions 0..c-1; root = text[c]
            r = Replay(model, d, text[: c + 1])
            path, f = [], r.feature([])
            for j in range(1, depth):
                path = path + [(text[c + j], f)]
                f = r.feature(path)
            hits += int(d.token_ids(r.log_probs(f).argmax()) == logits[q].argmax())
            n += 1
        assert 0 < n and got[depth - 1] == pytest.approx(hits / n), depth


def test_eagle3_new_trains_saves_and_decodes_losslessly(model, tmp_path):
    """new_drafter(kind="eagle", feature_layers="eagle3"): an EAGLE-3 layer over the streams entering base
    layers 2, L//2, L-3 whose fresh start ranks with the base model's final norm and LM-head rows; training on
    captured data lowers the token loss (no feature term) and resumes; data without the captured streams, a
    feature weight and EAGLE-1 norms are refused before any work; a trained checkpoint reloads and greedy
    decoding with it is plain greedy decoding."""
    from hydra_kernels.drafters.eagle_original import eagle3_feature_layers

    vocab = list(range(0, 101, 2))
    d = hk.new_drafter(model, kind="eagle", feature_layers="eagle3", draft_vocab=vocab)
    assert d.feature_layers == tuple(eagle3_feature_layers(model.config.num_layers))
    assert torch.equal(d.layer.lm_head.weight, model.output.weight[torch.tensor(vocab)])
    assert torch.equal(d.layer.logit_norm.weight, model.norm.weight)
    y = torch.randn(3, model.config.hidden_size)  # the fresh layer ranks like the base model on its rows
    base = torch.log_softmax(model.output(model.norm(y))[:, vocab], dim=-1)
    assert_close_rel(d.draft_log_probs(model, y), base, 1e-5)
    with pytest.raises(ValueError, match="leave them out"):
        hk.new_drafter(model, kind="eagle", feature_layers=[0, 2], input_norm=True)
    with pytest.raises(ValueError, match="capture must be distinct"):
        hk.new_drafter(model, kind="eagle", feature_layers=[0, 9])

    torch.manual_seed(0)
    seqs = [torch.randint(0, 101, (n,)).tolist() for n in (40, 33, 57, 25)]
    plain_data = compute_hidden_states(model, seqs, progress=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="capture="):
        train_eagle(model, d, plain_data, steps=2, progress=False)
    data = compute_hidden_states(model, seqs, progress=False, dtype=torch.float32, capture=d.feature_layers)
    with pytest.raises(ValueError, match="token loss alone"):
        train_eagle(model, d, data, steps=2, feature_weight=1.0, progress=False)
    hist = train_eagle(model, d, data, steps=30, lr=3e-3, seqs_per_step=3, window=32, loss_positions=64, unroll=2,
                       warmup=2, noise=0.0, progress=False)
    assert sum(hist["loss"][-5:]) < sum(hist["loss"][:5])
    runs = []
    for _ in range(2):  # the second run resumes at step 4 of 4: nothing left to do, same weights
        e = hk.new_drafter(model, kind="eagle", feature_layers="eagle3", draft_vocab=vocab)
        runs.append(e)
        train_eagle(model, e, data, steps=4, seqs_per_step=2, window=16, unroll=2, checkpoint_dir=tmp_path,
                    checkpoint_every=2, progress=False)
    for k, v in runs[0].state_dict().items():
        assert torch.equal(v, runs[1].state_dict()[k]), k

    d.save(tmp_path / "e3")
    loaded = hk.load_drafter(tmp_path / "e3", model=model)
    assert loaded.feature_layers == d.feature_layers
    for k, v in d.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    prompts = [[5, 17, 3, 44, 9], [8, 1], [60, 2, 7, 7, 3, 1, 9, 4]]
    plain = generate(model, prompts, max_new_tokens=14).sequences
    for tree in (None, "chain-3"):
        assert generate(model, prompts, drafter=loaded, max_new_tokens=14, tree=tree).sequences == plain


def test_dynamic_tree_search_records_the_fastest_setting(model, tmp_path):
    """training.tree_search.search_dynamic_tree decodes every setting and plain decoding (rows in grid order,
    plain first, each setting's tokens/step >= 1), records the fastest setting for this device class (saved as
    dynamic_<device>.json, used by generate(tree=None)) and refuses a setting the draft cannot rank first."""
    from hydra_kernels.training.tree_search import search_dynamic_tree

    d = randomised(model, seed=11, draft_vocab=list(range(0, 101, 5)))
    grid = [DynamicTree(3, 2, 1), DynamicTree(5, 3, 2)]
    best, rows = search_dynamic_tree(model, d, [[5, 17, 3, 44], [8, 1, 60]], max_new_tokens=10, grid=grid,
                                     progress=False)
    assert [(r["total_tokens"], r["depth"], r["top_k"]) for r in rows] == [(1, 0, 0), (3, 2, 1), (5, 3, 2)]
    assert rows[0]["tokens_per_step"] == 1 and rows[0]["vs_plain"] == 1
    assert all(r["tokens_per_s"] > 0 and r["tokens_per_step"] >= 1 for r in rows)
    fastest = max(rows[1:], key=lambda r: r["tokens_per_s"])
    assert best in grid and (best.total_tokens, best.depth, best.top_k) == (
        fastest["total_tokens"], fastest["depth"], fastest["top_k"])
    assert d.dynamic_trees == {"cpu": best}
    d.save(tmp_path / "e")
    assert hk.load_drafter(tmp_path / "e", model=model).resolve_tree(None, "cpu").dynamic == best
    with pytest.raises(ValueError, match="lower top_k to at most 21"):
        search_dynamic_tree(model, d, [[1, 2]], grid=[DynamicTree(30, 2, 22)], progress=False)


def test_training_recipe_refuses_bad_options_before_loading(tmp_path, capsys):
    """python/train_eagle.py: a missing --self-data, an unusable device, a bad time budget and a malformed
    --draft-vocab-file are refused with what to change, before the model loads."""
    recipe = load_script("python/train_eagle.py")
    bad_vocab = tmp_path / "v.json"
    cases = [([], "--self-data is required"), (["--self-data", "x", "--time-budget-s", "0"], "must be > 0"),
             (["--self-data", "x", "--deadline-s", "-5"], "--deadline-s must be > 0"),
             (["--self-data", "x", "--deadline-s", "60", "--time-budget-s", "30", "--heldout", "0"], "not both"),
             (["--self-data", "x", "--deadline-s", "60"], "past the deadline"),
             (["--evaluate", "d", "--heldout", "0"], "--evaluate needs >= 1"),
             (["--self-data", "x", "--draft-vocab-file", "v", "--draft-vocab", "9"], "leave out --draft-vocab")]
    if not torch.cuda.is_available():
        cases.append((["--self-data", "x", "--device", "cuda"], "no CUDA device"))
    for text, msg in [("[3, 5, 3]", "1 token ids repeat"), ('{"a": 1}', "JSON list of token ids"),
                      ("[1, -2]", "JSON list of token ids"), ("[1, true]", "JSON list of token ids"),
                      ("[1, 2", "not a readable JSON")]:
        cases.append((["--self-data", "x", "--draft-vocab-file", str(bad_vocab)], msg, text))
    for case in cases:
        if len(case) == 3:
            bad_vocab.write_text(case[2])
        with pytest.raises(SystemExit):
            recipe.main(case[0])
        assert case[1] in capsys.readouterr().err
