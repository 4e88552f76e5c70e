"""Recipe: measure a drafter's acceptance prior (hydra_kernels/acceptance_prior.py,
hydra_kernels/training/acceptance_calibration.py) and save it beside the drafter as acceptance_rates.json, where the
adaptive budget starts its acceptance rates in a fresh process (the default budget on the CPU).

    .venv/bin/python python/calibrate_acceptance.py [--drafter DIR | --kind combined] [--prompts 48] [--new-tokens 128]
        [--batch 4]

Prompts: the first user turns of training-split ShareGPT conversations (never the held-out turns or MT-Bench, which
evaluate the drafter). --kind combined (composed: no directory of its own) writes into
hydra_kernels/heads/<model>/combined/<heads>/ beside its budget table, where load_drafter(kind="combined") reads it;
a shipped kind into its own directory. Every run is checked against plain decoding. Device-independent: rates, not
times.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hydra_kernels as hk  # noqa: E402
from hydra_kernels.drafters.registry import COMPOSED, measured_files_dir  # noqa: E402
from hydra_kernels.training.acceptance_calibration import measure_acceptance_prior  # noqa: E402
from hydra_kernels.training.data import training_chat_prompts  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default=None, help="a drafter directory (the prior is written into it)")
    ap.add_argument("--kind", default="combined",
                    help=f"a shipped drafter or a composed kind {COMPOSED}, when --drafter is not given")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args(argv)
    if min(args.prompts, args.new_tokens, args.batch) < 1:
        raise SystemExit("--prompts, --new-tokens and --batch must be >= 1")
    try:
        path = Path(args.drafter) if args.drafter else measured_files_dir(args.kind)
    except ValueError as e:
        raise SystemExit(f"--kind: {e}") from e
    composed = not args.drafter and args.kind in COMPOSED
    torch.set_grad_enabled(False)
    model, tok = hk.load_model(device="cpu")
    drafter = hk.load_drafter(model=model, kind=args.kind) if composed else hk.load_drafter(path, model=model)
    command = (f"python/calibrate_acceptance.py {'--drafter ' + args.drafter if args.drafter else '--kind ' + args.kind} "
               f"--prompts {args.prompts} --new-tokens {args.new_tokens} --batch {args.batch}")
    prior = measure_acceptance_prior(model, drafter, training_chat_prompts(tok, args.prompts), args.new_tokens,
                                     args.batch, measured=command)
    print(prior.measured)
    for p, part in enumerate(prior.parts):  # the rates of the first depths, per confidence class
        for d in range(3):
            base = (p * prior.max_depth_key + d) * prior.signals
            cells = [f"{prior.rates[base + s]:.2f} ({prior.tested[base + s]:.0f})" for s in range(prior.signals)]
            print(f"  {part}, depth {d + 1}: " + "  ".join(cells))
    path.mkdir(parents=True, exist_ok=True)
    print("written:", prior.save(path))
    return prior


if __name__ == "__main__":
    main()
