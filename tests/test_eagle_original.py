"""Original EAGLE checkpoints (SafeAILab/EAGLE): replicas of its draft models, written here from the
original code's semantics (eagle/model/cnets1.py for EAGLE-1/2, eagle/model/cnets.py for EAGLE-3),
with random weights saved in the original layout (pytorch_model.bin and model.safetensors), load
through hk.load_drafter and compute what the replicas compute; EAGLE-3's base features (the inputs of
base layers 2, L // 2, L - 3) are what transformers' hidden_states hold; EAGLE-3 drafting equals a
brute-force replay and its greedy output is plain greedy's; loading is strict."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hydra_kernels as hk
from hydra_kernels.drafters.eagle import DynamicTree, EagleDrafter
from hydra_kernels.drafters.eagle_original import eagle3_feature_layers
from hydra_kernels.generate import generate
from helpers import assert_close_rel
from test_eagle import Replay, _first_child_chain, run_two_proposals
from test_llama_vs_transformers import make_hf

V, H = 101, 72  # the tiny base model's vocabulary and hidden size


@pytest.fixture(scope="module")
def hf_model():
    return make_hf("gqa3-tied", seed=5)


@pytest.fixture(scope="module")
def model(hf_model):
    return hk.Llama.from_hf(hf_model)


# ---- the replicas -------------------------------------------------------------------------------------
class RMSNormRef(nn.Module):  # LlamaRMSNorm
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps

    def forward(self, x):
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(x.dtype)


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


class AttentionRef(nn.Module):
    """cnets LlamaAttention without a cache: head_dim = hidden // heads, rope from the config's
    rope_theta (default 10000) and linear rope_scaling, causal mask of finfo.min, softmax in fp32."""

    def __init__(self, cfg, in_dim, qkv_bias):
        super().__init__()
        self.n, self.nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        self.d = cfg["hidden_size"] // self.n
        self.theta = cfg.get("rope_theta", 10000)
        self.factor = (cfg.get("rope_scaling") or {}).get("factor", 1.0)
        self.q_proj = nn.Linear(in_dim, self.n * self.d, bias=qkv_bias)
        self.k_proj = nn.Linear(in_dim, self.nkv * self.d, bias=qkv_bias)
        self.v_proj = nn.Linear(in_dim, self.nkv * self.d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n * self.d, cfg["hidden_size"], bias=False)

    def forward(self, x):
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.n, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.nkv, self.d).transpose(1, 2)
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.d, 2).float() / self.d))
        freqs = torch.einsum("i,j->ij", torch.arange(L, dtype=torch.float32) / self.factor, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None].to(x.dtype), emb.sin()[None, None].to(x.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.n // self.nkv  # repeat_kv
        k = k[:, :, None].expand(B, self.nkv, rep, L, self.d).reshape(B, self.n, L, self.d)
        v = v[:, :, None].expand(B, self.nkv, rep, L, self.d).reshape(B, self.n, L, self.d)
        w = q @ k.transpose(2, 3) / math.sqrt(self.d)
        mask = torch.full((L, L), torch.finfo(torch.float32).min).triu(1)
        w = F.softmax(w + mask, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj((w @ v).transpose(1, 2).reshape(B, L, self.n * self.d))


class MLPRef(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle1LayerRef(nn.Module):
    """cnets1 LlamaDecoderLayer with index 0: no input_layernorm."""

    def __init__(self, cfg):
        super().__init__()
        self.self_attn = AttentionRef(cfg, cfg["hidden_size"], cfg.get("qkv_bias", False))
        self.mlp = MLPRef(cfg)
        self.post_attention_layernorm = RMSNormRef(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))

    def forward(self, x):
        h = x + self.self_attn(x)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle1Ref(nn.Module):
    """cnets1 Model: fc(cat(embed(ids), hidden)) through the layer; no final norm."""

    def __init__(self, cfg, bias):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList([Eagle1LayerRef(cfg)])
        self.fc = nn.Linear(2 * cfg["hidden_size"], cfg["hidden_size"], bias=bias)

    def forward(self, hidden_states, input_ids):
        x = self.fc(torch.cat((self.embed_tokens(input_ids), hidden_states), dim=-1))
        for layer in self.layers:
            x = layer(x)
        return x


class Eagle3LayerRef(nn.Module):
    """cnets LlamaDecoderLayeremb: q/k/v over cat(input_layernorm(emb), hidden_norm(hidden)), residual = hidden."""

    def __init__(self, cfg):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = AttentionRef(cfg, 2 * h, False)
        self.mlp = MLPRef(cfg)
        self.hidden_norm = RMSNormRef(h, eps)
        self.input_layernorm = RMSNormRef(h, eps)
        self.post_attention_layernorm = RMSNormRef(h, eps)

    def forward(self, input_emb, hidden_states):
        residual = hidden_states
        x = torch.cat((self.input_layernorm(input_emb), self.hidden_norm(hidden_states)), dim=-1)
        h = residual + self.self_attn(x)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Ref(nn.Module):
    """cnets Model: fc (3H -> H, no bias) only on base features (inputs wider than the embedding),
    the midlayer, and tokens ranked by lm_head(norm(y)) over the draft vocabulary, mapped by d2t."""

    def __init__(self, cfg):
        super().__init__()
        h = cfg["hidden_size"]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], h)
        self.lm_head = nn.Linear(h, cfg["draft_vocab_size"], bias=False)
        self.midlayer = Eagle3LayerRef(cfg)
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.norm = RMSNormRef(h, cfg.get("rms_norm_eps", 1e-6))
        self.register_buffer("d2t", torch.zeros(cfg["draft_vocab_size"], dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg["vocab_size"], dtype=torch.bool))

    def forward(self, hidden_states, input_ids):
        emb = self.embed_tokens(input_ids)
        if hidden_states.shape[-1] != emb.shape[-1]:
            hidden_states = self.fc(hidden_states)
        return self.midlayer(emb, hidden_states)

    def ranking(self, y, k, same_vocab):
        idx = F.log_softmax(self.lm_head(self.norm(y)), dim=-1).topk(k, dim=-1).indices
        return idx if same_vocab else idx + self.d2t[idx]


# ---- checkpoints in the original layout ---------------------------------------------------------------
def draft_config(**extra) -> dict:
    """An EAGLE draft config.json: a one-layer Llama config whose layer shape is its own (not the base's)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": H,
            "intermediate_size": 50, "num_attention_heads": 6, "num_key_value_heads": 2, "num_hidden_layers": 1,
            "max_position_embeddings": 2048, "pad_token_id": 0, "rms_norm_eps": 1e-5, "rope_theta": 700.0,
            "vocab_size": V, "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True, **extra}


def randomise(ref: nn.Module, model, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim > 1 else 0.2) + (1.0 if "norm" in name else 0.0))
        ref.embed_tokens.weight.copy_(model.tok_embeddings.weight)  # EAGLE loads the base model's embeddings
    return ref.eval()


def save_original(path, ref: nn.Module, cfg: dict, fmt: str, drop=(), add=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items() if k not in drop}
    sd.update(add or {})
    if fmt == "bin":
        torch.save(sd, path / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(sd, str(path / "model.safetensors"))
    return path


def eagle1(model, tmp_path, fmt="bin", bias=True, **cfg_extra):
    cfg = draft_config(**cfg_extra) if bias else draft_config(bias=False, **cfg_extra)
    ref = randomise(Eagle1Ref(cfg, bias), model, seed=11)
    return ref, cfg, save_original(tmp_path / f"eagle1-{fmt}", ref, cfg, fmt)


def eagle3(model, tmp_path, fmt="bin", draft_vocab_size=40, seed=13):
    cfg = draft_config(draft_vocab_size=draft_vocab_size)
    ref = randomise(Eagle3Ref(cfg), model, seed=seed)
    if draft_vocab_size < V:  # EAGLE-3's vocabulary map: the draft's tokens, in id order
        ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:draft_vocab_size].sort().values
        ref.d2t.copy_(ids - torch.arange(draft_vocab_size))
        ref.t2d[ids] = True
    return ref, cfg, save_original(tmp_path / f"eagle3-{fmt}-{draft_vocab_size}", ref, cfg, fmt)


# ---- EAGLE-1 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
@pytest.mark.parametrize("variant", ["fc-bias", "qkv-bias-linear-rope"])
def test_eagle1_checkpoint_computes_what_the_original_computes(model, tmp_path, fmt, variant):
    extra = {} if variant == "fc-bias" else dict(qkv_bias=True, rope_scaling={"type": "linear", "factor": 2.0})
    ref, cfg, path = eagle1(model, tmp_path, fmt, bias=variant == "fc-bias", **extra)
    d = hk.load_drafter(path, model=model)
    assert isinstance(d, EagleDrafter) and d.feature_layers is None and d.layer.lm_head is None
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (2, 13), generator=g)
    feats = torch.randn(2, 13, H, generator=g)
    with torch.no_grad():
        want = ref(feats, ids)
        got = d.layer.forward_full(d.layer.fuse(model.tok_embeddings(ids), feats))
        assert_close_rel(got, want, 1e-5, f"EAGLE-1 {variant} {fmt} features")
        # the same next-token ranking through the base model's LM head
        assert torch.equal(d.draft_log_probs(model, got).topk(5, dim=-1).indices,
                           F.linear(want, model.output.weight).topk(5, dim=-1).indices)


def test_eagle1_checkpoint_without_embed_tokens_uses_the_base_models(model, tmp_path):
    """embed_tokens is optional (EAGLE loads the base model's embeddings anyway): a checkpoint without it
    loads and computes what the original computes with the base model's embeddings."""
    ref, cfg, _ = eagle1(model, tmp_path)
    d = hk.load_drafter(save_original(tmp_path / "no-embed", ref, cfg, "safetensors", drop=("embed_tokens.weight",)),
                        model=model)
    g = torch.Generator().manual_seed(3)
    ids, feats = torch.randint(0, V, (2, 9), generator=g), torch.randn(2, 9, H, generator=g)
    with torch.no_grad():
        assert_close_rel(d.layer.forward_full(d.layer.fuse(model.tok_embeddings(ids), feats)), ref(feats, ids), 1e-5,
                         "EAGLE-1 without embed_tokens")


def test_eagle1_loading_is_strict(model, tmp_path):
    ref, cfg, _ = eagle1(model, tmp_path)
    cases = {
        "missing": dict(drop=("layers.0.mlp.up_proj.weight",)),
        "unexpected": dict(add={"layers.0.input_layernorm.weight": torch.ones(H)}),
        "mis-shaped": dict(drop=("fc.weight",), add={"fc.weight": torch.zeros(H, 3 * H)}),
    }
    names = {"missing": "layers.0.mlp.up_proj.weight", "unexpected": "layers.0.input_layernorm.weight",
             "mis-shaped": "fc.weight"}
    for what, kw in cases.items():
        path = save_original(tmp_path / what, ref, cfg, "bin", **kw)
        with pytest.raises(ValueError, match=f"{what}.*{names[what]}"):
            hk.load_drafter(path, model=model)
    # a bias-free fc (config "bias": false) must not have one
    path = save_original(tmp_path / "nobias", ref, {**cfg, "bias": False}, "bin")
    with pytest.raises(ValueError, match="unexpected.*fc.bias"):
        hk.load_drafter(path, model=model)
    ok = save_original(tmp_path / "ok", ref, cfg, "safetensors")
    with pytest.raises(ValueError, match="base model"):
        hk.load_drafter(ok)
    other = hk.Llama.from_hf(make_hf("mha-untied"))
    with pytest.raises(ValueError, match="another model"):
        hk.load_drafter(ok, model=other)
    (ok / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin"):
        hk.load_drafter(ok, model=model)
    two = save_original(tmp_path / "two", ref, {**cfg, "num_hidden_layers": 2}, "bin")
    with pytest.raises(ValueError, match="neither"):  # not recognised: EAGLE drafts are one layer
        hk.load_drafter(two, model=model)


# ---- EAGLE-3 ------------------------------------------------------------------------------------------
def test_eagle3_feature_layers():
    assert eagle3_feature_layers(32) == [2, 16, 29]
    assert eagle3_feature_layers(3) == [0, 1, 2]  # the tiny model: L - 3, L // 2, 2
    with pytest.raises(ValueError, match="three distinct"):
        eagle3_feature_layers(5)


def test_captured_features_are_transformers_hidden_states(model, hf_model):
    """capture k = the residual stream entering layer k (transformers' hidden_states[k], k < L), on the
    cache-free forward, the prefill (ragged batch) and a step; the default outputs are unchanged."""
    cap = (0, 1, 2)
    prompts = [[5, 17, 3, 44, 9, 21], [2, 8, 60]]
    ids = torch.tensor(prompts[0])[None]
    with torch.no_grad():
        hs = hf_model(ids, output_hidden_states=True).hidden_states
        h, feats = model.hidden_states(ids, capture=cap)
        assert torch.equal(h, model.hidden_states(ids))
        assert_close_rel(feats, torch.cat([hs[k] for k in cap], dim=-1), 1e-4, "hidden_states capture")
        L = max(map(len, prompts))
        tokens = torch.tensor([p + [0] * (L - len(p)) for p in prompts])
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
        cache = model.new_kv_cache(2, 32)
        hp, fp = model.prefill(tokens, lengths, cache, all_hidden=True, capture=cap)
        nxt = torch.tensor([[7, 8], [9, 10]])
        hstep, fstep = model.step(nxt, cache, backends="reference", kv_len=L + 2, capture=cap)
        for b, p in enumerate(prompts):
            full = base_features_of(model, p + nxt[b].tolist(), cap)
            assert_close_rel(fp[b, : len(p)], full[: len(p)], 1e-4, f"prefill capture {b}")
            assert_close_rel(fstep[b], full[len(p):], 1e-4, f"step capture {b}")
            assert_close_rel(hp[b, : len(p)], model.hidden_states(torch.tensor([p]))[0], 1e-4, f"prefill hidden {b}")
    with pytest.raises(ValueError, match="capture"):
        model.hidden_states(ids, capture=(0, 3))


def base_features_of(model, text, cap):
    return model.hidden_states(torch.tensor([text]), capture=cap)[1][0]


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
@pytest.mark.parametrize("draft_vocab_size", [40, V])
def test_eagle3_checkpoint_computes_what_the_original_computes(model, tmp_path, fmt, draft_vocab_size):
    ref, cfg, path = eagle3(model, tmp_path, fmt, draft_vocab_size)
    d = hk.load_drafter(path, model=model)
    assert d.feature_layers == (0, 1, 2)
    same_vocab = draft_vocab_size == V
    assert (d.draft_vocab is None) == same_vocab
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, 11), generator=g)
    emb = model.tok_embeddings(ids)
    with torch.no_grad():
        # committed positions: base features [.., 3H] through fc; draft nodes: a predicted feature [.., H] as is
        for what, feats, fuse in (("base features", torch.randn(2, 11, 3 * H, generator=g), d.layer.fuse),
                                  ("draft features", torch.randn(2, 11, H, generator=g), d.layer.fuse_node)):
            want = ref(feats, ids)
            got = d.layer.forward_full(fuse(emb, feats))
            assert_close_rel(got, want, 1e-5, f"EAGLE-3 {what}")
            ours = d.token_ids(d.draft_log_probs(model, got).topk(5, dim=-1).indices)  # target ids
            assert torch.equal(ours, ref.ranking(want, 5, same_vocab)), what
    d.save(tmp_path / "ours")  # our format keeps it all
    e = hk.load_drafter(tmp_path / "ours", model=model)
    assert e.feature_layers == d.feature_layers
    assert all(torch.equal(v, e.state_dict()[k]) for k, v in d.state_dict().items())


@pytest.mark.parametrize("spec", [DynamicTree(8, 3, 3), DynamicTree(6, 3, 2)])
def test_eagle3_drafting_equals_brute_force_replay(model, tmp_path, spec):
    """Two proposals over a ragged batch == node-by-node replay through the layer's cache-free forward
    (committed positions from the captured base features, nodes from their parents' predicted features)."""
    _, _, path = eagle3(model, tmp_path)
    d = hk.load_drafter(path, model=model)
    prompts = [[5, 17, 3, 44, 9, 21, 7], [2, 8], [60, 61, 62, 63, 64]]
    accepted = [[30, 31, 32], [40], [50, 51]]
    roots = [[30, 40, 50], [33, 41, 52]]
    p1, p2, texts = run_two_proposals(model, d, prompts, accepted, roots, spec)
    for prop, step_texts, step_roots in ((p1, prompts, roots[0]), (p2, texts, roots[1])):
        for b in range(3):
            toks, parents = Replay(model, d, step_texts[b] + [step_roots[b]]).dynamic(spec)
            assert prop.tokens[b, 1:].tolist() == toks, f"sequence {b}"
            assert prop.tree.parents[b, 1:].tolist() == parents, f"sequence {b}"
            assert set(toks) <= set(d.draft_vocab.tolist())


@pytest.mark.parametrize("tree", [None, "chain-3", [[0], [1], [0, 0]]])
@pytest.mark.backends("reference", "native")
def test_eagle3_greedy_output_is_plain_greedy(model, tmp_path, tree, backend):
    _, _, path = eagle3(model, tmp_path)
    d = hk.load_drafter(path, model=model)
    prompts = [[5, 17, 3, 44, 9], [2, 8], [60, 61, 62, 63, 64, 65, 66, 67]]
    ref = generate(model, prompts, max_new_tokens=24, backend=backend)
    out = generate(model, prompts, drafter=d, max_new_tokens=24, tree=tree, backend=backend)
    assert out.sequences == ref.sequences


def test_eagle3_oracle_is_accepted(model, tmp_path):
    """With its first-child chain overwritten by the right tokens, the drafted tree is accepted to full
    depth: several positions a step reach after_step with their captured features (random weights alone
    are never accepted)."""
    _, _, path = eagle3(model, tmp_path)
    d = hk.load_drafter(path, model=model)
    prompts = [[5, 17, 3, 44, 9]]
    ref = generate(model, prompts, max_new_tokens=30).sequences[0]
    text = prompts[0] + ref

    def oracle_propose(state, root, seqlens, _orig=d.propose):
        p = _orig(state, root, seqlens)
        n, toks, par = state.host_len[0], p.tokens.clone(), p.tree.parents[0].tolist()
        for i in range(1, toks.shape[1]):
            depth = int(p.tree.depths[0, i])
            if _first_child_chain(par, i) and n + depth < len(text):
                toks[0, i] = text[n + depth]
        return type(p)(toks, p.tree, p.positions)

    d.propose = oracle_propose
    out = generate(model, prompts, drafter=d, max_new_tokens=30, tree=dict(total_tokens=6, depth=3, top_k=2))
    assert out.sequences[0] == ref
    assert out.num_steps <= 30 // 3 + 2


def test_eagle3_loading_is_strict(model, tmp_path):
    ref, cfg, _ = eagle3(model, tmp_path)
    for what, kw, name in (("missing", dict(drop=("d2t",)), "d2t"),
                           ("missing", dict(drop=("midlayer.hidden_norm.weight",)), "midlayer.hidden_norm.weight"),
                           ("unexpected", dict(add={"fc.bias": torch.zeros(H)}), "fc.bias"),
                           ("mis-shaped", dict(drop=("lm_head.weight",), add={"lm_head.weight": torch.zeros(V, H)}),
                            "lm_head.weight")):
        path = save_original(tmp_path / f"{what}-{name}", ref, cfg, "bin", **kw)
        with pytest.raises(ValueError, match=f"{what}.*{name}"):
            hk.load_drafter(path, model=model)
    bad = ref.d2t.clone()
    bad[0] += 1  # now disagrees with t2d
    path = save_original(tmp_path / "d2t", ref, cfg, "bin", drop=("d2t",), add={"d2t": bad})
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        hk.load_drafter(path, model=model)
    five_layers = hk.Llama.from_hf(make_hf("gqa3-tied", seed=5, num_hidden_layers=5))
    path = save_original(tmp_path / "ok", ref, cfg, "bin")
    with pytest.raises(ValueError, match="three distinct"):
        hk.load_drafter(path, model=five_layers)


def test_eagle3_config_names_the_feature_layers(model, tmp_path):
    """A config's eagle_config.eagle_aux_hidden_state_layer_ids (vLLM / SpecForge) decides which base layers'
    inputs the layer reads (in layer order), its fc sized to match; ids outside the model, repeated or not a
    list are refused before loading, naming the field."""
    ref, cfg, _ = eagle3(model, tmp_path)
    two = {**cfg, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 0]}}
    fc = {"fc.weight": ref.fc.weight.detach()[:, : 2 * H].clone()}
    path = save_original(tmp_path / "two-layers", ref, two, "bin", drop=("fc.weight",), add=fc)
    d = hk.load_drafter(path, model=model)
    assert list(d.config.feature_layers) == [0, 2]
    assert torch.equal(d.layer.fc.weight.float(), fc["fc.weight"].float())
    with pytest.raises(ValueError, match="mis-shaped.*fc.weight"):  # three ids, a two-layer fc
        hk.load_drafter(save_original(tmp_path / "three", ref, {**two, "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}, "bin", drop=("fc.weight",), add=fc), model=model)
    for ids in ([0, 1, 3], [1, 1, 2], "2,1,0"):
        bad = {**cfg, "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}}
        with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
            hk.load_drafter(save_original(tmp_path / f"bad-{ids}", ref, bad, "bin"), model=model)
