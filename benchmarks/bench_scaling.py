"""Plain vs speculative decoding across batch sizes and context lengths, one interleaved run (issue 26).

At each (batch B, context C) point: B different prompts of C tokens (C = "short": MT-Bench first turns as
they are; otherwise held-out ShareGPT conversations ending in an MT-Bench question, training/data.py's
long_context_prompts), decoded greedily --new-tokens tokens by
- plain decoding,
- speculative decoding with the drafter's budget table for this device (budget="auto", hydra_kernels/budget.py; the
  default before the adaptive budget became it, issue 45), or its default budget where it has no table,
- speculative decoding with its full tree every step (budget pinned), the behaviour before budget tables,
in a rotating order, each call back to back, --reps rounds (each round rotates the order again) of --groups
prompt sets (another B prompts each); the figures are the medians over rounds and sets, the ratios the medians
of each run's ratio to plain on the same prompts (a round's variants ran back to back, so this VM's drift
between rounds cancels), with their min and max where there are several. tok/s counts decode time only
(prefill excluded), all sequences. Every speculative output is checked against plain decoding token for
token (identical), in every round. --no-full-tree drops the third variant; --adaptive adds
budget="adaptive" (hydra_kernels/adaptive.py: each step's draft sized by expected tokens per second; the default
budget of a drafter with a table, on the CPU, greedy) as another variant. --prompt-set picks the short prompts:
MT-Bench first turns (default), the held-out ShareGPT editing turns (bench_ngram.py's rule: rewrite / fix /
translate a given text) or held-out ShareGPT first turns. --compare KIND... adds other drafters (shipped or
composed kinds, or directories) at their default budgets (budget=None) to the same rotation, so drafters are
compared in one interleaved run; --kind picks the main drafter among the shipped and composed kinds (default:
hk.load_drafter()'s).

Memory rates, plain decoding: weight GB/s = bytes of the weights one step reads / (step time - the
attention's time), attention GB/s = K/V bytes one step reads / the attention's time, the latter timed
alone on a buffer of the same shape (the native CPU kernel, 30 layers, batch B, context C, one query row).

    python benchmarks/bench_scaling.py [--drafter DIR | --kind KIND] [--compare KIND|DIR ...] [--batches 1 2 4 8 16]
        [--contexts short 2048 8000] [--max-batch-long 4] [--new-tokens 64] [--reps 1] [--groups 1] [--no-full-tree]
        [--adaptive] [--prompt-set mtbench|editing|sharegpt] [--activations fp32|int8] [--ratio-reps 5] [--out DIR]

Last, plain batch-1 decoding of a short and a 2048-token prompt, interleaved --ratio-reps times: the
share of its short-context speed decoding keeps at 2k context (medians).

--max-batch-long caps the batch at contexts >= 8000 (their prefill: ~10 s per sequence on a 2-core CPU,
paid by each of the three variants).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from report import drafter_by_name, plot_ratio_by_batch, print_table, write_results
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hydra_kernels as hk  # noqa: E402
from hydra_kernels import ops  # noqa: E402
from hydra_kernels.attention_share import kv_bytes_per_token, weight_bytes_per_step  # noqa: E402
from hydra_kernels.budget import whole_tree_budget  # noqa: E402
from hydra_kernels.chat import chat_prompt_ids  # noqa: E402
from hydra_kernels.generate import generate  # noqa: E402
from hydra_kernels.ops.backend import kernel_mask, resolve, resolved_name  # noqa: E402
from hydra_kernels.training.data import long_context_prompts, mtbench_questions  # noqa: E402

VARIANTS = ("plain", "speculative (budget table)", "speculative (full tree)")
ADAPTIVE = "speculative (adaptive)"


def attention_seconds(model, B: int, C: int, reps: int = 5, cycle_mib: int = 2048) -> float:
    """One decode step's attention alone: num_layers calls of tree_attention at batch B, context C, T = 1,
    each call on a K/V buffer not read since long before, as decoding reads each layer's once per step after
    the other layers' and the weights (one buffer reused by every layer stays in the caches and reads faster
    than memory: 56-100 GB/s measured that way on a VM whose DRAM reads ~42 GB/s). The calls cycle through
    ~cycle_mib of buffers (the default 2 GiB: over 4x the 480 MiB L3 of the Xeon VM; at least 2, at most
    4096 buffers), each read once before the timing: the first read of freshly written buffers ran at half the
    rate of later ones (Xeon VM, 2026-11-26: 368 vs 187 us a call at 2080 keys), and decoding rereads one
    long-lived K/V buffer."""
    c = model.config
    per_layer = 2 * B * (C + 1) * c.num_kv_heads * c.head_dim * 4
    kvs = [(torch.randn(B, C + 1, c.num_kv_heads, c.head_dim), torch.randn(B, C + 1, c.num_kv_heads, c.head_dim))
           for _ in range(min(4096, max(2, -(-cycle_mib * 2**20 // per_layer))))]
    k, v = kvs[0]
    q = torch.randn(B, 1, c.num_heads, c.head_dim)
    seqlens = torch.full((B,), C, dtype=torch.int32)
    mask = torch.ones(1, 1, dtype=torch.bool)
    name = resolved_name("tree_attention", "auto", q.device)
    kernel = resolve("tree_attention", name, q.device)
    ops.check_tree_attention(q, k, v, seqlens, mask)
    warm = kernel_mask("tree_attention", name, mask)
    for kv in kvs:
        kernel(q, *kv, seqlens, warm)
    times, call = [], 0
    for _ in range(reps):  # as a step runs it (AttentionSite): the mask in the kernel's form once, every layer
        t = time.perf_counter()
        step_mask = kernel_mask("tree_attention", name, mask)
        for _ in range(c.num_layers):
            kernel(q, *kvs[call % len(kvs)], seqlens, step_mask)
            call += 1
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def prompts_for(tok, C, B: int, questions: list[str], short: list[list[int]] | None = None,
                group: int = 0) -> list[list[int]]:
    """B prompts: MT-Bench questions as they are (C "short"; `short`: these prompts instead, cycled), or
    C-token ones ending in the first question; `group` g: the g-th B of them (another set of prompts)."""
    if C == "short":
        if short is not None:
            return [short[(group * B + i) % len(short)] for i in range(B)]
        return [chat_prompt_ids(tok, q) for q in (questions[group * B:] + questions)[:B]]
    return long_context_prompts(tok, (group + 1) * B, int(C), questions[0])[group * B:]


def plain_context_ratio(model, tok, questions, context: int, reps: int, new_tokens: int) -> tuple[float, float]:
    """Plain batch-1 decoding tok/s of a short prompt and a `context`-token one, interleaved `reps` times
    (medians): how much of its short-context speed decoding keeps at a long context."""
    short, long = [chat_prompt_ids(tok, questions[0])], long_context_prompts(tok, 1, context, questions[0])
    t = {"short": [], "long": []}
    for _ in range(reps):
        for name, p in (("short", short), ("long", long)):
            t[name].append(generate(model, p, max_new_tokens=new_tokens, eos_token_id=[]).tokens_per_second)
    return statistics.median(t["short"]), statistics.median(t["long"])


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default=None, help="a drafter directory (default: the shipped one)")
    ap.add_argument("--kind", default=None, help="a shipped or composed kind (default: hk.load_drafter()'s)")
    ap.add_argument("--compare", nargs="*", default=[], help="more drafters (kinds or directories), default budgets")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--contexts", nargs="+", default=["short", "2048", "8000"])
    ap.add_argument("--max-batch-long", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=1, help="interleaved rounds per point (medians)")
    ap.add_argument("--groups", type=int, default=1, help="prompt sets per point, each run every round (the ratios' "
                    "medians over sets and rounds: one set's answers decide little)")
    ap.add_argument("--no-full-tree", action="store_true", help="skip the full-tree variant")
    ap.add_argument("--adaptive", action="store_true", help="add budget='adaptive' as a variant")
    ap.add_argument("--prompt-set", choices=("mtbench", "editing", "sharegpt"), default="mtbench",
                    help="the short prompts: MT-Bench first turns, held-out ShareGPT editing turns or first turns")
    ap.add_argument("--activations", default="fp32", choices=["fp32", "int8"],
                    help="the model's projections: exact (fp32 activations) or int8 dot products (load_model's)")
    ap.add_argument("--out", default=None, help="write scaling.csv / scaling.png there")
    ap.add_argument("--ratio-reps", type=int, default=5, help="interleaved reps of the plain short/long ratio")
    ap.add_argument("--ratio-context", type=int, default=2048)
    ap.add_argument("--attention-cycle-mib", type=int, default=2048,
                    help="K/V buffers the attention timing cycles through (more than the LLC: memory reads)")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tok = hk.load_model(device="cpu", activations=args.activations)
    if args.drafter and args.kind:
        ap.error("--drafter and --kind both pick the main drafter: give one")
    name = args.kind or args.drafter
    drafter = drafter_by_name(name, model) if name else hk.load_drafter(model=model)
    others = {Path(n).name: drafter_by_name(n, model) for n in args.compare}  # column prefix -> drafter
    questions = [q["turns"][0] for q in mtbench_questions()]
    W, kvt = weight_bytes_per_step(model), kv_bytes_per_token(model)
    tables = drafter.budget_tables
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}; drafter {drafter.kind}, budget tables for "
          f"{sorted(tables) or 'no device'}; weights read per step {W / 2**20:.0f} MiB, K/V {kvt} B per token")
    for d in (drafter, *others.values()):  # warm-up: first calls, CPU weight packing of each drafter
        generate(model, [chat_prompt_ids(tok, questions[0])], drafter=d, max_new_tokens=8)
    if args.adaptive:  # and of the adaptive budget's own tensor ops (its first run in a process otherwise pays them)
        generate(model, [chat_prompt_ids(tok, questions[0])], drafter=drafter, budget="adaptive", max_new_tokens=8)
    short = None  # MT-Bench's questions (prompts_for)
    if args.prompt_set == "editing":
        from bench_ngram import editing_prompts

        short = editing_prompts(tok, max(args.batches) * args.groups)
    elif args.prompt_set == "sharegpt":
        from hydra_kernels.training.data import heldout_chat_prompts

        short = heldout_chat_prompts(tok, max(args.batches) * args.groups)
    points = [(B, C) for C in args.contexts for B in args.batches
              if C == "short" or int(C) < 8000 or B <= args.max_batch_long]
    rows = []
    for i, (B, C) in enumerate(tqdm(points, desc="batch x context")):
        sets = [prompts_for(tok, C, B, questions[(7 * i) % 80:] + questions, short, g) for g in range(args.groups)]
        full = whole_tree_budget(drafter, None, "cpu")  # its largest budget (a combined drafter: node_budget)
        table = "auto" if "cpu" in drafter.budget_tables else None  # without a table: its default budget
        kw = {"plain": {}, VARIANTS[1]: dict(drafter=drafter, budget=table),
              VARIANTS[2]: dict(drafter=drafter, budget=full), ADAPTIVE: dict(drafter=drafter, budget="adaptive"),
              **{n: dict(drafter=d) for n, d in others.items()}}
        variants = ((VARIANTS[:2] if args.no_full_tree else VARIANTS) + ((ADAPTIVE,) if args.adaptive else ())
                    + tuple(others))
        runs = {v: [] for v in variants}  # variant -> one GenerateOutput per (round, prompt set)
        for rep in range(args.reps):
            for g, prompts in enumerate(sets):
                k = (i + rep + g) % len(variants)
                for v in variants[k:] + variants[:k]:
                    runs[v].append(generate(model, prompts, max_new_tokens=args.new_tokens, eos_token_id=[], **kw[v]))
        plain = runs["plain"]
        ctx = sum(len(p) for s in sets for p in s) / (B * len(sets))
        att = attention_seconds(model, B, int(ctx + args.new_tokens / 2), cycle_mib=args.attention_cycle_mib)
        step = statistics.median(o.decode_s / max(1, o.num_steps) for o in plain)
        kv = B * (ctx + args.new_tokens / 2) * kvt
        row = {"batch": B, "context": C, "prompt_tokens": round(ctx), "reps": args.reps * args.groups,
               "plain_tok_s": statistics.median(o.tokens_per_second for o in plain)}
        for v, name in ((VARIANTS[1], "table"), (VARIANTS[2], "full"), (ADAPTIVE, "adaptive"),
                        *((n, n) for n in others)):
            if v not in runs:
                continue
            outs = runs[v]
            row[f"{name}_tok_s"] = statistics.median(o.tokens_per_second for o in outs)
            ratios = [o.tokens_per_second / p.tokens_per_second for o, p in zip(outs, plain)]
            row[f"{name}_ratio"] = statistics.median(ratios)
            if len(ratios) > 1:  # the spread of the paired ratios (this VM's run-to-run noise is a few percent)
                row[f"{name}_ratio_min"], row[f"{name}_ratio_max"] = min(ratios), max(ratios)
            row[f"{name}_tokens_per_step"] = statistics.median(o.mean_accepted_tokens for o in outs)
            # sequences identical to plain decoding's, counted over every round
            row[f"{name}_identical"] = sum(a == b for o, p in zip(outs, plain) for a, b in zip(o.sequences, p.sequences))
        nodes = [n for o in runs[VARIANTS[1]] for n in o.step_nodes]
        row["table_mean_nodes"] = sum(nodes) / max(1, len(nodes))
        row["table_plain_step_share"] = sum(n == 1 for n in nodes) / max(1, len(nodes))
        if ADAPTIVE in runs:  # what the policy did: nodes verified per step, plain steps, its own host time
            outs = runs[ADAPTIVE]
            nodes = [n for o in outs for n in o.step_nodes]
            row["adaptive_mean_nodes"] = sum(nodes) / max(1, len(nodes))
            row["adaptive_plain_step_share"] = sum(n == 1 for n in nodes) / max(1, len(nodes))
            row["adaptive_policy_ms_per_step"] = statistics.median(1e3 * o.policy_s / max(1, o.num_steps) for o in outs)
        row["weight_gb_s"] = W / max(step - att, 1e-9) / 1e9
        row["attention_gb_s"] = kv / att / 1e9
        rows.append(row)
    print_table(rows, list(rows[0]))
    if args.ratio_reps:
        a, b = plain_context_ratio(model, tok, questions, args.ratio_context, args.ratio_reps, args.new_tokens)
        print(f"plain decoding, batch 1, interleaved x{args.ratio_reps} (medians): short prompt {a:.1f} tok/s, "
              f"{args.ratio_context}-token prompt {b:.1f} tok/s: {b / a:.1%} of the short-context speed")
        rows[0]["plain_long_over_short"] = b / a  # kept in the CSV (first row)
    names = ("table", "full", "adaptive", *others)
    bad = [r for r in rows if any(r.get(f"{n}_identical", r["batch"] * r["reps"]) != r["batch"] * r["reps"]
                                  for n in names)]
    if bad:
        print(f"NOT LOSSLESS at {[(r['batch'], r['context']) for r in bad]}")
    if args.out:
        write_results(rows, args.out, "scaling", plot=lambda ax: plot(ax, rows, list(others)))
    return rows


def plot(ax, rows, others=()):
    series = {"budget table": lambda r: r["table_ratio"]}
    if "full_ratio" in rows[0]:
        series["full tree"] = lambda r: r["full_ratio"]
    if "adaptive_ratio" in rows[0]:
        series["adaptive budget"] = lambda r: r["adaptive_ratio"]
    for name in others:
        series[f"{name}, default budget"] = lambda r, name=name: r[f"{name}_ratio"]
    plot_ratio_by_batch(ax, rows, series, "tokens/s / plain decoding\n(median of rounds)")


if __name__ == "__main__":
    main()
