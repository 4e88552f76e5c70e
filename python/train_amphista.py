"""Recipe: train an Amphista drafter (hk.new_drafter(kind="amphista")) for the embedded SmolLM2-135M-Instruct
on its own answers to ShareGPT prompts (self-distillation): KL to the base model's distribution plus a
weighted cross-entropy on the true tokens, the adaptation layers run causally over windows of whole sequences.

    .venv/bin/python python/self_data.py --prompts 1024 --new-tokens 256 --batch 64
    .venv/bin/python python/train_amphista.py --self-data ~/.cache/hydra_kernels/training/self-1024-256.json \
        --out runs/amphista

The shipped Amphista (hk.load_drafter(kind="amphista")): the shipped Medusa heads' budget, 800 steps x 512
positions on 2048 answers (1309 s on the 2-core Xeon VM), its 3-node CPU tree from python/eval_heads.py and its
budget table from python/search_budget.py (results log, 2026-11-26):

    .venv/bin/python python/train_amphista.py --self-data ~/.cache/hydra_kernels/training/self-2048-256.json \
        --steps 800 --loss-positions 512 --out runs/amphista2k
    .venv/bin/python python/ship_heads.py --src runs/amphista2k --kinds amphista --dst runs/eval_amph
    (copy the shipped medusa and hydra dirs into runs/eval_amph)
    .venv/bin/python python/eval_heads.py --heads runs/eval_amph --kinds medusa hydra amphista --size 3
    .venv/bin/python python/search_budget.py --drafter runs/eval_amph/amphista --reps 5
    .venv/bin/python python/ship_heads.py --src runs/eval_amph --package amphista

Writes runs/amphista/amphista/ (the drafter, our format; hk.load_drafter reads it) and
runs/amphista/amphista_training.{csv,png} (loss, and top-1 agreement with the base model per head). Base
hidden states and training checkpoints are kept under the cache dir, so an interrupted run resumes.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hydra_kernels as hk  # noqa: E402
from hydra_kernels.model.gguf_convert import cache_root  # noqa: E402
from hydra_kernels.training import (compute_hidden_states, recipe_draft_vocabulary, self_data_sequences,  # noqa: E402
                                    train_amphista)
from benchmarks.report import plot_training, write_results  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--self-data", required=True, help="JSON of the base model's own answers (python/self_data.py), "
                    "plain or .gz")
    ap.add_argument("--max-tokens", type=int, default=512, help="answer tokens kept per sequence")
    ap.add_argument("--draft-vocab", type=int, default=16384, help="tokens the heads may propose (0: all)")
    ap.add_argument("--vocab-seqs", type=int, default=3000, help="ShareGPT conversations counted for the draft vocabulary")
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--lm-head", choices=["tied", "low_rank"], default="tied")
    ap.add_argument("--lm-head-rank", type=int, default=256)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seqs-per-step", type=int, default=8)
    ap.add_argument("--window", type=int, default=256, help="tokens per sequence window")
    ap.add_argument("--loss-positions", type=int, default=256, help="positions per step where all heads are trained")
    ap.add_argument("--ce-weight", type=float, default=0.1, help="weight of the cross-entropy on the true tokens")
    ap.add_argument("--bf16", action="store_true", help="train under bf16 autocast")
    ap.add_argument("--out", default="runs/amphista")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = cache_root() / "training"

    model, tok = hk.load_model(dtype=torch.float32)
    seqs, starts = self_data_sequences(args.self_data, args.max_tokens)
    print(f"{len(seqs)} training sequences, {sum(map(len, seqs))} tokens")
    dv = None
    if args.draft_vocab:
        dv = recipe_draft_vocabulary(tok, seqs, starts, args.draft_vocab, args.vocab_seqs)
    data = compute_hidden_states(model, seqs, cache_dir=work).train_from(starts)
    torch.manual_seed(args.seed)
    drafter = hk.new_drafter(model, "amphista", num_heads=args.num_heads, draft_vocab=dv, lm_head=args.lm_head,
                             lm_head_rank=args.lm_head_rank)
    t0 = time.perf_counter()
    hist = train_amphista(model, drafter, data, steps=args.steps, lr=args.lr, seqs_per_step=args.seqs_per_step,
                          window=args.window, loss_positions=args.loss_positions, ce_weight=args.ce_weight,
                          seed=args.seed, warmup=max(1, args.steps // 20), checkpoint_dir=work, checkpoint_every=25,
                          amp_dtype=torch.bfloat16 if args.bf16 else None)
    print(f"amphista: {args.steps} steps in {time.perf_counter() - t0:.0f} s, final loss {hist['loss'][-1]:.3f}, "
          f"top-1 agreement per head {hist['accuracy'][-1]}")
    drafter.save(out / "amphista")
    rows = [{"step": s, "loss": loss, **{f"loss{i + 1}": v for i, v in enumerate(hl)},
             **{f"acc{i + 1}": a for i, a in enumerate(acc)}}
            for s, (loss, hl, acc) in enumerate(zip(hist["loss"], hist["head_loss"], hist["accuracy"]))]

    def plot(ax):
        plot_training(ax, rows, [f"acc{i + 1}" for i in range(args.num_heads)],
                      [f"top-1 agreement, head {i + 1}" for i in range(args.num_heads)],
                      "Amphista training, SmolLM2-135M-Instruct, self-generated answers")

    write_results(rows, out, "amphista_training", plot)


if __name__ == "__main__":
    main()
