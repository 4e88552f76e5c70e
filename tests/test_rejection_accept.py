"""rejection_accept (lossless rejection sampling over a tree from LM-head statistics, no [B, T, V]
probabilities) on every backend against the reference, and the reference against the logits-based
definition (ops.rejection_verify fed the same uniforms: the same walk); child_tokens (the residual draws'
exclusion lists); generate() at temperature > 0 on the Triton backend taking the fused path (and the
logits path for a top-k law). That the emitted tokens follow the base law: test_sampling_exactness.py."""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels import ops
from hydra_kernels.generate import generate
from hydra_kernels.ops import reference
from helpers import DEV, assert_same_verification, poison_allocations, random_tree, random_tree_batch
from test_llama_vs_transformers import make_hf

V, H, TEMP = 4, 16, 0.8  # a small vocabulary: likely children, and siblings repeating a token
TREE = hk.Tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12], [40, 41, 40, 41, 40]]


def statistics(gen, B, parents, likely_share=0.5):
    """(logits [B, T, V], lse, child_logits, samples, uniforms, tokens [B, T], uniform seed) of random
    hidden states through a random LM head; parents [T] or [B, T]. About likely_share of the children
    hold their parent's likeliest token (deep walks), the rest a random one (rejections, repeated
    siblings). rejection_verify seeded with the returned seed draws the same uniforms first."""
    T = parents.shape[-1]
    w = torch.randn(V, H, generator=gen)
    hidden = torch.randn(B, T, H, generator=gen)
    par = parents.expand(B, T).clamp(min=0)
    likely = (hidden @ w.T).argmax(-1).gather(1, par)
    tokens = torch.where(torch.rand(B, T, generator=gen) < likely_share, likely,
                         torch.randint(0, V, (B, T), generator=gen))
    lse = (hidden @ w.T / TEMP).logsumexp(-1)
    cl = reference.child_logits(hidden, w, tokens, parents, TEMP)
    samples = torch.randint(0, 1000, (B, T), generator=gen)  # any ids: the op only picks one per sequence
    seed = int(torch.randint(2**31, (1,), generator=gen))
    uniforms = torch.rand(B, T, generator=torch.Generator().manual_seed(seed))
    return hidden @ w.T, lse, cl, samples, uniforms, tokens, seed


def accept(backend, lse, cl, samples, uniforms, tokens, parents, depth):
    args = [t.to(DEV) for t in (lse, cl, samples, uniforms, tokens, parents)]
    v = ops.rejection_accept(*args, depth=depth, backend=backend)
    return type(v)(*(t.cpu() for t in v))


def check_definition(v, logits, tokens, paths, samples, seed):
    """rejection_verify with the same uniforms walks the same path; the next root is the residual draw
    after the last node."""
    d = ops.rejection_verify(logits, tokens, paths, temperature=TEMP, generator=torch.Generator().manual_seed(seed),
                             backend="reference")
    for name in ("accept_lengths", "accept_indices", "last_node"):
        assert torch.equal(getattr(v, name), getattr(d, name)), (name, getattr(v, name), getattr(d, name))
    assert torch.equal(v.next_root, samples.gather(1, v.last_node[:, None])[:, 0])


pytestmark = pytest.mark.backends("reference", "triton", op="rejection_accept")


@pytest.mark.parametrize("tree_kind,B,seed", [("root-only", 2, 0), ("chain", 1, 1), ("chain", 5, 2), ("siblings", 8, 3),
                                              ("random-17", 3, 4), ("random-40", 8, 5)])
def test_rejection_accept_equals_reference_and_the_definition(backend, tree_kind, B, seed, monkeypatch):
    gen = torch.Generator().manual_seed(seed)
    tree = {"root-only": hk.Tree([]), "chain": hk.tree.chain(5), "siblings": TREE,
            "random-17": random_tree(gen, 17, depth=5), "random-40": random_tree(gen, 40)}[tree_kind]
    logits, lse, cl, samples, u, tokens, useed = statistics(gen, B, tree.parents)
    poison_allocations(monkeypatch)
    v = accept(backend, lse, cl, samples, u, tokens, tree.parents, tree.depth)
    monkeypatch.undo()
    ref = accept("reference", lse, cl, samples, u, tokens, tree.parents, tree.depth)
    assert_same_verification(v, ref, backend)
    check_definition(ref, logits, tokens, tree.paths, samples, useed)
    assert v.accept_indices.shape == (B, tree.depth + 1)


def test_rejection_accept_takes_every_branch(backend):
    """64 sequences over a tree with siblings at two depths: walks stop at every depth, and both first
    and later siblings are accepted (the residual renormalisation at work)."""
    gen = torch.Generator().manual_seed(7)
    logits, lse, cl, samples, u, tokens, useed = statistics(gen, 64, TREE.parents)
    v = accept(backend, lse, cl, samples, u, tokens, TREE.parents, TREE.depth)
    assert_same_verification(v, accept("reference", lse, cl, samples, u, tokens, TREE.parents, TREE.depth), backend)
    check_definition(v, logits, tokens, TREE.paths, samples, useed)
    assert set(v.accept_lengths.tolist()) == {1, 2, 3, 4}
    assert {1, 2, 3} <= set(v.accept_indices[:, 1].tolist())  # root children 1, 2, 3: second and third tried too


@pytest.mark.parametrize("seed,sizes", [(0, [7]), (1, [1, 12, 5]), (2, [30, 3, 9, 1])])
def test_rejection_accept_per_sequence_trees(backend, seed, sizes, monkeypatch):
    """Trees of different sizes in one batch (padded): the reference's result, the definition's walk,
    and for each sequence the result of walking it alone with its own static tree."""
    gen = torch.Generator().manual_seed(50 + seed)
    trees, batch = random_tree_batch(gen, sizes)
    B, D = len(sizes), batch.paths.shape[-1] - 1
    logits, lse, cl, samples, u, tokens, useed = statistics(gen, B, batch.parents)
    poison_allocations(monkeypatch)
    v = accept(backend, lse, cl, samples, u, tokens, batch.parents, D)
    monkeypatch.undo()
    assert_same_verification(v, accept("reference", lse, cl, samples, u, tokens, batch.parents, D), backend)
    check_definition(v, logits, tokens, batch.paths, samples, useed)
    assert not ((v.accept_indices[:, :, None] == torch.arange(batch.valid.shape[1])) & ~batch.valid[:, None, :]).any()
    for b, tree in enumerate(trees):
        n, D1 = tree.num_nodes, tree.depth + 1
        alone = accept(backend, *(t[b:b + 1, :n] for t in (lse, cl, samples, u, tokens)), tree.parents, tree.depth)
        assert v.accept_lengths[b] == alone.accept_lengths[0] and v.last_node[b] == alone.last_node[0]
        assert v.next_root[b] == alone.next_root[0]
        assert torch.equal(v.accept_indices[b, :D1], alone.accept_indices[0]) and (v.accept_indices[b, D1:] == -1).all()


def test_rejection_accept_padded_nodes_are_never_accepted(backend):
    """Padded nodes carry p(child) = 1 (certain acceptance were they tried), real children p ~ 0."""
    gen = torch.Generator().manual_seed(60)
    _, batch = random_tree_batch(gen, [1, 8, 4])
    _, lse, cl, samples, u, tokens, _ = statistics(gen, 3, batch.parents)
    par_lse = lse.gather(1, batch.parents.clamp(min=0))
    cl = torch.where(batch.valid, par_lse - 1e3, par_lse)
    v = accept(backend, lse, cl, samples, u, tokens, batch.parents, batch.paths.shape[-1] - 1)
    assert (v.accept_lengths == 1).all() and (v.last_node == 0).all()
    assert torch.equal(v.next_root, samples[:, 0])


def test_rejection_accept_same_tree_per_sequence_is_the_shared_result(backend):
    gen = torch.Generator().manual_seed(61)
    tree = random_tree(gen, 18)
    B = 3
    _, lse, cl, samples, u, tokens, _ = statistics(gen, B, tree.parents)
    shared = accept(backend, lse, cl, samples, u, tokens, tree.parents, tree.depth)
    for parents in (tree.parents.expand(B, -1).clone(), tree.parents.expand(B, -1)):
        assert_same_verification(accept(backend, lse, cl, samples, u, tokens, parents, tree.depth), shared, "same tree")


@pytest.mark.parametrize("per_sequence", [False, True])
def test_child_tokens(per_sequence):
    """child_tokens against a loop: each node's children's tokens in index order, -1 padded; padded
    nodes are nobody's children and have none."""
    gen = torch.Generator().manual_seed(70)
    if per_sequence:
        _, batch = random_tree_batch(gen, [9, 1, 14])
        parents, B = batch.parents, 3
    else:
        parents, B = random_tree(gen, 15).parents, 2
    T = parents.shape[-1]
    tokens = torch.randint(0, 50, (B, T), generator=gen)
    par = parents.expand(B, T)
    width = int(max((par[b] == i).sum() for b in range(B) for i in range(T))) + 2  # room to spare: -1 padded
    out = reference.child_tokens(tokens, parents, width)
    want = torch.full((B, T, width), -1)
    for b in range(B):
        for i in range(T):
            kids = [int(tokens[b, j]) for j in range(T) if int(par[b, j]) == i]
            want[b, i, :len(kids)] = torch.tensor(kids, dtype=torch.long)
    assert torch.equal(out, want)


def test_rejection_accept_bad_input_is_refused():
    gen = torch.Generator().manual_seed(80)
    _, lse, cl, samples, u, tokens, _ = statistics(gen, 2, TREE.parents)
    args = dict(lse=lse, child_logits=cl, samples=samples, uniforms=u, tree_tokens=tokens, parents=TREE.parents)

    def call(depth=TREE.depth, **change):
        a = {**args, **change}
        return ops.rejection_accept(a["lse"], a["child_logits"], a["samples"], a["uniforms"], a["tree_tokens"],
                                    a["parents"], depth=depth)

    with pytest.raises(ValueError, match=r"must all be \[B, T\]"):
        call(uniforms=u[:, :3])
    with pytest.raises(ValueError, match="uniforms must be torch.float32"):
        call(uniforms=u.double())
    with pytest.raises(ValueError, match="tree_tokens must be torch.int64"):
        call(tree_tokens=tokens.int())
    with pytest.raises(ValueError, match=r"parents must be \[T\]"):
        call(parents=TREE.parents[:5])
    with pytest.raises(ValueError, match="a node index < j"):
        call(parents=torch.tensor([-1, 0, 0, 4, 1, 2, 3, 4]))
    with pytest.raises(ValueError, match="the tree is 3 deep, more than depth = 2"):
        call(depth=2)
    with pytest.raises(ValueError, match="depth must be an int"):
        call(depth=8)


# ---- wiring into generate() -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    """One layer (every op runs interpreted on the CPU tier), an LM head sharpened 3x so that at
    temperature 0.7 a fresh drafter's guesses are often accepted."""
    hf = make_hf("gqa3-tied", seed=5, num_hidden_layers=1)
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)
    return hk.Llama.from_hf(hf).to(DEV)


@pytest.fixture(scope="module")
def drafter(model):
    torch.manual_seed(0)
    return hk.new_drafter(model, kind="medusa", num_heads=3, num_layers=1)  # fresh: drafts what the model repeats


def spy(monkeypatch, name):
    """Record the backend of every call of ops.<name> (still calling it)."""
    calls, real = [], getattr(ops, name)
    monkeypatch.setattr(ops, name, lambda *a, **k: calls.append(k.get("backend")) or real(*a, **k))
    return calls


@pytest.mark.requires("triton")
def test_sampling_on_the_triton_backend_takes_the_fused_path(model, drafter, monkeypatch):
    """temperature 0.7, no top-k / top-p, backend="triton": every step's acceptance is the fused one (no
    [B, T, V] probabilities), seeded; its kernels give the tokens their reference twins give in place."""
    fused, residual, logits_path = (spy(monkeypatch, n) for n in
                                    ("rejection_accept", "lm_head_residual_sample", "rejection_verify"))
    kw = dict(drafter=drafter, tree=TREE, max_new_tokens=10, eos_token_id=[], temperature=0.7, backend="triton")
    out = generate(model, PROMPTS, seed=3, **kw)
    assert fused and set(fused) == set(residual) == {"triton"} and len(fused) == len(residual) == out.num_steps
    assert not logits_path
    assert out.mean_accepted_tokens > 1  # drafts were accepted, not bypassed
    assert all(len(s) == 10 for s in out.sequences)
    assert generate(model, PROMPTS, seed=3, **kw).sequences == out.sequences
    assert generate(model, PROMPTS, seed=4, **kw).sequences != out.sequences
    monkeypatch.undo()
    for name in ("rejection_accept", "lm_head_residual_sample"):  # the same path, the reference ops
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, **k: _real(*a, **{**k, "backend": "reference"}))
    assert generate(model, PROMPTS, seed=3, **kw).sequences == out.sequences


@pytest.mark.requires("triton")
def test_top_k_on_the_triton_backend_takes_the_logits_path_and_top_k_1_is_greedy(model, drafter, monkeypatch):
    """A top-k law needs the filtered logits: rejection_verify runs; top_k = 1 equals greedy."""
    fused, logits_path = spy(monkeypatch, "rejection_accept"), spy(monkeypatch, "rejection_verify")
    kw = dict(drafter=drafter, tree=TREE, max_new_tokens=10, eos_token_id=[], backend="triton")
    greedy = generate(model, PROMPTS, **kw).sequences
    out = generate(model, PROMPTS, temperature=0.7, top_k=1, seed=3, **kw)
    assert out.sequences == greedy and out.mean_accepted_tokens > 1
    assert logits_path and not fused
