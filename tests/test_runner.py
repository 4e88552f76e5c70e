"""The decode runner (hydra_kernels/runner, issue 43) on the CPU: its static-buffer path, run without graphs
(runner.static_buffers(): the buffers, step functions, batch padding and KV buckets that CUDA graphs replay),
against the eager loop of generate().

- plain decoding: greedy token for token, ragged prompts (3 sequences padded to a bucket of 4), sequences
  stopping at different steps (EOS); sampling: seeded and reproducible, drawn from the exact law
  (test_sampling_exactness's G-test), the Philox inverse-CDF sampler never drawing a token of probability 0;
- greedy speculative decoding: every drafter family (test_drafters_on_device's list) token for token and
  step for step, and every family with a budget that changes mid-run (test_budget's table);
- the step functions trace whole (torch.compile(fullgraph=True, dynamic=False), graphs.Compiled) with the
  same tokens, with the reference ops and Triton's (interpreted), and trace once per key: no host int that
  changes per step reaches a traced (or captured) step; a negative control shows the count would catch one;
- the warm-up before a capture (graphs.warm_up: the step run and undone) leaves the run unchanged;
- the buffers are kept across calls (per batch bucket) and released on request; the benchmark's smoke run;
- cuda_graphs: its argument check, the warning (once) where graphs cannot apply, the eager fallback.
The same comparisons with CUDA graphs replayed are the GPU tier's (tests/test_runner_gpu.py).
"""
from __future__ import annotations

import warnings

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels import runner as R
from hydra_kernels.generate import generate
from test_budget import PROMPTS as BUDGET_PROMPTS, make as budget_make, varying_table, FAMILIES as BUDGET_FAMILIES
from test_drafters_on_device import KINDS, make
from test_llama_vs_transformers import make_hf
import test_sampling_exactness as exact

PROMPTS = [[5, 17, 3, 44, 9, 5, 17, 3], [2, 8], [60, 61, 62, 63, 64, 65, 66, 67, 60, 61, 62]]  # 3: bucket 4
NEW = 24


@pytest.fixture(scope="module")
def model():
    return hk.Llama.from_hf(make_hf("gqa3-tied", seed=5))


@pytest.fixture(scope="module")
def plain(model):
    return generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=[])


def static(fn, executor=None):
    with R.static_buffers(executor):
        return fn()


def assert_same(got, want, what):
    assert got.sequences == want.sequences, f"{what}: tokens differ"
    assert got.accept_lengths == want.accept_lengths, f"{what}: steps differ"
    assert got.num_steps == want.num_steps and got.step_nodes == want.step_nodes, what


def test_buckets():
    assert [R.batch_bucket(b) for b in (1, 2, 3, 5, 9, 13, 17, 64, 65, 100)] == [1, 2, 4, 8, 12, 16, 24, 64, 80, 112]
    assert R.kv_bucket(1, 4096) == R.KV_MIN == R.kv_bucket(R.KV_MIN, 4096)
    assert R.kv_bucket(R.KV_MIN + 1, 4096) == 2 * R.KV_MIN and R.kv_bucket(3000, 4096) == 4096
    assert R.kv_bucket(40, 33) == 33  # never past the buffer


def test_eager_steps_on_cuda_read_the_runners_bucket(model, monkeypatch):
    """Llama.step's attention reads kv_bucket rows on CUDA (what the graphs read: an eager step then splits
    and tunes attention as its replay does) and its exact bound elsewhere (the CPU unchanged)."""
    from hydra_kernels.model import kv_cache, llama

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [kv_cache.attention_rows(n, 4096, cuda) for n in (1, 130, 256, 257, 5000)] == [256, 256, 256, 512, 4096]
    assert [kv_cache.attention_rows(n, 4096, cpu) for n in (1, 130, 257)] == [1, 130, 257]
    assert kv_cache.attention_rows(None, 300, cpu) == kv_cache.attention_rows(None, 300, cuda) == 300
    seen = []
    real = llama.attention_rows
    monkeypatch.setattr(llama, "attention_rows", lambda *a: seen.append(a) or real(*a))
    cache = model.new_kv_cache(1, 64)
    model.prefill(torch.tensor([[1, 2, 3]]), torch.tensor([3], dtype=torch.int32), cache)
    model.step(torch.tensor([[4]]), cache, kv_len=4)
    assert seen == [(4, 64, cpu)]  # the one place a step's rows are decided


# ---- plain decoding -------------------------------------------------------------------------------
def test_plain_greedy_equals_eager(model, plain):
    got = static(lambda: generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=[]))
    assert_same(got, plain, "plain greedy")


def test_plain_greedy_sequences_stopping_at_different_steps(model, plain):
    """EOS tokens taken from the eager output so that the sequences stop after 5, 10 and 24 tokens (or
    where an EOS comes first); a second call reuses the runner's buffers and gives the same."""
    eos = [plain.sequences[0][4], plain.sequences[1][9]]
    want = generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=eos)
    lens = [len(s) for s in want.sequences]
    assert len(set(lens)) > 1, f"the sequences should stop at different steps: {lens}"
    with R.static_buffers():
        got = generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=eos)
        again = generate(model, PROMPTS[:2], max_new_tokens=NEW, eos_token_id=eos)  # bucket 2: other buffers
        third = generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=eos)  # bucket 4 again: reused
    assert_same(got, want, "plain greedy with EOS")
    assert_same(third, want, "plain greedy with EOS, buffers reused")
    runner = R.runner_for(model, "static", R.Eager())
    with R.static_buffers(runner.executor):
        generate(model, PROMPTS, max_new_tokens=2)
        cache = runner.buffers[4].cache
        generate(model, PROMPTS, max_new_tokens=2)
        assert runner.buffers[4].cache is cache  # kept across calls
        runner.release()
        assert not runner.buffers
        assert generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=eos).sequences == want.sequences
    assert again.sequences == generate(model, PROMPTS[:2], max_new_tokens=NEW, eos_token_id=eos).sequences


def test_plain_sampling_is_seeded(model):
    run = lambda seed: static(lambda: generate(model, PROMPTS, max_new_tokens=NEW, temperature=0.8, top_k=20,  # noqa: E731
                                               seed=seed, eos_token_id=[])).sequences
    a, b, c = run(3), run(3), run(4)
    assert a == b and a != c
    assert all(len(s) == NEW for s in a)


def test_sample_tokens_draws_only_allowed_tokens_at_their_rates():
    """sample_tokens over [N, V] logits with top-k: no token outside the top-k, frequencies near the law,
    the offset advanced by N per call (fresh noise per call)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 2
    logits[:, 7] = float("-inf")
    s = R.Sampler(0.9, 6, 1.0, torch.tensor([123]), torch.zeros(1, dtype=torch.long))
    draws = torch.stack([R.sample_tokens(logits, s) for _ in range(3000)])  # [3000, 4]
    assert int(s.offset) == 3000 * 4
    p = hk.sampling.sampling_probs(logits, 0.9, 6, 1.0)
    for row in range(4):
        freq = torch.bincount(draws[:, row], minlength=50).double() / draws.shape[0]
        assert (freq[p[row] == 0] == 0).all(), "a token of probability 0 was drawn"
        assert (freq - p[row].double()).abs().max() < 0.04


@pytest.mark.parametrize("name", ["plain", "plain-top_p"])
def test_plain_sampling_through_the_runner_is_exact(name):
    """The runner's sampler (Philox inverse CDF, the prefill's token too) against the enumerable exact law."""
    m = law_model()
    _, temperature, top_k, top_p, _ = exact.SETTINGS[name]
    with R.static_buffers():
        _, hist = exact.sample(m, None, exact.PROMPTS, temperature, top_k, top_p, None)
    law = exact.exact_law(m, exact.PROMPTS[0], temperature, top_k, top_p)
    assert exact.g_test(hist[0], law) > 1e-3 / 2


def law_model():
    """test_sampling_exactness's enumerable model: a 1-layer Llama over exact.V tokens, sharpened."""
    return hk.Llama.from_hf(exact.law_hf())


RUNNER_REJECTION = {  # name -> (exact.make_drafter kind, temperature, top_k, top_p)
    "hydra": ("hydra", 0.8, 0, 1.0),  # a static tree: one graph
    "per-sequence-trees-top_k-top_p": ("random-trees", 1.0, 5, 0.9),  # TreeBatch padded to the step's budget
    "hydra-varying-budget": ("hydra-budget", 0.8, 0, 1.0),  # full-tree steps and root-only steps
    "sampled-hydra": ("sampled-hydra", 0.8, 0, 1.0),  # draft_probs: verified eagerly (the generator's noise)
}


@pytest.mark.parametrize("name", list(RUNNER_REJECTION))
def test_speculative_rejection_sampling_through_the_runner_is_exact(name):
    """The runner's rejection step (verify, the walk with Philox uniforms, the next root by inverse CDF,
    commit) against the exact law of the first 3 tokens, through the static-buffer path the graphs replay;
    and the same seed draws the same tokens."""
    m = law_model()
    kind, temperature, top_k, top_p = RUNNER_REJECTION[name]
    steps = []
    real = R.DecodeRunner.spec
    with R.static_buffers(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(R.DecodeRunner, "spec", lambda self, *a, **kw: steps.append(kw["sampler"]) or real(self, *a, **kw))
        out, hist = exact.sample(m, exact.make_drafter(m, kind), exact.PROMPTS[:1], temperature, top_k, top_p,
                                 "rejection")
        again, _ = exact.sample(m, exact.make_drafter(m, kind), exact.PROMPTS[:1], temperature, top_k, top_p,
                                "rejection")
    if kind.startswith("sampled-"):  # every proposal carries draft_probs: none reaches the runner's step
        assert steps == []
    else:
        assert steps and all(s is not None for s in steps), "the steps did not go through the runner's rejection step"
    assert again.sequences == out.sequences, "the same seed drew different tokens"
    lens = torch.tensor([a for row in out.accept_lengths for a in row])
    assert (lens > 1).float().mean() > 0.05 and (lens == 1).float().mean() > 0.05, lens.float().mean()
    law = exact.exact_law(m, exact.PROMPTS[0], temperature, top_k, top_p)
    assert exact.g_test(hist[0], law) > 1e-3 / (len(RUNNER_REJECTION) + 1)


def test_greedy_steps_with_sampled_drafts_still_replay(model, plain):
    """Heads that sample their drafts attach draft_probs; greedy acceptance ignores them, so those steps
    still go through the runner (only a sampled run's min(1, p/q) steps are eager)."""
    drafter, tree = make(model, "hydra")
    drafter.draft_temperature = 0.7
    calls = []
    real = R.DecodeRunner.spec
    run = lambda: generate(model, PROMPTS, drafter=drafter, tree=tree, max_new_tokens=NEW, eos_token_id=[])  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(R.DecodeRunner, "spec", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
        got = static(run)
    assert calls and got.sequences == plain.sequences


def test_inverse_cdf_sample_never_draws_a_zero_weight_token():
    """Rows with many zero weights (rejected children, filtered tokens), uniforms on a fine grid and on the
    cdf's own boundaries: every draw has positive weight, and the draws follow the weights."""
    from hydra_kernels.sampling import inverse_cdf_sample

    g = torch.Generator().manual_seed(0)
    w = torch.rand(64, 50, generator=g) * (torch.rand(64, 50, generator=g) < 0.4)
    w[:, 7] = 0.3  # every row has some mass
    cdf = w.cumsum(-1)
    edges = (cdf / cdf[:, -1:]).clamp(max=1 - 2**-24)  # u exactly at each boundary
    for u in [torch.rand(64, generator=g) for _ in range(200)] + list(edges.T):
        tok = inverse_cdf_sample(w, u.contiguous())
        assert bool((w.gather(1, tok[:, None]) > 0).all())
    counts = torch.bincount(inverse_cdf_sample(w[:1].expand(200000, -1), torch.rand(200000, generator=g)), minlength=50)
    assert torch.allclose(counts / 200000, w[0] / w[0].sum(), atol=0.01)


def test_runner_noise_reused_every_step_is_refused_by_the_same_test(monkeypatch):
    """Negative control: a rejection step whose Philox counter never advances (every replay the same
    uniforms) draws correlated tokens; the same test must refuse it."""
    from hydra_kernels.runner import steps as S

    real = S.philox_draws

    def stuck(s, n):
        u = real(s, n)
        s.offset.sub_(n)  # the counter put back: the next step draws the same uniforms
        return u

    monkeypatch.setattr(S, "philox_draws", stuck)
    m = law_model()
    with R.static_buffers():
        _, hist = exact.sample(m, exact.make_drafter(m, "hydra"), exact.PROMPTS[:1], 0.8, 0, 1.0, "rejection")
    p = exact.g_test(hist[0], exact.exact_law(m, exact.PROMPTS[0], 0.8, 0, 1.0))
    assert p < exact.NEGATIVE_P, f"reused noise passed the exactness test (p = {p:.2e}): the harness has no power"


# ---- greedy speculative decoding ------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculative_equals_eager(model, plain, kind):
    """Every family through the runner (static trees: a graph per tree; per-sequence trees padded to the
    step's node budget) emits the eager loop's tokens in the same steps, and so plain greedy's."""
    drafter, tree = make(model, kind)
    want = generate(model, PROMPTS, drafter=drafter, tree=tree, max_new_tokens=NEW, eos_token_id=[])
    got = static(lambda: generate(model, PROMPTS, drafter=drafter, tree=tree, max_new_tokens=NEW, eos_token_id=[]))
    assert_same(got, want, kind)
    assert got.sequences == plain.sequences
    if kind != "mlp_speculator":
        assert got.mean_accepted_tokens > 1, f"{kind}: no draft accepted, so the accept path went untested"


@pytest.mark.parametrize("name", list(BUDGET_FAMILIES))
def test_budget_changing_mid_run_equals_eager(model, name):
    """A budget that changes every step or two (plain steps, subtrees, the full tree: one graph each),
    test_budget's prompts (3: bucket 4) and reference kernels (attention over the whole KV bucket)."""
    d, tree = budget_make(model, name)
    d.budget_tables["cpu"] = table = varying_table(d, tree, model)
    run = lambda: generate(model, BUDGET_PROMPTS, drafter=d, tree=tree, budget="auto", max_new_tokens=NEW,  # noqa: E731
                           eos_token_id=[], backend="reference")
    want = run()
    got = static(run)
    assert_same(got, want, name)
    assert set(got.step_nodes) >= {1, table.full}


def test_speculative_with_sequences_stopping_at_different_steps(model, plain):
    drafter, tree = make(model, "hydra")
    eos = [plain.sequences[0][4], plain.sequences[1][9]]
    run = lambda: generate(model, PROMPTS, drafter=drafter, tree=tree, max_new_tokens=NEW, eos_token_id=eos)  # noqa: E731
    want = run()
    assert len({len(s) for s in want.sequences}) > 1
    assert_same(static(run), want, "hydra with EOS")


def run_of(model, kind):
    """generate() over PROMPTS as `kind` decodes them: None plain greedy, "sampling" seeded, "rejection" seeded
    speculative sampling (Hydra), else a drafter family (greedy)."""
    if kind is None:
        return lambda: generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=[])
    if kind == "sampling":
        return lambda: generate(model, PROMPTS, max_new_tokens=NEW, temperature=0.7, seed=1, eos_token_id=[])
    if kind == "rejection":  # speculative sampling: the runner's rejection step
        drafter, tree = make(model, "hydra")
        return lambda: generate(model, PROMPTS, drafter=drafter, tree=tree, max_new_tokens=NEW, temperature=0.7, seed=1,
                                eos_token_id=[])
    drafter, tree = make(model, kind)
    return lambda: generate(model, PROMPTS, drafter=drafter, tree=tree, max_new_tokens=NEW, eos_token_id=[])


# ---- traced steps: no graph break, no per-step host int ------------------------------------------
@pytest.mark.parametrize("kind", [None, "sampling", "rejection", "hydra", "eagle-3", "ngram"])
def test_traced_steps_equal_eager_and_trace_once_per_key(model, plain, kind):
    """graphs.Compiled traces each runner key's step with torch.compile(fullgraph=True, dynamic=False): a graph
    break (a host read) fails, and a host int that changes per step would trace again every step. Each key
    traces exactly once over the run, the keys are few (the runs' contexts stay in one KV bucket), and
    the tokens are the eager loop's (greedy) or the static path's (sampling)."""
    torch._dynamo.reset()
    ex = R.Compiled()
    run = run_of(model, kind)
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256):
        got = static(run, ex)
    want = static(run) if kind in ("sampling", "rejection") else run()
    assert_same(got, want, f"traced {kind}")
    assert ex.fns and ex.compiles == len(ex.fns), f"{ex.compiles} traces for {len(ex.fns)} keys: a key traced again"
    assert got.num_steps > len(ex.fns), "fewer steps than keys: the test has no power"
    if kind in (None, "sampling"):
        assert len(ex.fns) == 1


@pytest.mark.backends("reference", "triton")
@pytest.mark.parametrize("kind", [None, "eagle-3"])
def test_traced_steps_with_each_kernel_backend(model, backend, kind):
    """The same trace with the reference ops and with Triton's (torch.library ops, kernels interpreted here):
    the ops a CUDA graph captures on a GPU. eagle-3: per-sequence trees and captured layer inputs."""
    torch._dynamo.reset()
    ex = R.Compiled()
    drafter, tree = make(model, kind) if kind else (None, None)
    # 4 tokens: 3 steps of the one key (most of this test's time is Triton's kernels interpreted: 8 tokens took 34 /
    # 63 s of a CI run, 2026-11-30)
    run = lambda: generate(model, PROMPTS, drafter=drafter, tree=tree, max_new_tokens=4, eos_token_id=[],  # noqa: E731
                           backend=backend)
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256):
        got = static(run, ex)
    assert_same(got, run(), f"traced {kind} on {backend}")
    assert ex.compiles == len(ex.fns) == 1 and got.num_steps >= 2  # the trace replayed, not only made


class WarmedEager(R.Eager):
    """CudaGraphs' sequence on the CPU: the first call of a key warms up (graphs.warm_up: the step run and
    undone, twice) before its real run, as a capture does. If a step mutated anything its snapshot misses,
    the run would drift from the eager loop."""

    def __init__(self):
        self.warmed = set()

    def run(self, key, step, restore, hold=None):
        if key not in self.warmed:
            self.warmed.add(key)
            R.graphs.warm_up(step, restore(), 2)
        return step()


@pytest.mark.parametrize("kind", [None, "sampling", "rejection", "hydra", "eagle-3", "ngram", "lookahead"])
def test_warm_up_before_capture_is_undone(model, kind):
    run = run_of(model, kind)
    ex = WarmedEager()
    got = static(run, ex)
    assert len(ex.warmed) >= 1
    assert_same(got, static(run) if kind in ("sampling", "rejection") else run(), f"warmed {kind}")


class NoHostTensors(R.Eager):
    """Runs each step with torch.tensor / torch.as_tensor refusing: a step that builds a tensor from host values
    copies host memory to the device on every call, which a CUDA capture refuses (an H200 run, 2026-11-27:
    philox_uniform's scale built that way failed every sampling capture). Tracing does not catch it: dynamo
    folds such a tensor into a constant."""

    def run(self, key, step, restore, hold=None):
        def refuse(*args, **kwargs):
            raise AssertionError(f"a {key[0]} step built a tensor from host values")

        real = torch.tensor, torch.as_tensor
        torch.tensor, torch.as_tensor = refuse, refuse
        try:
            return step()
        finally:
            torch.tensor, torch.as_tensor = real


@pytest.mark.parametrize("kind", [None, "sampling", "rejection", "hydra", "eagle-3", "ngram"])
def test_steps_build_no_tensor_from_host_values(model, kind):
    run = run_of(model, kind)
    assert_same(static(run, NoHostTensors()), static(run), f"{kind} without host tensors")


def test_a_per_step_host_int_would_be_caught(model):
    """Negative control of the test above: the plain step traced with the exact kv_len of each step (the
    eager loop's host int) traces once per step; with a constant kv_len (a bucket), once."""
    torch._dynamo.reset()
    ex = R.Compiled()
    bufs = R.runner_for(model, "static", ex).start(1, 64)
    cache = bufs.cache
    plan = model.backend_plan("auto")
    for kv in (16, 16, 16, 17, 18):  # a bucket three times, then what a captured step must never take
        cache.seqlens.fill_(5)

        def step():
            return R.plain_step(model, cache, bufs.tokens, bufs.live, kv_len=kv, backends=plan)
        ex.run(("probe",), step, None)
    assert ex.compiles == 3


# ---- the benchmark's CPU smoke run ------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke run")
def test_generate_graphs_bench_cpu(tmp_path):
    """bench_generate_device --graphs at a one-layer SmolLM2 slice: every decoder and mode timed (off CUDA the
    "graphs" rows run the static-buffer path), identical tokens, the CSV named by device and date."""
    import sys

    from helpers import ROOT, load_script

    sys.path.insert(0, str(ROOT / "benchmarks"))
    rows = load_script("benchmarks/bench_generate_device.py").main(
        ["--graphs", "--models", "smollm2-135m", "--layers", "1", "--batch", "1", "3", "--compiled-batches",
         "--prompt-tokens", "16", "--new-tokens", "8", "--reps", "1", "--dtype", "float32", "--out", str(tmp_path)])
    assert [(r["decoder"], r["mode"], r["batch"]) for r in rows[:5]] == [
        ("ours plain", "eager", 1), ("ours plain", "graphs", 1), ("ours n-gram", "eager", 1),
        ("ours n-gram", "graphs", 1), ("transformers generate", "eager", 1)]
    assert len(rows) == 12 and all(r["tokens_per_s"] > 0 and r["copy_fraction"] > 0 for r in rows)
    assert all(r["identical"] == 1.0 for r in rows if r["mode"] == "graphs" and "sampled" not in r["decoder"])
    assert [r["same_as_plain"] for r in rows if r["decoder"] == "ours n-gram"] == [1.0] * 4  # lossless on the CPU
    sampled = [r for r in rows if r["decoder"] == "ours n-gram sampled"]
    assert [(r["mode"], r["batch"]) for r in sampled] == [("eager", 1), ("graphs", 1)]  # --sampled-batches 1
    assert all(r["tokens_per_s"] > 0 and r["identical"] == "" for r in sampled)
    assert len(list(tmp_path.glob("generate_graphs_cpu_*.csv"))) == 1


# ---- cuda_graphs ------------------------------------------------------------------------------------
def test_cuda_graphs_argument_and_fallback_warnings(model, plain):
    with pytest.raises(TypeError, match="cuda_graphs must be None, True or False"):
        generate(model, PROMPTS, max_new_tokens=2, cuda_graphs="yes")
    R._WARNED.clear()
    with pytest.warns(RuntimeWarning, match="cuda_graphs=True needs a CUDA model"):
        out = generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=[], cuda_graphs=True)
    assert out.sequences == plain.sequences
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason: the second run is silent
        generate(model, PROMPTS, max_new_tokens=2, eos_token_id=[], cuda_graphs=True)
        generate(model, PROMPTS, max_new_tokens=2, eos_token_id=[])  # the CPU default: no runner, no warning
    assert not model.__dict__.get("_decode_runners", {}).get("graphs")
    drafter, tree = make(model, "hydra")
    with pytest.warns(RuntimeWarning, match="typical acceptance is not captured"):
        static(lambda: generate(model, PROMPTS, drafter=drafter, tree=tree, max_new_tokens=4, temperature=0.8,
                                acceptance="typical", seed=0, eos_token_id=[]))
