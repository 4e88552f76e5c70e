"""python -m hydra_kernels.generate --prompt "..." : stream a chat answer, end with tokens/s.

Every value is checked before any work (a bad one loads no model) and refused as argparse refuses its own:
the usage line, then one line naming the option and what to change, exit status 2. What only loading finds
(a corrupt model or drafter file, a drafter for another model) and generate()'s own checks are reported the
same way, before any token; a failure mid-run stops with the tokens produced so far, exit status 1.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

DTYPES = ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half")  # what hk.load_model takes


# ---- one option's value -----------------------------------------------------------------------------------
def _int(low: int, high: int | None = None):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {s!r}") from None
        if v < low or (high is not None and v >= high):
            raise argparse.ArgumentTypeError(f"must be >= {low}" + (f" and < {high}" if high else "") + f", got {v}")
        return v
    return parse


def _real(low: float, high: float | None = None, low_open: bool = False):
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        if not math.isfinite(v) or v < low or (low_open and v == low) or (high is not None and v > high):
            where = f"in ({low}, {high}]" if low_open else f">= {low}" + (f" and <= {high}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"must be a finite number {where}, got {s}")
        return v
    return parse


def _budget(s: str) -> str | int:
    if s in ("auto", "adaptive"):
        return s
    if s.isascii() and s.isdigit() and int(s) >= 1:
        return int(s)
    raise argparse.ArgumentTypeError(f"expected 'adaptive' (each step's draft sized by its expected gain), 'auto' "
                                     f"(the drafter's searched table) or a node count >= 1 (1 = plain steps), got {s!r}")


def _tree(s: str) -> str:
    from .tree import as_tree

    try:
        as_tree(s)  # 'default', 'chain-N' or a JSON file of choices; the drafter's bounds are checked once loaded
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def _model(s: str) -> str:
    if not Path(s).exists():
        raise argparse.ArgumentTypeError(f"no such file or directory: {s} (pass an HF model directory or a .gguf file)")
    return s


def _drafter(s: str) -> str:
    p = Path(s)
    if not p.is_dir():
        raise argparse.ArgumentTypeError(f"{s} is not a directory (pass a drafter directory: config.json and its weights)")
    if not (p / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{s} has no config.json: not a drafter directory")
    return s


def _device(s: str) -> str:
    try:
        d = torch.device(s)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a device: use cpu or cuda") from None
    if d.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{s!r}: use cpu or cuda")
    if d.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise argparse.ArgumentTypeError(f"cuda is not available here ({why}); use --device cpu")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{s}: there are {torch.cuda.device_count()} CUDA device(s)")
    return s


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hydra_kernels.generate", description=__doc__.split("\n")[0],
                                usage="%(prog)s --prompt TEXT [options] (--help lists them)")
    p.add_argument("--prompt", required=True, help="user message; the model's chat template is applied")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--model", default=None, type=_model,
                   help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--max-new-tokens", type=_int(1), default=256)
    draft = p.add_mutually_exclusive_group()
    draft.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding (no drafter)")
    draft.add_argument("--drafter", default=None, type=_drafter,
                       help="drafter directory (ours, original Hydra, Medusa or EAGLE, vLLM's Medusa, an MLPSpeculator); "
                            "default: the shipped drafter measured fastest at batch 1")
    p.add_argument("--tree", default=None, type=_tree, help="tree: JSON file of choices, 'default' or 'chain-N'")
    p.add_argument("--budget", default=None, type=_budget,
                   help="tree nodes per step: 'adaptive' (sized each step by its expected gain; the default on the "
                        "CPU when greedy), 'auto' (the drafter's searched table) or a number (1 = plain steps)")
    p.add_argument("--acceptance", default=None, choices=["greedy", "rejection", "typical"],
                   help="default: greedy at temperature 0, else rejection (exact sampling)")
    p.add_argument("--temperature", type=_real(0.0), default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=_real(0.0, 1.0, low_open=True), default=1.0)
    p.add_argument("--top-k", type=_int(0), default=0, help="0 = off")
    p.add_argument("--seed", type=_int(0, 2**63), default=None)
    p.add_argument("--dtype", default=None, choices=DTYPES, help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--device", default=None, type=_device, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--weights", default=None, choices=("quantized", "fp32", "int8", "int4"),
                   help="CPU weights: a GGUF's as stored (quantized, the default there) or fp32; an HF directory's "
                        "fp32 (default) or quantized at load (int8, int4)")
    p.add_argument("--activations", default="fp32", choices=("fp32", "int8"),
                   help="quantized CPU weights: exact fp32 arithmetic (default), or int8 activations with integer dot "
                        "products (AVX-512 VNNI or AVX2; llama.cpp's scheme: faster, tokens may differ from the fp32 model's)")
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "triton", "native"])
    return p


def parse_args(argv=None, p: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The options, each value checked, then the combinations: argparse's error (exit 2) for a bad one."""
    p = p or parser()
    args = p.parse_args(argv)
    if args.no_draft:
        for option, used in (("--tree", args.tree is not None), ("--budget", args.budget is not None),
                             ("--acceptance", args.acceptance not in (None, "greedy"))):
            if used:
                p.error(f"argument {option}: needs a drafter; drop --no-draft (or {option})")
    if args.acceptance == "greedy" and args.temperature > 0:
        p.error("argument --acceptance: greedy is for --temperature 0; sample with rejection (exact) or typical")
    return args


# ---- the run ------------------------------------------------------------------------------------------------
def main(argv=None) -> None:
    p = parser()
    args = parse_args(argv, p)

    import hydra_kernels as hk

    from .chat import TextStreamer, chat_prompt_ids
    from .drafters.registry import default_kind
    from .generate import GenerationError, GenerationInterrupted, generate

    try:
        model, tokenizer = hk.load_model(args.model, dtype=args.dtype, device=args.device, weights=args.weights,
                                         activations=args.activations)
    except (ValueError, TypeError, OSError) as e:  # a corrupt file, named; weights the model cannot keep
        option = ("--weights" if str(e).startswith("weights=") else
                  "--activations" if str(e).startswith("activations") else "--model")
        p.error(f"argument {option}: {e}" if args.model or option != "--model" else str(e))
    if tokenizer is None:
        p.error(f"argument --model: {args.model} ships no tokenizer; the CLI needs one to apply the chat template")
    drafter = None
    if args.drafter is not None:
        try:
            drafter = hk.load_drafter(args.drafter, model=model)
        except (ValueError, TypeError, OSError) as e:  # a corrupt file, a drafter for another model: named
            p.error(f"argument --drafter: {e}")
    elif not args.no_draft:
        try:
            # one prompt at a time: the kind measured fastest at batch 1 (default.json's batch_1 where it has one,
            # else its default kind), unless --budget asks for a table, which the default kind has and a composed
            # batch_1 kind may not
            drafter = hk.load_drafter(model=model, kind=default_kind(batch_1=args.budget in (None, "adaptive")))
        except (FileNotFoundError, ValueError) as e:  # none shipped, or not for this model: the user asked for none
            print(f"[{e}; plain decoding]", file=sys.stderr)
    if drafter is None and (args.tree or args.budget or args.acceptance not in (None, "greedy")):
        p.error("--tree, --budget and --acceptance need a drafter (--drafter PATH)")
    if drafter is not None and args.tree is not None:
        try:
            drafter.resolve_tree(args.tree, model.device.type)  # its bounds: heads, ranks
        except (ValueError, TypeError) as e:
            p.error(f"argument --tree: {e}")
    ids = chat_prompt_ids(tokenizer, args.prompt, args.system)
    streamer = TextStreamer(tokenizer)
    try:
        out = generate(model, [ids], drafter=drafter, max_new_tokens=args.max_new_tokens, tree=args.tree,
                       budget=args.budget, temperature=args.temperature, acceptance=args.acceptance,
                       top_p=args.top_p, top_k=args.top_k, seed=args.seed, backend=args.backend, streamer=streamer)
    except (ValueError, TypeError) as e:  # generate()'s checks, before any work
        p.error(str(e))
    except GenerationError as e:
        print(f"\n[stopped: {e.__cause__!r}; {len(e.output.sequences[0])} tokens were produced]", file=sys.stderr)
        sys.exit(1)
    except GenerationInterrupted as e:
        print(f"\n[interrupted; {len(e.output.sequences[0])} tokens were produced]", file=sys.stderr)
        sys.exit(130)
    n = len(out.sequences[0])
    print(f"\n\n[{n} tokens | prefill {out.prefill_s * 1e3:.0f} ms | decode {out.tokens_per_second:.1f} tokens/s | "
          f"{out.mean_accepted_tokens:.2f} tokens/step | {drafter.kind if drafter else 'no'} drafter | "
          f"{model.dtype} on {model.device}]")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
