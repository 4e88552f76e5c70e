"""End-to-end generate() on the device (a GPU where there is one) beside transformers, same weights, same run.

A GPU machine here cannot hold the embedded model (no network, too big to carry), so the model has a named
config's shapes (default SmolLM2-135M) with random weights, in both libraries: timings do not depend on the
weight values. Acceptance does, so the speculative rows pair like with like: our n-gram drafter beside
transformers' prompt lookup (the same idea) on the same prompts, tokens per step printed, and no claim about
trained drafters (their acceptance is measured with the real model on the CPU: benchmarks/results/README.md).

Decoders, batch 1, greedy, exactly --new-tokens tokens each (EOS ignored on both sides), interleaved over
--reps rounds in a rotating order, medians of end-to-end tokens/s (prefill included on both sides):
  ours plain | ours n-gram | transformers generate | transformers prompt lookup (prompt_lookup_num_tokens=10)
Also: whether our plain tokens equal transformers' greedy tokens (bf16 kernels may differ at near-ties:
reported, not asserted) and our n-gram tokens equal ours plain (asserted: lossless).

    python benchmarks/bench_generate_device.py [--model smollm2-135m] [--layers N] [--dtype bfloat16]
        [--prompt-tokens 128] [--new-tokens 128] [--reps 5] [--out benchmarks/out]
CPU smoke: --layers 1 --prompt-tokens 16 --new-tokens 8 --reps 1 --dtype float32.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import hydra_kernels as hk  # noqa: E402
from hydra_kernels.generate import generate  # noqa: E402
from report import print_table, write_results  # noqa: E402


def hf_model(name: str, layers: int | None, device, dtype):
    """A transformers LlamaForCausalLM at NAMED_CONFIGS[name] shapes, random weights, built on the device."""
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM

    c = hk.NAMED_CONFIGS[name]
    cfg = HFConfig(**{**c.to_hf_dict(), "num_hidden_layers": layers or c.num_layers, "eos_token_id": None})
    torch.manual_seed(0)
    with torch.device(device):
        hf = LlamaForCausalLM(cfg).to(dtype).eval()
    hf.generation_config.eos_token_id = None  # exactly max_new_tokens, as ours with eos_token_id=[]
    return hf


def repetitive_prompt(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    """n tokens that repeat a few random phrases (as chat prompts quote and restate): n-gram drafting's case."""
    phrases = [torch.randint(3, vocab, (int(torch.randint(4, 12, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(6)]
    out: list[int] = []
    while len(out) < n:
        out += phrases[int(torch.randint(0, len(phrases), (1,), generator=gen))]
    return out[:n]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", choices=list(hk.NAMED_CONFIGS))
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model (CPU smoke runs)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_grad_enabled(False)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"

    hf = hf_model(args.model, args.layers, dev, dtype)
    ours = hk.Llama.from_hf(hf).to(dev, dtype)
    ngram = hk.new_drafter(ours, kind="ngram")
    gen = torch.Generator().manual_seed(1)
    prompts = [repetitive_prompt(args.prompt_tokens, hf.config.vocab_size, gen) for _ in range(args.prompts)]
    n = args.new_tokens

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def run_ours(ids, drafter):
        sync()
        t = time.perf_counter()
        out = generate(ours, [ids], drafter=drafter, max_new_tokens=n, eos_token_id=[])
        sync()
        return time.perf_counter() - t, out.sequences[0], out.mean_accepted_tokens

    def run_hf(ids, lookup):
        x = torch.tensor([ids], device=dev)
        kw = dict(prompt_lookup_num_tokens=10) if lookup else {}
        sync()
        t = time.perf_counter()
        # no EOS on either side (ours: eos_token_id=[]): min_new_tokens would mask EOS logits instead, which
        # changes the argmax where EOS wins and so the token comparison below
        y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
        sync()
        assert y.shape[1] == len(ids) + n, "transformers stopped early: the work would not be equal"
        return time.perf_counter() - t, y[0, len(ids):].tolist(), float("nan")

    decoders = {"ours plain": lambda p: run_ours(p, None), "ours n-gram": lambda p: run_ours(p, ngram),
                "transformers generate": lambda p: run_hf(p, False),
                "transformers prompt lookup": lambda p: run_hf(p, True)}
    for fn in decoders.values():  # warm-up: compiles, allocator, first-call dispatch
        fn(prompts[0])
    times = {k: [] for k in decoders}
    steps = {k: [] for k in decoders}
    toks = {}
    order = list(decoders)
    for r in range(args.reps):
        for i, p in enumerate(prompts):
            rot = order[(r + i) % len(order):] + order[:(r + i) % len(order)]
            for k in rot:
                t, seq, tps = decoders[k](p)
                times[k].append(n / t)
                steps[k].append(tps)
                toks[k, i] = seq
    for i in range(len(prompts)):
        assert toks["ours n-gram", i] == toks["ours plain", i], f"prompt {i}: n-gram drafting changed the output"
    same_hf = sum(toks["ours plain", i] == toks["transformers generate", i] for i in range(len(prompts)))
    plain = statistics.median(times["ours plain"])
    rows = [dict(device=name, model=args.model, layers=args.layers or hk.NAMED_CONFIGS[args.model].num_layers,
                 dtype=args.dtype, prompt_tokens=args.prompt_tokens, new_tokens=n, decoder=k,
                 median_tok_s=round(statistics.median(v), 1), vs_ours_plain=round(statistics.median(v) / plain, 3),
                 tokens_per_step=round(statistics.median(steps[k]), 2) if k.startswith("ours") and k != "ours plain" else "",
                 runs=len(v)) for k, v in times.items()]
    print(f"\ngenerate() end to end on {name}, {args.model} shapes (random weights), {args.dtype}, batch 1, "
          f"{args.prompt_tokens}-token prompts, {n} new tokens, {len(prompts)} prompts x {args.reps} rounds interleaved; "
          f"ours plain == transformers greedy on {same_hf}/{len(prompts)} prompts; n-gram == plain on all")
    print_table(rows, ["decoder", "median_tok_s", "vs_ours_plain", "tokens_per_step"])

    def plot(ax):
        ax.bar(range(len(rows)), [r["median_tok_s"] for r in rows])
        ax.set_xticks(range(len(rows)), [r["decoder"] for r in rows], rotation=15)
        ax.set_ylabel("tokens/s (median, end to end)")
        ax.set_title(f"generate on {name}: {args.model} shapes, {args.dtype}, batch 1")

    write_results(rows, args.out, f"generate_device_{args.model}", plot)
    return rows


if __name__ == "__main__":
    main()
