"""python -m hydra_kernels.generate --prompt "..." : stream a chat answer, end with tokens/s."""
from __future__ import annotations

import argparse
import sys

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m hydra_kernels.generate", description=__doc__)
    p.add_argument("--prompt", required=True, help="user message; the model's chat template is applied")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding (no drafter)")
    p.add_argument("--drafter", default=None,
                   help="drafter directory (ours, original Hydra or original Medusa); default: the shipped drafter "
                        "measured fastest at batch 1")
    p.add_argument("--tree", default=None, help="tree: JSON file of choices, 'default' or 'chain-N'")
    p.add_argument("--budget", default=None,
                   help="tree nodes per step: 'auto' (the drafter's searched table) or a number (1 = plain steps)")
    p.add_argument("--acceptance", default=None, choices=["greedy", "rejection", "typical"],
                   help="default: greedy at temperature 0, else rejection (exact sampling)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "triton", "native"])
    return p.parse_args(argv)


def main(argv=None) -> None:
    import hydra_kernels as hk

    from .chat import TextStreamer, chat_prompt_ids
    from .drafters.registry import default_kind
    from .generate import GenerationError, generate

    args = parse_args(argv)
    model, tokenizer = hk.load_model(args.model, dtype=args.dtype, device=args.device)
    if tokenizer is None:
        sys.exit(f"{args.model} ships no tokenizer; the CLI needs one to apply the chat template")
    drafter = None
    if not args.no_draft:
        try:
            # one prompt at a time: the kind measured fastest at batch 1 (default.json's batch_1 where it has one,
            # else its default kind), unless --budget asks for a table, which the default kind has and a composed
            # batch_1 kind may not
            kind = None if args.drafter is not None else default_kind(batch_1=args.budget is None)
            drafter = hk.load_drafter(args.drafter, model=model, kind=kind)
        except FileNotFoundError as e:
            if args.drafter is not None:
                raise
            print(f"[{e}; plain decoding]", file=sys.stderr)
    if drafter is None and (args.tree or args.budget or args.acceptance not in (None, "greedy")):
        sys.exit("--tree, --budget and --acceptance need a drafter (--drafter PATH)")
    budget = int(args.budget) if args.budget and args.budget.isdigit() else args.budget
    ids = chat_prompt_ids(tokenizer, args.prompt, args.system)
    streamer = TextStreamer(tokenizer)
    try:
        out = generate(model, [ids], drafter=drafter, max_new_tokens=args.max_new_tokens, tree=args.tree,
                       budget=budget, temperature=args.temperature, acceptance=args.acceptance, top_p=args.top_p,
                       top_k=args.top_k, seed=args.seed, backend=args.backend, streamer=streamer)
    except GenerationError as e:
        print(f"\n[stopped: {e.__cause__!r}; {len(e.output.sequences[0])} tokens were produced]", file=sys.stderr)
        sys.exit(1)
    n = len(out.sequences[0])
    print(f"\n\n[{n} tokens | prefill {out.prefill_s * 1e3:.0f} ms | decode {out.tokens_per_second:.1f} tokens/s | "
          f"{out.mean_accepted_tokens:.2f} tokens/step | {drafter.kind if drafter else 'no'} drafter | "
          f"{model.dtype} on {model.device}]")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
