"""CPU decode / verify step cost per tree size T: the packed small-M kernel (the CPU default) against MKL
on input-major weights (the same model with the packed copies switched off), interleaved, median of
--reps. A step is model.step over T chain tokens after a --context-token prefill, plus the greedy LM
head; both layouts' hidden states are checked against each other first.

    python benchmarks/bench_cpu_step.py [--reps 9] [--context 300] [--sizes 1 6 16] [--prefill 128 1500]

--prefill also times a batch-1 prefill of each given length on both paths (the packed panels are the only
copy of the projections since load_model releases the originals, so prefill runs the packed kernel too).

What it shows: whether a T-node verify step costs about one single-token step (weights streamed once,
the condition for speculative decoding to pay off on a CPU) or T times more compute than it should.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hydra_kernels as hk  # noqa: E402
from hydra_kernels.model.packed_linear import packed_kernel_off  # noqa: E402

TREE_SIZES = (1, 6, 16)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(TREE_SIZES), help="tree sizes T to time")
    ap.add_argument("--prefill", type=int, nargs="*", default=[], help="prompt lengths to time a prefill at")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model, _ = hk.load_model(device="cpu")
    if not model.has_packed_weights:
        sys.exit("the packed kernel is unavailable here (extension not built or no AVX-512): nothing to compare")

    def path(packed: bool):
        return contextlib.nullcontext() if packed else packed_kernel_off(model)

    C, V = args.context, model.config.vocab_size
    sizes = args.sizes
    cache = model.new_kv_cache(1, C + max(sizes) + 1)
    model.prefill(torch.randint(0, V, (1, C)), torch.tensor([C], dtype=torch.int32), cache)
    toks = torch.randint(0, V, (1, max(sizes)))
    hs = []
    for on in (True, False):
        with path(on):
            hs.append(model.step(toks, cache, kv_len=C + toks.shape[1]))
    err = ((hs[0] - hs[1]).abs().max() / hs[1].abs().max()).item()
    if not err < 1e-4:  # fp32: both are the same math in a different summation order
        raise AssertionError(f"packed and MKL hidden states differ by {err:.3g} (relative to max)")
    times: dict = {}
    for _ in range(args.reps):
        for T in sizes:
            for on in (True, False):
                with path(on):
                    t0 = time.perf_counter()
                    model.greedy_tokens(model.step(toks[:, :T], cache, kv_len=C + T))
                    times.setdefault((T, on), []).append(time.perf_counter() - t0)
    for _ in range(args.reps if args.prefill else 0):
        for L in args.prefill:
            for on in (True, False):
                pc = model.new_kv_cache(1, L)
                with path(on):
                    t0 = time.perf_counter()
                    model.prefill(torch.randint(0, V, (1, L)), torch.tensor([L], dtype=torch.int32), pc)
                    times.setdefault((f"prefill {L}", on), []).append(time.perf_counter() - t0)
    rows = [{"T": T, "packed_ms": 1e3 * statistics.median(times[(T, True)]),
             "mkl_ms": 1e3 * statistics.median(times[(T, False)])} for T in sizes + [f"prefill {L}" for L in args.prefill]]
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}, context {C}; ms per step "
          f"(median of {args.reps}); packed vs MKL hidden states agree to {err:.1e}")
    print("| T | packed (default) | MKL input-major |\n|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['packed_ms']:.1f} | {r['mkl_ms']:.1f} |")
    return rows


if __name__ == "__main__":
    main()
