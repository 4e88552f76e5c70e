"""Recipe: train an MLPSpeculator (IBM's, fms-extras; hk.new_drafter(kind="mlp_speculator")) for the
embedded SmolLM2-135M-Instruct, distilled from the base model, the way python/train_heads.py trains the
heads. The paper's two training stages are two runs of this recipe: ShareGPT text first, then the base
model's own answers (python/self_data.py) with --self-data FILE --self-only --init <the first run's dir>.

    .venv/bin/python python/train_mlp_speculator.py                                  # ShareGPT
    .venv/bin/python python/self_data.py --prompts 2048 --new-tokens 256 --batch 64
    .venv/bin/python python/train_mlp_speculator.py --self-data ~/.cache/hydra_kernels/training/self-2048-256.json \
        --self-only --init runs/mlp_speculator/mlp_speculator --out runs/mlp_speculator_self

The shipped speculator (hk.load_drafter(kind="mlp_speculator")): tie_base, the second stage only, on 1024
answers (550 s here, half the shipped Medusa heads' budget of 800 steps x 512 positions on 2048 answers):

    .venv/bin/python python/self_data.py --prompts 1024 --new-tokens 256 --batch 64
    .venv/bin/python python/train_mlp_speculator.py --self-data ~/.cache/hydra_kernels/training/self-1024-256.json \
        --self-only --tie-base --steps 400 --positions 512 --out runs/mlp_tied
    .venv/bin/python python/ship_heads.py --src runs/mlp_tied --kinds mlp_speculator --dst runs/ship_mlp
    .venv/bin/python python/search_budget.py --drafter runs/ship_mlp/mlp_speculator

Writes <out>/mlp_speculator/ (our drafter format; hk.load_drafter reads it) and <out>/training_loss.{csv,png}
(loss per step, and per stage). Base hidden states and training checkpoints are kept under the cache dir,
so an interrupted run resumes (checkpoints are named by the run's fingerprint).
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
                                    sharegpt_token_sequences, train_mlp_speculator)
from benchmarks.report import write_results  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-seqs", type=int, default=400, help="ShareGPT conversations to train on")
    ap.add_argument("--max-tokens", type=int, default=512, help="tokens kept per conversation")
    ap.add_argument("--vocab-seqs", type=int, default=3000, help="conversations counted for the draft vocabulary")
    ap.add_argument("--draft-vocab", type=int, default=16384, help="tokens the stages may propose (0: all)")
    ap.add_argument("--n-predict", type=int, default=3, help="stages: tokens drafted per step")
    ap.add_argument("--inner-dim", type=int, default=0, help="the stages' width (0: the model's hidden size)")
    ap.add_argument("--top-k", type=int, nargs="+", default=None,
                    help="candidates per stage when drafting (one per stage; default 4 3 2 ...)")
    ap.add_argument("--n-candidates", type=int, default=None, help="suffixes kept per step (default min(8, prod))")
    ap.add_argument("--tie-weights", action="store_true", help="share emb / head / norm across stages")
    ap.add_argument("--scale-input", action="store_true", help="RMS-normalise the base hidden state first")
    ap.add_argument("--tie-base", action="store_true",
                    help="stages read the base model's embedding and rank with its LM head (frozen, not stored)")
    ap.add_argument("--init", default=None, help="start from this mlp_speculator (e.g. the ShareGPT stage's)")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--positions", type=int, default=256, help="positions per step (every stage trains on each)")
    ap.add_argument("--bf16", action="store_true", help="run the speculator under bf16 autocast (AMX CPUs, GPUs)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--distill-weight", type=float, default=0.9, help="1: teacher KL only; 0: next-token CE only")
    ap.add_argument("--self-data", default=None, help="JSON of the base model's own answers (python/self_data.py), "
                    "plain or .gz")
    ap.add_argument("--self-only", action="store_true", help="train on --self-data alone")
    ap.add_argument("--out", default="runs/mlp_speculator")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.self_only and not args.self_data:
        ap.error("--self-only needs --self-data")
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
    if not seqs:
        raise SystemExit("no training sequences")
    print(f"{len(seqs)} training sequences, {sum(map(len, seqs))} tokens")
    if args.init:
        drafter = hk.load_drafter(args.init, model=model)
        if drafter.kind != "mlp_speculator":
            raise SystemExit(f"--init {args.init} is a {drafter.kind!r} drafter, not an mlp_speculator")
    else:
        dv = None
        if args.draft_vocab:
            dv = recipe_draft_vocabulary(tok, seqs, starts, args.draft_vocab, args.vocab_seqs)
        drafter = hk.new_drafter(model, "mlp_speculator", n_predict=args.n_predict, inner_dim=args.inner_dim,
                                 top_k_tokens_per_head=args.top_k, n_candidates=args.n_candidates,
                                 tie_weights=args.tie_weights, scale_input=args.scale_input,
                                 tie_base=args.tie_base, draft_vocab=dv)
    data = compute_hidden_states(model, seqs, cache_dir=work).train_from(starts)

    t0 = time.perf_counter()
    hist = train_mlp_speculator(model, drafter, data, steps=args.steps, lr=args.lr, positions_per_step=args.positions,
                                warmup=max(1, args.steps // 20), distill_weight=args.distill_weight, seed=args.seed,
                                amp_dtype=torch.bfloat16 if args.bf16 else None, checkpoint_dir=work,
                                checkpoint_every=50)  # named by the run's fingerprint
    print(f"mlp_speculator: {args.steps} steps in {time.perf_counter() - t0:.0f} s, final loss {hist['loss'][-1]:.3f}")
    drafter.save(out / "mlp_speculator")
    rows = [{"step": s, "loss": loss, **{f"stage{i}": v for i, v in enumerate(stages)}}
            for s, (loss, stages) in enumerate(zip(hist["loss"], hist["stage_loss"]))]

    def plot(ax):
        k = 25  # running mean: one step's loss is noisy
        for col in ["loss"] + [f"stage{i}" for i in range(drafter.n_predict)]:
            ys = torch.tensor([r[col] for r in rows], dtype=torch.float64)
            ys = torch.nn.functional.avg_pool1d(ys[None, None], k, 1)[0, 0] if len(ys) > k else ys
            ax.plot(range(len(ys)), ys.tolist(), label=col)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title("mlp_speculator training, SmolLM2-135M-Instruct")
        ax.legend()

    write_results(rows, out, "training_loss", plot)


if __name__ == "__main__":
    main()
