"""One speculative decoding step, all on the device, and the loop around it.

draft (heads on the nodes of each depth, top-k children) -> verify forward (tree attention) ->
acceptance (path, accept length, next root, last node) -> commit_kv -> seqlens += accept length.
The host reads each step's accepted tokens once, to stream them and to stop on EOS / max_new_tokens.
"""
from __future__ import annotations

import torch

from . import ops
from .emit import Emitter
from .ops.backend import op_backend, resolved_name


def speculative_loop(model, drafter, tree, cache, prefill_hidden, lengths, root, emitter: Emitter, *,
                     temperature, acceptance, posterior_threshold, posterior_alpha, generator, backend,
                     host_seqlens: list[int], stats) -> None:
    """Decode until every sequence is done. prefill_hidden [B, L, H] (right-padded), root [B] (already
    emitted). `stats.num_steps` counts verify forwards."""
    B = root.shape[0]
    dev = root.device
    bidx = torch.arange(B, device=dev)[:, None]
    state = drafter.start(model, B, cache.max_seq_len)
    h = drafter.after_prefill(state, prefill_hidden, lengths)
    active = torch.ones(B, dtype=torch.long, device=dev)
    T = tree.num_nodes
    greedy = acceptance == "greedy" or temperature == 0.0
    be = {op: op_backend(op, backend, dev) for op in ("tree_attention", "greedy_verify", "typical_verify", "commit_kv",
                                                 "tree_inputs", "lm_head_topk", "lm_head_sample_stats",
                                                 "typical_accept")}
    # typical acceptance runs fused when the LM-head statistics op is a kernel (Triton); the reference
    # backend keeps the logits-based definition (ops.typical_verify)
    typical_fused = (not greedy and model.output.bias is None
                     and resolved_name("lm_head_sample_stats", be["lm_head_sample_stats"], dev) == "triton")
    while not emitter.all_done:
        positions = None
        if drafter.config.grounded:  # Hydra: each depth conditions on the tokens drafted before it
            tokens = drafter.draft(model, h, root, tree, backend=backend)  # [B, T]
        else:  # Medusa: all depths at once, then tokens and positions built on the device
            cand = drafter.medusa_candidates(model, h, tree, backend=backend)
            tokens, positions = ops.tree_inputs(root, cand, tree.flat_source, tree.depths, cache.seqlens,
                                                backend=be["tree_inputs"])
        kv_len = max(host_seqlens) + T
        hidden = model.step(tokens, cache, tree.mask, tree.depths, positions=positions, kv_len=kv_len,
                            backend=be["tree_attention"])  # [B, T, H]
        if greedy:  # the base argmax after every node, as plain decoding picks it (Llama.greedy_tokens)
            target = model.greedy_tokens(hidden, be["lm_head_topk"])
            v = ops.greedy_verify(target, tokens, tree.paths, backend=be["greedy_verify"])
        elif typical_fused:  # LM-head statistics + fused acceptance: no [B, T, V] logits, no host read
            W = model.output.weight
            seed = torch.randint(2**62, (1,), device=dev, generator=generator)
            lse, ent, samples = ops.lm_head_sample_stats(hidden, W, temperature, seed, backend=be["lm_head_sample_stats"])
            cl = ops.reference.child_logits(hidden, W, tokens, tree.parents, temperature)
            v = ops.typical_accept(lse, ent, cl, samples, tree.paths, posterior_threshold=posterior_threshold,
                                   posterior_alpha=posterior_alpha, backend=be["typical_accept"])
        else:
            logits = model.output(hidden)  # [B, T, V]
            v = ops.typical_verify(logits, tokens, tree.paths, temperature=temperature,
                                   posterior_threshold=posterior_threshold, posterior_alpha=posterior_alpha,
                                   generator=generator, backend=be["typical_verify"])
        n = v.accept_lengths * active  # finished sequences commit nothing (their rows stay in the buffer)
        ops.commit_kv(cache.kv, cache.seqlens, v.accept_indices, n, backend=be["commit_kv"])
        idx = v.accept_indices.clamp(min=0)  # [B, D+1]
        h = drafter.after_step(state, hidden[bidx, idx], n)
        cache.advance(n.to(cache.seqlens.dtype))
        root = v.next_root
        stats.num_steps += 1
        # the one host read of the step: accepted tokens (root first, already emitted) and the next root
        accepted = torch.cat([tokens.gather(1, idx), root[:, None], n[:, None]], dim=1).tolist()
        for b, row in enumerate(accepted):
            k = row[-1]
            host_seqlens[b] += k
            if k:
                emitter.emit(b, row[1:k] + [row[-2]], in_step=True)
            if emitter.done[b]:
                active[b] = 0
