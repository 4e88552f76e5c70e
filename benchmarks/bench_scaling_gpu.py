"""The scaling benchmark's GPU half (issue 26): decode-step cost across batch sizes, contexts and draft budgets
at a real model's shapes with random weights, and the draft budget each point would get.

Timings do not depend on weight values; acceptance does, and random weights accept nothing. So at each
(batch B, context C) point this times, on the GPU's own clock (each step captured in a CUDA graph and
replayed: eager steps at 8B shapes are bound by the host's launches, bench_decode_step):
- the plain step (T = 1: forward, greedy LM head, KV append),
- the verify step of a T-node tree for each budget T (tree forward, greedy LM head, greedy_verify,
  commit_kv of a fixed 4-token path; bench_decode_step.Steps),
- the drafting a Hydra-style drafter adds to it: per depth of the tree, one projection [H -> 3H] (a Hydra
  head's first layer at these shapes) and the LM head's top-10 (ops.lm_head_topk) over that depth's nodes,
and projects tokens/s = B x tokens per step(T) / (verify + draft time), with tokens per step(T) measured with
the real model on MT-Bench's 80 prompts (--acceptance: a replay CSV of kind, size, tokens_per_step; default
the shipped Hydra heads' curve). The "chosen" budget is the fastest projected, 1 = plain decoding where no
tree pays: what a budget table searched on this device would hold for a drafter of that acceptance.

    python benchmarks/bench_scaling_gpu.py [--model llama-3-8b] [--batches 1 2 4 8 16]
        [--contexts 128 2048 8192] [--budgets 3 8 16 32 64] [--acceptance CSV] [--kind hydra] [--out DIR]

GB/s: the bytes a step must read (weights once, the K/V of B x C rows; bench_decode_step.step_bytes) over the
plain step's time, beside the copy ceiling measured in the same run. CPU smoke (eager times):
--model smollm2-135m --layers 1 --batches 1 2 --contexts 32 --budgets 3 8 --reps 1.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import hydra_kernels as hk  # noqa: E402
from bench_decode_step import Steps, random_model, step_bytes  # noqa: E402
from report import capture_graph, copy_bandwidth_gbs, plot_ratio_by_batch, print_table, time_us, write_results  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_ACCEPTANCE = RESULTS / "mtbench_tree_sizes_amphista2k_xeon.csv"  # shipped hydra / medusa + amphista


def read_acceptance(path: Path, kind: str) -> dict[int, float]:
    """{tree size: tokens per step} of one drafter kind from a replay CSV (kind, size, tokens_per_step)."""
    with open(path) as f:
        curve = {int(r["size"]): float(r["tokens_per_step"]) for r in csv.DictReader(f) if r["kind"] == kind}
    if not curve:
        raise ValueError(f"{path} has no rows of kind {kind!r}: pass --kind with one of its kinds")
    return curve


FAILED_CAPTURES: list[str] = []  # steps timed eagerly because their capture failed (printed at the end)


def step_us(fn, dev, reps: int) -> float:
    """Median us of fn: replays of a CUDA graph of it on a GPU (the device's own time), eager on the CPU or
    where the capture fails (recorded in FAILED_CAPTURES and printed: such a time includes host launches)."""
    if dev.type == "cuda":
        try:
            graph, _ = capture_graph(fn)
            us = time_us(graph.replay, dev, reps=reps, warmup=3)
            del graph
            return us
        except Exception as e:  # noqa: BLE001 - reported, and the point is still timed
            FAILED_CAPTURES.append(f"{getattr(fn, '__qualname__', fn)}: {type(e).__name__}: {e}"[:200])
    fn()
    return time_us(fn, dev, reps=reps, warmup=1)


def draft_us(model, tree, B: int, dev, reps: int, proj: torch.Tensor) -> float:
    """A Hydra-style draft of `tree` for B sequences: per depth, the depth's nodes through an [H -> 3H]
    projection and the LM head's top-10 (the weights each depth must read: the head and the LM head)."""
    widths = torch.bincount(tree.depths.cpu())[1:].tolist()  # nodes per depth below the root
    H = model.config.hidden_size
    xs = [torch.randn(B, w, H, device=dev, dtype=model.dtype) for w in widths]
    W = model.output.weight

    def draft():
        for x in xs:  # the head's first layer reads its [H, 3H] weight once per depth; the top-k reads the LM head
            hk.ops.lm_head_topk((x @ proj)[..., :H], W, 10)
    return step_us(draft, dev, reps)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3-8b", choices=list(hk.NAMED_CONFIGS))
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model (CPU smoke runs)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 2048, 8192])
    ap.add_argument("--budgets", type=int, nargs="+", default=[3, 8, 16, 32, 64], help="tree sizes (root included)")
    ap.add_argument("--acceptance", type=Path, default=DEFAULT_ACCEPTANCE)
    ap.add_argument("--kind", default="hydra", help="the drafter kind whose replayed tokens per step to use")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args(argv)
    curve = read_acceptance(args.acceptance, args.kind)
    missing = [T for T in args.budgets if T not in curve]
    if missing:
        raise SystemExit(f"--budgets {missing}: {args.acceptance} has tokens per step for {args.kind} at sizes "
                         f"{sorted(curve)} only; pick budgets among them")
    torch.set_grad_enabled(False)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = random_model(args.model, args.layers, dev, dtype)
    plan = model.backend_plan("auto")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    bw = copy_bandwidth_gbs(dev)
    H = model.config.hidden_size
    proj = torch.randn(H, 3 * H, device=dev, dtype=dtype) / H**0.5
    rows, max_T = [], max(args.budgets)
    points = [(B, C) for B in args.batches for C in args.contexts]
    bar = tqdm(points, desc="batch x context")
    for B in args.batches:
        cache = model.new_kv_cache(B, max(args.contexts) + max_T + 1)  # one per batch size, every context
        cache.kv.normal_(0.0, 0.5, generator=torch.Generator(device=dev).manual_seed(B))
        drafts = {T: draft_us(model, hk.tree.default_tree(T, depth=4).to(dev), B, dev, args.reps, proj)
                  for T in args.budgets}  # drafting does not read the context
        for C in args.contexts:
            plain = step_us(Steps(model, B, 1, 1, C, plan, cache=cache).plain, dev, args.reps)
            row = {"device": name, "model": args.model, "batch": B, "context": C, "plain_us": plain,
                   "eager_fallbacks": len(FAILED_CAPTURES),
                   "plain_tok_s": B / plain * 1e6, "plain_GB_s": step_bytes(model, B, C, 1) / plain / 1e3,
                   "copy_GB_s": bw}
            best = (row["plain_tok_s"], 1)
            for T in args.budgets:
                verify = step_us(Steps(model, B, T, 4, C, plan, cache=cache).speculative, dev, args.reps)
                tok_s = B * curve[T] / (verify + drafts[T]) * 1e6
                row.update({f"verify{T}_us": verify, f"draft{T}_us": drafts[T], f"T{T}_ratio": tok_s / row["plain_tok_s"]})
                best = max(best, (tok_s, T))
            row["chosen"], row["chosen_ratio"] = best[1], best[0] / row["plain_tok_s"]
            rows.append(row)
            bar.update()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        del cache
        # after every batch size: a sweep cut short by a time limit keeps what it measured
        write_results(rows, args.out, f"scaling_{args.model}_{dev.type}")
    bar.close()
    print(f"{name}: copy ceiling {bw:.0f} GB/s; tokens per step ({args.kind}, {args.acceptance.name}): "
          + ", ".join(f"{T}: {curve[T]:.2f}" for T in args.budgets))
    print_table(rows, ["batch", "context", "plain_us", "plain_tok_s", "plain_GB_s",
                       *[f"verify{T}_us" for T in args.budgets], *[f"draft{T}_us" for T in args.budgets],
                       *[f"T{T}_ratio" for T in args.budgets], "chosen", "chosen_ratio"])
    if FAILED_CAPTURES:
        print(f"TIMED EAGERLY (capture failed) {len(FAILED_CAPTURES)}x, first: {FAILED_CAPTURES[0]}")
    write_results(rows, args.out, f"scaling_{args.model}_{dev.type}", plot=lambda ax: plot(ax, rows, args.budgets))
    return rows


def plot(ax, rows, budgets):
    series = {f"T = {T}": (lambda r, T=T: r[f"T{T}_ratio"]) for T in budgets}
    plot_ratio_by_batch(ax, rows, series, "projected tokens/s / plain decoding")


if __name__ == "__main__":
    main()
