"""Recipe: tree search and MT-Bench evaluation of trained heads (Medusa / Hydra / Hydra++) on this CPU.

    .venv/bin/python python/eval_heads.py [--heads runs/heads] [--out runs/eval]

1. Held-out text for tree search: ShareGPT held-out first user turns, answered greedily by the base
   model (speculative decoding, lossless); per kind, ranks of the base model's tokens in each head.
2. Tree search per kind (grow one node at a time by expected acceptance), then real decoding timed at
   each size with the best kind: the fastest size is kept (throughput and tokens/step vs size: plot).
3. MT-Bench's 80 first turns, greedy, --new-tokens: plain decoding and every kind (its own searched tree
   of the chosen size), in batches: tokens per step, and each output compared with plain decoding
   token for token (lossless on all 80); per-head top-1/5/10 accuracy on the plain answers (plot).
   Larger trees (--replay-sizes, the sizes a GPU affords) are not decoded here: their tokens/step on
   the same 80 answers is replayed from the heads' ranks (tree_search.replay_accept_lengths, equal to
   real decoding step by step; the kept size is both measured and replayed, as a check) (plot).
4. Tokens/s, batch 1, on a fixed subset of the 80 (every 8th question: all 8 categories), in one run,
   interleaved (each prompt through every decoder back to back, order rotated per prompt): plain (packed
   kernel and MKL), each kind, and transformers' generate as the outside baseline.
Writes CSVs + plots + results.md (the README table) under --out, and tree_cpu.json into each kind's dir.
--replay-only stops after 3's replay and accuracy (no decoding runs with heads, no timing): comparing heads
in minutes.
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import hydra_kernels as hk  # noqa: E402
from hydra_kernels.chat import chat_prompt_ids  # noqa: E402
from hydra_kernels.generate import generate  # noqa: E402
from hydra_kernels.model.packed_linear import packed_kernel_off  # noqa: E402
from hydra_kernels.training import mtbench_questions, sharegpt_records  # noqa: E402
from hydra_kernels.training.data import conversation_messages, is_heldout  # noqa: E402
from hydra_kernels.training.evaluate import head_ranks, split_ranks, topk_accuracy  # noqa: E402
from hydra_kernels.training.tree_search import grow_tree, replay_accept_lengths, time_tree_sizes  # noqa: E402
from report import write_results  # noqa: E402

KINDS = ["medusa", "hydra", "hydra++"]


def heldout_prompts(tok, n: int) -> list[list[int]]:
    out = []
    for rec in sharegpt_records():
        if not is_heldout(rec, 5):
            continue
        msgs = conversation_messages(rec)
        if msgs and len(msgs[0]["content"]) < 2000:
            out.append(chat_prompt_ids(tok, msgs[0]["content"]))
            if len(out) == n:
                return out
    return out


def batched(model, prompts, bs, **kw):
    seqs, acc = [], []
    for i in tqdm(range(0, len(prompts), bs), desc=kw.get("drafter") and kw["drafter"].kind or "plain", leave=False):
        o = generate(model, prompts[i:i + bs], **kw)
        seqs += o.sequences
        acc += o.accept_lengths
    return seqs, acc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="runs/heads")
    ap.add_argument("--kinds", nargs="+", default=KINDS)
    ap.add_argument("--out", default="runs/eval")
    ap.add_argument("--heldout", type=int, default=48,
                    help="held-out ShareGPT prompts for tree search (16, the shipped trees' count, left the "
                         "4-node choice to a few positions: see the README)")
    ap.add_argument("--heldout-tokens", type=int, default=128)
    ap.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32])
    ap.add_argument("--time-prompts", type=int, default=4, help="held-out prompts timed per tree size")
    ap.add_argument("--size", type=int, default=None, help="skip timing; use this tree size")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="batch for the 80-prompt acceptance/lossless runs")
    ap.add_argument("--questions", type=int, default=80, help="MT-Bench first turns used (fewer: a smoke run)")
    ap.add_argument("--subset-every", type=int, default=8, help="tokens/s on every n-th question")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--replay-only", action="store_true",
                    help="tokens/step by tree size replayed from head ranks and per-head accuracy only: no "
                         "speculative decoding runs (so no lossless check) and no timing (a quick comparison of heads)")
    ap.add_argument("--replay-sizes", nargs="+", type=int, default=[2, 8, 16, 32, 64, 128],
                    help="tree sizes whose MT-Bench tokens/step is replayed from head ranks (no decoding)")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = hk.load_model(device="cpu", dtype=torch.float32)
    drafters = {k: hk.load_drafter(Path(args.heads) / k, model=model) for k in args.kinds}

    # 1. held-out greedy text and ranks
    hp = heldout_prompts(tok, args.heldout)
    print(f"{len(hp)} held-out prompts; answering them greedily")
    ans, _ = batched(model, hp, args.batch, max_new_tokens=args.heldout_tokens)
    seqs = [p + a for p, a in zip(hp, ans)]
    ranks = {k: head_ranks(model, d, seqs, [len(p) - 1 for p in hp]) for k, d in drafters.items()}
    expect16 = {k: grow_tree(r, 16, max_depth=drafters[k].num_heads)[1][-1] for k, r in ranks.items()}
    best_kind = max(expect16, key=expect16.get)  # the kind whose 16-node tree accepts most on held-out text
    print("expected tokens/step with a 16-node tree on held-out text:", expect16, "-> timing trees with", best_kind)

    # 2. tree search: sizes timed with the best kind
    if args.size is None:
        rows = time_tree_sizes(model, drafters[best_kind], ranks[best_kind], args.sizes, hp[: args.time_prompts])
        for r in rows:
            r["kind"] = best_kind
        spec = [r for r in rows if r["size"] > 1]
        size = max(spec, key=lambda r: r["tokens_per_s"])["size"]  # the fastest real tree
        if rows[0]["size"] == 1 and rows[0]["tokens_per_s"] >= max(r["tokens_per_s"] for r in spec):
            print(f"note: plain decoding ({rows[0]['tokens_per_s']:.1f} tok/s) beats every tree on this device; "
                  f"evaluating with the fastest tree ({size} nodes) anyway")

        def plot_sizes(ax):
            ax.plot([r["size"] for r in rows], [r["tokens_per_s"] for r in rows], "o-", label="tokens/s (measured)")
            ax2 = ax.twinx()
            ax2.plot([r["size"] for r in rows], [r["tokens_per_step"] for r in rows], "s--", color="C1",
                     label="tokens/step (measured)")
            ax2.plot([r["size"] for r in rows], [r["expected_tokens_per_step"] for r in rows], "^:", color="C2",
                     label="tokens/step (expected)")
            ax.set_xlabel("tree size (nodes, root included)")
            ax.set_ylabel("tokens/s")
            ax2.set_ylabel("tokens/step")
            ax.set_title(f"{best_kind} heads, SmolLM2-135M fp32, CPU ({torch.get_num_threads()} threads)", fontsize=9)
            ax.legend(loc="upper left", fontsize=7)
            ax2.legend(loc="lower right", fontsize=7)

        write_results(rows, out, "tree_sizes", plot_sizes)
    else:
        size = args.size
    print(f"tree size kept: {size}")
    trees = {k: grow_tree(ranks[k], size, max_depth=drafters[k].num_heads)[0] for k in drafters}
    for k, t in trees.items():
        t.save(Path(args.heads) / k / "tree_cpu.json")
        print(k, "tree", t.choices)

    # 3. MT-Bench 80: tokens/step, lossless, per-head accuracy
    qs = mtbench_questions()[: args.questions]
    prompts = [chat_prompt_ids(tok, q["turns"][0]) for q in qs]
    n = args.new_tokens
    plain, _ = batched(model, prompts, args.batch, max_new_tokens=n)
    (out / "mtbench_plain.json").write_text(json.dumps(plain))
    summary, acc_rows, replay_rows = {}, [], []
    for k, d in drafters.items():
        summary[k] = {}
        if not args.replay_only:
            seqs_k, acc = batched(model, prompts, args.batch, drafter=d, tree=trees[k], max_new_tokens=n)
            same = sum(a == b for a, b in zip(seqs_k, plain))
            steps = sum(len(a) for a in acc)
            summary[k] = {"tokens_per_step": sum(map(sum, acc)) / max(1, steps), "lossless": f"{same}/{len(plain)}"}
        full, starts = [p + a for p, a in zip(prompts, plain)], [len(p) - 1 for p in prompts]
        r = head_ranks(model, d, full, starts)
        for row in topk_accuracy(r):
            acc_rows.append({"kind": k, **row})
        # replay: tokens/step of larger trees (grown on held-out text, as the real ones) on the same 80
        # answers, from these ranks; the real tree's replay must match its measured run (printed)
        blocks = split_ranks(r, full, starts)
        for s in sorted({size, *args.replay_sizes}):
            tree_s = trees[k] if s == size else grow_tree(ranks[k], s, max_depth=d.num_heads)[0]
            acc_s = [replay_accept_lengths(b, len(a), tree_s) for b, a in zip(blocks, plain)]
            tps = sum(map(sum, acc_s)) / sum(map(len, acc_s))
            replay_rows.append({"kind": k, "size": s, "tokens_per_step": tps,
                                "measured": summary[k].get("tokens_per_step", "") if s == size else ""})
            if s == size:
                summary[k]["replayed"] = tps
        print(k, summary[k])

    def plot_acc(ax):
        for k in drafters:
            rr = [r for r in acc_rows if r["kind"] == k]
            ax.plot([r["head"] for r in rr], [r["top1"] for r in rr], "o-", label=f"{k} top-1")
            ax.plot([r["head"] for r in rr], [r["top5"] for r in rr], "s:", label=f"{k} top-5")
        ax.set_xlabel("head (tokens ahead of the root)")
        ax.set_ylabel("accuracy on MT-Bench answers")
        ax.set_title(f"per-head accuracy, SmolLM2-135M greedy answers, {len(prompts)} MT-Bench first turns", fontsize=8)
        ax.legend(fontsize=6)

    write_results(acc_rows, out, "head_accuracy", plot_acc)

    def plot_replay(ax):
        for k in drafters:
            rr = [r for r in replay_rows if r["kind"] == k]
            ax.plot([r["size"] for r in rr], [r["tokens_per_step"] for r in rr], "o-", label=k)
        ax.axvline(size, color="gray", ls=":", label=f"CPU tree ({size} nodes)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree size (nodes, root included; grown on held-out text)")
        ax.set_ylabel("tokens/step (replayed from head ranks)")
        ax.set_title(f"tokens/step vs tree size, {len(prompts)} MT-Bench first turns, greedy, {n} new tokens",
                     fontsize=8)
        ax.legend(fontsize=7)

    write_results(replay_rows, out, "mtbench_tree_sizes", plot_replay)
    sizes = sorted({r["size"] for r in replay_rows})

    def replay_table(measured: bool) -> list[str]:
        lines = ["| kind | " + " | ".join(f"{s} nodes" for s in sizes) + " |", "|---|" + "---|" * len(sizes)]
        for k in drafters:
            by = {r["size"]: r["tokens_per_step"] for r in replay_rows if r["kind"] == k}
            lines.append(f"| {k} | " + " | ".join(f"{summary[k]['tokens_per_step']:.2f} / {by[s]:.2f}"
                                                  if measured and s == size else f"{by[s]:.2f}" for s in sizes) + " |")
        return lines

    if args.replay_only:
        lines = [f"SmolLM2-135M-Instruct fp32; MT-Bench first turns ({len(prompts)}), greedy, {n} new tokens; "
                 f"tokens/step replayed from head ranks (no speculative decoding run, no timing); trees grown on "
                 f"held-out ShareGPT text", ""] + replay_table(measured=False)
        (out / "results.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return

    # 4. tokens/s at batch 1 on the subset. Interleaved: each prompt is decoded by every decoder back to
    # back, the order rotated from prompt to prompt, so a drift in the machine's speed (this shared 2-core
    # VM swings up to 2x between minutes) hits all decoders alike. Per decoder: all tokens / all time, and
    # the median over prompts of its tokens/s relative to plain decoding on the same prompt.
    sub = prompts[:: args.subset_every]
    decoders = {"plain (ours, default: packed kernel)": lambda p, m=n: generate(model, [p], max_new_tokens=m).sequences[0]}
    if model.has_packed_weights:
        # the same plain decoding on MKL with input-major weights (the layout without the packed kernel),
        # for comparison: the packed kernel must not be slower at M = 1
        def plain_mkl(p, m=n):
            with packed_kernel_off(model):
                return generate(model, [p], max_new_tokens=m).sequences[0]

        decoders["plain (ours, MKL input-major weights)"] = plain_mkl
    for k, d in drafters.items():
        decoders[k] = lambda p, m=n, d=d, k=k: generate(model, [p], drafter=d, tree=trees[k], max_new_tokens=m).sequences[0]
    if not args.no_transformers:
        logging.getLogger("transformers").setLevel(logging.ERROR)
        from transformers import LlamaForCausalLM

        from hydra_kernels.model import embedded_gguf_path

        gguf = embedded_gguf_path()
        hf = LlamaForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
        eos = model.config.eos_token_id
        decoders["transformers generate"] = lambda p, m=n: hf.generate(
            torch.tensor([p]), max_new_tokens=m, do_sample=False, eos_token_id=eos)[0, len(p):].tolist()
    names = list(decoders)
    for name in names:
        decoders[name](sub[0], 16)  # warm-up (first-call dispatch, buffers)
    toks = {k: [] for k in names}
    secs = {k: [] for k in names}
    for i, p in enumerate(tqdm(sub, desc="timing, all decoders per prompt")):
        for name in names[i % len(names):] + names[: i % len(names)]:
            t0 = time.perf_counter()
            toks[name].append(len(decoders[name](p)))
            secs[name].append(time.perf_counter() - t0)
    plain_name = names[0]
    per_prompt = {k: [toks[k][i] / secs[k][i] for i in range(len(sub))] for k in names}
    results = []
    for k in names:
        row = {"decoding": k, "tokens_per_step": summary[k]["tokens_per_step"] if k in summary else 1.0,
               "tokens_per_s": sum(toks[k]) / sum(secs[k]),
               "lossless_80": summary[k]["lossless"] if k in summary else ("definition" if k == plain_name else "-"),
               "median_ratio_vs_plain": statistics.median(a / b for a, b in zip(per_prompt[k], per_prompt[plain_name]))}
        results.append(row)
    plain_tps = results[0]["tokens_per_s"]
    for r in results:
        r["speedup_vs_plain"] = r["tokens_per_s"] / plain_tps
    write_results(results, out, "results")
    head = (f"SmolLM2-135M-Instruct fp32, {platform.machine()} CPU, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}; MT-Bench first turns, greedy, {n} new tokens; tree size {size}")
    lines = [head, "", f"| decoding | tokens/step ({len(prompts)} prompts) | tokens/s (batch 1, {len(sub)} prompts, interleaved) | "
             f"vs plain (all tokens / all time) | vs plain (median per prompt) | identical to plain ({len(prompts)}) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['decoding']} | {r['tokens_per_step']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup_vs_plain']:.2f}x | {r['median_ratio_vs_plain']:.2f}x | {r['lossless_80']} |")
    lines += ["", f"Tokens/step on the same {len(prompts)} answers by tree size (trees grown on held-out ShareGPT text), "
              f"replayed from head ranks; the {size}-node tree above measured / replayed:", ""] + replay_table(measured=True)
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
