"""Training and evaluation text: the truncated ShareGPT JSON, the role mapping, the stable split,
rendering with the real chat template; the hidden-state cache and the draft vocabulary."""
import copy
import gzip
import json

import pytest
import torch

from hydra_kernels.training import data as tdata
from hydra_kernels.training.hidden_cache import compute_hidden_states, draft_vocabulary


def test_truncated_json_yields_complete_records_only(tmp_path):
    recs = [{"id": f"r{i}", "conversations": [{"from": "human", "value": "q" * i}, {"from": "gpt", "value": "a,]}"}]}
            for i in range(40)]
    text = json.dumps(recs, indent=2)
    cut = text[: int(len(text) * 0.73)]  # ends inside a record, like the packaged file
    got = list(tdata.sharegpt_records(_write(tmp_path / "cut.json", cut), chunk_chars=97))  # records span chunks
    assert 20 < len(got) < 40 and got == recs[: len(got)]
    assert list(tdata.sharegpt_records(_write(tmp_path / "whole.json", text), chunk_chars=50)) == recs


def _write(path, text):
    path.write_text(text)
    return path


def test_conversation_messages_alternate_from_the_first_user_turn():
    rec = {"conversations": [{"from": "gpt", "value": "hello"}, {"from": "human", "value": "q1"},
                             {"from": "gpt", "value": "a1"}, {"from": "gpt", "value": "a1 again"},
                             {"from": "human", "value": "q2"}]}
    assert tdata.conversation_messages(rec) == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]


def test_packaged_sharegpt_and_split(smollm2):
    _, tok = smollm2
    first = []
    for r in tdata.sharegpt_records():
        first.append(r)
        if len(first) == 50:
            break
    assert all("conversations" in r for r in first)
    held = [r for r in first if tdata.is_heldout(r, 5)]
    assert held != first and all(tdata.is_heldout(r, 5) for r in held)
    train = tdata.sharegpt_token_sequences(tok, 3, max_tokens=100)
    test = tdata.sharegpt_token_sequences(tok, 3, max_tokens=100, heldout=True)
    assert all(64 <= len(s) <= 100 for s in train + test) and not set(map(tuple, train)) & set(map(tuple, test))
    assert tok.decode(train[0]).startswith("<|im_start|>")


def test_hidden_states_cache_resumes_and_matches(smollm2, tmp_path):
    model, _ = smollm2
    seqs = [[1, 2, 3, 4, 5], [9, 8, 7], [4, 4, 4, 4]]
    a = compute_hidden_states(model, seqs, cache_dir=tmp_path, shard_size=2, progress=False, dtype=torch.float32)
    assert len(list(tmp_path.glob("hidden-*/shard-*.pt"))) == 2
    b = compute_hidden_states(model, seqs, cache_dir=tmp_path, shard_size=2, progress=False, dtype=torch.float32)
    assert torch.equal(a.hidden, b.hidden) and a.after.tolist() == [4, 3, 2, 1, 0, 2, 1, 0, 3, 2, 1, 0]
    with torch.no_grad():
        ref = model.hidden_states(torch.tensor([seqs[1]]))[0]
    assert torch.allclose(a.hidden[5:8], ref, atol=1e-5)
    # grown data (old sequences first): the full old shard is read back, not recomputed
    shard01 = next(f for f in tmp_path.glob("hidden-*/shard-*.pt") if torch.load(f).shape[0] == 8)
    torch.save(torch.load(shard01) + 1.0, shard01)  # a marker: only a reuse returns it
    c = compute_hidden_states(model, seqs[:2] + [[6, 6]], cache_dir=tmp_path, shard_size=2, progress=False,
                              dtype=torch.float32)
    assert len(list(tmp_path.glob("hidden-*/shard-*.pt"))) == 3
    assert torch.equal(c.hidden[:8], a.hidden[:8] + 1.0)
    with torch.no_grad():
        assert torch.allclose(c.hidden[8:], model.hidden_states(torch.tensor([[6, 6]]))[0], atol=1e-5)


def test_hidden_states_with_captured_layers(smollm2, tmp_path):
    """capture: the streams entering the named base layers are kept beside the final states (EAGLE-3's
    features), in their own cache folder, batched or not, equal to Llama.hidden_states(capture=...)."""
    model, _ = smollm2
    seqs = [[1, 2, 3, 4, 5], [9, 8, 7], [4, 4, 4, 4]]
    plain = compute_hidden_states(model, seqs, cache_dir=tmp_path, shard_size=2, progress=False, dtype=torch.float32)
    assert plain.captured is None and plain.capture is None
    runs = [compute_hidden_states(model, seqs, cache_dir=tmp_path, shard_size=2, progress=False, dtype=torch.float32,
                                  capture=[2, 15], batch_tokens=b) for b in (1, 1, 100)]  # computed, reread, batched
    assert len(list(tmp_path.glob("hidden-*"))) == 2  # captured shards never mix with plain ones
    with torch.no_grad():
        refs = [model.hidden_states(torch.tensor([s]), capture=(2, 15)) for s in seqs]
    ref_h, ref_c = (torch.cat([r[i][0] for r in refs]) for i in (0, 1))
    for got in runs:
        assert got.capture == (2, 15) and got.captured.shape == (12, 2 * model.config.hidden_size)
        assert torch.allclose(got.hidden, ref_h, atol=1e-4) and torch.allclose(got.captured, ref_c, atol=1e-4)
        assert torch.equal(got.hidden, plain.hidden) or got is runs[2]
    assert torch.equal(runs[0].captured, runs[1].captured)
    trained = runs[0].train_from([2, 0, 1])
    assert trained.captured is runs[0].captured and trained.to("cpu").capture == (2, 15)
    with pytest.raises(ValueError, match="capture must be distinct layer indices"):
        compute_hidden_states(model, seqs, progress=False, capture=[2, 2])


def test_hidden_states_batched_forwards_match_one_sequence_each(smollm2):
    """Sequences of mixed lengths, batched (right-padded, longest first) under several token budgets:
    every sequence's states, in the input order, are as close to an fp64 forward of it alone as the
    fp32 forward of it alone is (twice that error at most: batching changes GEMM shapes, not accuracy)."""
    model, _ = smollm2
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (7, 2, 13, 5, 13, 9, 3)]
    m64 = copy.deepcopy(model).double()
    with torch.no_grad():
        alone = torch.cat([model.hidden_states(torch.tensor([s]))[0] for s in seqs])
        exact = torch.cat([m64.hidden_states(torch.tensor([s]))[0] for s in seqs]).float()
    del m64
    bound = 2 * (alone - exact).abs().max().item()
    for budget in (1, 20, 40, 10_000):  # 1: one sequence per forward; 10_000: the whole chunk at once
        got = compute_hidden_states(model, seqs, progress=False, dtype=torch.float32, batch_tokens=budget)
        assert got.hidden.shape == exact.shape
        err = (got.hidden - exact).abs().max().item()
        assert err <= bound, f"batch_tokens={budget}: max |batched - fp64| = {err:.2e} > {bound:.2e}"


def test_draft_vocabulary_frequency_order_and_forced_ids():
    dv = draft_vocabulary([[5, 5, 5, 2, 2, 9], [2, 7]], 3, always=[100])
    assert dv.tolist() == [100, 2, 5]
    with pytest.raises(ValueError, match="distinct tokens"):
        draft_vocabulary([[1, 2]], 5)


def test_self_data_reads_plain_and_gzipped_json_alike(tmp_path):
    """read_self_data / self_data_sequences: a .gz file (as python/gpu_carry.py packs the training text) reads as its
    plain JSON does; a file whose bytes are not gzip under a .gz name is refused, not read as something else."""
    data = {"prompt_lengths": [3, 2, 4], "sequences": [[5, 6, 7, 8, 9], [1, 2], [4, 4, 4, 4, 3, 2]]}
    plain, packed = tmp_path / "a.json", tmp_path / "a.json.gz"
    plain.write_text(json.dumps(data))
    packed.write_bytes(gzip.compress(json.dumps(data).encode()))
    assert tdata.read_self_data(packed) == tdata.read_self_data(plain) == data
    assert tdata.self_data_sequences(packed, max_tokens=2) == tdata.self_data_sequences(plain, max_tokens=2) == (
        [[5, 6, 7, 8, 9], [4, 4, 4, 4, 3, 2]], [2, 3])  # the 2-token sequence has no answer: skipped
    bad = tmp_path / "b.json.gz"
    bad.write_text(json.dumps(data))
    with pytest.raises(OSError):
        tdata.read_self_data(bad)


def test_sharegpt_replies_start_at_the_first_reply_and_skip_answered_prompts(smollm2, tmp_path):
    """ShareGPT's own first replies in self_data.py's format: each sequence is its first user turn's chat
    prompt (at most max_prompt_tokens, as self_data.py picks prompts; training starts after it) and that
    conversation's first reply (at most max_reply_tokens); prompts a self-data file answers are skipped;
    self_data_sequences reads several such files as one."""
    from hydra_kernels.chat import chat_ids, chat_prompt_ids

    _, tok = smollm2
    got = tdata.sharegpt_reply_data(tok, 5, max_prompt_tokens=120, max_reply_tokens=40)
    prompts = [s[:n] for n, s in zip(got["prompt_lengths"], got["sequences"])]
    expect = []
    for rec in tdata.sharegpt_records():  # brute force: the first 5 training conversations that qualify
        msgs = [] if tdata.is_heldout(rec, 5) else tdata.conversation_messages(rec)
        if len(msgs) >= 2 and len(chat_prompt_ids(tok, msgs[0]["content"])) <= 120:
            expect.append(chat_ids(tok, msgs[:2])[: len(chat_prompt_ids(tok, msgs[0]["content"])) + 40])
            if len(expect) == 5:
                break
    assert got["sequences"] == expect and all(len(p) <= 120 for p in prompts)
    assert all(1 < len(s) - n <= 40 for n, s in zip(got["prompt_lengths"], got["sequences"]))
    skipped = tdata.sharegpt_reply_data(tok, 3, exclude_prompts=prompts[:2], max_prompt_tokens=120, max_reply_tokens=40)
    assert skipped["sequences"] == got["sequences"][2:5]
    a = _write(tmp_path / "a.json", json.dumps(got))
    b = tmp_path / "b.json.gz"  # gzipped, as python/gpu_carry.py packs them: read the same
    b.write_bytes(gzip.compress(json.dumps(skipped).encode()))
    seqs, starts = tdata.self_data_sequences([a, b], max_tokens=30)
    one, one_starts = tdata.self_data_sequences(a, max_tokens=30)
    assert seqs == one + one[2:] and starts == one_starts + one_starts[2:]
    assert all(len(s) <= n + 1 + 30 for n, s in zip(starts, seqs))
