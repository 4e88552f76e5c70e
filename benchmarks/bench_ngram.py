"""Training-free drafting beside its peers, one interleaved run, same model (the embedded SmolLM2-135M-
Instruct, fp32, this machine's CPU) and the same prompts: plain decoding, transformers' generate and its
prompt lookup (prompt_lookup_num_tokens=10), our shipped Hydra heads, our n-gram drafter, the combined
drafter (n-gram + Hydra in one tree), and lookahead when the kind exists.

Prompt sets
- MT-Bench's 80 first turns, reported per category (coding and extraction are where lookup pays).
- "editing": ShareGPT user turns that quote a text to transform, built by this rule: held-out records
  (hydra_kernels.training.data.is_heldout, 5%: the shipped heads never trained on them), first user
  turn of 300-3000 characters whose longest paragraph (split on newlines) is >= 200 characters (the
  quoted passage) and which, outside that paragraph, names an edit: rewrite, rephrase, paraphrase,
  proofread, correct, fix, edit, improve, convert, reformat, format, summarise / summarize, summary,
  shorten; at most 1024 tokens with the chat template. The first --editing such turns in file order.

Figures
- tokens per step on every prompt: ours = tokens emitted per verify forward after the prefill (batched
  runs of --batch, EOS ends a sequence); transformers = new tokens / forwards of its model (a forward
  hook counts them; prompt lookup verifies its first draft in the prefill forward, so that forward
  counts as a step), batch 1 (its prompt lookup takes no batch).
- tokens/s on --timed prompts (half from each set, spread over MT-Bench's categories), batch 1, every
  peer on a prompt before the next prompt, the peers' order rotating: new tokens / wall time of the
  whole call (prefill included on both sides).
- identical: share of prompts whose output equals our plain greedy decoding's token for token.
Writes ngram_steps.csv, ngram_speed.csv, ngram.md and ngram_steps.png to --out.

    python benchmarks/bench_ngram.py [--max-new-tokens 64] [--mtbench 80] [--editing 24] [--timed 8] \
        [--batch 8] [--node-budget N] [--combined-min-ngram 1] [--out benchmarks/results]
Default size: about 8 minutes on the 2-core dev CPU when run alone.
"""
from __future__ import annotations

import argparse
import logging
import platform
import re
import time
from collections import defaultdict

import torch
from report import print_table, write_results

EDIT_WORDS = re.compile(r"\b(rewrite|re-write|rephrase|paraphrase|proofread|correct|fix|edit|improve|convert|"
                        r"reformat|format|summari[sz]e|summary|shorten)\b", re.I)


def editing_prompts(tok, n: int) -> list[list[int]]:
    """The first n ShareGPT turns that pass the rule in the module docstring, as chat prompt ids."""
    from hydra_kernels.chat import chat_prompt_ids
    from hydra_kernels.training.data import conversation_messages, is_heldout, sharegpt_records

    out = []
    for rec in sharegpt_records():
        if len(out) == n:
            break
        if not is_heldout(rec, 5):
            continue
        msgs = conversation_messages(rec)
        if not msgs or not 300 <= len(msgs[0]["content"]) <= 3000:
            continue
        text = msgs[0]["content"]
        passage = max(text.split("\n"), key=len)
        if len(passage) < 200 or not EDIT_WORDS.search(text.replace(passage, " ")):
            continue
        ids = chat_prompt_ids(tok, text)
        if len(ids) <= 1024:
            out.append(ids)
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--mtbench", type=int, default=80, help="MT-Bench first turns (all 80 by default)")
    ap.add_argument("--editing", type=int, default=24, help="editing / summarisation prompts from ShareGPT")
    ap.add_argument("--timed", type=int, default=8, help="prompts timed interleaved at batch 1")
    ap.add_argument("--batch", type=int, default=8, help="batch of our tokens-per-step runs")
    ap.add_argument("--node-budget", type=int, default=None, help="the combined drafter's node budget")
    ap.add_argument("--combined-min-ngram", type=int, default=1, help="min_ngram of the combined drafter's n-gram part")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_grad_enabled(False)

    import hydra_kernels as hk
    from hydra_kernels.chat import chat_prompt_ids
    from hydra_kernels.drafters import KINDS
    from hydra_kernels.generate import generate
    from hydra_kernels.model import embedded_gguf_path
    from hydra_kernels.training.data import mtbench_questions
    from tqdm.auto import tqdm
    from transformers import LlamaForCausalLM

    model, tok = hk.load_model(device="cpu")
    gguf = embedded_gguf_path()
    hf = LlamaForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    hf_calls = [0]
    hf.register_forward_hook(lambda *a: hf_calls.__setitem__(0, hf_calls[0] + 1))
    eos = model.config.eos_token_ids
    N = args.max_new_tokens

    qs = mtbench_questions()[: args.mtbench]
    prompts = [(q["category"], chat_prompt_ids(tok, q["turns"][0])) for q in qs]
    prompts += [("editing", ids) for ids in editing_prompts(tok, args.editing)]
    print(f"{len(qs)} MT-Bench prompts, {sum(c == 'editing' for c, _ in prompts)} editing prompts")

    shipped = hk.load_drafter(model=model, kind="hydra")
    parts = [hk.new_drafter(model, kind="ngram", min_ngram=args.combined_min_ngram), shipped]
    drafters = {"hydra (shipped)": shipped, "ngram": hk.new_drafter(model, kind="ngram"),
                "combined": hk.new_drafter(model, kind="combined", drafters=parts, node_budget=args.node_budget)}
    if "lookahead" in KINDS:
        drafters["lookahead"] = hk.new_drafter(model, kind="lookahead")
    ours = {"plain": None, **drafters}

    def run_ours(d, ids_list):
        return generate(model, ids_list, drafter=d, max_new_tokens=N, eos_token_id=eos)

    def run_hf(ids, lookup: bool):
        hf_calls[0] = 0
        extra = {"prompt_lookup_num_tokens": 10} if lookup else {}
        out = hf.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False, eos_token_id=eos,
                          pad_token_id=eos[0], **extra)
        return out[0, len(ids):].tolist(), hf_calls[0]

    # ---- tokens per step on every prompt ------------------------------------------------------
    seqs: dict[str, list[list[int]]] = {}
    per = defaultdict(lambda: [0, 0])  # (peer, category) -> [tokens, steps]
    for name, d in tqdm(ours.items(), desc="ours, batched"):
        seqs[name] = []
        for i in range(0, len(prompts), args.batch):
            chunk = prompts[i:i + args.batch]
            out = run_ours(d, [ids for _, ids in chunk])
            seqs[name] += out.sequences
            for (cat, _), acc in zip(chunk, out.accept_lengths):
                per[name, cat][0] += sum(acc)
                per[name, cat][1] += len(acc)
    for name, lookup in (("transformers generate", False), ("transformers prompt lookup", True)):
        seqs[name] = []
        for cat, ids in tqdm(prompts, desc=name):
            new, calls = run_hf(ids, lookup)
            seqs[name].append(new)
            per[name, cat][0] += len(new)
            per[name, cat][1] += calls
    cats = list(dict.fromkeys(c for c, _ in prompts))
    step_rows = []
    for name in seqs:
        same = [a == b for a, b in zip(seqs[name], seqs["plain"])]
        for group in cats + ["mt-bench", "all"]:
            members = [c for c in cats if group in (c, "all") or (group == "mt-bench" and c != "editing")]
            tokens, steps = (sum(per[name, c][k] for c in members) for k in (0, 1))
            idx = [j for j, (c, _) in enumerate(prompts) if c in members]
            step_rows.append(dict(peer=name, prompts=group, n=len(idx), tokens_per_step=tokens / max(steps, 1),
                                  identical=sum(same[j] for j in idx) / max(len(idx), 1)))

    # ---- tokens/s, interleaved, batch 1 -------------------------------------------------------
    mt_idx = [j for j, (c, _) in enumerate(prompts) if c != "editing"]
    ed_idx = [j for j, (c, _) in enumerate(prompts) if c == "editing"]
    half = args.timed // 2
    timed = mt_idx[:: max(1, len(mt_idx) // max(half, 1))][:half] + ed_idx[: args.timed - half]
    peers = [*ours, "transformers generate", "transformers prompt lookup"]

    def call(name, ids):
        t = time.perf_counter()
        if name in ours:
            new = run_ours(ours[name], [ids]).sequences[0]
        else:
            new, _ = run_hf(ids, name.endswith("lookup"))
        return len(new), time.perf_counter() - t

    for name in peers:  # warm-up: first-call dispatch, allocator, packed weights
        call(name, prompts[0][1][:32])
    tot = defaultdict(lambda: [0, 0.0])  # (peer, set) -> [tokens, seconds]
    for r, j in enumerate(tqdm(timed, desc="timed, interleaved")):
        group = "editing" if prompts[j][0] == "editing" else "mt-bench"
        for name in peers[r % len(peers):] + peers[: r % len(peers)]:
            n, s = call(name, prompts[j][1])
            for g in (group, "all"):
                tot[name, g][0] += n
                tot[name, g][1] += s
    speed_rows = []
    for name in peers:
        for g in ("mt-bench", "editing", "all"):
            if tot[name, g][1]:
                tps = tot[name, g][0] / tot[name, g][1]
                speed_rows.append(dict(peer=name, prompts=g, tok_s=tps,
                                       speedup_vs_plain=tps / (tot["plain", g][0] / tot["plain", g][1])))

    print(f"\nSmolLM2-135M-Instruct fp32, {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, up to {N} new tokens, EOS ends")
    print_table(step_rows, ["peer", "prompts", "n", "tokens_per_step", "identical"])
    print_table(speed_rows, ["peer", "prompts", "tok_s", "speedup_vs_plain"])
    from pathlib import Path

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = ["| peer | " + " | ".join(cats + ["mt-bench", "all"]) + " |", "|---" * (len(cats) + 3) + "|"]
    for name in seqs:
        vals = {r["prompts"]: r["tokens_per_step"] for r in step_rows if r["peer"] == name}
        md.append(f"| {name} | " + " | ".join(f"{vals[c]:.2f}" for c in cats + ["mt-bench", "all"]) + " |")
    md += ["", "| peer | prompts | tok/s | speedup vs plain |", "|---|---|---|---|"]
    md += [f"| {r['peer']} | {r['prompts']} | {r['tok_s']:.1f} | {r['speedup_vs_plain']:.2f} |" for r in speed_rows]
    (out_dir / "ngram.md").write_text("tokens per step (rows: peers; columns: prompt sets)\n\n" + "\n".join(md) + "\n")

    def plot(ax):
        groups = cats + ["mt-bench", "all"]
        w = 0.8 / len(seqs)
        for k, name in enumerate(seqs):
            vals = {r["prompts"]: r["tokens_per_step"] for r in step_rows if r["peer"] == name}
            ax.bar([g + k * w for g in range(len(groups))], [vals[c] for c in groups], w, label=name)
        ax.set_xticks([g + 0.4 - w / 2 for g in range(len(groups))], groups, rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("tokens per step")
        ax.set_title(f"SmolLM2-135M, CPU, up to {N} new tokens", fontsize=9)
        ax.legend(fontsize=6)

    write_results(speed_rows, out_dir, "ngram_speed")
    write_results(step_rows, out_dir, "ngram_steps", plot)
    return step_rows + speed_rows


if __name__ == "__main__":
    main()
