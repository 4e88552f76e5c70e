"""`make gpu`'s script without CUDA (it says so and exits 0) and its decode-step benchmark on the CPU at a
tiny slice of SmolLM2 (plain vs speculative step with a fixed acceptance pattern)."""
import sys
from pathlib import Path

import pytest
import torch

from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


def _load(script):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    return load_script(f"benchmarks/{script}.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path without CUDA")
def test_gpu_suite_without_cuda_says_so_and_exits_0(capsys, tmp_path):
    assert _load("gpu_suite").main(["--out", str(tmp_path)]) == 0
    assert "no CUDA device here" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())  # nothing ran


def test_gpu_suite_steps_name_existing_files():
    for name, cmd, env, limit in _load("gpu_suite").steps("out"):
        for arg in cmd:
            if arg.endswith(".py"):
                assert (ROOT / arg).exists(), f"{name}: {arg} does not exist"
        assert limit > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke run")
def test_decode_step_bench_cpu(tmp_path):
    rows = _load("bench_decode_step").main(["--model", "smollm2-135m", "--layers", "1", "--context", "32", "--T", "8",
                                             "--accept", "3", "--reps", "1", "--backend", "auto",
                                             "--out", str(tmp_path)])
    assert [(r["backend"].split()[0], r["step"]) for r in rows] == [
        ("auto", "plain"), ("auto", "speculative"), ("reference", "plain"), ("reference", "speculative")]
    for plain, spec in (rows[:2], rows[2:]):  # ours, then the plain-PyTorch peer
        assert spec["T"] == 8 and spec["tokens_per_step"] == 3 and spec["us"] > 0 and plain["us"] > 0
        assert spec["GB/s"] > 0 and plain["GB/s"] > 0
    assert (tmp_path / "decode_step_smollm2-135m_cpu.csv").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke run")
def test_generate_device_bench_cpu(tmp_path):
    """generate() end to end beside transformers at a one-layer SmolLM2 slice: every decoder timed, n-gram
    lossless (the script asserts it), a tokens-per-step figure for the drafted row only."""
    rows = _load("bench_generate_device").main(["--layers", "1", "--prompt-tokens", "16", "--new-tokens", "8",
                                                "--reps", "1", "--prompts", "2", "--dtype", "float32",
                                                "--out", str(tmp_path)])
    assert [r["decoder"] for r in rows] == ["ours plain", "ours n-gram", "transformers generate",
                                            "transformers prompt lookup"]
    assert all(r["median_tok_s"] > 0 and r["runs"] == 2 for r in rows) and rows[0]["vs_ours_plain"] == 1.0
    assert rows[1]["tokens_per_step"] >= 1 and rows[0]["tokens_per_step"] == ""
    assert (tmp_path / "generate_device_smollm2-135m.csv").exists()


def test_gpu_suite_tests_option_replaces_the_tier_files():
    """--tests (a short lease): the GPU test tier runs the named files, and only them."""
    suite = _load("gpu_suite")
    tier = lambda tests: next(cmd for name, cmd, *_ in suite.steps("out", tests) if name == "GPU test tier")  # noqa: E731
    assert set(suite.GPU_TESTS) <= set(tier(None))
    short = tier(["tests/test_runner_gpu.py"])
    assert "tests/test_runner_gpu.py" in short and not set(suite.GPU_TESTS) - {"tests/test_runner_gpu.py"} & set(short)


def test_gpu_suite_runs_its_steps_and_kills_a_step_that_runs_over(monkeypatch, tmp_path, capsys):
    """The suite's loop without a GPU: steps run in order, a failing step does not stop the next, a step over
    its limit is killed with the processes it started (its process group), --only and --deadline-s apply."""
    suite = _load("gpu_suite")
    marker = tmp_path / "grandchild_survived"
    slow = ["bash", "-c", f"(sleep 3; touch {marker}) & sleep 30"]  # a child that would outlive its parent
    monkeypatch.setattr(suite, "steps", lambda out, tests=None: [
        ("build extension (CUDA)", ["true"], {}, 10), ("fails", ["false"], {}, 10), ("slow", slow, {}, 1),
        ("after", ["true"], {}, 10)])
    monkeypatch.setattr(suite, "_build_env", lambda: {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    assert suite.main(["--out", str(tmp_path)]) == 1
    table = capsys.readouterr().out
    assert "| build extension (CUDA) | ok |" in table and "| fails | FAILED (exit 1) |" in table
    assert "| slow | TIMED OUT (1 s) |" in table and "| after | ok |" in table
    import time

    time.sleep(3.5)
    assert not marker.exists()  # the step's background child was killed with it
    assert suite.main(["--out", str(tmp_path), "--only", "after"]) == 0
    assert suite.main(["--out", str(tmp_path), "--deadline-s", "5", "--only", "slow", "after"]) == 1
    assert "| after | NOT RUN (deadline) |" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke run")
def test_scaling_gpu_bench_cpu(tmp_path):
    """The GPU scaling sweep's loop on the CPU (eager times): every point has plain, verify and draft times,
    projected ratios from the acceptance CSV, and a chosen budget that is the fastest projected."""
    mod = _load("bench_scaling_gpu")
    rows = mod.main(["--model", "smollm2-135m", "--layers", "1", "--batches", "1", "3", "--contexts", "17", "40",
                     "--budgets", "3", "8", "--reps", "1", "--out", str(tmp_path)])
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 17), (1, 40), (3, 17), (3, 40)]
    curve = mod.read_acceptance(mod.DEFAULT_ACCEPTANCE, "hydra")
    for r in rows:
        assert r["plain_us"] > 0 and r["plain_GB_s"] > 0
        for T in (3, 8):
            expect = r["batch"] * curve[T] / (r[f"verify{T}_us"] + r[f"draft{T}_us"]) * 1e6 / r["plain_tok_s"]
            assert r[f"T{T}_ratio"] == pytest.approx(expect)
        assert r["chosen_ratio"] == pytest.approx(max([1.0] + [r[f"T{T}_ratio"] for T in (3, 8)]))
    assert (tmp_path / "scaling_smollm2-135m_cpu.csv").exists()
    with pytest.raises(SystemExit, match="pick budgets among them"):
        mod.main(["--model", "smollm2-135m", "--layers", "1", "--budgets", "5", "--out", str(tmp_path)])
