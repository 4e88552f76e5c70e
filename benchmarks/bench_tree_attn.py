"""Tree attention: our Triton kernel beside the peers a user would otherwise pick, same inputs, same run.

Peers: torch SDPA with a dense [B, 1, T, S] mask (built outside the timed region: generous to it),
FlexAttention (compiled) with a tree BlockMask, flash-attn's kvcache kernel when installed (T = 1 only:
it cannot express a tree mask), and our pure-PyTorch reference. Every output is checked against the
reference before it is timed. Reported: median time, GB/s over the bytes that must move (prefix + tree
K/V, queries, output) and that as a fraction of the copy bandwidth measured in this run.

    python benchmarks/bench_tree_attn.py                 # GPU: SmolLM2 / Llama-2-7B / Llama-3-8B shapes,
                                                         # context 512..32k, T in 1/16/64/128, batch 1..8
    python benchmarks/bench_tree_attn.py --quick         # small shapes (the default on a CPU, where the
                                                         # Triton kernel runs under TRITON_INTERPRET=1)
Writes benchmarks/out/tree_attn.csv and .png.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton kernels are defined

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import copy_bandwidth_gbs, graph_us, plotted_fraction, print_table, time_us, write_results  # noqa: E402

import hydra_kernels as hk  # noqa: E402
from hydra_kernels.ops.backend import kernel_mask, resolve  # noqa: E402
from hydra_kernels.tree import default_tree  # noqa: E402

MODELS = ["smollm2-135m", "llama-2-7b", "llama-3-8b"]


def make_inputs(cfg, B, T, context, dtype, device, seed=0):
    """Random q / cache (S = context + T rows), every sequence at `context`, a T-node default tree."""
    gen = torch.Generator().manual_seed(seed)
    S = context + T
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = torch.randn(B, T, Hq, D, generator=gen).to(device, dtype)
    k = torch.randn(B, S, Hkv, D, generator=gen).to(device, dtype)
    v = torch.randn(B, S, Hkv, D, generator=gen).to(device, dtype)
    seqlens = torch.full((B,), context, dtype=torch.int32, device=device)
    mask = (default_tree(T, depth=min(4, max(1, T - 1))).mask if T > 1 else torch.ones(1, 1, dtype=torch.bool)).to(device)
    return q, k, v, seqlens, mask


def dense_mask(seqlens, tree_mask, S):
    from hydra_kernels.ops.reference import tree_key_mask

    return tree_key_mask(seqlens, tree_mask, S)[:, None]  # [B, 1, T, S]


def peers(q, k, v, seqlens, mask):
    """name -> zero-argument callable returning [B, T, Hq, D] (or a string: why it is not available)."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    # ours as a model step runs it: the mask packed once per step (AttentionSite) and the kernel called per
    # layer, so the timed call is one layer's (like the peers' masks, built outside the timed region)
    ours = resolve("tree_attention", "triton", q.device)
    packed = kernel_mask("tree_attention", "triton", mask)
    out = {
        "ours (triton)": lambda: ours(q, k, v, seqlens, packed),
        "reference": lambda: hk.ops.tree_attention(q, k, v, seqlens, mask, backend="reference"),
    }
    dm = dense_mask(seqlens, mask, S)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out["sdpa dense mask"] = lambda: sdpa(qt, kt, vt, attn_mask=dm, enable_gqa=Hq != Hkv).transpose(1, 2)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        sl, tm = seqlens.long(), mask

        def mask_mod(b, h, qi, kj):
            rel = kj - sl[b]
            return (kj < sl[b]) | ((rel >= 0) & (rel < T) & tm[qi, rel.clamp(0, T - 1)])

        bm = create_block_mask(mask_mod, B, None, T, S, device=q.device)
        # one compile per shape; past dynamo's default recompile limit (8) flex_attention silently falls back
        # to its unfused path, which would misstate the peer
        import torch._dynamo as dynamo

        limit = "recompile_limit" if hasattr(dynamo.config, "recompile_limit") else "cache_size_limit"  # torch < 2.7
        setattr(dynamo.config, limit, max(getattr(dynamo.config, limit), 256))
        flex = torch.compile(flex_attention, dynamic=False)
        out["flex tree blockmask"] = lambda: flex(qt, kt, vt, block_mask=bm, enable_gqa=Hq != Hkv).transpose(1, 2)
    except Exception as e:  # noqa: BLE001 - report, do not hide
        out["flex tree blockmask"] = f"unavailable: {type(e).__name__}: {e}"[:120]
    try:
        from flash_attn import flash_attn_with_kvcache

        if T == 1:
            out["flash-attn kvcache"] = lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens + 1)
        else:
            out["flash-attn kvcache"] = "no tree mask in flash-attn (T = 1 only)"
    except ImportError:
        pass
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    ap.add_argument("--contexts", nargs="+", type=int, default=None)
    ap.add_argument("--T", nargs="+", type=int, default=None)
    ap.add_argument("--batch", nargs="+", type=int, default=None)
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--quick", action="store_true", help="small shapes (default without CUDA)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = args.quick or dev.type == "cpu"
    contexts = args.contexts or ([64, 256] if quick else [512, 1024, 4096, 16384, 32768])
    Ts = args.T or ([1, 16] if quick else [1, 16, 64, 128])
    batches = args.batch or ([1, 2] if quick else [1, 4, 8])
    reps = args.reps or (3 if quick else 50)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("fp32" if dev.type == "cpu" else "bf16")]
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    bw = copy_bandwidth_gbs(dev)
    print(f"device {name}, dtype {dtype}, measured copy bandwidth {bw:.0f} GB/s"
          + (" (Triton under the interpreter: times show it runs, not how fast)" if dev.type == "cpu" else ""))
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size if dev.type == "cuda" else 0
    rows = []
    points = [(m, c, T, B) for m in args.models for c in contexts for T in Ts for B in batches]
    for model, context, T, B in tqdm(points, desc="tree attention points"):
        cfg = hk.NAMED_CONFIGS[model]
        q, k, v, seqlens, mask = make_inputs(cfg, B, T, context, dtype, dev)
        elt = q.element_size()
        nbytes = 2 * B * (context + T) * cfg.num_kv_heads * cfg.head_dim * elt + 2 * q.numel() * elt
        ref = hk.ops.tree_attention(q.float(), k.float(), v.float(), seqlens, mask, backend="reference")
        for peer, fn in peers(q, k, v, seqlens, mask).items():
            row = dict(model=model, context=context, T=T, batch=B, peer=peer, device=name, dtype=str(dtype)[6:])
            if isinstance(fn, str):
                rows.append({**row, "us": float("nan"), "GB/s": float("nan"), "frac_copy_bw": float("nan"),
                             "graph_us": float("nan"), "graph_frac_copy_bw": float("nan"), "max_err": float("nan"),
                             "note": fn})
                continue
            try:
                err = (fn().float() - ref).abs().max().item()
                us = time_us(fn, dev, reps=reps, warmup=1 if quick else 5)
                g_us = graph_us(fn, dev)  # without the host's launch overhead; NaN on the CPU
                note = "K/V fits in L2: repeated calls read it from cache" if nbytes < l2 else ""
            except Exception as e:  # noqa: BLE001 - a peer that fails is reported as such
                err, us, g_us = float("nan"), float("nan"), float("nan")
                note = f"failed: {type(e).__name__}: {e}"[:120]
            gbs = nbytes / (us * 1e-6) / 1e9
            rows.append({**row, "us": us, "GB/s": gbs, "frac_copy_bw": gbs / bw, "graph_us": g_us,
                         "graph_frac_copy_bw": nbytes / (g_us * 1e-6) / 1e9 / bw, "max_err": err, "note": note})
    print_table(rows, ["model", "context", "T", "batch", "peer", "us", "frac_copy_bw", "graph_us", "graph_frac_copy_bw",
                       "max_err", "note"])

    def plot(ax):
        T0 = max(t for t in Ts if t <= 16)
        for model in args.models:
            for peer in sorted({r["peer"] for r in rows}):
                pts = [(r["context"], plotted_fraction(r)) for r in rows if r["model"] == model and r["peer"] == peer
                       and r["T"] == T0 and r["batch"] == batches[0] and plotted_fraction(r) == plotted_fraction(r)]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{model}: {peer}")
        ax.set_xscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("fraction of copy bandwidth (CUDA-graph time on a GPU)")
        ax.set_title(f"tree attention, T={T0}, batch {batches[0]}, {name}", fontsize=9)
        ax.legend(fontsize=5)

    write_results(rows, args.out, "tree_attn", plot)


if __name__ == "__main__":
    main()
