"""The checkpoint formats of original implementations the README names, each against its own source (issue 47):
vLLM's Medusa layout (vllm/model_executor/models/medusa.py and its MedusaConfig) against a replica of vLLM's module
written here, original Medusa (FasterDecoding/Medusa medusa_model.py) and Hydra (zankner/Hydra hydra_heads/)
heads against test_drafters.py's replicas, EAGLE-1 and fms-extras' MLPSpeculator against theirs. Each loads
strictly (every missing, unexpected or mis-shaped tensor named, before any work), computes what its replica
computes, and decodes losslessly (greedy output = plain greedy)."""
import json
import re

import pytest
import torch
from torch import nn

import hydra_kernels as hk
from hydra_kernels.drafters import MedusaDrafter
from hydra_kernels.generate import generate
from helpers import assert_close_rel
from test_drafter_files import refused_before_work
from test_drafters import OrigHydra, randomise
from test_llama_vs_transformers import make_hf

V, H = 101, 72  # the tiny base model's vocabulary and hidden size
PROMPTS = [[5, 17, 3, 99, 42, 7], [8, 1]]


@pytest.fixture(scope="module")
def model():
    return hk.Llama.from_hf(make_hf("gqa3-tied", seed=5))


def assert_lossless(model, drafter, tree=None):
    plain = generate(model, PROMPTS, max_new_tokens=12, eos_token_id=[]).sequences
    spec = generate(model, PROMPTS, drafter=drafter, tree=tree, max_new_tokens=12, eos_token_id=[])
    assert spec.sequences == plain and spec.num_steps > 0


# ---- vLLM's Medusa: a replica of its module --------------------------------------------------------------
class VllmResidualBlock(nn.Module):
    """vLLM medusa.py ResidualBlock: num_hidden_layers Linears, x <- x + SiLU(layer(x)) for each in turn."""

    def __init__(self, hidden, layers, bias):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=bias) for _ in range(layers))
        self.act = nn.SiLU()

    def forward(self, x):
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


class VllmMedusa(nn.Module):
    """vLLM medusa.py Medusa at tensor-parallel size 1: a ResidualBlock per head, an LM head per head (or one,
    original_lm_head) of truncated_vocab_size rows, logits * logit_scale, scattered to token_map's ids (-inf
    elsewhere) when the vocabulary is truncated."""

    def __init__(self, n, L, vocab, truncated, fc_bias=False, original_lm_head=False, logit_scale=1.0):
        super().__init__()
        self.blocks = nn.ModuleList(VllmResidualBlock(H, L, fc_bias) for _ in range(n))
        if original_lm_head:
            self.lm_head = nn.Linear(H, truncated, bias=False)
            self.lm_heads = [self.lm_head] * n
        else:
            self.lm_heads = nn.ModuleList(nn.Linear(H, truncated, bias=False) for _ in range(n))
        self.orig_vocab_size, self.logit_scale, self.token_map = vocab, logit_scale, None

    def forward(self, hidden_states):
        return [block(hidden_states) for block in self.blocks]

    def compute_logits(self, hidden_states):
        out = []
        for hs, lm_head in zip(hidden_states, self.lm_heads):
            logits = lm_head(hs) * self.logit_scale
            if self.token_map is None:
                out.append(logits)
            else:
                full = torch.full((*logits.shape[:-1], self.orig_vocab_size), -torch.inf)
                full[..., self.token_map] = logits
                out.append(full)
        return out


def vllm_medusa(seed, n=3, L=2, truncated=V, **kw):
    ref = randomise(VllmMedusa(n, L, V, truncated, **kw), seed).eval()
    if truncated < V:
        ref.token_map = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:truncated]
    return ref


def save_vllm(path, ref, cfg: dict, fmt="safetensors", prefix="", full_rows=False, lm_name=None, drop=(), add=None):
    """ref's weights as vLLM's loader reads them: names optionally prefixed, a token_map tensor, an LM head stored
    with the whole vocabulary's rows (full_rows: vLLM cuts it to token_map's), the shared LM head under lm_name."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    if lm_name is not None:
        sd[lm_name] = sd.pop("lm_head.weight")
    if ref.token_map is not None:
        sd["token_map"] = ref.token_map.clone()
        if full_rows:
            for k in [k for k in sd if "lm_head" in k]:
                whole = torch.randn(V, H)
                whole[ref.token_map] = sd[k]
                sd[k] = whole
    sd = {prefix + k: v for k, v in sd.items() if k not in drop}
    sd.update(add or {})
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(sd, str(path / "model.safetensors"))
    else:
        torch.save(sd, path / "pytorch_model.bin")
    return path


def vllm_config(n=3, L=2, **extra):
    return {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": H, "vocab_size": V,
            "num_heads": n, "num_hidden_layers": L, "max_paths": 64, "topk": 10, **extra}


VLLM_CASES = {  # name: (replica options, config extras, save options)
    "plain": (dict(), dict(), dict()),
    "bias-prefix-bin-renamed-scaled": (dict(fc_bias=True, logit_scale=0.5),
                                       dict(medusa_fc_bias=True, logit_scale=0.5, rename=True),
                                       dict(fmt="bin", prefix="medusa_heads.")),
    "truncated-shared": (dict(truncated=40, original_lm_head=True), dict(truncated_vocab_size=40, original_lm_head=True),
                         dict(lm_name="lm_heads.0.weight")),
    "truncated-whole-rows": (dict(truncated=40), dict(truncated_vocab_size=40), dict(full_rows=True)),
    "shared-as-lm_head": (dict(original_lm_head=True), dict(original_lm_head=True), dict(lm_name="lm_head.weight")),
}


def vllm_checkpoint(path, case, seed=3):
    ref_kw, cfg_kw, save_kw = VLLM_CASES[case]
    cfg_kw = dict(cfg_kw)
    cfg = vllm_config(**{k: v for k, v in cfg_kw.items() if k != "rename"})
    if cfg_kw.get("rename"):  # MedusaConfig.from_pretrained reads medusa_num_heads as num_heads
        cfg["medusa_num_heads"], cfg["medusa_num_layers"] = cfg.pop("num_heads"), cfg.pop("num_hidden_layers")
    ref = vllm_medusa(seed, **ref_kw)
    return ref, cfg, save_vllm(path / case, ref, cfg, **save_kw)


@pytest.mark.parametrize("case", list(VLLM_CASES))
def test_vllm_medusa_computes_what_vllm_computes(model, tmp_path, case):
    ref, cfg, path = vllm_checkpoint(tmp_path, case)
    d = hk.load_drafter(path, model=model)
    assert isinstance(d, MedusaDrafter) and d.kind == "medusa" and d.num_heads == 3
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1)) * 2
    for i, want in enumerate(ref.compute_logits(ref(x))):
        ours = d.logits(model, i, x)  # [5, Vd]: the draft vocabulary's columns
        full = torch.full((5, V), -torch.inf)
        full[:, d.token_ids(torch.arange(ours.shape[1]))] = ours
        assert torch.equal(full.isinf(), want.isinf()), f"head {i}: the drafted ids differ"
        assert_close_rel(full[~full.isinf()], want[~want.isinf()], 1e-5, f"head {i}")
        assert torch.equal(full.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("case", ["plain", "truncated-shared"])
def test_vllm_medusa_decodes_losslessly(model, tmp_path, case):
    _, _, path = vllm_checkpoint(tmp_path, case)
    assert_lossless(model, hk.load_drafter(path, model=model), tree=[[0], [1], [0, 0], [0, 0, 0]])


@pytest.mark.parametrize("change,pattern", [
    (dict(drop=("blocks.1.layers.1.weight",)), r"{dir}/model.safetensors does not match {dir}/config.json "
                                               r"\(num_heads 3, num_hidden_layers 2.*\): missing blocks.1.layers.1.weight"),
    (dict(add={"blocks.0.layers.2.weight": torch.zeros(H, H)}), r"unexpected blocks.0.layers.2.weight"),
    (dict(drop=("lm_heads.2.weight",), add={"lm_heads.2.weight": torch.zeros(V - 1, H)}),
     r"mis-shaped lm_heads.2.weight \[100, 72\] \(expected \[101, 72\]\)"),
    (dict(add={"blocks.0.layers.0.bias": torch.zeros(H)}), r"unexpected blocks.0.layers.0.bias"),  # medusa_fc_bias false
    (dict(add={"lm_head.weight": torch.zeros(V, H)}), r"unexpected lm_head.weight"),  # original_lm_head false
    (dict(add={"medusa_heads.blocks.0.layers.0.weight": torch.zeros(H, H)}),
     r"{dir}/model.safetensors: weight 'blocks.0.layers.0.weight' appears twice"),
    (dict(cfg=dict(hidden_size=None)), r"does not match {dir}/config.json \(.*hidden_size 4096.*mis-shaped "
                                       r"blocks.0.layers.0.weight \[72, 72\] \(expected \[4096, 4096\]\)"),
    (dict(cfg=dict(num_heads="3")), r"{dir}/config.json: num_heads must be an int >= 1, got '3'"),
    (dict(cfg=dict(truncated_vocab_size=40)), r"truncated_vocab_size 40 < vocab_size 101 in {dir}/config.json needs a "
                                              r"token_map"),
    (dict(cfg=dict(truncated_vocab_size=200)), r"{dir}/config.json: truncated_vocab_size \(200\) exceeds vocab_size"),
    (dict(cfg=dict(logit_scale="big")), r"{dir}/config.json: logit_scale must be a finite number"),
    (dict(cfg=dict(medusa_fc_bias="yes")), r"{dir}/config.json: medusa_fc_bias must be true or false"),
])
def test_vllm_medusa_loading_is_strict(model, tmp_path, monkeypatch, change, pattern):
    ref = vllm_medusa(4)
    cfg = vllm_config()
    for k, v in change.get("cfg", {}).items():
        cfg.pop(k) if v is None else cfg.__setitem__(k, v)
    path = save_vllm(tmp_path / "ckpt", ref, cfg, drop=change.get("drop", ()), add=change.get("add"))
    refused_before_work(model, monkeypatch, path, ValueError, pattern)


def test_vllm_medusa_token_map_and_shared_head_are_checked(model, tmp_path, monkeypatch):
    ref = vllm_medusa(5, truncated=40, original_lm_head=True)
    cfg = vllm_config(truncated_vocab_size=40, original_lm_head=True)
    dup = ref.token_map.clone()
    dup[1] = dup[0]
    for name, kw, pattern in (
            ("dup", dict(add={"token_map": dup}), r"{dir}/model.safetensors: token_map: draft_vocab must be distinct"),
            ("float", dict(add={"token_map": ref.token_map.float()}), r"token_map must hold integer token ids"),
            ("both", dict(lm_name="lm_heads.0.weight", add={"lm_head.weight": torch.zeros(40, H)}),
             r"both lm_heads.0.weight and lm_head.weight"),
            ("extra", dict(lm_name="lm_heads.0.weight", add={"lm_heads.1.weight": torch.zeros(40, H)}),
             r"unexpected lm_heads.1.weight")):
        path = save_vllm(tmp_path / name, ref, cfg, **kw)
        refused_before_work(model, monkeypatch, path, ValueError, pattern)
        monkeypatch.undo()
    # vLLM ignores a token_map when the vocabulary is not truncated; so does the loader
    ok = vllm_medusa(6)
    path = save_vllm(tmp_path / "ignored", ok, vllm_config(), add={"token_map": torch.arange(7)})
    assert hk.load_drafter(path, model=model).draft_vocab is None


def test_vllm_medusa_for_another_model_is_refused_at_load(tmp_path):
    _, _, path = vllm_checkpoint(tmp_path, "plain")
    other = hk.Llama.from_hf(make_hf("gqa3-tied", seed=5, vocab_size=120))
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": drafter vocab \(101\) does not match the model's"):
        hk.load_drafter(path, model=other)


# ---- original Medusa heads (FasterDecoding/Medusa medusa_model.py) -----------------------------------------
class MedusaResBlock(nn.Module):  # medusa_model.py ResBlock
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(H, H)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def medusa_heads(n, L, seed):
    """MedusaModel.medusa_head: per head nn.Sequential(*[ResBlock] * L, nn.Linear(H, V, bias=False))."""
    return randomise(nn.ModuleList(nn.Sequential(*([MedusaResBlock()] * L), nn.Linear(H, V, bias=False))
                                   for _ in range(n)), seed).eval()


def save_medusa(path, heads, cfg, fmt="pt", drop=(), add=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    sd = {k: v for k, v in heads.state_dict().items() if k not in drop}
    sd.update(add or {})
    if fmt == "pt":
        torch.save(sd, path / "medusa_lm_head.pt")
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "medusa_lm_head.safetensors"))
    return path


@pytest.mark.parametrize("fmt,L", [("pt", 2), ("safetensors", 1)])
def test_original_medusa_decodes_losslessly(model, tmp_path, fmt, L):
    heads = medusa_heads(3, L, seed=7)
    path = save_medusa(tmp_path, heads, {"medusa_num_heads": 3, "medusa_num_layers": L,
                                         "base_model_name_or_path": "x"}, fmt)
    d = hk.load_drafter(path, model=model)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(3))
    for i in range(3):
        assert_close_rel(d.logits(model, i, x), heads[i](x), 1e-5, f"medusa head {i}")
    assert_lossless(model, d, tree=[[0], [1], [0, 0], [0, 0, 0]])


@pytest.mark.parametrize("cfg,change,pattern", [
    ({"medusa_num_heads": 2}, {}, r"{dir}/medusa_lm_head.pt does not match {dir}/config.json \(medusa_num_heads is 2, "
                                  r"the weights hold 3: fix config.json\): unexpected 2.0.linear.weight"),
    ({"medusa_num_heads": 3, "medusa_num_layers": 3}, {}, r"{dir}/medusa_lm_head.pt has no 0.3.weight .*medusa_num_layers"
                                                          r" is 3, the weights hold 2"),
    ({"medusa_num_heads": 3}, dict(drop=("1.0.linear.bias", "1.1.linear.bias")), r"missing 1.0.linear.bias"),
    ({"medusa_num_heads": 3}, dict(add={"0.9.scale": torch.ones(1)}), r"unexpected 0.9.scale"),
    ({"medusa_num_heads": 3}, dict(drop=("2.2.weight",), add={"2.2.weight": torch.zeros(V, H - 1)}),
     r"mis-shaped 2.2.weight \[101, 71\] \(expected \[101, 72\]\)"),
    ({"medusa_num_heads": 0}, {}, r"{dir}/config.json: medusa_num_heads must be an int >= 1, got 0"),
])
def test_original_medusa_loading_is_strict(model, tmp_path, monkeypatch, cfg, change, pattern):
    cfg = {"medusa_num_layers": 2, **cfg}
    path = save_medusa(tmp_path / "m", medusa_heads(3, 2, seed=8), cfg, **change)
    refused_before_work(model, monkeypatch, path, ValueError, pattern)


# ---- original Hydra heads (zankner/Hydra hydra_heads/mlp_head.py, prefix_mlp_head.py) -----------------------
def save_hydra(path, orig, cfg, drop=(), add=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    sd = {k: v for k, v in orig.state_dict().items() if k not in drop}
    sd.update(add or {})
    torch.save(sd, path / "hydra_lm_head.pt")
    return path


def hydra_config(**kw):
    return {"hydra_num_heads": 3, "hydra_num_layers": 2, "hydra_head_arch": "mlp", "grounded_heads": True, **kw}


@pytest.mark.parametrize("grounded", [True, False])
def test_original_hydra_decodes_losslessly(model, tmp_path, grounded):
    orig = randomise(OrigHydra(H, V, 3, 2, False, grounded=grounded), 4).eval()
    d = hk.load_drafter(save_hydra(tmp_path, orig, hydra_config(grounded_heads=grounded)), model=model)
    assert d.kind == ("hydra" if grounded else "medusa")
    assert_lossless(model, d, tree=[[0], [1], [0, 0], [0, 0, 0]])


@pytest.mark.parametrize("cfg,change,pattern", [
    # HydraConfig's grounded_heads defaults to false: grounded weights under a config without it
    (dict(grounded_heads=None), {}, r"{dir}/hydra_lm_head.pt does not match {dir}/config.json \(grounded_heads is false "
                                    r"\(HydraConfig's default when absent: false\), the weights' heads are grounded"),
    (dict(hydra_num_heads=2), {}, r"hydra_num_heads is 2, the weights hold 3: fix config.json.*unexpected hydra_mlp.2"),
    (dict(), dict(drop=("hydra_lm_head.1.bias",)), r"missing hydra_lm_head.1.bias"),
    (dict(), dict(add={"prefix_embeding_layer.norm.weight": torch.ones(H)}),
     r"unexpected prefix_embeding_layer.\* \(a prefix layer, but hydra_head_arch is 'mlp'\)"),
    (dict(), dict(drop=("hydra_mlp.0.0.res_connection.weight",)), r"missing hydra_mlp.0.0.res_connection.weight"),
    (dict(hydra_head_arch="cross-attn"), {}, r"{dir}/config.json: hydra_head_arch 'cross-attn' is not supported"),
    (dict(hydra_head_arch="prefix-mlp"), {}, r"{dir}/hydra_lm_head.pt has no hydra_lm_head.0.1.weight"),
    (dict(grounded_heads="yes"), {}, r"{dir}/config.json: grounded_heads must be true or false"),
])
def test_original_hydra_loading_is_strict(model, tmp_path, monkeypatch, cfg, change, pattern):
    orig = randomise(OrigHydra(H, V, 3, 2, False, grounded=True), 5).eval()
    config = hydra_config(**{k: v for k, v in cfg.items() if v is not None})
    for k in [k for k, v in cfg.items() if v is None]:
        del config[k]
    path = save_hydra(tmp_path / "h", orig, config, **change)
    refused_before_work(model, monkeypatch, path, ValueError, pattern)


# ---- EAGLE-1 and fms-extras' MLPSpeculator: their replicas' checkpoints decode losslessly ------------------
def test_original_eagle1_decodes_losslessly(model, tmp_path):
    from test_eagle_original import eagle1

    _, _, path = eagle1(model, tmp_path, "safetensors")
    assert_lossless(model, hk.load_drafter(path, model=model), tree=[[0], [1], [0, 0]])


def test_original_mlp_speculator_decodes_losslessly(model, tmp_path):
    from test_mlp_speculator import random_replica, save_original

    save_original(random_replica(1), tmp_path, prefix=True, fmt="safetensors", topk=[3, 2, 2], n_candidates=4,
                  tie_weights=False, scale_input=False)
    assert_lossless(model, hk.load_drafter(tmp_path, model=model))
