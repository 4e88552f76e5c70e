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

More --self-data files in the same format train together, e.g. ShareGPT's own first replies
(training/data.sharegpt_reply_data, which python/gpu_carry.py writes): on 2 cores they neither helped nor
hurt held-out agreement (2026-11-27, benchmarks/results/README.md); they are for runs long enough to
memorise 2048 answers.

On a lent GPU (python/gpu_carry.py carries the model and data there in two calls; it prints them):
--device cuda --model <the carried GGUF> --draft-vocab-file <the carried ids> --deadline-s S trains as
many steps as fit before S seconds after the start, saving included (timed on throwaway probes, then one
cosine schedule over them; --time-budget-s S counts the training loop's seconds alone; nothing
cached or checkpointed on that one-shot machine), with no held-out check there (--heldout 0: its prompts
are in a package the GPU lacks) and --save-dtype bfloat16 (what comes back from the GPU is at most 16 MiB
a file). Back here, --evaluate DIR measures the held-out agreement of the layer it wrote.

lr: 2e-4 trains steadily for 2000 steps (~45 min on 2 cores); 5e-4, which suited a 450-step run, diverged
in a long one (loss 7.5 at step 50 rising to 15 by step 450, top-1 falling from 0.21 to 0.13: 2026-11-25).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hydra_kernels as hk  # noqa: E402
from hydra_kernels.model.gguf_convert import cache_root  # noqa: E402
from hydra_kernels.training import compute_hidden_states, recipe_draft_vocabulary, self_data_sequences  # noqa: E402
from hydra_kernels.generate import generate  # noqa: E402
from hydra_kernels.training.data import heldout_chat_prompts, sharegpt_path  # noqa: E402
from hydra_kernels.training.eagle import agreement, train_eagle  # noqa: E402
from hydra_kernels.training.loop import steps_within  # noqa: E402
from benchmarks.report import plot_training, write_results  # noqa: E402


SAVE_RESERVE_S = 20.0  # --deadline-s keeps this many seconds for saving the layer and writing the curves


def main(argv=None):
    started = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--self-data", nargs="+",
                    help="JSON of the base model's own answers (python/self_data.py), plain or .gz; more files (the "
                         "same format, e.g. ShareGPT's replies that python/gpu_carry.py writes) train together")
    ap.add_argument("--model", help="the base model: a .gguf file or an HF directory (default: the embedded one)")
    ap.add_argument("--device", default="cpu", help="where the base model and the layer train: cpu or cuda")
    ap.add_argument("--draft-vocab-file",
                    help="a JSON list of the draft vocabulary's token ids (python/gpu_carry.py writes the recipe's "
                         "rule's ids, which count ShareGPT text: the package is not on the GPU); instead of "
                         "--draft-vocab / --vocab-seqs")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="train as many steps as fit in this many seconds (the training loop's, after loading and "
                         "the hidden states) instead of --steps; a one-shot run on a lent machine, so nothing is "
                         "cached or checkpointed on its disk and no progress bar floods the call's output")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="like --time-budget-s, but counted from the script's start: loading, the base hidden states "
                         "and the timing probes are spent from it, and the layer is saved before it ends (a lent "
                         "GPU's call limit: give the call's limit less a minute for unpacking and starting Python)")
    ap.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the written layer's dtype")
    ap.add_argument("--evaluate", metavar="DIR",
                    help="train nothing: print the held-out agreement of the EAGLE layer saved in DIR")
    ap.add_argument("--max-tokens", type=int, default=512, help="answer tokens kept per sequence")
    ap.add_argument("--draft-vocab", type=int, default=None, help="tokens the draft may propose (default 16384; 0: all)")
    ap.add_argument("--vocab-seqs", type=int, default=None,
                    help="ShareGPT conversations counted for the draft vocabulary (default 3000)")
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
    if args.evaluate is None and args.self_data is None:
        ap.error("--self-data is required (the answers to train on), unless --evaluate DIR")
    for name in ("time_budget_s", "deadline_s"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            ap.error(f"--{name[:-2].replace('_', '-')}-s must be > 0, got {getattr(args, name)}")
    if args.deadline_s is not None and args.heldout:
        ap.error("--deadline-s: the held-out check would run after the layer is saved, past the deadline; give "
                 "--heldout 0 and measure it with --evaluate DIR afterwards")
    if args.time_budget_s is not None and args.deadline_s is not None:
        ap.error("give --time-budget-s (the training loop's seconds) or --deadline-s (the whole run's), not both")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this machine has no CUDA device (torch.cuda.is_available() is False)")
    if args.draft_vocab_file and (args.draft_vocab is not None or args.vocab_seqs is not None):
        ap.error("--draft-vocab-file gives the draft vocabulary: leave out --draft-vocab / --vocab-seqs")
    vocab_ids = read_draft_vocab(args.draft_vocab_file, ap) if args.draft_vocab_file else None
    draft_vocab = 16384 if args.draft_vocab is None else args.draft_vocab
    if args.heldout < 0 or (args.evaluate and args.heldout == 0):
        ap.error(f"--heldout must be >= 0 (0: no held-out check; --evaluate needs >= 1), got {args.heldout}")
    if args.heldout or (vocab_ids is None and draft_vocab):
        try:  # the held-out prompts and the vocabulary's counts read ShareGPT: refused here where it is missing
            sharegpt_path()
        except FileNotFoundError as e:
            ap.error(f"{e}; or train with --heldout 0 and --draft-vocab-file (python/gpu_carry.py writes one)")
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
    one_shot = args.time_budget_s is not None or args.deadline_s is not None
    work = None if one_shot else cache_root() / "training"

    if args.device.startswith("cuda"):  # TF32 matmuls, the teacher's features included: ~1e-3 relative, far
        torch.set_float32_matmul_precision("high")  # under the errors the layer trains to absorb
    model, tok = hk.load_model(args.model, dtype=torch.float32, device=args.device)
    if args.evaluate:
        drafter = hk.load_drafter(args.evaluate, model=model)
        if drafter.kind != "eagle":
            ap.error(f"--evaluate {args.evaluate}: holds a {drafter.kind!r} drafter, not an EAGLE layer")
        print_heldout(model, tok, drafter, args.heldout, args.unroll)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seqs, starts = self_data_sequences(args.self_data, args.max_tokens)
    print(f"{len(seqs)} training sequences, {sum(map(len, seqs))} tokens")
    dv = vocab_ids
    if dv is None and draft_vocab:
        dv = recipe_draft_vocabulary(tok, seqs, starts, draft_vocab, 3000 if args.vocab_seqs is None else args.vocab_seqs)
    drafter = hk.new_drafter(model, "eagle", draft_vocab=dv, feature_layers=fl)
    data = compute_hidden_states(model, seqs, cache_dir=work, capture=drafter.feature_layers).train_from(starts)
    settings = dict(lr=args.lr, seqs_per_step=args.seqs_per_step, window=args.window,
                    loss_positions=args.loss_positions, unroll=args.unroll, noise=noise,
                    feature_weight=args.feature_weight, token_weight=args.token_weight, seed=args.seed)
    steps = args.steps
    if one_shot:
        def timed(n):  # n steps of a throwaway copy, no checkpoint: the real run starts from the same weights
            t = time.perf_counter()
            train_eagle(model, copy.deepcopy(drafter), data, steps=n, warmup=1, progress=False, **settings)
            return time.perf_counter() - t

        def seconds_left():  # the deadline's time after everything so far, less saving and a 5% margin
            return 0.95 * (args.deadline_s - (time.perf_counter() - started) - SAVE_RESERVE_S)

        budget = args.time_budget_s if args.deadline_s is None else seconds_left
        steps = steps_within(budget, timed)
        print(f"{steps} steps fit in {args.time_budget_s or seconds_left():.0f} s on {args.device} "
              f"({time.perf_counter() - started:.0f} s after the start)")
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    hist = train_eagle(model, drafter, data, steps=steps, warmup=max(1, steps // 20), checkpoint_dir=work,
                       checkpoint_every=25, progress=not one_shot, **settings)
    print(f"eagle: {steps} steps in {time.perf_counter() - t0:.0f} s, final loss {hist['loss'][-1]:.3f}, "
          f"top-1 agreement per unroll step {hist['accuracy'][-1]}")
    drafter.save(out / "eagle", dtype=getattr(torch, args.save_dtype))
    rows = [{"step": s, "loss": loss, **{f"acc{i + 1}": a for i, a in enumerate(acc)}}
            for s, (loss, acc) in enumerate(zip(hist["loss"], hist["accuracy"]))]

    def plot(ax):
        plot_training(ax, rows, [f"acc{i + 1}" for i in range(args.unroll)],
                      [f"top-1 agreement, depth {i + 1}" for i in range(args.unroll)],
                      f"{'EAGLE-3' if fl is not None else 'EAGLE'} layer training, SmolLM2-135M-Instruct, "
                      "self-generated answers")

    write_results(rows, out, "eagle_training", plot)
    if args.heldout:  # the training log's agreement is over training windows; this is over unseen answers
        print_heldout(model, tok, drafter, args.heldout, args.unroll)


def read_draft_vocab(path, ap) -> torch.Tensor:
    """--draft-vocab-file: a JSON list of distinct token ids (new_drafter checks their range)."""
    try:
        ids = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        ap.error(f"--draft-vocab-file {path}: not a readable JSON file ({e})")
    if not (isinstance(ids, list) and ids and all(type(i) is int and i >= 0 for i in ids)):
        ap.error(f"--draft-vocab-file {path}: wants a JSON list of token ids (non-negative integers)")
    if len(set(ids)) != len(ids):
        ap.error(f"--draft-vocab-file {path}: {len(ids) - len(set(ids))} token ids repeat")
    return torch.tensor(ids, dtype=torch.long)


def print_heldout(model, tok, drafter, n: int, unroll: int) -> None:
    """Top-1 agreement per depth on the greedy answers (128 tokens) to n held-out ShareGPT prompts."""
    prompts = heldout_chat_prompts(tok, n)
    answers = generate(model, prompts, max_new_tokens=128).sequences
    held = agreement(model, drafter, [p + a for p, a in zip(prompts, answers)], [len(p) - 1 for p in prompts], unroll)
    print(f"held-out top-1 agreement per depth ({n} ShareGPT answers): " + " ".join(f"{a:.3f}" for a in held))


if __name__ == "__main__":
    main()
