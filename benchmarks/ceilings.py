"""The two hardware ceilings every GPU figure is quoted against, measured once per run on this device:
device-to-device copy bandwidth ((bytes read + bytes written) / time) and bf16 matrix-product rate
(an 8192 x 8192 x 8192 product on random data: zeros run faster than real data on some GPUs).

    python benchmarks/ceilings.py [--out benchmarks/out]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import copy_bandwidth_gbs, print_table, time_us, write_results  # noqa: E402


def matmul_tflops(device, n: int = 8192, dtype=torch.bfloat16) -> float:
    """2 n^3 / time of an n x n x n product (random inputs, median of timed calls)."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    c = torch.empty(n, n, device=device, dtype=dtype)
    us = time_us(lambda: torch.mm(a, b, out=c), device, reps=20, warmup=3)
    return 2 * n**3 / (us * 1e-6) / 1e12


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--matmul-n", type=int, default=None, help="matrix size (default 8192 on CUDA, 1024 on the CPU)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    n = args.matmul_n or (8192 if dev.type == "cuda" else 1024)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = [{"device": name, "ceiling": "copy bandwidth", "value": copy_bandwidth_gbs(dev), "unit": "GB/s (read + write)"},
            {"device": name, "ceiling": f"{str(dtype)[6:]} matmul {n}^3", "value": matmul_tflops(dev, n, dtype),
             "unit": "TFLOP/s"}]
    print_table(rows, ["device", "ceiling", "value", "unit"])
    write_results(rows, args.out, f"ceilings_{dev.type}")
    return rows


if __name__ == "__main__":
    main()
