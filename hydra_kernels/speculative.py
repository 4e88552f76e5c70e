"""One speculative decoding step, all on the device, and the loop around it. Knows no drafting family:
it calls only the Drafter protocol (drafters/protocol.py).

budget (budget.py: the step's node count from the batch size and context; 1 = a plain step, the root
alone, the drafter only catching up; or adaptive.py: the drafter's parts that pay propose, then the nodes
that pay are kept) -> propose (draft tokens + their tree: static or one per sequence)
-> verify forward (tree attention) ->
acceptance (path, accept length, next root) -> commit_kv -> seqlens += accept length -> the drafter
sees the committed tokens (host-side drafters also get their host copy: Drafter.observe_tokens). The
host reads each step's accepted tokens once, to stream them and to stop on EOS / max_new_tokens.
"""
from __future__ import annotations

import torch

from . import ops
from .budget import StepBudget
from .drafters.protocol import Proposal
from .emit import Emitter
from .model.plain_step import native_plain_step
from .model.tree_step import native_tree_step
from .sampling import filter_top_k_top_p
from .tree import Tree, TreeBatch


def speculative_loop(model, drafter, tree, cache, prefill_hidden, lengths, root, emitter: Emitter, *,
                     temperature, acceptance, posterior_threshold, posterior_alpha, generator, backends,
                     host_seqlens: list[int], stats, prompts: list[list[int]], top_k: int = 0,
                     top_p: float = 1.0, budget: StepBudget | None = None, runner=None, buffers=None,
                     batch: int | None = None, sampler=None) -> None:
    """Decode until every sequence is done. tree: drafter.resolve_tree's (bounds every proposal);
    prefill_hidden [B, L, H] (right-padded; for a drafter with feature_layers, the prefill's captured
    layer inputs [B, L, n * H]), root [B] (already emitted); backends: the run's
    BackendPlan. acceptance: "greedy" | "rejection" | "typical"; top_k / top_p shape the base
    distribution of the sampling kinds. Sampling with temperature only, where the plan's LM-head
    statistics ops are kernels (Triton), accepts from those statistics (typical: typical_accept;
    rejection of deterministic drafts: rejection_accept), never writing the [B, T, V] logits; otherwise
    from the logits. A proposal's draft_probs (sampled drafts) go to rejection acceptance on the logits
    path (min(1, p/q)); greedy acceptance (exact for any draft) and typical acceptance (it judges p
    alone) ignore them. prompts: the host token lists. `stats.num_steps` counts verify forwards,
    `stats.step_nodes` each step's node budget. budget: the run's StepBudget (None: the full tree every
    step; an adaptive one runs adaptive.AdaptiveBudget and sets `stats.policy_s`; `stats.seq_step_nodes`,
    `depth_drafted` and `depth_accepted` record each step per sequence). runner (hydra_kernels/runner,
    greedy or rejection acceptance): the steps run through it over `buffers` (its StepBuffers: the cache,
    `active`); the rows are then the batch padded to its bucket (padding rows inactive throughout) and
    `batch` the real batch size the budget is chosen by; with rejection sampling `sampler` (the runner's
    Sampler: the law's constants and its Philox stream) draws the acceptance noise, and a proposal with
    sampled drafts (draft_probs) is verified eagerly."""
    B = root.shape[0]
    batch = batch or B
    dev = root.device
    bidx = torch.arange(B, device=dev)[:, None]
    capture = drafter.feature_layers  # None: the drafter reads the final hidden states
    state = drafter.start(model, B, cache.max_seq_len, tree, backends)
    drafter.use_generator(state, generator)  # a drafter that samples its drafts draws from the run's generator
    drafter.after_prefill(state, prefill_hidden, lengths)
    drafter.observe_tokens(state, [p + s[:1] for p, s in zip(prompts, emitter.sequences)])  # prompt + root
    active = torch.ones(B, dtype=torch.long, device=dev) if runner is None else buffers.active
    for b in range(batch):  # the host's copy of active is `not emitter.done`: a sequence done at its first token
        if emitter.done[b]:  # (max_new_tokens 1, an EOS) commits nothing and skips its attention from the start
            active[b] = 0
    greedy = acceptance == "greedy" or temperature == 0.0
    target = None
    filtered = top_k > 0 or top_p < 1.0
    typical_fused = (acceptance == "typical" and not greedy and not filtered and model.output.bias is None
                     and backends.fused_lm_head_statistics)
    # exact rejection sampling from the LM head's lse and residual samples (temperature only: a top-k /
    # top-p law needs the filtered logits). A node has at most num_nodes - 1 children, and fewer than V
    # of them must leave a token to draw (lm_head_residual_sample's C < V)
    rejection_fused = (acceptance == "rejection" and not greedy and not filtered and model.output.bias is None
                       and backends.fused_residual_sampling and tree.num_nodes <= model.output.weight.shape[0])
    budget = budget or StepBudget(tree.num_nodes)
    drafting = tree.num_nodes  # the node budget the drafter's state drafts now (start: the full tree)
    root_only = Tree([]).to(dev)  # a plain step: the root alone, verified like any tree
    # greedy plain steps in one native call where it applies (no captured layers; model/plain_step.py)
    native = native_plain_step(model, cache, backends) if greedy and capture is None and runner is None else None
    # and greedy verify steps (model/tree_step.py), where the same holds
    native_tree = native_tree_step(model, cache, backends) if native is not None else None
    # the last verified step's accept_indices [B, D+1], its tokens [B, T] and (greedy) the base argmax after each node
    # [B, T] (else None): the adaptive budget learns from them
    last_accept = [None]

    def _verify_and_emit(prop: Proposal, nodes: int, context: int) -> torch.Tensor:
        """Verify `prop` (nodes: its step's node budget), commit, emit; returns the next root."""
        nonlocal target
        stats.step_nodes.append(nodes)
        tokens, tr = prop.tokens, prop.tree  # [B, T]; tr: Tree or TreeBatch
        kv_len = context + tr.num_nodes
        so = None
        if runner is not None and (greedy or prop.draft_probs is None):  # greedy acceptance ignores draft_probs
            so = runner.spec(buffers, tokens, tr, context, backends, capture=capture, nodes=nodes, depth=tree.depth,
                             sampler=None if greedy else sampler)
        elif runner is not None:
            from .runner.graphs import warn_once  # here: the runner's modules import this one

            warn_once("sampled drafts (draft_probs) are verified by the eager rejection step (min(1, p/q) "
                              "is not captured yet)")
        if so is not None:  # the step replayed (or run) by the runner over its static buffers
            drafter.after_step(state, so.accepted_feats, so.accepted_tokens, so.n)
            root = so.next_root
            stats.num_steps += 1
            report = runner.read(so.report)
            record_step(stats, [(tr.num_nodes, tr.depth)] * len(report), [row[-1] for row in report])  # bounds
            # the base argmax goes to the drafter after greedy steps only, as in the eager loop
            _emit_step(drafter, state, report, so.target if greedy else None, host_seqlens, emitter, active)
            last_accept[0] = None  # the runner's report holds no node ids
            return root
        if greedy and native_tree is not None:  # the same step in one native call; a finished sequence (active 0)
            # skips its attention (its rows are not read): at long context most of its share of the step
            attend = active if any(emitter.done) else None
            feats, target, v, n = native_tree(tokens, tr, active, prop.positions, kv_len, attend)
        elif greedy:  # forward, acceptance, commit in one function with no host read (greedy_verify_step)
            feats, target, v, n = greedy_verify_step(model, cache, tokens, tr, active, positions=prop.positions,
                                                     kv_len=kv_len, backends=backends, capture=capture)
        else:
            hidden, feats = verify_forward(model, cache, tokens, tr, positions=prop.positions, kv_len=kv_len,
                                           backends=backends, capture=capture)
            if typical_fused:  # LM-head statistics + fused acceptance: no [B, T, V] logits, no host read
                W = model.lm_head_weight()
                seed = torch.randint(2**62, (1,), device=dev, generator=generator)
                lse, ent, samples = ops.lm_head_sample_stats(hidden, W, temperature, seed,
                                                             backend=backends["lm_head_sample_stats"])
                cl = ops.reference.child_logits(hidden, W, tokens, tr.parents, temperature)
                v = ops.typical_accept(lse, ent, cl, samples, tr.paths, posterior_threshold=posterior_threshold,
                                       posterior_alpha=posterior_alpha, backend=backends["typical_accept"])
            elif rejection_fused and prop.draft_probs is None:  # exact, from LM-head statistics: no [B, T, V]
                # probabilities, no host read (sampled drafts need q: the logits path below)
                W = model.lm_head_weight()
                u = torch.rand(tokens.shape, device=dev, generator=generator)  # one acceptance draw per node
                seed = torch.randint(2**62, (1,), device=dev, generator=generator)  # the residual draws' noise
                exclude = ops.reference.child_tokens(tokens, tr.parents, max(tr.max_children, 1))  # [B, T, C]
                lse, samples = ops.lm_head_residual_sample(hidden, W, temperature, seed, exclude,
                                                           backend=backends["lm_head_residual_sample"])
                cl = ops.reference.child_logits(hidden, W, tokens, tr.parents, temperature)
                v = ops.rejection_accept(lse, cl, samples, u, tokens, tr.parents, depth=tr.depth,
                                         backend=backends["rejection_accept"])
            elif acceptance == "rejection":  # exact: the emitted tokens follow the plain sampler's law
                # sampled drafts (prop.draft_probs: the q each token was drawn from) accept with min(1, p/q)
                v = ops.rejection_verify(model.output(hidden), tokens, tr.paths, temperature=temperature, top_k=top_k,
                                         top_p=top_p, generator=generator, draft_probs=prop.draft_probs,
                                         backend=backends["rejection_verify"])
            else:
                logits, t = model.output(hidden), temperature  # [B, T, V]
                if filtered:  # typical acceptance judged on the same top-k / top-p distribution plain sampling uses
                    logits, t = filter_top_k_top_p(logits.float() / temperature, top_k, top_p), 1.0
                v = ops.typical_verify(logits, tokens, tr.paths, temperature=t,
                                       posterior_threshold=posterior_threshold, posterior_alpha=posterior_alpha,
                                       generator=generator, backend=backends["typical_verify"])
            n = commit_step(cache, v, active, backends)
        idx = v.accept_indices.clamp(min=0)  # [B, D+1]
        accepted_tokens = tokens.gather(1, idx)  # [B, D+1], root first
        drafter.after_step(state, feats[bidx, idx], accepted_tokens, n)
        root = v.next_root
        stats.num_steps += 1
        # the one host read of the step: per sequence its tree's nodes and depth, the accepted tokens (root
        # first, already emitted), the next root and the committed length
        report = [accepted_tokens, root[:, None], n[:, None]]
        if isinstance(tr, TreeBatch):  # each sequence's own tree size and depth ride on the same read
            report = [tr.valid.sum(1, keepdim=True), tr.depths.amax(1, keepdim=True)] + report
        rows = torch.cat(report, dim=1).tolist()
        if isinstance(tr, TreeBatch):
            shapes, rows = [(r[0], r[1]) for r in rows], [r[2:] for r in rows]
        else:  # a static tree: known on the host
            shapes = [(tr.num_nodes, tr.depth)] * B
        record_step(stats, shapes, [r[-1] for r in rows])
        _emit_step(drafter, state, rows, target, host_seqlens, emitter, active)
        last_accept[0] = (v.accept_indices, tokens, target if greedy else None)
        return root

    cap = max(drafter.budget_levels(tree))  # the drafter's own bound (the combined drafter's node_budget)
    policy = budget.policy(drafter, batch, cap, model, dev)  # None unless the budget is adaptive (adaptive.py)
    if policy is not None:
        if cap != drafting:
            drafter.set_budget(state, cap)
            drafting = cap
        policy.begin()
    try:
        while not emitter.all_done:
            context = max(host_seqlens)  # host-side bound on every committed length
            if policy is not None:
                parts = policy.plan(host_seqlens, emitter.done)  # the step's size: who attends, over how much
                prop = None
                if any(parts):  # the parts that pay draft; the policy keeps the nodes that pay (None: none)
                    emitted = [len(s) for s in emitter.sequences] if batch > 1 else None  # who holds the end back
                    prop = policy.propose(drafter, state, root, cache.seqlens, active, parts, emitted)
                else:
                    drafter.skip_step(state, root, cache.seqlens)
                    policy.plain_step()
                nodes = 1 if prop is None else prop.tree.num_nodes
            else:
                nodes = budget.nodes(batch, context)  # finished sequences still take their rows in the step
                if nodes <= 1:
                    drafter.skip_step(state, root, cache.seqlens)
                elif nodes != drafting:
                    drafter.set_budget(state, nodes)
                    drafting = nodes
            if nodes <= 1:
                if greedy and runner is not None:
                    root = _runner_plain_greedy_step(runner, buffers, drafter, state, root, backends, capture, context,
                                                     host_seqlens, emitter, stats)
                elif greedy:  # a plain step as plain decoding runs it: no tree, no verify op, no commit copy
                    root = _plain_greedy_step(model, drafter, state, cache, root, active, backends, capture,
                                              context, host_seqlens, emitter, stats, native)
                else:  # sampling: the root verified as a root-only tree (the exact law)
                    root = _verify_and_emit(Proposal(root[:, None], root_only), 1, context)
                if policy is not None:
                    policy.observe(None)
                continue
            if policy is None:
                prop = drafter.propose(state, root, cache.seqlens)
            root = _verify_and_emit(prop, nodes, context)
            if policy is not None:
                policy.observe(*(last_accept[0] or (None,)))
    finally:
        if policy is not None:
            policy.finish()
            stats.policy_s = policy.host_s


def record_step(stats, shapes: list[tuple[int, int]], committed: list[int]) -> None:
    """GenerateOutput's per-sequence figures of one step: shapes[b] = (nodes, depth) of sequence b's
    verified tree, committed[b] its committed length (0: finished before the step, not counted)."""
    for b, ((nodes, depth), k) in enumerate(zip(shapes, committed)):
        if not k or b >= len(stats.seq_step_nodes):  # finished, or a padding row of the runner's bucket
            continue
        stats.seq_step_nodes[b].append(nodes)
        for lst, reach in ((stats.depth_drafted, depth), (stats.depth_accepted, k - 1)):
            if len(lst) <= reach:
                lst.extend([0] * (reach + 1 - len(lst)))
            for d in range(1, reach + 1):
                lst[d] += 1


def _emit_step(drafter, state, accepted: list[list[int]], target, host_seqlens: list[int], emitter: Emitter,
               active: torch.Tensor) -> None:
    """After a speculative step's host read: accepted rows (accepted tokens root first, the next root, the
    committed length k) to the drafter's host copy, the committed lengths, the emitter; a sequence that
    finishes here stops committing (active 0)."""
    drafter.observe_tokens(state, [row[1:row[-1]] + [row[-2]] if row[-1] else [] for row in accepted], target)
    for b, row in enumerate(accepted):
        k = row[-1]
        host_seqlens[b] += k
        if k:
            emitter.emit(b, row[1:k] + [row[-2]], in_step=True)
            if emitter.done[b]:
                active[b] = 0


def greedy_verify_step(model, cache, tokens, tree, active, *, positions=None, kv_len: int, backends, capture=None):
    """The device part of one greedy speculative step: the verify forward of tokens [B, T] over `tree`
    (a Tree or TreeBatch), the base argmax after every node (Llama.greedy_tokens, as plain decoding picks
    it), greedy acceptance, and the commit (commit_step). active int [B] (0: a finished sequence, commits
    nothing); kv_len: a host-known bound on seqlens + T. Returns (the drafter's features [B, T, ...]: the
    final hidden states, or with capture the captured layers' inputs; target [B, T]; the Verification;
    the committed lengths n [B]).

    No host read and no graph break: on the CPU torch.compile(fullgraph=True) traces it as one graph
    (tests/test_compiled_step.py; the ops' value checks run in eager calls only, ops.values_checkable),
    and no host sync is what a CUDA graph capture needs too (not yet run on a GPU). The loop around it
    stays eager by design: its one host read per step (the accepted tokens, to stream them and stop)
    and the host-side budget and drafter bookkeeping."""
    hidden, feats = verify_forward(model, cache, tokens, tree, positions=positions, kv_len=kv_len,
                                   backends=backends, capture=capture)
    target = model.greedy_tokens(hidden, backends)  # [B, T]
    v = ops.greedy_verify(target, tokens, tree.paths, backend=backends["greedy_verify"])
    return feats, target, v, commit_step(cache, v, active, backends)


def verify_forward(model, cache, tokens, tree, *, positions=None, kv_len: int, backends, capture=None):
    """The verify forward of tokens [B, T] over `tree` -> (final hidden states [B, T, H], the drafter's
    features: those states, or with capture the captured layers' inputs [B, T, n * H])."""
    out = model.step(tokens, cache, tree.mask, tree.depths, positions=positions, kv_len=kv_len,
                     backends=backends, capture=capture)
    return out if capture is not None else (out, out)


def commit_step(cache, v, active, backends) -> torch.Tensor:
    """Commit a verified step: each active sequence's accepted rows move down after its prefix (commit_kv)
    and its committed length grows by its accept length; finished sequences (active 0) commit nothing
    (their rows stay in the buffer). Returns the committed lengths n [B]. Advancing before the drafter's
    after_step is safe: no drafter reads the base model's cache there."""
    n = v.accept_lengths * active
    ops.commit_kv(cache.kv, cache.seqlens, v.accept_indices, n, backend=backends["commit_kv"])
    cache.advance(n.to(cache.seqlens.dtype))
    return n


def _plain_greedy_step(model, drafter, state, cache, root, active, backends, capture, context: int,
                       host_seqlens: list[int], emitter: Emitter, stats, native=None) -> torch.Tensor:
    """One greedy plain step inside a speculative run (budget 1): the root alone through the model as
    plain decoding feeds it (Llama.step without a tree; the same rows and the same argmax path, so the
    same tokens), committed in place for the active sequences; the drafter sees its one accepted token.
    native: the run's native plain step (model/plain_step.py, no capture), which gives the same tokens and
    hidden states in one call. Returns the next root."""
    stats.step_nodes.append(1)
    if native is not None and not any(emitter.done):  # every sequence active (active[b] drops to 0 only where
        # done[b]): plain decoding's own step (the commit advances every row, as advance(active) would here)
        return _native_plain_greedy_step(drafter, state, root, active, context, host_seqlens, emitter, stats, native)
    if native is not None:  # a finished sequence (active 0) skips its attention: its token is not read
        nxt, hidden = native(root, context + 1, commit=False, attend=active)  # [B], [B, H]
        feats = hidden[:, None]  # [B, 1, H]: Llama.step's output
    else:
        hidden = model.step(root[:, None], cache, kv_len=context + 1, backends=backends, capture=capture)
        hidden, feats = hidden if capture is not None else (hidden, hidden)  # [B, 1, H]; the drafter's features
        nxt = model.greedy_tokens(hidden[:, -1], backends)  # [B]
    n = active.clone()  # accept lengths: 1 per active sequence (active changes below; drafters may keep n)
    drafter.after_step(state, feats, root[:, None], n)
    cache.advance(n.to(cache.seqlens.dtype))  # the row was written at seqlens: committing is advancing
    stats.num_steps += 1
    rows = torch.stack([nxt, active]).tolist()  # the one host read of the step
    record_step(stats, [(1, 0)] * len(rows[1]), rows[1])
    drafter.observe_tokens(state, [[t] if a else [] for t, a in zip(*rows)], None)
    for b, (t, a) in enumerate(zip(*rows)):
        if a:
            host_seqlens[b] += 1
            emitter.emit(b, [t], in_step=True)
            if emitter.done[b]:
                active[b] = 0
    return nxt


def _native_plain_greedy_step(drafter, state, root, active, context: int, host_seqlens: list[int], emitter: Emitter,
                              stats, native) -> torch.Tensor:
    """_plain_greedy_step where every sequence is active, with the fewest calls around the native step: the
    step commits every row, the host read is the next tokens alone, a plain step's record is one node per
    sequence. Why: each call after the native step runs with cold caches (the step streams the weights through
    them), so a call that takes 1-3 us in a loop of its own took 10-35 us here (EPYC VM, 2026-11-29: 0.16 ms of a
    batch-1 plain step's ~6 ms went to the bookkeeping around the native call, against ~0.05 ms in plain
    decoding's loop). Same tokens, rows and drafter calls as _plain_greedy_step."""
    nxt, hidden = native(root, context + 1)  # [B], [B, H]; seqlens advanced by one
    drafter.after_plain_step(state, hidden, root)
    stats.num_steps += 1
    toks = nxt.tolist()  # the one host read of the step
    for b in range(len(toks)):
        stats.seq_step_nodes[b].append(1)  # record_step of a one-node step: no depth drafted or accepted
    for lst in (stats.depth_drafted, stats.depth_accepted):
        if not lst:  # as record_step leaves them: depth 0's slot
            lst.append(0)
    drafter.observe_tokens(state, [[t] for t in toks], None)
    for b, t in enumerate(toks):
        host_seqlens[b] += 1
        emitter.emit(b, [t], in_step=True)
        if emitter.done[b]:
            active[b] = 0
    return nxt


def _runner_plain_greedy_step(runner, buffers, drafter, state, root, backends, capture, context: int,
                              host_seqlens: list[int], emitter: Emitter, stats) -> torch.Tensor:
    """_plain_greedy_step through the decode runner (its plain step over buffers.tokens, the active rows
    committed): the same rows, tokens and drafter calls. Returns the next root."""
    stats.step_nodes.append(1)
    buffers.tokens.copy_(root)
    was_active = [not d for d in emitter.done]  # the host's copy of buffers.active
    n = buffers.active.clone()  # accept lengths: 1 per active sequence (active changes below)
    nxt, feats = runner.plain(buffers, context, backends, capture=capture, live=buffers.active, keep=True)
    drafter.after_step(state, feats, root[:, None], n)
    stats.num_steps += 1
    toks = runner.read(nxt)  # the one host read of the step
    record_step(stats, [(1, 0)] * len(toks), [int(a) for a in was_active])
    drafter.observe_tokens(state, [[t] if a else [] for t, a in zip(toks, was_active)], None)
    for b, (t, a) in enumerate(zip(toks, was_active)):
        if a:
            host_seqlens[b] += 1
            emitter.emit(b, [t], in_step=True)
            if emitter.done[b]:
                buffers.active[b] = 0
    return nxt
