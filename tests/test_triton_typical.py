"""Typical acceptance without logits: LM-head statistics (lse, entropy, a sample) and fused path
selection, Triton against the reference (CPU tier: TRITON_INTERPRET=1); the statistics path against
the logits-based definition (ops.typical_verify); the Gumbel-max sample against softmax frequencies."""
import os

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.ops import reference
from helpers import RTOL, assert_close_rel
from test_tree import random_choices

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="Triton needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _seed(s):
    return torch.tensor([s], dtype=torch.int64, device=DEV)


@pytest.mark.parametrize("N,V,H,temp", [(1, 300, 64, 1.0), (9, 517, 96, 0.7), (33, 129, 64, 1.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_stats_triton_equals_reference(N, V, H, temp, dtype):
    gen = torch.Generator().manual_seed(N + V)
    x = torch.randn(N, H, generator=gen).to(DEV, dtype)
    w = torch.randn(V, H, generator=gen).to(DEV, dtype) / H**0.25
    lse, ent, samp = hk.ops.lm_head_sample_stats(x, w, temp, _seed(3), backend="triton")
    rl, re, _ = reference.lm_head_sample_stats(x.float(), w.float(), temp, _seed(3))
    assert_close_rel(lse, rl, RTOL[dtype] * 4, "lse")
    assert_close_rel(ent, re, RTOL[dtype] * 4, "entropy")
    assert samp.dtype == torch.int64 and ((samp >= 0) & (samp < V)).all()


def test_gumbel_sample_follows_softmax():
    """4096 rows with the same logits: token frequencies within 5 sigma of softmax(z)."""
    V, H, n = 10, 16, 4096
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(V, H, generator=gen).to(DEV)
    x = torch.randn(1, H, generator=gen).to(DEV).expand(n, H).contiguous()
    _, _, samp = hk.ops.lm_head_sample_stats(x, w, 0.8, _seed(11), backend="triton")
    p = torch.softmax((x[0] @ w.T) / 0.8, -1).cpu()
    freq = torch.bincount(samp.cpu(), minlength=V).double() / n
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 5 * sigma + 1e-3).all(), (freq, p)
    _, _, again = hk.ops.lm_head_sample_stats(x, w, 0.8, _seed(11), backend="triton")
    assert torch.equal(samp, again)  # same seed, same draw


@pytest.mark.parametrize("seed,B,n_nodes", [(0, 1, 0), (1, 2, 6), (2, 3, 30), (3, 1, 64)])
def test_typical_accept_triton_equals_reference_and_the_definition(seed, B, n_nodes):
    gen = torch.Generator().manual_seed(seed)
    tree = hk.Tree(random_choices(gen, n=n_nodes, depth=4)) if n_nodes else hk.Tree([])
    T, V, H, temp = tree.num_nodes, 12, 16, 0.9
    w = torch.randn(V, H, generator=gen)
    hidden = torch.randn(B, T, H, generator=gen) * 2
    tokens = torch.randint(0, V, (B, T), generator=gen)
    # make many children the parent's likely tokens, so paths of several lengths are accepted
    likely = (hidden @ w.T).argmax(-1)
    pick = torch.rand(B, T, generator=gen) < 0.7
    tokens = torch.where(pick, likely[:, tree.parents.clamp(min=0)], tokens)
    lse, ent, _ = reference.lm_head_sample_stats(hidden, w, temp, torch.tensor([0]))
    samples = torch.randint(0, V, (B, T), generator=gen)
    cl = reference.child_logits(hidden, w, tokens, tree.parents, temp)
    args = [t.to(DEV) for t in (lse, ent, cl, samples, tree.paths)]
    out = hk.ops.typical_accept(*args, posterior_threshold=0.09, posterior_alpha=0.3, backend="triton")
    ref = hk.ops.typical_accept(*args, posterior_threshold=0.09, posterior_alpha=0.3, backend="reference")
    for a, b, name in zip(out, ref, out._fields):
        assert torch.equal(a.cpu(), b.cpu()), name
    # the definition from logits: same lengths and paths (its next root is its own draw)
    d = hk.ops.typical_verify(hidden @ w.T, tokens, tree.paths, temperature=temp, backend="reference")
    assert torch.equal(d.accept_lengths, ref.accept_lengths.cpu())
    assert torch.equal(d.accept_indices, ref.accept_indices.cpu())
    if n_nodes >= 30:
        assert ref.accept_lengths.max() >= 2
    last = ref.last_node.cpu()
    assert torch.equal(ref.next_root.cpu(), samples[torch.arange(B), last])


def test_generate_typical_with_triton_backend_runs_fused():
    """temperature > 0 with backend="triton": the statistics + fused acceptance path end to end
    (sampling: outputs are valid and reproducible with a seed, not comparable token for token)."""
    from hydra_kernels.generate import generate
    from test_llama_vs_transformers import make_hf

    model = hk.Llama.from_hf(make_hf("gqa3-tied", seed=5))
    torch.manual_seed(0)
    d = hk.new_drafter(model, kind="hydra", num_heads=3)
    run = lambda: generate(model, [[1, 2, 3], [4, 5]], drafter=d, tree=hk.tree.default_tree(10, depth=3),  # noqa: E731
                           max_new_tokens=12, temperature=0.8, acceptance="typical", seed=7, eos_token_id=[],
                           backend="triton")
    a, b = run(), run()
    assert a.sequences == b.sequences and all(len(s) == 12 for s in a.sequences)
    assert all(0 <= t < model.config.vocab_size for s in a.sequences for t in s)
