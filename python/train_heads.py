"""Recipe: train Medusa, Hydra and Hydra++ heads for the embedded SmolLM2-135M-Instruct on ShareGPT,
distilled from the base model. Reproduces the shipped heads (python/ship_heads.py packages them).

    .venv/bin/python python/train_heads.py                 # all three kinds, defaults below
    .venv/bin/python python/train_heads.py --kinds hydra   # one kind

The shipped heads (hydra + medusa; 2026-11-22, this 2-core CPU, ~41 min for all three kinds):

    .venv/bin/python python/self_data.py --prompts 2048 --new-tokens 256 --batch 64
    .venv/bin/python python/train_heads.py --self-data ~/.cache/hydra_kernels/training/self-2048-256.json \
        --self-only --kinds hydra hydra++ medusa --positions 512 --seqs-per-step 6 --bf16 --out runs/heads_self
    .venv/bin/python python/ship_heads.py --src runs/heads_self --dst runs/ship
    .venv/bin/python python/eval_heads.py --heads runs/ship --out runs/eval_self --heldout 16  # search + table
    # the shipped CPU trees (3 nodes) come from re-searching on the current dev CPU (2026-11-23, AMD EPYC):
    .venv/bin/python python/eval_heads.py --heads runs/ship --kinds medusa hydra --out runs/eval_cur --time-prompts 8
    .venv/bin/python python/ship_heads.py --src runs/ship --package hydra medusa

Writes runs/heads/<kind>/ (drafter dirs), runs/heads/training_loss.{csv,png}; base hidden states and
training checkpoints are kept under the cache dir, so an interrupted run resumes (checkpoints are named
by the run's fingerprint: new data or other settings start afresh instead of resuming another run).
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
                                    sharegpt_token_sequences, train_drafter)
from benchmarks.report import write_results  # noqa: E402

# kind -> (ResBlocks per head, training steps). Hydra++ (its prefix layer) with one-layer heads: 24.6 MB in
# bf16, within the package's 32 MB (four layers, the paper's: 32.2 MB), and measured above hydra (README).
KIND_SHAPES = {"medusa": (1, 800), "hydra": (1, 800), "hydra++": (1, 800)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=list(KIND_SHAPES), choices=list(KIND_SHAPES))
    ap.add_argument("--train-seqs", type=int, default=400, help="ShareGPT conversations to train on")
    ap.add_argument("--max-tokens", type=int, default=512, help="tokens kept per conversation")
    ap.add_argument("--vocab-seqs", type=int, default=3000, help="conversations counted for the draft vocabulary")
    ap.add_argument("--draft-vocab", type=int, default=16384, help="tokens the heads may propose")
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="override every kind's step count")
    ap.add_argument("--num-layers", type=int, default=None, help="override every kind's ResBlocks per head")
    ap.add_argument("--positions", type=int, default=256, help="teacher positions per step")
    ap.add_argument("--seqs-per-step", type=int, default=32,
                    help="Hydra++: sequences a step draws its positions from (its prefix layer reads their past)")
    ap.add_argument("--prefix-no-norm", action="store_true",
                    help="Hydra++: no final RMSNorm after the prefix layer (its heads start from exactly h)")
    ap.add_argument("--prefix-lr-scale", type=float, default=1.0, help="Hydra++ prefix layer's lr as a fraction of --lr")
    ap.add_argument("--bf16", action="store_true", help="run the heads under bf16 autocast (AMX CPUs, GPUs)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--distill-weight", type=float, default=0.9, help="1: teacher KL only; 0: next-token CE only")
    ap.add_argument("--self-data", default=None, help="JSON of the base model's own answers (python/self_data.py), "
                    "plain or .gz")
    ap.add_argument("--self-only", action="store_true", help="train on --self-data alone")
    ap.add_argument("--out", default="runs/heads")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = cache_root() / "training"

    model, tok = hk.load_model(dtype=torch.float32)
    seqs = [] if args.self_only else sharegpt_token_sequences(tok, args.train_seqs, args.max_tokens)
    starts = [0] * len(seqs)  # ShareGPT: every position
    if args.self_data:  # the base model's own answers only are trained on
        more, more_starts = self_data_sequences(args.self_data, args.max_tokens)
        seqs, starts = seqs + more, starts + more_starts
    print(f"{len(seqs)} training sequences, {sum(map(len, seqs))} tokens")
    dv = recipe_draft_vocabulary(tok, seqs, starts, args.draft_vocab, args.vocab_seqs)
    data = compute_hidden_states(model, seqs, cache_dir=work).train_from(starts)

    rows = []
    for kind in args.kinds:
        layers, steps = KIND_SHAPES[kind]
        layers, steps = args.num_layers or layers, args.steps or steps
        torch.manual_seed(args.seed)
        drafter = hk.new_drafter(model, kind, num_heads=args.num_heads, num_layers=layers, draft_vocab=dv,
                                 prefix_final_norm=not args.prefix_no_norm)
        t0 = time.perf_counter()
        hist = train_drafter(model, drafter, data, steps=steps, lr=args.lr, positions_per_step=args.positions,
                             warmup=max(1, steps // 20), distill_weight=args.distill_weight, seed=args.seed,
                             prefix_lr_scale=args.prefix_lr_scale,
                             seqs_per_step=args.seqs_per_step, amp_dtype=torch.bfloat16 if args.bf16 else None,
                             checkpoint_dir=work, checkpoint_every=50)  # named by the run's fingerprint
        print(f"{kind}: {steps} steps in {time.perf_counter() - t0:.0f} s, final loss {hist['loss'][-1]:.3f}")
        drafter.save(out / kind)
        for s, (loss, heads) in enumerate(zip(hist["loss"], hist["head_loss"])):
            rows.append({"kind": kind, "step": s, "loss": loss, **{f"head{i}": v for i, v in enumerate(heads)}})

    def plot(ax):
        for kind in args.kinds:
            r = [x for x in rows if x["kind"] == kind]
            k = 25  # running mean: one step's loss is noisy
            ys = torch.tensor([x["loss"] for x in r])
            ys = torch.nn.functional.avg_pool1d(ys[None, None], k, 1)[0, 0] if len(ys) > k else ys
            ax.plot(range(len(ys)), ys.tolist(), label=kind)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (mean over heads)")
        ax.set_title("draft-head training, SmolLM2-135M-Instruct, ShareGPT")
        ax.legend()

    write_results(rows, out, "training_loss", plot)


if __name__ == "__main__":
    main()
