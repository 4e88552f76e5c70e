"""Sampling with a drafter: exact rejection sampling vs Medusa's typical acceptance vs plain sampling.

MT-Bench first turns on the embedded default model, batch 1, at --temperature (0.7), with the shipped
drafters (hk.load_drafter(kind=...)). Every method decodes each prompt in turn before the next prompt
starts (interleaved, the order rotated per prompt), so a slow moment of the machine hits all methods
alike. Reports tokens per step (root + accepted, per base forward) and decode tokens/s (prefill
excluded), summed over prompts, and the speedup over plain sampling. Writes CSV, a Markdown table and a
plot to --out.

    python benchmarks/bench_sampling.py [--prompts 12] [--new-tokens 96] [--kinds hydra medusa]
        [--temperature 0.7] [--top-k 0] [--top-p 1.0] [--seed 0] [--device cpu] [--out benchmarks/out]

Defaults take about 6 minutes on a 2-core CPU (SmolLM2-135M fp32).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from report import print_table, write_results


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--kinds", nargs="+", default=["hydra", "medusa"], help="shipped drafter kinds")
    ap.add_argument("--acceptance", nargs="+", default=["rejection", "typical"])
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)

    import hydra_kernels as hk
    from hydra_kernels.chat import chat_prompt_ids
    from hydra_kernels.generate import generate
    from hydra_kernels.training import mtbench_questions
    from tqdm.auto import tqdm

    model, tok = hk.load_model(device=args.device, dtype=args.dtype)
    prompts = [chat_prompt_ids(tok, q["turns"][0]) for q in mtbench_questions()[: args.prompts]]
    methods = [("plain", None, None)]
    for kind in args.kinds:
        d = hk.load_drafter(kind=kind, model=model)
        methods += [(f"{kind} {acc}", d, acc) for acc in args.acceptance]
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_token_id=[])
    generate(model, [prompts[0]], max_new_tokens=4, **sampling)  # warm-up
    totals = {name: dict(tokens=0, steps=0, decode_s=0.0) for name, _, _ in methods}
    for i, p in enumerate(tqdm(prompts, desc="prompts (every method interleaved)")):
        for j in range(len(methods)):
            name, d, acc = methods[(i + j) % len(methods)]  # rotate the order per prompt
            out = generate(model, [p], drafter=d, acceptance=acc, max_new_tokens=args.new_tokens,
                           seed=args.seed + i, **sampling)
            t = totals[name]
            t["tokens"] += sum(out.accept_lengths[0])
            t["steps"] += len(out.accept_lengths[0])
            t["decode_s"] += out.decode_s

    plain_tps = totals["plain"]["tokens"] / totals["plain"]["decode_s"]
    rows = []
    for name, d, acc in methods:
        t = totals[name]
        tps = t["tokens"] / t["decode_s"]
        rows.append(dict(method=name, drafter=d.kind if d is not None else "-", acceptance=acc or "-",
                         exact=acc != "typical", tokens_per_step=t["tokens"] / max(t["steps"], 1),
                         tokens_per_s=tps, speedup=tps / plain_tps))
    print(f"\nsampling at temperature {args.temperature} (top_k {args.top_k}, top_p {args.top_p}), "
          f"{model.dtype} on {model.device}, batch 1, {len(prompts)} MT-Bench first turns x {args.new_tokens} tokens")
    print_table(rows, ["method", "exact", "tokens_per_step", "tokens_per_s", "speedup"])

    def plot(ax):
        names = [r["method"] for r in rows]
        ax.bar(names, [r["tokens_per_s"] for r in rows],
               color=["gray" if r["acceptance"] == "-" else "C0" if r["exact"] else "C1" for r in rows])
        for k, r in enumerate(rows):
            ax.text(k, r["tokens_per_s"], f"{r['tokens_per_step']:.2f} tok/step", ha="center", va="bottom", fontsize=7)
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"T={args.temperature}: exact rejection (blue) vs typical (orange) vs plain", fontsize=9)
        ax.tick_params(axis="x", labelsize=7, rotation=15)

    write_results(rows, args.out, "bench_sampling", plot)
    md = Path(args.out) / "bench_sampling.md"
    md.write_text("| method | exact | tokens/step | tokens/s | speedup |\n|---|---|---|---|---|\n" + "".join(
        f"| {r['method']} | {r['exact']} | {r['tokens_per_step']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} |\n"
        for r in rows))
    return rows


if __name__ == "__main__":
    main()
