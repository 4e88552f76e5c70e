"""`make gpu`: everything a CUDA machine should check and measure, in one command, summary table last.

Steps (each its own process; a failing step is reported and the next still runs):
  1. build the extension with CUDA in place (setup.py build_ext --inplace, HYDRA_KERNELS_FORCE_CUDA_BUILD=1,
     for this GPU's arch unless TORCH_CUDA_ARCH_LIST says otherwise)
  2. the two ceilings (benchmarks/ceilings.py: copy GB/s, bf16 matmul TFLOP/s) the figures are quoted against
  3. the GPU test tier: the op tests with Triton compiled for real (TRITON_INTERPRET=0) and the CUDA kernels,
     every backend against the reference on the GPU (helpers.DEV is "cuda" there), every dtype, awkward shapes,
     and every drafter family's generate() on the GPU against plain greedy (test_drafters_on_device)
  4. benchmarks: bench_tree_attn, bench_heads, bench_verify at Llama-3-8B shapes (CSVs)
  5. the scaling sweep (bench_scaling_gpu: plain and verify steps at batch 1-16, context 128-8k, budgets
     3-64, with Hydra-style drafting; projected tokens/s from the real drafter's measured acceptance)
  6. generate() end to end at SmolLM2 shapes (random weights): ours plain and n-gram beside transformers'
     generate and prompt lookup (bench_generate_device)
  7. an end-to-end decode step at Llama-3-8B shapes with random weights, plain vs speculative with a fixed
     acceptance pattern, beside plain PyTorch; both steps captured in CUDA graphs, checked against the eager
     steps and timed
  8. generate() eager vs replayed from CUDA graphs (the decode runner, issue 43), plain and n-gram, at SmolLM2
     and Llama-3-8B shapes, batch 1 / 4 / 16, beside transformers' generate eager and (batch 1) with its static
     cache + torch.compile, as fractions of the copy ceiling (bench_generate_device --graphs:
     generate_graphs_<gpu>_<date>.csv)
Writes benchmarks/out/gpu_suite.csv (step, status, seconds) and prints it last. Each step has its own time
limit (a step that runs over is killed with its whole process group: ninja / nvcc, pytest's workers); on an
H100 (2026-11-24) the whole suite took 8-9.5 minutes; --deadline-s caps it. Without CUDA it says so and
exits 0. The build uses the gcc / g++ on PATH (see _build_env; HYDRA_KERNELS_KEEP_CXX=1 keeps CC / CXX).

    python benchmarks/gpu_suite.py [--out benchmarks/out] [--only STEP ...] [--tests FILE ...] [--deadline-s S]
"""
from __future__ import annotations

import argparse
import csv
import os
import signal
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
             "tests/test_kv_cache_paths.py", "tests/test_drafters_on_device.py", "tests/test_runner_gpu.py",
             "tests/test_layer_ops.py"]


def _pytest_workers() -> list[str]:
    """pytest-xdist's -n where it is installed: the tier's Triton compiles run in parallel (a fresh machine
    has an empty Triton cache), the kernels still on the one GPU."""
    import importlib.util

    if importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(max(1, min(8, (os.cpu_count() or 2) // 2)))]


def steps(out: str, tests: list[str] | None = None) -> list[tuple[str, list[str], dict, int]]:
    """(name, command, extra environment, time limit in seconds) of each step, in order."""
    py = sys.executable
    real = {"TRITON_INTERPRET": "0"}
    return [
        ("build extension (CUDA)", [py, "setup.py", "build_ext", "--inplace"],
         {"HYDRA_KERNELS_FORCE_CUDA_BUILD": "1"}, 300),
        ("ceilings", [py, "benchmarks/ceilings.py", "--out", out], {}, 60),
        # every failure listed (no -x): the first GPU run of a kernel should show all that is wrong at once
        ("GPU test tier", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--maxfail=50", *_pytest_workers(),
                           # the embedded model (a 98 MB GGUF) is not on a GPU machine without network
                           "-k", "not real_model", *(tests or GPU_TESTS)], real, 300),
        # 18 points (each compiles a FlexAttention peer): contexts 1k-16k, T 1 / 16 / 64, batch 1 and 8
        ("bench_tree_attn", [py, "benchmarks/bench_tree_attn.py", "--models", "llama-3-8b", "--contexts", "1024", "4096",
                             "16384", "--T", "1", "16", "64", "--batch", "1", "8", "--out", out], real, 150),
        ("bench_heads", [py, "benchmarks/bench_heads.py", "--model", "llama-3-8b", "--out", out], real, 60),
        ("bench_verify", [py, "benchmarks/bench_verify.py", "--model", "llama-3-8b", "--out", out], real, 60),
        # issue 26's GPU half: 15 (batch, context) points x plain + 5 budgets, graph-replayed (~2 min)
        ("scaling", [py, "benchmarks/bench_scaling_gpu.py", "--model", "llama-3-8b", "--out", out], real, 240),
        # generate() end to end, every decoder interleaved: ours plain / n-gram beside transformers' (~1 min)
        ("generate end to end", [py, "benchmarks/bench_generate_device.py", "--reps", "2", "--prompts", "2", "--out", out],
         real, 180),
        ("decode step + CUDA graph", [py, "benchmarks/bench_decode_step.py", "--model", "llama-3-8b", "--batch", "1", "8",
                                      "--out", out], real, 150),
        # issue 43: 2 shapes x 3 batch sizes x 5-8 decoders (batch 1: + compiled peer, + sampled n-gram), 64 new tokens, 2 rounds
        ("generate graphs", [py, "benchmarks/bench_generate_device.py", "--graphs", "--new-tokens", "64", "--reps", "2",
                             "--out", out], real, 420),
    ]


def _build_env() -> dict:
    """Build for the GPU that is here (one arch: half the nvcc time of setup.py's default two) unless the
    user named TORCH_CUDA_ARCH_LIST, with the gcc / g++ on PATH: an image's CXX may name a second GCC whose
    inlined libstdc++ code crashes against the system libstdc++ torch loads (the H100 image's
    CXX=/opt/gcc/bin/g++ did, 2026-11-24: every raised input check was a segfault; setup.py now refuses
    such a build)."""
    import shutil

    import torch

    keep = os.environ.get("HYDRA_KERNELS_KEEP_CXX") == "1"  # a toolchain the user chose on purpose
    env = {} if keep else {var: exe for var, exe in (("CC", "gcc"), ("CXX", "g++")) if shutil.which(exe)}
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        major, minor = torch.cuda.get_device_capability()
        env["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--only", nargs="+", default=None, metavar="STEP",
                    help="run only the steps whose names start with these words (e.g. --only build bench_tree)")
    ap.add_argument("--tests", nargs="+", default=None, metavar="FILE",
                    help="the GPU test tier runs these test files instead of all of GPU_TESTS (a short lease)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="stop starting steps, and cut each step's limit, so that all ends within this many seconds")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"make gpu: no CUDA device here (torch {torch.__version__}, built with CUDA: "
              f"{torch.version.cuda or 'no'}): nothing to run. On a CUDA machine this builds the extension, "
              "runs the GPU test tier and the benchmarks.")
        return 0
    print(f"make gpu on {torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})")
    results = []
    start = time.time()
    for name, cmd, env, limit in steps(args.out, args.tests):
        if args.only and not any(name.startswith(w) for w in args.only):
            continue
        if name.startswith("build"):
            env = {**env, **_build_env()}
        if args.deadline_s is not None:
            limit = min(limit, int(args.deadline_s - (time.time() - start)))
            if limit < 10:
                results.append({"step": name, "status": "NOT RUN (deadline)", "seconds": 0.0})
                continue
        print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
        t0 = time.time()
        # its own process group, so that a timeout also stops what it started (ninja / nvcc, pytest-xdist
        # workers that would otherwise hold the GPU while the next step times it)
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else f"FAILED (exit {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
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
