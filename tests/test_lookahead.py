"""Lookahead decoding: its lookahead nodes see exactly the sequence their mask and positions describe
(the base argmax there equals a plain forward's), lossless on the tiny model on every backend and on
the real model, save / load, bad settings."""
from __future__ import annotations

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.chat import chat_prompt_ids
from hydra_kernels.drafters import LookaheadDrafter
from hydra_kernels.drafters.lookahead import LookaheadConfig
from hydra_kernels.generate import generate
from test_llama_vs_transformers import make_hf


class RecordingLookahead(LookaheadDrafter):
    """Records, per step: each sequence's text (up to the root), the window rows and the base argmax."""

    def start(self, *args):
        self.state = super().start(*args)
        self.texts, self.steps = None, []
        return self.state

    def observe_tokens(self, state, new_tokens, step_argmax=None):
        if self.texts is None:
            self.texts = [list(t) for t in new_tokens]
        else:
            text_now = [list(t) for t in self.texts]
            self.steps.append((text_now, [[list(r) for r in rows] for rows in state.rows], state.la_start,
                               step_argmax.clone()))
            for t, new in zip(self.texts, new_tokens):
                t.extend(new)
        super().observe_tokens(state, new_tokens, step_argmax)


@pytest.fixture(scope="module")
def tiny():
    return hk.Llama.from_hf(make_hf("gqa3-tied", seed=5))


PROMPTS = [[3, 4, 5, 6, 7, 8] * 3, [9, 10, 9, 10, 11], list(range(20, 33))]


def test_lookahead_nodes_see_their_jacobi_sequence(tiny):
    """Node (k, j)'s argmax equals a plain forward over text, row0[0..j], rows 1..k of column j."""
    cfg = LookaheadConfig(window=3, ngram=3, guesses=2)
    d = RecordingLookahead(cfg)
    generate(tiny, PROMPTS, drafter=d, max_new_tokens=6, eos_token_id=[], backend="reference")
    R, W = cfg.ngram - 1, cfg.window
    for texts, rows, start, argmax in d.steps[:2]:
        for b, (text, r) in enumerate(zip(texts, rows)):
            for k in range(R):
                for j in range(W):
                    seq = text + r[0][: j + 1] + [r[k2][j] for k2 in range(1, k + 1)]
                    want = int(tiny(torch.tensor([seq]))[0, -1].argmax())
                    assert int(argmax[b, start + k * W + j]) == want, (b, k, j)


@pytest.mark.backends("reference", "native", "triton")
def test_lookahead_lossless_tiny_model(tiny, backend):
    n = 12 if backend == "triton" else 24
    plain = generate(tiny, PROMPTS, max_new_tokens=n, eos_token_id=[], backend=backend).sequences
    d = hk.new_drafter(tiny, kind="lookahead", window=3, ngram=3, guesses=3)
    out = generate(tiny, PROMPTS, drafter=d, max_new_tokens=n, eos_token_id=[], backend=backend)
    assert out.sequences == plain


@pytest.mark.backends("auto")
def test_lookahead_lossless_real_model(smollm2, backend):
    model, tok = smollm2
    prompts = [chat_prompt_ids(tok, "Count from 1 to 30, separated by commas."),
               chat_prompt_ids(tok, "Name three colours.")]
    plain = generate(model, prompts, max_new_tokens=32, backend=backend)
    out = generate(model, prompts, drafter=hk.new_drafter(model, kind="lookahead"), max_new_tokens=32, backend=backend)
    assert out.sequences == plain.sequences
    assert out.mean_accepted_tokens > 1.2  # the counting sequence is predictable from the pool


def test_lookahead_save_load_and_bad_settings(tiny, tmp_path):
    d = hk.new_drafter(tiny, kind="lookahead", window=5, ngram=4, guesses=2)
    d.save(tmp_path)
    back = hk.load_drafter(tmp_path)
    assert isinstance(back, LookaheadDrafter) and back.config == d.config
    with pytest.raises(ValueError, match="ngram"):
        hk.new_drafter(tiny, kind="lookahead", ngram=1)
    with pytest.raises(ValueError, match="own tree"):
        generate(tiny, [[1, 2]], drafter=d, tree="chain-2")
    with pytest.raises(Exception, match="greedy acceptance"):
        generate(tiny, [[1, 2, 3]], drafter=d, temperature=1.0, acceptance="typical", max_new_tokens=4)
