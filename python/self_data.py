"""Recipe: the base model's own greedy answers to ShareGPT training prompts (self-distillation data).

Heads decode on the base model's own text, not on ShareGPT's; training on its answers removes that
shift (Medusa-2 / Hydra++ "regenerated" data). Plain greedy decoding in the model's dtype (fp32 on
the CPU: exactly the text the heads will be asked to guess), batched by prompt length so little of
each batch is padding, resumable:

    .venv/bin/python python/self_data.py --prompts 2048 --new-tokens 256 --batch 64

Writes <cache>/training/self-<n>-<tokens>.json: {"prompt_lengths": [...], "sequences": [...]} (chat
prompt + answer token ids, in ShareGPT order); python/train_heads.py --self-data FILE trains on the
answers (with or instead of ShareGPT). A larger run reuses a finished smaller run's answers (the
first prompts are the same), e.g. --prompts 4096 after --prompts 2048 generates 2048 new answers.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hydra_kernels as hk  # noqa: E402
from hydra_kernels.chat import chat_prompt_ids  # noqa: E402
from hydra_kernels.generate import generate  # noqa: E402
from hydra_kernels.model.gguf_convert import cache_root  # noqa: E402
from hydra_kernels.training.data import conversation_messages, is_heldout, sharegpt_records  # noqa: E402


def training_prompts(tok, n: int, max_prompt_tokens: int) -> list[list[int]]:
    """The first user turn of the first n training-split ShareGPT conversations whose chat prompt fits."""
    prompts = []
    for rec in sharegpt_records():
        if is_heldout(rec, 5):
            continue
        msgs = conversation_messages(rec)
        if msgs:
            ids = chat_prompt_ids(tok, msgs[0]["content"])
            if len(ids) <= max_prompt_tokens:
                prompts.append(ids)
        if len(prompts) == n:
            break
    return prompts


def smaller_runs_answers(folder, prompts, new_tokens: int, skip) -> dict[int, list[int]]:
    """Answers a finished smaller run already holds: training_prompts(n) starts with training_prompts(m)
    for m < n, so self-<m>-<tokens>.json answers our first m prompts (each checked to start with its
    prompt). Growing 2048 -> 4096 answers then costs the 2048 new ones only."""
    found = {}
    for f in sorted(folder.glob(f"self-*-{new_tokens}.json")):
        seqs = json.loads(f.read_text())["sequences"]
        for i, s in enumerate(seqs[: len(prompts)]):
            if i not in skip and s[: len(prompts[i])] == prompts[i]:
                found[i] = s
    return found


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tok = hk.load_model(device="cpu", dtype=torch.float32)
    prompts = training_prompts(tok, args.prompts, args.max_prompt_tokens)
    out = cache_root() / "training" / f"self-{len(prompts)}-{args.new_tokens}.json"
    part = out.with_suffix(".partial.json")  # {prompt index: sequence}, rewritten after every batch
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {int(k): v for k, v in json.loads(part.read_text()).items()} if part.exists() else {}
    done.update(smaller_runs_answers(out.parent, prompts, args.new_tokens, skip=done))
    order = sorted((i for i in range(len(prompts)) if i not in done), key=lambda i: len(prompts[i]))
    batches = [order[i:i + args.batch] for i in range(0, len(order), args.batch)]
    bar = tqdm(batches, desc="self-generated answers", unit="batch")
    for idx in bar:
        batch = [prompts[i] for i in idx]
        res = generate(model, batch, max_new_tokens=args.new_tokens)
        for i, p, a in zip(idx, batch, res.sequences):
            done[i] = p + a
        part.write_text(json.dumps(done))
        bar.set_postfix(tok_s=f"{sum(map(len, res.sequences)) / (res.prefill_s + res.decode_s):.0f}")
    seqs = [done[i] for i in range(len(prompts))]
    out.write_text(json.dumps({"prompt_lengths": [len(p) for p in prompts], "sequences": seqs}))
    part.unlink(missing_ok=True)
    print(f"{len(seqs)} sequences, {sum(map(len, seqs))} tokens -> {out}")


if __name__ == "__main__":
    main()
