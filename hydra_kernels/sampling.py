"""Next-token choice from logits: greedy, or temperature / top-k / top-p sampling with a generator."""
from __future__ import annotations

import torch


def filter_top_k_top_p(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [N, V] -> logits with tokens outside the top-k / the top-p nucleus set to -inf.

    The nucleus keeps the smallest set of highest-probability tokens whose mass reaches top_p (the
    token that crosses top_p is kept, so at least one token always survives).
    """
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        drop_sorted = mass_before >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> the base distribution every sampler draws from, fp32 [..., V]:
    softmax(filter_top_k_top_p(logits / temperature)). Plain sampling (next_tokens) and speculative
    rejection sampling (ops.rejection_verify) share this one definition. temperature > 0."""
    z = logits.float() / temperature
    shape = z.shape
    return filter_top_k_top_p(z.reshape(-1, shape[-1]), top_k, top_p).softmax(dim=-1).view(shape)


def inverse_cdf_sample(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [N, V] >= 0 (rows need not be normalised, each with some positive entry), u [N] uniforms in
    [0, 1) -> token ids [N] drawn from weights / weights.sum(-1) by inverse CDF: the first i with
    cdf[i] > u * cdf[V - 1]. A token of weight 0 is never drawn: its cdf entry is set to the running maximum
    of the entries before it, so an earlier index always holds the same value (a sequential cumsum gives
    that already; a GPU's parallel scan can round entries i - 1 and i differently, even out of order, and
    the running maximum also keeps the cdf monotone for searchsorted). The clamp to the last positive token
    covers u * total rounding up to total. No host read, no generator: the caller's uniforms (device-side
    Philox in a CUDA graph) make the draw."""
    V = weights.shape[-1]
    positive = weights > 0
    cdf = torch.where(positive, weights.float().cumsum(dim=-1), 0.0).cummax(dim=-1).values  # [N, V]
    x = (u * cdf[:, -1])[:, None]  # [N, 1]
    idx = torch.searchsorted(cdf, x, right=True)[:, 0]
    last = (V - 1) - positive.flip(-1).to(torch.int32).argmax(dim=-1)  # the last token with weight > 0
    return torch.minimum(idx, last)


def next_tokens(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [N, V] -> token ids [N] (int64). temperature 0: argmax."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
