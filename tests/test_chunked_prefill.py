"""Chunked prefill (model/llama.py prefill_chunk_positions, model/attention.py suffix_causal_attention):
a prompt prefilled in chunks of positions is the same computation as one causal pass: the same K/V
rows, hidden states, captured features and last-token states, for ragged batches whose last real tokens
fall in different chunks; the chunk attention equals masked attention on every path it takes."""
import pytest
import torch

from helpers import assert_close_rel
from hydra_kernels.model import KVCache, Llama, LlamaConfig
from hydra_kernels.model import attention
from hydra_kernels.model.llama import PREFILL_CHUNK_TOKENS, prefill_chunk_positions

CFG = LlamaConfig(vocab_size=37, hidden_size=48, intermediate_size=72, num_layers=3, num_heads=6, num_kv_heads=2,
                  rope_theta=500.0)
POISON = 1234.5


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Llama(CFG).eval()
    with torch.no_grad():  # norms away from their ones init, so they matter
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return m


def prefill(model, tokens, lengths, chunk_tokens, **kw):
    cache = KVCache(model.config, tokens.shape[0], tokens.shape[1] + 3, dtype=torch.float32, device="cpu")
    cache.kv.fill_(POISON)  # a row never written shows
    with torch.inference_mode():
        out = model.prefill(tokens, lengths, cache, chunk_tokens=chunk_tokens, **kw)
    return out, cache


def masked_reference(q, k, v):
    """q [B, T, Hq, D] at the last T of k/v's [B, P + T, Hkv, D] positions, by the softmax formula."""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    kk, vv = k.repeat_interleave(G, 2).double(), v.repeat_interleave(G, 2).double()
    s = torch.einsum("bthd,bshd->bhts", q.double(), kk) / D ** 0.5
    P = k.shape[1] - T
    s = s.masked_fill(~torch.ones(T, P + T, dtype=torch.bool).tril(P), float("-inf"))
    return torch.einsum("bhts,bshd->bthd", s.softmax(-1), vv)


@pytest.mark.parametrize("chunk_tokens", [1, 7, 20])
def test_chunked_prefill_equals_one_pass(model, chunk_tokens):
    """Ragged batch of 3 (lengths 13, 5, 1 of L = 13): the chunks split the prompt at 1, 2 or 6 positions."""
    lengths = torch.tensor([13, 5, 1], dtype=torch.int32)
    tokens = torch.randint(0, CFG.vocab_size, (3, 13), generator=torch.Generator().manual_seed(1))
    capture = (0, 2)
    (h1, f1), c1 = prefill(model, tokens, lengths, 10**9, all_hidden=True, capture=capture)
    (h2, f2), c2 = prefill(model, tokens, lengths, chunk_tokens, all_hidden=True, capture=capture)
    assert prefill_chunk_positions(torch.device("cpu"), 3, 13, chunk_tokens) < 13
    assert_close_rel(h2, h1, 1e-5, "hidden states, every position")
    assert_close_rel(f2, f1, 1e-5, "captured features")
    assert_close_rel(c2.kv[:, :, :, :13], c1.kv[:, :, :, :13], 1e-5, "K/V rows")
    assert (c2.kv[:, :, :, 13:] == POISON).all() and torch.equal(c2.seqlens, lengths)
    # without all_hidden: each sequence's last real token, whichever chunk it fell in
    (h3, f3), _ = prefill(model, tokens, lengths, chunk_tokens, capture=capture)
    last = lengths.long() - 1
    assert_close_rel(h3, h1[torch.arange(3), last], 1e-5, "last-token states")
    assert_close_rel(f3, f1[torch.arange(3), last], 1e-5, "last-token features")
    h4, _ = prefill(model, tokens, lengths, chunk_tokens)
    assert_close_rel(h4, h3, 1e-6, "without capture")


def test_chunked_prefill_matches_the_full_forward(model):
    """Batch 1, odd length, 4-position chunks: the prefill's states equal the no-cache forward's."""
    tokens = torch.randint(0, CFG.vocab_size, (1, 19), generator=torch.Generator().manual_seed(2))
    h, _ = prefill(model, tokens, torch.tensor([19], dtype=torch.int32), 4, all_hidden=True)
    with torch.inference_mode():
        ref = model.hidden_states(tokens)
    assert_close_rel(h, ref, 1e-5, "chunked prefill vs full forward")


@pytest.mark.parametrize("B,P,T,Hq,Hkv", [(1, 1, 1, 2, 2), (2, 9, 5, 6, 2), (3, 4, 11, 9, 3), (1, 30, 1, 4, 1)])
@pytest.mark.parametrize("path", ["lse_merge", "masked_sdpa"])
def test_suffix_causal_attention_equals_the_formula(monkeypatch, B, P, T, Hq, Hkv, path):
    """Both CPU paths (two parts merged by log-sum-exp; a masked SDPA where the private op is absent) on
    random inputs, K/V strided as in the buffer (a view of rows [0, P + T) of a longer buffer)."""
    if path == "masked_sdpa":
        monkeypatch.setattr(attention, "_cpu_flash_with_lse", None)
    elif attention._cpu_flash_with_lse is None:
        pytest.fail("this torch has no _scaled_dot_product_flash_attention_for_cpu: the CPU prefill takes the slow path")
    g = torch.Generator().manual_seed(B * 100 + P * 10 + T)
    D = 16
    q = torch.randn(B, T, Hq, D, generator=g)
    kv = torch.randn(2, B, P + T + 4, Hkv, D, generator=g)
    k, v = kv[0, :, :P + T], kv[1, :, :P + T]
    got = attention.suffix_causal_attention(q, k, v)
    assert got.shape == (B, T, Hq, D) and got.dtype == q.dtype
    assert_close_rel(got, masked_reference(q, k, v).float(), 1e-5, f"{path}")


def test_default_chunks_follow_the_token_budget():
    cpu = torch.device("cpu")
    budget = PREFILL_CHUNK_TOKENS["cpu"]
    assert prefill_chunk_positions(cpu, 1, 100, None) == 100  # a short prompt: one chunk
    assert prefill_chunk_positions(cpu, 16, 2048, None) == budget // 16
    assert prefill_chunk_positions(cpu, 2 * budget, 5, None) == 1  # never zero positions
    assert prefill_chunk_positions(cpu, 4, 1000, 8) == 2  # an explicit budget wins
    assert prefill_chunk_positions(torch.device("meta"), 16, 4096, None) == 4096  # no budget: one piece
