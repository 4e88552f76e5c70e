"""Speculative decoding beside plain decoding, same model, same prompts, same run.

For each drafter (untrained Medusa / Hydra / Hydra++ made on the spot, plus any --drafter checkpoint)
and each tree, greedy decoding of MT-Bench first turns: tokens per step and decode tokens/s, next to
plain greedy decoding. Every speculative output is checked against the plain one (lossless).
Writes CSV and a plot (tokens/s vs tree size).

    python benchmarks/bench_speculative.py [--prompts 4] [--new-tokens 64] [--trees chain-1 default]
        [--drafter DIR ...] [--device cpu] [--dtype float32] [--out benchmarks/out]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from report import write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--trees", nargs="+", default=["chain-2", "default"])
    ap.add_argument("--drafter", nargs="*", default=[], help="trained drafter directories to add")
    ap.add_argument("--kinds", nargs="*", default=["medusa", "hydra", "hydra++"], help="untrained kinds to add")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args()
    torch.set_grad_enabled(False)

    import hydra_kernels as hk
    from hydra_kernels.chat import chat_prompt_ids
    from hydra_kernels.generate import generate
    from hydra_kernels.training import mtbench_questions
    from tqdm.auto import tqdm

    model, tok = hk.load_model(device=args.device, dtype=args.dtype)
    prompts = [chat_prompt_ids(tok, q["turns"][0]) for q in mtbench_questions()[: args.prompts]]
    n = args.new_tokens

    def run(drafter=None, tree=None):
        seqs, steps_tokens, steps, decode_s = [], 0, 0, 0.0
        for p in prompts:  # batch 1, the latency case
            out = generate(model, [p], drafter=drafter, tree=tree, max_new_tokens=n)
            seqs.append(out.sequences[0])
            steps_tokens += sum(out.accept_lengths[0])
            steps += len(out.accept_lengths[0])
            decode_s += out.decode_s
        return seqs, steps_tokens / max(steps, 1), steps_tokens / decode_s

    generate(model, [prompts[0]], max_new_tokens=4)  # warm-up
    plain_seqs, _, plain_tps = run()
    rows = [dict(drafter="plain", tree="-", tree_nodes=1, tokens_per_step=1.0, tokens_per_s=plain_tps,
                 speedup=1.0, lossless=True)]
    drafters = [(f"{k} (untrained)", hk.new_drafter(model, kind=k, num_heads=4)) for k in args.kinds]
    drafters += [(Path(d).name, hk.load_drafter(d, model=model)) for d in args.drafter]
    jobs = [(name, d, t) for name, d in drafters for t in args.trees]
    for name, d, t in tqdm(jobs, desc="drafter x tree"):
        tree = hk.tree.as_tree(t)
        if tree.depth > d.num_heads:
            continue
        seqs, tps_step, tps = run(d, tree)
        rows.append(dict(drafter=name, tree=t, tree_nodes=tree.num_nodes, tokens_per_step=tps_step,
                         tokens_per_s=tps, speedup=tps / plain_tps, lossless=seqs == plain_seqs))

    print(f"\ngreedy decoding, {model.dtype} on {model.device}, batch 1, {len(prompts)} MT-Bench prompts x {n} tokens")
    print(f"{'drafter':<22} {'tree':<10} {'nodes':>5} {'tokens/step':>11} {'tokens/s':>9} {'speedup':>7} {'lossless':>8}")
    for r in rows:
        print(f"{r['drafter']:<22} {r['tree']:<10} {r['tree_nodes']:>5} {r['tokens_per_step']:>11.2f} "
              f"{r['tokens_per_s']:>9.1f} {r['speedup']:>7.2f} {str(r['lossless']):>8}")
    def plot(ax):
        for name in dict.fromkeys(r["drafter"] for r in rows[1:]):
            pts = sorted((r["tree_nodes"], r["tokens_per_s"]) for r in rows if r["drafter"] == name)
            ax.plot(*zip(*pts), marker="o", label=name)
        ax.axhline(plain_tps, color="k", ls="--", label="plain")
        ax.set_xlabel("tree nodes")
        ax.set_ylabel("decode tokens/s")
        ax.set_xscale("log")
        sizes = sorted({r["tree_nodes"] for r in rows[1:]})
        ax.minorticks_off()
        ax.set_xticks(sizes, [str(x) for x in sizes])
        ax.legend(fontsize=7)

    write_results(rows, args.out, "bench_speculative", plot)
    if not all(r["lossless"] for r in rows):
        raise SystemExit("a speculative run differed from plain greedy decoding")


if __name__ == "__main__":
    main()
