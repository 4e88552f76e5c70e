"""csrc/step_kernels.h: the kernels a CPU decoding step's layer stack calls directly (packed_linear_into,
quantized_linear_into, tree_attention_step / tree_attention_into), without the ops' tensors. The ops call the same
functions, so tests/test_quantized_linear.py, test_packed_linear.py and test_tree_attention.py cover them through
the ops; here the stack that calls them directly (decode_stack) is compared with a layer stack written from
ops/reference.py (rms_norm, rope_write_kv, tree_attention, silu_mul, F.linear on the dequantized weights) on fresh
random inputs: awkward shapes (GQA ratios 5 and 2, odd widths), batch 1 with T = 1, per-sequence trees of
different sizes, fp32 / bf16 panels, quantized panels with fp16 and fp32 scales, and cache rows past each
sequence's tree poisoned with NaN (never read). Tolerances are fp32's."""
import pytest
import torch
import torch.nn.functional as F

from hydra_kernels.model import decode_stack, layers
from hydra_kernels.ops import reference
from helpers import RTOL, assert_close_rel, random_tree_batch
from test_decode_stack import model_of

pytestmark = pytest.mark.skipif(decode_stack.DECODE_STACK is None, reason="the extension's decode_stack")


def reference_stack(m, x, cos, sin, kv, rows, seqlens, mask, capture):
    """The stack's definition: each layer from ops/reference.py on the dequantized weights, in fp32; writes the
    step's K / V rows into kv [L, 2, B, S, Hkv, D]. -> (last layer's output, the captured layers' inputs)."""
    feats = []
    for i, block in enumerate(m.layers):
        if i in capture:
            feats.append(x)
        a, f = block.attention, block.feed_forward
        wqkv, wo, w13, w2 = layers.block_linears(block)
        lin = lambda t, l: F.linear(t, l.unpacked_weight(), l.bias)  # noqa: E731
        xn = reference.rms_norm(x, block.attention_norm.weight, block.attention_norm.eps)
        qkv = lin(xn, wqkv).view(*x.shape[:2], a.n_heads + 2 * a.n_kv_heads, a.head_dim)
        q = reference.rope_write_kv(qkv, cos, sin, kv[i], rows, a.n_heads, a.n_kv_heads)
        o = reference.tree_attention(q, kv[i, 0], kv[i, 1], seqlens, mask)
        h = x + lin(o.flatten(2), wo)
        hn = reference.rms_norm(h, block.ffn_norm.weight, block.ffn_norm.eps)
        x = h + lin(reference.silu_mul(lin(hn, w13)), w2)
    return x, torch.cat(feats, -1)


@pytest.mark.parametrize("quantized,hidden,heads,kv_heads", [
    (False, 40, 5, 1),   # fp32 panels, G = 5, head_dim 8
    (False, 60, 6, 3),   # G = 2, odd panel counts (the threads' half split does not apply to fp32 panels)
    ("a", 64, 4, 2),     # quantized, fp16 scales (kinds 141 / 180)
    ("a32", 64, 4, 2),   # quantized, fp32 scales
    ("b", 64, 4, 2),     # the other layouts (4 bits without offset, 8 bits with one)
])
@pytest.mark.parametrize("sizes", [[1], [6, 2, 4]])  # batch 1, T = 1; per-sequence trees of different sizes
def test_the_stack_on_step_kernels_is_the_reference_stack(quantized, hidden, heads, kv_heads, sizes):
    m = model_of(quantized, False, seed=len(sizes) + hidden, hidden=hidden, heads=heads, kv_heads=kv_heads)
    gen = torch.Generator().manual_seed(hidden + 7 * len(sizes))
    B, H, L = len(sizes), hidden, len(m.layers)
    a = m.layers[0].attention
    tree = random_tree_batch(gen, sizes)[1]
    mask, depths = tree.mask, tree.depths  # [B, T, T], [B, T]
    T = mask.shape[1]
    seqlens = torch.tensor([13, 40, 7][:B], dtype=torch.int32)
    S, kv_len = 64, int(seqlens.max()) + T
    kv = torch.randn(L, 2, B, S, a.n_kv_heads, a.head_dim, generator=gen)
    kv_ref = kv.clone()
    for b, n in enumerate(seqlens.tolist()):
        kv[:, :, b, n + T:] = float("nan")  # never read by the stack
        kv_ref[:, :, b, n + T:] = 0.0  # the reference's masked rows still meet a 0 weight
    rows = seqlens.long()[:, None] + torch.arange(T)
    positions = seqlens.long()[:, None] + depths.long()
    cos, sin = m._rope(positions, S, torch.float32)
    x = torch.randn(B, T, H, generator=gen)
    weights, kinds, biases, norms, eps = decode_stack.stack_weights(m, B * T)
    capture = [0, L - 1]
    with torch.no_grad():
        out, feats = decode_stack.DECODE_STACK(x, weights, kinds, biases, norms, eps, a.n_heads, a.n_kv_heads,
                                               m.layers[0].feed_forward.inter, cos, sin, kv, rows, seqlens, mask,
                                               kv_len, capture)
        want, want_feats = reference_stack(m, x, cos, sin, kv_ref, rows, seqlens, mask, capture)
    valid = tree.valid  # padded nodes of a shorter tree: their rows are the kernel's own, not compared
    assert torch.isfinite(out[valid]).all()
    assert_close_rel(out[valid], want[valid], 10 * RTOL[torch.float32], "stack output vs reference")
    assert_close_rel(feats[valid], want_feats[valid], 10 * RTOL[torch.float32], "captured inputs vs reference")
    for b in range(B):  # the K / V rows the step wrote, and nothing else changed
        n, t = int(seqlens[b]), int(valid[b].sum())
        assert_close_rel(kv[:, :, b, n:n + t], kv_ref[:, :, b, n:n + t], 10 * RTOL[torch.float32], "written K / V")
        assert torch.equal(kv[:, :, b, :n], kv_ref[:, :, b, :n])
