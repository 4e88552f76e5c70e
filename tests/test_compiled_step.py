"""A whole greedy verify step traced as one graph: speculative.greedy_verify_step (Llama.step over a tree,
the base argmax after every node, greedy acceptance, commit_kv and the cache advance) under
torch.compile(fullgraph=True) on the CPU (fullgraph: any graph break is an error) equals the eager step,
for every backend usable on the CPU: reference, native (packed projections, native tree_attention /
greedy_verify / commit_kv) and Triton (its torch.library ops, kernels interpreted). A step that traces
without a break has no host read inside, which is also what a CUDA graph capture of it needs. One case
captures layer inputs (EAGLE-3's features).

The host-side value checks (seqlens, paths) run in eager calls only (ops.values_checkable); the last
tests check that eager callers still get their errors, before the step writes anything.
"""
import copy

import pytest
import torch

import hydra_kernels as hk
from helpers import RTOL, assert_close_rel, random_tree_batch
from hydra_kernels.model import Llama, LlamaConfig
from hydra_kernels.speculative import greedy_verify_step
from hydra_kernels.tree import TreeBatch

# GQA (4 query heads over 2 KV heads), two layers: the per-layer loop and the shared site are traced
CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  rope_theta=500.0)
S = 32  # buffer rows
TREE = hk.Tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])  # T = 7, depth 3
# "aot_eager": dynamo's graph plus AOT autograd's functionalization of the in-place KV writes, commit
# and seqlens advance (what inductor and CUDA graphs consume), without inductor's C++ build per case
# (one cold inductor build of this step took ~26 s on the 2-core CPU; the ops' own inductor compiles
# are in test_torch_library.py)
COMPILER = "aot_eager"


@pytest.fixture(scope="module")
def models():
    """{"plain": F.linear projections, "packed": the native packed CPU kernel (where the CPU has it)}."""
    torch.manual_seed(0)
    plain = Llama(CFG).eval()
    packed = copy.deepcopy(plain)
    packed.use_input_major_weights()
    packed.use_packed_cpu_weights()  # False (F.linear stays) without AVX-512: the native ops still run
    return {"plain": plain, "packed": packed}


def model_for(models, backend):
    return models["packed" if backend == "native" else "plain"]


def make_tree(kind: str, B: int, gen):
    """A shared Tree, a TreeBatch of ragged per-sequence trees, or the root alone (T = 1)."""
    if kind == "shared":
        return TREE
    if kind == "root":
        return hk.Tree([])
    sizes = [int(torch.randint(1, 9, (1,), generator=gen)) for _ in range(B)]
    sizes[0] = 8  # one full-size tree, the others padded to it
    _, pad = random_tree_batch(gen, sizes, depth=3)
    return TreeBatch(pad.parents, pad.valid)


def clone_cache(model, cache):
    c = model.new_kv_cache(cache.batch_size, cache.max_seq_len)
    c.kv.copy_(cache.kv)
    c.seqlens.copy_(cache.seqlens)
    return c


def step_inputs(model, plan, tree, B: int, gen):
    """A cache of random committed rows with ragged seqlens, and tokens planted so that paths of several
    lengths are accepted: node i copies the base argmax after its parent with probability 0.7, node 1
    always (found by eager steps, one depth level more per pass)."""
    T = tree.num_nodes
    cache = model.new_kv_cache(B, S)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen))
    cache.seqlens.copy_(torch.randint(0, S - T - 4, (B,), generator=gen))
    kv_len = int(cache.seqlens.max()) + T  # the host-known bound speculative_loop passes
    parents = tree.parents.expand(B, T)
    copies = (torch.rand(B, T, generator=gen) < 0.7) & (parents >= 0)
    copies[:, 1:2] = parents[:, 1:2] >= 0  # node 1 always: every tree with a drafted node accepts one
    tokens = torch.randint(0, CFG.vocab_size, (B, T), generator=gen)
    for _ in range(tree.depth):
        h = model.step(tokens, clone_cache(model, cache), tree.mask, tree.depths, kv_len=kv_len, backends=plan)
        target = model.greedy_tokens(h, plan)
        tokens = torch.where(copies, target.gather(1, parents.clamp(min=0)), tokens)
    active = torch.ones(B, dtype=torch.long)
    if B > 1:
        active[1] = 0  # a finished sequence commits nothing
    return cache, tokens, kv_len, active


def run_step(fn, model, plan, cache, tokens, tree, active, kv_len, capture=None):
    feats, target, v, n = fn(model, cache, tokens, tree, active, kv_len=kv_len, backends=plan, capture=capture)
    return feats, target, v, n, cache


@pytest.mark.backends("reference", "native", "triton")
@pytest.mark.parametrize("kind,B,seed,capture", [
    ("shared", 1, 1, None), ("shared", 3, 2, None), ("per_sequence", 1, 3, None), ("per_sequence", 3, 4, None),
    ("root", 3, 5, None),
    ("shared", 3, 6, (0, 1)),  # EAGLE-3's features: the captured layers' inputs
])
def test_compiled_greedy_verify_step_equals_eager(models, backend, kind, B, seed, capture):
    model = model_for(models, backend)
    plan = model.backend_plan(backend)
    gen = torch.Generator().manual_seed(seed)
    tree = make_tree(kind, B, gen)
    # Triton's tokens planted with the reference ops: planting runs a step per tree depth, each of Triton's interpreted
    # here; the planted tokens need only be argmaxes a path accepts (checked below on the step under test)
    plant = model.backend_plan("reference") if backend == "triton" else plan
    cache, tokens, kv_len, active = step_inputs(model, plant, tree, B, gen)
    cache2 = clone_cache(model, cache)
    torch._dynamo.reset()  # each case traces afresh (no recompile limit shared between cases)
    compiled = torch.compile(greedy_verify_step, fullgraph=True, backend=COMPILER)  # a graph break fails
    got = run_step(compiled, model, plan, cache2, tokens, tree, active, kv_len, capture)
    want = run_step(greedy_verify_step, model, plan, cache, tokens, tree, active, kv_len, capture)
    (gf, gt, gv, gn, gc), (wf, wt, wv, wn, wc) = got, want
    assert_close_rel(gf, wf, RTOL[torch.float32], f"{backend} {kind} B={B}: features")
    assert torch.equal(gt, wt), f"{backend} {kind}: argmax tokens differ"
    for name, g, w in zip(wv._fields, gv, wv):
        assert torch.equal(g, w), f"{backend} {kind}: {name} {g.tolist()} vs {w.tolist()}"
    assert torch.equal(gn, wn) and torch.equal(gc.seqlens, wc.seqlens)
    assert_close_rel(gc.kv, wc.kv, RTOL[torch.float32], f"{backend} {kind} B={B}: KV buffer after the commit")
    if kind != "root":
        assert int(wv.accept_lengths.max()) >= 2, "the planted tokens should accept a path"


@pytest.mark.backends("reference", "native")
def test_eager_step_still_checks_seqlens_before_writing(models, backend):
    """A sequence whose tree rows would run past kv_len: the eager step raises tree_attention's error
    before the KV write (AttentionSite.prepare runs first), also after a compiled step skipped the check."""
    model = model_for(models, backend)
    plan = model.backend_plan(backend)
    gen = torch.Generator().manual_seed(5)
    cache, tokens, kv_len, active = step_inputs(model, plan, TREE, 3, gen)
    torch._dynamo.reset()
    torch.compile(greedy_verify_step, fullgraph=True, backend=COMPILER)(
        model, clone_cache(model, cache), tokens, TREE, active, kv_len=kv_len, backends=plan)
    cache.seqlens[1] = kv_len - TREE.num_nodes + 1  # its rows end one past kv_len
    before = cache.kv.clone()
    with pytest.raises(ValueError, match=rf"cache_seqlens\[1\] = {kv_len - TREE.num_nodes + 1}"):
        greedy_verify_step(model, cache, tokens, TREE, active, kv_len=kv_len, backends=plan)
    assert torch.equal(cache.kv, before), "the failed step wrote the buffer"


@pytest.mark.backends("reference", "native")
def test_eager_step_still_checks_the_tree(models, backend):
    """Leaf paths naming a node past T: greedy_verify's error, and nothing committed."""
    model = model_for(models, backend)
    plan = model.backend_plan(backend)
    cache, tokens, kv_len, active = step_inputs(model, plan, TREE, 2, torch.Generator().manual_seed(6))
    bad = copy.copy(TREE)
    bad.paths = TREE.paths.clone()
    bad.paths[0, 1] = TREE.num_nodes
    seqlens = cache.seqlens.clone()
    with pytest.raises(ValueError, match=f"paths index node {TREE.num_nodes} but the tree has"):
        greedy_verify_step(model, cache, tokens, bad, active, kv_len=kv_len, backends=plan)
    assert torch.equal(cache.seqlens, seqlens)


@pytest.mark.requires("native")
def test_compiled_packed_layer_follows_eager_rebuilds(models):
    """Traced code reads a packed Linear's panels as last built eagerly (weight_cache.DerivedCache.get: the
    storage/version key cannot be traced); after a weight change the next eager call rebuilds them and
    compiled calls see the new ones. A layer whose panels were never built packs inside the graph."""
    layer = copy.deepcopy(models["packed"].output)  # a copy starts with no panels (DerivedCache.__deepcopy__)
    if not layer.packed_on:
        pytest.skip("no packed kernel on this CPU")
    x = torch.randn(2, 3, CFG.hidden_size, generator=torch.Generator().manual_seed(7))
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend=COMPILER)
    assert torch.equal(compiled(x), layer(x))  # traced before any eager call: packed in the graph
    layer.weight.mul_(2)  # in place: the eager key (its version) changes
    want = layer(x)  # eager: rebuilds the panels
    assert torch.equal(compiled(x), want)
