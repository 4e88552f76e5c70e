"""The native greedy verify step (csrc/tree_step_cpu.cpp, model/tree_step.py): one call per drafted step gives
speculative.greedy_verify_step's hidden states, argmax tokens, acceptance, committed lengths, KV cache and seqlens bit
for bit: fp32 and quantized layers, a quantized tied embedding and LM head, batch 1 and a ragged batch of 3 with a
finished sequence, a shared tree, per-sequence trees of different sizes, a one-node tree, given positions, GQA shapes;
drafts planted from the model's own argmax so every accept length occurs; bad input refused before anything is
written; generate() runs it for every drafted greedy step (same tokens as the module path on the embedded model),
never for sampling nor for a run that captures layers."""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels import speculative
from hydra_kernels.chat import chat_prompt_ids
from hydra_kernels.generate import generate, plan_backends
from hydra_kernels.model import plain_step, tree_step
from hydra_kernels.ops import reference
from hydra_kernels.model.packed_linear import packed_linear_available
from hydra_kernels.tree import Tree, TreeBatch
from helpers import random_tree
from test_decode_stack import model_of
from test_plain_step import two_prefilled, with_quantized_head

pytestmark = pytest.mark.skipif(tree_step.TREE_GREEDY_STEP is None or not packed_linear_available(),
                                reason="the extension's tree_greedy_step and the packed CPU kernel (AVX-512)")

V = 97  # model_of's vocabulary


def prefilled(m, B: int, seed: int):
    """A ragged batch prefilled into a NaN-poisoned cache (rows a step writes are read back; no other may be)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 5, 7][:B], dtype=torch.int32)
    cache = m.new_kv_cache(B, 48)
    cache.kv.fill_(float("nan"))
    h = m.prefill(torch.randint(0, V, (B, 9), generator=gen), lengths, cache)
    return cache, m.greedy_tokens(h, "native")


def clone(cache):
    c = cache.__class__.__new__(cache.__class__)
    c.__dict__.update(cache.__dict__)
    c.kv, c.seqlens, c.stack_memo = cache.kv.clone(), cache.seqlens.clone(), {}
    c.layers = c.kv.unbind(0)
    return c


NATIVE = plan_backends("native", torch.device("cpu"), packed_weights=True)


def module_step(m, cache, tokens, tree, active, positions, kv_len):
    return speculative.greedy_verify_step(m, cache, tokens, tree, active, positions=positions, kv_len=kv_len,
                                          backends=NATIVE)


def planted(m, cache, root, tree, parents, gen, kv_len, p_copy=0.7):
    """Draft tokens [B, T] under `tree` where each node copies the model's argmax after its parent with probability
    p_copy (depth by depth, from the module path on a copy of the cache), so accept lengths 1 .. depth + 1 occur."""
    B, T = root.shape[0], parents.shape[-1]
    parents = parents.expand(B, T)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    tokens[:, 0] = root
    depths = tree.depths.expand(B, T)
    for d in range(1, int(depths.max()) + 1):
        target = module_step(m, clone(cache), tokens, tree, torch.zeros(B, dtype=torch.long), None, kv_len)[1]
        copy = (depths == d) & (torch.rand(B, T, generator=gen) < p_copy)
        tokens = torch.where(copy, target.gather(1, parents.clamp(min=0)), tokens)
    return tokens


def tree_for(step: int, B: int, gen) -> tuple[object, torch.Tensor]:
    """(a Tree or a TreeBatch of different sizes, its parents [T] or [B, T]) by step: shared, per sequence, one node."""
    if step % 3 == 2:
        t = Tree([])
        return t, torch.tensor([-1])
    if step % 3 == 0:
        t = random_tree(gen, 7, depth=3)
        return t, torch.tensor(t.host_parents())
    trees = [random_tree(gen, n, depth=4) for n in (6, 3, 9)[:B]]
    tb = TreeBatch.from_parent_lists([t.host_parents() for t in trees])
    return tb, tb.parents


def assert_same_steps(m, B: int, steps: int = 6, seed: int = 0, finished: bool = True, positions: bool = False,
                      attend: bool = False, finish: int = 1):
    """The native step against the module path, step by step. attend: the native step also gets attend = active, so
    a finished sequence skips its attention: its outputs are then unspecified (finite) and its rows past its committed
    length differ, where every active sequence's outputs and cache rows, and every committed row, stay the same.
    finish: the sequence that finishes (prompts of 9, 5 and 7 tokens: 0 is the longest, whose skip changes the step's
    longest prefix and the attention's scratch sizes)."""
    gen = torch.Generator().manual_seed(seed)
    want_cache, root = prefilled(m, B, seed)
    got_cache, _ = prefilled(m, B, seed)
    native = tree_step.native_tree_step(m, got_cache, "native")
    assert native is not None
    active = torch.ones(B, dtype=torch.long)
    lengths, skipped = set(), False
    for i in range(steps):
        if finished and B > 1 and i == 2:
            active[finish] = 0  # it finished: it commits nothing from here
        tree, parents = tree_for(i, B, gen)
        T = tree.num_nodes
        kv_len = int(want_cache.seqlens.max()) + T + 2
        tokens = planted(m, want_cache, root, tree, parents, gen, kv_len)
        pos = None
        if positions:  # a drafter's own positions (lookahead's): any in the RoPE table
            pos = want_cache.seqlens.long()[:, None] + torch.randint(0, 3, (B, T), generator=gen)
        want = module_step(m, want_cache, tokens, tree, active, pos, kv_len)
        if i % 2:  # a drafter's tokens may come as a non-contiguous view (MLPSpeculator's candidates)
            tokens = tokens.t().contiguous().t()
            assert not tokens.is_contiguous() or min(tokens.shape) == 1
        got = native(tokens, tree, active, pos, kv_len, active.clone() if attend else None)
        live = active > 0 if attend else torch.ones(B, dtype=torch.bool)  # the rows compared
        skipped |= not torch.equal(got[0][~live], want[0][~live])  # the skip ran (a finished row's outputs moved)
        assert torch.isfinite(got[0]).all() and torch.equal(got[0][live], want[0][live]), f"step {i}: hidden states"
        assert torch.equal(got[1][live], want[1][live]), f"step {i}: argmax tokens"
        for name, g, w in zip(want[2]._fields, got[2], want[2]):
            assert torch.equal(g[live], w[live]), f"step {i}: {name} {g.tolist()} != {w.tolist()}"
        assert torch.equal(got[3], want[3])
        ref = reference.greedy_verify(got[1], tokens, tree.paths)  # the acceptance's definition (ops/reference.py)
        for name, g, r in zip(got[2]._fields, got[2], ref):
            assert torch.equal(g, r), f"step {i}: {name} against the reference"
        assert torch.equal(got[3], got[2].accept_lengths * active)
        rows = torch.arange(got_cache.max_seq_len)[None, :] < got_cache.seqlens[:, None].long()  # [B, S]: committed
        rows |= live[:, None]  # a finished sequence's rows past its length are the skipped step's, not compared
        g_kv, w_kv = (c.kv.nan_to_num(7.0).permute(2, 3, 0, 1, 4, 5)[rows] for c in (got_cache, want_cache))
        assert torch.equal(g_kv, w_kv), f"step {i}: KV cache"
        assert torch.equal(got_cache.seqlens, want_cache.seqlens)
        lengths.update(want[2].accept_lengths[active > 0].tolist())
        root = want[2].next_root
    assert skipped == (attend and finished and B > 1)
    return lengths


@pytest.mark.parametrize("quantized", [False, "a", "b"])
@pytest.mark.parametrize("B,bias", [(1, False), (3, True)])
def test_native_verify_step_is_the_module_path_bit_for_bit(quantized, B, bias):
    lengths = assert_same_steps(model_of(quantized, bias, seed=B + 10), B, seed=B)
    assert len(lengths) >= 3, f"accept lengths seen: {lengths}"  # short and long accepted paths both ran


def test_a_finished_sequence_skips_its_attention_and_changes_nothing_else():
    """attend = active (the speculative loop's, once a sequence has finished): the finished sequence's attention is
    skipped, and every active sequence's hidden states, tokens, acceptance, commits and cache rows are the module
    path's bit for bit; the finished one's committed rows untouched, its outputs finite. Shared, per-sequence and
    one-node trees; fp32 and quantized layers."""
    for quantized, finish in ((False, 1), ("a", 1), (False, 0)):
        assert_same_steps(model_of(quantized, True, seed=31), 3, steps=6, seed=9, attend=True, finish=finish)


def test_a_sequence_done_at_its_first_token_skips_from_the_first_step(smollm2, monkeypatch):
    """A sequence whose first token (the prefill's) is an EOS is finished before the loop: it commits nothing and its
    attention is skipped from the first drafted step, and the other's tokens are plain decoding's."""
    model, tok = smollm2
    questions = ("Name three rivers in Africa.", "What is 17*23? Explain.", "Write a haiku about rain.",
                 "List two prime numbers.", "Translate 'good morning' into French.", "Say hello.")
    firsts = generate(model, [chat_prompt_ids(tok, q) for q in questions], max_new_tokens=1).sequences
    other = next(i for i, f in enumerate(firsts) if f != firsts[0])  # a second prompt whose first token differs
    prompts = [chat_prompt_ids(tok, questions[0]), chat_prompt_ids(tok, questions[other])]
    first = [firsts[0], firsts[other]]
    want = generate(model, prompts, max_new_tokens=12, eos_token_id=first[0])
    assert want.sequences[0] == first[0] and len(want.sequences[1]) > 1
    calls = []
    real = tree_step.TREE_GREEDY_STEP
    monkeypatch.setattr(tree_step, "TREE_GREEDY_STEP", lambda *a: calls.append(a[-1].clone()) or real(*a))
    got = generate(model, prompts, drafter=hk.load_drafter(model=model), max_new_tokens=12, eos_token_id=first[0],
                   budget=6)
    assert got.sequences == want.sequences and calls and all(c.tolist()[0] == 0 for c in calls)


def test_quantized_head_and_embedding_and_given_positions():
    m = with_quantized_head(model_of("a", False, seed=21), tied=True, seed=21)
    assert_same_steps(m, 3, seed=5, positions=True)


@pytest.mark.parametrize("hidden,heads,kv_heads", [(40, 5, 1), (60, 6, 3)])
def test_awkward_shapes(hidden, heads, kv_heads):
    assert_same_steps(model_of("b", False, seed=23, hidden=hidden, heads=heads, kv_heads=kv_heads), 3, steps=4, seed=7)


def test_bad_input_is_refused_before_anything_is_written():
    m = model_of("a", False, seed=1)
    cache = two_prefilled(m)
    step = tree_step.native_tree_step(m, cache, "native")
    kv, lens = cache.kv.clone(), cache.seqlens.clone()
    tree = Tree([(0,), (1,), (0, 0)])
    active = torch.ones(2, dtype=torch.long)
    good = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    bad_paths = Tree([(0,), (1,), (0, 0)])
    bad_paths.paths = bad_paths.paths.clone()
    bad_paths.paths[0, 1] = 4  # a node the tree does not have
    cases = [((torch.tensor([[5, 6, 97, 8], [1, 2, 3, 4]]), tree, active, None, 8),
              r"token 97 of sequence 0 \(node 2\) outside the embedding's \[0, 97\)"),
             ((good, tree, active, None, 5), "must lie in"),  # kv_len below seqlens + T
             ((good.int(), tree, active, None, 8), "int64"),
             ((good, tree, active.int(), None, 8), "active must be int64"),
             ((good, bad_paths, active, None, 8), "names node 4"),
             ((good, tree, active, torch.full((2, 4), 10**6), 8), "outside the RoPE table")]
    for args, match in cases:
        with pytest.raises(RuntimeError, match=match):
            step(*args)
        assert torch.equal(cache.kv, kv) and torch.equal(cache.seqlens, lens)
    hidden, target, v, n = step(good, tree, active, None, 8)  # the good case runs and commits
    assert hidden.shape == (2, 4, m.config.hidden_size) and target.shape == (2, 4)
    assert torch.equal(cache.seqlens, lens + n.int()) and (n >= 1).all()


def test_op_passes_torch_library_opcheck():
    """Schema (kv and seqlens written in place, nothing else) and the fake kernel."""
    m = with_quantized_head(model_of("a", True, seed=2), tied=True, seed=2)
    cache = two_prefilled(m)
    tb = TreeBatch.from_parent_lists([[-1, 0, 0], [-1, 0]])
    args = (torch.tensor([[5, 6, 7], [1, 2, 3]]), tb.mask, tb.depths, None, tb.paths, torch.tensor([1, 0]),
            *plain_step.native_step_model(m, cache, "native")(), cache.kv, cache.seqlens, 8)
    torch.library.opcheck(torch.ops.hydra_kernels.tree_greedy_step.default, args)
    torch.library.opcheck(torch.ops.hydra_kernels.tree_greedy_step.default, (*args, torch.tensor([1, 0])))  # attend


def test_cases_it_does_not_take_keep_the_module_path():
    """It applies exactly where the native plain step does (one rule: plain_step.native_step_model)."""
    m = model_of(False, False, seed=2)
    cache = m.new_kv_cache(1, 16)
    assert tree_step.native_tree_step(m, cache, "native") is not None
    assert tree_step.native_tree_step(m, cache, "reference") is None
    with torch.enable_grad():
        assert tree_step.native_tree_step(m, cache, "native") is None
    hook = m.output.register_forward_hook(lambda mod, args, out: out)
    assert tree_step.native_tree_step(m, cache, "native") is None
    hook.remove()


def test_generate_runs_it_for_every_drafted_greedy_step(smollm2, monkeypatch):
    """The embedded model and its shipped drafter at a pinned budget: one native call per drafted step, the tokens
    of the module path and of plain decoding, for a ragged batch where one answer ends early (its later steps skip the
    finished sequence's attention: attend given, with a 0); sampling and a run that captures layers (EAGLE-3) never
    call it."""
    model, tok = smollm2
    prompts = [chat_prompt_ids(tok, q) for q in ("Name three rivers in Africa.", "What is 17*23? Explain.")]
    want = generate(model, prompts, max_new_tokens=24)
    assert min(map(len, want.sequences)) < 24  # one answer ends early: later steps carry a finished row
    drafter = hk.load_drafter(model=model)
    calls = []
    real = tree_step.TREE_GREEDY_STEP
    monkeypatch.setattr(tree_step, "TREE_GREEDY_STEP",  # attend cloned: the loop changes active after the call
                        lambda *a: calls.append(None if a[-1] is None else a[-1].clone()) or real(*a))
    got = generate(model, prompts, drafter=drafter, max_new_tokens=24, budget=6)
    assert got.sequences == want.sequences
    assert len(calls) == got.num_steps > 0 and set(got.step_nodes) == {6}
    assert calls[0] is None and any(a is not None and 0 in a.tolist() for a in calls)  # a finished row skipped
    monkeypatch.setattr(speculative, "native_tree_step", lambda *a: None)  # the module path
    assert generate(model, prompts, drafter=drafter, max_new_tokens=24, budget=6).sequences == want.sequences
    monkeypatch.undo()
    monkeypatch.setattr(tree_step, "TREE_GREEDY_STEP", lambda *a: pytest.fail("a sampled run took the greedy step"))
    generate(model, prompts[:1], drafter=drafter, max_new_tokens=8, budget=6, temperature=0.8, seed=1)
    m = model_of("a", False, seed=8)
    eagle3 = hk.new_drafter(m, kind="eagle", feature_layers="eagle3")
    small = [[5, 9, 14, 3, 7], [2, 8, 1]]
    assert generate(m, small, drafter=eagle3, max_new_tokens=10, budget=4).sequences == \
        generate(m, small, max_new_tokens=10).sequences
