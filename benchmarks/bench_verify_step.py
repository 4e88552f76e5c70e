"""CPU greedy verify step, native (one call: csrc/tree_step_cpu.cpp) against the module path
(speculative.greedy_verify_step: Llama.step, Llama.greedy_tokens, ops.greedy_verify, commit_step), beside the
native plain step, on the embedded model: per batch size B and chain of T nodes, blocks of --calls calls of each
variant in turn (each block warmed by 3 calls), --rounds rounds, medians. The steps commit nothing (every sequence
inactive), so each call sees the same cache of --context rows; the two verify steps' outputs are compared first.

    python benchmarks/bench_verify_step.py [--batches 1 4] [--sizes 1 2 4 6] [--context 300] [--rounds 6]
        [--calls 20] [--activations fp32|int8] [--out DIR]

What it shows: what a drafted step pays beyond its rows: (module T) - (native T) is the work around the kernels
that the native step removes; (native T) - (plain) is what T - 1 drafted rows cost.
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
from hydra_kernels.generate import plan_backends  # noqa: E402
from hydra_kernels.model.plain_step import native_plain_step  # noqa: E402
from hydra_kernels.model.tree_step import native_tree_step  # noqa: E402
from hydra_kernels.speculative import greedy_verify_step  # noqa: E402
from hydra_kernels.tree import chain  # noqa: E402


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 6], help="chain sizes T (root included)")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=20, help="calls timed per block")
    ap.add_argument("--activations", default="fp32", choices=["fp32", "int8"],
                    help="the model's projections: exact (fp32 activations) or int8 dot products (load_model's)")
    ap.add_argument("--out", default=None, help="write verify_step.csv there")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model, _ = hk.load_model(device="cpu", activations=args.activations)
    backends = plan_backends("auto", model.device, packed_weights=model.has_packed_weights)
    rows = []
    for B in args.batches:
        C, T_max = args.context, max(args.sizes)
        cache = model.new_kv_cache(B, C + T_max + 8)
        cache.seqlens.fill_(C)  # the rows' values do not change the time
        plain, native = native_plain_step(model, cache, backends), native_tree_step(model, cache, backends)
        if plain is None or native is None:
            sys.exit("the native steps do not apply here (the extension, the packed CPU kernel, a quantized model)")
        inactive = torch.zeros(B, dtype=torch.long)  # nothing committed: every call sees the same cache
        tokens = torch.randint(0, model.config.vocab_size, (B, T_max), generator=torch.Generator().manual_seed(0))
        calls = {("plain", 1): lambda: plain(tokens[:, 0].contiguous(), C + 1, commit=False)}
        for T in args.sizes:
            tree, x = chain(T - 1), tokens[:, :T].contiguous()
            calls[("module", T)] = lambda tree=tree, x=x, T=T: greedy_verify_step(
                model, cache, x, tree, inactive, kv_len=C + T, backends=backends)
            calls[("native", T)] = lambda tree=tree, x=x, T=T: native(x, tree, inactive, None, C + T)
        for T in args.sizes:  # both give the same hidden states, tokens and acceptance before either is timed
            got, want = calls[("native", T)](), calls[("module", T)]()
            if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                    and all(torch.equal(g, w) for g, w in zip(got[2], want[2]))):
                sys.exit(f"the native verify step differs from the module path at B={B}, T={T}")
        times = {k: [] for k in calls}
        for _ in range(args.rounds):
            for k, f in calls.items():
                for _ in range(3):
                    f()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    f()
                times[k].append((time.perf_counter() - t0) / args.calls * 1e3)
        plain_ms = statistics.median(times[("plain", 1)])
        for T in args.sizes:
            mod, nat = statistics.median(times[("module", T)]), statistics.median(times[("native", T)])
            rows.append(dict(batch=B, T=T, context=C, plain_ms=round(plain_ms, 3), module_ms=round(mod, 3),
                             native_ms=round(nat, 3), saved_ms=round(mod - nat, 3),
                             native_over_plain=round(nat / plain_ms, 3), module_over_plain=round(mod / plain_ms, 3)))
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}, context {args.context}")
    print_table(rows, list(rows[0]))
    if args.out:
        write_results(rows, args.out, "verify_step")
    return rows


if __name__ == "__main__":
    main()
