"""The native plain greedy step (csrc/plain_step_cpu.cpp, model/plain_step.py): one call per step gives the module
path's tokens and final hidden states (Llama.step + KVCache.advance + Llama.greedy_tokens), KV cache and seqlens bit
for bit, on fp32 and quantized layers, an fp32 or quantized (tied) embedding and LM head, batch 1 and a ragged batch
of 3, GQA shapes; torch.argmax's tie and NaN rules; bad input and weights that do not fit refused before anything is
written; the cases it does not take (another backend, autograd, forward hooks, a renormalizing embedding, a norm with
its own forward, a head bias) keep the module path; generate() runs it for greedy plain decoding and the plain steps
of a greedy speculative run (same tokens on the embedded model), never for sampling nor for a run that captures
layers (EAGLE-3). Its run on the AVX2 kernels: tests/test_cpu_isa_limit.py."""
import pytest
import torch

import hydra_kernels as hk

from hydra_kernels.generate import generate
import hydra_kernels.generate as generate_module
from hydra_kernels.model import plain_step
from hydra_kernels.model.layers import RMSNorm
from hydra_kernels.model.packed_linear import Linear, packed_linear_available
from hydra_kernels.model.quantized_embedding import QuantizedEmbedding
from hydra_kernels.chat import chat_prompt_ids
from test_decode_stack import model_of
from test_quantized_linear import panels_of, random_blocks

pytestmark = pytest.mark.skipif(plain_step.PLAIN_GREEDY_STEP is None or not packed_linear_available(),
                                reason="the extension's plain_greedy_step and the packed CPU kernel (AVX-512)")

V = 97  # model_of's vocabulary


def with_quantized_head(m, tied: bool, seed: int):
    """m's LM head on Q8_0-like panels; tied: the embedding reads the same panels (the embedded GGUF's layout),
    else an untied Q4_1-like table of its own."""
    gen = torch.Generator().manual_seed(seed)
    H = m.config.hidden_size
    head = panels_of(random_blocks(V, H, 32, 8, False, gen), half=True)
    m.output.use_quantized(head)
    m.tok_embeddings = QuantizedEmbedding(head if tied else panels_of(random_blocks(V, H, 32, 4, True, gen), half=True))
    return m


def two_prefilled(m):
    """A cache of 16 rows with two prompts of 3 and 2 tokens prefilled (the bad-input and opcheck tests' state)."""
    cache = m.new_kv_cache(2, 16)
    m.prefill(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([3, 2], dtype=torch.int32), cache)
    return cache


def decode(m, B: int, steps: int, native: bool, forced=None, commit: bool = True, attend=None):
    """Prefill a ragged batch (NaN-poisoned cache), then `steps` plain greedy steps on the native step or the module
    path. forced [steps, B]: the tokens fed after each step (both paths then see the same inputs even where their
    outputs would differ). Returns (each step's tokens [steps, B], final hidden states [steps, B, H], the cache's kv,
    seqlens). commit=False steps (a speculative run's) advance seqlens after the step, as the caller does. attend: the
    native step's (int64 [B]: 0 skips that sequence's attention)."""
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([9, 5, 7][:B], dtype=torch.int32)
    cache = m.new_kv_cache(B, 40)
    cache.kv.fill_(float("nan"))  # rows a step writes are read back; the others must never be read
    h = m.prefill(torch.randint(0, V, (B, 9), generator=gen), lengths, cache)
    nxt = m.greedy_tokens(h, "native")
    step = plain_step.native_plain_step(m, cache, "native") if native else None
    assert (step is not None) == native
    kv_len, out, hiddens = int(lengths.max()), [], []
    for i in range(steps):
        kv_len += 1
        if native:
            nxt, hidden = step(nxt, kv_len, commit, attend)
            if not commit:
                cache.advance(1)
        else:
            hidden = m.step(nxt[:, None], cache, kv_len=kv_len, backends="native")[:, -1]
            cache.advance(1)
            nxt = m.greedy_tokens(hidden, "native")
        out.append(nxt.clone())
        hiddens.append(hidden.clone())
        if forced is not None:
            nxt = forced[i].clone()
    return torch.stack(out), torch.stack(hiddens), cache.kv.clone(), cache.seqlens.clone()


def assert_same_decoding(m, B: int, steps: int = 6, commit: bool = True):
    want = decode(m, B, steps, native=False)
    got = decode(m, B, steps, native=True, forced=want[0], commit=commit)
    assert torch.equal(got[0], want[0]), f"tokens {got[0].T.tolist()} != {want[0].T.tolist()}"
    assert torch.isfinite(got[1]).all() and torch.equal(got[1], want[1])
    assert torch.equal(got[2].nan_to_num(7.0), want[2].nan_to_num(7.0))
    assert torch.equal(got[3], want[3])


@pytest.mark.parametrize("quantized", [False, "a", "b"])
@pytest.mark.parametrize("B,bias", [(1, False), (3, True)])
def test_native_step_is_the_module_path_bit_for_bit(quantized, B, bias):
    assert_same_decoding(model_of(quantized, bias, seed=B), B)


@pytest.mark.parametrize("commit", [True, False])
def test_a_finished_sequence_skips_its_attention_and_changes_nothing_else(commit):
    """attend 0 for a finished sequence (plain decoding's and a speculative run's plain steps, once one has finished):
    its attention is skipped, so its tokens and hidden states move (finite), and every other sequence's tokens, hidden
    states and cache rows are the module path's bit for bit, its own prompt rows untouched. The same tokens fed to both
    paths after each step (forced), since the skipped sequence's own choices differ."""
    m = model_of("a", True, seed=33)
    forced = torch.randint(0, V, (6, 3), generator=torch.Generator().manual_seed(4))
    want = decode(m, 3, 6, native=False, forced=forced)
    attend = torch.tensor([1, 0, 1])
    got = decode(m, 3, 6, native=True, forced=forced, commit=commit, attend=attend)
    live = attend > 0
    assert torch.equal(got[0][:, live], want[0][:, live]) and torch.equal(got[1][:, live], want[1][:, live])
    assert torch.isfinite(got[1]).all() and not torch.equal(got[1][:, 1], want[1][:, 1])  # the skip ran
    kv_got, kv_want = got[2].nan_to_num(7.0), want[2].nan_to_num(7.0)
    assert torch.equal(kv_got[:, :, live], kv_want[:, :, live])
    assert torch.equal(kv_got[:, :, 1, :5], kv_want[:, :, 1, :5])  # the finished sequence's prompt rows
    assert torch.equal(got[3], want[3])
    with pytest.raises(RuntimeError, match="attend must be int64"):
        plain_step.native_plain_step(m, two_prefilled(m), "native")(torch.tensor([1, 2]), 8, True, torch.ones(2))


def test_without_commit_the_caller_commits():
    assert_same_decoding(model_of("a", False, seed=4), 3, commit=False)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("B", [1, 3])
def test_quantized_head_and_embedding(tied, B):
    assert_same_decoding(with_quantized_head(model_of("a", False, seed=5), tied, seed=5), B)


@pytest.mark.parametrize("hidden,heads,kv_heads", [(40, 5, 1), (60, 6, 3)])
def test_awkward_shapes(hidden, heads, kv_heads):
    assert_same_decoding(model_of("b", False, seed=7, hidden=hidden, heads=heads, kv_heads=kv_heads), 3, steps=4)


def test_ties_and_nans_follow_torch_argmax():
    """A head whose rows tie (zeros, two equal rows) picks the first maximum; a NaN logit wins, as in torch.argmax."""
    m = model_of(False, False, seed=9)
    w = m.output.weight
    w.zero_()
    w[[3, 8]] = torch.randn(w.shape[1], generator=torch.Generator().manual_seed(0))
    assert_same_decoding(m, 3, steps=3)
    tokens = decode(m, 3, 2, native=True)[0]
    assert set(tokens.flatten().tolist()) <= {0, 3}  # every row is a tie: its first member
    w[50, 5] = float("nan")
    assert_same_decoding(m, 3, steps=3)
    assert (decode(m, 3, 2, native=True)[0] == 50).all()


def test_bad_input_is_refused_before_anything_is_written():
    m = model_of("a", False, seed=1)
    cache = two_prefilled(m)
    step = plain_step.native_plain_step(m, cache, "native")
    kv, lens = cache.kv.clone(), cache.seqlens.clone()

    def unchanged():
        assert torch.equal(cache.kv, kv) and torch.equal(cache.seqlens, lens)

    with pytest.raises(RuntimeError, match=r"token 97 of sequence 1 outside the embedding's \[0, 97\)"):
        step(torch.tensor([5, 97]), 4)
    unchanged()
    with pytest.raises(RuntimeError, match="must lie in"):  # kv_len below seqlens + 1
        step(torch.tensor([5, 6]), 3)
    unchanged()
    with pytest.raises(RuntimeError, match="int64"):
        step(torch.tensor([5, 6], dtype=torch.int32), 4)
    unchanged()
    assert step(torch.tensor([5, 6]), 4)[0].shape == (2,)  # the good case runs and commits one row each
    assert cache.seqlens.tolist() == [4, 3]


def test_bad_weights_and_positions_are_refused_before_anything_is_written():
    """A head or embedding whose panels do not fit vocab and H, a layer's quantized weight that does not fit its
    projection, and a position past the RoPE table, are refused by the op before the stack writes a cache row."""
    m = with_quantized_head(model_of("a", False, seed=6), tied=True, seed=6)
    cache = two_prefilled(m)
    kv, lens = cache.kv.clone(), cache.seqlens.clone()
    weights, kinds, biases, norms, eps = plain_step.stack_weights(m, 2)
    a, f = m.layers[0].attention, m.layers[0].feed_forward
    emb, head = plain_step.embedding_spec(m.tok_embeddings), m.output.step_weights(2)
    cos, sin = m._rope.table(16, m.device)
    narrow = panels_of(random_blocks(V, 32, 32, 8, False, torch.Generator().manual_seed(1)), half=True)

    def call(emb=emb, head=head, vocab=V, cos=cos, sin=sin, weights=weights):
        return torch.ops.hydra_kernels.plain_greedy_step(
            torch.tensor([5, 6]), *emb, weights, kinds, biases, norms, eps, a.n_heads, a.n_kv_heads, f.inter,
            m.norm.weight, m.norm.eps, *head, vocab, cos, sin, cache.kv, cache.seqlens, 8)

    swapped = list(weights)  # layer 1's wqkv where its w2 goes: quantized panels of the wrong shape for their place
    swapped[7] = weights[4]
    for bad, match in [(dict(vocab=V + 64), "does not match"), (dict(head=(narrow.packed, narrow.kind)), "inputs a row"),
                       (dict(weights=swapped), "does not match|inputs a row|does not fit"),
                       (dict(emb=(narrow.packed, narrow.kind, V)), "inputs a row"),
                       (dict(emb=(emb[0], emb[1], V + 64)), "does not match"),
                       (dict(head=(torch.zeros(2, 48, 64), 0)), "LM head must be packed panels"),
                       (dict(cos=cos[:3], sin=sin[:3]), "outside the RoPE table")]:
        with pytest.raises(RuntimeError, match=match):
            call(**bad)
        assert torch.equal(cache.kv, kv) and torch.equal(cache.seqlens, lens)
    assert call()[0].shape == (2,)


class _OwnNorm(RMSNorm):
    def forward(self, x):
        return super().forward(x) * 2


def test_cases_it_does_not_take_keep_the_module_path():
    m = model_of(False, False, seed=2)
    cache = m.new_kv_cache(1, 16)
    assert plain_step.native_plain_step(m, cache, "native") is not None
    assert plain_step.native_plain_step(m, cache, "reference") is None  # another attention backend
    with torch.enable_grad():
        assert plain_step.native_plain_step(m, cache, "native") is None  # autograd
    hook = m.output.register_forward_hook(lambda mod, args, out: out)
    assert plain_step.native_plain_step(m, cache, "native") is None  # a hook on the LM head's forward
    hook.remove()
    m.tok_embeddings.max_norm = 1.0  # an embedding that renormalizes its rows
    assert plain_step.native_plain_step(m, cache, "native") is None
    m.tok_embeddings.max_norm = None
    own = _OwnNorm(m.config.hidden_size, m.norm.eps)
    own.weight = m.norm.weight
    m.norm = own  # a norm with its own forward
    assert plain_step.native_plain_step(m, cache, "native") is None
    m.output.bias = torch.nn.Parameter(torch.zeros(V), requires_grad=False)
    assert plain_step.native_plain_step(m, cache, "native") is None  # a head with a bias
    m = model_of(False, False, seed=2)
    for mod in m.modules():  # F.linear layers (packed_kernel_off): no panels to run
        if isinstance(mod, Linear):
            mod.restore_original()
            mod.packed_on = False
    assert plain_step.native_plain_step(m, m.new_kv_cache(1, 16), "native") is None


def test_op_passes_torch_library_opcheck():
    """Schema (kv and seqlens written in place, nothing else) and the fake kernel."""
    m = with_quantized_head(model_of("a", True, seed=2), tied=True, seed=2)
    cache = two_prefilled(m)
    weights, kinds, biases, norms, eps = plain_step.stack_weights(m, 2)
    a, f = m.layers[0].attention, m.layers[0].feed_forward
    emb, head = plain_step.embedding_spec(m.tok_embeddings), m.output.step_weights(2)
    cos, sin = m._rope.table(16, m.device)
    args = (torch.tensor([5, 6]), *emb, weights, kinds, biases, norms, eps, a.n_heads, a.n_kv_heads, f.inter,
            m.norm.weight, m.norm.eps, *head, V, cos, sin, cache.kv, cache.seqlens, 8)
    torch.library.opcheck(torch.ops.hydra_kernels.plain_greedy_step.default, args)
    torch.library.opcheck(torch.ops.hydra_kernels.plain_greedy_step.default, (*args, False, torch.tensor([1, 0])))


def test_generate_runs_it_for_greedy_plain_decoding(smollm2, monkeypatch):
    """The embedded model: the same tokens as the module path for a ragged batch (the steps after one answer ends skip
    its attention: attend given, with a 0); one native call per step; sampling never calls it."""
    model, tok = smollm2
    prompts = [chat_prompt_ids(tok, q) for q in ("Name three rivers in Africa.", "What is 17*23? Explain.")]
    calls = []
    real = plain_step.PLAIN_GREEDY_STEP

    def counting(*a):
        calls.append(a[-1])  # attend
        return real(*a)

    monkeypatch.setattr(plain_step, "PLAIN_GREEDY_STEP", counting)
    got = generate(model, prompts, max_new_tokens=24)
    assert len(calls) == got.num_steps > 0
    assert calls[0] is None and calls[-1].tolist() in ([0, 1], [1, 0])  # the finished answer's attention skipped
    monkeypatch.setattr(generate_module, "native_plain_step", lambda *a: None)
    want = generate(model, prompts, max_new_tokens=24)
    assert got.sequences == want.sequences
    assert min(map(len, want.sequences)) < 24  # one answer ends early: later steps carry a finished row
    monkeypatch.undo()
    monkeypatch.setattr(plain_step, "PLAIN_GREEDY_STEP", counting)
    calls.clear()  # a greedy speculative run's plain steps (the adaptive budget runs some here)
    spec = generate(model, prompts, drafter=hk.load_drafter(model=model), max_new_tokens=24, budget="adaptive")
    assert spec.sequences == want.sequences
    assert len(calls) == spec.step_nodes.count(1) > 0
    monkeypatch.undo()
    monkeypatch.setattr(plain_step, "PLAIN_GREEDY_STEP", lambda *a: pytest.fail("a sampled run took the greedy step"))
    generate(model, prompts[:1], max_new_tokens=4, temperature=0.8, seed=1)


@pytest.mark.parametrize("kind", [None, "amphista", "eagle"])
def test_a_speculative_runs_plain_steps_keep_every_record_of_the_module_path(smollm2, monkeypatch, kind):
    """The speculative loop's plain steps on the native step, with every sequence active (speculative.
    _native_plain_greedy_step: the step commits, the drafter's after_plain_step) and after one sequence finished (the
    general path), against the same run on the module path: the same tokens, steps, per-sequence records and
    acceptance by depth. The shipped default drafter, the shipped Amphista heads and an EAGLE layer (untrained: the two
    whose after_plain_step holds the native step's row in their backlog) under a table that cycles plain / full / a
    subtree by context, a ragged batch of 3 whose shortest answer ends early."""
    from hydra_kernels import speculative
    from hydra_kernels.budget import BudgetTable, tree_key

    model, tok = smollm2
    prompts = [chat_prompt_ids(tok, q) for q in ("Name three rivers in Africa.", "What is 17*23? Explain.",
                                                 "Say hi.")]
    d = hk.new_drafter(model, kind="eagle") if kind == "eagle" else hk.load_drafter(model=model, kind=kind)
    bound = d.resolve_tree(None, "cpu")
    levels = d.budget_levels(bound)
    contexts = list(range(min(map(len, prompts)), max(map(len, prompts)) + 40))
    cycle = (1, levels[-1], levels[len(levels) // 2])
    d.budget_tables["cpu"] = BudgetTable(device="cpu", tree=tree_key(bound), full=bound.num_nodes, batch_sizes=[3],
                                         contexts=contexts, nodes=[[cycle[i % 3] for i in range(len(contexts))]])
    lean, real = [], speculative._native_plain_greedy_step
    monkeypatch.setattr(speculative, "_native_plain_greedy_step", lambda *a: lean.append(1) or real(*a))
    got = generate(model, prompts, drafter=d, budget="auto", max_new_tokens=30)
    monkeypatch.setattr(speculative, "native_plain_step", lambda *a: None)  # the module path, plain and verify steps
    want = generate(model, prompts, drafter=d, budget="auto", max_new_tokens=30)
    assert lean and got.step_nodes.count(1) > len(lean)  # both paths ran: a finished row came before the end
    assert min(map(len, want.sequences)) < 30 and max(map(len, want.sequences)) == 30
    for field in ("sequences", "num_steps", "step_nodes", "seq_step_nodes", "depth_drafted", "depth_accepted"):
        assert getattr(got, field) == getattr(want, field), field


def test_a_run_that_captures_layers_keeps_the_module_path(monkeypatch):
    """An EAGLE-3 drafter reads the inputs of intermediate layers, which the native step does not capture: its greedy
    speculative run never asks for the native step (and stays lossless); a drafter of final hidden states does."""
    from hydra_kernels import speculative

    m = model_of("a", False, seed=8)
    prompts = [[5, 9, 14, 3, 7], [2, 8, 1]]
    want = generate(m, prompts, max_new_tokens=10)
    asked = []
    real = speculative.native_plain_step
    monkeypatch.setattr(speculative, "native_plain_step", lambda *a: asked.append(1) or real(*a))
    eagle3 = hk.new_drafter(m, kind="eagle", feature_layers="eagle3")
    assert eagle3.feature_layers is not None
    assert generate(m, prompts, drafter=eagle3, max_new_tokens=10, budget="adaptive").sequences == want.sequences
    assert not asked
    assert generate(m, prompts, drafter=hk.new_drafter(m, kind="eagle"), max_new_tokens=10,
                    budget="adaptive").sequences == want.sequences
    assert asked

