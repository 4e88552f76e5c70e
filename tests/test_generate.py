"""generate(): plain decoding behaviour (greedy, sampling, EOS, lengths, streaming, failures, bad input)."""
import json

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.generate import GenerationError, generate
from test_llama_vs_transformers import make_hf


@pytest.fixture(scope="module")
def model():
    return hk.Llama.from_hf(make_hf("gqa3-tied", seed=5))


def prompts(lens=(4, 9, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 101, (n,), generator=g).tolist() for n in lens]


def naive_greedy(model, prompt, n):
    """Full forward over the growing sequence each time: the slowest, most obvious greedy decoder."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def test_greedy_equals_naive_full_forward_decoding(model):
    for p in prompts():
        assert generate(model, [p], max_new_tokens=20, eos_token_id=[]).sequences[0] == naive_greedy(model, p, 20)


def test_result_fields_and_exact_length(model):
    out = generate(model, prompts(), max_new_tokens=13, eos_token_id=[])
    assert [len(s) for s in out.sequences] == [13, 13, 13]
    assert out.num_steps == 12  # the prefill emits the first token
    assert out.accept_lengths == [[1] * 12] * 3 and out.mean_accepted_tokens == 1.0
    assert out.prefill_s > 0 and out.decode_s > 0 and out.tokens_per_second > 0
    one = generate(model, prompts(), max_new_tokens=1, eos_token_id=[])
    assert [len(s) for s in one.sequences] == [1, 1, 1] and one.num_steps == 0


def test_tensor_input_equals_list_input(model):
    p = prompts(lens=(7, 7))
    a = generate(model, torch.tensor(p), max_new_tokens=8, eos_token_id=[]).sequences
    assert a == generate(model, p, max_new_tokens=8, eos_token_id=[]).sequences


def test_each_sequence_stops_at_its_own_eos(model):
    ps = prompts()
    free = generate(model, ps, max_new_tokens=25, eos_token_id=[]).sequences
    # EOS := the 6th token of sequence 1 (its first occurrence there); other sequences stop at their
    # first occurrence of it, or run to max_new_tokens.
    eos = free[1][5]
    out = generate(model, ps, max_new_tokens=25, eos_token_id=eos)
    for b, s in enumerate(free):
        cut = s.index(eos) + 1 if eos in s else len(s)
        assert out.sequences[b] == s[:cut], f"sequence {b}"
        assert len(out.accept_lengths[b]) == cut - 1
    assert out.num_steps == max(len(s) for s in out.sequences) - 1


def test_config_eos_is_the_default(model):
    p = prompts()[:1]
    free = generate(model, p, max_new_tokens=15, eos_token_id=[]).sequences[0]
    model.config.eos_token_id = [free[3], 99999]
    try:
        assert generate(model, p, max_new_tokens=15).sequences[0] == free[: free.index(free[3]) + 1]
    finally:
        model.config.eos_token_id = None


def test_sampling_is_seeded_and_filters_work(model):
    p = prompts()
    a = generate(model, p, max_new_tokens=12, temperature=1.0, seed=3, eos_token_id=[]).sequences
    b = generate(model, p, max_new_tokens=12, temperature=1.0, seed=3, eos_token_id=[]).sequences
    c = generate(model, p, max_new_tokens=12, temperature=1.0, seed=4, eos_token_id=[]).sequences
    assert a == b and a != c
    greedy = generate(model, p, max_new_tokens=12, eos_token_id=[]).sequences
    assert generate(model, p, max_new_tokens=12, temperature=0.7, top_k=1, seed=1, eos_token_id=[]).sequences == greedy
    assert generate(model, p, max_new_tokens=12, temperature=0.7, top_p=1e-6, seed=1, eos_token_id=[]).sequences == greedy


def test_top_p_keeps_the_smallest_nucleus():
    from hydra_kernels.sampling import filter_top_k_top_p

    logits = torch.log(torch.tensor([[0.5, 0.1, 0.3, 0.1]]))
    kept = filter_top_k_top_p(logits, top_p=0.75).isfinite()[0].tolist()
    assert kept == [True, False, True, False]  # 0.5 < 0.75, 0.5 + 0.3 crosses it
    assert filter_top_k_top_p(logits, top_k=1).isfinite()[0].tolist() == [True, False, False, False]


def test_streamer_sees_every_token_in_order(model):
    got = {0: [], 1: [], 2: []}
    out = generate(model, prompts(), max_new_tokens=9, eos_token_id=[], streamer=lambda b, t: got[b].extend(t))
    assert [got[b] for b in range(3)] == out.sequences


def test_failure_mid_generation_keeps_produced_tokens(model, monkeypatch):
    full = generate(model, prompts(), max_new_tokens=10, eos_token_id=[]).sequences
    real_step, calls = model.step, []

    def failing_step(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("device lost")
        return real_step(*a, **k)

    monkeypatch.setattr(model, "step", failing_step)
    with pytest.raises(GenerationError) as err:
        generate(model, prompts(), max_new_tokens=10, eos_token_id=[])
    assert isinstance(err.value.__cause__, RuntimeError)
    assert err.value.output.sequences == [s[:4] for s in full]  # first token + 3 good steps
    assert err.value.output.num_steps == 3


# ---- bad input: a clear error before any work ----------------------------------------------------
@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(input_ids=[[1, 2, 3]], max_new_tokens=10, max_seq_len=12), ValueError, "KV buffer too small"),
    (dict(input_ids=[[1] * 250], max_new_tokens=10), ValueError, "exceeds the model's context"),
    (dict(input_ids=[[1, 2], []]), ValueError, "prompt 1 is empty"),
    (dict(input_ids=[]), ValueError, "no sequence"),
    (dict(input_ids=[[1, 2, 101]]), ValueError, "token id 101 at position 2"),
    (dict(input_ids=[[1, -1]]), ValueError, "outside the vocabulary"),
    (dict(input_ids=[1, 2, 3]), ValueError, "list of token lists"),
    (dict(input_ids=torch.ones(1, 3)), ValueError, "integer tensor"),
    (dict(input_ids=[[1, 2]], max_new_tokens=0), ValueError, "max_new_tokens"),
    (dict(input_ids=[[1, 2]], temperature=-1.0), ValueError, "temperature"),
    (dict(input_ids=[[1, 2]], top_p=0.0), ValueError, "top_p"),
    (dict(input_ids=[[1, 2]], acceptance="fancy"), ValueError, "acceptance"),
    (dict(input_ids=[[1, 2]], tree=[[0]]), ValueError, "tree is only used with a drafter"),
    (dict(input_ids=[[1, 2]], drafter=object()), TypeError, "Drafter"),
    (dict(input_ids=[[1, 2]], backend="triton"), ValueError, "TRITON_INTERPRET=1"),
    (dict(input_ids=[[1, 2]], backend="cuda"), ValueError, "backend must be one of"),
])
def test_bad_input_raises_before_work(model, monkeypatch, kwargs, exc, msg):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(model, "prefill", lambda *a, **k: pytest.fail("work started"))
    with pytest.raises(exc, match=msg):
        generate(model, **{"max_new_tokens": 5, **kwargs})


def test_missing_extension_is_clear_for_native_and_silent_for_auto(model, monkeypatch):
    import hydra_kernels.ops.backend as backend

    monkeypatch.setattr(backend, "native_available", lambda: False)
    with pytest.raises(ValueError, match="hydra_kernels._C is not built"):
        generate(model, [[1, 2]], max_new_tokens=3, backend="native")
    # no EOS: the random model's first token must not end the answer (its weights depend on the tests run before)
    assert len(generate(model, [[1, 2]], max_new_tokens=3, backend="auto", eos_token_id=[]).sequences[0]) == 3


def test_hf_model_object_is_rejected_with_a_hint():
    with pytest.raises(TypeError, match="from_hf"):
        generate(make_hf("mha-untied"), [[1, 2]])


def test_non_llama_checkpoint_dir_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                      "vocab_size": 10, "n_embd": 8}))
    with pytest.raises(ValueError, match="not a Llama-family checkpoint"):
        hk.load_model(tmp_path, device="cpu")


def test_missing_paths_and_bad_dtype_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model at"):
        hk.load_model(tmp_path / "nope", device="cpu")
    with pytest.raises(FileNotFoundError, match="config.json"):
        hk.load_model(tmp_path, device="cpu")
    with pytest.raises(ValueError, match="unknown dtype"):
        hk.load_model(tmp_path, dtype="float8", device="cpu")
