"""Chat prompts and streamed text, for the CLI and the demo."""
from __future__ import annotations

import sys


def chat_prompt_ids(tokenizer, user_text: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat with the generation prompt appended (the tokenizer's template)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_text}]
    return chat_ids(tokenizer, messages, add_generation_prompt=True)


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """Token ids of chat messages rendered with the tokenizer's template (some transformers versions
    return a BatchEncoding, others a list)."""
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


class TextStreamer:
    """Prints the text of one sequence as its tokens arrive (decodes the whole sequence each time and
    prints the new suffix, holding back an incomplete multi-byte character)."""

    def __init__(self, tokenizer, out=None, skip_special_tokens: bool = True):
        # out=None: the sys.stdout of now, not of import time (a redirected stdout, e.g. contextlib's, is honoured)
        self.tokenizer, self.out, self.skip = tokenizer, out if out is not None else sys.stdout, skip_special_tokens
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, seq: int, tokens: list[int]) -> None:
        if seq != 0:
            return
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)
