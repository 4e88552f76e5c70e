"""The adaptive budget's decisions replayed on a modelled clock: variants of the policy compared without this VM's
timing noise (issue 45).

Why: the policy steers by measured times (its step-cost fit, its parts' drafting costs), so on this 2-core VM two runs
of one prompt take different paths, and in-process A/Bs of 4-8 prompts at 2k tokens moved by 5-15% between runs of the
same code (EPYC VM, 2026-11-29). Here the model and the drafter run for real (real drafts, real acceptances, greedy
output checked against plain decoding), but every time the policy reads comes from a clock that advances by modelled
costs only:
- a verify step of w nodes per sequence: a + c [w > 1] + b (w - 1) ms (--step-ms a c b), times a seeded lognormal
  factor (--noise; the same draws for every variant at a given round and prompt: common random numbers) with a 1.5x
  spike 2% of the time (a page fault, the other core busy);
- the heads' drafting: h0 + h1 per drafted node (--heads-ms); an n-gram lookup per sequence (--lookup-ms); the
  policy's own work per drafted or checked step (--policy-ms), inside its proposing, where the policy charges its own
  work to the parts that ran (so it counts in their gates' costs and their trials' price, as on the machine).
A decoder's modelled time is what its steps cost on that clock; plain decoding's is its steps x a (the same noise). So
the figures are ratios to plain under the cost model, not tokens per second: they rank policy variants (a real A/B
says whether a ranking holds on the machine). The defaults follow EPYC VM medians of 2026-11-29: the loop's timed
steps by width, short prompts 6.0 / 7.8 / 9.1 / 10.4 ms for w = 1-4 (modelled: the same), 2048-token prompts 11.2 /
13.3 / 15.0 / 16.5 / 18.6 / 21.5 for w = 1-6 (modelled 11.2 / 13.5 / 15.4 / 17.3 / 19.2 / 21.1); the heads ~0.8 ms for
their 2 nodes at 2k (modelled 0.81; 0.6 at short prompts); the policy ~0.45 ms of host work per drafted step. The
table's steps are costed at the widths GenerateOutput.step_nodes records (its budget's).

A variant is NAME or NAME:CONST=VALUE[,CONST=VALUE...], CONST a module constant of hydra_kernels/adaptive.py set for
that variant's runs (e.g. old-margin:MARGIN_BATCH_1=1.08); "table" is budget="auto" (the drafter's budget table),
"adaptive" the code as it is. Each variant keeps its own learned state across prompts (a drafter's and a model's
memory), as one user's process would.

    python benchmarks/replay_adaptive.py [--context short|2048] [--prompt-set mtbench|editing] [--prompts 8]
        [--start 20] [--rounds 3] [--new-tokens 64] [--variants table adaptive ...] [--noise 0.06] [--out DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import types
from pathlib import Path

import torch
from report import print_table, write_results
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hydra_kernels as hk  # noqa: E402
from hydra_kernels import adaptive  # noqa: E402
from hydra_kernels.chat import chat_prompt_ids  # noqa: E402
from hydra_kernels.drafters import combined, ngram  # noqa: E402
from hydra_kernels.generate import generate  # noqa: E402
from hydra_kernels.training.data import long_context_prompts, mtbench_questions  # noqa: E402

# EPYC VM, 2026-11-29 (module docstring): (a, c, b) of a step by context; heads (h0, h1); lookup; policy, in ms
DEFAULT_COSTS = {"short": ((6.0, 0.5, 1.3), (0.2, 0.2), 0.1, 0.45),
                 "2048": ((11.2, 0.4, 1.9), (0.25, 0.28), 0.15, 0.45)}


class ModelledClock:
    """Seconds that advance only by modelled costs (advance(ms)); noisy(ms): a cost times this round's seeded noise."""

    def __init__(self, noise: float):
        self.now, self.noise, self.rng = 0.0, noise, random.Random(0)

    def __call__(self) -> float:
        return self.now

    def advance(self, ms: float) -> None:
        self.now += ms / 1e3

    def reseed(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def noisy(self, ms: float) -> float:
        if not self.noise:
            return ms
        f = self.rng.lognormvariate(0.0, self.noise)
        return ms * (1.5 * f if self.rng.random() < 0.02 else f)


class StepModel:
    """A verify step's modelled ms by width: a + c [w > 1] + b (w - 1)."""

    def __init__(self, a: float, c: float, b: float):
        self.a, self.c, self.b = a, c, b

    def __call__(self, width: int) -> float:
        return self.a + (self.c + self.b * (width - 1) if width > 1 else 0.0)


@contextlib.contextmanager
def modelled(model, drafter, clock: ModelledClock, step: StepModel, heads_ms, lookup_ms: float, policy_ms: float):
    """Within: the combined drafter's part timers, its heads' drafting, the n-gram lookups and the adaptive policy run
    on `clock`, each advancing it by its modelled cost; a prompt's prefill replays from a copy after its first run
    (the K/V rows, seqlens and returned hidden states: the decode is what is compared, and a 2k-token prefill costs
    ~4 s here). Everything is restored on exit."""
    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    heads_cls, budget_cls, drafter_cls = type(drafter.heads), adaptive.AdaptiveBudget, type(drafter)
    index_cls, model_cls = ngram.NgramIndex, type(model)
    propose_heads, lookup, init, observe, set_parts = (heads_cls.propose, index_cls.lookup, budget_cls.__init__,
                                                       budget_cls.observe, drafter_cls.set_parts)
    prefill, memo = model_cls.prefill, {}

    def heads_propose(self, state, root, seqlens):
        out = propose_heads(self, state, root, seqlens)
        clock.advance(heads_ms[0] + heads_ms[1] * (out.tokens.shape[1] - 1))
        return out

    def index_lookup(self, *a):
        clock.advance(lookup_ms)
        return lookup(self, *a)

    def budget_init(self, *a, **k):  # the modelled clock replaces the caller's
        init(self, *a, **{**k, "clock": clock})

    def budget_observe(self, *a, **k):  # the step verified self.step[2] nodes per sequence: its cost first
        clock.advance(clock.noisy(step(self.step[2])))
        return observe(self, *a, **k)

    def drafter_set_parts(self, *a, **k):  # the policy's first call in its proposing, after it reads its start time
        clock.advance(policy_ms)
        return set_parts(self, *a, **k)

    def memo_prefill(self, tokens, lengths, cache, **k):
        key = (tokens.cpu().numpy().tobytes(), tuple(tokens.shape), tuple(cache.kv.shape), repr(sorted(k.items())))
        L = tokens.shape[1]
        if key in memo:
            kv, seqlens, out = memo[key]
            cache.kv[:, :, :, :L].copy_(kv)
            cache.seqlens.copy_(seqlens)
            return out
        out = prefill(self, tokens, lengths, cache, **k)
        memo[key] = (cache.kv[:, :, :, :L].clone(), cache.seqlens.clone(), out)
        return out

    patch(combined, "time", types.SimpleNamespace(perf_counter=clock))
    for owner, name, value in ((heads_cls, "propose", heads_propose), (index_cls, "lookup", index_lookup),
                               (budget_cls, "__init__", budget_init), (budget_cls, "observe", budget_observe),
                               (drafter_cls, "set_parts", drafter_set_parts), (model_cls, "prefill", memo_prefill)):
        patch(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def parse_variant(text: str) -> tuple[str, dict[str, float]]:
    """NAME[:CONST=VALUE,...] -> (NAME, {CONST: VALUE}); a CONST that adaptive.py does not define is refused."""
    name, _, sets = text.partition(":")
    consts = {}
    for item in filter(None, sets.split(",")):
        const, eq, value = item.partition("=")
        if not eq or not hasattr(adaptive, const):
            raise SystemExit(f"variant {text!r}: {item!r} is not CONST=VALUE with CONST a constant of "
                             "hydra_kernels/adaptive.py")
        consts[const] = type(getattr(adaptive, const))(value)
    return name, consts


def parse_variants(texts: list[str], reserved: tuple[str, ...] = ()) -> list[tuple[str, dict[str, float]]]:
    """parse_variant of each; two variants of one NAME (their runs, learned state and rows are keyed by it: pooled, an A/B
    of adaptive beside adaptive:MARGIN=1.0 read 0.51x) or a reserved one (ab_adaptive.py's plain decoding) are refused."""
    parsed = [parse_variant(v) for v in texts]
    names = [name for name, _ in parsed]
    if len(set(names)) < len(names) or set(names) & set(reserved):
        taken = f" or use {', '.join(repr(r) for r in reserved)}" if reserved else ""
        raise SystemExit(f"variants {texts} repeat a name{taken}: give each its own (NAME:CONST=VALUE, e.g. "
                         f"m10:MARGIN=1.0 beside adaptive)")
    return parsed


def replay(model, drafter, prompts: list[list[int]], variants: list[str], rounds: int, new_tokens: int,
           clock: ModelledClock, step: StepModel) -> list[dict]:
    """Every variant on every prompt (batch 1), `rounds` times -> one row per variant: the geometric mean of its
    modelled ratio to plain, tokens and nodes per step, prompts identical to plain decoding."""
    parsed = [parse_variant(v) for v in variants]
    memories = {name: ({}, {}) for name, _ in parsed}
    ratios = {name: [] for name, _ in parsed}
    per_step = {name: ([], []) for name, _ in parsed}
    identical = {name: 0 for name, _ in parsed}
    plains = [generate(model, [p], max_new_tokens=new_tokens, eos_token_id=[]) for p in prompts]  # the same each round
    for r in tqdm(range(rounds), desc="rounds"):
        for i, (p, plain) in enumerate(zip(prompts, plains)):
            clock.reseed(r * 100003 + i)  # plain decoding's steps on the same noise as every variant's
            plain_ms = sum(clock.noisy(step(1)) for _ in range(plain.num_steps))
            for name, consts in parsed:
                clock.reseed(r * 100003 + i)  # the same noise for every variant at this round and prompt
                old = {c: getattr(adaptive, c) for c in consts}
                for c, v in consts.items():
                    setattr(adaptive, c, v)
                drafter.__dict__["_adaptive_memory"], model.__dict__["_adaptive_costs"] = memories[name]
                t0 = clock.now
                try:
                    out = generate(model, [p], drafter=drafter, budget="auto" if name == "table" else "adaptive",
                                   max_new_tokens=new_tokens, eos_token_id=[])
                finally:
                    for c, v in old.items():
                        setattr(adaptive, c, v)
                ms = (clock.now - t0) * 1e3
                if name == "table":  # no policy: the steps' costs by the widths it verified
                    ms += sum(clock.noisy(step(w)) for w in out.step_nodes)
                ratios[name].append(plain_ms / ms)
                per_step[name][0].append(out.mean_accepted_tokens)
                per_step[name][1].append(statistics.mean(out.step_nodes))
                identical[name] += out.sequences == plain.sequences
    return [{"variant": v, "modelled_ratio_geomean": statistics.geometric_mean(ratios[name]),
             "modelled_ratio_min": min(ratios[name]), "modelled_ratio_max": max(ratios[name]),
             "tokens_per_step": statistics.mean(per_step[name][0]),
             "nodes_per_step": statistics.mean(per_step[name][1]),
             "identical": f"{identical[name]}/{rounds * len(prompts)}"}
            for v, (name, _) in zip(variants, parsed)]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", default="short", choices=sorted(DEFAULT_COSTS))
    ap.add_argument("--prompt-set", default="mtbench", choices=["mtbench", "editing"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--start", type=int, default=20, help="first MT-Bench question / editing prompt used")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=["table", "adaptive"])
    ap.add_argument("--noise", type=float, default=0.06, help="sigma of a step's lognormal cost factor")
    ap.add_argument("--step-ms", type=float, nargs=3, metavar=("A", "C", "B"))
    ap.add_argument("--heads-ms", type=float, nargs=2, metavar=("H0", "H1"))
    ap.add_argument("--lookup-ms", type=float)
    ap.add_argument("--policy-ms", type=float)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    parse_variants(args.variants)  # a bad variant is refused before the model loads
    torch.set_grad_enabled(False)
    (a, c, b), heads, lookup, policy = DEFAULT_COSTS[args.context]
    step = StepModel(*(args.step_ms or (a, c, b)))
    clock = ModelledClock(args.noise)
    model, tok = hk.load_model()
    drafter = hk.load_drafter(model=model)
    if not isinstance(drafter, combined.CombinedDrafter):
        raise SystemExit("the replay models the combined drafter's parts (n-gram + heads): load the default drafter")
    questions = [q["turns"][0] for q in mtbench_questions()]
    if args.context != "short":
        prompts = long_context_prompts(tok, args.prompts, int(args.context), questions[0])
    elif args.prompt_set == "editing":
        from bench_ngram import editing_prompts
        prompts = editing_prompts(tok, args.start + args.prompts)[args.start:]
    else:
        prompts = [chat_prompt_ids(tok, q) for q in questions[args.start:args.start + args.prompts]]
    lookup = lookup if args.lookup_ms is None else args.lookup_ms
    policy = policy if args.policy_ms is None else args.policy_ms
    with modelled(model, drafter, clock, step, args.heads_ms or heads, lookup, policy):
        rows = replay(model, drafter, prompts, args.variants, args.rounds, args.new_tokens, clock, step)
    for r in rows:
        r.update(context=args.context, prompt_set=args.prompt_set if args.context == "short" else "long_context",
                 prompts=len(prompts), rounds=args.rounds, noise=args.noise)
    print_table(rows, list(rows[0]))
    if args.out:
        write_results(rows, args.out, f"replay_adaptive_{args.context}_{args.prompt_set}")
    return rows


if __name__ == "__main__":
    main()
