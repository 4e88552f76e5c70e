"""Bad drafter files, tried as a new user would (issue 47): a config that does not describe its weights, and
corrupt files of every kind a drafter directory holds, are refused by hk.load_drafter before any work, naming
the file (and the config field at odds); no prefill runs. The formats of original implementations get the
same: see test_drafter_formats.py."""
import json
import re
import shutil

import numpy as np
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.budget import BudgetTable, tree_key
from hydra_kernels.drafters.eagle import DynamicTree
from hydra_kernels.generate import generate
from test_llama_vs_transformers import make_hf

P = [[1, 2, 3]]


@pytest.fixture(scope="module")
def model():
    return hk.Llama.from_hf(make_hf("gqa3-tied", seed=5))  # vocab 101, hidden 72


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    """kind -> a directory of that drafter saved in our format (random weights, a CPU tree and budget table where
    the kind has them)."""
    root = tmp_path_factory.mktemp("saved")
    g = torch.Generator().manual_seed(0)
    out = {}
    for kind, opts in (("hydra", dict(num_heads=4)), ("medusa", dict(num_heads=2)), ("eagle", {}),
                       ("mlp_speculator", dict(n_predict=3)), ("amphista", dict(num_heads=2)), ("ngram", {})):
        d = hk.new_drafter(model, kind, **opts)
        for p in d.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
        if kind in ("hydra", "medusa", "amphista"):
            d.trees["cpu"] = hk.Tree([[0], [1], [0, 0]])
            d.budget_tables["cpu"] = BudgetTable("cpu", tree_key(d.trees["cpu"]), 4, [1, 8], [64], [[4], [1]])
        if kind == "eagle":
            d.dynamic_trees["cpu"] = DynamicTree(total_tokens=6, depth=3, top_k=2)
        d.save(root / kind)
        out[kind] = root / kind
    return out


def copy_of(saved, kind, tmp_path):
    return shutil.copytree(saved[kind], tmp_path / kind)


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    for k in [k for k, v in changes.items() if v is None]:
        del cfg[k]
    (path / "config.json").write_text(json.dumps(cfg))


def refused_before_work(model, monkeypatch, path, exc, pattern):
    """Loading `path` for `model` and generating with it raises `exc` matching `pattern` (a regex, '{dir}' standing for
    the directory), and the model never runs."""
    monkeypatch.setattr(model, "prefill", lambda *a, **k: pytest.fail("work started before the error"))
    with pytest.raises(exc, match=pattern.replace("{dir}", re.escape(str(path)))) as err:
        generate(model, P, drafter=hk.load_drafter(path, model=model), max_new_tokens=4)
    return str(err.value)


def test_every_saved_kind_loads_and_its_files_are_read(model, saved):
    """The good directories the cases below damage: each loads, with its tree, table and dynamic tree."""
    for kind, path in saved.items():
        d = hk.load_drafter(path, model=model)
        assert d.kind == kind
        if kind in ("hydra", "medusa", "amphista"):
            assert [list(c) for c in d.trees["cpu"].choices] == [[0], [1], [0, 0]] and d.budget_tables["cpu"].nodes == [[4], [1]]
    assert hk.load_drafter(saved["eagle"], model=model).dynamic_trees["cpu"].top_k == 2


# ---- 1: a config that does not describe its weights ---------------------------------------------------------
@pytest.mark.parametrize("kind,changes,pattern", [
    # the report's three cases
    ("hydra", dict(kind="medusa"),
     r"{dir}/config.json: \"kind\" is 'medusa', but its fields \(grounded true, prefix_layer false\) describe a "
     r"'hydra' drafter; fix \"kind\""),
    ("hydra", dict(num_heads=6),
     r"{dir}/model.safetensors does not match {dir}/config.json \(num_heads is 6, the weights hold 4 heads: fix "
     r"config.json\): missing heads.4.blocks.0.linear.weight"),
    ("hydra", dict(kind="eagle"),
     r"{dir}/config.json: \"kind\" is 'eagle', but its fields \[.*'num_heads'.*\] are not fields of kind 'eagle': "
     r"they are those of 'medusa' / 'hydra' / 'hydra\+\+'; fix \"kind\""),
    # neighbours: fewer heads, other layers / LM head / width / prefix layer, unknown and bad fields, kinds, version
    ("hydra", dict(num_heads=3), r"num_heads is 3, the weights hold 4 heads.*unexpected heads.3"),
    ("hydra", dict(num_layers=2), r"num_layers is 2, the weights hold 1 ResBlocks per head.*missing heads.0.blocks.1"),
    ("hydra", dict(lm_head="per_head"), r"lm_head is \"per_head\", the weights hold \"tied\" LM heads.*missing heads.0.lm_head"),
    ("medusa", dict(hidden_size=64), r"hidden_size is 64, the weights hold 72 hidden units.*mis-shaped .*"
                                     r"heads.0.blocks.0.linear.weight \[72, 72\] \(expected \[64, 64\]\)"),
    ("medusa", dict(grounded=True, kind="hydra"), r"{dir}/model.safetensors does not match .*grounded is true, the "
                                                  r"weights hold false"),
    ("hydra", dict(num_head=4), r"{dir}/config.json: unknown field\(s\) \['num_head'\] for a 'hydra' drafter"),
    ("hydra", dict(num_heads=None), r"{dir}/config.json: missing \['num_heads'\] for a 'hydra' drafter"),
    ("hydra", dict(num_heads=0), r"{dir}/config.json: num_heads and num_layers must be >= 1"),
    ("hydra", dict(num_heads="4"), r"{dir}/config.json: num_heads must be an int, got '4'; fix config.json"),
    ("hydra", dict(grounded=1), r"{dir}/config.json: grounded must be a bool, got 1"),
    ("hydra", dict(draft_vocab_size=2.5), r"{dir}/config.json: draft_vocab_size must be an int or null, got 2.5"),
    ("hydra", dict(kind="banana"), r"{dir}/config.json: \"kind\" 'banana' is not a drafter kind"),
    ("hydra", dict(version=2), r"{dir}/config.json: format version 2; this hydra_kernels reads version 1"),
    ("ngram", dict(kind="hydra"), r"\"kind\" is 'hydra', but its fields .* are those of 'ngram'"),
    ("mlp_speculator", dict(n_predict=4), r"{dir}/config.json: top_k_tokens_per_head needs one k per stage"),
    ("mlp_speculator", dict(n_predict=4, top_k_tokens_per_head=[4, 3, 2, 2]),
     r"{dir}/model.safetensors does not match {dir}/config.json: missing proj.3"),
    ("eagle", dict(fc_bias=False), r"{dir}/model.safetensors does not match {dir}/config.json: unexpected layer.fc.bias"),
    ("eagle", dict(hidden_size=64), r"{dir}: EAGLE layer built for vocab 101 / hidden 64, the model has 101 / 72"),
    ("amphista", dict(num_heads=3), r"{dir}/model.safetensors does not match {dir}/config.json"),
])
def test_config_that_does_not_describe_the_weights_is_refused(model, saved, tmp_path, monkeypatch, kind, changes,
                                                               pattern):
    path = copy_of(saved, kind, tmp_path)
    edit_config(path, **changes)
    refused_before_work(model, monkeypatch, path, ValueError, pattern)


def test_legacy_config_without_kind_needs_head_fields(model, saved, tmp_path, monkeypatch):
    path = copy_of(saved, "ngram", tmp_path)
    edit_config(path, kind=None)
    refused_before_work(model, monkeypatch, path, ValueError, r"{dir}/config.json has no \"kind\" and its fields are "
                                                              r"not a head drafter's")
    legacy = copy_of(saved, "hydra", tmp_path / "legacy")  # the shipped heads were written before "kind": still read
    edit_config(legacy, kind=None)
    assert hk.load_drafter(legacy, model=model).kind == "hydra"


def test_drafter_for_another_model_is_refused_at_load_naming_the_directory(saved):
    other = hk.Llama.from_hf(make_hf("mha-untied"))  # hidden 48
    with pytest.raises(ValueError, match=re.escape(str(saved["hydra"])) + r": drafter hidden size \(72\) does not "
                                         r"match the model's \(48\)"):
        hk.load_drafter(saved["hydra"], model=other)


# ---- 2: corrupt files, each named -------------------------------------------------------------------------
def garble(path, offset, data: bytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(f):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _nan(f):
    from safetensors.torch import load_file, save_file

    sd = load_file(str(f))
    k = next(k for k, v in sd.items() if v.is_floating_point())
    sd[k].view(-1)[3] = float("nan")
    save_file(sd, str(f))


@pytest.mark.parametrize("kind,file,damage,exc,pattern", [
    ("hydra", "model.safetensors", _truncate, ValueError,
     r"{dir}/model.safetensors is not a readable weights file \(SafetensorError: .*\); the checkpoint is corrupt"),
    ("hydra", "model.safetensors", lambda f: garble(f, 8, b"\x00" * 16), ValueError,
     r"{dir}/model.safetensors is not a readable weights file"),
    ("hydra", "model.safetensors", _nan, ValueError, r"{dir}/model.safetensors: weight '.*' holds 1 non-finite value"),
    ("hydra", "model.safetensors", lambda f: f.unlink(), FileNotFoundError, r"{dir}/model.safetensors is missing"),
    ("hydra", "config.json", lambda f: f.write_text("{not json"), ValueError, r"{dir}/config.json is not valid JSON"),
    ("hydra", "config.json", lambda f: f.write_text("[1, 2]"), ValueError,
     r"{dir}/config.json holds JSON list, not an object"),
    ("hydra", "config.json", lambda f: f.write_bytes(b"\xff\xfe{"), ValueError, r"{dir}/config.json is not valid JSON"),
    ("hydra", "tree_cpu.json", lambda f: f.write_text("garbage"), ValueError, r"{dir}/tree_cpu.json is not valid JSON"),
    ("hydra", "tree_cpu.json", lambda f: f.write_text('{"choices": 1}'), ValueError,
     r"{dir}/tree_cpu.json is not a tree this drafter can draft \(expected a JSON list of choices, got dict\)"),
    ("hydra", "tree_cpu.json", lambda f: f.write_text('[[0], [0.5]]'), ValueError,
     r"{dir}/tree_cpu.json is not a tree this drafter can draft .*ranks must be ints"),
    ("medusa", "tree_cpu.json", lambda f: f.write_text('[[0], [0, 0], [0, 0, 0]]'), ValueError,
     r"{dir}/tree_cpu.json is not a tree this drafter can draft \(.*3 deep but the drafter has 2 heads"),
    ("hydra", "budget_cpu.json", lambda f: f.write_text("{"), ValueError,
     r"{dir}/budget_cpu.json is not a budget table"),
    ("hydra", "budget_cpu.json", lambda f: f.write_text(f.read_text().replace('"device": "cpu"', '"device": "cuda"')),
     ValueError, r"{dir}/budget_cpu.json holds the table of device 'cuda'"),
    ("eagle", "dynamic_cpu.json", lambda f: f.write_text("[1]"), ValueError,
     r"{dir}/dynamic_cpu.json is not an EAGLE-2 dynamic tree"),
    ("eagle", "dynamic_cpu.json", lambda f: f.write_text('{"total_tokens": 6, "depth": 3, "top_k": 200}'), ValueError,
     r"{dir}/dynamic_cpu.json: the dynamic tree asks for the draft's top 200 tokens"),
    ("mlp_speculator", "model.safetensors", _truncate, ValueError, r"{dir}/model.safetensors is not a readable"),
    ("ngram", "config.json", lambda f: f.write_text('{"format": "hydra_kernels.drafter", "kind": "ngram", "max_ngram": 0}'),
     ValueError, r"{dir}/config.json: "),
])
def test_corrupt_file_is_refused_naming_it(model, saved, tmp_path, monkeypatch, kind, file, damage, exc, pattern):
    path = copy_of(saved, kind, tmp_path)
    damage(path / file)
    refused_before_work(model, monkeypatch, path, exc, pattern)


def test_combined_drafter_names_the_bad_file_of_its_part(model, saved, tmp_path, monkeypatch):
    combined = hk.new_drafter(model, "combined", drafters=[hk.new_drafter(model, "ngram"),
                                                           hk.load_drafter(saved["hydra"], model=model)])
    combined.save(tmp_path / "combined")
    _truncate(tmp_path / "combined" / "heads" / "model.safetensors")
    refused_before_work(model, monkeypatch, tmp_path / "combined", ValueError,
                        r"{dir}/heads/model.safetensors is not a readable weights file")


def test_not_a_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory: pass a drafter directory"):
        hk.load_drafter(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        hk.load_drafter(tmp_path / "config.json")


def test_corrupt_weights_of_an_original_format_are_named(model, tmp_path, monkeypatch):
    """torch.save'd state dicts (original Hydra / Medusa / EAGLE heads): truncated, garbled or not a state dict."""
    path = tmp_path / "medusa"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": 1, "medusa_num_layers": 1}))
    sd = {"0.0.linear.weight": torch.randn(72, 72), "0.0.linear.bias": torch.randn(72), "0.1.weight": torch.randn(101, 72)}
    torch.save(sd, path / "medusa_lm_head.pt")
    assert hk.load_drafter(path, model=model).kind == "medusa"
    _truncate(path / "medusa_lm_head.pt")
    refused_before_work(model, monkeypatch, path, ValueError, r"{dir}/medusa_lm_head.pt is not a readable weights file")
    torch.save([1, 2], path / "medusa_lm_head.pt")
    refused_before_work(model, monkeypatch, path, ValueError, r"{dir}/medusa_lm_head.pt does not hold a state dict")
    (path / "medusa_lm_head.pt").write_bytes(np.random.default_rng(0).bytes(4096))
    refused_before_work(model, monkeypatch, path, ValueError, r"{dir}/medusa_lm_head.pt is not a readable weights file")
    (path / "medusa_lm_head.pt").unlink()
    refused_before_work(model, monkeypatch, path, FileNotFoundError,
                        r"{dir} has an original Medusa config.json \(medusa_num_heads\) but no weights: expected "
                        r"medusa_lm_head.safetensors or medusa_lm_head.pt")


def test_corrupt_shard_index_is_named(model, tmp_path, monkeypatch):
    path = tmp_path / "spec"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "mlp_speculator", "emb_dim": 72, "vocab_size": 101}))
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    refused_before_work(model, monkeypatch, path, ValueError, r"{dir}/model.safetensors.index.json has no weight_map")
    (path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-1.safetensors"}}')
    refused_before_work(model, monkeypatch, path, FileNotFoundError, r"{dir}/model-1.safetensors is missing")
