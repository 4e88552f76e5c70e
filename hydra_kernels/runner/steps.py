"""The decode runner's step functions: one decoding step each, all on the device, no host read and no host
int that changes from step to step (kv_len is a bucket: constant over many steps, part of a graph's key).
The runner (runner/decode.py) calls them eagerly, replays them from CUDA graphs, or (tests) traces them
with torch.compile(fullgraph=True); every input and output is a tensor the runner owns (static buffers)
or a constant of the graph.

plain_step: the last token through the model (Llama.step, T = 1), the committed row, the next token:
    greedy (Llama.greedy_tokens, the path plain decoding and verification share) or sampled from the
    plain sampler's law (sampling.sampling_probs) with device-side Philox noise (sample_tokens).
greedy_spec_step: speculative.greedy_verify_step (verify forward over a tree, base argmax, greedy
    acceptance, commit_kv, seqlens advance) plus the gathers the loop and the drafter read after it.
rejection_spec_step: the same step accepted by exact rejection sampling, its uniforms from the plain
    sampler's Philox stream (philox_draws).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..ops.philox import philox_uniform
from .. import ops
from ..sampling import inverse_cdf_sample, sampling_probs
from ..speculative import commit_step, greedy_verify_step, verify_forward


class Sampler(NamedTuple):
    """Plain sampling's law (temperature > 0, top_k, top_p: constants of a graph) and its device-side
    noise: seed int64 [1] and offset int64 [1], the Philox counter of the next draw (advanced in place by
    every draw, so each replay of a graph draws fresh noise)."""

    temperature: float
    top_k: int
    top_p: float
    seed: torch.Tensor
    offset: torch.Tensor


def sample_tokens(logits: torch.Tensor, s: Sampler) -> torch.Tensor:
    """logits [N, V] -> token ids [N], drawn from sampling_probs(logits, temperature, top_k, top_p) (the
    law plain sampling's torch.multinomial draws from) by inverse CDF (sampling.inverse_cdf_sample) with one
    Philox uniform per row (ops.philox: tl.rand's bits). Advances s.offset by N."""
    probs = sampling_probs(logits, s.temperature, s.top_k, s.top_p)  # [N, V] fp32
    return inverse_cdf_sample(probs, philox_draws(s, probs.shape[0]))


def philox_draws(s: Sampler, n: int) -> torch.Tensor:
    """n fresh uniforms [n] in [0, 1) from the sampler's Philox stream: counters offset .. offset + n - 1,
    then offset += n (on the device: each replay of a graph draws the next ones)."""
    u = philox_uniform(s.seed, s.offset + torch.arange(n, device=s.offset.device))
    s.offset.add_(n)
    return u


def plain_step(model, cache, tokens: torch.Tensor, live: torch.Tensor, *, kv_len: int, backends,
               sampler: Sampler | None = None, capture=None):
    """One plain decoding step. tokens int64 [B]: each sequence's last token (its K/V row is written at
    seqlens[b]); live int32 [B]: 1 for a real sequence (its row is committed: seqlens += 1), 0 for a row
    that pads the batch to its bucket. kv_len: a bucket >= every seqlens + 1 (a constant of the graph).
    Writes the next tokens into `tokens` (the next step's input; a graph feeds itself) and returns
    (them [B], the drafter's features of the step [B, 1, ...]: the final hidden states, or with capture
    the captured layers' inputs)."""
    out = model.step(tokens[:, None], cache, kv_len=kv_len, backends=backends, capture=capture)
    hidden, feats = out if capture is not None else (out, out)  # [B, 1, H]
    cache.advance(live)
    h = hidden[:, -1]
    nxt = model.greedy_tokens(h, backends) if sampler is None else sample_tokens(model.output(h), sampler)
    tokens.copy_(nxt)
    return nxt, feats


class SpecOut(NamedTuple):
    """What a speculative step leaves for the loop: the drafter's inputs (accepted_feats [B, D+1, ...],
    accepted_tokens [B, D+1] root first, n [B] committed lengths), next_root [B], target [B, T] (the base
    argmax after every node: lookahead's observe_tokens; [B, 0] after a sampled step), and report
    [B, D+3] = (accepted tokens, next root, n): the one tensor the host reads."""

    accepted_feats: torch.Tensor
    accepted_tokens: torch.Tensor
    n: torch.Tensor
    next_root: torch.Tensor
    target: torch.Tensor
    report: torch.Tensor


def greedy_spec_step(model, cache, tokens: torch.Tensor, tree, active: torch.Tensor, *, kv_len: int, backends,
                     capture=None) -> SpecOut:
    """One greedy speculative step after the draft: tokens int64 [B, T] over `tree` (anything with the
    tree's mask / depths / paths tensors: a Tree, a TreeBatch, or the runner's static copies of them),
    active int64 [B] (0: finished or padding, commits nothing), kv_len a bucket >= every seqlens + T."""
    feats, target, v, n = greedy_verify_step(model, cache, tokens, tree, active, kv_len=kv_len, backends=backends,
                                             capture=capture)
    return _spec_out(tokens, feats, v, n, target)


def rejection_spec_step(model, cache, tokens: torch.Tensor, tree, active: torch.Tensor, *, kv_len: int, backends,
                        sampler: Sampler, capture=None) -> SpecOut:
    """One speculative step accepted by exact rejection sampling (ops.rejection_verify, deterministic
    drafts: the emitted tokens follow sampling_probs(temperature, top_k, top_p), the plain sampler's law), its
    B x (T + 1) uniforms from the sampler's Philox stream instead of a torch.Generator: one per node (the
    acceptance draws) and one per sequence (the next root, by inverse CDF over the residual). The uniforms
    are i.i.d. U[0, 1) and drawn after the tokens were fixed, which is all the exactness argument in
    rejection_verify's docstring needs. target is empty ([B, 0]): after a sampled step the loop hands the
    drafter no base argmax, as the eager loop does. The step keeps the [B, T, V] logits and probabilities in
    the graph's pool (the eager loop's fused LM-head path avoids them where the law is unfiltered; not in
    graphs yet)."""
    B, T = tokens.shape
    hidden, feats = verify_forward(model, cache, tokens, tree, kv_len=kv_len, backends=backends, capture=capture)
    logits = model.output(hidden)  # [B, T, V]
    noise = philox_draws(sampler, B * (T + 1))
    v = ops.rejection_verify(logits, tokens, tree.paths, temperature=sampler.temperature, top_k=sampler.top_k,
                             top_p=sampler.top_p, noise=(noise[:B * T].view(B, T), noise[B * T:]),
                             backend=backends["rejection_verify"])
    n = commit_step(cache, v, active, backends)
    return _spec_out(tokens, feats, v, n, tokens.new_zeros(B, 0))


def _spec_out(tokens, feats, v, n, target) -> SpecOut:
    """The gathers the loop and the drafter read after a verified step (v: ops.Verification-like)."""
    idx = v.accept_indices.clamp(min=0)  # [B, D+1]
    bidx = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
    accepted = tokens.gather(1, idx)  # [B, D+1], root first
    report = torch.cat([accepted, v.next_root[:, None], n[:, None]], dim=1)
    return SpecOut(feats[bidx, idx], accepted, n, v.next_root, target, report)
