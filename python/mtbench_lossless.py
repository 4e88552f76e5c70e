"""Lossless check of shipped (or any) drafters on MT-Bench's 80 first turns: every speculative output
must equal plain greedy decoding token for token; prints the count and tokens per step per drafter.

    .venv/bin/python python/mtbench_lossless.py [--drafters medusa hydra | --drafters path/to/dir ...]
        [--batch 8] [--new-tokens 256] [--questions 80]

A name is a shipped kind (hk.load_drafter(kind=...)); anything else is a checkpoint directory. Each
drafter uses its own tree for this device (tree=None), whole at every step (--budget-table: its budget table's
choice per batch size, which at batch 8 is often a plain step). Exits non-zero if any output differs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

import hydra_kernels as hk
from hydra_kernels.budget import whole_tree_budget
from hydra_kernels.chat import chat_prompt_ids
from hydra_kernels.generate import generate
from hydra_kernels.training.data import mtbench_questions


def batched(model, prompts, bs, desc, **kw):
    seqs, acc = [], []
    for i in tqdm(range(0, len(prompts), bs), desc=desc):
        o = generate(model, prompts[i:i + bs], **kw)
        seqs += o.sequences
        acc += o.accept_lengths
    return seqs, acc


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", nargs="+", default=sorted(hk.drafters.shipped_drafters()))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--questions", type=int, default=80)
    ap.add_argument("--budget-table", action="store_true",
                    help="let each drafter's per-batch budget table choose its steps (at --batch 8 the shipped tables "
                         "run plain steps); default: its whole tree every step, so tokens/step measures the drafter")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tok = hk.load_model(device="cpu")
    prompts = [chat_prompt_ids(tok, q["turns"][0]) for q in mtbench_questions()[: args.questions]]
    kw = dict(max_new_tokens=args.new_tokens)
    plain, _ = batched(model, prompts, args.batch, "plain", **kw)
    failed = False
    for name in args.drafters:
        d = hk.load_drafter(name, model=model) if Path(name).is_dir() else hk.load_drafter(model=model, kind=name)
        dev = model.device.type
        budget = ("auto" if dev in d.budget_tables else None) if args.budget_table else whole_tree_budget(d, None, dev)
        seqs, acc = batched(model, prompts, args.batch, name, drafter=d, budget=budget, **kw)
        same = sum(a == b for a, b in zip(seqs, plain))
        steps = sum(len(a) for a in acc)
        print(f"{name}: {same}/{len(plain)} identical to plain greedy, {sum(map(sum, acc)) / max(1, steps):.3f} tokens/step "
              f"(batch {args.batch}, {args.new_tokens} new tokens, EOS stops)")
        failed |= same != len(plain)
    if failed:
        sys.exit("a speculative output differs from plain greedy decoding")


if __name__ == "__main__":
    main()
