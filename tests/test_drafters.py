"""Drafters: drafting semantics, our format, the original Hydra and Medusa formats, bad input."""
import json

import pytest
import torch
from torch import nn
from transformers import LlamaModel

import hydra_kernels as hk
from hydra_kernels.generate import generate
from hydra_kernels.model.llama import PREFILL_CHUNK_TOKENS
from helpers import assert_close_rel, load_script
from test_llama_vs_transformers import make_hf


@pytest.fixture(scope="module")
def model():
    return hk.Llama.from_hf(make_hf("gqa3-tied", seed=5))


def randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 and "norm" in str(p.shape) else 0))
    return module


@pytest.mark.parametrize("kind", ["medusa", "hydra", "hydra++"])
def test_draft_equals_node_by_node_brute_force(model, kind):
    d = randomise(hk.new_drafter(model, kind=kind, num_heads=3, num_layers=2), 1)
    tree = hk.tree.default_tree(15, depth=3)
    B = 2
    h = torch.randn(B, 72, generator=torch.Generator().manual_seed(2))
    root = torch.tensor([5, 17])
    tokens = d.draft(model, h, root, tree)
    nodes = [()] + tree.choices
    expect = {(): root}
    for c in tree.choices:  # BFS order: a node's path tokens are known before it
        depth = len(c) - 1  # head index
        if kind == "medusa":
            x = h
        else:
            path = [expect[c[:j]] for j in range(len(c))]  # root .. parent
            x = torch.cat([h] + [model.tok_embeddings(t) for t in path], dim=-1)
        logits = d.logits(model, depth, x)
        expect[c] = logits.topk(c[-1] + 1, dim=-1).indices[:, c[-1]]
    for i, c in enumerate(nodes):
        assert torch.equal(tokens[:, i], expect[c]), f"node {c}"


@pytest.mark.parametrize("kind,lm_head,draft_vocab", [("medusa", "per_head", False), ("medusa", "tied", True),
                                                    ("hydra", "tied", True), ("hydra++", "shared", False)])
def test_sampled_drafts_carry_the_heads_distributions(model, kind, lm_head, draft_vocab):
    """draft_temperature > 0: node j's row of Proposal.draft_probs is softmax(head logits / draft_temperature)
    at j's parent (over the whole vocabulary, 0 outside a draft vocabulary), the distribution j's token was
    drawn from; siblings share it; a seeded generator repeats the draws."""
    dv = torch.arange(1, model.config.vocab_size, 2) if draft_vocab else None
    d = randomise(hk.new_drafter(model, kind=kind, num_heads=3, num_layers=2, lm_head=lm_head, draft_vocab=dv), 1)
    d.draft_temperature = 0.7
    tree = hk.tree.default_tree(15, depth=3)
    B = 2
    h = torch.randn(B, 72, generator=torch.Generator().manual_seed(2))
    root, seqlens = torch.tensor([5, 17]), torch.tensor([4, 4], dtype=torch.int32)

    def propose(seed):
        state = d.start(model, B, 32, tree, model.backend_plan("reference"))
        d.use_generator(state, torch.Generator().manual_seed(seed))
        state.h = h
        return d.propose(state, root, seqlens)

    prop = propose(0)
    tokens, q = prop.tokens, prop.draft_probs  # [B, T], [B, T, V]
    assert q.shape == (B, tree.num_nodes, model.config.vocab_size)
    assert torch.equal(propose(0).tokens, tokens) and not torch.equal(propose(1).tokens, tokens)
    ids = d.token_ids(torch.arange(d.config.draft_vocab_size or d.vocab_size))  # draft index -> token id
    for j, c in enumerate(tree.choices, start=1):  # node j's path of ranks c
        parent, depth = int(tree.parents[j]), len(c) - 1  # head index
        path = tree.ancestors[parent, : depth + 1]  # root .. parent
        x = h if kind == "medusa" else torch.cat([h] + [model.tok_embeddings(tokens[:, a]) for a in path], dim=-1)
        expect = torch.zeros(B, q.shape[-1]).index_copy(1, ids, (d.logits(model, depth, x).float() / 0.7).softmax(-1))
        assert_close_rel(q[:, j], expect, 1e-5, f"node {c}")
        assert (q[:, j].gather(1, tokens[:, j, None]) > 0).all()
    assert q[:, 0].abs().sum() == 0  # the root is not drawn


@pytest.mark.parametrize("kind,lm_head", [("medusa", "per_head"), ("hydra", "tied"), ("hydra++", "shared")])
def test_our_format_round_trip(model, tmp_path, kind, lm_head):
    d = randomise(hk.new_drafter(model, kind=kind, num_heads=2, num_layers=3, lm_head=lm_head, lm_head_bias=True), 3)
    d.save(tmp_path)
    back = hk.load_drafter(tmp_path, model=model)
    assert back.config == d.config
    for (k, a), (k2, b) in zip(d.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    if lm_head == "tied":  # a tied drafter stores no vocabulary-sized matrix
        from safetensors.torch import load_file

        assert all(101 not in t.shape for t in load_file(str(tmp_path / "model.safetensors")).values())


def test_prefix_layer_without_final_norm(model, tmp_path):
    """prefix_final_norm=False: a fresh layer is exactly the identity on h (full and cached), a trained
    one (random weights) gives the same output cached in two chunks as over the whole sequence, and the
    setting survives save/load (no norm weight stored)."""
    d = hk.new_drafter(model, kind="hydra++", num_heads=2, prefix_final_norm=False)
    x = torch.randn(2, 9, 72, generator=torch.Generator().manual_seed(6))
    assert torch.equal(d.prefix.forward_full(x), x)
    assert torch.equal(d.prefix(x, d.prefix.new_cache(2, 16, model), model.backend_plan()), x)
    randomise(d, 7)
    full = d.prefix.forward_full(x)
    assert (full - x).abs().max() > 0.1  # the layer now changes h
    cache, plan = d.prefix.new_cache(2, 16, model), model.backend_plan()
    a = d.prefix(x[:, :4], cache, plan)
    cache.advance(4)
    assert_close_rel(torch.cat([a, d.prefix(x[:, 4:], cache, plan)], 1), full, 1e-5, "prefix layer without norm, cached")
    rows = torch.tensor([[0, 8, 3], [5, 5, 0]])  # any positions, repeats included
    assert_close_rel(d.prefix.forward_at(x, rows), full[torch.arange(2)[:, None], rows], 1e-5, "forward_at")
    d.save(tmp_path)
    back = hk.load_drafter(tmp_path, model=model)
    assert back.config.prefix_final_norm is False and back.config == d.config
    assert not any(k.startswith("prefix.norm") for k in back.state_dict())
    assert torch.equal(back.prefix.forward_full(x), full)


@pytest.mark.parametrize("chunk_tokens", [3, 10**6])
def test_prefix_layer_prompts_in_prefill_chunks(model, monkeypatch, chunk_tokens):
    """The prompts' first pass (PrefixLayer.prefill, after the base model's prefill): in prefill chunks of
    1 position (3 sequences, chunk_tokens 3) or in one piece, each sequence's output at its last real
    position equals the cache-free layer's, its K/V rows those of the step path, seqlens = lengths; a
    step after it still equals the cache-free layer over the whole text."""
    monkeypatch.setitem(PREFILL_CHUNK_TOKENS, "cpu", chunk_tokens)
    d = randomise(hk.new_drafter(model, kind="hydra++", num_heads=2), 8)
    x = torch.randn(3, 7, 72, generator=torch.Generator().manual_seed(9))
    lengths = torch.tensor([7, 2, 5], dtype=torch.int32)
    full, plan = d.prefix.forward_full(x), model.backend_plan("reference")
    cache, ref_cache = d.prefix.new_cache(3, 16, model), d.prefix.new_cache(3, 16, model)
    cache.kv.fill_(1234.5)
    out = d.prefix.prefill(x, lengths, cache)
    assert_close_rel(out, full[torch.arange(3), lengths.long() - 1], 1e-5, "last real positions")
    assert torch.equal(cache.seqlens, lengths)
    d.prefix(x, ref_cache, plan)  # the step path over the whole padded prompt
    for b, n in enumerate(lengths.tolist()):
        assert_close_rel(cache.kv[:, :, b, :n], ref_cache.kv[:, :, b, :n], 1e-5, f"K/V rows of sequence {b}")
    nxt = torch.randn(3, 2, 72, generator=torch.Generator().manual_seed(10))
    step = d.prefix(nxt, cache, plan)
    for b, n in enumerate(lengths.tolist()):
        whole = d.prefix.forward_full(torch.cat([x[b:b + 1, :n], nxt[b:b + 1]], 1))[0, n:]
        assert_close_rel(step[b], whole, 1e-5, f"a step after the chunked prompts, sequence {b}")


# ---- original Hydra / Medusa checkpoints, written by replicas of their modules -----------------
class OrigResBlock(nn.Module):
    def __init__(self, H, num_condition=0):
        super().__init__()
        self.linear = nn.Linear(H * (num_condition + 1), H)
        self.res_connection = nn.Linear(H * (num_condition + 1), H) if num_condition > 0 else nn.Identity()

    def forward(self, x):
        return self.res_connection(x) + nn.functional.silu(self.linear(x))


class OrigHydra(nn.Module):
    """The original module layout: one ResBlock object repeated, Dropouts shifting indices in prefix-mlp."""

    def __init__(self, H, V, n, L, prefix, base_cfg=None, grounded=True):
        super().__init__()
        drop = (lambda: [nn.Dropout(0.0)]) if prefix else (lambda: [])
        heads = []
        for i in range(n):
            if grounded:
                rest = OrigResBlock(H)
                heads.append(nn.Sequential(*drop(), OrigResBlock(H, i + 1), *((drop() + [rest]) * (L - 1))))
            else:
                one = OrigResBlock(H)
                heads.append(nn.Sequential(*((drop() + [one]) * L)))
        self.hydra_mlp = nn.ModuleList(heads)
        self.hydra_lm_head = nn.ModuleList(nn.Sequential(*drop(), nn.Linear(H, V)) if prefix else nn.Linear(H, V)
                                           for _ in range(n))
        if prefix:
            self.prefix_embeding_layer = LlamaModel(base_cfg)


@pytest.mark.parametrize("arch,grounded", [("mlp", True), ("prefix-mlp", True), ("mlp", False)])
def test_original_hydra_checkpoint(model, tmp_path, arch, grounded):
    n, L, H, V = 3, 3, 72, 101
    base_cfg = make_hf("gqa3-tied", seed=5).config
    base_cfg.num_hidden_layers = 1
    orig = randomise(OrigHydra(H, V, n, L, arch == "prefix-mlp", base_cfg, grounded), 4).eval()
    sd = orig.state_dict()
    rep = [k for k in sd if ".linear.weight" in k and k.startswith("hydra_mlp.0.")]
    assert len(rep) == L and len({sd[k].data_ptr() for k in rep}) == (2 if grounded else 1)  # shared tensors
    torch.save(sd, tmp_path / "hydra_lm_head.pt")
    (tmp_path / "config.json").write_text(json.dumps({"hydra_num_heads": n, "hydra_num_layers": L,
                                                      "hydra_head_arch": arch, "grounded_heads": grounded}))
    d = hk.load_drafter(tmp_path, model=model)
    assert d.kind == ("hydra++" if arch == "prefix-mlp" else "hydra") if grounded else d.kind == "medusa"
    g = torch.Generator().manual_seed(9)
    for i in range(n):
        x = torch.randn(5, H * (i + 2) if grounded else H, generator=g)
        assert_close_rel(d.logits(model, i, x), orig.hydra_lm_head[i](orig.hydra_mlp[i](x)), 1e-5, f"head {i}")
    if arch == "prefix-mlp":
        x = torch.randn(2, 7, H, generator=g)
        ref = orig.prefix_embeding_layer(inputs_embeds=x).last_hidden_state
        assert_close_rel(d.prefix.forward_full(x), ref, 1e-5, "prefix layer")
        rows = torch.tensor([[6, 0, 4, 4]]).expand(x.shape[0], 4)
        assert_close_rel(d.prefix.forward_at(x, rows), ref[:, [6, 0, 4, 4]], 1e-5, "prefix layer at rows")
        cache, plan = d.prefix.new_cache(2, 16, model), model.backend_plan()  # the cached path gives the same, in two chunks
        a = d.prefix(x[:, :4], cache, plan)
        cache.advance(4)
        assert_close_rel(torch.cat([a, d.prefix(x[:, 4:], cache, plan)], 1), ref, 1e-5, "prefix layer, cached")


def test_original_medusa_checkpoint(model, tmp_path):
    n, L, H, V = 4, 2, 72, 101

    class ResBlockM(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(H, H)

        def forward(self, x):
            return x + nn.functional.silu(self.linear(x))

    orig = randomise(nn.ModuleList(nn.Sequential(*([ResBlockM()] * L), nn.Linear(H, V, bias=False))
                                   for _ in range(n)), 5).eval()
    torch.save(orig.state_dict(), tmp_path / "medusa_lm_head.pt")
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": n, "medusa_num_layers": L}))
    d = hk.load_drafter(tmp_path, model=model)
    assert d.kind == "medusa" and d.config.shared_resblocks
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(1))
    for i in range(n):
        assert_close_rel(d.logits(model, i, x), orig[i](x), 1e-5, f"medusa head {i}")


def test_unknown_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="neither"):
        hk.load_drafter(tmp_path)


# ---- bad input to generate with a drafter -------------------------------------------------------
def test_drafter_bad_input_is_caught_before_work(model, monkeypatch):
    d = hk.new_drafter(model, kind="hydra", num_heads=2)
    monkeypatch.setattr(model, "prefill", lambda *a, **k: pytest.fail("work started"))
    p = [[1, 2, 3]]
    with pytest.raises(ValueError, match="3 deep but the drafter has 2 heads"):
        generate(model, p, drafter=d, tree="chain-3", max_new_tokens=4)
    with pytest.raises(ValueError, match="KV buffer too small.*tree"):
        generate(model, p, drafter=d, tree="chain-2", max_new_tokens=4, max_seq_len=9)
    with pytest.raises(ValueError, match="greedy acceptance is for temperature 0"):
        generate(model, p, drafter=d, temperature=0.7, acceptance="greedy", max_new_tokens=4)
    other = hk.Llama.from_hf(make_hf("mha-untied"))  # hidden 48 vs 72
    with pytest.raises(ValueError, match="hidden size"):
        generate(other, p, drafter=d, max_new_tokens=4)
    wide = hk.new_drafter(hk.Llama.from_hf(make_hf("gqa3-tied", vocab_size=120)), kind="medusa", num_heads=2)
    with pytest.raises(ValueError, match="vocab"):
        generate(model, p, drafter=wide, max_new_tokens=4)
    with pytest.raises(ValueError, match="call drafter.to"):
        generate(model, p, drafter=hk.new_drafter(model, kind="medusa").double(), max_new_tokens=4)


def test_save_bf16_with_trees_roundtrip(tmp_path):
    model = hk.Llama.from_hf(make_hf("gqa3-tied", seed=2))
    torch.manual_seed(0)
    d = hk.new_drafter(model, "hydra", num_heads=2, draft_vocab=torch.arange(0, 60, 3))
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.05)
    d.trees = {"cpu": hk.Tree([[0], [1], [0, 0]])}
    d.save(tmp_path / "h", dtype=torch.bfloat16)
    e = hk.load_drafter(tmp_path / "h", model=model)
    assert e.trees["cpu"].choices == d.trees["cpu"].choices
    assert torch.equal(e.draft_vocab, d.draft_vocab) and e.draft_vocab.dtype == torch.long
    for (k, a), (_, b) in zip(d.state_dict().items(), e.state_dict().items()):
        if a.is_floating_point():
            assert b.dtype == a.dtype and torch.equal(b, a.to(torch.bfloat16).to(a.dtype)), k
    plain = generate(model, [[1, 2, 3]], max_new_tokens=10, eos_token_id=[]).sequences
    out = generate(model, [[1, 2, 3]], drafter=e, max_new_tokens=10, eos_token_id=[])  # tree=None: e.trees["cpu"]
    assert out.sequences == plain


def test_shipped_heads_registry_and_errors(tmp_path, monkeypatch):
    """load_drafter() reads the package's heads dir: the preferred shipped kind, a named kind, clear
    errors when a kind (or everything) is missing or the model is not the embedded default."""
    import hydra_kernels.drafters.registry as drafters

    monkeypatch.setattr(drafters, "SHIPPED_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="no shipped 'hydra' drafter; shipped: none"):
        hk.load_drafter()
    model = hk.Llama.from_hf(make_hf("gqa3-tied", seed=2))
    for kind in ("medusa", "hydra"):
        hk.new_drafter(model, kind, num_heads=2).save(tmp_path / drafters.SHIPPED_MODEL / kind, dtype=torch.bfloat16)
    assert sorted(drafters.shipped_drafters()) == ["hydra", "medusa"]
    assert hk.load_drafter().kind == "hydra" and hk.load_drafter(kind="medusa").kind == "medusa"
    with pytest.raises(FileNotFoundError, match=r"no shipped 'hydra\+\+' drafter; shipped: \['hydra', 'medusa'\]"):
        hk.load_drafter(kind="hydra++")
    with pytest.raises(ValueError, match="only used with path=None"):
        hk.load_drafter(tmp_path, kind="hydra")
    with pytest.raises(ValueError, match="shipped drafters are for the embedded SmolLM2"):
        hk.load_drafter(model=model)
    with pytest.raises(FileNotFoundError, match=r"no shipped 'eagle' drafter.*python/train_eagle.py"):
        hk.load_drafter(kind="eagle")


def test_default_kind_is_the_one_default_json_names(tmp_path, monkeypatch):
    """load_drafter() returns the kind the package's default.json names (the fastest measured), not the first
    of the fallback order; a default.json that is not JSON, lacks its kind or names a kind not shipped is
    refused as a corrupt package."""
    import hydra_kernels.drafters.registry as drafters

    monkeypatch.setattr(drafters, "SHIPPED_DIR", tmp_path)
    model = hk.Llama.from_hf(make_hf("gqa3-tied", seed=2))
    root = tmp_path / drafters.SHIPPED_MODEL
    for kind in ("medusa", "hydra"):
        hk.new_drafter(model, kind, num_heads=2).save(root / kind, dtype=torch.bfloat16)
    assert drafters.default_kind() == "hydra"  # no default.json: the fallback order
    (root / "default.json").write_text('{"kind": "medusa", "measured": "a test"}')
    assert drafters.default_kind() == "medusa" and hk.load_drafter().kind == "medusa"
    for bad, why in (("{not json", "must be JSON"), ('{"measured": "x"}', "must be JSON"),
                     ('{"kind": "eagle"}', "names 'eagle', which is not shipped")):
        (root / "default.json").write_text(bad)
        with pytest.raises(ValueError, match=why):
            hk.load_drafter()


def _package_of_medusa_and_hydra(drafters, tmp_path, monkeypatch):
    """A package dir under tmp_path shipping untrained medusa and hydra heads for a tiny model (registry patched)
    -> (the model, the shipped model's directory)."""
    monkeypatch.setattr(drafters, "SHIPPED_DIR", tmp_path)
    model = hk.Llama.from_hf(make_hf("gqa3-tied", seed=2))
    monkeypatch.setattr(drafters, "SHIPPED_SHAPE", (model.config.vocab_size, model.config.hidden_size))
    root = tmp_path / drafters.SHIPPED_MODEL
    for kind in ("medusa", "hydra"):
        hk.new_drafter(model, kind, num_heads=2).save(root / kind, dtype=torch.bfloat16)
    return model, root


def test_batch_1_kind_and_the_composed_combined_drafter(tmp_path, monkeypatch):
    """default.json's optional batch_1 entry names the kind for one sequence at a time (the CLI's and the demo's;
    the shipped default.json has none now: its default kind is the combined drafter itself): "combined" is
    composed at load time from the n-gram drafter and the default shipped kind, with no weights of its own;
    without the entry batch 1 takes the default; a batch_1 entry without a kind, naming a kind neither shipped
    nor composed, or a composed default without shipped heads is refused as a corrupt package."""
    import hydra_kernels.drafters.registry as drafters
    from hydra_kernels.drafters import CombinedDrafter, NgramDrafter

    model, root = _package_of_medusa_and_hydra(drafters, tmp_path, monkeypatch)
    (root / "default.json").write_text('{"kind": "medusa", "measured": "a test"}')
    assert drafters.default_kind(batch_1=True) == "medusa"  # no batch_1 entry: the default
    (root / "default.json").write_text('{"kind": "medusa", "measured": "a", "batch_1": {"kind": "combined", "measured": "b"}}')
    assert drafters.default_kind() == "medusa" and drafters.default_kind(batch_1=True) == "combined"
    d = hk.load_drafter(model=model, kind=drafters.default_kind(batch_1=True))
    assert isinstance(d, CombinedDrafter) and isinstance(d.ngram, NgramDrafter) and d.heads.kind == "medusa"
    assert d.node_budget == drafters.COMBINED_NODE_BUDGET and not d.budget_tables
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 3]]
    ref = generate(model, prompts, max_new_tokens=12, eos_token_id=[])
    assert generate(model, prompts, drafter=d, max_new_tokens=12, eos_token_id=[]).sequences == ref.sequences
    for bad, why in (('{"kind": "medusa", "batch_1": {}}', "must be JSON"),
                     ('{"kind": "medusa", "batch_1": {"kind": "eagle"}}', "names 'eagle' for batch 1, which is neither"),
                     ('{"kind": "combined"}', r"KeyError\('heads'\)"),  # a composed default names its heads
                     ('{"kind": "combined", "heads": "eagle"}', "names 'eagle' as the heads of 'combined', which is not"),
                     ('{"kind": "combined", "heads": "combined"}', "names 'combined' as the heads"),
                     ('{"kind": ["hydra"]}', "kinds are strings")):
        (root / "default.json").write_text(bad)
        with pytest.raises(ValueError, match=why):
            drafters.default_kind(batch_1=True)
    # the composed drafter's heads are the default kind: one that drafts no static tree is refused before loading
    (root / "default.json").write_text('{"kind": "medusa", "batch_1": {"kind": "combined"}}')
    monkeypatch.setattr(drafters, "STATIC_TREE_KINDS", ("hydra",))
    with pytest.raises(ValueError, match="drafts no static tree"):
        drafters.default_kind(batch_1=True)
    with pytest.raises(ValueError, match="drafts no static tree"):
        hk.load_drafter(model=model, kind="combined")


def test_combined_default_with_its_budget_table(tmp_path, monkeypatch):
    """default.json may name the composed combined drafter as load_drafter()'s default, over the shipped heads its
    "heads" names; its budget tables come from composed_tables_dir and steer generate() (a plain step where the
    table says so) while a table searched over other heads is not used."""
    import hydra_kernels.drafters.registry as drafters
    from hydra_kernels.acceptance_prior import AcceptancePrior
    from hydra_kernels.budget import BudgetTable, tree_key
    from hydra_kernels.drafters import CombinedDrafter

    model, root = _package_of_medusa_and_hydra(drafters, tmp_path, monkeypatch)
    (root / "default.json").write_text('{"kind": "combined", "heads": "medusa", "measured": "a test"}')
    assert drafters.default_kind() == "combined" == drafters.default_kind(batch_1=True)
    assert "combined" not in drafters.shipped_drafters()  # its directory holds tables only
    d = hk.load_drafter(model=model)
    assert isinstance(d, CombinedDrafter) and d.heads.kind == "medusa" and not d.budget_tables
    bound = d.resolve_tree(None, "cpu")
    # batch 1 drafts 4 nodes, batch 2 runs plain steps
    table = BudgetTable(device="cpu", tree=tree_key(bound), full=bound.num_nodes, batch_sizes=[1, 2], contexts=[128],
                        nodes=[[4], [1]])
    drafters.composed_tables_dir("combined", "medusa").mkdir(parents=True)
    table.save(drafters.composed_tables_dir("combined", "medusa"))
    assert d.acceptance_prior is None
    n = 2 * 8 * 8  # ngram and heads x depth keys x signals
    prior = AcceptancePrior(["ngram", "heads"], 8, 8, [0.25] * n, [1.0] * n, "a test")
    prior.save(drafters.composed_tables_dir("combined", "medusa"))  # beside the table: the composed kind's prior
    d = hk.load_drafter(model=model)
    assert d.budget_tables["cpu"].nodes == [[4], [1]] and d.acceptance_prior == prior
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 9, 3, 9]]
    for batch, nodes in (([prompts[0]], {4}), (prompts, {1})):  # batch 2: plain steps (or plain decoding)
        out = generate(model, batch, drafter=d, budget="auto", max_new_tokens=16, eos_token_id=[])
        assert out.sequences == generate(model, batch, max_new_tokens=16, eos_token_id=[]).sequences
        assert set(out.step_nodes) <= nodes and (len(batch) > 1 or out.step_nodes)
    # heads changed (hydra): the table was searched over medusa's heads (here the same tree), so it is not taken
    (root / "default.json").write_text('{"kind": "combined", "heads": "hydra", "measured": "a test"}')
    d = hk.load_drafter(model=model)
    assert d.heads.kind == "hydra" and not d.budget_tables
    out = generate(model, prompts, drafter=d, max_new_tokens=16, eos_token_id=[])
    assert out.sequences == generate(model, prompts, max_new_tokens=16, eos_token_id=[]).sequences
    assert out.step_nodes and min(out.step_nodes) > 1  # no table: every step drafts


def test_ship_heads_default_keeps_the_batch_1_entry(tmp_path, monkeypatch):
    """python/ship_heads.py --default rewrites default.json's kind and measurement, keeps its batch_1 entry (a
    separate measurement) while the default kind stays, drops it when the default kind (combined's heads) changes,
    and refuses a kind that is not shipped; a composed default (combined) is written with its heads, and refused
    without shipped static-tree heads or without a budget table searched over them."""
    ship = load_script("python/ship_heads.py")
    monkeypatch.setattr(ship, "SHIPPED_DIR", tmp_path)
    monkeypatch.setattr(ship, "shipped_drafters", lambda: {"hydra": tmp_path, "medusa": tmp_path})
    f = tmp_path / ship.SHIPPED_MODEL / ship.DEFAULT_FILE
    f.parent.mkdir(parents=True)
    f.write_text(json.dumps({"kind": "medusa", "measured": "old", "batch_1": {"kind": "combined", "measured": "b1"}}))
    ship.main(["--default", "medusa", "--measured", "new"])  # the same default kind: the batch-1 entry stands
    assert json.loads(f.read_text()) == {"kind": "medusa", "measured": "new", "batch_1": {"kind": "combined", "measured": "b1"}}
    ship.main(["--default", "hydra", "--measured", "newer"])  # another: batch 1 was measured over medusa, dropped
    assert json.loads(f.read_text()) == {"kind": "hydra", "measured": "newer"}
    with pytest.raises(SystemExit):
        ship.main(["--default", "eagle", "--measured", "x"])
    # a composed default names its heads (default.json's current ones unless --heads) and needs its budget table
    # searched over them; a batch_1 entry naming the new default is dropped as redundant
    monkeypatch.setattr(ship, "composed_tables_dir", lambda kind, heads: tmp_path / "tables" / kind / heads)
    f.write_text(json.dumps({"kind": "hydra", "measured": "a", "batch_1": {"kind": "combined", "measured": "b1"}}))
    with pytest.raises(SystemExit):  # no table searched yet
        ship.main(["--default", "combined", "--measured", "c"])
    for heads in ("hydra", "medusa"):
        (tmp_path / "tables" / "combined" / heads).mkdir(parents=True)
        (tmp_path / "tables" / "combined" / heads / "budget_cpu.json").write_text("{}")
    ship.main(["--default", "combined", "--measured", "c"])
    assert json.loads(f.read_text()) == {"kind": "combined", "measured": "c", "heads": "hydra"}
    ship.main(["--default", "combined", "--heads", "medusa", "--measured", "d"])
    assert json.loads(f.read_text()) == {"kind": "combined", "measured": "d", "heads": "medusa"}
    for bad in (["--default", "combined", "--heads", "eagle", "--measured", "x"],
                ["--default", "hydra", "--heads", "medusa", "--measured", "x"], ["--heads", "hydra"]):
        with pytest.raises(SystemExit):
            ship.main(bad)


def test_lm_head_rows_packed_in_chunks_equal_the_slice_packed_whole(monkeypatch):
    """fit.pack_lm_head_rows (the tied LM head's draft-vocabulary rows packed PACK_CHUNK rows at a time, no
    fp32 slice ever whole) is pack_linear_weight of the gathered slice, bit for bit: a vocabulary that is not
    a multiple of the chunk or of the 64-row panel, unsorted ids, the whole head (every id), an input-major
    weight as the CPU model keeps it; and the drafter's logits read those panels."""
    from hydra_kernels.drafters import fit
    from hydra_kernels.ops.packed_linear import pack_linear_weight, packed_linear

    monkeypatch.setattr(fit, "PACK_CHUNK", 128)  # several chunks at a test's size
    g = torch.Generator().manual_seed(0)
    w = torch.randn(700, 48, generator=g).t().contiguous().t()  # [V, H] seen from input-major storage
    ids = torch.randperm(700, generator=g)[:333]
    gather = lambda i: w.index_select(0, i)  # noqa: E731  (what Llama.lm_head_rows gives)
    for rows in (ids, None):
        want = pack_linear_weight(fit.lm_head_rows(gather, rows) if rows is not None else w, fit.DRAFT_PACK_DTYPE)
        got = fit.pack_lm_head_rows(gather, rows if rows is not None else torch.arange(700))
        assert got.dtype == want.dtype and torch.equal(got, want)
    head, model = fit.TiedLMHead(), type("M", (), {})()
    model.output = type("O", (), {"weight": w, "out_features": 700})()
    model.lm_head_source = lambda: w  # Llama's accessors (the head's values, read a few rows at a time)
    model.lm_head_rows = gather
    model.lm_head_quantized = lambda: None  # an fp32 head: bf16 panels of its rows
    h = torch.randn(3, 48, generator=g)
    assert torch.equal(head.packed_logits(model, ids, h), packed_linear(h, pack_linear_weight(w[ids], fit.DRAFT_PACK_DTYPE), 333))
    assert head._rows._key is None  # the packed path never built the fp32 slice
