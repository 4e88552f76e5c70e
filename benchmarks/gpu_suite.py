"""`make gpu`: everything a CUDA machine should check and measure, in one command, summary table last.

Steps (each its own process; a failing step is reported and the next still runs):
  1. build the extension with CUDA in place (setup.py build_ext --inplace, HYDRA_KERNELS_FORCE_CUDA_BUILD=1)
  2. the GPU test tier: the op tests with Triton compiled for real (TRITON_INTERPRET=0) and the CUDA kernels,
     every backend against the reference on the GPU (helpers.DEV is "cuda" there), every dtype, awkward shapes
  3. benchmarks: bench_tree_attn, bench_heads, bench_verify at Llama-3-8B shapes (CSVs)
  4. an end-to-end decode step at Llama-3-8B shapes with random weights, plain vs speculative with a fixed
     acceptance pattern, and one speculative step captured in a CUDA graph and checked against the eager step
Writes benchmarks/out/gpu_suite.csv (step, status, seconds) and prints it last. Budget: under 9 minutes on
an H100 (each step has its own time limit). Without CUDA it says so and exits 0.

    python benchmarks/gpu_suite.py [--out benchmarks/out]
"""
from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The GPU test tier: every op's test file (kernels against the reference) and the paths that use them.
GPU_TESTS = ["tests/test_tree_attention.py", "tests/test_commit_kv.py", "tests/test_greedy_verify.py",
             "tests/test_typical_accept.py", "tests/test_typical_verify.py", "tests/test_lm_head_topk.py",
             "tests/test_lm_head_sample_stats.py", "tests/test_lm_head_residual_sample.py", "tests/test_rejection_accept.py",
             "tests/test_hydra_first_layer.py", "tests/test_resblock.py",
             "tests/test_tree_inputs.py", "tests/test_backends.py", "tests/test_per_sequence_trees.py",
             "tests/test_kv_cache_paths.py"]


def steps(out: str) -> list[tuple[str, list[str], dict, int]]:
    """(name, command, extra environment, time limit in seconds) of each step, in order."""
    py = sys.executable
    real = {"TRITON_INTERPRET": "0"}
    return [
        ("build extension (CUDA)", [py, "setup.py", "build_ext", "--inplace"],
         {"HYDRA_KERNELS_FORCE_CUDA_BUILD": "1"}, 240),
        ("GPU test tier", [py, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *GPU_TESTS], real, 180),
        ("bench_tree_attn", [py, "benchmarks/bench_tree_attn.py", "--models", "llama-3-8b", "--out", out], real, 90),
        ("bench_heads", [py, "benchmarks/bench_heads.py", "--model", "llama-3-8b", "--out", out], real, 60),
        ("bench_verify", [py, "benchmarks/bench_verify.py", "--model", "llama-3-8b", "--out", out], real, 45),
        ("decode step + CUDA graph", [py, "benchmarks/bench_decode_step.py", "--model", "llama-3-8b", "--batch", "1", "8",
                                      "--out", out], real, 120),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"make gpu: no CUDA device here (torch {torch.__version__}, built with CUDA: "
              f"{torch.version.cuda or 'no'}): nothing to run. On a CUDA machine this builds the extension, "
              "runs the GPU test tier and the benchmarks.")
        return 0
    print(f"make gpu on {torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})")
    results = []
    for name, cmd, env, limit in steps(args.out):
        print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
        t0 = time.time()
        try:
            r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, timeout=limit)
            status = "ok" if r.returncode == 0 else f"FAILED (exit {r.returncode})"
        except subprocess.TimeoutExpired:
            status = f"TIMED OUT ({limit} s)"
        results.append({"step": name, "status": status, "seconds": round(time.time() - t0, 1)})
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "gpu_suite.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", "status", "seconds"])
        w.writeheader()
        w.writerows(results)
    print("\n| step | status | seconds |\n|---|---|---|")
    for r in results:
        print(f"| {r['step']} | {r['status']} | {r['seconds']} |")
    print(f"CSVs in {args.out}/")
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
