"""The drafter families side by side: the one results table (MT-Bench's 80 first turns, greedy).

Same model (the embedded SmolLM2-135M-Instruct, fp32, this machine's CPU), same prompts, one run:
- tokens per step and lossless count: every decoder on all --mtbench prompts, batched (--batch), greedy,
  --new-tokens, each drafter's whole tree every step (its budget table, which at batch 8 picks plain steps,
  off); tokens/step = tokens emitted per verify forward per sequence; identical = outputs equal
  to our plain greedy decoding token for token. EAGLE is also run at the larger dynamic trees of
  --eagle-budgets (what a GPU affords; measured, not replayed).
- tokens/s at batch 1 on every 8th prompt (--batch1-every; 8: all 8 categories), interleaved: each prompt through every
  decoder back to back, the order rotating; new tokens / wall time of the whole call. Drafting ms per
  step: the drafter's propose() timed inside those runs (what a step spends before the verify forward).
- transformers' generate (and its prompt lookup) on the same batch-1 prompts, as the outside peers.
- --search: the dynamic tree (total_tokens, depth, top_k) that decodes fastest here, by real decoding
  of --search-prompts held-out ShareGPT turns at batch 1, written as dynamic_cpu.json into --eagle.

Rows: every shipped kind (--kinds: some), n-gram, and the combined drafter (the shipped composition: n-gram + the default heads, hk.load_drafter(kind="combined")).

    python benchmarks/bench_drafters.py --eagle runs/eagle/eagle [--search] [--new-tokens 256] [--kinds K ...] [--out DIR]
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import logging
import platform
import statistics
import time
from pathlib import Path

import torch
from report import write_results
from tqdm.auto import tqdm

import hydra_kernels as hk
from hydra_kernels.budget import whole_tree_budget
from hydra_kernels.chat import chat_prompt_ids
from hydra_kernels.drafters.eagle import DynamicTree
from hydra_kernels.drafters.registry import default_heads_kind
from hydra_kernels.generate import generate
from hydra_kernels.training import mtbench_questions
from hydra_kernels.training.data import heldout_chat_prompts
from hydra_kernels.training.tree_search import search_dynamic_tree

FAMILY_ORDER = ("medusa", "hydra", "hydra++", "mlp_speculator", "amphista")  # the shipped kinds' rows in this order


class ProposeTimer:
    """Wraps drafter.propose to accumulate its wall time and call count."""

    def __init__(self, drafter):
        self.drafter, self.seconds, self.calls = drafter, 0.0, 0
        self.inner = drafter.propose

        def timed(*a, **k):
            t = time.perf_counter()
            r = self.inner(*a, **k)
            self.seconds += time.perf_counter() - t
            self.calls += 1
            return r

        drafter.propose = timed

    def ms_per_step(self) -> float:
        return 1e3 * self.seconds / max(1, self.calls)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eagle", default=None, help="an EAGLE drafter dir (default: the shipped one, if any)")
    ap.add_argument("--extra", nargs="*", default=[], help="more drafter dirs to compare (any family)")
    ap.add_argument("--mtbench", type=int, default=80)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--eagle-budgets", nargs="*", type=int, default=[16, 32, 64])
    ap.add_argument("--search", action="store_true")
    ap.add_argument("--search-prompts", type=int, default=6)
    ap.add_argument("--search-tokens", type=int, default=128)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--skip-steps", action="store_true", help="only the batch-1 timing (tokens/step from an earlier run)")
    ap.add_argument("--kinds", nargs="*", default=None, help="shipped kinds to run (default: all; none: only n-gram, "
                    "combined and the peers)")
    ap.add_argument("--batch1-every", type=int, default=8, help="time every Nth prompt at batch 1 (8: all 8 categories)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    shipped = hk.drafters.shipped_drafters()
    if args.kinds is not None and set(args.kinds) - set(shipped):
        ap.error(f"--kinds {sorted(set(args.kinds) - set(shipped))} not shipped; shipped: {sorted(shipped)}")
    if args.batch1_every < 1:
        ap.error("--batch1-every must be >= 1")
    torch.set_grad_enabled(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = hk.load_model(dtype=torch.float32)
    prompts = [chat_prompt_ids(tok, q["turns"][0]) for q in mtbench_questions()[: args.mtbench]]
    n = args.new_tokens

    drafters: dict[str, tuple] = {}  # name -> (drafter, tree)

    def add_small_speculator(d):  # an MLPSpeculator also at a CPU-sized budget: 2 candidates, top-k 2 then 1
        small = copy.deepcopy(d)
        ks = [2] + [1] * (d.config.n_predict - 1)
        small.config = dataclasses.replace(d.config, top_k_tokens_per_head=ks, n_candidates=2)
        drafters[f"mlp_speculator (2 candidates, top-k {'/'.join(map(str, ks))})"] = (small, None)

    for kind in sorted(shipped, key=lambda k: (FAMILY_ORDER.index(k) if k in FAMILY_ORDER else len(FAMILY_ORDER), k)):
        if args.kinds is not None and kind not in args.kinds:
            continue
        if kind != "eagle":  # below, with its dynamic tree
            drafters[kind] = (hk.load_drafter(kind=kind, model=model), None)
            if kind == "mlp_speculator":
                add_small_speculator(drafters[kind][0])
    eagle_dir = args.eagle or (shipped.get("eagle") if args.kinds is None or "eagle" in args.kinds else None)
    eagle = None
    if eagle_dir is not None:
        eagle = hk.load_drafter(eagle_dir, model=model)
        if args.search:
            best, rows = search_dynamic_tree(model, eagle, heldout_chat_prompts(tok, args.search_prompts), args.search_tokens)
            write_results(rows, out, "eagle_tree_search")
            print("dynamic tree search (tokens/s):", *(f"{r['total_tokens']}/{r['depth']}/{r['top_k']}: "
                                                       f"{r['tokens_per_s']:.1f} ({r['tokens_per_step']:.2f}/step)" for r in rows))
            (Path(eagle_dir) / "dynamic_cpu.json").write_text(json.dumps(best.__dict__))
        cpu_tree = eagle.resolve_tree(None, "cpu").dynamic
        drafters[f"eagle ({cpu_tree.total_tokens}/{cpu_tree.depth}/{cpu_tree.top_k})"] = (eagle, cpu_tree)
    for path in args.extra:
        d = hk.load_drafter(path, model=model)
        tree = None
        if getattr(d, "trees", None) is not None and "cpu" not in d.trees and "hydra" in drafters:
            tree = drafters["hydra"][0].trees.get("cpu")  # no searched tree: the shipped Hydra heads' CPU tree
        name = f"{d.kind}" + (f" ({tree.num_nodes}-node Hydra tree)" if tree is not None else "")
        if name in drafters:  # a shipped drafter of the same kind is in the table already
            name = f"{name} ({path})"
        drafters[name] = (d, tree)
        if d.kind == "mlp_speculator" and "mlp_speculator" not in shipped:
            add_small_speculator(d)
    drafters["ngram"] = (hk.new_drafter(model, kind="ngram"), None)
    if shipped:  # n-gram chains beside the default heads' tree, in one verify: the shipped composition
        drafters[f"combined (ngram + {default_heads_kind()})"] = (hk.load_drafter(kind="combined", model=model), None)

    # 1. tokens per step and lossless count, batched
    def batched(drafter=None, tree=None):
        seqs, acc = [], []
        for i in range(0, len(prompts), args.batch):
            budget = None if drafter is None else whole_tree_budget(drafter, tree, model.device.type)
            o = generate(model, prompts[i:i + args.batch], drafter=drafter, tree=tree, max_new_tokens=n, budget=budget)
            seqs += o.sequences
            acc += o.accept_lengths
        return seqs, sum(map(sum, acc)) / max(1, sum(map(len, acc)))

    summary = {}
    runs = [] if args.skip_steps else list(drafters.items())
    plain = [] if args.skip_steps else batched()[0]
    if eagle is not None and not args.skip_steps:
        runs += [(f"eagle (budget {b})", (eagle, DynamicTree(b, min(8, b - 1), 8 if b >= 32 else 4)))
                 for b in args.eagle_budgets]
    for name, (d, tree) in tqdm(runs, desc="tokens/step, all prompts"):
        seqs, tps = batched(d, tree)
        summary[name] = {"tokens_per_step": tps, "identical": sum(a == b for a, b in zip(seqs, plain))}
        print(f"{name}: {tps:.2f} tokens/step, identical {summary[name]['identical']}/{len(prompts)}")

    # 2. tokens/s at batch 1, interleaved
    sub = prompts[::args.batch1_every]
    decoders = {"plain": lambda p: generate(model, [p], max_new_tokens=n).sequences[0]}
    timers = {}
    for name, (d, tree) in drafters.items():
        timers[name] = ProposeTimer(d)
        decoders[name] = lambda p, d=d, tree=tree: generate(model, [p], drafter=d, tree=tree, max_new_tokens=n).sequences[0]
    if not args.no_transformers:
        logging.getLogger("transformers").setLevel(logging.ERROR)
        from transformers import LlamaForCausalLM

        from hydra_kernels.model import embedded_gguf_path

        gguf = embedded_gguf_path()
        hf = LlamaForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
        eos = model.config.eos_token_id
        decoders["transformers generate"] = lambda p: hf.generate(
            torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=eos)[0, len(p):].tolist()
        decoders["transformers prompt lookup"] = lambda p: hf.generate(
            torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
            prompt_lookup_num_tokens=10)[0, len(p):].tolist()
    names = list(decoders)
    for name in names:
        decoders[name](sub[0][:64])  # warm-up
    for t in timers.values():
        t.seconds, t.calls = 0.0, 0
    toks = {k: [] for k in names}
    secs = {k: [] for k in names}
    for i, p in enumerate(tqdm(sub, desc="tokens/s, batch 1, interleaved")):
        for name in itertools.islice(itertools.cycle(names), i % len(names), i % len(names) + len(names)):
            t0 = time.perf_counter()
            toks[name].append(len(decoders[name](p)))
            secs[name].append(time.perf_counter() - t0)
    rows = []
    plain_tps = sum(toks["plain"]) / sum(secs["plain"])
    for name in names:
        tps = sum(toks[name]) / sum(secs[name])
        ratios = [(toks[name][i] / secs[name][i]) / (toks["plain"][i] / secs["plain"][i]) for i in range(len(sub))]
        s = summary.get(name, {})
        rows.append({"decoding": name, "tokens_per_step": s.get("tokens_per_step", 1.0 if name == "plain" else None),
                     "tokens_per_s": tps, "vs_plain": tps / plain_tps, "median_vs_plain": statistics.median(ratios),
                     "draft_ms_per_step": timers[name].ms_per_step() if name in timers else None,
                     "identical": f"{s['identical']}/{len(prompts)}" if s else ("definition" if name == "plain" else "-")})
    for name in summary:
        if name not in decoders:
            rows.append({"decoding": name, "tokens_per_step": summary[name]["tokens_per_step"], "tokens_per_s": None,
                         "vs_plain": None, "median_vs_plain": None, "draft_ms_per_step": None,
                         "identical": f"{summary[name]['identical']}/{len(prompts)}"})

    def plot(ax):
        r = [x for x in rows if x["tokens_per_s"]]
        ax.barh([x["decoding"] for x in r], [x["tokens_per_s"] for x in r])
        ax.set_xlabel(f"tokens/s, batch 1, {len(sub)} MT-Bench prompts x {n} new tokens")
        ax.set_title("drafters on SmolLM2-135M-Instruct, this CPU")

    write_results(rows, out, "drafters", plot)
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    head = (f"SmolLM2-135M-Instruct fp32, {platform.processor() or platform.machine()} CPU, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}; MT-Bench first turns, greedy, {n} new tokens")
    lines = [head, "", f"| decoding | tokens/step ({len(prompts)} prompts) | tokens/s (batch 1, {len(sub)} prompts) | "
             "vs plain | median vs plain | draft ms/step | identical to plain |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['decoding']} | {fmt(r['tokens_per_step'], '.2f')} | {fmt(r['tokens_per_s'], '.1f')} | "
                     f"{fmt(r['vs_plain'], '.2f')} | {fmt(r['median_vs_plain'], '.2f')} | "
                     f"{fmt(r['draft_ms_per_step'], '.2f')} | {r['identical']} |")
    (out / "drafters.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
