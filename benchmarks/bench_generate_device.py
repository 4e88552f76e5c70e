"""End-to-end generate() on the device (a GPU where there is one) beside transformers, same weights, same run.

A GPU machine here cannot hold the embedded model (no network, too big to carry), so the model has a named
config's shapes (default SmolLM2-135M) with random weights, in both libraries: timings do not depend on the
weight values. Acceptance does, so the speculative rows pair like with like: our n-gram drafter beside
transformers' prompt lookup (the same idea) on the same prompts, tokens per step printed, and no claim about
trained drafters (their acceptance is measured with the real model on the CPU: benchmarks/results/README.md).

Decoders, batch 1, greedy, exactly --new-tokens tokens each (EOS ignored on both sides), interleaved over
--reps rounds in a rotating order, medians of end-to-end tokens/s (prefill included on both sides):
  ours plain | ours n-gram | transformers generate | transformers prompt lookup (prompt_lookup_num_tokens=10)
Also: whether our plain tokens equal transformers' greedy tokens (bf16 kernels may differ at near-ties:
reported, not asserted) and our n-gram tokens equal ours plain (asserted: lossless).

    python benchmarks/bench_generate_device.py [--model smollm2-135m] [--layers N] [--dtype bfloat16]
        [--prompt-tokens 128] [--new-tokens 128] [--reps 5] [--out benchmarks/out]
CPU smoke: --layers 1 --prompt-tokens 16 --new-tokens 8 --reps 1 --dtype float32.

--graphs (issue 43): generate() eager (cuda_graphs=False) vs replayed from CUDA graphs (cuda_graphs=True), plain
and with the n-gram drafter, at each of --models' shapes (default SmolLM2-135M and Llama-3-8B, random weights)
and --batch sizes (default 1 4 16), bf16, beside transformers' generate eager and with its static cache + torch
.compile (cache_implementation="static": transformers then compiles the forward itself; at --compiled-batches
only: each batch size compiles afresh), each as a
fraction of the copy ceiling measured in the same call (batch x tokens/s over what the copy bandwidth allows:
every weight and the K/V read once per step, at the mid-run context). Medians of end-to-end tokens/s
(prefill included, all decoders alike), every sequence exactly --new-tokens long; `identical`: the fraction of
our graph-replayed sequences equal to eager's (the target: 1.0; not for sampled rows, whose graphs draw
Philox noise where eager draws the generator's). At --sampled-batches (default 1) also n-gram drafting
with rejection sampling at T = 0.8, eager and graphs. Writes generate_graphs_<gpu>_<date>.csv
(columns shapes, decoder, mode, batch, tokens_per_s, copy_fraction, ...) under --out. Without CUDA the
"graphs" rows run the runner's static-buffer path without graphs (hydra_kernels.runner.static_buffers).
    python benchmarks/bench_generate_device.py --graphs [--models smollm2-135m llama-3-8b] [--batch 1 4 16]
        [--compiled-batches 1] [--sampled-batches 1] [--prompt-tokens 128] [--new-tokens 128] [--reps 3]
        [--out benchmarks/out]
CPU smoke: --graphs --models smollm2-135m --layers 1 --batch 1 2 --compiled-batches --prompt-tokens 16
    --new-tokens 8 --reps 1 --dtype float32.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import hydra_kernels as hk  # noqa: E402
from hydra_kernels.generate import generate  # noqa: E402
from report import copy_bandwidth_gbs, print_table, write_results  # noqa: E402


def hf_model(name: str, layers: int | None, device, dtype):
    """A transformers LlamaForCausalLM at NAMED_CONFIGS[name] shapes, random weights, built on the device."""
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM

    c = hk.NAMED_CONFIGS[name]
    cfg = HFConfig(**{**c.to_hf_dict(), "num_hidden_layers": layers or c.num_layers, "eos_token_id": None})
    torch.manual_seed(0)
    with torch.device(device):
        hf = LlamaForCausalLM(cfg).to(dtype).eval()
    hf.generation_config.eos_token_id = None  # exactly max_new_tokens, as ours with eos_token_id=[]
    return hf


def repetitive_prompt(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    """n tokens that repeat a few random phrases (as chat prompts quote and restate): n-gram drafting's case."""
    phrases = [torch.randint(3, vocab, (int(torch.randint(4, 12, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(6)]
    out: list[int] = []
    while len(out) < n:
        out += phrases[int(torch.randint(0, len(phrases), (1,), generator=gen))]
    return out[:n]


def main(argv=None) -> list[dict]:
    if argv is None:
        argv = sys.argv[1:]
    if "--graphs" in argv:
        return graphs_main([a for a in argv if a != "--graphs"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", choices=list(hk.NAMED_CONFIGS))
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model (CPU smoke runs)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_grad_enabled(False)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"

    hf = hf_model(args.model, args.layers, dev, dtype)
    ours = hk.Llama.from_hf(hf).to(dev, dtype)
    ngram = hk.new_drafter(ours, kind="ngram")
    gen = torch.Generator().manual_seed(1)
    prompts = [repetitive_prompt(args.prompt_tokens, hf.config.vocab_size, gen) for _ in range(args.prompts)]
    n = args.new_tokens

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def run_ours(ids, drafter):
        sync()
        t = time.perf_counter()
        out = generate(ours, [ids], drafter=drafter, max_new_tokens=n, eos_token_id=[])
        sync()
        return time.perf_counter() - t, out.sequences[0], out.mean_accepted_tokens

    def run_hf(ids, lookup):
        x = torch.tensor([ids], device=dev)
        kw = dict(prompt_lookup_num_tokens=10) if lookup else {}
        sync()
        t = time.perf_counter()
        # no EOS on either side (ours: eos_token_id=[]): min_new_tokens would mask EOS logits instead, which
        # changes the argmax where EOS wins and so the token comparison below
        y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
        sync()
        assert y.shape[1] == len(ids) + n, "transformers stopped early: the work would not be equal"
        return time.perf_counter() - t, y[0, len(ids):].tolist(), float("nan")

    decoders = {"ours plain": lambda p: run_ours(p, None), "ours n-gram": lambda p: run_ours(p, ngram),
                "transformers generate": lambda p: run_hf(p, False),
                "transformers prompt lookup": lambda p: run_hf(p, True)}
    for fn in decoders.values():  # warm-up: compiles, allocator, first-call dispatch
        fn(prompts[0])
    times = {k: [] for k in decoders}
    steps = {k: [] for k in decoders}
    toks = {}
    order = list(decoders)
    for r in range(args.reps):
        for i, p in enumerate(prompts):
            rot = order[(r + i) % len(order):] + order[:(r + i) % len(order)]
            for k in rot:
                t, seq, tps = decoders[k](p)
                times[k].append(n / t)
                steps[k].append(tps)
                toks[k, i] = seq
    for i in range(len(prompts)):
        assert toks["ours n-gram", i] == toks["ours plain", i], f"prompt {i}: n-gram drafting changed the output"
    same_hf = sum(toks["ours plain", i] == toks["transformers generate", i] for i in range(len(prompts)))
    plain = statistics.median(times["ours plain"])
    rows = [dict(device=name, model=args.model, layers=args.layers or hk.NAMED_CONFIGS[args.model].num_layers,
                 dtype=args.dtype, prompt_tokens=args.prompt_tokens, new_tokens=n, decoder=k,
                 median_tok_s=round(statistics.median(v), 1), vs_ours_plain=round(statistics.median(v) / plain, 3),
                 tokens_per_step=round(statistics.median(steps[k]), 2) if k.startswith("ours") and k != "ours plain" else "",
                 runs=len(v)) for k, v in times.items()]
    print(f"\ngenerate() end to end on {name}, {args.model} shapes (random weights), {args.dtype}, batch 1, "
          f"{args.prompt_tokens}-token prompts, {n} new tokens, {len(prompts)} prompts x {args.reps} rounds interleaved; "
          f"ours plain == transformers greedy on {same_hf}/{len(prompts)} prompts; n-gram == plain on all")
    print_table(rows, ["decoder", "median_tok_s", "vs_ours_plain", "tokens_per_step"])

    def plot(ax):
        ax.bar(range(len(rows)), [r["median_tok_s"] for r in rows])
        ax.set_xticks(range(len(rows)), [r["decoder"] for r in rows], rotation=15)
        ax.set_ylabel("tokens/s (median, end to end)")
        ax.set_title(f"generate on {name}: {args.model} shapes, {args.dtype}, batch 1")

    write_results(rows, args.out, f"generate_device_{args.model}", plot)
    return rows


# ---- --graphs: eager vs CUDA graphs (issue 43) --------------------------------------------------------
def gpu_short_name(dev) -> str:
    """'h100', 'h200', 'a100', ... from the device name; 'cpu' off CUDA."""
    if dev.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(dev).lower()
    for tag in ("h200", "h100", "a100", "l40s", "l4", "a10g", "b200", "gh200"):
        if tag in name:
            return tag
    return name.replace("nvidia", "").strip().replace(" ", "-")


def graphs_main(argv=None) -> list[dict]:
    import hydra_kernels.runner as runner
    from bench_decode_step import step_bytes

    ap = argparse.ArgumentParser(description="generate() eager vs CUDA graphs (--graphs)")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-3-8b"], choices=list(hk.NAMED_CONFIGS))
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model (CPU smoke runs)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--compiled-batches", type=int, nargs="*", default=[1],
                    help="batch sizes of the transformers static cache + torch.compile peer (each compiles afresh)")
    ap.add_argument("--sampled-batches", type=int, nargs="*", default=[1],
                    help="batch sizes that also time n-gram drafting with rejection sampling (T = 0.8), eager and graphs")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kernel-profile", action="store_true",
                    help="CUDA: also list the kernels of one graph-replayed plain run at the first batch size (launches "
                         "a step, device time per kernel name) in <out>/kernels_<shapes>.txt")
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_grad_enabled(False)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    n = args.new_tokens
    bw = copy_bandwidth_gbs(dev)  # the ceiling, measured in this call
    print(f"copy ceiling on {name}: {bw:.0f} GB/s")

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def timed(fn):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        return time.perf_counter() - t, out

    rows = []
    for model_name in args.models:
        hf = hf_model(model_name, args.layers, dev, dtype)
        ours = hk.Llama.from_hf(hf).to(dev, dtype)
        ngram = hk.new_drafter(ours, kind="ngram")
        gen = torch.Generator().manual_seed(1)
        shapes = model_name + (f" ({args.layers} layers)" if args.layers else "")
        for B in args.batch:
            prompts = [repetitive_prompt(args.prompt_tokens, hf.config.vocab_size, gen) for _ in range(B)]

            def ours_run(drafter, graphs, temperature=0.0):
                # off CUDA "graphs" is the runner's static-buffer path without graphs (the smoke run's check)
                ctx = runner.static_buffers() if graphs and dev.type != "cuda" else contextlib.nullcontext()
                with ctx:
                    out = generate(ours, prompts, drafter=drafter, max_new_tokens=n, eos_token_id=[],
                                   cuda_graphs=graphs, temperature=temperature, seed=0 if temperature else None)
                return out.sequences, out.mean_accepted_tokens, out.num_steps, out.tokens_per_second

            def hf_run(compiled):
                x = torch.tensor(prompts, device=dev)
                kw = dict(cache_implementation="static") if compiled else {}
                y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                pad_token_id=0, **kw)
                assert y.shape[1] == x.shape[1] + n, "transformers stopped early: the work would not be equal"
                return y[:, x.shape[1]:].tolist(), float("nan"), None, None

            decoders = {("ours plain", "eager"): lambda: ours_run(None, False),  # (decoder, mode) -> run
                        ("ours plain", "graphs"): lambda: ours_run(None, True),
                        ("ours n-gram", "eager"): lambda: ours_run(ngram, False),
                        ("ours n-gram", "graphs"): lambda: ours_run(ngram, True),
                        ("transformers generate", "eager"): lambda: hf_run(False)}
            if B in args.compiled_batches:
                decoders["transformers generate", "static cache + compile"] = lambda: hf_run(True)
            if B in args.sampled_batches:  # speculative rejection sampling (T = 0.8): the graphs' Philox noise
                decoders["ours n-gram sampled", "eager"] = lambda: ours_run(ngram, False, 0.8)
                decoders["ours n-gram sampled", "graphs"] = lambda: ours_run(ngram, True, 0.8)
            times = {k: [] for k in decoders}
            decode_rates = {k: [] for k in decoders}  # ours: tokens/s of the decode loop alone (prefill left out)
            seqs, tps = {}, {}
            for fn in decoders.values():  # warm-up: captures, compiles, autotuning, allocator pools
                fn()
            order = list(decoders)
            for r in range(args.reps):
                rot = order[r % len(order):] + order[:r % len(order)]
                for k in rot:
                    t, (seq, steps, _, decode_rate) = timed(decoders[k])
                    times[k].append(B * n / t)
                    if decode_rate:  # the steps' tokens over their seconds (the first token comes from prefill)
                        decode_rates[k].append(decode_rate)
                    seqs[k], tps[k] = seq, steps
            replay = {k: replay_profile(ours, decoders[k]) for k in decoders if k[1] == "graphs"}
            if args.kernel_profile and dev.type == "cuda" and B == args.batch[0]:
                try:  # a diagnostic: a profiler failure must not cost the benchmark's rows
                    kernel_profile(decoders["ours plain", "graphs"], Path(args.out) / f"kernels_{model_name}_b{B}.txt")
                except Exception as e:  # noqa: BLE001
                    print(f"WARNING: the kernel profile failed: {type(e).__name__}: {e}")
            ceiling = B / (step_bytes(ours, B, args.prompt_tokens + n // 2, 1) / (bw * 1e9))  # tokens/s at the ceiling
            for k, v in times.items():
                tok_s = statistics.median(v)
                same = ""
                if k[0].startswith("ours") and k[1] == "graphs" and "sampled" not in k[0]:  # sampled: other noise
                    eager_seqs = seqs[k[0], "eager"]
                    same = round(sum(a == b for a, b in zip(seqs[k], eager_seqs)) / B, 3)
                dec = statistics.median(decode_rates[k]) if decode_rates[k] else None
                rows.append(dict(shapes=shapes, decoder=k[0], mode=k[1], batch=B, tokens_per_s=round(tok_s, 1),
                                 copy_fraction=round(tok_s / ceiling, 3),
                                 decode_tokens_per_s=round(dec, 1) if dec else "",
                                 decode_copy_fraction=round(dec / ceiling, 3) if dec else "", identical=same,
                                 tokens_per_step=round(tps[k], 2) if tps[k] == tps[k] else "",
                                 **replay.get(k, dict.fromkeys(PROFILE_COLUMNS, "")), same_as_plain="",
                                 device=name, dtype=args.dtype, prompt_tokens=args.prompt_tokens, new_tokens=n,
                                 copy_gbs=round(bw, 1), runs=len(v)))
            for row in rows[-len(decoders):]:  # n-gram drafting vs plain decoding, same mode: lossless = 1.0
                if row["decoder"] == "ours n-gram":
                    got, want = seqs["ours n-gram", row["mode"]], seqs["ours plain", row["mode"]]
                    row["same_as_plain"] = round(sum(a == b for a, b in zip(got, want)) / B, 3)
                    if row["same_as_plain"] < 1:
                        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(got, want)]
                        print(f"WARNING: {shapes} batch {B} {row['mode']}: n-gram drafting's tokens differ from plain "
                              f"decoding's (first differing token per sequence: {first})")
            print_table(rows[-len(decoders):], ["shapes", "decoder", "mode", "batch", "tokens_per_s", "copy_fraction",
                                                "decode_tokens_per_s", "decode_copy_fraction", "identical", "same_as_plain", "tokens_per_step", *PROFILE_COLUMNS])
            # written after every batch size: a run stopped at its time limit keeps what it measured
            write_results(rows, args.out, f"generate_graphs_{gpu_short_name(dev)}_{datetime.date.today().isoformat()}")
        del hf, ours, ngram
        gc.collect()  # a model and its decode runner (graphs, KV buffers) refer to each other
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\ngenerate() eager vs CUDA graphs on {name}, {args.dtype}, {args.prompt_tokens}-token prompts, {n} new "
          f"tokens, medians of {args.reps} rounds (prefill included); copy ceiling {bw:.0f} GB/s measured here")
    print_table(rows, ["shapes", "decoder", "mode", "batch", "tokens_per_s", "copy_fraction", "decode_tokens_per_s",
                       "decode_copy_fraction", "identical",
                       "same_as_plain", "tokens_per_step", *PROFILE_COLUMNS])
    write_results(rows, args.out, f"generate_graphs_{gpu_short_name(dev)}_{datetime.date.today().isoformat()}",
                  lambda ax: plot_graphs(ax, rows))
    return rows


def plot_graphs(ax, rows: list[dict]) -> None:
    """tokens/s (log scale) of every decoder and mode, grouped by (shapes, batch)."""
    groups = list(dict.fromkeys((r["shapes"], int(r["batch"])) for r in rows))
    series = list(dict.fromkeys((r["decoder"], r["mode"]) for r in rows))
    width = 0.8 / len(series)
    for i, (dec, mode) in enumerate(series):
        val = {(r["shapes"], int(r["batch"])): float(r["tokens_per_s"]) for r in rows
               if (r["decoder"], r["mode"]) == (dec, mode)}
        xs = [g for g, key in enumerate(groups) if key in val]
        ax.bar([x + i * width for x in xs], [val[groups[x]] for x in xs], width, label=f"{dec} ({mode})")
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], [f"{s}\nbatch {b}" for s, b in groups], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (median, end to end)")
    ax.set_title(f"generate(): eager vs CUDA graphs, {rows[0]['device']}, {rows[0]['dtype']}", fontsize=9)
    ax.legend(fontsize=6)


def kernel_profile(run, path: Path, top: int = 25) -> None:
    """One more run under torch.profiler: the device kernels it ran (graph replays included), as launches per
    decoding step and device time per kernel name (prefill's kernels counted in: ~1 step's worth at batch 1), the `top` names by total time, printed and written to path."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps = run()[2]
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    total = sum(sum(v) for v in by_name.values())
    lines = [f"{len(kernels)} kernels in {steps} steps: {len(kernels) / max(steps, 1):.0f} a step, "
             f"{total / 1e3 / max(steps, 1):.3f} ms of kernel time a step",
             f"{'total ms':>9} {'calls/step':>10} {'us each':>8}  kernel"]
    for name, ts in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"{sum(ts) / 1e3:9.2f} {len(ts) / max(steps, 1):10.1f} {statistics.mean(ts):8.2f}  {name[:110]}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


PROFILE_COLUMNS = ["steps_replayed", "replay_ms_plain", "replay_ms_spec", "host_ms_per_step"]


def replay_profile(model, run) -> dict:
    """One more run of a graph-replayed decoder with each replay timed by device events (CUDA only):
    steps_replayed (replays over the run's steps: 1.0 = no step ran eagerly), the median replay of a plain
    and of a speculative step (ms), and host_ms_per_step, the median gap between one replay's end and the
    next one's start: the device idles while the host reads the step, runs the drafter and launches the next
    replay (the issue's "everything outside the replay")."""
    import hydra_kernels.runner as runner

    if model.device.type != "cuda":
        return dict.fromkeys(PROFILE_COLUMNS, "")
    ex = runner.runner_for(model, "graphs").executor
    ex.timed = []
    try:
        steps = run()[2]  # (sequences, mean accepted tokens, steps)
    finally:
        torch.cuda.synchronize()
        timed, ex.timed = ex.timed, None
    med = lambda xs: round(statistics.median(xs), 3) if xs else ""  # noqa: E731
    ms = {kind: [s.elapsed_time(e) for k, s, e in timed if k[0] == kind] for kind in ("plain", "spec")}
    gaps = [a[2].elapsed_time(b[1]) for a, b in zip(timed, timed[1:])]
    return dict(steps_replayed=round(len(timed) / steps, 3), replay_ms_plain=med(ms["plain"]), replay_ms_spec=med(ms["spec"]),
                host_ms_per_step=med(gaps))


if __name__ == "__main__":
    main()
