"""torch.compile(fullgraph=True) traces a call of each op as the model makes it (the backend's function a
BackendPlan entry resolves to) without a graph break, and the compiled call returns the eager call's
outputs bit for bit, on the CPU with inductor (gcc builds its CPU code):

- the Triton ops (all thirteen) through their torch.library forms (ops/triton/library.py; kernels under
  TRITON_INTERPRET=1), tree_attention with its mask packed inside the graph as a step packs it;
- the native ops a CPU decode step runs (the extension's TORCH_LIBRARY ops with the fake kernels of
  ops/native.py): tree_attention, tree_inputs, greedy_verify, commit_kv, packed_linear;
- the reference lm_head_topk (the CPU step's top-k without packed weights).
"""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.ops.backend import kernel_mask, resolve
from helpers import planted, tree_from_parents

CPU = torch.device("cpu")
TREE = hk.Tree([[0], [1], [0, 0], [0, 1], [1, 0]])  # T = 6, depth 2
B, H, V = 2, 32, 50


def _tree_attention(gen):
    T = 5
    kv = torch.randn(2, B, 16, 2, 16, generator=gen)  # a layer's buffer; the op reads row-limited views
    mask, _ = tree_from_parents([-1, 0, 0, 1, 3])
    return (torch.randn(B, T, 4, 16, generator=gen), kv[0, :, :12], kv[1, :, :12],
            torch.tensor([7, 3], dtype=torch.int32), mask)


def _commit_kv(gen):
    kv = torch.randn(2, 2, B, 12, 2, 8, generator=gen)  # [layers, K/V, B, S, Hkv, D]
    idx = torch.tensor([[0, 2, 4, -1], [0, 1, -1, -1]])  # overlapping moves: row 2 -> 1, 4 -> 2
    return kv, torch.tensor([3, 5], dtype=torch.int32), idx, torch.tensor([3, 2])


def _verify(gen):
    target, tokens = planted(gen, B, TREE.parents, V)
    return target, tokens, TREE.paths


def _typical_accept(gen):
    T = TREE.num_nodes
    lse, child = (torch.randn(B, T, generator=gen) for _ in range(2))
    entropy = torch.rand(B, T, generator=gen) * 3
    return lse, entropy, child, torch.randint(0, V, (B, T), generator=gen), TREE.paths, 0.09, 0.3


def _residual_sample(gen):
    T = TREE.num_nodes
    tokens = torch.randint(0, V, (B, T), generator=gen)
    exclude = hk.ops.reference.child_tokens(tokens, TREE.parents, max(TREE.max_children, 1))
    return torch.randn(B, T, H, generator=gen), torch.randn(V, H, generator=gen), 0.7, torch.tensor([7]), exclude


def _rejection_accept(gen):
    T = TREE.num_nodes
    lse, child = torch.randn(B, T, generator=gen) + 3, torch.randn(B, T, generator=gen)
    return (lse, child, torch.randint(0, V, (B, T), generator=gen), torch.rand(B, T, generator=gen),
            torch.randint(0, V, (B, T), generator=gen), TREE.parents, TREE.depth)


def _hydra_first_layer(gen):
    w = lambda *s: torch.randn(*s, generator=gen) * 0.1  # noqa: E731
    return (w(B, H), torch.randint(0, V, (B, 3, 2), generator=gen), w(V, H), w(H, 3 * H), w(H), w(H, 3 * H), w(H))


def _tree_inputs(gen):
    T = TREE.num_nodes
    return (torch.randint(0, V, (B,), generator=gen), torch.randint(0, V, (B, 8), generator=gen),
            torch.tensor([0, 0, 1, 4, 5, 6]), TREE.depths[:T], torch.tensor([7, 3], dtype=torch.int32))


def _rope_write_kv(gen):
    T, NQ, NKV, D = 3, 4, 2, 16
    ang = torch.rand(B, T, D, generator=gen) * 6
    return (torch.randn(B, T, NQ + 2 * NKV, D, generator=gen), ang.cos(), ang.sin(),
            torch.randn(2, B, 12, NKV, D, generator=gen), torch.tensor([[7, 8, 9], [3, 4, 5]]), NQ, NKV)


INPUTS = {
    "tree_attention": _tree_attention,
    "rms_norm": lambda gen: (torch.randn(B, 3, H, generator=gen), torch.randn(H, generator=gen), 1e-5,
                             torch.randn(B, 3, H, generator=gen)),
    "rope_write_kv": _rope_write_kv,
    "silu_mul": lambda gen: (torch.randn(B, 3, 2 * H, generator=gen),),
    "commit_kv": _commit_kv,
    "greedy_verify": _verify,
    "typical_accept": _typical_accept,
    "lm_head_topk": lambda gen: (torch.randn(B, 3, H, generator=gen), torch.randn(V, H, generator=gen), 4),
    "lm_head_sample_stats": lambda gen: (torch.randn(B, 3, H, generator=gen), torch.randn(V, H, generator=gen), 0.7,
                                         torch.tensor([7])),
    "hydra_first_layer": _hydra_first_layer,
    "resblock": lambda gen: (torch.randn(B, 3, H, generator=gen), torch.randn(H, H, generator=gen) * 0.1,
                             torch.randn(H, generator=gen)),
    "tree_inputs": _tree_inputs,
    "lm_head_residual_sample": _residual_sample,
    "rejection_accept": _rejection_accept,
}
TRITON_OPS = ["tree_attention", "commit_kv", "greedy_verify", "typical_accept", "lm_head_topk", "lm_head_sample_stats",
              "hydra_first_layer", "resblock", "lm_head_residual_sample", "rejection_accept", "rms_norm", "rope_write_kv",
              "silu_mul"]
NATIVE_STEP_OPS = ["tree_attention", "tree_inputs", "greedy_verify", "commit_kv"]  # packed_linear: its own test


def _as_step_calls(backend: str, op: str):
    """The op's function as a step calls it; tree_attention with its mask in the kernel's form, made in
    the traced code as AttentionSite makes it (Triton: packed in the graph)."""
    fn = resolve(op, backend, CPU)
    if op == "tree_attention":
        return lambda q, k, v, sl, mask: fn(q, k, v, sl, kernel_mask(op, backend, mask))
    return fn


def _outputs(result, args, op: str) -> list[torch.Tensor]:
    """What a call produced: its returned tensors, or for commit_kv (in place, returns None) the buffer; for
    rope_write_kv also the cache it writes."""
    if result is None:
        return [args[0]]
    if op == "rope_write_kv":
        return [result, args[3]]
    return list(result) if isinstance(result, (tuple, list)) else [result]


def check_compiled_call_equals_eager(backend: str, op: str) -> None:
    fn = _as_step_calls(backend, op)
    make = INPUTS[op]
    eager_args, compiled_args = make(torch.Generator().manual_seed(1)), make(torch.Generator().manual_seed(1))
    torch._dynamo.reset()  # each case traces afresh (no recompile limit shared between cases)
    compiled = torch.compile(fn, fullgraph=True)  # fullgraph: a graph break is an error
    got = _outputs(compiled(*compiled_args), compiled_args, op)
    want = _outputs(fn(*eager_args), eager_args, op)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, f"output {i}: {g.dtype} {tuple(g.shape)} vs {w.dtype} {tuple(w.shape)}"
        assert torch.equal(g, w), f"output {i} differs: max |diff| {(g.double() - w.double()).abs().max():.3e}"


@pytest.mark.backends("triton")
@pytest.mark.parametrize("op", TRITON_OPS)
def test_triton_op_compiles_whole(backend, op):
    check_compiled_call_equals_eager(backend, op)


@pytest.mark.backends("native")
@pytest.mark.parametrize("op", NATIVE_STEP_OPS)
def test_native_step_op_compiles_whole(backend, op):
    check_compiled_call_equals_eager(backend, op)


@pytest.mark.backends("native")
def test_native_packed_linear_compiles_whole(backend):
    """The CPU step's projections and LM head (packed fp32 panels, x W^T + b)."""
    gen = torch.Generator().manual_seed(3)
    w, b, x = torch.randn(40, H, generator=gen), torch.randn(40, generator=gen), torch.randn(B, 3, H, generator=gen)
    packed = hk.ops.pack_linear_weight(w)
    fn = lambda x: hk.ops.packed_linear(x, packed, 40, b)  # noqa: E731
    want = fn(x)
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True)(x)
    assert got.shape == (B, 3, 40) and torch.equal(got, want)


@pytest.mark.backends("reference")
def test_reference_lm_head_topk_compiles_whole(backend):
    check_compiled_call_equals_eager(backend, "lm_head_topk")


@pytest.mark.requires("triton")
def test_eager_triton_calls_skip_the_library_dispatch(monkeypatch):
    """Eager calls go straight to the launcher (the custom-op dispatch costs ~5.5 us per call)."""
    from hydra_kernels.ops.triton import library

    def traced_only(*args):
        raise AssertionError("an eager call went through the torch.library op")

    monkeypatch.setattr(library, "traced_call", traced_only)
    x, w, b = INPUTS["resblock"](torch.Generator().manual_seed(2))
    out = resolve("resblock", "triton", CPU)(x, w, b)
    assert torch.allclose(out, hk.ops.reference.resblock(x, w, b), rtol=1e-4, atol=1e-5)


def test_every_triton_op_has_a_library_form_and_a_compile_case():
    """A Triton op added to the backend without its torch.library form (or without a case above) fails here."""
    from hydra_kernels.ops import backend as be

    triton_ops = {op for op, impls in be._IMPLS.items() if "triton" in impls}
    assert triton_ops == set(TRITON_OPS)
    assert all(hasattr(torch.ops.hydra_kernels_triton, op) for op in triton_ops)
