"""Recipe: search a drafter's budget table on this device (hydra_kernels/training/budget_search.py) and
save it beside the drafter as budget_<device>.json, which generate() then uses by default.

    .venv/bin/python python/search_budget.py [--drafter DIR | --kind hydra] [--prompts 24] [--new-tokens 64]
        [--batches 1 2 4 8 16] [--contexts 128 2048 8000] [--margin 1.15] [--reps 5] [--out benchmarks/results]
    .venv/bin/python python/search_budget.py [--drafter DIR | --kind hydra] --rechoose [--margin M]
    .venv/bin/python python/search_budget.py --kind combined --budgets 3 4 6   # the composed n-gram + heads drafter

--kind combined (composed from the n-gram drafter and the default heads: no directory of its own) writes its
table to hydra_kernels/heads/<model>/combined/<heads>/ (the default heads), where load_drafter(kind="combined")
reads it.

tokens/step per budget: greedy decoding of --prompts held-out ShareGPT first turns (not MT-Bench, the
evaluation set); step times: the real decoding loop from a synthetic state at each (batch, context).
Prints the table and each point's predicted tokens/s per budget beside plain decoding; writes
budget_search.csv (and .png) under --out when given. The shipped drafter's table is written into the
package (hydra_kernels/heads/...), so this is also how the shipped budget_cpu.json was made.
--rechoose times nothing: it chooses the saved table's budgets again from its stored predictions with
--margin (how the shipped tables moved to the 15% margin) and rewrites it. The shipped combined table is at a
25% margin: its predictions ran 20-25% above real decoding (held-out prompts copy more than MT-Bench's), and
at 15% it drafted at batch 8 where real decoding ran 0.93x plain (benchmarks/results/README.md, 2026-11-27):
    .venv/bin/python python/search_budget.py --kind combined --budgets 3 4 6 --prompts 16 --new-tokens 256
    .venv/bin/python python/search_budget.py --kind combined --rechoose --margin 1.25
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import hydra_kernels as hk  # noqa: E402
from hydra_kernels.drafters.registry import COMPOSED, measured_files_dir  # noqa: E402
from hydra_kernels.budget import load_tables  # noqa: E402
from hydra_kernels.training.budget_search import MARGIN, rechoose, search_budget_table  # noqa: E402
from hydra_kernels.training.data import heldout_chat_prompts  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default=None, help="a drafter directory (the table is written into it)")
    ap.add_argument("--kind", default="hydra",
                    help=f"a shipped drafter or a composed kind {COMPOSED}, when --drafter is not given")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 2048, 8000])
    ap.add_argument("--margin", type=float, default=None,
                    help=f"a budget must be predicted this much faster than plain decoding (default {MARGIN}; "
                         "--rechoose: the margin the table was chosen with)")
    ap.add_argument("--rechoose", action="store_true", help="re-choose the saved CPU table from its predictions")
    ap.add_argument("--reps", type=int, default=5,
                    help="timed run pairs per step time (medians); 5 reps of the shipped Amphista's search "
                         "took 28 min alone on the 2-core Xeon VM (2026-11-26)")
    ap.add_argument("--budgets", type=int, nargs="+", default=None,
                    help="node budgets > 1 to time (default: the full tree and up to 5 sizes below it)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.reps < 1:
        raise SystemExit(f"--reps must be >= 1, got {args.reps}")
    if args.budgets is not None and min(args.budgets) < 2:
        raise SystemExit(f"--budgets are node counts > 1 (1 is a plain step, always compared), got {args.budgets}")
    try:
        path = Path(args.drafter) if args.drafter else measured_files_dir(args.kind)
    except ValueError as e:
        raise SystemExit(f"--kind: {e}") from e
    composed = not args.drafter and args.kind in COMPOSED
    if args.rechoose:
        saved = load_tables(path)["cpu"]
        table = rechoose(saved, args.margin or (saved.measured or {}).get("margin", MARGIN))
        print_budgets(table)
        print("written:", table.save(path))
        return
    torch.set_grad_enabled(False)
    model, tok = hk.load_model(device="cpu")
    drafter = hk.load_drafter(model=model, kind=args.kind) if composed else hk.load_drafter(path, model=model)
    table = search_budget_table(model, drafter, heldout_chat_prompts(tok, args.prompts), batch_sizes=args.batches,
                                contexts=args.contexts, new_tokens=args.new_tokens, margin=args.margin, reps=args.reps,
                                budgets=args.budgets)
    print(json.dumps(table.measured["tokens_per_step"]))
    from report import print_table, write_results

    rows = table.measured["points"]
    print_table(rows, list(rows[0]))
    print_budgets(table)
    path.mkdir(parents=True, exist_ok=True)
    print("written:", table.save(path))
    if args.out:
        write_results(rows, args.out, "budget_search", plot=lambda ax: plot(ax, rows))


def print_budgets(table) -> None:
    print("node budget (rows: batch sizes", table.batch_sizes, "; columns: contexts", table.contexts, ")")
    for B, r in zip(table.batch_sizes, table.nodes):
        print(f"  batch {B:3d}: {r}")


def plot(ax, rows):
    from report import plot_ratio_by_batch

    keys = [k for k in rows[0] if k.startswith("nodes_")]
    plot_ratio_by_batch(ax, rows, {f"{k.split('_')[1]} nodes": (lambda r, k=k: r[k] / r["plain_tok_s"]) for k in keys},
                        "predicted tokens/s relative to plain decoding")


if __name__ == "__main__":
    main()
