"""A drafter's first pass over the prompts beside the base model's prefill of them, in one run.

Drafters with their own decoder layers (Amphista's adaptation layers, the EAGLE layer, Hydra++'s prefix
layer) run the whole prompt through them once, after the base prefill and before the first draft. This
times that: start + after_prefill + the first propose (the first pass and one draft) on the prefill's
hidden states of a random prompt of --context tokens at --batch, each drafter and the peer (the base
model's prefill of the same prompt, as generate() runs it) once per rep, interleaved; medians.

    python benchmarks/bench_first_pass.py [--drafters amphista new:eagle new:hydra++] [--context 8000]
        [--batch 1] [--reps 3] [--out benchmarks/results]

A drafter is a shipped kind (`amphista`), a checkpoint directory, or `new:<kind>` (untrained: the timing
does not depend on the weights' values). Writes first_pass.csv (and .png) to --out.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from report import drafter_by_name, print_table, write_results

import hydra_kernels as hk


def load(spec: str, model):
    if spec.startswith("new:"):
        return hk.new_drafter(model, kind=spec[4:])
    return drafter_by_name(spec, model)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", nargs="+", default=["amphista", "new:eagle", "new:hydra++"])
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if min(args.context, args.batch, args.reps) < 1:
        raise SystemExit("--context, --batch and --reps must be >= 1")
    model, _ = hk.load_model()
    drafters = {spec: load(spec, model) for spec in args.drafters}  # loading errors before any timing
    B, L, V = args.batch, args.context, model.config.vocab_size
    plan = model.backend_plan("auto")
    lengths = torch.full((B,), L, dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, L), generator=g)
    root = torch.randint(0, V, (B,), generator=g)
    with torch.inference_mode():
        def prefill(capture=None):  # what generate() runs: every position's hidden state for the drafter
            return model.prefill(ids, lengths, model.new_kv_cache(B, L + 64), all_hidden=True, capture=capture)

        feats = {spec: (prefill(d.feature_layers)[1] if getattr(d, "feature_layers", None) else prefill())
                 for spec, d in drafters.items()}

        def first_pass(d, hidden):
            tree = d.resolve_tree(None, "cpu")
            state = d.start(model, B, L + 64, tree, plan)
            d.after_prefill(state, hidden, lengths)
            d.observe_tokens(state, [t + [int(r)] for t, r in zip(ids.tolist(), root)])
            d.propose(state, root, lengths)

        secs = {name: [] for name in ["base prefill", *drafters]}
        for _ in range(args.reps):
            for name in secs:
                t = time.perf_counter()
                prefill() if name == "base prefill" else first_pass(drafters[name], feats[name])
                secs[name].append(time.perf_counter() - t)
    base = statistics.median(secs["base prefill"])
    rows = [{"drafter": name, "batch": B, "context": L, "median_s": statistics.median(s), "min_s": min(s),
             "max_s": max(s), "vs_base_prefill": statistics.median(s) / base} for name, s in secs.items()]
    print_table(rows, list(rows[0]))

    def plot(ax):
        ax.barh([r["drafter"] for r in rows], [r["median_s"] for r in rows])
        ax.set_xlabel(f"seconds (median of {args.reps}), batch {B}, {L}-token prompt")
        ax.set_title("first pass + first draft beside the base prefill, this CPU")

    write_results(rows, args.out, "first_pass", plot)
    return rows


if __name__ == "__main__":
    main()
