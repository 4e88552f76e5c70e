"""Variants of the adaptive budget on the machine's own clock: each interleaved with plain decoding in one process,
answer by answer, with the drafts each made (issue 45).

Why: the policy's gains and losses at a point are a few percent, and bench_scaling.py's cells (4 runs each) moved by
+-9% between runs of the same code on this 2-core VM (EPYC VM, 2026-11-29). Here every variant and plain decoding
decode the same answers back to back, in an order that rotates with each answer and round, so the VM's drift hits them
alike; the ratio is total plain time over total variant time, beside the median and geometric mean of the answers'
ratios; and the proposals a variant drafted per answer (drafts) are counted: a deterministic figure a timing A/B can be
read against. An adaptive variant's steps are also timed by kind (STEP_KINDS: plain, a refused trial, drafted; their
shares, median and mean ms beside plain decoding's mean ms a step, plain_decoding_step_mean_ms), which says where its
time goes (the means add up to the total: a kind's tail shows there, not in its median). benchmarks/replay_adaptive.py
ranks variants without the noise, on a modelled clock; this says whether a ranking holds on the machine.

A variant is NAME or NAME:CONST=VALUE[,CONST=VALUE...] (replay_adaptive.py's form: CONST a module constant of
hydra_kernels/adaptive.py, set for that variant's runs only); "table" is budget="auto" (the drafter's budget table),
"adaptive" the code as it is, "@REV" the policy of hydra_kernels/adaptive.py at git revision REV (the rest of the
package as it is: a before / after A/B of a change to the policy in one process; "@REV:CONST=VALUE" sets the
revision's constant; its steps are timed by kind where that revision's policy keeps `step` as today's does). Each
variant keeps its own learned state across answers (the drafter's and the model's adaptive memory), as one user's
process would. Every output is checked against plain decoding. Each answer's prompts are prefilled once per A/B and the
rows reused by every later run of them (ReusedPrefill: an 8k A/B ran ~5x faster, its timed decoding unchanged).
--calibration adds, per adaptive variant, the forecast P of the nodes its drafted steps verified beside the share of
them right, per drafter part and depth (forecast_calibration.py): where the forecasts err.

    python benchmarks/ab_adaptive.py [--kind KIND] [--batch 1] [--context short|2048|...]
        [--prompt-set mtbench|editing|sharegpt] [--prompts 16] [--start 20] [--rounds 2] [--new-tokens 64]
        [--variants adaptive table NAME:CONST=VALUE ...] [--activations fp32|int8] [--calibration] [--out DIR]
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from forecast_calibration import ForecastCalibration
from replay_adaptive import parse_variant, parse_variants
from report import drafter_by_name, print_table, write_results
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hydra_kernels as hk  # noqa: E402
from hydra_kernels import adaptive  # noqa: E402
from hydra_kernels.chat import chat_prompt_ids  # noqa: E402
from hydra_kernels.generate import generate  # noqa: E402
from hydra_kernels.training.data import heldout_chat_prompts, long_context_prompts, mtbench_questions  # noqa: E402


def prompt_groups(tok, args) -> list[list[list[int]]]:
    """--prompts groups of --batch prompts each: MT-Bench first turns from --start, editing prompts, held-out ShareGPT
    first turns (bench_scaling.py's sets), or --context-token prompts ending in MT-Bench question --start."""
    n = args.prompts * args.batch
    questions = [q["turns"][0] for q in mtbench_questions()]
    if args.context != "short":
        prompts = long_context_prompts(tok, n, int(args.context), questions[args.start % len(questions)])
    elif args.prompt_set == "editing":
        from bench_ngram import editing_prompts

        prompts = editing_prompts(tok, args.start + n)[args.start:]
    elif args.prompt_set == "sharegpt":
        prompts = heldout_chat_prompts(tok, args.start + n)[args.start:]
    else:
        prompts = [chat_prompt_ids(tok, questions[(args.start + i) % len(questions)]) for i in range(n)]
    if len(prompts) < n:
        raise SystemExit(f"ab_adaptive.py: {len(prompts)} {args.prompt_set} prompts from --start {args.start}, "
                         f"{n} asked for (--prompts x --batch): ask for fewer or start earlier")
    return [prompts[i * args.batch:(i + 1) * args.batch] for i in range(args.prompts)]


def policy_at(rev: str, _cache: dict = {}):  # noqa: B006 (one load per revision and process)
    """AdaptiveBudget of hydra_kernels/adaptive.py at git revision `rev`, loaded beside the current module (its
    relative imports the current package's), its constructor, plan and propose given only the arguments they take (an
    older loop passed fewer). A revision git cannot show is refused."""
    if rev not in _cache:
        root = Path(__file__).resolve().parents[1]
        try:
            shown = subprocess.run(["git", "-C", str(root), "show", f"{rev}:hydra_kernels/adaptive.py"],
                                   capture_output=True, text=True)
        except OSError as exc:  # no git on this machine
            raise SystemExit(f"variant @{rev}: git cannot run here ({exc}); @REV variants need git and a checkout")
        if shown.returncode:
            raise SystemExit(f"variant @{rev}: git cannot show hydra_kernels/adaptive.py at {rev!r} "
                             f"({shown.stderr.strip()}); name a commit of this repository")
        name = "hydra_kernels._adaptive_at_" + re.sub(r"\W", "_", rev)
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
        module.__package__ = "hydra_kernels"
        sys.modules[name] = module
        exec(compile(shown.stdout, f"{rev}:hydra_kernels/adaptive.py", "exec"), module.__dict__)
        takes = len(inspect.signature(module.AdaptiveBudget.propose).parameters) - 1  # self excluded
        plan_takes = len(inspect.signature(module.AdaptiveBudget.plan).parameters) - 1
        keywords = inspect.signature(module.AdaptiveBudget.__init__).parameters

        class Budget(module.AdaptiveBudget):
            def __init__(self, *a, **kw):  # the keywords budget.py passes that the revision takes
                super().__init__(*a, **{k: v for k, v in kw.items() if k in keywords})

            def propose(self, *a):
                return super().propose(*a[:takes])

            def plan(self, *a):  # before 2026-12-01 plan took no step size
                return super().plan(*a[:plan_takes])

        _cache[rev] = Budget
    return _cache[rev]


# the adaptive policy's steps, by what happened in them: no part ran (plain), a part ran and the step stayed plain (a
# refused trial: a check or a draft cut to the root), or a draft was verified (drafted). Their shares and median / mean
# wall times (observe to observe: the host work and the native step together) beside plain decoding's step say where a
# variant's time goes: 2026-11-30, batch 2, the refused trials (29% of the steps, ~0.6-0.9 ms over a plain step each)
STEP_KINDS = ("plain", "refused", "drafted")


class ReusedPrefill:
    """model.prefill memoised within one A/B: each group's prompts are prefilled once, and every later run of the same
    prompts (plain decoding's and each variant's, every round) gets a copy of the KV rows and the hidden states that
    prefill left. Why: at 8k tokens a batch-2 prefill took ~2.5 minutes on this VM (the causal attention over the
    prompt), so a 4-variant A/B of 2 answers ran ~20 minutes, nearly all prefill, where its decoding is what it times
    (decode_s excludes the prefill). Exact: the rows [0, L) and the lengths are what the prefill wrote, bit for bit,
    and the decode steps write every row past a sequence's length before any step reads it; a prefill is always run
    with all_hidden (plain decoding's last rows are then gathered from its rows: chunked_prefill gathers them from the
    same normed chunk outputs). So the runs' outputs and the A/B's ratios are the ones fresh prefills give, and every
    output is still checked against plain decoding's. Memory: every group's rows held at once (~0.75 GB per batch-2
    group at 8k with SmolLM2-135M)."""

    def __init__(self, model):
        self.model, self.saved, self.hits, self.runs = model, {}, 0, 0

    def __enter__(self):
        prefill = self.model.prefill

        def reused(tokens, lengths, cache, *, all_hidden=False, capture=None, **kw):
            L = tokens.shape[1]
            key = (tokens.cpu().numpy().tobytes(), tuple(tokens.shape), tuple(lengths.tolist()),
                   None if capture is None else tuple(capture), tuple(sorted(kw.items())))
            if key in self.saved:
                rows, seqlens, out = self.saved[key]
                cache.kv[:, :, :, :L].copy_(rows)
                cache.seqlens.copy_(seqlens)
                self.hits += 1
            else:
                out = prefill(tokens, lengths, cache, all_hidden=True, capture=capture, **kw)
                self.saved[key] = (cache.kv[:, :, :, :L].clone(), cache.seqlens.clone(), out)
                self.runs += 1
            last = (torch.arange(tokens.shape[0], device=tokens.device), lengths.long() - 1)
            return _each(out, lambda h: h.clone() if all_hidden else h[last])

        self.model.prefill = reused
        return self

    def __exit__(self, *exc):
        del self.model.prefill  # the class's method again
        self.saved.clear()


def _each(out, f):
    return tuple(f(o) for o in out) if isinstance(out, tuple) else f(out)


def ab(model, drafter, groups: list[list[list[int]]], variants: list[str], rounds: int, new_tokens: int,
       calibration: bool = False) -> list[dict]:
    """Plain decoding and every variant on every group, `rounds` times, the order rotating -> one row per variant;
    calibration: each adaptive variant's forecasts against its outcomes too (forecast_calibration.py)."""
    parsed = [parse_variant(v) for v in variants]
    memories = {name: ({}, {}) for name, _ in parsed}
    runs = {name: [] for name in ["plain"] + [n for n, _ in parsed]}  # (decode s, drafts, output) per answer
    drafts = [0]
    propose = drafter.propose
    steps = []  # the adaptive policy's steps in the current run: (time at its observe, kind of step)
    step_ms = {name: {k: [] for k in STEP_KINDS} for name, _ in parsed}  # per variant and kind: the steps' ms
    calib = {name: ForecastCalibration() for name, _ in parsed} if calibration else None
    running = [None]  # the variant decoding now
    current = adaptive.AdaptiveBudget
    policies = {name: policy_at(name[1:]) if name.startswith("@") else current for name, _ in parsed}

    def counted(*a, **k):
        drafts[0] += 1
        return propose(*a, **k)

    def observed(accept_indices, tokens=None, target=None):  # observe's arguments, however they were passed
        return accept_indices, tokens, target

    def timing(observe):
        def timed(policy, *a, **k):  # each step's kind, as its observe sees it (the step in flight)
            step = policy.step  # (parts ran, their ms, the verified width, ...) since 89f6306; else the step untimed
            if calib is not None:  # its time handed back to the policy's clock (forecast_calibration.py)
                t0 = time.perf_counter()
                calib[running[0]].record(policy, step, *observed(*a, **k))
                if getattr(policy, "last_t", None) is not None:
                    policy.last_t += time.perf_counter() - t0
            observe(policy, *a, **k)
            if isinstance(step, tuple) and len(step) > 2 and isinstance(step[0], tuple):
                parts, width = step[0], step[2]
                kind = "plain" if not any(parts) else "refused" if width == 1 else "drafted"
                steps.append((time.perf_counter(), kind))
        return timed

    order = [("plain", {})] + parsed
    drafter.propose = counted
    own = {cls: cls.__dict__.get("observe") for cls in set(policies.values())}  # None: inherited (a revision's)
    for cls in own:
        cls.observe = timing(cls.observe)
    reuse = ReusedPrefill(model)
    try:
        with reuse:
            for name, consts in parsed:  # warm-up: first calls, each variant's policy ops
                running[0] = name
                _decode(model, drafter, groups[0], name, consts, memories, 8)
            generate(model, groups[0], max_new_tokens=8, eos_token_id=[])
            memories.update({name: ({}, {}) for name, _ in parsed})  # the warm-up's learning forgotten
            for c in (calib or {}).values():  # and its forecasts
                c.sums.clear()
            for r in tqdm(range(rounds), desc="rounds"):
                for i, g in enumerate(groups):
                    k = (r + i) % len(order)
                    for name, consts in order[k:] + order[:k]:
                        drafts[0] = 0
                        steps.clear()
                        running[0] = name
                        if name == "plain":
                            out = generate(model, g, max_new_tokens=new_tokens, eos_token_id=[])
                        else:
                            out = _decode(model, drafter, g, name, consts, memories, new_tokens)
                            for (t0, _), (t1, kind) in zip(steps, steps[1:]):  # observe to observe: a whole step
                                step_ms[name][kind].append((t1 - t0) * 1e3)
                        runs[name].append((out.decode_s, drafts[0], out))
    finally:
        print(f"prefills: {reuse.runs} run, {reuse.hits} reused (ReusedPrefill)")
        drafter.propose = propose
        for cls, observe in own.items():
            if observe is None:
                del cls.observe  # the revision's own again
            else:
                cls.observe = observe
    plain = runs["plain"]
    plain_steps = [o[2].decode_s * 1e3 / max(1, o[2].num_steps) for o in plain]  # plain decoding's ms a step
    rows = []
    for v, (name, _) in zip(variants, parsed):
        ratios = [p[0] / o[0] for p, o in zip(plain, runs[name])]
        outs = [o[2] for o in runs[name]]
        nodes = [n for o in outs for n in o.step_nodes]
        rows.append({"variant": v, "ratio_total": sum(p[0] for p in plain) / sum(o[0] for o in runs[name]),
                     "ratio_median": statistics.median(ratios), "ratio_geomean": statistics.geometric_mean(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "drafts_per_answer": statistics.mean(o[1] for o in runs[name]),
                     "drafted_steps_per_answer": sum(n > 1 for n in nodes) / len(outs),
                     "plain_step_share": sum(n == 1 for n in nodes) / max(1, len(nodes)),
                     "tokens_per_step": statistics.mean(o.mean_accepted_tokens for o in outs),
                     # the policy's own host time a step (GenerateOutput.policy_s; issue 45: < 0.2 ms at batch 16)
                     "policy_ms_per_step": 1e3 * sum(o.policy_s for o in outs) / sum(max(1, o.num_steps) for o in outs),
                     "identical": f"{sum(o.sequences == p[2].sequences for o, p in zip(outs, plain))}/{len(outs)}",
                     "plain_decoding_step_ms": statistics.median(plain_steps),
                     # the mean the step kinds' means (step_mean_ms_*) compare with: the median above is of the answers'
                     # means, lower than the mean where a few answers ran slow (2026-11-30, batch 2: 8.27 against 8.56)
                     "plain_decoding_step_mean_ms": 1e3 * sum(o[2].decode_s for o in plain) / sum(
                         max(1, o[2].num_steps) for o in plain)})
        timed_steps = sum(len(x) for x in step_ms[name].values())
        for kind, ms in step_ms[name].items():  # the adaptive policy's steps by kind (none for "table")
            rows[-1][f"step_share_{kind}"] = len(ms) / timed_steps if timed_steps else None
            rows[-1][f"step_ms_{kind}"] = statistics.median(ms) if ms else None
            rows[-1][f"step_mean_ms_{kind}"] = statistics.mean(ms) if ms else None  # what adds up to the total
        if calib is not None:
            rows[-1].update(calib[name].columns(tuple(drafter.parts)))
    return rows


def _decode(model, drafter, prompts, name: str, consts: dict, memories: dict, new_tokens: int):
    """One variant's run: its constants set (an @REV variant's in that revision's module too), its own learned state
    in place, an @REV variant's policy the one budget.py builds; all restored after."""
    modules = [adaptive] + ([revision_module(name[1:])] if name.startswith("@") else [])
    old = {(m, c): getattr(m, c) for m in modules for c in consts}
    current = adaptive.AdaptiveBudget
    try:
        for (m, c), v in zip(old, [v for _ in modules for v in consts.values()]):
            setattr(m, c, v)
        drafter.__dict__["_adaptive_memory"], model.__dict__["_adaptive_costs"] = memories[name]
        if name.startswith("@"):
            adaptive.AdaptiveBudget = policy_at(name[1:])  # budget.py imports it from the module at each call
        return generate(model, prompts, drafter=drafter, budget="auto" if name == "table" else "adaptive",
                        max_new_tokens=new_tokens, eos_token_id=[])
    finally:
        adaptive.AdaptiveBudget = current
        for (m, c), v in old.items():
            setattr(m, c, v)


def revision_module(rev: str):
    """The module policy_at(rev) loaded (its constants are read there, not in today's adaptive.py)."""
    return sys.modules[policy_at(rev).__mro__[1].__module__]


def plot(ax, rows) -> None:
    names = [r["variant"] for r in rows]
    ax.bar(range(len(rows)), [r["ratio_total"] for r in rows])
    ax.errorbar(range(len(rows)), [r["ratio_median"] for r in rows], fmt="k.", label="median answer")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(0.97, color="k", ls="--", lw=0.8, label=">= 0.97 (issue 45)")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(names, fontsize=7, rotation=15)
    ax.set_ylim(min(0.85, min(r["ratio_min"] for r in rows)), max(1.05, max(r["ratio_total"] for r in rows) + 0.05))
    ax.set_ylabel("plain time / variant time")
    ax.legend(fontsize=7)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", default=None, help="a shipped or composed kind, or a directory (default: hk.load_drafter's)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", default="short", help="'short' (the prompts as they are) or a prompt length in tokens")
    ap.add_argument("--prompt-set", default="mtbench", choices=["mtbench", "editing", "sharegpt"],
                    help="the short prompts: MT-Bench first turns, ShareGPT editing turns or held-out ShareGPT first turns")
    ap.add_argument("--prompts", type=int, default=16, help="answers (groups of --batch prompts) per round")
    ap.add_argument("--start", type=int, default=20, help="first MT-Bench question / editing prompt used")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=["adaptive", "table"])
    ap.add_argument("--activations", default="fp32", choices=["fp32", "int8"],
                    help="the base model's (hk.load_model(activations=...)): int8 is llama.cpp's arithmetic, opt-in")
    ap.add_argument("--calibration", action="store_true",
                    help="also each adaptive variant's forecast P against the share of those nodes right, per part and "
                         "depth (forecast_calibration.py; its time is kept from the policy, not from the timings)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for v, (name, consts) in zip(args.variants, parse_variants(args.variants, reserved=("plain",))):
        # a bad variant is refused before the model loads (parse_variants: a repeated name, or plain decoding's)
        if name.startswith("@"):
            missing = [c for c in consts if not hasattr(revision_module(name[1:]), c)]
            if missing:
                raise SystemExit(f"variant {v!r}: {missing} not constants of hydra_kernels/adaptive.py at {name[1:]}")
    if args.context != "short" and not args.context.isdigit():
        ap.error(f"--context must be 'short' or a token count, got {args.context!r}")
    if min(args.batch, args.prompts, args.rounds, args.new_tokens) < 1:
        ap.error("--batch, --prompts, --rounds and --new-tokens must be >= 1")
    torch.set_grad_enabled(False)
    model, tok = hk.load_model(activations=args.activations)  # int8 on a CPU without its kernel: refused first
    drafter = drafter_by_name(args.kind, model) if args.kind else hk.load_drafter(model=model)
    rows = ab(model, drafter, prompt_groups(tok, args), args.variants, args.rounds, args.new_tokens, args.calibration)
    for r in rows:
        r.update(kind=drafter.kind, activations=args.activations, batch=args.batch, context=args.context,
                 prompt_set=args.prompt_set, answers=args.prompts, rounds=args.rounds, new_tokens=args.new_tokens)
    print_table(rows, list(rows[0]))
    if args.out:
        int8 = "_int8" if args.activations == "int8" else ""
        name = f"ab_adaptive_{drafter.kind}{int8}_b{args.batch}_{args.context}_{args.prompt_set}_{args.new_tokens}tok"
        write_results(rows, args.out, name, plot=lambda ax: plot(ax, rows))
    return rows


if __name__ == "__main__":
    main()
