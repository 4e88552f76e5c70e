"""A GGUF loaded with its blocks kept (hk.load_model(weights="quantized"), the CPU default for GGUF files):
the same logits as the fp32 load of the same file, bit for bit, for every supported format mixed in one
file; projections held only as quantized panels; greedy decoding, plain and speculative, token for token
the fp32 model's on the embedded SmolLM2; bad `weights` values refused before loading."""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.generate import generate
from hydra_kernels.model.packed_linear import Linear, packed_linear_available
from hydra_kernels.model.quantized_embedding import QuantizedEmbedding
from hydra_kernels.ops.quantized_linear import QuantizedPanels, quantized_linear_available
from helpers import assert_close_rel
from test_gguf_loading import write_gguf
from test_llama_vs_transformers import make_hf

pytestmark = pytest.mark.skipif(not quantized_linear_available(),
                                reason="the quantized kernel needs the extension and AVX2 or AVX-512")

# every supported format in one file, as a Q4_K_M download mixes them (and Q4_0 / Q4_1 / Q8_0 files)
MIXED = {"attn_q": "Q4_K", "attn_k": "Q6_K", "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q8_0", "output": "Q6_K"}
# the other formats a Q2_K .. Q5_K_M download holds (each decoded into the 4- or 8-bit layout that holds it)
MIXED_LOW = {"attn_q": "Q5_K", "attn_k": "Q3_K", "attn_v": "Q2_K", "attn_output": "Q5_0", "ffn_gate": "Q5_1",
             "ffn_up": "Q2_K", "ffn_down": "Q3_K", "token_embd": "Q5_K", "output": "Q5_0"}


def projections(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear) and n != "output"}


@pytest.mark.parametrize("tied,formats", [(False, MIXED), (True, MIXED), (False, MIXED_LOW), (True, MIXED_LOW)],
                         ids=["untied", "tied", "untied-low-bit", "tied-low-bit"])
def test_mixed_format_gguf_loads_quantized_with_the_fp32_logits(tmp_path, monkeypatch, tied, formats):
    monkeypatch.setenv("HYDRA_KERNELS_CACHE", str(tmp_path / "cache"))
    # widths that are multiples of 256 (K-quant super-blocks), GQA 2
    hf = make_hf("gqa3-tied" if tied else "mha-untied", seed=5, hidden_size=256, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=512)
    held = write_gguf(hf, tmp_path / "mixed.gguf", quantise=formats)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(held[n])
    q, _ = hk.load_model(tmp_path / "mixed.gguf", device="cpu")  # the default on this CPU: quantized
    f, _ = hk.load_model(tmp_path / "mixed.gguf", device="cpu", weights="fp32")
    for name, mod in projections(q).items():
        assert mod.released and isinstance(mod._panels, QuantizedPanels) and mod.weight.is_meta, name
    assert isinstance(q.output.packed_weight(), QuantizedPanels)
    assert q.config.tie_word_embeddings == tied
    # the embedding and the LM head as stored, no fp32 table (tied: one set of panels is both; untied: each its
    # own, in its own format: model/quantized_embedding.py)
    assert q.output.weight.is_meta and q.output.released and isinstance(q.tok_embeddings, QuantizedEmbedding)
    assert (q.tok_embeddings.panels is q.output.packed_weight()) == tied
    assert not any(p.numel() >= q.config.vocab_size * q.config.hidden_size and not p.is_meta for p in q.parameters())
    assert torch.equal(q.lm_head_weight(), f.output.weight) and torch.equal(q.embedding_weight(), f.tok_embeddings.weight)
    some = torch.tensor([100, 0, 7, 7])
    assert torch.equal(q.lm_head_rows(some), f.output.weight[some])
    assert torch.equal(q.tok_embeddings(some[None]), f.tok_embeddings(some[None]))
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lq = q(ids)
        if packed_linear_available():  # bit for bit: the same values, the same FMA order
            assert torch.equal(lq, f(ids))
        else:  # AVX2 only: the fp32 model runs MKL (another summation order)
            assert_close_rel(lq, f(ids), 1e-4, "quantized vs fp32 (MKL)")
        assert_close_rel(lq, hf(ids).logits, 1e-4, "quantized GGUF vs transformers")
    prompts = [[5, 7, 9, 11], [3, 1]]
    plain_f = generate(f, prompts, max_new_tokens=12).sequences
    with monkeypatch.context() as m:  # decoding reads rows, never the whole table
        m.setattr(QuantizedPanels, "dequantize", lambda self: pytest.fail("a whole vocabulary table was built"))
        assert generate(q, prompts, max_new_tokens=12).sequences == plain_f
        for kind in ("ngram", "hydra"):  # a head drafter reads the LM head's rows (TiedLMHead)
            d = hk.new_drafter(q, kind=kind)
            spec = generate(q, prompts, max_new_tokens=12, drafter=d,
                            budget=max(d.budget_levels(d.resolve_tree(None, "cpu"))))  # its whole tree every step
            assert spec.sequences == plain_f and (kind == "ngram" or max(spec.step_nodes) > 1), kind
    # the layout survives a second packing pass and a no-op move: no fp32 copy comes back
    q.use_packed_cpu_weights()
    q.to("cpu").float()
    assert isinstance(q.output.packed_weight(), QuantizedPanels) and q.output.weight.is_meta
    assert q.tok_embeddings.panels is not None and q.tok_embeddings.weight.is_meta  # the embedding too
    assert all(m.released and isinstance(m._panels, QuantizedPanels) for m in projections(q).values())
    with torch.no_grad():
        assert torch.equal(q(ids), lq)


def test_a_format_the_kernel_does_not_decode_loads_as_fp32_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRA_KERNELS_CACHE", str(tmp_path / "cache"))
    hf = make_hf("mha-untied", seed=7, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512)
    held = write_gguf(hf, tmp_path / "iq.gguf", quantise={**MIXED, "ffn_down": "IQ4_NL"})  # a non-affine 4-bit code
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(held[n])
    with pytest.warns(UserWarning, match=r"iq.gguf: weights in IQ4_NL are not decoded .* load as fp32 \(2 MB\)"):
        q, _ = hk.load_model(tmp_path / "iq.gguf", device="cpu")
    down = q.layers[0].feed_forward.w2
    assert not isinstance(down._panels, QuantizedPanels) and isinstance(q.layers[0].attention.wqkv._panels,
                                                                          QuantizedPanels)
    ids = torch.randint(0, 101, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close_rel(q(ids), hf(ids).logits, 1e-4, "IQ4_NL down projections as fp32")


def test_bad_weights_choice_is_refused_before_loading(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRA_KERNELS_CACHE", str(tmp_path / "cache"))
    hf = make_hf("mha-untied", seed=11, hidden_size=64, num_key_value_heads=2, intermediate_size=96)
    write_gguf(hf, tmp_path / "tiny.gguf")
    with pytest.raises(ValueError, match="weights must be 'quantized'"):
        hk.load_model(tmp_path / "tiny.gguf", device="cpu", weights="int3")
    with pytest.raises(ValueError, match="dtype=torch.bfloat16"):
        hk.load_model(tmp_path / "tiny.gguf", device="cpu", dtype="bf16", weights="quantized")
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="needs a .gguf path"):
        hk.load_model(tmp_path / "hf", device="cpu", weights="quantized")
    assert not (tmp_path / "cache").exists()  # refused before any conversion


@pytest.fixture(scope="module")
def smollm2_pair():
    q, tok = hk.load_model(device="cpu")
    f, _ = hk.load_model(device="cpu", weights="fp32")
    return q, f, tok


def test_embedded_smollm2_is_quantized_by_default_and_decodes_as_fp32(smollm2_pair):
    from hydra_kernels.chat import chat_prompt_ids

    q, f, tok = smollm2_pair
    mods = projections(q)
    assert len(mods) == 4 * q.config.num_layers and all(isinstance(m._panels, QuantizedPanels) for m in mods.values())
    # one copy of the projections, as 4-bit blocks: 6 bits a weight (fp32 scale and offset per 32) vs 32
    qbytes = sum(m._panels.nbytes for m in mods.values())
    fbytes = sum(m.unpacked_weight().numel() * 4 for m in list(mods.values())[:4]) * q.config.num_layers
    assert qbytes < 0.2 * fbytes
    prompts = [chat_prompt_ids(tok, "Write a haiku about the sea."), tok.encode("def fib(n):")]
    with torch.no_grad():
        ids = torch.tensor([prompts[0]])
        assert torch.equal(q(ids), f(ids)) or not packed_linear_available()
    plain_q = generate(q, prompts, max_new_tokens=24)
    assert plain_q.sequences == generate(f, prompts, max_new_tokens=24).sequences
    spec = generate(q, prompts, drafter=hk.load_drafter(model=q), max_new_tokens=24)
    assert spec.sequences == plain_q.sequences


def test_embedded_smollm2_never_builds_the_fp32_vocabulary_table(smollm2_pair, monkeypatch):
    """The tied embedding / LM head stays Q8_0 panels only (model/quantized_embedding.py: 113 MB of fp32 table
    not held, issue 44's peak memory): loading, plain decoding and the default drafter drafting every step
    read rows, never the whole table; the rows are the fp32 model's."""
    from hydra_kernels.chat import chat_prompt_ids

    q, f, tok = smollm2_pair
    assert isinstance(q.tok_embeddings, QuantizedEmbedding) and q.output.weight.is_meta and q.output.released
    monkeypatch.setattr(QuantizedPanels, "dequantize", lambda self: pytest.fail("the whole table was built"))
    ids = torch.tensor([[0, 5, 49151, 17]])
    assert torch.equal(q.tok_embeddings(ids), f.tok_embeddings(ids))
    assert torch.equal(q.lm_head_rows(ids[0]), f.output.weight[ids[0]])
    prompts = [chat_prompt_ids(tok, "Write a haiku about the sea.")]
    plain = generate(q, prompts, max_new_tokens=16)
    d = hk.load_drafter(model=q)
    spec = generate(q, prompts, drafter=d, max_new_tokens=16, budget=max(d.budget_levels(d.resolve_tree(None, "cpu"))))
    assert spec.sequences == plain.sequences and max(spec.step_nodes) > 1  # it drafted


def test_drafters_read_the_quantized_heads_rows_of_their_draft_vocabulary(smollm2_pair):
    """With a quantized LM head, the tied draft-vocabulary logits of the heads (and Amphista / MLPSpeculator,
    the same TiedLMHead) run on the head's own Q8_0 rows (QuantizedPanels.select_rows): the quantized head's
    logits of those tokens bit for bit, not bf16-rounded rows; an fp32 model keeps its bf16 panels."""
    q, f, _ = smollm2_pair
    d = hk.load_drafter(model=q).heads
    vocab = d.draft_vocab
    assert vocab is not None and q.lm_head_quantized() is not None and f.lm_head_quantized() is None
    h = torch.randn(3, q.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = d._tied.packed_logits(q, vocab, h)
        assert torch.equal(got, q.lm_head_quantized().linear(h)[:, vocab])
        assert isinstance(d._tied._panels._value, QuantizedPanels)
        assert d._tied._panels._value.nbytes < 0.6 * vocab.numel() * q.config.hidden_size * 2  # < bf16's bytes
        fp = hk.load_drafter(model=f).heads
        assert isinstance(fp._tied.packed_logits(f, fp.draft_vocab, h), torch.Tensor)
        assert fp._tied._panels._value.dtype is torch.bfloat16


def test_loading_a_drafter_with_its_model_builds_its_lm_head_rows(smollm2_pair, monkeypatch):
    """load_drafter(model=...) builds the tied rows (Drafter.prepare) under grad mode as a user script has it,
    so no run builds them again, and changes nothing a method computes: its Linear layers stay on F.linear until
    a run's start() (the evaluation path, Drafter.logits, is the fp32 one). The combined drafter prepares its
    heads. Without a model nothing is built."""
    from hydra_kernels.drafters import fit
    from hydra_kernels.model.packed_linear import Linear

    q, _, _ = smollm2_pair
    for kind in ("hydra", "amphista", "mlp_speculator", "combined"):
        with torch.enable_grad():  # as in a user's script
            d = hk.load_drafter(kind=kind, model=q)
        owner = d.heads if kind == "combined" else d
        tied = owner.base_head if kind == "mlp_speculator" else owner._tied
        if kind == "mlp_speculator" and not owner.config.tie_base:
            continue
        assert isinstance(tied._panels._value, QuantizedPanels), kind
        assert not any(m.packed_on for m in d.modules() if isinstance(m, Linear)), kind
        monkeypatch.setattr(fit, "pack_lm_head_rows", lambda *a: pytest.fail("rows built again"))
        monkeypatch.setattr(QuantizedPanels, "select_rows", lambda *a: pytest.fail("rows built again"))
        with torch.no_grad():
            d.start(q, 1, 64, d.resolve_tree(None, "cpu"), q.backend_plan())
        monkeypatch.undo()
    bare = hk.load_drafter(kind="hydra")
    assert bare._tied._panels._value is None


def test_drafters_build_their_lm_head_rows_when_a_run_starts(smollm2_pair, monkeypatch):
    """The tied rows a drafter ranks with (heads, Amphista, a base-tied MLPSpeculator) are built in start(), not
    in the first drafting step: the adaptive budget times a step's drafting as its part's cost, and a ~25 ms
    one-time build there kept the heads held back (adaptive.py's gates). No draft runs here (propose would fail)."""
    from hydra_kernels.drafters import fit

    q, _, _ = smollm2_pair
    backends = q.backend_plan()
    for kind in ("hydra", "amphista", "mlp_speculator"):
        d = hk.load_drafter(kind=kind, model=q)
        tied = d.base_head if kind == "mlp_speculator" else d._tied
        if kind == "mlp_speculator" and not d.config.tie_base:
            continue
        tied._panels.clear()
        with torch.no_grad():
            d.start(q, 1, 64, d.resolve_tree(None, "cpu"), backends)
        assert isinstance(tied._panels._value, QuantizedPanels), kind
        monkeypatch.setattr(fit, "pack_lm_head_rows", lambda *a: pytest.fail("rows built again"))
        monkeypatch.setattr(QuantizedPanels, "select_rows", lambda *a: pytest.fail("rows built again"))
        h = torch.randn(2, q.config.hidden_size)
        with torch.no_grad():
            tied.packed_logits(q, d.draft_vocab, h)  # the first draft's read: built already
        monkeypatch.undo()
