"""Hydra's greedy drafting of a depth in one native call (csrc/hydra_head_cpu.cpp, drafters/native_heads.py): the same
guesses as HydraDrafter's module path (first_block + head_topk) bit for bit, on fp32 packed or quantized layers, an
fp32 or quantized (tied) embedding and LM head, with and without a draft vocabulary, batch 1 and 3, trees whose
depths have several parents and ranks; the cases it does not take (sampled drafts, heads of two blocks, a head's own
or shared LM head, another backend or dtype, more rows than the packed kernels take, autograd, forward hooks) keep the
module path; a strided h is taken; bad input refused before any work; opcheck; and greedy
speculative decoding through it stays plain decoding's tokens."""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.drafters import native_heads
from hydra_kernels.generate import generate
from hydra_kernels.model import plain_step
from hydra_kernels.model.packed_linear import MAX_PACKED_ROWS, packed_linear_available
from test_decode_stack import model_of
from test_drafters import randomise
from test_plain_step import V, with_quantized_head

pytestmark = pytest.mark.skipif(native_heads.HYDRA_HEAD_TOPK is None or not packed_linear_available(),
                                reason="the extension's hydra_head_topk and the packed CPU kernel (AVX-512)")

MODELS = {  # layers, embedding and LM head
    "fp32": lambda: model_of(False, False, seed=11),
    "quantized, tied Q8 head": lambda: with_quantized_head(model_of("a", True, seed=12), tied=True, seed=12),
    "quantized, untied Q4 embedding": lambda: with_quantized_head(model_of("b", False, seed=13), tied=False, seed=13),
}


def hydra_of(model, draft_vocab=True, seed=1, **kw):
    dv = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:41] if draft_vocab else None
    kw = dict(num_heads=3, num_layers=1, lm_head="tied", draft_vocab=dv) | kw
    return randomise(hk.new_drafter(model, kind="hydra", **kw), seed).eval()


REAL_OP = native_heads.HYDRA_HEAD_TOPK


def native_calls(monkeypatch) -> list:
    """Counts the native depth's calls (each one's paths shape)."""
    calls = []

    def spy(*args):
        calls.append(args[1].shape)
        return REAL_OP(*args)

    monkeypatch.setattr(native_heads, "HYDRA_HEAD_TOPK", spy)
    return calls


def module_path(monkeypatch):
    """HydraDrafter's module path from here on (the op looks absent)."""
    monkeypatch.setattr(native_heads, "HYDRA_HEAD_TOPK", None)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("draft_vocab", [True, False])
@pytest.mark.parametrize("B", [1, 3])
def test_native_depth_drafts_the_module_paths_guesses(name, draft_vocab, B, monkeypatch):
    model = MODELS[name]()
    d = hydra_of(model, draft_vocab, seed=B)
    g = torch.Generator().manual_seed(7 + B)
    h = torch.randn(B, model.config.hidden_size, generator=g)
    root = torch.randint(0, V, (B,), generator=g)
    backends = model.backend_plan(None)
    for tree in (hk.tree.default_tree(15, depth=3), hk.tree.chain(3), hk.tree.Tree([[0], [1], [2], [0, 0], [0, 1]])):
        with torch.no_grad():
            calls = native_calls(monkeypatch)
            got = d.draft(model, h, root, tree)
            assert len(calls) == tree.depth  # every depth in one call
            n_calls = len(calls)
            _, _, got_conf = d._tokens(model, h, root, tree, backends)  # each node's probability: the policy's signal
            assert len(calls) == n_calls + tree.depth  # natively
            module_path(monkeypatch)
            want = d.draft(model, h, root, tree)
            _, _, want_conf = d._tokens(model, h, root, tree, backends)
        assert torch.equal(got, want) and torch.equal(got_conf, want_conf)
        assert (got[:, 1:] != 0).any()  # real guesses, not an untouched buffer
        assert (got_conf[:, 0] == 1).all() and ((got_conf >= 0) & (got_conf <= 1)).all()


def test_guesses_of_each_depth_match_first_block_and_head_topk_directly():
    """native_head_topk against the module functions it replaces, on paths of every depth, k 1 and 4, n 1 and 5."""
    model = MODELS["quantized, tied Q8 head"]()
    d = hydra_of(model)
    backends = model.backend_plan(None)
    d.use_packed_cpu_weights(backends.packed_linear)
    g = torch.Generator().manual_seed(5)
    h = torch.randn(2, model.config.hidden_size, generator=g)
    with torch.no_grad():
        for head in range(3):
            for n, k in [(1, 1), (5, 4), (2, 1)]:
                paths = torch.randint(0, V, (2, n, head + 1), generator=g)
                got = native_heads.native_head_topk(d, model, head, h, paths, k, backends)
                hidden = d.heads[head].infer(d.first_block(model, head, h, paths, backends), backends, first=1)
                want = d.head_guesses(model, head, hidden, k, backends)
                assert got is not None and got[0].shape == got[1].shape == (2, n, k)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                assert torch.equal(got[0], d.head_topk(model, head, hidden, k, backends))


@pytest.mark.parametrize("name", ["quantized, tied Q8 head", "quantized, untied Q4 embedding"])
def test_guesses_are_the_definitions_top_k(name):
    """Against the definition (HeadDrafter.logits: the head's modules in fp32 autograd form over the base model's LM
    rows, F.linear): on heads whose weights are bf16 values (the packed panels' storage) and quantized LM rows (the
    same dequantized values), the native guesses are the top-k of the definition's logits and their probabilities the
    definition's softmax (fp32 tolerance), each depth, k 1 and 3, fresh random h and paths."""
    model = MODELS[name]()
    d = hydra_of(model, seed=9)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(p.bfloat16().float())
    backends = model.backend_plan(None)
    d.use_packed_cpu_weights(backends.packed_linear)
    g = torch.Generator().manual_seed(21)
    h = torch.randn(3, model.config.hidden_size, generator=g)
    for head in range(3):
        for n, k in [(1, 1), (4, 3)]:
            paths = torch.randint(0, V, (3, n, head + 1), generator=g)
            with torch.no_grad():
                got = native_heads.native_head_topk(d, model, head, h, paths, k, backends)
                x = torch.cat([h[:, None, :].expand(3, n, -1), model.tok_embeddings(paths).flatten(2)], dim=-1)
            with torch.enable_grad():  # the training path: F.linear on the fp32 weights, not the packed kernels
                logits = d.logits(model, head, x).detach()  # [3, n, draft vocabulary]
            assert got is not None
            top = logits.topk(k, dim=-1)
            assert torch.equal(got[0], d.token_ids(top.indices))
            torch.testing.assert_close(got[1], logits.softmax(-1).gather(-1, top.indices), rtol=1e-5, atol=1e-6)


def test_cases_it_does_not_take_keep_the_module_path(monkeypatch):
    model = MODELS["fp32"]()
    backends = model.backend_plan(None)
    h, paths = torch.randn(1, model.config.hidden_size), torch.tensor([[[3]]])
    two_blocks = hydra_of(model, num_layers=2)
    own_head = hydra_of(model, draft_vocab=False, lm_head="per_head")
    shared_head = hydra_of(model, draft_vocab=False, lm_head="shared")
    plain = hydra_of(model)
    for d in (two_blocks, own_head, shared_head, plain):
        d.use_packed_cpu_weights(backends.packed_linear)
    with torch.no_grad():
        for d in (two_blocks, own_head, shared_head):
            assert native_heads.native_head_topk(d, model, 0, h, paths, 1, backends) is None
        assert native_heads.native_head_topk(plain, model, 0, h, paths, 1, model.backend_plan("reference")) is None
        assert native_heads.native_head_topk(plain, model, 0, h.double(), paths, 1, backends) is None
        many = torch.randint(0, V, (1, MAX_PACKED_ROWS + 1, 1))  # more rows than the packed kernels take
        assert native_heads.native_head_topk(plain, model, 0, h, many, 1, backends) is None
        blk = plain.heads[0].blocks[0]
        for mod in (blk, blk.linear, blk.res_connection, model.tok_embeddings):  # a hook the native call would skip
            handle = mod.register_forward_hook(lambda *a: None)
            assert native_heads.native_head_topk(plain, model, 0, h, paths, 1, backends) is None
            handle.remove()
        assert native_heads.native_head_topk(plain, model, 0, h, paths, 1, backends) is not None
        wide = torch.randn(3, 2 * model.config.hidden_size)[:, ::2]  # a strided h (a view of hidden states)
        for x, y in zip(native_heads.native_head_topk(plain, model, 0, wide, paths.expand(3, 1, 1), 1, backends),
                        native_heads.native_head_topk(plain, model, 0, wide.contiguous(), paths.expand(3, 1, 1), 1,
                                                      backends)):
            assert torch.equal(x, y)
    with torch.enable_grad():  # training: autograd through the modules
        assert native_heads.native_head_topk(plain, model, 0, h, paths, 1, backends) is None
    # sampled drafts draw from q: the module path (HydraDrafter._tokens never asks)
    calls = native_calls(monkeypatch)
    plain.draft_temperature = 0.7
    state = plain.start(model, 1, 32, hk.tree.chain(2), backends)
    state.h = h
    with torch.no_grad():
        plain.propose(state, torch.tensor([3]), torch.tensor([4], dtype=torch.int32))
    assert not calls


def op_args(model, d, head=0, n=2):
    backends = model.backend_plan(None)
    d.use_packed_cpu_weights(backends.packed_linear)
    blk = d.heads[head].blocks[0]
    h = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    paths = torch.randint(0, V, (2, n, head + 1), generator=torch.Generator().manual_seed(2))
    return dict(h=h, paths=paths, emb=plain_step.embedding_spec(model.tok_embeddings),
                lin=blk.linear.step_weights(2 * n), b_lin=blk.linear.bias, res=blk.res_connection.step_weights(2 * n),
                b_res=blk.res_connection.bias, lm=native_heads.tied_rows_spec(d, model)[:2],
                vocab=d.draft_vocab.numel(), ids=d.draft_vocab, k=2)


def call(a):
    return torch.ops.hydra_kernels.hydra_head_topk(a["h"], a["paths"], *a["emb"], *a["lin"], a["b_lin"], *a["res"],
                                                   a["b_res"], *a["lm"], a["vocab"], a["ids"], a["k"])


def test_bad_input_is_refused_with_what_is_wrong():
    model = MODELS["quantized, tied Q8 head"]()
    d = hydra_of(model)
    good = op_args(model, d)
    ids, probs = call(good)
    assert ids.shape == probs.shape == (2, 2, 2) and probs.dtype == torch.float32
    assert ((probs >= 0) & (probs <= 1)).all() and (probs[..., 0] >= probs[..., 1]).all()  # best first
    wrong_depth = op_args(model, d, head=1)  # head 1's block reads 3 H inputs
    for bad, match in [(dict(paths=good["paths"].clone().fill_(V)), "outside the embedding"),
                       (dict(paths=good["paths"][0]), "paths must be"),
                       (dict(h=good["h"].double()), "h must be contiguous fp32"),
                       (dict(k=0), "k must be in"), (dict(k=good["vocab"] + 1), "k must be in"),
                       (dict(lin=wrong_depth["lin"]), "w_lin must be packed panels"),
                       (dict(b_res=torch.zeros(3)), "b_res must be"),
                       (dict(ids=good["ids"][:-1]), "vocab_ids must be"),
                       (dict(vocab=good["vocab"] + 64), "does not match"),  # the LM rows' panels hold fewer rows
                       (dict(emb=(good["emb"][0], good["emb"][1], V + 64)), "does not match"),
                       (dict(emb=(torch.zeros(V, 32), -1, V)), "an fp32 embedding must be contiguous \\[V, H = 64\\]")]:
        with pytest.raises(RuntimeError, match=match):
            call(good | bad)


def test_op_passes_torch_library_opcheck():
    model = MODELS["fp32"]()
    a = op_args(model, hydra_of(model))
    torch.library.opcheck(torch.ops.hydra_kernels.hydra_head_topk.default,
                          (a["h"], a["paths"], *a["emb"], *a["lin"], a["b_lin"], *a["res"], a["b_res"], *a["lm"],
                           a["vocab"], a["ids"], a["k"]))


def test_greedy_speculative_decoding_through_it_is_plain_decoding(monkeypatch):
    model = MODELS["quantized, tied Q8 head"]()
    d = hydra_of(model, seed=3)
    prompts = [[5, 9, 2, 44, 17], [8, 1, 60]]
    with torch.no_grad():
        want = generate(model, prompts, max_new_tokens=24).sequences
        calls = native_calls(monkeypatch)
        got = generate(model, prompts, drafter=d, tree=hk.tree.default_tree(7, depth=3), max_new_tokens=24)
    assert calls and got.sequences == want
