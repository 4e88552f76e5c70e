"""Bad input tried as a new user would (issue 25): each case either raises a clear error before any
work, or works as a user expects. One test (or parameter) per reported defect, with its reproduction."""
import numpy as np
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.generate import GenerationInterrupted, generate
from test_llama_vs_transformers import make_hf


@pytest.fixture(scope="module")
def model():
    return hk.Llama.from_hf(make_hf("gqa3-tied", seed=5))  # vocab 101, context 256


@pytest.fixture(scope="module")
def heads(model):
    torch.manual_seed(0)
    d = hk.new_drafter(model, kind="hydra", num_heads=2)
    for p in d.parameters():
        p.data.normal_(0, 0.05)
    return d


def no_work(model, monkeypatch):
    monkeypatch.setattr(model, "prefill", lambda *a, **k: pytest.fail("work started before the error"))


P = [[1, 2, 3]]


# ---- generate's arguments (generate/arguments.py), all refused before the prefill -----------------
@pytest.mark.parametrize("kwargs,exc,msg", [
    # 3: nan / inf temperature, a fractional top_k
    (dict(temperature=float("nan")), ValueError, "temperature must be finite"),
    (dict(temperature=float("inf")), ValueError, "temperature must be finite"),
    (dict(temperature=0.7, top_k=1.5), TypeError, "top_k must be an int"),
    (dict(temperature=0.7, top_p=float("nan")), ValueError, "top_p must be finite"),
    (dict(temperature="hot"), TypeError, "temperature must be a real number"),
    (dict(temperature=0.7, seed=1.5), TypeError, "seed must be an int"),
    (dict(max_new_tokens=2.0), TypeError, "max_new_tokens must be an int"),
    # 5: a streamer that is not callable
    (dict(streamer=5), TypeError, "streamer must be a callable"),
    # 6: eos_token_id outside the vocabulary, negative, a string, a float
    (dict(eos_token_id=101), ValueError, "outside the vocabulary"),
    (dict(eos_token_id=-1), ValueError, "outside the vocabulary"),
    (dict(eos_token_id=[3, 500]), ValueError, "eos_token_id 500 is outside"),
    (dict(eos_token_id="</s>"), TypeError, "eos_token_id must be an int"),
    (dict(eos_token_id=2.0), TypeError, "eos_token_id must be an int"),
    # 9: a KV buffer beyond the model's context
    (dict(max_seq_len=10**5), ValueError, "exceeds the model's context of 256"),
    (dict(max_seq_len="big"), TypeError, "max_seq_len must be an int"),
])
def test_bad_generate_arguments_are_refused_before_work(model, monkeypatch, kwargs, exc, msg):
    no_work(model, monkeypatch)
    with pytest.raises(exc, match=msg):
        generate(model, P, **{"max_new_tokens": 4, **kwargs})


def test_bogus_backend_env_is_refused_before_work_naming_the_variable(model, monkeypatch):  # 5
    no_work(model, monkeypatch)
    monkeypatch.setenv("HYDRA_KERNELS_BACKEND", "bogus")
    with pytest.raises(ValueError, match="HYDRA_KERNELS_BACKEND='bogus'.*backend must be one of"):
        generate(model, P, max_new_tokens=4)


@pytest.mark.parametrize("tree,msg", [  # 7, 8: tree arguments parsed in one place (tree.as_tree)
    ("chain-x", "'chain-N' needs a whole number N >= 1"),
    ("chain-0", "'chain-N' needs a whole number N >= 1"),
    ("chain--1", "'chain-N' needs a whole number N >= 1"),
    ([], "drafts no token"),
    (hk.Tree([]), "drafts no token"),
    ([[0.5]], "ranks must be ints"),
    ([5], "a tree choice must be a list of ranks"),
])
def test_bad_trees_are_refused_before_work(model, heads, monkeypatch, tree, msg):
    no_work(model, monkeypatch)
    with pytest.raises((ValueError, TypeError), match=msg):
        generate(model, P, drafter=heads, tree=tree, max_new_tokens=4)


def test_corrupt_tree_file_names_the_file(model, heads, monkeypatch, tmp_path):
    f = tmp_path / "tree.json"
    f.write_text("[[0], [0, ")
    no_work(model, monkeypatch)
    with pytest.raises(ValueError, match="tree file .*tree.json is not a JSON list"):
        generate(model, P, drafter=heads, tree=str(f), max_new_tokens=4)


def test_tree_rank_beyond_the_draft_vocabulary_is_refused_before_work(model, monkeypatch):  # 2
    d = hk.new_drafter(model, kind="medusa", num_heads=2, draft_vocab=list(range(0, 100, 5)))  # 20 tokens
    no_work(model, monkeypatch)
    with pytest.raises(ValueError, match="rank 20, but these heads rank at most 20"):
        generate(model, P, drafter=d, tree=[[20]], max_new_tokens=4)
    monkeypatch.undo()
    assert generate(model, P, drafter=d, tree=[[19]], max_new_tokens=4, eos_token_id=[]).sequences  # rank 19 fits


@pytest.mark.backends("reference", "triton", "native", op="commit_kv")
def test_tree_rank_beyond_lm_head_topk_is_refused_on_every_backend(model, heads, monkeypatch, backend):  # 2
    no_work(model, monkeypatch)
    with pytest.raises(ValueError, match="rank 70, but these heads rank at most 64"):
        generate(model, P, drafter=heads, tree=[[70]], backend=backend, max_new_tokens=4)


def test_shipped_heads_refuse_a_rank_beyond_their_draft_vocabulary(smollm2, monkeypatch):  # 2, the report's case
    model, _ = smollm2
    drafter = hk.load_drafter(model=model, kind="hydra")
    no_work(model, monkeypatch)
    with pytest.raises(ValueError, match="rank 20000"):
        generate(model, P, drafter=drafter, tree=[[20000]], max_new_tokens=4)
    with pytest.raises(ValueError, match="rank 70"):
        generate(model, P, drafter=drafter, tree=[[70]], backend="reference", max_new_tokens=4)


@pytest.mark.requires("native", op="commit_kv")
def test_deep_tree_beyond_native_commit_kv_is_refused_before_work(model, monkeypatch):  # 2
    d = hk.new_drafter(model, kind="medusa", num_heads=40)
    no_work(model, monkeypatch)
    with pytest.raises(ValueError, match="commits at most 32"):
        generate(model, P, drafter=d, tree="chain-32", backend="native", max_new_tokens=4)
    monkeypatch.undo()
    out = generate(model, P, drafter=d, tree="chain-32", backend="reference", max_new_tokens=4, eos_token_id=[])
    assert len(out.sequences[0]) == 4  # the reference commit has no such limit


@pytest.mark.parametrize("input_ids,exc,msg", [  # issue 47, 4: the type is named, not the vocabulary
    ([[6403.0, 5]], TypeError, r"prompt 0 has token id 6403.0 at position 0, a float: token ids must be ints"),
    ([[1, 2], [3, True]], TypeError, r"prompt 1 has token id True at position 1, a bool"),
    ([[1, "5"]], TypeError, r"prompt 0 has token id '5' at position 1, a str"),
    ([np.array([1.0, 2.0])], TypeError, r"token id 1.0 at position 0, a float"),
    (torch.zeros(1, 3, dtype=torch.long, device="meta"), ValueError, r"input_ids is a tensor on the meta device"),
    ([[1, 2], torch.zeros(3, dtype=torch.long, device="meta")], ValueError, r"prompt 1 is a tensor on the meta device"),
])
def test_token_ids_of_the_wrong_type_are_refused_before_work(model, monkeypatch, input_ids, exc, msg):
    no_work(model, monkeypatch)
    with pytest.raises(exc, match=msg):
        generate(model, input_ids, max_new_tokens=4)


def test_numpy_token_ids_are_accepted(model):  # 7
    want = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=5, eos_token_id=[]).sequences
    as_np = [np.array([1, 2, 3]), [np.int64(4), np.int32(5)]]
    assert generate(model, as_np, max_new_tokens=np.int64(5), eos_token_id=[np.int64(100)]).sequences == want
    assert generate(model, np.array([[1, 2, 3]]), max_new_tokens=5, eos_token_id=[]).sequences == want[:1]


def test_keyboard_interrupt_from_a_streamer_carries_the_partial_output(model):  # 11
    seen = []

    def streamer(b, tokens):
        seen.extend(tokens)
        if len(seen) >= 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as err:  # still a KeyboardInterrupt: Ctrl-C handlers keep working
        generate(model, P, max_new_tokens=10, eos_token_id=[], streamer=streamer)
    assert isinstance(err.value, GenerationInterrupted)
    full = generate(model, P, max_new_tokens=10, eos_token_id=[]).sequences[0]
    assert err.value.output.sequences[0] == seen == full[:3]
