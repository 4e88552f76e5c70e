"""Prefill speed: our chunked prefill beside a prefill in one piece and transformers' forward, same model,
one interleaved run.

At each (batch B, prompt length L) point, random tokens (every sequence L long), --reps rounds, each round
running every variant back to back in a rotating order; figures are medians over rounds:
- ours (chunked): Llama.prefill as generate() runs it (chunks of model/llama.py PREFILL_CHUNK_TOKENS),
- ours (one piece): the same prefill in one chunk (the behaviour before chunking),
- transformers forward: LlamaForCausalLM on the same weights, use_cache=True, logits of the last position
  only (logits_to_keep=1), at points with B * L <= --hf-max-tokens (its attention and activations grow
  with B * L too).
Columns: tokens/s (B * L / seconds), page faults and system seconds per prefill (the kernel's work of
mapping fresh memory, which chunking removes), and max |difference| of ours (chunked) to ours (one
piece) on the last position's hidden state.

    python benchmarks/bench_prefill.py [--points 1x2048 1x8000 4x2048 16x2048] [--reps 2] [--chunk-tokens N]
        [--no-hf] [--hf-max-tokens 8192] [--out DIR]
"""
from __future__ import annotations

import argparse
import logging
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from report import print_table, write_results
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hydra_kernels as hk  # noqa: E402
from hydra_kernels.model.llama import PREFILL_CHUNK_TOKENS  # noqa: E402

ONE_PIECE = 1 << 40  # a chunk budget no prompt reaches


def timed(fn) -> tuple[float, int, float, object]:
    """(seconds, minor page faults, system seconds, fn's result) of one call."""
    r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = fn()
    dt, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
    return dt, r1.ru_minflt - r0.ru_minflt, r1.ru_stime - r0.ru_stime, out


def hf_model():
    """transformers' LlamaForCausalLM on the embedded model's weights (fp32), or None if unavailable."""
    try:
        from transformers import LlamaForCausalLM
        from hydra_kernels.model import embedded_gguf_path
    except ImportError:
        return None
    logging.getLogger("transformers").setLevel(logging.ERROR)
    gguf = embedded_gguf_path()
    return LlamaForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", nargs="+", default=["1x2048", "1x8000", "4x2048", "16x2048"], help="BxL")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--hf-max-tokens", type=int, default=8192, help="transformers' forward up to B * L tokens")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' forward")
    ap.add_argument("--chunk-tokens", type=int, default=None, help="override the chunked variant's tokens per chunk")
    ap.add_argument("--out", default=None, help="write prefill.csv / prefill.png there")
    args = ap.parse_args(argv)
    points = []
    for p in args.points:
        try:
            B, L = (int(x) for x in p.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--points takes BxL pairs like 4x2048, got {p!r}") from None
        points.append((B, L))
    torch.set_grad_enabled(False)
    model, _ = hk.load_model(device="cpu")
    hf = None if args.no_hf else hf_model()
    V = model.config.vocab_size
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}; chunk budget {PREFILL_CHUNK_TOKENS} tokens; "
          f"transformers peer: {'yes' if hf is not None else 'no'}")
    rows = []
    for B, L in tqdm(points, desc="prefill points"):
        tokens = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(B * L))
        lengths = torch.full((B,), L, dtype=torch.int32)

        def ours(chunk):
            cache = model.new_kv_cache(B, L)
            return lambda: model.prefill(tokens, lengths, cache, chunk_tokens=chunk)

        variants = {"chunked": lambda: ours(args.chunk_tokens)(), "one piece": lambda: ours(ONE_PIECE)()}
        if hf is not None and B * L <= args.hf_max_tokens:
            variants["transformers"] = lambda: hf(tokens, use_cache=True, logits_to_keep=1).logits
        got = {v: [] for v in variants}
        outs = {}
        for r in range(args.reps):
            names = list(variants)
            for v in names[r % len(names):] + names[: r % len(names)]:
                dt, faults, sys_s, out = timed(variants[v])
                got[v].append((dt, faults, sys_s))
                outs[v] = out
        row = {"batch": B, "prompt_tokens": L, "reps": args.reps}
        for v, runs in got.items():
            key = v.replace(" ", "_")
            row[f"{key}_tok_s"] = B * L / statistics.median(r[0] for r in runs)
            row[f"{key}_page_faults"] = int(statistics.median(r[1] for r in runs))
            row[f"{key}_sys_s"] = statistics.median(r[2] for r in runs)
        row["chunked_speedup"] = row["chunked_tok_s"] / row["one_piece_tok_s"]
        row["max_abs_diff"] = float((outs["chunked"] - outs["one piece"]).abs().max())
        rows.append(row)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    for r in rows:
        for c in cols:
            r.setdefault(c, "")
    print_table(rows, cols)
    if args.out:
        write_results(rows, args.out, "prefill", plot=lambda ax: plot(ax, rows))
    return rows


def plot(ax, rows):
    labels = [f"{r['batch']}x{r['prompt_tokens']}" for r in rows]
    x = range(len(rows))
    for i, (key, name) in enumerate((("chunked", "ours (chunked)"), ("one_piece", "ours (one piece)"),
                                     ("transformers", "transformers forward"))):
        ys = [r.get(f"{key}_tok_s") or 0 for r in rows]
        ax.bar([j + 0.27 * (i - 1) for j in x], ys, 0.27, label=name)
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("batch x prompt tokens")
    ax.set_ylabel("prefill tokens/s")
    top = max(r.get(f"{k}_tok_s") or 0 for r in rows for k in ("chunked", "one_piece", "transformers"))
    ax.set_ylim(0, 1.25 * top)  # headroom: the legend sits above the bars
    ax.legend(fontsize=8, loc="upper center", ncol=3)


if __name__ == "__main__":
    main()
