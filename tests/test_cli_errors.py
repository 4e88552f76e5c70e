"""Bad command-line values, tried as a new user would (issue 47, 3): `python -m hydra_kernels.generate` refuses each
the way argparse refuses its own: exit status 2, stderr the usage line and one error line naming the option, no
traceback, nothing on stdout (no answer was generated). Values are checked before the model loads: the CLI's main()
runs in this process with every function that reads a model's files failing the test (a subprocess per value cost
~3 s of torch import each, ~70 s of a CI run). One value, a CUDA request on a machine without it, and what only
loading finds (a corrupt drafter file, a drafter for another model; test_cli.py: a tree its heads cannot draft) go
through the real command in a subprocess, reported the same way."""
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels import cli
from hydra_kernels.model import pretrained
from helpers import ROOT
from test_llama_vs_transformers import make_hf

PROG = "python -m hydra_kernels.generate"


ARGS = ["--prompt", "hi", "--max-new-tokens", "4"]


def run_cli(*argv, timeout=300):
    return subprocess.run([sys.executable, "-m", "hydra_kernels.generate", *ARGS, *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def run_main_without_loading(argv, monkeypatch, capsys):
    """cli.main(argv) here, as the command runs it, with every function that reads a model's files failing the test:
    load_model's own checks of its arguments run, its work does not."""
    def read(*args, **kwargs):
        raise AssertionError("a model file was read before the bad value was refused")

    for name in ("convert_gguf_cached", "load_gguf_quantized", "load_hf_dir", "load_tokenizer"):
        monkeypatch.setattr(pretrained, name, read)
    with pytest.raises(SystemExit) as stop:
        cli.main([*ARGS, *argv])
    out = capsys.readouterr()
    return SimpleNamespace(returncode=stop.value.code, stdout=out.out, stderr=out.err)


def assert_refused(result, option, pattern):
    """Exit 2, argparse's two stderr lines (usage, then 'error: argument OPTION: ...' matching pattern), no output."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert len(lines) == 2 and lines[0].startswith(f"usage: {PROG}"), result.stderr
    prefix = f"{PROG}: error: " + (f"argument {option}: " if option else "")
    assert lines[1].startswith(prefix) and re.search(pattern, lines[1][len(prefix):]), lines[1]


@pytest.mark.parametrize("argv,option,pattern", [
    # the report's cases
    (["--max-new-tokens", "-1"], "--max-new-tokens", r"^must be >= 1, got -1$"),
    (["--drafter", "/no/such/drafter"], "--drafter", r"^/no/such/drafter is not a directory \(pass a drafter directory"),
    (["--dtype", "int8"], "--dtype", r"^invalid choice: 'int8' \(choose from 'float32', 'bfloat16'"),
    (["--budget", "zero"], "--budget", r"^expected 'adaptive' \(each step's draft sized by its expected gain\), 'auto' "
                                     r"\(the drafter's searched table\) or a node count >= 1"),
    (["--tree", "chain-x"], "--tree", r"'chain-N' needs a whole number N >= 1"),
    (["--model", "/no/such/model.gguf"], "--model", r"^no such file or directory: /no/such/model.gguf"),
    (["--no-draft", "--drafter", "hydra_kernels/heads/smollm2-135m-instruct/hydra"], "--drafter",
     r"^not allowed with argument --no-draft$"),
    # neighbours
    (["--budget", "0"], "--budget", r"got '0'"),
    (["--tree", "no-such-tree.json"], "--tree", r"unknown tree 'no-such-tree.json'"),
    (["--drafter", "hydra_kernels/heads"], "--drafter", r"hydra_kernels/heads has no config.json: not a drafter directory"),
    (["--device", "tpu"], "--device", r"'tpu' is not a device: use cpu or cuda"),
    (["--temperature", "nan"], "--temperature", r"must be a finite number >= 0.0, got nan"),
    (["--top-p", "0"], "--top-p", r"must be a finite number in \(0.0, 1.0\], got 0"),
    (["--top-k", "1.5"], "--top-k", r"expected a whole number, got '1.5'"),
    (["--seed", "-1"], "--seed", r"must be >= 0 and < \d+, got -1"),
    (["--no-draft", "--tree", "chain-2"], "--tree", r"needs a drafter; drop --no-draft"),
    (["--no-draft", "--acceptance", "rejection"], "--acceptance", r"needs a drafter"),
    (["--acceptance", "greedy", "--temperature", "0.7"], "--acceptance", r"greedy is for --temperature 0"),
    (["--weights", "int3"], "--weights", r"invalid choice: 'int3' \(choose from 'quantized', 'fp32', 'int8', 'int4'\)"),
    (["--weights", "quantized", "--dtype", "bf16"], "--weights", r"^weights='quantized' keeps a GGUF file's blocks"),
    (["--activations", "int4"], "--activations", r"invalid choice: 'int4' \(choose from 'fp32', 'int8'\)"),
    (["--activations", "int8", "--weights", "fp32"], "--activations", r"^activations='int8' runs on quantized weights"),
])
def test_bad_value_is_refused_before_any_work(argv, option, pattern, monkeypatch, capsys):
    assert_refused(run_main_without_loading(argv, monkeypatch, capsys), option, pattern)


def test_good_values_do_reach_the_model_files(monkeypatch, capsys):
    """The control: without a bad value, main() goes on to read the model, which the patched readers refuse."""
    with pytest.raises(AssertionError, match="a model file was read"):
        run_main_without_loading(["--no-draft"], monkeypatch, capsys)


def test_the_command_refuses_a_bad_value_as_main_does():
    assert_refused(run_cli("--max-new-tokens", "-1"), "--max-new-tokens", r"^must be >= 1, got -1$")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_device_cuda_without_cuda_is_refused():
    why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
    assert_refused(run_cli("--device", "cuda"), "--device", rf"^cuda is not available here \({why}\); use --device cpu$")


# ---- what only loading finds: after the (embedded) model loads, before any token ------------------------------
def test_corrupt_drafter_file_is_named(tmp_path):
    bad = shutil.copytree(ROOT / "hydra_kernels/heads/smollm2-135m-instruct/hydra", tmp_path / "hydra")
    st = bad / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    assert_refused(run_cli("--drafter", str(bad), "--device", "cpu"), "--drafter",
                   re.escape(str(st)) + r" is not a readable weights file \(SafetensorError")


def test_drafter_for_another_model_is_named(tmp_path):
    tiny = hk.Llama.from_hf(make_hf("gqa3-tied", seed=5))
    hk.new_drafter(tiny, "hydra", num_heads=2).save(tmp_path / "tiny")
    assert_refused(run_cli("--drafter", str(tmp_path / "tiny"), "--device", "cpu"), "--drafter",
                   re.escape(str(tmp_path / "tiny")) + r": drafter vocab \(101\) does not match the model's \(49152\)")
