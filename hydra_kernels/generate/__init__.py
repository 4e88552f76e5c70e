"""generate(): the decoding loop engines import. ``python -m hydra_kernels.generate`` is its CLI
(hydra_kernels/cli.py, run from __main__.py).

One step = one base-model forward after the prefill. Plain decoding feeds the last token and emits
one; speculative decoding (drafter given) verifies a tree and emits root + accepted tokens. The host
reads each step's tokens only to stream them and to stop on EOS / max_new_tokens.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import budget as budgets
from .. import runner as runners
from ..drafters.protocol import Drafter
from ..emit import Emitter
from ..model.llama import Llama
from ..model.plain_step import native_plain_step
from ..ops.backend import plan_backends
from ..sampling import next_tokens
from ..speculative import speculative_loop
from . import arguments as args

ACCEPTANCE_KINDS = ("greedy", "rejection", "typical")


@dataclass
class GenerateOutput:
    sequences: list[list[int]]  # new tokens per sequence, prompt excluded, EOS kept when emitted
    num_steps: int = 0  # base-model forwards after prefill
    accept_lengths: list[list[int]] = field(default_factory=list)  # per sequence: tokens emitted per step
    prefill_s: float = 0.0  # prefill forward and the first token
    decode_s: float = 0.0  # every step after it
    step_nodes: list[int] = field(default_factory=list)  # speculative: each step's node budget (1 = a plain step)
    # speculative: per sequence, its proposal's tree nodes at each step it was active (root included; 1 = plain)
    seq_step_nodes: list[list[int]] = field(default_factory=list)
    # speculative: [d] = (sequence, step) pairs whose verified tree reached depth d / whose accepted path did
    depth_drafted: list[int] = field(default_factory=list)
    depth_accepted: list[int] = field(default_factory=list)
    policy_s: float = 0.0  # the adaptive budget's own host time (hydra_kernels/adaptive.py)

    @property
    def acceptance_by_depth(self) -> list[float]:
        """[d - 1] = how often depth d was accepted where a step drafted that deep (d = 1, 2, ...)."""
        return [a / n if n else 0.0 for a, n in zip(self.depth_accepted[1:], self.depth_drafted[1:])]

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens emitted per step, averaged over all steps of all sequences (0.0 before any step)."""
        steps = sum(len(a) for a in self.accept_lengths)
        return sum(map(sum, self.accept_lengths)) / steps if steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: tokens emitted by the steps (all sequences) / decode_s; prefill excluded."""
        n = sum(map(sum, self.accept_lengths))
        return n / self.decode_s if self.decode_s > 0 else 0.0


class GenerationError(RuntimeError):
    """Generation failed part-way; ``output`` holds every token produced before the failure."""

    def __init__(self, message: str, output: GenerateOutput):
        super().__init__(message)
        self.output = output


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C (a KeyboardInterrupt, e.g. raised by a streamer) stopped generation part-way. Still a
    KeyboardInterrupt (``except KeyboardInterrupt`` catches it); ``output`` holds every token produced."""

    def __init__(self, output: GenerateOutput):
        n = sum(map(len, output.sequences))
        super().__init__(f"generation interrupted after {n} tokens; partial output in .output")
        self.output = output


def generate(model: Llama, input_ids, drafter=None, max_new_tokens: int = 256, tree=None,
             temperature: float = 0.0, acceptance: str | None = None, eos_token_id=None, backend: str = "auto",
             *, top_k: int = 0, top_p: float = 1.0, seed: int | None = None, max_seq_len: int | None = None,
             posterior_threshold: float = 0.09, posterior_alpha: float = 0.3,
             streamer: Callable[[int, list[int]], None] | None = None, budget=None,
             cuda_graphs: bool | None = None) -> GenerateOutput:
    """Decode up to max_new_tokens new tokens for each prompt.

    model: a hydra_kernels Llama (hk.load_model / hk.Llama.from_hf). input_ids: LongTensor [B, L] or a
    list of token lists (ragged prompts).
    drafter=None: plain autoregressive decoding; temperature 0 is greedy, > 0 samples with top_k / top_p
    and a torch.Generator seeded with `seed`.
    drafter (hk.new_drafter / hk.load_drafter): speculative decoding over `tree` (a Tree, Medusa-format
    choices, a JSON file, "default" or "chain-N"; default: the tree searched for this device class and
    saved with the heads (drafter.trees, e.g. the shipped heads' CPU tree), else hk.tree.default_tree).
    budget (speculative only): the node budget of each step, 1 = a plain step (hydra_kernels/budget.py).
    "adaptive": each step's draft sized by its expected tokens per second, per sequence: the drafter's
    parts that pay run, each node's acceptance learned during the run, step costs timed
    (hydra_kernels/adaptive.py); the eager loop; a seeded sampled run is exact in law but not token for
    token reproducible (measured times steer it). "auto": the table searched for this drafter, tree and device
    class (budget_<device>.json), chosen from the live batch size and context (an error without one); an int: that
    many nodes every step. None (default): "adaptive" on the CPU under greedy acceptance when tree is None and such
    a table exists (every shipped drafter: the adaptive budget replaces the table there; budget.default_is_adaptive
    says why); elsewhere that table when tree is None and it exists (sampling: seeds stay reproducible; CUDA: steps
    replay from graphs), else the full tree. Where the budget is 1 for every step the request can take (a pinned 1,
    or a table's plain steps over this batch size and its whole context range), the run is plain decoding (the
    drafter is not run). GenerateOutput's step_nodes, seq_step_nodes, acceptance_by_depth and policy_s show what the
    steps drafted, what was accepted and what the adaptive budget's own work cost.
    acceptance (None: "greedy" at temperature 0, else "rejection"): "greedy" (temperature must be 0)
    emits exactly the plain greedy tokens; "rejection" (temperature > 0) is recursive rejection sampling
    over the tree, its tokens distributed exactly as plain sampling with the same temperature / top_k /
    top_p; "typical" (temperature > 0, posterior_threshold / posterior_alpha, judged on the top_k / top_p
    distribution) is Medusa's typical acceptance, not distribution-preserving. Head drafters with
    drafter.draft_temperature > 0 sample their drafts (each node's children i.i.d. from the head's
    softmax, drawn from the run's seeded generator); "rejection" then accepts with min(1, p/q).
    eos_token_id: int or list; None: the model config's; []: never stop early. Each sequence stops at its
    first EOS (kept in its output) or after exactly max_new_tokens tokens.
    max_seq_len: KV buffer rows per sequence (default: what the request needs).
    streamer(b, tokens): called with each sequence's newly emitted tokens, as they come.
    cuda_graphs: None (default): on a CUDA model each decode step is replayed from CUDA graphs (the decode
    runner, hydra_kernels/runner: captured on first use, cached on the model, reused by later calls; the
    batch padded to a bucket; one host read per step); elsewhere the eager loop. True: the same, with a
    warning where it cannot apply; False: the eager loop. A request the runner cannot capture (typical
    acceptance) decodes eagerly and says why once (a RuntimeWarning). Greedy tokens are the eager loop's;
    sampling through the runner, plain or speculative (rejection; a proposal of sampled drafts is verified
    eagerly), draws from the same law with device-side Philox noise (a seed gives the same tokens on every
    run, not the eager sampler's tokens).
    Raises TypeError / ValueError before any work on bad input (generate/arguments.py); GenerationError
    (with .output) on a mid-run failure; GenerationInterrupted, a KeyboardInterrupt with .output (the
    tokens produced so far), on Ctrl-C or a KeyboardInterrupt raised by the streamer.
    """
    if not isinstance(model, Llama):
        raise TypeError(f"model must be a hydra_kernels Llama (hk.load_model or hk.Llama.from_hf), got {type(model)}")
    if acceptance is None:
        acceptance = "greedy" if temperature == 0 else "rejection"
    if acceptance not in ACCEPTANCE_KINDS:
        raise ValueError(f"acceptance must be one of {ACCEPTANCE_KINDS}, got {acceptance!r}")
    max_new_tokens = args.as_int("max_new_tokens", max_new_tokens, low=1)
    temperature, top_k, top_p, seed, posterior_threshold, posterior_alpha = args.sampling_args(
        temperature, top_k, top_p, seed, posterior_threshold, posterior_alpha)
    args.check_streamer(streamer)
    cuda_graphs = args.cuda_graphs_arg(cuda_graphs)
    cfg, device = model.config, model.device
    prompts = args.prompts(input_ids, cfg.vocab_size)
    eos = args.eos_set(eos_token_id, cfg.eos_token_ids, cfg.vocab_size)
    lens = [len(p) for p in prompts]
    backends = plan_backends(backend, device, packed_weights=model.has_packed_weights)  # also HYDRA_KERNELS_BACKEND
    extra, tree_obj, step_budget, plain_run = 0, None, None, False
    if drafter is None:
        for name, value in (("tree", tree), ("budget", budget)):
            if value is not None:
                raise ValueError(f"{name} is only used with a drafter; pass {name}=None for plain decoding")
    else:
        if not isinstance(drafter, Drafter):
            raise TypeError(f"drafter must be a hydra_kernels Drafter (hk.new_drafter / hk.load_drafter), got {type(drafter)}")
        if acceptance == "greedy" and temperature > 0:
            raise ValueError("greedy acceptance is for temperature 0; use acceptance='rejection' (exact) or "
                             "'typical' to sample")
        drafter.check_model(model)
        tree_obj = drafter.resolve_tree(tree, device.type)  # validated; bounds every step's proposal
        backends.check_tree(tree_obj)  # the chosen kernels' own limits (e.g. accepted rows per commit)
        step_budget = budgets.choose(budget, drafter, tree_obj, tree, device.type, greedy=acceptance == "greedy")
        extra = tree_obj.num_nodes + tree_obj.depth  # a step writes T rows; a last step may commit depth+1
        if step_budget.plain_throughout(len(prompts), max(lens), max(lens) + max_new_tokens):
            drafter, extra, plain_run = None, 0, True  # nothing pays at any step: run plain decoding itself
    S = args.kv_rows(max_seq_len, max(lens), max_new_tokens, extra, cfg.max_position_embeddings)
    gen = None
    if temperature > 0:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed if seed is not None else int(torch.randint(2**62, ()).item()))
    if step_budget is not None and step_budget.adaptive and drafter is not None:
        # the runner's steps report no node ids (what the adaptive budget learns from) and pad the batch to a
        # bucket: the eager loop, whatever asked for the runner (cuda_graphs, runner.static_buffers())
        if cuda_graphs:
            warnings.warn("budget='adaptive' runs the eager loop (the decode runner cannot report which nodes "
                          "were accepted yet); pass budget='auto' or an int to replay steps from CUDA graphs",
                          RuntimeWarning, stacklevel=2)
        runner = None
    else:
        runner = runners.choose(cuda_graphs, model, drafter, acceptance, temperature)

    B = len(prompts)
    bufs, sampler = None, None
    if runner is not None:  # the batch padded to its bucket: rows of one token, inactive throughout
        bufs = runner.start(B, S)
        prompts = prompts + [[0]] * (bufs.bucket - B)
        if temperature > 0:  # the run's noise: Philox from the generator's first draw (seeded as above)
            runner.seed(bufs, int(torch.randint(2**62, (), generator=gen, device=device).item()))
            sampler = runner.sampler(bufs, temperature, top_k, top_p)
    run_lens = [len(p) for p in prompts]
    tokens = torch.zeros(len(prompts), max(lens), dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p)
    tokens, lengths = tokens.to(device), torch.tensor(run_lens, dtype=torch.int32, device=device)
    cache = model.new_kv_cache(B, S) if bufs is None else bufs.cache
    emitter = Emitter(len(prompts), max_new_tokens, eos, streamer)
    emitter.done[B:] = [True] * (len(prompts) - B)  # padding rows emit nothing
    out = GenerateOutput(sequences=emitter.sequences[:B], accept_lengths=emitter.accept_lengths[:B],
                         seq_step_nodes=[[] for _ in range(B)])

    def pick(h):  # final hidden states [N, H] -> next tokens [N]
        if temperature == 0.0:  # greedy: the same argmax path as verification (Llama.greedy_tokens)
            return model.greedy_tokens(h, backends)
        if sampler is not None:  # the runner's sampler: the same law, device-side noise
            return runners.sample_tokens(model.output(h), sampler)
        return next_tokens(model.output(h), temperature, top_k, top_p, gen)

    t0 = time.perf_counter()
    t1 = None
    try:
        with torch.inference_mode():
            capture = None if drafter is None else drafter.feature_layers  # EAGLE-3 reads intermediate layers
            hidden = model.prefill(tokens, lengths, cache, all_hidden=drafter is not None, capture=capture)
            hidden, feats = hidden if capture is not None else (hidden, hidden)  # feats: what the drafter reads
            last = hidden if drafter is None else hidden[torch.arange(len(prompts), device=device), lengths.long() - 1]
            nxt = pick(last)
            for b, t in enumerate(nxt.tolist()):
                emitter.emit(b, [t], in_step=False)
            t1 = time.perf_counter()
            out.prefill_s = t1 - t0
            if drafter is None and runner is not None:
                _runner_plain_loop(runner, bufs, nxt, emitter, sampler, backends, max(lens), out,
                                   count_nodes=plain_run)
            elif drafter is None:
                _plain_loop(model, cache, nxt, emitter, pick, backends, max(lens), out, count_nodes=plain_run,
                            greedy=temperature == 0.0)
            elif not emitter.all_done:
                speculative_loop(model, drafter, tree_obj, cache, feats, lengths, nxt, emitter,
                                 temperature=temperature, acceptance=acceptance,
                                 posterior_threshold=posterior_threshold, posterior_alpha=posterior_alpha,
                                 generator=gen, backends=backends, host_seqlens=list(run_lens), stats=out,
                                 top_k=top_k, top_p=top_p, prompts=prompts, budget=step_budget,
                                 runner=runner, buffers=bufs, batch=B, sampler=sampler)
    except KeyboardInterrupt as exc:
        _finish_timing(out, t0, t1)
        raise GenerationInterrupted(out) from exc
    except Exception as exc:
        _finish_timing(out, t0, t1)
        n = sum(map(len, out.sequences))
        raise GenerationError(f"generation failed after {n} tokens: {exc!r}; partial output in .output", out) from exc
    _finish_timing(out, t0, t1)
    return out


def _plain_loop(model, cache, nxt, emitter: Emitter, pick, backends, kv_len: int, out: GenerateOutput,
                count_nodes: bool = False, greedy: bool = False) -> None:
    """One token per step: feed the last token, commit its row, pick the next. count_nodes: a speculative
    request whose budget made every step plain records each step's budget (1) as the speculative loop does.
    greedy (pick is the argmax): on the CPU the whole step runs as one native call where it applies
    (model/plain_step.py: the same tokens)."""
    native = native_plain_step(model, cache, backends) if greedy else None
    attend, finished = None, 0  # the native step's attend: 0 for a finished sequence (its attention skipped)
    while not emitter.all_done:
        kv_len += 1  # host-side bound on every seqlens[b] + 1
        if native is not None:
            if sum(emitter.done) != finished:  # a sequence finished: its token is not read from now on
                finished = sum(emitter.done)
                attend = torch.tensor([0 if d else 1 for d in emitter.done], dtype=torch.long)
            nxt, _ = native(nxt, kv_len, attend=attend)  # step, commit and argmax in one call
        else:
            hidden = model.step(nxt[:, None], cache, kv_len=kv_len, backends=backends)  # [B, 1, H]
            cache.advance(1)
            nxt = pick(hidden[:, -1])
        out.num_steps += 1
        if count_nodes:
            out.step_nodes.append(1)
        for b, t in enumerate(nxt.tolist()):
            emitter.emit(b, [t], in_step=True)


def _runner_plain_loop(runner, bufs, nxt, emitter: Emitter, sampler, backends, context: int, out: GenerateOutput,
                       count_nodes: bool = False) -> None:
    """_plain_loop through the decode runner: the same steps (Llama.step of the last token, its row
    committed, the next token picked) over the runner's static buffers, one host read per step.
    context: a host bound on every committed length."""
    bufs.tokens.copy_(nxt)
    while not emitter.all_done:
        nxt, _ = runner.plain(bufs, context, backends, sampler)
        context += 1
        out.num_steps += 1
        if count_nodes:
            out.step_nodes.append(1)
        for b, t in enumerate(runner.read(nxt)):
            emitter.emit(b, [t], in_step=True)


def _finish_timing(out: GenerateOutput, t0: float, t1: float | None) -> None:
    now = time.perf_counter()
    if t1 is None:
        out.prefill_s = now - t0
    else:
        out.decode_s = now - t1

