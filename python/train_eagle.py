"""Recipe: train an EAGLE draft layer for the embedded SmolLM2-135M-Instruct on its own answers to ShareGPT
prompts (self-distillation), with EAGLE's losses and EAGLE-3's training-time test. EAGLE is not shipped
(it has tied the shipped Hydra heads so far: benchmarks/results/README.md); python/ship_heads.py --package
would package what this trains.

    .venv/bin/python python/self_data.py --prompts 2048 --new-tokens 256 --batch 64
    .venv/bin/python python/train_eagle.py --self-data ~/.cache/hydra_kernels/training/self-2048-256.json \
        --out runs/eagle

--feature-layers eagle3 trains an EAGLE-3 layer instead: it reads the residual streams entering base layers
2, L // 2 and L - 3 (fc 3H -> H), predicts through its own norm and LM head over the draft vocabulary, and
trains on the token loss alone (the base hidden states are then computed with those streams captured).

Writes runs/eagle/eagle/ (the drafter), runs/eagle/eagle_training.{csv,png} (loss and top-1 agreement
with the base model per unroll step, over training windows) and prints the agreement on --heldout unseen
answers (training/eagle.agreement), the figure that predicts drafting. Base hidden states and training
checkpoints are kept under the cache dir, so an interrupted run resumes.

lr: 2e-4 trains steadily for 2000 steps (~45 min on 2 cores); 5e-4, which suited a 450-step run, diverged
in a long one (loss 7.5 at step 50 rising to 15 by step 450, top-1 falling from 0.21 to 0.13: 2026-11-25).
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
from hydra_kernels.training import compute_hidden_states, recipe_draft_vocabulary, self_data_sequences  # noqa: E402
from hydra_kernels.generate import generate  # noqa: E402
from hydra_kernels.training.data import heldout_chat_prompts  # noqa: E402
from hydra_kernels.training.eagle import agreement, train_eagle  # noqa: E402
from benchmarks.report import plot_training, write_results  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--self-data", required=True, help="JSON of the base model's own answers (python/self_data.py)")
    ap.add_argument("--max-tokens", type=int, default=512, help="answer tokens kept per sequence")
    ap.add_argument("--draft-vocab", type=int, default=16384, help="tokens the draft may propose (0: all)")
    ap.add_argument("--vocab-seqs", type=int, default=3000, help="ShareGPT conversations counted for the draft vocabulary")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--seqs-per-step", type=int, default=8)
    ap.add_argument("--window", type=int, default=256, help="tokens per sequence window")
    ap.add_argument("--loss-positions", type=int, default=384, help="positions per unroll step given the token loss")
    ap.add_argument("--unroll", type=int, default=3, help="training-time test depth (1: EAGLE-1)")
    ap.add_argument("--noise", type=float, default=None,
                    help="input-feature noise, a fraction of each feature's RMS (default 0.1; EAGLE-3: 0)")
    ap.add_argument("--feature-weight", type=float, default=None, help="default 1.0 (EAGLE-3: no feature loss)")
    ap.add_argument("--feature-layers", default=None,
                    help="'eagle3' (base layers 2, L//2, L-3) or comma-separated base layer indices: an EAGLE-3 "
                         "layer over the streams entering them (default: EAGLE-1/2 over the final features)")
    ap.add_argument("--token-weight", type=float, default=1.0)
    ap.add_argument("--out", default="runs/eagle")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout", type=int, default=16,
                    help="held-out ShareGPT prompts whose greedy answers (128 tokens) measure top-1 agreement "
                         "after training")
    args = ap.parse_args(argv)
    if args.heldout < 0:
        ap.error(f"--heldout must be >= 0 (0: no held-out check), got {args.heldout}")
    fl = args.feature_layers
    if fl is not None and fl != "eagle3":
        try:
            fl = [int(k) for k in fl.split(",")]
        except ValueError:
            ap.error(f"--feature-layers takes 'eagle3' or comma-separated layer indices, got {fl!r}")
    if fl is not None and args.feature_weight:
        ap.error("--feature-weight: an EAGLE-3 layer trains on the token loss alone")
    noise = args.noise if args.noise is not None else (0.0 if fl is not None else 0.1)
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
    drafter = hk.new_drafter(model, "eagle", draft_vocab=dv, feature_layers=fl)
    data = compute_hidden_states(model, seqs, cache_dir=work, capture=drafter.feature_layers).train_from(starts)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    hist = train_eagle(model, drafter, data, steps=args.steps, lr=args.lr, seqs_per_step=args.seqs_per_step,
                       window=args.window, loss_positions=args.loss_positions, unroll=args.unroll, noise=noise,
                       feature_weight=args.feature_weight, token_weight=args.token_weight, seed=args.seed,
                       warmup=max(1, args.steps // 20), checkpoint_dir=work, checkpoint_every=25)
    print(f"eagle: {args.steps} steps in {time.perf_counter() - t0:.0f} s, final loss {hist['loss'][-1]:.3f}, "
          f"top-1 agreement per unroll step {hist['accuracy'][-1]}")
    drafter.save(out / "eagle")
    if args.heldout:  # the training log's agreement is over training windows; this is over unseen answers
        prompts = heldout_chat_prompts(tok, args.heldout)
        answers = generate(model, prompts, max_new_tokens=128).sequences
        held = agreement(model, drafter, [p + a for p, a in zip(prompts, answers)], [len(p) - 1 for p in prompts],
                         args.unroll)
        print(f"held-out top-1 agreement per depth ({args.heldout} ShareGPT answers): "
              + " ".join(f"{a:.3f}" for a in held))
    rows = [{"step": s, "loss": loss, **{f"acc{i + 1}": a for i, a in enumerate(acc)}}
            for s, (loss, acc) in enumerate(zip(hist["loss"], hist["accuracy"]))]

    def plot(ax):
        plot_training(ax, rows, [f"acc{i + 1}" for i in range(args.unroll)],
                      [f"top-1 agreement, depth {i + 1}" for i in range(args.unroll)],
                      f"{'EAGLE-3' if fl is not None else 'EAGLE'} layer training, SmolLM2-135M-Instruct, "
                      "self-generated answers")

    write_results(rows, out, "eagle_training", plot)


if __name__ == "__main__":
    main()
