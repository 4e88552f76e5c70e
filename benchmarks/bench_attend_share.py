"""What a batch stops paying when a sequence finishes: the native plain step of the embedded model at batch B over
contexts of C keys, with every sequence attending, with one finished (its attention skipped: `attend` 0, as the
decoding loops pass once a sequence is done) and with none attending; blocks of --calls calls of each in turn (each
block warmed by 3 calls), --rounds rounds, medians. Beside them, each context's attention share of a step as measured,
(all - none) / all, and as hydra_kernels/attention_share.py estimates it from the bytes (the adaptive budget's value of
a batched draft counts each sequence's own tokens at that share).

    python benchmarks/bench_attend_share.py [--batch 2] [--contexts 100 2000 8000] [--rounds 10] [--calls 5]
        [--out DIR]

What it shows: one_finished / all is what a step costs once a sequence is done (at batch 2 over long contexts about
half, if the attention's work is spread over the threads by keys, not by sequences: csrc/tree_attention_cpu.cpp's
balanced_spans); the two shares say whether the bytes estimate the time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from report import print_table, write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hydra_kernels as hk  # noqa: E402
from hydra_kernels.attention_share import attention_shares, kv_per_weight_byte  # noqa: E402
from hydra_kernels.generate import plan_backends  # noqa: E402
from hydra_kernels.model.plain_step import native_plain_step  # noqa: E402


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--contexts", type=int, nargs="+", default=[100, 2000, 8000])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=5, help="calls timed per block")
    ap.add_argument("--out", default=None, help="write attend_share.csv (and its plot) there")
    args = ap.parse_args(argv)
    if args.batch < 2:
        sys.exit("--batch must be at least 2: one sequence finishes while another attends")
    if min(args.contexts) < 1 or args.rounds < 1 or args.calls < 1:
        sys.exit("--contexts, --rounds and --calls must be at least 1")
    torch.set_grad_enabled(False)
    model, _ = hk.load_model(device="cpu")
    backends = plan_backends("auto", model.device, packed_weights=model.has_packed_weights)
    B, k = args.batch, kv_per_weight_byte(model)
    cache = model.new_kv_cache(B, max(args.contexts) + 8)
    cache.kv.normal_()  # K/V of random values: a step reads them as it reads a prompt's
    step = native_plain_step(model, cache, backends)
    if step is None:
        sys.exit("the native plain step does not apply here (the extension, the packed CPU kernel, a quantized model)")
    tokens = torch.randint(0, model.config.vocab_size, (B,), generator=torch.Generator().manual_seed(0))
    one = torch.ones(B, dtype=torch.long)
    one[-1] = 0
    attends = {"all": None, "one_finished": one, "none": torch.zeros(B, dtype=torch.long)}
    rows = []
    for C in args.contexts:
        cache.seqlens.fill_(C)  # commit=False: every call sees the same cache
        times = {name: [] for name in attends}
        for _ in range(args.rounds):
            for name, attend in attends.items():
                for _ in range(3):
                    step(tokens, C + 1, False, attend)
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    step(tokens, C + 1, False, attend)
                times[name].append((time.perf_counter() - t0) * 1e3 / args.calls)
        ms = {name: statistics.median(v) for name, v in times.items()}
        rows.append({"batch": B, "context": C, "all_ms": round(ms["all"], 3),
                     "one_finished_ms": round(ms["one_finished"], 3), "none_ms": round(ms["none"], 3),
                     "one_finished_over_all": round(ms["one_finished"] / ms["all"], 3),
                     "attention_share_measured": round((ms["all"] - ms["none"]) / ms["all"], 3),
                     "attention_share_bytes": round(sum(attention_shares([C] * B, [1] * B, k)), 3)})
    print_table(rows, list(rows[0]))
    if args.out:
        write_results(rows, args.out, "attend_share", plot=lambda ax: plot(ax, rows))
    return rows


def plot(ax, rows) -> None:
    x = [r["context"] for r in rows]
    for key, label in (("attention_share_measured", "attention share, measured"),
                       ("attention_share_bytes", "attention share, by bytes"),
                       ("one_finished_over_all", "step with one finished / all attending")):
        ax.plot(x, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("context (keys per sequence)")
    ax.set_ylabel("share of a plain step")
    ax.set_title(f"plain step at batch {rows[0]['batch']}: what a finished sequence saves")
    ax.legend()


if __name__ == "__main__":
    main()
