"""Our Llama equals transformers' LlamaForCausalLM on the same weights (random small configs)."""
import json

import pytest
import torch
from transformers import LlamaConfig as HFConfig
from transformers import LlamaForCausalLM

import hydra_kernels as hk
from helpers import assert_close_rel

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
CONFIGS = {  # odd sizes throughout: vocab 101, hidden 48/72, intermediate 70/94
    "mha-untied": dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=4),
    "gqa3-tied": dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "gqa4-llama3-rope": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, rope_scaling=LLAMA3_ROPE),
    "mqa-linear-rope-bias": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=1,
                                 rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True, mlp_bias=True),
    "head_dim-override": dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}


def make_hf(name: str, seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    kw = dict(vocab_size=101, intermediate_size=70 if name != "gqa3-tied" else 94, num_hidden_layers=3,
              rope_theta=5000.0, max_position_embeddings=256, rms_norm_eps=1e-5)
    kw.update(CONFIGS[name])
    kw.update(overrides)
    hf = LlamaForCausalLM(HFConfig(**kw)).eval()
    with torch.no_grad():  # HF zero-inits biases and ones-inits norms: randomise them so they matter
        for n, p in hf.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in n else 0.0))
    return hf


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name):
    hf = make_hf(name)
    ours = hk.Llama.from_hf(hf)
    ids = torch.randint(0, 101, (2, 37), generator=torch.Generator().manual_seed(1))
    ref = hf(ids).logits
    assert_close_rel(ours(ids), ref, 1e-4, f"{name} logits")


@pytest.mark.parametrize("name", ["gqa3-tied", "gqa4-llama3-rope"])
def test_hf_directory_round_trip_sharded(name, tmp_path):
    """transformers writes a sharded safetensors dir; we load it; transformers reads ours back."""
    hf = make_hf(name, seed=3)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours, tok = hk.load_model(tmp_path / "hf", device="cpu")
    assert tok is None
    ids = torch.randint(0, 101, (1, 20), generator=torch.Generator().manual_seed(2))
    ref = hf(ids).logits
    assert_close_rel(ours(ids), ref, 1e-4, "loaded from sharded dir")

    from hydra_kernels.model import save_hf_dir

    save_hf_dir(ours, tmp_path / "ours")
    back = LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert_close_rel(back(ids).logits, ref, 1e-4, "transformers reading our dir")


def test_dtype_and_config_round_trip(tmp_path):
    hf = make_hf("gqa4-llama3-rope")
    hf.save_pretrained(tmp_path)
    ours, _ = hk.load_model(tmp_path, dtype="bfloat16", device="cpu")
    assert ours.dtype == torch.bfloat16
    assert ours.config.rope_scaling["rope_type"] == "llama3"
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert hk.LlamaConfig.from_hf_dict(cfg).to_hf_dict()["rope_scaling"]["factor"] == 8.0
    ids = torch.randint(0, 101, (1, 9), generator=torch.Generator().manual_seed(5))
    ref = hf.to(torch.bfloat16)(ids).logits
    # bf16 vs bf16: both round every op to 8 mantissa bits; differences come from op order only.
    assert_close_rel(ours(ids).float(), ref.float(), 5e-2, "bf16 logits")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_expected_keys_from_the_config_alone(name):
    """hf_names.expected_keys (no model built) = the parameters a Llama of that config holds."""
    from hydra_kernels.model.hf_names import expected_keys

    cfg = hk.LlamaConfig.from_hf_dict(make_hf(name).config.to_dict())
    with torch.device("meta"):
        keys = set(hk.Llama(cfg).state_dict())
    if cfg.tie_word_embeddings:
        keys.discard("output.weight")  # the tied head is the embedding
    assert expected_keys(cfg) == keys


def test_model_package_imports_are_acyclic():
    """No module of hydra_kernels/model imports one that imports it back, counting imports inside
    functions too (a lazy import is how a cycle hides)."""
    import ast
    from pathlib import Path

    root = Path(hk.__file__).parent / "model"
    deps = {}
    for f in root.glob("*.py"):
        tree = ast.parse(f.read_text())
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module}
        deps[f.stem] = {m.split(".")[0] for m in names} & {g.stem for g in root.glob("*.py")}

    def reaches(a, b, seen=()):
        return any(d == b or (d not in seen and reaches(d, b, seen + (d,))) for d in deps[a])

    cycles = [m for m in deps if reaches(m, m)]
    assert not cycles, f"import cycles through {cycles}: {deps}"
