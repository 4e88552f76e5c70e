"""Plain greedy decoding speed: hydra_kernels beside transformers' generate, same model, same run.

Both decode exactly --new-tokens tokens per prompt (EOS ignored on both sides so the work is equal),
batch 1, fp32 on this machine's CPU. Reported: end-to-end tokens/s (prefill included, as
transformers' generate is timed) and our decode-only tokens/s. Writes CSV and a bar plot.

    python benchmarks/bench_generate.py [--new-tokens 64] [--prompts 4] [--out benchmarks/out]
"""
from __future__ import annotations

import argparse
import logging
import platform
import time

import torch
from report import write_results

PROMPTS = [
    "Explain how a CPU cache works.",
    "Write a short poem about the sea.",
    "Give me three tips for learning a new language.",
    "What are the main differences between Python and C++?",
    "Describe the water cycle for a ten-year-old.",
    "How do I make a good cup of coffee?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_grad_enabled(False)

    import hydra_kernels as hk
    from hydra_kernels.chat import chat_prompt_ids
    from hydra_kernels.generate import generate
    from hydra_kernels.model import embedded_gguf_path
    from tqdm.auto import tqdm
    from transformers import LlamaForCausalLM

    model, tok = hk.load_model(device="cpu")
    gguf = embedded_gguf_path()
    hf = LlamaForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    prompts = [chat_prompt_ids(tok, p) for p in PROMPTS[: args.prompts]]
    n = args.new_tokens

    def ours(ids):
        t = time.perf_counter()
        out = generate(model, [ids], max_new_tokens=n, eos_token_id=[])
        return time.perf_counter() - t, out

    def theirs(ids):
        t = time.perf_counter()
        hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t

    ours(prompts[0])  # warm-up both (allocator, first-call dispatch)
    theirs(prompts[0])
    rows = []
    for i, ids in enumerate(tqdm(prompts, desc="prompts")):
        t_ours, out = ours(ids)
        t_hf = theirs(ids)
        rows.append(dict(prompt=i, prompt_tokens=len(ids), new_tokens=n,
                         hydra_kernels_tok_s=n / t_ours, hydra_kernels_decode_tok_s=out.tokens_per_second,
                         transformers_tok_s=n / t_hf))
    tot_ours = sum(n / r["hydra_kernels_tok_s"] for r in rows)
    tot_hf = sum(n / r["transformers_tok_s"] for r in rows)
    summary = dict(ours=n * len(rows) / tot_ours, hf=n * len(rows) / tot_hf)

    print(f"\nplain greedy decoding, SmolLM2-135M-Instruct fp32, batch 1, {n} new tokens, "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'prompt':>6} {'tokens':>6} | {'ours e2e tok/s':>14} {'ours decode':>11} | {'transformers tok/s':>18} | {'ratio':>5}")
    for r in rows:
        print(f"{r['prompt']:>6} {r['prompt_tokens']:>6} | {r['hydra_kernels_tok_s']:>14.1f} "
              f"{r['hydra_kernels_decode_tok_s']:>11.1f} | {r['transformers_tok_s']:>18.1f} | "
              f"{r['hydra_kernels_tok_s'] / r['transformers_tok_s']:>5.2f}")
    print(f"{'all':>6} {'':>6} | {summary['ours']:>14.1f} {'':>11} | {summary['hf']:>18.1f} | "
          f"{summary['ours'] / summary['hf']:>5.2f}")

    def plot(ax):
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["hydra_kernels_tok_s"] for r in rows], 0.4, label="hydra_kernels")
        ax.bar([i + 0.2 for i in x], [r["transformers_tok_s"] for r in rows], 0.4, label="transformers generate")
        ax.set_xlabel("prompt")
        ax.set_ylabel("tokens/s (end to end)")
        ax.set_title(f"SmolLM2-135M fp32 greedy, CPU, {n} new tokens")
        ax.legend()

    write_results(rows, args.out, "bench_generate", plot)


if __name__ == "__main__":
    main()
