"""The kernel benchmark scripts users run, on the smallest shapes (Triton under the interpreter):
they run end to end, check every peer against the reference, and write their CSV and plot."""
import csv
import math
import os
import random
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tier: Triton interpreter")


def _script(script):
    """benchmarks/<script>.py as a module (its sibling modules importable, as when it runs as a script)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    return load_script(f"benchmarks/{script}.py")


def _run_returning(script, argv):
    return _script(script).main(argv)


def _run(script, argv):
    _run_returning(script, argv)


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_bench_tree_attn_runs(tmp_path):
    _run("bench_tree_attn", ["--models", "smollm2-135m", "--contexts", "40", "--T", "3", "--batch", "2", "--reps", "1",
                             "--out", str(tmp_path)])
    rows = _rows(tmp_path / "tree_attn.csv")
    peers = {r["peer"] for r in rows}
    assert {"ours (triton)", "reference", "sdpa dense mask", "flex tree blockmask"} <= peers
    ours = next(r for r in rows if r["peer"] == "ours (triton)")
    assert float(ours["max_err"]) < 1e-4 and float(ours["us"]) > 0 and (tmp_path / "tree_attn.png").exists()
    for r in rows:  # a peer either ran and matched or says why not
        assert (r["note"] != "") or (not math.isnan(float(r["max_err"])) and float(r["max_err"]) < 1e-4), r


def test_bench_heads_runs(tmp_path):
    _run("bench_heads", ["--nodes", "3", "--k", "4", "--out", str(tmp_path)])
    rows = _rows(tmp_path / "heads.csv")
    assert {r["op"] for r in rows} == {"hydra first layer", "resblock", "lm head top-4", "lm head argmax"}
    assert all(float(r["us"]) > 0 for r in rows)
    assert all(float(r["max_err_vs_ours"]) < 1e-4 for r in rows if r["op"] in ("hydra first layer", "resblock"))


def test_bench_verify_runs(tmp_path):
    _run("bench_verify", ["--model", "smollm2-135m", "--context", "32", "--nodes", "10", "--out", str(tmp_path)])
    rows = _rows(tmp_path / "verify.csv")
    assert {r["backend"] for r in rows} >= {"reference", "triton"}
    assert all(r["matches_reference"] == "True" for r in rows)


def test_bench_cpu_step_runs():
    from hydra_kernels.model.packed_linear import packed_linear_available

    if not packed_linear_available():
        pytest.skip("no packed CPU kernel here (extension not built or no AVX-512)")
    rows = _run_returning("bench_cpu_step", ["--reps", "1", "--context", "20"])
    assert [r["T"] for r in rows] == [1, 6, 16] and all(r["packed_ms"] > 0 and r["mkl_ms"] > 0 for r in rows)


def test_bench_verify_step_runs(tmp_path):
    from hydra_kernels.model.tree_step import TREE_GREEDY_STEP
    from hydra_kernels.model.packed_linear import packed_linear_available

    if TREE_GREEDY_STEP is None or not packed_linear_available():
        pytest.skip("no native verify step here (extension not built or no AVX-512)")
    rows = _run_returning("bench_verify_step", ["--batches", "1", "2", "--sizes", "1", "3", "--context", "20",
                                                "--rounds", "1", "--calls", "2", "--out", str(tmp_path)])
    assert [(r["batch"], r["T"]) for r in rows] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(r["native_ms"] > 0 and r["module_ms"] > 0 and r["plain_ms"] > 0 for r in rows)
    assert len(_rows(tmp_path / "verify_step.csv")) == 4
    from hydra_kernels.ops.int8_dot_linear import int8_dot_linear_available

    if int8_dot_linear_available():  # the model on int8 activations: its native and module steps agree too
        rows = _run_returning("bench_verify_step", ["--batches", "1", "--sizes", "2", "--context", "20", "--rounds",
                                                    "1", "--calls", "2", "--activations", "int8"])
        assert [(r["batch"], r["T"]) for r in rows] == [(1, 2)] and rows[0]["native_ms"] > 0


def test_bench_attend_share_runs(tmp_path):
    from hydra_kernels.model.plain_step import PLAIN_GREEDY_STEP
    from hydra_kernels.model.packed_linear import packed_linear_available

    if PLAIN_GREEDY_STEP is None or not packed_linear_available():
        pytest.skip("no native plain step here (extension not built or no AVX-512)")
    rows = _run_returning("bench_attend_share", ["--batch", "3", "--contexts", "40", "300", "--rounds", "1",
                                                 "--calls", "1", "--out", str(tmp_path)])
    assert [(r["batch"], r["context"]) for r in rows] == [(3, 40), (3, 300)]
    for r in rows:
        assert r["all_ms"] > 0 and r["one_finished_ms"] > 0 and r["none_ms"] > 0
        assert 0 < r["attention_share_bytes"] < 1
    assert rows[1]["attention_share_bytes"] > rows[0]["attention_share_bytes"]
    assert len(_rows(tmp_path / "attend_share.csv")) == 2
    with pytest.raises(SystemExit, match="at least 2"):
        _run("bench_attend_share", ["--batch", "1"])
    with pytest.raises(SystemExit, match="at least 1"):
        _run("bench_attend_share", ["--contexts", "0", "100"])


def test_bench_checkouts_runs():
    """Two checkouts (here the same one twice) in fresh processes: equal tokens, speeds for both modes."""
    res = _run_returning("bench_checkouts", ["--a", str(ROOT), "--b", str(ROOT), "--rounds", "1", "--prompts", "1",
                                             "--new-tokens", "6"])
    assert res["identical"] and res["steps"]["A"] == res["steps"]["B"] > 0
    assert set(res["tokens_per_s"]) == {"A plain", "A spec", "B plain", "B spec"}
    assert all(v[0] > 0 for v in res["tokens_per_s"].values())


def test_bench_sampling_runs(tmp_path):
    """Rejection vs typical vs plain sampling with a shipped drafter, one prompt x 8 tokens."""
    rows = _run_returning("bench_sampling", ["--prompts", "1", "--new-tokens", "8", "--kinds", "hydra",
                                             "--out", str(tmp_path)])
    assert [r["method"] for r in rows] == ["plain", "hydra rejection", "hydra typical"]
    assert all(r["tokens_per_s"] > 0 and r["tokens_per_step"] >= 1 for r in rows)
    assert (tmp_path / "bench_sampling.csv").exists() and (tmp_path / "bench_sampling.md").exists()


def test_bench_scaling_runs(tmp_path):
    """Plain vs speculative (budget table, full tree, the adaptive budget and a compared drafter) on the smallest
    grid, one round of two prompt sets: every output of every run lossless."""
    rows = _run_returning("bench_scaling", ["--batches", "1", "2", "--contexts", "short", "300", "--new-tokens", "4",
                                            "--compare", "medusa", "--adaptive",
                                            "--reps", "1", "--groups", "2", "--ratio-reps", "1", "--ratio-context", "200",
                                            "--attention-cycle-mib", "16",
                                            "--out", str(tmp_path)])
    assert [(r["batch"], r["context"]) for r in rows] == [(1, "short"), (2, "short"), (1, "300"), (2, "300")]
    assert all(r["table_identical"] == r["full_identical"] == r["medusa_identical"] == r["adaptive_identical"]
               == 2 * r["batch"] for r in rows)
    assert all(r["adaptive_ratio_min"] <= r["adaptive_ratio"] <= r["adaptive_ratio_max"] for r in rows)
    assert all(r["adaptive_policy_ms_per_step"] >= 0 and 1 <= r["adaptive_mean_nodes"] for r in rows)
    assert all(r["plain_tok_s"] > 0 and r["weight_gb_s"] > 0 and r["attention_gb_s"] > 0 for r in rows)
    assert rows[0]["plain_long_over_short"] > 0 and (tmp_path / "scaling.png").exists()


def test_bench_prefill_runs(tmp_path):
    """Chunked (3 chunks of 2 x 7 tokens), one piece and transformers' forward, on the embedded model."""
    rows = _run_returning("bench_prefill", ["--points", "2x20", "--reps", "1", "--chunk-tokens", "14",
                                            "--out", str(tmp_path)])
    (row,) = _rows(tmp_path / "prefill.csv")
    assert float(row["chunked_tok_s"]) > 0 and float(row["one_piece_tok_s"]) > 0 and float(row["transformers_tok_s"]) > 0
    assert float(row["max_abs_diff"]) < 1e-3 and rows[0]["max_abs_diff"] < 1e-3
    assert (tmp_path / "prefill.png").exists()


def test_bench_first_pass_runs(tmp_path):
    """The drafters' first pass beside the base prefill (a 20-token prompt, batch 2, untrained drafters)."""
    rows = _run_returning("bench_first_pass", ["--drafters", "new:amphista", "new:eagle", "new:hydra++", "--context",
                                               "20", "--batch", "2", "--reps", "1", "--out", str(tmp_path)])
    assert [r["drafter"] for r in rows] == ["base prefill", "new:amphista", "new:eagle", "new:hydra++"]
    assert all(r["median_s"] > 0 for r in rows) and len(_rows(tmp_path / "first_pass.csv")) == 4
    assert (tmp_path / "first_pass.png").exists()


def test_bench_drafters_runs(tmp_path):
    """The results table's script at its smallest: 2 MT-Bench prompts, 8 tokens, the shipped Hydra heads, n-gram
    and the combined drafter beside plain (no transformers peers), every row lossless."""
    _run("bench_drafters", ["--mtbench", "2", "--new-tokens", "8", "--batch", "2", "--kinds", "hydra",
                            "--no-transformers", "--batch1-every", "1", "--out", str(tmp_path)])
    rows = {r["decoding"]: r for r in _rows(tmp_path / "drafters.csv")}
    assert list(rows) == ["plain", "hydra", "ngram", "combined (ngram + hydra)"]
    assert all(r["identical"] in ("definition", "2/2") and float(r["tokens_per_s"]) > 0 for r in rows.values())
    assert float(rows["combined (ngram + hydra)"]["tokens_per_step"]) >= 1


def test_bench_one_prompt_runs(tmp_path):
    """make demo's prompt through plain, the shipped Hydra heads and the composed combined drafter, one round."""
    rows = _run_returning("bench_one_prompt", ["--drafters", "hydra", "combined", "--reps", "1", "--new-tokens", "8",
                                               "--out", str(tmp_path)])
    assert [r["decoder"] for r in rows] == ["plain", "hydra", "combined"]
    assert all(r["identical"] and r["tok_s"] > 0 and r["tokens_per_step"] >= 1 for r in rows)
    assert len(_rows(tmp_path / "one_prompt.csv")) == 3



def test_the_demo_times_both_paths_interleaved(monkeypatch):
    """make demo's timing (demo.timed_rounds): its prompt decoded speculatively and plainly, the order alternating
    round by round, medians of each path's tokens/s, every output checked against the streamed answer's (a wrong one
    shows)."""
    import hydra_kernels as hk
    import hydra_kernels.generate as gen
    from hydra_kernels.chat import chat_prompt_ids
    from hydra_kernels.demo import PROMPT, timed_rounds
    from hydra_kernels.drafters.registry import default_kind

    model, tok = hk.load_model()
    drafter = hk.load_drafter(model=model, kind=default_kind(batch_1=True))
    ids = chat_prompt_ids(tok, PROMPT)
    want = gen.generate(model, [ids], max_new_tokens=6).sequences
    order, real = [], gen.generate
    monkeypatch.setattr(gen, "generate", lambda *a, drafter=None, **k: order.append(drafter is not None) or real(
        *a, drafter=drafter, **k))
    spec, plain, same = timed_rounds(model, [ids], drafter, 6, tok, want, 3)
    assert order == [False, True, True, False, False, True] and same and spec > 0 and plain > 0
    assert not timed_rounds(model, [ids], drafter, 6, tok, [want[0][:-1] + [want[0][-1] + 1]], 1)[2]

def test_bench_cpu_peers_runs(tmp_path, capsys):
    """Our quantized plain and speculative decoding beside the fp32 path (llama.cpp and transformers are peers
    the smoke run leaves out: an optional build, and slow), one MT-Bench prompt and one --long prompt of
    --long-context tokens, one round; ours identical. A long context that llama.cpp's window cannot hold is
    refused before any work. Where the int8 dot kernel runs, our decoders on int8 activations too: their speculative
    tokens are their own plain decoding's."""
    from hydra_kernels.ops.int8_dot_linear import int8_dot_linear_available

    int8 = ["plain-int8", "combined-int8"] if int8_dot_linear_available() else []
    decoders = ["plain", "combined", *int8, "plain-fp32"]
    rows = _run_returning("bench_cpu_peers", ["--mtbench", "1", "--editing", "0", "--long", "1", "--long-context", "96",
                                              "--new-tokens", "6", "--rounds", "1",
                                              "--decoders", *decoders, "--out", str(tmp_path)])
    assert "(1 MT-Bench, 0 editing, 1 of 96 tokens)" in capsys.readouterr().out
    assert [r["decoder"] for r in rows] == decoders
    assert all(r["same_as_own_plain"] == "2/2" and r["e2e_tok_s"] > 0 and r["decode_tok_s"] > 0 for r in rows)
    assert all(r["same_as_fp32"] == "2/2" for r in rows if not r["decoder"].endswith("-int8"))
    assert len(_rows(tmp_path / "cpu_peers.csv")) == len(decoders)
    with pytest.raises(SystemExit):
        _run_returning("bench_cpu_peers", ["--long", "1", "--long-context", "4000", "--new-tokens", "128"])
    assert "must fit llama.cpp's 4096-token context" in capsys.readouterr().err


def test_bench_cpu_peers_reads_another_gguf_of_the_model(tmp_path, monkeypatch):
    """--gguf: both sides read that file (here a copy of the embedded one: another path, not the embedded digest)."""
    import shutil

    from hydra_kernels.model.pretrained import embedded_gguf_path

    monkeypatch.setenv("HYDRA_KERNELS_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / "smollm2-copy.gguf"
    shutil.copyfile(embedded_gguf_path(), copy)
    rows = _run_returning("bench_cpu_peers", ["--mtbench", "1", "--editing", "0", "--new-tokens", "6", "--rounds", "1",
                                              "--decoders", "plain", "combined", "--gguf", str(copy)])
    assert [r["decoder"] for r in rows] == ["plain", "combined"] and all(r["same_as_fp32"] == "1/1" for r in rows)
    assert any(p.name.startswith("smollm2-copy-") for p in (tmp_path / "cache").iterdir())


def test_bench_int8_agreement_runs(tmp_path):
    from hydra_kernels.ops.int8_dot_linear import int8_dot_linear_available

    if not int8_dot_linear_available():
        pytest.skip("no int8 dot kernel here (AVX-512 VNNI or AVX2)")
    rows = _run_returning("bench_int8_agreement", ["--prompts", "1", "--new-tokens", "8", "--out", str(tmp_path)])
    assert [r["prompt"] for r in rows] == [0, "all"] and rows[-1]["positions"] == 8
    assert 0.5 <= rows[-1]["top1_agreement"] <= 1 and 0 <= rows[-1]["kl_mean"] < 0.1
    assert len(_rows(tmp_path / "int8_agreement.csv")) == 2


def test_ab_adaptive_runs_and_restores_what_it_set(tmp_path):
    """Variants of the adaptive budget on the machine's clock, interleaved with plain decoding: a row per variant, every
    output identical to plain decoding, a variant's constants set for its runs only; the drafts counted: the table's
    one per drafted step, the adaptive budget's at least that (a draft its cut takes back to the root counts too); the
    policy of a git revision (@HEAD: the commit checked out) run beside it with a constant of its own, its steps timed
    too; a constant adaptive.py lacks, a revision git cannot show, a bad context, two variants of one name (their
    runs would be pooled under it) and a variant named plain (plain decoding's) are refused before the model loads; with
    --calibration, each adaptive variant's forecasts beside the share of those nodes right."""
    from hydra_kernels import adaptive

    wait, budget = adaptive.MAX_WAIT_DEAR, adaptive.AdaptiveBudget
    ab = _script("ab_adaptive")
    rows = ab.main(["--context", "600", "--prompts", "2", "--rounds", "1", "--new-tokens", "12", "--variants", "table",
                    "short:MAX_WAIT_DEAR=8", "@HEAD:MAX_WAIT_DEAR=8", "--calibration", "--out", str(tmp_path)])
    assert [r["variant"] for r in rows] == ["table", "short:MAX_WAIT_DEAR=8", "@HEAD:MAX_WAIT_DEAR=8"]
    assert all(r["identical"] == "2/2" and r["ratio_min"] <= r["ratio_median"] <= r["ratio_max"] for r in rows)
    # the table drafts past 512 tokens (its buckets: 128 and 2048 on a log scale)
    assert rows[0]["drafts_per_answer"] == rows[0]["drafted_steps_per_answer"] > 0
    assert all(r["drafts_per_answer"] >= r["drafted_steps_per_answer"] >= 0 for r in rows)
    assert all(0 <= r["plain_step_share"] <= 1 for r in rows)
    # the adaptive variant's steps timed by kind (observe to observe), the table's not at all (it runs no policy)
    kinds = ("plain", "refused", "drafted")
    table, short, head = rows
    assert table["plain_decoding_step_ms"] > 0 and all(table[f"step_share_{k}"] is None for k in kinds)
    assert all(r["plain_decoding_step_mean_ms"] > 0 for r in rows)
    assert table["policy_ms_per_step"] == 0 and short["policy_ms_per_step"] > 0 and head["policy_ms_per_step"] > 0
    assert abs(sum(short[f"step_share_{k}"] for k in kinds) - 1) < 1e-9
    assert abs(sum(head[f"step_share_{k}"] for k in kinds) - 1) < 1e-9
    assert all((short[f"step_ms_{k}"] is None) == (short[f"step_share_{k}"] == 0) for k in kinds)
    assert all(short[f"step_ms_{k}"] > 0 for k in kinds if short[f"step_ms_{k}"] is not None)
    assert all((short[f"step_mean_ms_{k}"] is None) == (short[f"step_ms_{k}"] is None) for k in kinds)
    assert all(short[f"step_mean_ms_{k}"] > 0 for k in kinds if short[f"step_mean_ms_{k}"] is not None)
    # --calibration: the forecasts of each adaptive variant's verified nodes beside the share of them right (the table
    # runs no policy: none); the adaptive variants verified some drafted nodes here
    cols = [(f"nodes_{p}_d{d}", f"forecast_{p}_d{d}", f"right_{p}_d{d}") for p in ("ngram", "heads") for d in (1, 2, 3)]
    assert all(table[n] == 0 and table[f] is None and table[a] is None for n, f, a in cols)
    for r in (short, head):
        assert sum(r[n] for n, _, _ in cols) > 0
        assert all((r[f] is None) == (r[n] == 0) for n, f, _ in cols)
        assert all(0 < r[f] <= 1 and 0 <= r[a] <= 1 for n, f, a in cols if r[n])
    assert adaptive.MAX_WAIT_DEAR == wait and adaptive.AdaptiveBudget is budget
    assert adaptive.AdaptiveBudget.observe is adaptive.AdaptiveBudget.__dict__["observe"]  # the timing hook undone
    at_head = ab.policy_at("HEAD")  # the class the run used (one load per revision)
    assert at_head is not budget and "observe" not in at_head.__dict__  # the revision's own observe, unwrapped
    assert ab.revision_module("HEAD").MAX_WAIT_DEAR == wait  # the revision's constant set for its runs only
    assert len(_rows(tmp_path / "ab_adaptive_combined_b1_600_mtbench_12tok.csv")) == 3
    with pytest.raises(SystemExit, match="git cannot show"):
        _run("ab_adaptive", ["--variants", "@no-such-revision"])
    with pytest.raises(SystemExit, match="NO_SUCH"):
        _run("ab_adaptive", ["--variants", "@HEAD:NO_SUCH=1"])
    with pytest.raises(SystemExit, match="NO_SUCH"):
        _run("ab_adaptive", ["--variants", "x:NO_SUCH=1"])
    with pytest.raises(SystemExit):
        _run("ab_adaptive", ["--context", "long"])
    with pytest.raises(SystemExit, match="repeat a name"):  # their runs would be pooled under one name
        _run("ab_adaptive", ["--variants", "adaptive", "adaptive:MARGIN=1.0"])
    with pytest.raises(SystemExit, match="or use 'plain'"):  # plain decoding's runs are keyed by it
        _run("ab_adaptive", ["--variants", "plain:MARGIN=1.0"])


def test_ab_adaptive_reuses_a_prefill_bit_for_bit(smollm2):
    """ReusedPrefill (each group prefilled once per A/B): a repeated prefill of the same ragged batch leaves the KV rows
    and lengths a fresh prefill leaves and returns its hidden states, bit for bit, for all_hidden and for the last rows
    alone (gathered from the saved rows), into a cache that held other rows before; a different batch is prefilled
    anew; leaving restores the model's own prefill."""
    model, _ = smollm2
    ab = _script("ab_adaptive")
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, model.config.vocab_size, (2, 37), generator=g)
    lengths = torch.tensor([37, 23], dtype=torch.int32)
    fresh = model.new_kv_cache(2, 64)
    with torch.inference_mode():
        want_all = model.prefill(tokens, lengths, fresh, all_hidden=True)
        want_last = model.prefill(tokens, lengths, model.new_kv_cache(2, 64))
        with ab.ReusedPrefill(model) as reuse:
            first = model.new_kv_cache(2, 64)
            got_last = model.prefill(tokens, lengths, first)  # a miss: prefilled (with all_hidden) and saved
            for all_hidden, want in ((True, want_all), (False, want_last)):
                cache = model.new_kv_cache(2, 64)
                cache.kv.normal_(generator=g)  # rows an earlier run left
                got = model.prefill(tokens, lengths, cache, all_hidden=all_hidden)
                assert torch.equal(got, want) and torch.equal(cache.kv[:, :, :, :37], fresh.kv[:, :, :, :37])
                assert torch.equal(cache.seqlens, lengths)
            assert torch.equal(got_last, want_last) and reuse.hits == 2
            other = tokens.flip(0)
            model.prefill(other, lengths, model.new_kv_cache(2, 64))
            assert reuse.hits == 2 and len(reuse.saved) == 2
    assert "prefill" not in model.__dict__


def test_ab_adaptive_refuses_more_prompts_than_its_set_has(smollm2):
    """The editing set holds a few dozen prompts: asking past its end says so, never a run on an empty batch. The
    ShareGPT set is bench_scaling.py's held-out first turns, from --start."""
    from types import SimpleNamespace

    from hydra_kernels.training.data import heldout_chat_prompts

    ab = _script("ab_adaptive")
    args = SimpleNamespace(prompts=4, batch=2, prompt_set="editing", start=0, context="short")
    assert [len(g) for g in ab.prompt_groups(smollm2[1], args)] == [2, 2, 2, 2]
    shared = ab.prompt_groups(smollm2[1], SimpleNamespace(**{**vars(args), "prompt_set": "sharegpt", "start": 3}))
    assert [p for g in shared for p in g] == heldout_chat_prompts(smollm2[1], 11)[3:]
    with pytest.raises(SystemExit, match=r"8 asked for \(--prompts x --batch\): ask for fewer or start earlier"):
        ab.prompt_groups(smollm2[1], SimpleNamespace(**{**vars(args), "start": 1000}))


def test_replay_adaptive_runs_and_replays_alike(tmp_path, monkeypatch):
    """The adaptive budget's decisions on a modelled clock: every output identical to plain decoding, a variant's
    constants set for its runs only, everything the replay patched restored, and the replay deterministic: a second run
    under a wall clock that jumps at random gives the same figures (no wall time reaches the policy). A constant
    adaptive.py lacks and two variants of one name are refused."""
    from hydra_kernels import adaptive

    observe, margin = adaptive.AdaptiveBudget.observe, adaptive.MARGIN_BATCH_1
    argv = ["--prompts", "2", "--rounds", "2", "--new-tokens", "8", "--noise", "0.1",
            "--variants", "table", "adaptive", "wide:MARGIN_BATCH_1=0.5", "--out", str(tmp_path)]
    first = _run_returning("replay_adaptive", argv)
    assert [r["variant"] for r in first] == ["table", "adaptive", "wide:MARGIN_BATCH_1=0.5"]
    assert all(r["identical"] == "4/4" and r["modelled_ratio_min"] <= r["modelled_ratio_geomean"]
               <= r["modelled_ratio_max"] for r in first)
    assert adaptive.AdaptiveBudget.observe is observe and adaptive.MARGIN_BATCH_1 == margin
    # again with a wall clock that jumps at random: the figures do not move (only the modelled clock steers the policy)
    jumps = random.Random(7)
    wall = [0.0]

    def chaotic():
        wall[0] += jumps.expovariate(1.0) * 0.05
        return wall[0]

    monkeypatch.setattr(time, "perf_counter", chaotic)
    assert _run_returning("replay_adaptive", argv) == first
    monkeypatch.undo()
    assert len(_rows(tmp_path / "replay_adaptive_short_mtbench.csv")) == 3
    with pytest.raises(SystemExit, match="MARGIN_BATCH_2"):
        _run("replay_adaptive", ["--variants", "x:MARGIN_BATCH_2=1.0"])
    with pytest.raises(SystemExit, match="repeat a name"):  # their runs would be pooled under one name
        _run("replay_adaptive", ["--variants", "adaptive", "adaptive:MARGIN=1.0"])


def test_forecast_calibration_sums_each_verified_nodes_path_forecast_and_whether_it_was_right():
    """forecast_calibration.ForecastCalibration.record: per (part, depth) the verified nodes of the active sequences,
    each one's forecast P (the product of its path's conditional rates as Calibration.host_rates reads them, clamped to
    [1e-6, 1]; the root's 1) and whether it was right: under greedy acceptance every node on the base model's own
    continuation (a right sibling the accepted path did not take included), under sampled acceptance the accepted path.
    Sequence 0's tree: root, 1 (part 0, rate 0.8), 2 under 1 (part 0, 0.5), 3 under the root (part 1, 0.6, the same
    token as node 1), 4 under 2 (part 0, depth 3, rate 1.3: clamped to 1), 5 padding; sequence 1 finished (not
    counted); a plain step and a step without accept_indices count nothing; the rates are read without settling the
    counts' pending decay."""
    cal = _script("forecast_calibration")

    class Calib:
        def host_rates(self, keys):
            table = [0.0, 0.8, 0.5, 0.6, 1.3, 0.2]
            return {b: [table[k] for k in ks] for b, ks in keys.items()}

        def rates(self, keys):
            raise AssertionError("rates() settles the pending decay: not a read")

    class Policy:
        calib = Calib()

    keys = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
    depths = torch.tensor([[0, 1, 2, 1, 3, 0], [0, 1, 2, 1, 3, 0]])
    valid = torch.tensor([[True] * 5 + [False]] * 2)
    parents = torch.tensor([[-1, 0, 1, 0, 2, -1], [-1, 0, 1, 0, 2, -1]])
    groups = torch.tensor([[0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 0, 0]])
    tokens = torch.tensor([[0, 7, 8, 7, 9, 0], [0, 7, 8, 7, 9, 0]])
    target = torch.tensor([[7, 8, 2, 8, 1, 1], [7, 8, 2, 8, 1, 1]])  # the base argmax after each node: 7, 8, then not 9
    step = ((True, True), [0.0, 0.0], 6, (keys, depths, valid, parents, groups), torch.tensor([1.0, 0.0]))
    path = torch.tensor([[0, 1, 2, -1], [0, 3, -1, -1]])  # the accepted path takes node 1 (node 3 ties with it)
    greedy, sampled = cal.ForecastCalibration(), cal.ForecastCalibration()
    greedy.record(Policy(), step, path, tokens, target)
    sampled.record(Policy(), step, path)
    for c in (greedy, sampled):
        c.record(Policy(), step[:3] + (None, step[4]), torch.tensor([[0, -1, -1, -1]] * 2))  # a plain step: nothing
        c.record(Policy(), step, None)
    g, s_ = greedy.columns(("ngram", "heads")), sampled.columns(("ngram", "heads"))
    for got in (g, s_):
        assert got["nodes_ngram_d1"] == 1 and got["forecast_ngram_d1"] == pytest.approx(0.8)
        assert got["nodes_ngram_d2"] == 1 and got["forecast_ngram_d2"] == pytest.approx(0.4)
        assert got["nodes_ngram_d3"] == 1 and got["forecast_ngram_d3"] == pytest.approx(0.4)  # 0.4 * min(1.3, 1)
        assert got["nodes_heads_d1"] == 1 and got["forecast_heads_d1"] == pytest.approx(0.6)
        assert got["nodes_heads_d2"] == 0 and got["forecast_heads_d2"] is None and got["right_heads_d2"] is None
        assert got["right_ngram_d1"] == 1 and got["right_ngram_d2"] == 1 and got["right_ngram_d3"] == 0
    assert g["right_heads_d1"] == 1  # right, though the path took its twin
    assert s_["right_heads_d1"] == 0  # not on the accepted path
