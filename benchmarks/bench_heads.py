"""Drafting kernels beside plain PyTorch, same inputs, same run: the fused Hydra first layer
(gather + concat-free matmul + SiLU + residual), the fused H -> H ResBlock of deeper heads and the LM
head with fused top-k / argmax, for 1 to 64 nodes.
Both are weight-read bound at these sizes; reported as GB/s over the weight bytes (plus gathered
embeddings) and as a fraction of the copy bandwidth measured in this run. Outputs are checked first.

    python benchmarks/bench_heads.py [--model llama-2-7b] [--quick]
Writes benchmarks/out/heads.csv and .png. Without CUDA the Triton kernels run under the interpreter
(small shapes: it shows they run, not how fast).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import copy_bandwidth_gbs, graph_us, plotted_fraction, print_table, time_us, write_results  # noqa: E402

import hydra_kernels as hk  # noqa: E402
from hydra_kernels.ops import reference  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-2-7b", choices=list(hk.NAMED_CONFIGS))
    ap.add_argument("--nodes", nargs="+", type=int, default=None)
    ap.add_argument("--depth", type=int, default=1, help="head index d: the first layer is [(d+2)H -> H]")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = args.quick or dev.type == "cpu"
    cfg = hk.NAMED_CONFIGS[args.model]
    H, V = cfg.hidden_size, cfg.vocab_size
    if quick:  # interpreter: a slice of the real shapes
        H, V = min(H, 256), min(V, 4096)
    nodes = args.nodes or ([1, 16] if quick else [1, 4, 16, 64])
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    reps = 3 if quick else 100
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: (torch.randn(*s, generator=gen) / s[-1] ** 0.5).to(dev, dtype)
    d = args.depth
    emb, wl, wr, bl, br, lm = r(V, H), r(H, (d + 2) * H), r(H, (d + 2) * H), r(H), r(H), r(V, H)
    # a further H -> H ResBlock; 4 copies of its weight taken in turn, so that back-to-back calls (the graph
    # timing) stream it from memory: one copy (33 MB at 8B shapes) would sit in a 50 MB L2
    wbs, bb = [r(H, H) for _ in range(4)], r(H)
    wb, turn = wbs[0], itertools.cycle(range(4))
    bw = copy_bandwidth_gbs(dev)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"device {name}, {args.model} shapes (H={H}, V={V}), {dtype}, copy bandwidth {bw:.0f} GB/s")
    rows = []
    for n in tqdm(nodes, desc="node counts"):
        h = r(1, H)
        toks = torch.randint(0, V, (1, n, d + 1), generator=gen).to(dev)
        x = r(n, H)
        elt = wl.element_size()
        cases = {
            "hydra first layer": ((2 * wl.numel() + n * (d + 1) * H) * elt, {
                "ours (triton)": lambda: hk.ops.hydra_first_layer(h, toks, emb, wl, bl, wr, br, backend="triton"),
                "pytorch (cat + 2 linears)": lambda: reference.hydra_first_layer(h, toks, emb, wl, bl, wr, br)}),
            "resblock": ((wb.numel() + 2 * n * H) * elt, {
                "ours (triton)": lambda: hk.ops.resblock(x, wbs[next(turn)], bb, backend="triton"),
                "pytorch (linear + silu + add)": lambda: reference.resblock(x, wbs[next(turn)], bb)}),
            f"lm head top-{args.k}": (lm.numel() * elt, {
                "ours (triton)": lambda: hk.ops.lm_head_topk(x, lm, args.k, backend="triton"),
                "pytorch (linear + topk)": lambda: torch.nn.functional.linear(x, lm).topk(args.k, dim=-1)}),
            "lm head argmax": (lm.numel() * elt, {
                "ours (triton)": lambda: hk.ops.lm_head_topk(x, lm, 1, backend="triton"),
                "pytorch (linear + argmax)": lambda: torch.nn.functional.linear(x, lm).argmax(-1)}),
        }
        for op, (nbytes, impls) in cases.items():
            ref = None
            for peer, fn in impls.items():
                if op == "resblock":
                    turn = itertools.cycle(range(4))  # the same weight copy for each peer's checked call
                res = fn()
                val = res[0] if isinstance(res, tuple) else res
                if op in ("hydra first layer", "resblock"):
                    err = 0.0 if ref is None else (val.float() - ref.float()).abs().max().item()
                    ref = val if ref is None else ref
                else:
                    err = float("nan")
                us = time_us(fn, dev, reps=reps, warmup=1 if quick else 10)
                gbs = nbytes / (us * 1e-6) / 1e9
                g_us = graph_us(fn, dev)  # NaN on the CPU
                rows.append(dict(op=op, nodes=n, peer=peer, device=name, us=us, **{"GB/s": gbs},
                                 frac_copy_bw=gbs / bw, graph_us=g_us,
                                 graph_frac_copy_bw=nbytes / (g_us * 1e-6) / 1e9 / bw, max_err_vs_ours=err))
    print_table(rows, ["op", "nodes", "peer", "us", "GB/s", "frac_copy_bw", "graph_us", "graph_frac_copy_bw",
                       "max_err_vs_ours"])

    def plot(ax):
        for op in sorted({x["op"] for x in rows}):
            for peer in sorted({x["peer"] for x in rows if x["op"] == op}):
                pts = [(x["nodes"], plotted_fraction(x)) for x in rows if x["op"] == op and x["peer"] == peer]
                ax.plot(*zip(*pts), marker="o", label=f"{op}: {peer}")
        ax.set_xscale("log")
        ax.set_xlabel("nodes")
        ax.set_ylabel("fraction of copy bandwidth (weights; CUDA-graph time on a GPU)")
        ax.set_title(f"draft heads, {args.model} shapes, {name}", fontsize=9)
        ax.legend(fontsize=5)

    write_results(rows, args.out, "heads", plot)


if __name__ == "__main__":
    main()
