"""The n-gram (prompt lookup) and combined drafters: the incremental index against a brute-force rescan,
the trie, lossless decoding (tiny random model on every backend, the real model on prompts that repeat
text), batches whose sequences match at different lengths, save / load, bad settings."""
from __future__ import annotations

import random

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.chat import chat_prompt_ids
from hydra_kernels.drafters import CombinedDrafter, NgramDrafter
from hydra_kernels.drafters.ngram import _MAX_SCAN, NgramIndex, trie
from hydra_kernels.generate import generate
from test_llama_vs_transformers import make_hf


def brute_lookup(text, min_n, max_n, num_tokens, num_branches):
    """Rescan the whole text: the longest suffix with an earlier occurrence, its distinct continuations."""
    L = len(text)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = text[L - n:]
        ends = [e for e in range(n, L) if text[e - n:e] == suffix]
        if not ends:
            continue
        found = []
        for e in reversed(ends[-_MAX_SCAN:]):
            ext = list(text)  # the copy runs on past the end: the future repeats what followed e
            for m in range(num_tokens):
                ext.append(ext[e + m])
            c = ext[L:]
            if c not in found:
                found.append(c)
            if len(found) == num_branches:
                break
        return n, found
    return 0, []


@pytest.mark.parametrize("min_n,max_n,k,branches", [(1, 4, 5, 1), (2, 3, 3, 3), (1, 1, 7, 2)])
def test_index_matches_brute_force_rescan(min_n, max_n, k, branches):
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(5):
        idx = NgramIndex(min_n, max_n)
        vocab = rng.choice([3, 5, 20])  # small vocabularies: many matches of every length
        while len(idx.text) < 150:
            idx.extend([rng.randrange(vocab) for _ in range(rng.randint(1, 6))])  # steps of varying size
            assert idx.lookup(k, branches) == brute_lookup(idx.text, min_n, max_n, k, branches), idx.text


def test_byte_matches_across_token_boundaries_are_not_matches():
    """The index searches the text's 4-byte words: ids whose bytes shift into each other (0x05, 0x500,
    0x50000, 0x5000000, 0) make byte matches that straddle two tokens, which must be skipped, never taken
    for an occurrence (the rescan is the reference)."""
    rng = random.Random(7)
    ids = [0, 5, 0x500, 0x50000, 0x5000000, 0x5050505, 2**32 - 1]
    for min_n, max_n, k, branches in [(1, 4, 5, 1), (1, 3, 4, 3)]:
        for _ in range(20):
            idx = NgramIndex(min_n, max_n)
            while len(idx.text) < 120:
                idx.extend([rng.choice(ids) for _ in range(rng.randint(1, 4))])
                assert idx.lookup(k, branches) == brute_lookup(idx.text, min_n, max_n, k, branches), idx.text


@pytest.mark.parametrize("period", [1, 2, 3, 7])
def test_a_loop_drafts_num_tokens_of_the_loop(period):
    """The most recent occurrence of the suffix ends `period` tokens back: its continuation runs into the
    text's end and goes on copying the loop (as the text will go on if the loop holds), num_tokens long."""
    loop = [11, 12, 13, 14, 15, 16, 17][:period]
    idx = NgramIndex(1, 4)
    idx.extend([1, 2, 3] + loop * (12 // period + 2))
    n, (c,) = idx.lookup(10, 1)
    assert n == 4 and len(c) == 10
    assert idx.text[-period:] == loop and c == (loop * 20)[:10]  # the text ends with a whole loop


def test_trie_shares_prefixes_and_keeps_parents_first():
    parents, tokens = trie(7, [[1, 2, 3], [1, 2, 4], [5], [1, 9]])
    assert tokens == [7, 1, 2, 3, 4, 5, 9] and parents == [-1, 0, 1, 2, 2, 0, 1]
    assert trie(7, []) == ([-1], [7])


class RecordingNgram(NgramDrafter):
    """Keeps its last run's state and the tree sizes it proposed, per step."""

    def start(self, *args):
        self.state = super().start(*args)
        self.sizes = []
        return self.state

    def propose(self, state, root, seqlens):
        p = super().propose(state, root, seqlens)
        valid = getattr(p.tree, "valid", None)
        self.sizes.append(tuple(valid.sum(1).tolist()) if valid is not None else (p.tree.num_nodes,) * root.shape[0])
        return p


@pytest.fixture(scope="module")
def tiny():
    return hk.Llama.from_hf(make_hf("gqa3-tied", seed=5))


# one prompt repeats a long pattern (long matches), one a short one, one never repeats (no match)
TINY_PROMPTS = [[3, 4, 5, 6, 7, 8] * 4, [9, 10, 9, 10, 11], list(range(20, 33))]


@pytest.mark.backends("reference", "native", "triton")
def test_ngram_lossless_tiny_model_batch_with_different_matches(tiny, backend):
    n = 16 if backend == "triton" else 40
    plain = generate(tiny, TINY_PROMPTS, max_new_tokens=n, eos_token_id=[], backend=backend).sequences
    for branches in ((3,) if backend == "triton" else (1, 3)):  # the Triton interpreter is slow
        d = RecordingNgram(hk.drafters.ngram.NgramConfig(max_ngram=3, num_tokens=4, num_branches=branches))
        out = generate(tiny, TINY_PROMPTS, drafter=d, max_new_tokens=n, eos_token_id=[], backend=backend)
        assert out.sequences == plain
        assert any(len(set(s)) > 1 for s in d.sizes)  # sequences proposed trees of different sizes in one step
        for b, (p, s) in enumerate(zip(TINY_PROMPTS, plain)):  # observe_tokens fed it exactly the text
            assert d.state.indexes[b].text[: len(p) + len(s)] == p + s


@pytest.mark.backends("reference", "native")
def test_combined_lossless_tiny_model(tiny, backend):
    plain = generate(tiny, TINY_PROMPTS, max_new_tokens=30, eos_token_id=[], backend=backend).sequences
    heads = hk.new_drafter(tiny, kind="hydra", num_heads=2)
    for budget in (None, 3):
        ng = hk.new_drafter(tiny, kind="ngram", max_ngram=3, num_tokens=4, num_branches=2)
        d = hk.new_drafter(tiny, kind="combined", drafters=[heads, ng], node_budget=budget)
        out = generate(tiny, TINY_PROMPTS, drafter=d, max_new_tokens=30, eos_token_id=[], backend=backend,
                       tree=[[0], [1], [0, 0]])
        assert out.sequences == plain, budget


@pytest.mark.backends("auto")
def test_ngram_and_combined_lossless_real_model(smollm2, backend):
    model, tok = smollm2
    text = "The quick brown fox jumps over the lazy dog near the river bank at dawn."
    prompts = [chat_prompt_ids(tok, f"Repeat this sentence three times: {text}"),
               chat_prompt_ids(tok, f"Correct the spelling: {text.replace('quick', 'quikc').replace('river', 'rivr')}")]
    plain = generate(model, prompts, max_new_tokens=32, backend=backend)
    ng = generate(model, prompts, drafter=hk.new_drafter(model, kind="ngram"), max_new_tokens=32, backend=backend)
    assert ng.sequences == plain.sequences
    assert ng.mean_accepted_tokens > 1.5  # the repeated text is drafted from the prompt
    parts = [hk.new_drafter(model, kind="ngram"), hk.load_drafter(model=model, kind="hydra")]
    comb = generate(model, prompts, drafter=hk.new_drafter(model, kind="combined", drafters=parts, node_budget=8),
                    max_new_tokens=32, backend=backend)
    assert comb.sequences == plain.sequences and comb.mean_accepted_tokens > 1.5


def test_save_load_roundtrip(tiny, tmp_path):
    d = hk.new_drafter(tiny, kind="ngram", max_ngram=5, min_ngram=2, num_tokens=7, num_branches=3)
    d.save(tmp_path / "ng")
    assert not (tmp_path / "ng" / "model.safetensors").exists()
    back = hk.load_drafter(tmp_path / "ng")
    assert isinstance(back, NgramDrafter) and back.kind == "ngram" and back.config == d.config
    heads = hk.new_drafter(tiny, kind="hydra", num_heads=2)
    torch.manual_seed(0)
    for p in heads.parameters():
        p.data.normal_()
    c = hk.new_drafter(tiny, kind="combined", drafters=[d, heads], node_budget=9, strong_match=3)
    c.save(tmp_path / "c")
    cb = hk.load_drafter(tmp_path / "c", model=tiny)
    assert isinstance(cb, CombinedDrafter) and (cb.node_budget, cb.strong_match) == (9, 3)
    assert cb.ngram.config == d.config and cb.heads.kind == "hydra"
    for (k, v), (k2, v2) in zip(heads.state_dict().items(), cb.heads.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)


def test_bad_settings_fail_clearly(tiny):
    with pytest.raises(ValueError, match="min_ngram"):
        hk.new_drafter(tiny, kind="ngram", max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="num_tokens"):
        hk.new_drafter(tiny, kind="ngram", num_tokens=0)
    with pytest.raises(ValueError, match="builds its own tree"):
        generate(tiny, [[1, 2, 3]], drafter=hk.new_drafter(tiny, kind="ngram"), tree="chain-3")
    ng = hk.new_drafter(tiny, kind="ngram")
    with pytest.raises(ValueError, match="node_budget"):
        hk.new_drafter(tiny, kind="combined", drafters=[ng, hk.new_drafter(tiny, kind="medusa")], node_budget=1)
    with pytest.raises(ValueError, match="ngram drafter, a trained drafter"):
        hk.new_drafter(tiny, kind="combined")
    with pytest.raises(ValueError, match="trained drafter"):
        hk.new_drafter(tiny, kind="combined", drafters=[ng, hk.new_drafter(tiny, kind="ngram")])
