"""Recipe: the base model's own greedy answers to ShareGPT training prompts (self-distillation data).

Heads decode on the base model's own text, not on ShareGPT's; training on its answers removes that
shift (Medusa-2 / Hydra++ "regenerated" data). Batched plain greedy decoding, resumable:

    .venv/bin/python python/self_data.py --prompts 512 --new-tokens 256 --batch 16

Writes <cache>/training/self-<n>-<tokens>.json: a list of token sequences (chat prompt + answer);
python/train_heads.py --self-data FILE trains on them (with or instead of ShareGPT).
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tok = hk.load_model()
    prompts = []
    for rec in sharegpt_records():
        if is_heldout(rec, 5):
            continue
        msgs = conversation_messages(rec)
        if msgs:
            ids = chat_prompt_ids(tok, msgs[0]["content"])
            if len(ids) <= args.max_prompt_tokens:
                prompts.append(ids)
        if len(prompts) == args.prompts:
            break
    out = cache_root() / "training" / f"self-{len(prompts)}-{args.new_tokens}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    done = json.loads(out.read_text()) if out.exists() else []
    for i in tqdm(range(len(done), len(prompts), args.batch), desc="self-generated answers", initial=len(done) // args.batch,
                  total=-(-len(prompts) // args.batch)):
        batch = prompts[i:i + args.batch]
        answers = generate(model, batch, max_new_tokens=args.new_tokens).sequences
        done += [p + a for p, a in zip(batch, answers)]
        out.write_text(json.dumps(done))  # after every batch: an interrupted run resumes
    print(f"{len(done)} sequences, {sum(map(len, done))} tokens -> {out}")


if __name__ == "__main__":
    main()
