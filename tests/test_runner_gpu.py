"""The decode runner's CUDA graphs (hydra_kernels/runner, issue 43) on a GPU: the GPU tier (make gpu; skipped
without CUDA). The CPU tier checks the same step functions and buffers without graphs (tests/test_runner.py).

- graph-replayed generate() (cuda_graphs=True, every step captured: no capture failure warning) emits eager
  generate()'s (cuda_graphs=False) tokens, token for token and step for step, in float32 and bfloat16: plain
  greedy with ragged prompts (3 sequences: a bucket of 4) and sequences stopping at different steps, and
  every drafter family (test_drafters_on_device's list);
- a second generate() call replays the graphs the first captured (no new capture), and the default
  (cuda_graphs=None) on a CUDA model is the graphs;
- seeded sampling through graphs, plain and speculative rejection sampling: reproducible, and the exactness
  harness's G-test against the exact law.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels import runner as R
from hydra_kernels.generate import generate
from test_drafters_on_device import KINDS, make
from test_llama_vs_transformers import make_hf
import test_sampling_exactness as exact

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

PROMPTS = [[5, 17, 3, 44, 9, 5, 17, 3], [2, 8], [60, 61, 62, 63, 64, 65, 66, 67, 60, 61, 62]]
NEW = 24


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def model(request):
    return hk.Llama.from_hf(make_hf("gqa3-tied", seed=5)).to("cuda", request.param)


def graphs(model) -> R.CudaGraphs:
    return R.runner_for(model, "graphs").executor


def run_both(fn):
    """(fn(cuda_graphs=False), fn(cuda_graphs=True)), the graph run with any runner warning an error (a
    capture that failed would warn and run eagerly: the comparison would be vacuous)."""
    eager = fn(cuda_graphs=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        replayed = fn(cuda_graphs=True)
    return eager, replayed


def assert_same(got, want, what):
    assert got.sequences == want.sequences, f"{what}: graph-replayed tokens differ from eager"
    assert got.accept_lengths == want.accept_lengths and got.step_nodes == want.step_nodes, what


def test_plain_greedy_graphs_equal_eager(model):
    eager = generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=[], cuda_graphs=False)
    eos = [eager.sequences[0][4], eager.sequences[1][9]]
    for e in ([], eos):
        want, got = run_both(lambda **kw: generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=e, **kw))
        assert_same(got, want, f"plain greedy, eos {e}")
    ex = graphs(model)
    assert ex.entries and all(v is not None for v in ex.entries.values()), "a plain step was not captured"


def test_second_call_reuses_the_graphs_and_none_means_graphs(model):
    run = lambda **kw: generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=[], **kw)  # noqa: E731
    first = run(cuda_graphs=True)
    ex = graphs(model)
    captured = dict(ex.entries)
    replays = ex.replays
    second = run()  # cuda_graphs=None: on a CUDA model, the graphs
    assert second.sequences == first.sequences
    assert ex.entries.keys() == captured.keys() and all(ex.entries[k] is captured[k] for k in captured), \
        "a graph was recaptured"
    assert ex.replays - replays == second.num_steps, "not every step replayed a cached graph"


def test_a_longer_request_recaptures_after_its_cache_is_replaced(model):
    """A request that needs more KV rows replaces its bucket's cache, and with it every graph of the bucket;
    the next capture must not go into the pool those graphs released (torch's allocator asserted there on an
    H200, 2026-11-27)."""
    R.runner_for(model, "graphs").release()
    for n in (8, 200):  # the second needs a longer cache (the model has 256 positions): the first's graphs dropped
        want, got = run_both(lambda **kw: generate(model, PROMPTS, max_new_tokens=n, eos_token_id=[], **kw))
        assert_same(got, want, f"plain greedy, {n} tokens")
    assert graphs(model).entries and all(v is not None for v in graphs(model).entries.values())


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculative_graphs_equal_eager(model, kind):
    drafter, tree = make(model, kind)
    want, got = run_both(lambda **kw: generate(model, PROMPTS, drafter=drafter, tree=tree, max_new_tokens=NEW,
                                               eos_token_id=[], **kw))
    assert_same(got, want, f"{kind} ({model.dtype})")
    entries = graphs(model).entries
    assert any(k[0] == "spec" for k in entries), "no speculative step was captured"
    assert all(v is not None for v in entries.values()), "a step's capture failed (it ran eagerly)"


@pytest.fixture(scope="module")
def law_model():
    """test_sampling_exactness's enumerable model on the CPU in float32 (the exact law) and on the GPU."""
    hf = exact.law_hf()
    return hk.Llama.from_hf(hf), hk.Llama.from_hf(hf).to("cuda")


@pytest.mark.parametrize("name", ["plain", "plain-top_p", "hydra", "per-sequence-trees-top_k-top_p"])
def test_seeded_sampling_through_graphs_is_exact(law_model, name):
    """Plain sampling and speculative rejection sampling (a static tree; per-sequence trees padded to the
    step's budget) replayed from graphs: reproducible, every step captured, and the exact law."""
    cpu, dev = law_model
    kind, temperature, top_k, top_p, _ = exact.SETTINGS[name]
    drafter = lambda: exact.make_drafter(dev, kind)  # noqa: E731 (a fresh drafter per run: same proposals)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out, hist = exact.sample(dev, drafter(), exact.PROMPTS[:1], temperature, top_k, top_p, "rejection")
        again, _ = exact.sample(dev, drafter(), exact.PROMPTS[:1], temperature, top_k, top_p, "rejection")
    assert again.sequences == out.sequences, "the same seed drew different tokens"
    entries = graphs(dev).entries
    step = "plain" if kind is None else "spec"
    sampler_at = 4 if kind is None else 5  # the key's sampler constants (runner/decode.py)
    assert any(k[0] == step and k[sampler_at] is not None for k in entries), "sampling was not captured"
    assert all(v is not None for v in entries.values()), "a step's capture failed (it ran eagerly)"
    assert exact.g_test(hist[0], exact.exact_law(cpu, exact.PROMPTS[0], temperature, top_k, top_p)) > 1e-3 / 4
