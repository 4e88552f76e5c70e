"""Microseconds per decoding step of the bookkeeping ops, per backend, same inputs, same run:
commit_kv (all layers, K and V), greedy_verify, tree_inputs. Every backend's output is checked
against the reference first. Shapes: the model's KV buffer and a 64-node tree, batch 1 and 8.

    python benchmarks/bench_step_ops.py [--model smollm2-135m|llama-2-7b|llama-3-8b] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import torch
from report import time_us as bench, write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args()
    import hydra_kernels as hk
    from hydra_kernels.ops.backend import _IMPLS, _usable

    dev = torch.device(args.device)
    cfg = hk.NAMED_CONFIGS[args.model]
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    tree = hk.tree.default_tree(64, depth=4).to(dev)
    rows = []
    for B in (1, 8):
        gen = torch.Generator().manual_seed(B)
        S = args.context + 128
        kv = torch.randn(cfg.num_layers, 2, B, S, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(dev, dtype)
        seqlens = torch.full((B,), args.context, dtype=torch.int32, device=dev)
        target = torch.randint(0, 50, (B, tree.num_nodes), generator=gen).to(dev)
        tokens = target[:, tree.parents.clamp(min=0).cpu()].clone()  # every node accepted: the longest path
        v = hk.ops.greedy_verify(target, tokens, tree.paths, backend="reference")
        C = int(tree.flat_source.max()) + 1
        cand = torch.randint(0, 50, (B, C), generator=gen).to(dev)
        root = cand[:, 0].clone()
        cases = {
            "commit_kv": lambda be: hk.ops.commit_kv(kv, seqlens, v.accept_indices, v.accept_lengths, backend=be),
            "greedy_verify": lambda be: hk.ops.greedy_verify(target, tokens, tree.paths, backend=be),
            "tree_inputs": lambda be: hk.ops.tree_inputs(root, cand, tree.flat_source, tree.depths, seqlens, backend=be),
        }
        for op, fn in cases.items():
            ref = None if op == "commit_kv" else fn("reference")
            for be in ("reference", "triton", "native"):
                if be not in _IMPLS.get(op, {}) or not _usable(be, dev):
                    continue
                if ref is not None:
                    out = fn(be)
                    assert all(torch.equal(a, b) for a, b in zip(out, ref)), f"{op} {be} differs from the reference"
                rows.append(dict(op=op, backend=be, batch=B, us=bench(lambda: fn(be), dev)))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"\nstep bookkeeping ops, {args.model} KV buffer ({dtype}), 64-node tree, context {args.context}, {name}")
    print(f"{'op':<14} {'backend':<10} {'batch':>5} {'us/step':>9}")
    for r in rows:
        print(f"{r['op']:<14} {r['backend']:<10} {r['batch']:>5} {r['us']:>9.1f}")
    write_results(rows, args.out, f"bench_step_ops_{dev.type}")


if __name__ == "__main__":
    main()
