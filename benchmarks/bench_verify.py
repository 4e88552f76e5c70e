"""Acceptance + commit per decoding step, per backend, same inputs, same run: greedy_verify (path
selection: accept length, accepted nodes, next root, last node) followed by commit_kv (all layers, K
and V), on the model's KV buffer with a 64-node tree where every node is accepted (the longest copy).
Each backend's result is checked against the reference first. Target on a GPU: < 20 us at batch 1.

    python benchmarks/bench_verify.py [--model llama-2-7b] [--context 1024]
Writes benchmarks/out/verify.csv and .png. Without CUDA: Triton under the interpreter (it runs; the
times are not its speed) and the native C++ CPU kernels.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import graph_us, print_table, time_us, write_results  # noqa: E402

import hydra_kernels as hk  # noqa: E402
from hydra_kernels.ops.backend import _usable  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-2-7b", choices=list(hk.NAMED_CONFIGS))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = hk.NAMED_CONFIGS[args.model]
    layers = cfg.num_layers if dev.type == "cuda" else min(cfg.num_layers, 4)  # CPU: a slice of the buffer
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tree = hk.tree.default_tree(args.nodes, depth=4).to(dev)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    rows = []
    for B in (1, 8):
        gen = torch.Generator().manual_seed(B)
        S = args.context + tree.num_nodes
        kv = torch.randn(layers, 2, B, S, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(dev, dtype)
        seqlens = torch.full((B,), args.context, dtype=torch.int32, device=dev)
        target = torch.randint(0, 50, (B, tree.num_nodes), generator=gen).to(dev)
        tokens = target[:, tree.parents.clamp(min=0)].clone()  # every drafted node accepted
        ref_kv = kv.clone()
        ref = hk.ops.greedy_verify(target, tokens, tree.paths, backend="reference")
        hk.ops.commit_kv(ref_kv, seqlens, ref.accept_indices, ref.accept_lengths, backend="reference")
        for be in ("reference", "native", "triton"):
            if not _usable(be, dev):
                continue

            def step(kv_buf):
                v = hk.ops.greedy_verify(target, tokens, tree.paths, backend=be)
                hk.ops.commit_kv(kv_buf, seqlens, v.accept_indices, v.accept_lengths, backend=be)
                return v

            mine = kv.clone()
            v = step(mine)
            ok = all(torch.equal(a, b) for a, b in zip(v, ref)) and torch.equal(mine, ref_kv)
            scratch = kv.clone()
            us = time_us(lambda: step(scratch), dev, reps=5 if (dev.type == "cpu" and be == "triton") else 100)
            g_us = graph_us(lambda: step(scratch), dev)  # without the host's launch overhead; NaN on the CPU
            rows.append(dict(backend=be, batch=B, layers=layers, accepted=int(ref.accept_lengths[0]), device=name,
                             us_per_step=us, graph_us_per_step=g_us, matches_reference=ok))
    print_table(rows, ["backend", "batch", "layers", "accepted", "us_per_step", "graph_us_per_step", "matches_reference"])
    if not all(r["matches_reference"] for r in rows):
        raise SystemExit("a backend disagrees with the reference")

    def plot(ax):
        for be in sorted({r["backend"] for r in rows}):
            pts = [(r["batch"], r["us_per_step"]) for r in rows if r["backend"] == be]
            ax.plot(*zip(*pts), marker="o", label=be)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("us per step (verify + commit)")
        ax.set_title(f"acceptance + commit, {args.model}, {name}", fontsize=9)
        ax.legend()

    write_results(rows, args.out, "verify", plot)


if __name__ == "__main__":
    main()
