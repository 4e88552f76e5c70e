"""The mlp_speculator drafter (IBM's MLPSpeculator, fms-extras): drafting against a replica of fms-extras'
module (its forward and generate_suffixes) loaded from the original layouts, strict loading, our format,
the per-sequence trie, lossless greedy decoding, bad input, training and its checkpoint."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import hydra_kernels as hk
from hydra_kernels.drafters import MLPSpeculatorDrafter
from hydra_kernels.drafters.mlp_speculator import candidate_trie
from hydra_kernels.generate import generate
from hydra_kernels.training import compute_hidden_states, train_mlp_speculator
from hydra_kernels.tree import TreeBatch
from helpers import assert_close_rel
from test_llama_vs_transformers import make_hf

H, V = 72, 101  # the tiny model's width and vocabulary


@pytest.fixture(scope="module")
def model():
    return hk.Llama.from_hf(make_hf("gqa3-tied", seed=5))


# ---- a replica of fms-extras' MLPSpeculator (fms_extras/models/speculator.py) ---------------------------
class FmsLayerNormParameterized(nn.Module):
    """fms.modules.layernorm.LayerNormParameterized with use_mean=False (the speculator's)."""

    def __init__(self, dim, eps=1e-6, elementwise_scale=True, elementwise_shift=False):
        super().__init__()
        self.eps, self.scale, self.shift = eps, elementwise_scale, elementwise_shift
        if elementwise_scale:
            self.weight = nn.Parameter(torch.ones(dim))
        if elementwise_shift:
            self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        if self.scale:
            x = self.weight * x
        if self.shift:
            x = x + self.bias
        return x


class FmsMLPSpeculator(nn.Module):
    def __init__(self, emb_dim, inner_dim, vocab_size, n_predict, tie_weights=False, scale_input=False):
        super().__init__()
        self.n_predict, self.emb_dim = n_predict, emb_dim
        inner_dim = inner_dim or emb_dim
        self.inner_dim, self.scale_input = inner_dim, scale_input
        self.emb = nn.ModuleList(nn.Embedding(vocab_size, inner_dim) for _ in range(n_predict))
        self.proj = nn.ModuleList(nn.Linear(emb_dim if i == 0 else inner_dim, inner_dim, bias=False)
                                  for i in range(n_predict))
        self.head = nn.ModuleList(nn.Linear(inner_dim, vocab_size, bias=False) for _ in range(n_predict))
        self.ln = nn.ModuleList(FmsLayerNormParameterized(inner_dim, elementwise_shift=True, elementwise_scale=True)
                                for _ in range(n_predict))
        if scale_input:
            self.ln0 = FmsLayerNormParameterized(emb_dim, elementwise_shift=False, elementwise_scale=False)
        self.state_weight = 0.5 ** (0.5 / n_predict)
        self.emb_weight = math.sqrt((1 - self.state_weight**2) * (self.inner_dim / 2))
        self.activation = nn.GELU()
        if tie_weights:
            for emb in self.emb:
                emb.weight = self.emb[0].weight
            for head in self.head:
                head.weight = self.head[0].weight
            for ln in self.ln:
                ln.weight, ln.bias = self.ln[0].weight, self.ln[0].bias
            for i in range(2, n_predict):
                self.proj[i].weight = self.proj[1].weight

    def generate_suffixes(self, state, ind, topk, n):
        b = state.size(0)
        k = math.prod(topk)
        out = torch.empty(b, 1, k, self.n_predict, device=state.device).int()
        log_probs = torch.zeros(b, 1, k, device=state.device)
        assert len(topk) == self.n_predict
        if self.scale_input:
            state = self.ln0(state) / (2**0.5)
        for i in range(self.n_predict):
            z = self.emb[i](ind)
            state = self.proj[i](state)
            state = torch.add(state, z, alpha=self.emb_weight / self.state_weight)
            state = self.activation(self.ln[i](state))
            probs = nn.functional.log_softmax(self.head[i](state), dim=2)
            probs, preds = probs.topk(topk[i], dim=2)
            out = out.view(b, preds.size(1) * preds.size(2), -1, self.n_predict)
            out[:, :, :, i] = preds.view(b, -1, 1)
            state = state.unsqueeze(2).expand(-1, -1, topk[i], -1)
            state = state.reshape(b, -1, state.size(3))
            ind = preds.view(b, -1)
            log_probs = log_probs.view(b, probs.size(1) * probs.size(2), -1)
            log_probs = log_probs.add(probs.view(b, -1, 1))
        out = out.view(b, k, self.n_predict)
        log_probs = log_probs.view(b, k)
        best_guesses = log_probs.topk(n, dim=1)[1]
        return out.gather(1, best_guesses.unsqueeze(2).expand(-1, -1, self.n_predict))

    def forward(self, state, inds):
        out = []
        if self.scale_input:
            state = self.ln0(state) / (2**0.5)
        for i in range(self.n_predict):
            z = self.emb[i](inds[:, i: i + state.size(1)])
            state = self.proj[i](state)
            state = torch.add(state, z, alpha=self.emb_weight / self.state_weight)
            state = self.activation(self.ln[i](state))
            out.append(self.head[i](state))
        return torch.stack(out, dim=0)


def random_replica(seed, inner_dim=0, n_predict=3, tie_weights=False, scale_input=False):
    torch.manual_seed(seed)
    m = FmsMLPSpeculator(H, inner_dim, V, n_predict, tie_weights, scale_input).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():  # shared tensors appear once
            r = torch.randn(p.shape, generator=g)
            if name.startswith("ln"):  # norm scale around 1, shift around 0
                p.copy_(r * 0.3 + (1.0 if name.endswith("weight") else 0.0))
            else:  # heads x4: peakier distributions, so the candidates' scores differ clearly
                p.copy_(r / math.sqrt(m.inner_dim) * (4.0 if name.startswith("head") else 1.0))
    return m


def save_original(m: FmsMLPSpeculator, path, *, prefix: bool, fmt: str, topk, n_candidates, tie_weights, scale_input):
    """The HF hub layout (fms-extras' MLPSpeculatorPreTrainedModel: "speculator." names) or vLLM's (none);
    safetensors cannot alias tensors, so tied weights are stored once there (the first name of each), as a
    state dict saved with torch.save keeps every stage's name."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator", "vocab_size": V,
        "emb_dim": H, "inner_dim": m.inner_dim if m.inner_dim != H else 0, "n_predict": m.n_predict,
        "top_k_tokens_per_head": topk, "n_candidates": n_candidates, "tie_weights": tie_weights,
        "scale_input": scale_input, "torch_dtype": "float32"}))
    sd = {("speculator." if prefix else "") + k: v for k, v in m.state_dict().items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        seen, once = set(), {}
        for k, v in sd.items():
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                once[k] = v.contiguous()
        save_file(once, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(sd, path / "pytorch_model.bin")


CASES = [  # (prefix, format, inner_dim, n_predict, top_k, n_candidates, tie_weights, scale_input)
    (True, "safetensors", 0, 3, [4, 3, 2], 8, False, False),
    (False, "bin", 48, 4, [3, 2, 2, 2], 5, True, True),
    (True, "bin", 96, 3, [5, 4, 3], 7, False, True),
    (False, "safetensors", 0, 3, [3, 3, 2], 18, True, False),
]


@pytest.mark.parametrize("prefix,fmt,inner,P,topk,n,tie,scale", CASES)
def test_original_checkpoint_drafts_as_fms_generate_suffixes(model, tmp_path, prefix, fmt, inner, P, topk, n, tie, scale):
    ref = random_replica(1, inner, P, tie, scale)
    save_original(ref, tmp_path, prefix=prefix, fmt=fmt, topk=topk, n_candidates=n, tie_weights=tie, scale_input=scale)
    d = hk.load_drafter(tmp_path, model=model)
    assert isinstance(d, MLPSpeculatorDrafter) and d.kind == "mlp_speculator"
    c = d.config
    assert (c.n_predict, c.inner_dim, c.top_k_tokens_per_head, c.n_candidates, c.tie_weights, c.scale_input) == \
        (P, inner or H, topk, n, tie, scale)
    g = torch.Generator().manual_seed(2)
    B = 5
    h = torch.randn(B, H, generator=g) * 2
    root = torch.randint(0, V, (B,), generator=g)
    want = ref.generate_suffixes(h[:, None, :], root[:, None], topk, n)  # [B, n, P] best first
    got, scores = d.candidates(h, root)
    assert torch.equal(got, want.long())
    assert (scores[:, 1:] <= scores[:, :-1]).all()
    # the training path is fms' forward: stage i at position j reads inds[j + i]
    L = 6
    state = torch.randn(1, L, H, generator=g)
    inds = torch.randint(0, V, (1, L + P), generator=g)
    ref_logits = ref(state, inds)  # [P, 1, L, V]
    ours = d.chain_logits(state[0], torch.stack([inds[0, i: i + L] for i in range(P)], dim=1))
    for i in range(P):
        assert_close_rel(ours[i], ref_logits[i, 0], 1e-5, f"stage {i} logits")
    # the proposal: a trie whose leaf paths are exactly root + each candidate, in rank order
    st = d.start(model, B, 64, d.resolve_tree(None, "cpu"), None)
    lengths = torch.tensor([3, 1, 4, 2, 4], dtype=torch.int32)
    hidden = torch.randn(B, 4, H, generator=g)
    hidden[torch.arange(B), lengths.long() - 1] = h
    d.after_prefill(st, hidden, lengths)
    prop = d.propose(st, root, lengths)
    assert isinstance(prop.tree, TreeBatch) and prop.tree.paths.shape == (B, n, P + 1)
    assert torch.equal(prop.tokens.gather(1, prop.tree.paths.flatten(1)).view(B, n, P + 1),
                       torch.cat([root[:, None, None].expand(B, n, 1), want.long()], dim=2))


def _dump(path, sd, name="model.safetensors"):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / name))


def test_strict_loading_names_the_bad_weight(model, tmp_path):
    ref = random_replica(3)
    good = tmp_path / "good"
    save_original(ref, good, prefix=True, fmt="safetensors", topk=[4, 3, 2], n_candidates=8, tie_weights=False,
                  scale_input=False)
    from safetensors.torch import load_file

    sd = load_file(str(good / "model.safetensors"))
    cfg = (good / "config.json").read_text()

    def variant(name, change):
        p = tmp_path / name
        p.mkdir()
        (p / "config.json").write_text(cfg)
        s = dict(sd)
        change(s)
        _dump(p, s)
        return p

    sharded = tmp_path / "sharded"  # a sharded checkpoint: model.safetensors.index.json names the shards
    sharded.mkdir()
    (sharded / "config.json").write_text(cfg)
    names = sorted(sd)
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        _dump(sharded, {k: sd[k] for k in part}, f"model-0000{i + 1}-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f"model-0000{1 + (k in names[len(names) // 2:])}-of-00002.safetensors"
                                        for k in names}}))
    whole, parts = hk.load_drafter(good), hk.load_drafter(sharded)
    assert all(torch.equal(v, parts.state_dict()[k]) for k, v in whole.state_dict().items())

    missing = variant("missing", lambda s: s.pop("speculator.proj.2.weight"))
    with pytest.raises(ValueError, match=r"missing weight 'speculator\.proj\.2\.weight'"):
        hk.load_drafter(missing)
    extra = variant("extra", lambda s: s.__setitem__("speculator.ln0.weight", torch.ones(H)))
    with pytest.raises(ValueError, match=r"unexpected weight.*speculator\.ln0\.weight"):
        hk.load_drafter(extra)
    shaped = variant("shaped", lambda s: s.__setitem__("speculator.head.1.weight", torch.zeros(V - 1, H)))
    with pytest.raises(ValueError, match=r"'speculator\.head\.1\.weight' has shape \[100, 72\], expected \[101, 72\]"):
        hk.load_drafter(shaped)
    both = variant("both", lambda s: s.__setitem__("emb.0.weight", s["speculator.emb.0.weight"].clone()))
    with pytest.raises(ValueError, match=r"'emb\.0\.weight' appears twice"):
        hk.load_drafter(both)
    # tied weights stored per stage must be copies of one tensor
    tied = random_replica(4, tie_weights=True)
    sd_t = {k: v.clone() for k, v in tied.state_dict().items()}
    sd_t["head.2.weight"] += 1
    p = tmp_path / "tied"
    save_original(tied, p, prefix=False, fmt="bin", topk=[4, 3, 2], n_candidates=8, tie_weights=True, scale_input=False)
    torch.save(sd_t, p / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"tie_weights is true but 'head\.2\.weight' differs from 'head\.0\.weight'"):
        hk.load_drafter(p)
    bad_cfg = tmp_path / "badcfg"
    bad_cfg.mkdir()
    (bad_cfg / "config.json").write_text(json.dumps({**json.loads(cfg), "top_k_tokens_per_head": [4, 3]}))
    with pytest.raises(ValueError, match="one k per stage"):
        hk.load_drafter(bad_cfg)
    # a speculator for another model: refused by generate before any work
    other = hk.Llama.from_hf(make_hf("gqa3-tied", seed=5, vocab_size=120))
    with pytest.raises(ValueError, match=r"vocab \(101\) does not match the model's \(120\)"):
        generate(other, [[1, 2]], drafter=hk.load_drafter(good, model=other), max_new_tokens=2)
    narrow = hk.Llama.from_hf(make_hf("mha-untied"))  # hidden 48
    with pytest.raises(ValueError, match=r"emb_dim \(72\) does not match the model's hidden size \(48\)"):
        generate(narrow, [[1, 2]], drafter=hk.load_drafter(good, model=narrow), max_new_tokens=2)


@pytest.mark.parametrize("tie,draft_vocab", [(False, None), (True, list(range(0, V, 2)))])
def test_our_format_round_trip(model, tmp_path, tie, draft_vocab):
    torch.manual_seed(5)
    d = hk.new_drafter(model, kind="mlp_speculator", n_predict=3, inner_dim=40, top_k_tokens_per_head=[3, 3, 2],
                       n_candidates=6, tie_weights=tie, scale_input=tie, draft_vocab=draft_vocab)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    d.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["format"] == "hydra_kernels.drafter" and cfg["version"] == 1 and cfg["kind"] == "mlp_speculator"
    back = hk.load_drafter(tmp_path, model=model)
    assert isinstance(back, MLPSpeculatorDrafter) and back.config == d.config
    assert d.state_dict().keys() == back.state_dict().keys()
    for k, v in d.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    if tie:  # stored once: one embedding, head and norm, proj for stage 0 and the rest
        assert sorted(k for k in d.state_dict() if k != "draft_vocab") == [
            "emb.0.weight", "head.0.weight", "ln.0.bias", "ln.0.weight", "proj.0.weight", "proj.1.weight"]
        assert back.draft_vocab.tolist() == draft_vocab
    g = torch.Generator().manual_seed(6)
    h, root = torch.randn(4, H, generator=g), torch.randint(0, V, (4,), generator=g)
    a, sa = d.candidates(h, root)
    b, sb = back.candidates(h, root)
    assert torch.equal(a, b) and torch.equal(sa, sb)
    if draft_vocab is not None:
        assert set(a.flatten().tolist()) <= set(draft_vocab)
    d.save(tmp_path / "bf16", dtype=torch.bfloat16)
    half = hk.load_drafter(tmp_path / "bf16", model=model)
    assert half.config == d.config and next(half.parameters()).dtype == torch.float32


def tied_reference_candidates(d, model, h, root):
    """tie_base drafting written out per sequence and per prefix (no drafter method): every stage from the
    base model's embedding rows and LM-head rows, all prod(top_k) suffixes scored, the best n kept."""
    cfg = d.config
    dv = torch.arange(V) if d.draft_vocab is None else d.draft_vocab
    E, W = model.tok_embeddings.weight, model.output.weight[dv]

    def rms(x, norm):
        return norm.weight * x / torch.sqrt(x.pow(2).mean() + 1e-6) + norm.bias

    def stage(i, state, tok):
        m, pi = (0, min(i, 1)) if cfg.tie_weights else (i, i)
        state = torch.nn.functional.gelu(rms(d.proj[pi].weight @ state + d.emb_weight / d.state_weight * E[tok],
                                             d.ln[m]))
        return state, torch.log_softmax(W @ rms(d.out[m].weight @ state, d.out_norm[m]), dim=-1)

    out, scores = [], []
    for b in range(h.shape[0]):
        beams = [(0.0, [], h[b], int(root[b]))]  # (score, suffix, state, last token)
        for i, k in enumerate(cfg.top_k_tokens_per_head):
            nxt = []
            for sc, suf, st, tok in beams:
                st, lp = stage(i, st, tok)
                top = lp.topk(k)
                nxt += [(sc + float(v), suf + [int(dv[j])], st, int(dv[j])) for v, j in zip(top.values, top.indices)]
            beams = nxt
        best = sorted(beams, key=lambda x: -x[0])[: cfg.n_candidates]
        out.append([x[1] for x in best])
        scores.append([x[0] for x in best])
    return torch.tensor(out), torch.tensor(scores)


@pytest.mark.parametrize("tie,draft_vocab", [(False, None), (True, list(range(1, V, 3)))])
def test_tie_base_drafts_with_the_base_models_embedding_and_head(model, tmp_path, tie, draft_vocab):
    """tie_base: the stages read the base model's embedding and rank with its LM head (not stored); the
    drafting equals the written-out definition, a checkpoint holds only the stages' own weights, and the
    loaded drafter follows the model it is given."""
    torch.manual_seed(9)
    d = hk.new_drafter(model, kind="mlp_speculator", top_k_tokens_per_head=[3, 2, 2], n_candidates=7,
                       tie_weights=tie, tie_base=True, draft_vocab=draft_vocab)
    assert torch.equal(d.out_norm[0].weight, model.norm.weight)  # the head first sees a final-norm-like state
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    g = torch.Generator().manual_seed(10)
    h, root = torch.randn(4, H, generator=g), torch.randint(0, V, (4,), generator=g)
    want, want_scores = tied_reference_candidates(d, model, h, root)
    got, got_scores = d.candidates(h, root, model=model)
    assert torch.equal(got, want)
    assert_close_rel(got_scores, want_scores.float(), 1e-5, "candidate scores")
    if draft_vocab is not None:
        assert set(got.flatten().tolist()) <= set(draft_vocab)
    d.save(tmp_path)
    keys = {k.split(".")[0] for k in load_file(tmp_path / "model.safetensors")}
    assert keys == {"proj", "ln", "out", "out_norm"} | ({"draft_vocab"} if draft_vocab else set())
    back = hk.load_drafter(tmp_path, model=model)
    assert back.config == d.config and back.config.tie_base
    b, sb = back.candidates(h, root, model=model)
    assert torch.equal(b, got) and torch.equal(sb, got_scores)
    other = copy.deepcopy(model)  # another base model's embedding and head: other candidates
    with torch.no_grad():
        other.output.weight.mul_(-1.0)
    assert not torch.equal(back.candidates(h, root, model=other)[0], got)
    with pytest.raises(ValueError, match="tie_base=True: it reads the base model's embedding and LM head, so pass model="):
        back.candidates(h, root)


@pytest.mark.backends("reference", "native")
def test_tie_base_greedy_is_lossless(model, backend):
    n = 16
    plain = generate(model, PROMPTS, max_new_tokens=n, eos_token_id=[], backend=backend).sequences
    torch.manual_seed(11)
    d = hk.new_drafter(model, kind="mlp_speculator", tie_base=True, draft_vocab=list(range(0, V, 2)))
    out = generate(model, PROMPTS, drafter=d, max_new_tokens=n, eos_token_id=[], backend=backend)
    assert out.sequences == plain
    assert max(out.step_nodes) > 1  # it drafted


def test_trie_and_tree_from_paths_match_the_parent_constructor():
    """candidate_trie (device ops) builds the BFS trie of the candidates; TreeBatch.from_paths gives the same
    tree as the constructor from parents, padding included."""
    g = torch.Generator().manual_seed(7)
    for _ in range(30):
        B, n, P = 3, int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        cands = []
        for _b in range(B):
            seen = []
            while len(seen) < min(n, 3**P):
                c = tuple(torch.randint(0, 3, (P,), generator=g).tolist())  # 3 tokens: many shared prefixes
                if c not in seen:
                    seen.append(c)
            cands.append(seen)
        n = len(cands[0])
        root = torch.tensor([50, 51, 52])
        for trim in (False, True):
            tokens, paths, T = candidate_trie(root, torch.tensor(cands), trim)
            tree = TreeBatch.from_paths(paths, T)
            parent_lists = []
            for b in range(B):
                index, order = {(): 0}, [()]
                for d in range(1, P + 1):  # BFS: by depth, then by the first candidate holding the prefix
                    for c in cands[b]:
                        if c[:d] not in index:
                            index[c[:d]] = len(order)
                            order.append(c[:d])
                parent_lists.append([-1] + [index[o[:-1]] for o in order[1:]])
                assert tokens[b, : len(order)].tolist() == [50 + b] + [o[-1] for o in order[1:]]
                assert (tokens[b, len(order):] == 0).all()
                assert paths[b].tolist() == [[index[c[:d]] for d in range(P + 1)] for c in cands[b]]
            ref = TreeBatch(torch.tensor([p + [-1] * (T - len(p)) for p in parent_lists]),  # padded to T
                            torch.tensor([[i < len(p) for i in range(T)] for p in parent_lists]))
            assert T == (max(map(len, parent_lists)) if trim else n * P + 1)
            for name in ("parents", "depths", "mask", "valid", "paths"):
                assert torch.equal(getattr(tree, name), getattr(ref, name)), name
            assert (tree.num_nodes, tree.depth) == (ref.num_nodes, ref.depth)


def test_state_follows_the_last_committed_token(model):
    d = hk.new_drafter(model, kind="mlp_speculator")
    st = d.start(model, 3, 64, d.resolve_tree(None, "cpu"), None)
    hidden = torch.randn(3, 5, H)
    d.after_prefill(st, hidden, torch.tensor([5, 2, 3], dtype=torch.int32))
    assert torch.equal(st.h, hidden[[0, 1, 2], [4, 1, 2]])
    acc = torch.randn(3, 4, H)
    before = st.h.clone()
    d.after_step(st, acc, torch.zeros(3, 4, dtype=torch.long), torch.tensor([2, 0, 4]))
    assert torch.equal(st.h[0], acc[0, 1]) and torch.equal(st.h[1], before[1]) and torch.equal(st.h[2], acc[2, 3])


# ---- lossless greedy decoding ------------------------------------------------------------------------
PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12]]


def forced_good(model, continuations):
    """A speculator whose weights make every stage predict the next token of a bigram table drawn from the
    plain greedy text (a one-hot state: inner_dim > vocab, proj 0, emb_i one-hot, head_i the table)."""
    table = {}
    for s in continuations:
        for a, b in zip(s, s[1:]):
            table[a] = b
    d = hk.new_drafter(model, kind="mlp_speculator", inner_dim=128, top_k_tokens_per_head=[2, 2, 2], n_candidates=4)
    with torch.no_grad():
        for i in range(3):
            d.proj[i].weight.zero_()
            d.emb[i].weight.zero_()
            d.emb[i].weight[:, :V] = torch.eye(V)
            d.head[i].weight.zero_()
            for a, b in table.items():
                d.head[i].weight[b, a] = 1.0
    return d


@pytest.mark.backends("reference", "native")
def test_greedy_is_lossless_ragged_batch(model, backend):
    n = 16
    plain = generate(model, PROMPTS, max_new_tokens=n, eos_token_id=[], backend=backend).sequences
    torch.manual_seed(8)
    rand = hk.new_drafter(model, kind="mlp_speculator")
    out = generate(model, PROMPTS, drafter=rand, max_new_tokens=n, eos_token_id=[], backend=backend)
    assert out.sequences == plain
    good = forced_good(model, [p + s for p, s in zip(PROMPTS, plain)])
    good.trim_cpu_trees = False  # the GPU's form: every step's tree at its bound, merged nodes padded
    out = generate(model, PROMPTS, drafter=good, max_new_tokens=n, eos_token_id=[], backend=backend)
    assert out.sequences == plain and max(k for a in out.accept_lengths for k in a) == 4
    good.trim_cpu_trees = True
    out = generate(model, PROMPTS, drafter=good, max_new_tokens=n, eos_token_id=[], backend=backend)
    assert out.sequences == plain
    steps = sum(len(a) for a in out.accept_lengths)
    assert max(k for a in out.accept_lengths for k in a) == 4  # whole chains of 3 drafts accepted
    assert sum(map(len, plain)) / steps > 2.0, out.accept_lengths


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_drafting_reads_nothing_back_on_the_gpu():
    """On the GPU a step's draft (candidates, trie, tree) and the state updates are device work only."""
    m = hk.Llama.from_hf(make_hf("gqa3-tied", seed=5).to("cuda"))
    d = hk.new_drafter(m, kind="mlp_speculator", draft_vocab=list(range(0, V, 2)))
    st = d.start(m, 3, 64, d.resolve_tree(None, "cuda"), None)
    lengths = torch.tensor([4, 1, 2], dtype=torch.int32, device="cuda")
    root = torch.tensor([3, 4, 5], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        d.after_prefill(st, torch.randn(3, 4, H, device="cuda"), lengths)
        prop = d.propose(st, root, lengths)
        d.after_step(st, torch.randn(3, 4, H, device="cuda"), prop.tokens[:, :4], torch.tensor([2, 0, 4], device="cuda"))
        d.propose(st, root, lengths)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert prop.tree.num_nodes == 8 * 3 + 1 and prop.tokens.is_cuda


# ---- bad input -----------------------------------------------------------------------------------------
def test_bad_input_is_refused_before_work(model, monkeypatch):
    for kw, msg in ((dict(top_k_tokens_per_head=[4, 3]), r"one k per stage \(n_predict=3\), got 2"),
                    (dict(n_predict=2, top_k_tokens_per_head=[4, 0]), "entries must be ints in"),
                    (dict(n_candidates=0), r"n_candidates must be an int in \[1, prod"),
                    (dict(n_candidates=25), r"n_candidates must be an int in \[1, prod\(top_k_tokens_per_head\) = 24\]"),
                    (dict(n_predict=0), "n_predict must be a positive int"),
                    (dict(n_predict=1, tie_weights=True), "needs n_predict >= 2"),
                    (dict(draft_vocab=[1, 2], top_k_tokens_per_head=[4, 3, 2]), r"ints in \[1, 2\]"),
                    (dict(tie_base=True, inner_dim=40), r"inner_dim must be 0 or the hidden size \(72\), got 40")):
        with pytest.raises(ValueError, match=msg):
            hk.new_drafter(model, kind="mlp_speculator", **kw)
    d = hk.new_drafter(model, kind="mlp_speculator")
    monkeypatch.setattr(model, "prefill", lambda *a, **k: pytest.fail("work started"))
    with pytest.raises(ValueError, match="builds its own tree every step; pass tree=None"):
        generate(model, [[1, 2, 3]], drafter=d, tree="chain-3", max_new_tokens=4)
    with pytest.raises(ValueError, match="call drafter.to"):
        generate(model, [[1, 2, 3]], drafter=hk.new_drafter(model, kind="mlp_speculator").double(), max_new_tokens=4)


# ---- training ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    m = hk.Llama.from_hf(make_hf("gqa3-tied", seed=3))
    seqs = [[(start + stride * i) % V for i in range(n)] for start, stride, n in ((3, 7, 30), (50, 2, 17), (9, 7, 41))]
    return m, compute_hidden_states(m, seqs, progress=False, dtype=torch.float32)


@pytest.mark.parametrize("distill_weight,draft_vocab,tie_base", [(1.0, None, False), (0.5, "half", False),
                                                               (1.0, "half", True)])
def test_training_lowers_the_loss(tiny, distill_weight, draft_vocab, tie_base):
    m, data = tiny
    torch.manual_seed(0)
    dv = torch.arange(0, V, 2) if draft_vocab else None
    d = hk.new_drafter(m, kind="mlp_speculator", n_predict=3, draft_vocab=dv, tie_base=tie_base)
    base = {k: v.clone() for k, v in m.state_dict().items()}
    hist = train_mlp_speculator(m, d, data, steps=40, lr=1e-2, positions_per_step=32, distill_weight=distill_weight,
                                progress=False)
    first, last = sum(hist["loss"][:5]) / 5, sum(hist["loss"][-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert len(hist["stage_loss"][0]) == 3 and not d.training
    assert all(torch.equal(v, base[k]) for k, v in m.state_dict().items())  # the base model stays frozen


def test_training_checkpoint_resumes(tiny, tmp_path):
    m, data = tiny
    kw = dict(steps=10, positions_per_step=16, progress=False)
    torch.manual_seed(0)
    a = hk.new_drafter(m, kind="mlp_speculator", n_predict=2, tie_weights=True)
    train_mlp_speculator(m, a, data, **kw)
    # a run stopped after 6 optimizer steps (checkpoint at 5) and started again ends with the same weights
    torch.manual_seed(0)
    c = hk.new_drafter(m, kind="mlp_speculator", n_predict=2, tie_weights=True)
    orig, calls = torch.optim.AdamW.step, {"n": 0}

    def step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 6:
            raise KeyboardInterrupt
        return orig(self, *args, **kwargs)

    torch.optim.AdamW.step = step
    try:
        with pytest.raises(KeyboardInterrupt):
            train_mlp_speculator(m, c, data, checkpoint_dir=tmp_path, checkpoint_every=5, **kw)
    finally:
        torch.optim.AdamW.step = orig
    (ck,) = tmp_path.glob("ckpt-mlp_speculator-*.pt")
    assert torch.load(ck, weights_only=False)["step"] == 5
    torch.manual_seed(1)  # resuming must not depend on the fresh weights
    c2 = hk.new_drafter(m, kind="mlp_speculator", n_predict=2, tie_weights=True)
    hist = train_mlp_speculator(m, c2, data, checkpoint_dir=tmp_path, checkpoint_every=5, **kw)
    assert len(hist["loss"]) == 10
    for k, v in a.state_dict().items():
        assert torch.allclose(v, c2.state_dict()[k], atol=1e-6), k
    with pytest.raises(ValueError, match="different training run"):
        train_mlp_speculator(m, hk.new_drafter(m, kind="mlp_speculator", n_predict=2, tie_weights=True), data,
                             checkpoint=ck, **{**kw, "steps": 12})
    with pytest.raises(ValueError, match="distill_weight"):
        train_mlp_speculator(m, c2, data, distill_weight=1.5)
    with pytest.raises(ValueError, match="trains an mlp_speculator"):
        train_mlp_speculator(m, hk.new_drafter(m, kind="medusa", num_heads=1), data)


@pytest.mark.parametrize("tie_base", [False, True])
def test_head_ranks_are_the_drafting_ranks(tiny, tie_base):
    """evaluate.head_ranks (tree search's and the replay's input) ranks stage d's true token at p as the
    drafting chain ranks it when the earlier stages were fed the true tokens."""
    from hydra_kernels.training.evaluate import head_ranks

    m, _ = tiny
    torch.manual_seed(12)
    d = hk.new_drafter(m, kind="mlp_speculator", n_predict=3, tie_base=tie_base,
                       draft_vocab=list(range(0, V, 2)) if tie_base else None)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    seqs = [[5, 17, 3, 44, 9, 21, 7, 11, 13, 2, 30], [8, 60, 4, 4, 9]]
    data = compute_hidden_states(m, seqs, progress=False, dtype=torch.float32)
    ranks = head_ranks(m, d, seqs, [2, 0], max_rank=V, data=data)
    dv = torch.arange(V) if d.draft_vocab is None else d.draft_vocab
    row = 0
    for s, seq in enumerate(seqs):
        h_all = m.hidden_states(torch.tensor([seq]))[0]
        for p in range(2 if s == 0 else 0, len(seq) - 2):
            state = d.input_state(h_all[p])
            for k in range(3):
                tgt = p + 2 + k
                if tgt >= len(seq):
                    assert ranks[row, k] == -1
                    continue
                state = d.stage(k, state, torch.tensor(seq[p + 1 + k]), m)
                logits = d.stage_logits(k, state, m)
                hit = (dv == seq[tgt]).nonzero().flatten()
                if hit.numel() == 0:  # outside the draft vocabulary: never proposed
                    assert ranks[row, k] == 1 << 20
                    continue
                z = logits[hit[0]]
                tol = 1e-4 * logits.abs().max()
                assert int((logits > z + tol).sum()) <= ranks[row, k] <= int((logits > z - tol).sum()) - 1, (p, k)
            row += 1
    assert row == ranks.shape[0]
