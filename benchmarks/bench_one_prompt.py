"""Drafters on one chat prompt at batch 1, interleaved with plain decoding: what `make demo` shows, measured.

The embedded SmolLM2-135M-Instruct (fp32, this machine's CPU), one prompt (default: make demo's), greedy,
--new-tokens tokens; every decoder once per round in the same order, --reps rounds after one short warm-up
each; medians of decode tokens/s (prefill excluded, as make demo prints them), tokens per step, outputs
checked equal to plain decoding's.

    python benchmarks/bench_one_prompt.py [--prompt TEXT] [--drafters hydra combined DIR ...] [--reps 4]
        [--new-tokens 200] [--out DIR]

A drafter name is a drafter directory, else a shipped or composed kind (hk.load_drafter(kind=...)).
"""
from __future__ import annotations

import argparse
import statistics

import torch
from report import drafter_by_name, print_table, write_results

import hydra_kernels as hk
from hydra_kernels.chat import chat_prompt_ids
from hydra_kernels.demo import PROMPT
from hydra_kernels.generate import generate


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--drafters", nargs="+", default=["hydra", "combined"])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--out", default=None, help="write one_prompt.csv there")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tok = hk.load_model()
    ids = chat_prompt_ids(tok, args.prompt)
    decoders = {"plain": None, **{name: drafter_by_name(name, model) for name in args.drafters}}
    for d in decoders.values():  # warm-up: first-call dispatch, buffers, packing the heads
        generate(model, [ids], drafter=d, max_new_tokens=8)
    speed = {k: [] for k in decoders}
    steps = {k: [] for k in decoders}
    out = {}
    for _ in range(args.reps):
        for name, d in decoders.items():
            o = generate(model, [ids], drafter=d, max_new_tokens=args.new_tokens)
            speed[name].append(o.tokens_per_second)
            steps[name].append(o.mean_accepted_tokens)
            out[name] = o.sequences[0]
    plain = statistics.median(speed["plain"])
    rows = [dict(decoder=name, tok_s=round(statistics.median(v), 1), vs_plain=round(statistics.median(v) / plain, 3),
                 tokens_per_step=round(statistics.median(steps[name]), 2), identical=out[name] == out["plain"],
                 tokens=len(out[name]), reps=args.reps) for name, v in speed.items()]
    print(f"\nbatch 1, {len(ids)}-token prompt, {args.new_tokens} new tokens at most, {args.reps} rounds interleaved, "
          f"{torch.get_num_threads()} threads: {args.prompt[:60]!r}")
    print_table(rows, ["decoder", "tok_s", "vs_plain", "tokens_per_step", "identical"])
    if args.out:
        write_results(rows, args.out, "one_prompt")
    return rows


if __name__ == "__main__":
    main()
