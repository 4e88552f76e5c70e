"""End-to-end decode step cost at a real model's shapes with random weights: a plain greedy step (T = 1)
against a speculative step (a T-node tree forward, greedy LM head, greedy_verify, commit_kv) with a fixed
acceptance pattern (every step commits `--accept` tokens: the longest path's first nodes), so the per-step cost is
measured apart from how good a drafter is. Timings do not depend on weight values.

On CUDA it also captures the plain and the speculative step in CUDA graphs, checks each replay against the
eager step from the same state (tokens, verification, KV cache: the steps must be graph-safe) and times the
replays (eager steps are bound by the host's launches). A plain-PyTorch peer (the "reference" plan) runs
beside ours, and GB/s counts the bytes a step must read (step_bytes) against the measured copy bandwidth.

    python benchmarks/bench_decode_step.py [--model llama-3-8b] [--T 16 64] [--accept 4] [--context 4096]

Rows: step, T, B, us per step, tokens per step, us per token; plus the verify / plain step ratio.
CPU smoke: --model smollm2-135m --layers 2 --context 64 --T 8 --reps 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import hydra_kernels as hk  # noqa: E402
from hydra_kernels.attention_share import kv_bytes_per_token  # noqa: E402
from report import capture_graph, copy_bandwidth_gbs, print_table, time_us, write_results  # noqa: E402


def plan_name(plan) -> str:
    """A plan's name for the table: what was asked for and the backends its ops resolved to."""
    used = sorted(set(plan.ops.values()))
    return plan.requested if used == [plan.requested] else f"{plan.requested} ({'+'.join(used)})"


def random_model(name: str, layers: int | None, device, dtype) -> hk.Llama:
    """A Llama at NAMED_CONFIGS[name] shapes (optionally fewer layers), random weights, built on device."""
    cfg = hk.NAMED_CONFIGS[name]
    if layers:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = hk.Llama(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


class Steps:
    """Plain and speculative steps on one cache, each starting from the same committed length."""

    def __init__(self, model, B: int, T: int, accept: int, context: int, backends, cache=None):
        """cache: a KV cache of batch B and at least context + T + 1 rows to reuse (its rows as they are:
        a sweep draws one cache per batch size); default a new one drawn at random."""
        dev, V = model.device, model.config.vocab_size
        self.model, self.plan, self.context = model, backends, context
        self.tree = hk.tree.default_tree(T, depth=4).to(dev)
        gen = torch.Generator(device=dev).manual_seed(B * 1000 + T)
        if cache is None:
            cache = model.new_kv_cache(B, context + T + 1)
            # drawn on the device: the cache is GBs at 8B shapes (a CPU draw took minutes)
            cache.kv.normal_(0.0, 0.5, generator=gen)
        self.cache = cache
        self.tokens = torch.randint(0, V, (B, T), generator=gen, device=dev)
        lens = (self.tree.paths >= 0).sum(1)  # the fixed acceptance: the longest path's first `accept` nodes
        path = self.tree.paths[int(lens.argmax())]
        k = min(accept, int(lens.max()))
        self.accept_idx = torch.where(torch.arange(path.numel(), device=dev) < k, path, -1).expand(B, -1).contiguous()
        self.accept_len = torch.full((B,), k, dtype=torch.long, device=dev)
        self.k = k

    def reset(self):
        self.cache.seqlens.fill_(self.context)

    def plain(self):
        self.reset()
        h = self.model.step(self.tokens[:, :1], self.cache, kv_len=self.context + 1, backends=self.plan)
        tok = self.model.greedy_tokens(h, self.plan)
        self.cache.advance(1)
        return tok

    def speculative(self):
        self.reset()
        tr = self.tree
        h = self.model.step(self.tokens, self.cache, tr.mask, tr.depths, kv_len=self.context + tr.num_nodes,
                            backends=self.plan)  # [B, T, H]
        target = self.model.greedy_tokens(h, self.plan)
        v = hk.ops.greedy_verify(target, self.tokens, tr.paths, backend=self.plan["greedy_verify"])
        hk.ops.commit_kv(self.cache.kv, self.cache.seqlens, self.accept_idx, self.accept_len,
                         backend=self.plan["commit_kv"])  # the fixed pattern, not v's (random drafts)
        self.cache.advance(self.accept_len.to(self.cache.seqlens.dtype))
        return target, v.accept_lengths, v.accept_indices


def graph_check(steps: Steps, which: str = "speculative") -> tuple[str, "torch.cuda.CUDAGraph"]:
    """Capture steps.<which> ("plain" or "speculative") in a CUDA graph, replay it from the eager step's
    starting state, compare outputs and KV cache. Returns (status, the graph): its replays are timed too (a
    serving engine replays captured steps; eager steps here are bound by the host's launches)."""
    step = getattr(steps, which)
    kv0 = steps.cache.kv.clone()
    eager = step()
    kv_eager = steps.cache.kv.clone()
    steps.cache.kv.copy_(kv0)
    graph, out = capture_graph(step)
    steps.cache.kv.copy_(kv0)
    graph.replay()
    torch.cuda.synchronize()
    eager, out = (eager,) if torch.is_tensor(eager) else eager, (out,) if torch.is_tensor(out) else out
    same = all(torch.equal(a, b) for a, b in zip(eager, out)) and torch.equal(steps.cache.kv, kv_eager)
    return ("ok" if same else "MISMATCH: graph replay differs from the eager step"), graph


def timed_graph(steps: Steps, which: str, dev, reps: int) -> tuple[str, float]:
    """(graph check status, us per replay) of steps.<which>; ("no CUDA", NaN) on the CPU."""
    if dev.type != "cuda":
        return "no CUDA", float("nan")
    try:
        status, g = graph_check(steps, which)
        return status, time_us(g.replay, dev, reps=reps, warmup=3)
    except Exception as e:  # noqa: BLE001 - a step that cannot be captured is reported as such
        return f"FAILED: {type(e).__name__}: {e}"[:160], float("nan")


def step_bytes(model, B: int, context: int, T: int) -> int:
    """The fewest bytes a step must move: every weight once (the LM head included; an untied embedding table
    not: a step gathers only B x T of its rows), the committed K/V (B x context rows, K and V, every layer)
    read once, and the T new K/V rows written."""
    emb = model.tok_embeddings.weight
    tied = model.output.weight is emb
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not emb)
    return weights + B * (context + T) * kv_bytes_per_token(model)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3-8b", choices=list(hk.NAMED_CONFIGS))
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model (CPU smoke runs)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--T", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--accept", type=int, default=4, help="tokens committed per speculative step (root included)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-peers", dest="peers", action="store_false",
                    help="skip the plain-PyTorch peer (the reference backend)")
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = random_model(args.model, args.layers, dev, dtype)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    bw = copy_bandwidth_gbs(dev) if dev.type == "cuda" else float("nan")
    rows = []

    def row(backend, step, T, B, us, k, plain_us, graph="", graph_us=float("nan")):
        gbs = step_bytes(model, B, args.context, T) / (us * 1e-6) / 1e9
        return {"device": name, "model": args.model, "backend": backend, "step": step, "T": T, "B": B, "us": us,
                "tokens_per_step": k, "us_per_token": us / k, "vs_plain": us / plain_us, "GB/s": gbs,
                "frac_copy_bw": gbs / bw, "graph": graph, "graph_us": graph_us}

    # our plan ("auto": the fastest backend of each op here) beside plain PyTorch ("reference": torch SDPA
    # with a dense tree mask, torch top-k / argmax), same model, same cache, same run
    backends = [args.backend] + [b for b in ("reference",) if b != args.backend and args.peers]
    for B in args.batch:
        for backend in backends:
            plan = model.backend_plan(backend)
            plain_us = None
            for T in args.T:
                steps = Steps(model, B, T, args.accept, args.context, plan)
                if plain_us is None:
                    plain_us = time_us(steps.plain, dev, reps=args.reps, warmup=3)
                    rows.append(row(plan_name(plan), "plain", 1, B, plain_us, 1, plain_us,
                                    *timed_graph(steps, "plain", dev, args.reps)))
                us = time_us(steps.speculative, dev, reps=args.reps, warmup=3)
                graph, graph_us = timed_graph(steps, "speculative", dev, args.reps)
                rows.append(row(plan_name(plan), "speculative", T, B, us, steps.k, plain_us, graph, graph_us))
                print(f"B={B} {plan_name(plan)} T={T}: plain {plain_us:.0f} us, speculative {us:.0f} us, graph {graph}",
                      flush=True)
    if dev.type == "cuda":
        print(f"device {name}: measured copy bandwidth {bw:.0f} GB/s (GB/s below: weights + K/V bytes per step / time)")
    print_table(rows, ["backend", "step", "T", "B", "us", "tokens_per_step", "us_per_token", "vs_plain", "GB/s",
                       "frac_copy_bw", "graph", "graph_us"])
    write_results(rows, args.out, f"decode_step_{args.model}_{dev.type}")
    return rows


if __name__ == "__main__":
    main()
