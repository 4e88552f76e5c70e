"""One TransformerBlock, its three attention modes (model/attention.py) agreeing with each other:
no cache, prefill into a static buffer, single-token steps, and one tree step (chain or branching),
on every tree_attention backend usable on the CPU."""
import dataclasses

import pytest
import torch

from helpers import assert_close_rel, random_parents, tree_from_parents
from hydra_kernels.model import KVCache, LlamaConfig
from hydra_kernels.model.attention import PREFILL, AttentionSite
from hydra_kernels.model.layers import TransformerBlock
from hydra_kernels.model.rope import RopeCache
CFG = LlamaConfig(vocab_size=11, hidden_size=40, intermediate_size=52, num_layers=1, num_heads=5, num_kv_heads=1,
                  rope_theta=500.0, attention_bias=True)


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    blk = TransformerBlock(CFG).eval()
    with torch.no_grad():  # norms and biases away from their ones / zeros init, so they matter
        for n, p in blk.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" not in n else 0.2) + (1.0 if "norm" in n else 0.0))
    return blk


def rope_at(positions):
    """cos, sin [B, T, D] at integer positions [B, T]."""
    return RopeCache(CFG)(positions, 64, torch.float32)


POISON = 1234.5


def poisoned_cache(B, S):
    """A buffer of huge values: a row read but never written shows in the output. (Finite, not NaN: rows a
    sequence's mask excludes are still read below kv_len, and 0 * NaN would be NaN.)"""
    cache = KVCache(CFG, B, S, dtype=torch.float32, device="cpu")
    cache.kv.fill_(POISON)
    return cache


def step_site(cache, T, mask, backend):
    rows = cache.seqlens.long()[:, None] + torch.arange(T)
    return rows, AttentionSite(rows, cache.seqlens, mask, int(cache.seqlens.max()) + T, backend)


def test_prefill_equals_no_cache_and_fills_rows(block):
    B, L = 3, 13
    x = torch.randn(B, L, CFG.hidden_size)
    cos, sin = rope_at(torch.arange(L).expand(B, L))
    ref = block(x, cos, sin)
    cache = poisoned_cache(B, L + 4)
    got = block(x, cos, sin, PREFILL, cache.layers[0])
    assert_close_rel(got, ref, 1e-5, "prefill vs no cache")
    _, k, v = block.attention.qkv(block.attention_norm(x), cos, sin)  # what the buffer must hold
    assert torch.equal(cache.kv[0, 0, :, :L], k) and torch.equal(cache.kv[0, 1, :, :L], v)
    assert (cache.kv[0, :, :, L:] == POISON).all()  # nothing past the prompt is written


@pytest.mark.backends("reference", "native", op="tree_attention")
def test_single_token_steps_and_chain_step_equal_no_cache(block, backend):
    B, L, P = 2, 17, 6
    x = torch.randn(B, L, CFG.hidden_size)
    cos, sin = rope_at(torch.arange(L).expand(B, L))
    ref = block(x, cos, sin)
    # prefill P rows, then one token per step
    cache = poisoned_cache(B, L + 3)
    block(x[:, :P], cos[:, :P], sin[:, :P], PREFILL, cache.layers[0])
    cache.seqlens.fill_(P)
    one = torch.ones(1, 1, dtype=torch.bool)
    for t in range(P, L):
        _, site = step_site(cache, 1, one, backend)
        got = block(x[:, t:t + 1], cos[:, t:t + 1], sin[:, t:t + 1], site, cache.layers[0])
        assert_close_rel(got[:, 0], ref[:, t], 1e-5, f"{backend}: step at position {t}")
        cache.advance(1)
    # the same tokens after the prefill in one chain step (causal mask [T, T])
    cache2 = poisoned_cache(B, L + 3)
    block(x[:, :P], cos[:, :P], sin[:, :P], PREFILL, cache2.layers[0])
    cache2.seqlens.fill_(P)
    T = L - P
    _, site = step_site(cache2, T, torch.ones(T, T, dtype=torch.bool).tril_(), backend)
    got = block(x[:, P:], cos[:, P:], sin[:, P:], site, cache2.layers[0])
    assert_close_rel(got, ref[:, P:], 1e-5, f"{backend}: chain step")
    # the same rows written either way (up to rounding: a GEMM's sums depend on how many rows share it)
    assert_close_rel(cache2.kv[0, :, :, :L], cache.kv[0, :, :, :L], 1e-5, f"{backend}: buffer rows")


@pytest.mark.backends("reference", "native", op="tree_attention")
def test_tree_step_node_equals_no_cache_over_its_path(block, backend):
    """Ragged prefixes, then a branching tree: node i equals the no-cache block over prefix + the path
    root..i, at positions prefix length + depth."""
    T = 9
    mask, depths = tree_from_parents(random_parents(T, torch.Generator().manual_seed(4)))
    lens = [4, 11]
    B = len(lens)
    prefixes = [torch.randn(1, n, CFG.hidden_size) for n in lens]
    nodes = torch.randn(B, T, CFG.hidden_size)
    cache = poisoned_cache(B, max(lens) + T + 2)
    padded = torch.cat([torch.cat([p, torch.randn(1, max(lens) - p.shape[1], CFG.hidden_size)], 1) for p in prefixes])
    cos, sin = rope_at(torch.arange(max(lens)).expand(B, -1))
    block(padded, cos, sin, PREFILL, cache.layers[0])  # right padding: real rows see only real rows
    cache.seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
    _, site = step_site(cache, T, mask, backend)
    cos, sin = rope_at(cache.seqlens.long()[:, None] + depths)
    got = block(nodes, cos, sin, site, cache.layers[0])
    for b in range(B):
        for i in range(T):
            path = [j for j in range(T) if mask[i, j]]
            seq = torch.cat([prefixes[b], nodes[b:b + 1, path]], 1)
            n = seq.shape[1]
            ref = block(seq, *rope_at(torch.arange(n)[None]))[0, -1]
            assert_close_rel(got[b, i], ref, 1e-5, f"{backend}: sequence {b} node {i}")


def test_site_rows_and_batch_index():
    rows = torch.tensor([[3, 4], [7, 8], [0, 1]])
    site = AttentionSite(rows, torch.tensor([3, 7, 0]), torch.ones(2, 2, dtype=torch.bool), 9, "reference")
    assert site.batch_index.tolist() == [[0], [1], [2]]
    assert PREFILL.rows is None and PREFILL.batch_index is None
    assert dataclasses.replace(site, kv_len=5).batch_index.shape == (3, 1)


@pytest.mark.requires("triton", op="tree_attention")
def test_triton_step_packs_the_tree_mask_once_for_every_layer(monkeypatch):
    """A Triton step packs its tree mask once (AttentionSite.prepare) and every layer reads that packed
    form, also under inference_mode (where tensors keep no version counter to tell a reused mask); the
    step's output equals the reference backend's."""
    import hydra_kernels.ops.triton.tree_mask as kernel
    from hydra_kernels.model import Llama

    cfg = dataclasses.replace(CFG, num_layers=3)
    torch.manual_seed(1)
    model = Llama(cfg).eval()
    packs = []
    pack = kernel.pack_tree_mask
    monkeypatch.setattr(kernel, "pack_tree_mask", lambda m: packs.append(m) or pack(m))
    mask, depths = tree_from_parents([-1, 0, 0, 1, 3])
    prompt, tokens = torch.randint(0, cfg.vocab_size, (2, 6)), torch.randint(0, cfg.vocab_size, (2, 5))
    out = {}
    with torch.inference_mode():
        for backend in ("triton", "reference"):
            cache = KVCache(cfg, 2, 24, dtype=torch.float32, device="cpu")
            model.prefill(prompt, torch.tensor([6, 4]), cache)
            out[backend] = [model.step(tokens, cache, mask, depths, backends=backend) for _ in range(2)]
    assert len(packs) == 2, f"{len(packs)} packs for 2 steps of {cfg.num_layers} layers"
    for a, b in zip(out["triton"], out["reference"]):
        assert_close_rel(a, b, 1e-4, "triton step")
