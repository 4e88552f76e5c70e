"""Bad command-line values, tried as a new user would (issue 47, 3): `python -m hydra_kernels.generate` run as a
subprocess refuses each the way argparse refuses its own: exit status 2, stderr the usage line and one error
line naming the option, no traceback, nothing on stdout (no answer was generated). Values are checked before
the model loads; what only loading finds (a corrupt drafter file, a drafter for another model; test_cli.py: a tree
its heads cannot draft) is reported the same way."""
import re
import shutil
import subprocess
import sys

import pytest
import torch

import hydra_kernels as hk
from helpers import ROOT
from test_llama_vs_transformers import make_hf

PROG = "python -m hydra_kernels.generate"


def run_cli(*argv, timeout=300):
    return subprocess.run([sys.executable, "-m", "hydra_kernels.generate", "--prompt", "hi", "--max-new-tokens", "4",
                           *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


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
def test_bad_value_is_refused_before_any_work(argv, option, pattern):
    assert_refused(run_cli(*argv), option, pattern)


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
