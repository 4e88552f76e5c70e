"""The embedded default (SmolLM2-135M-Instruct, fp32): our model and decoding against transformers."""
import torch

from helpers import assert_close_rel
from hydra_kernels.chat import chat_prompt_ids
from hydra_kernels.generate import generate

PROMPTS = [
    "Explain how a CPU cache works.",
    "Write a short poem about the sea.",
    "Give me three tips for learning a new language.",
]


def prompt_ids(tok):
    return [chat_prompt_ids(tok, p) for p in PROMPTS]


def test_config_of_embedded_default(smollm2):
    cfg = smollm2[0].config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (
        30, 576, 9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.eos_token_ids == [2]


def test_logits_match_transformers_gguf_load(smollm2, hf_smollm2):
    model, tok = smollm2
    x = torch.tensor([prompt_ids(tok)[0]])
    assert_close_rel(model(x), hf_smollm2(x).logits, 1e-4, "SmolLM2 logits")


def test_greedy_generate_equals_transformers_generate(smollm2, hf_smollm2):
    model, tok = smollm2
    for ids in prompt_ids(tok):
        ours = generate(model, [ids], max_new_tokens=64).sequences[0]
        ref = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0, len(ids):].tolist()
        assert ours == ref, f"first difference at {next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)}"
        assert len(ours) == 64 or ours[-1] == 2


def test_ragged_batch_gives_each_sequence_its_own_tokens(smollm2):
    model, tok = smollm2
    prompts = prompt_ids(tok)
    prompts[1] = prompts[1][:-9] + prompts[1][-5:]  # make the lengths differ more
    assert len({len(p) for p in prompts}) == 3
    batch = generate(model, prompts, max_new_tokens=40)
    for b, p in enumerate(prompts):
        alone = generate(model, [p], max_new_tokens=40)
        assert batch.sequences[b] == alone.sequences[0], f"sequence {b}"
        assert len(batch.accept_lengths[b]) == len(batch.sequences[b]) - 1


def test_prefill_and_steps_equal_full_forward_on_smollm2(smollm2):
    model, tok = smollm2
    x = torch.tensor([prompt_ids(tok)[2]])
    L = x.shape[1]
    full = model(x)
    cache = model.new_kv_cache(1, L)
    model.prefill(x[:, : L - 4], torch.tensor([L - 4], dtype=torch.int32), cache)
    for t in range(L - 4, L):
        h = model.step(x[:, t : t + 1], cache)
        cache.advance(1)
        assert_close_rel(model.output(h)[:, 0], full[:, t], 1e-4, f"position {t}")
