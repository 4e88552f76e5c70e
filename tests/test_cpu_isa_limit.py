"""HK_CPU_ISA (csrc/cpu_features.h): the embedded model's greedy decoding with every kernel limited to AVX2 runs the
native plain step, and a drafted run the native verify step, on the AVX2 quantized kernels with the module path's
tokens (the only whole-step test of those paths on an AVX-512 machine; on an AVX2-only one, the path it always
takes), a finished sequence's skipped attention (attend) included; a bad value is refused at import. Kept apart
from test_plain_step.py, whose tests need the AVX-512 packed kernel: these need neither."""
import os
import subprocess
import sys

import pytest

from hydra_kernels.model import plain_step
from test_quantized_linear import FLAGS

# the embedded model under HK_CPU_ISA=avx2 (csrc/cpu_features.h: every kernel as on a CPU without AVX-512):
# generate()'s greedy plain decoding runs the native step on the AVX2 quantized kernels, one call per step,
# with the module path's tokens (the module path on the same kernels); a drafted greedy run (a pinned budget) runs
# the native verify step (model/tree_step.py) every step, with the same tokens; an adaptive run's plain steps (its
# first, at least: no costs timed yet) run the native plain step through the speculative loop's lean path
AVX2_RUN = r"""
import torch
import hydra_kernels as hk
import hydra_kernels._C  # noqa: F401
import hydra_kernels.generate as generate_module
from hydra_kernels.chat import chat_prompt_ids
from hydra_kernels.model import plain_step
from hydra_kernels.ops.packed_linear import packed_linear_available
from hydra_kernels.ops.quantized_linear import ISA_AVX2
assert torch.ops.hydra_kernels.quantized_linear_isa() == ISA_AVX2 and not packed_linear_available()
model, tok = hk.load_model(device="cpu")
prompts = [chat_prompt_ids(tok, q) for q in ("Name three rivers in Africa.", "What is 17*23? Explain.")]
calls, real = [], plain_step.PLAIN_GREEDY_STEP
plain_step.PLAIN_GREEDY_STEP = lambda *a: calls.append(1) or real(*a)
got = generate_module.generate(model, prompts, max_new_tokens=16)
assert len(calls) == got.num_steps > 0, (len(calls), got.num_steps)
generate_module.native_plain_step = lambda *a: None
want = generate_module.generate(model, prompts, max_new_tokens=16)
assert got.sequences == want.sequences, (got.sequences, want.sequences)
from hydra_kernels.model import tree_step
tree_calls, real_tree = [], tree_step.TREE_GREEDY_STEP
tree_step.TREE_GREEDY_STEP = lambda *a: tree_calls.append(1) or real_tree(*a)
spec = generate_module.generate(model, prompts, drafter=hk.load_drafter(model=model), max_new_tokens=16, budget=6)
assert len(tree_calls) == spec.num_steps > 0 and spec.sequences == want.sequences, (len(tree_calls), spec.num_steps)
from hydra_kernels import speculative
calls.clear()
lean, real_lean = [], speculative._native_plain_greedy_step
speculative._native_plain_greedy_step = lambda *a: lean.append(1) or real_lean(*a)
adaptive = generate_module.generate(model, prompts, drafter=hk.load_drafter(model=model), max_new_tokens=16,
                                    budget="adaptive")
assert adaptive.sequences == want.sequences, (adaptive.sequences, want.sequences)
assert len(calls) == adaptive.step_nodes.count(1) >= len(lean) > 0, (len(calls), len(lean), adaptive.step_nodes)
# a finished sequence skips its attention (attend 0) on the AVX2 path too: 24 tokens, where one answer ends early, the
# other's tokens the module path's, in plain decoding and in a drafted run
attends = []
generate_module.native_plain_step = plain_step.native_plain_step
plain_step.PLAIN_GREEDY_STEP = lambda *a: attends.append(a[-1]) or real(*a)
tree_step.TREE_GREEDY_STEP = lambda *a: attends.append(None if a[-1] is None else a[-1].clone()) or real_tree(*a)
long = generate_module.generate(model, prompts, max_new_tokens=24)
long_spec = generate_module.generate(model, prompts, drafter=hk.load_drafter(model=model), max_new_tokens=24, budget=6)
generate_module.native_plain_step = lambda *a: None
long_want = generate_module.generate(model, prompts, max_new_tokens=24)
assert long.sequences == long_want.sequences == long_spec.sequences, (long.sequences, long_spec.sequences)
assert min(map(len, long_want.sequences)) < 24
assert sum(a is not None and 0 in a.tolist() for a in attends) >= 2, attends
"""


@pytest.mark.skipif(plain_step.PLAIN_GREEDY_STEP is None or not {"avx2", "fma", "f16c"} <= FLAGS,
                    reason="the extension's plain_greedy_step and a CPU with AVX2, FMA and F16C")
def test_the_whole_step_on_the_avx2_kernels():
    env = {**os.environ, "HK_CPU_ISA": "avx2"}
    run = subprocess.run([sys.executable, "-c", AVX2_RUN], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]


def test_a_bad_isa_limit_is_refused_at_import():
    env = {**os.environ, "HK_CPU_ISA": "avx-2"}
    run = subprocess.run([sys.executable, "-c", "import hydra_kernels"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and "HK_CPU_ISA must be avx512, avx2 or portable" in run.stderr


# the tree attention's row kernel (the path of every CPU without the AVX-512 passes) compiled for AVX2 + FMA and
# compiled without: the same values bit for bit (its lanes keep one order: csrc/tree_attention_cpu.cpp), on awkward
# shapes (head_dim 40 with a tail of lanes, 64, 288; GQA; trees; an empty prefix)
ROW_KERNEL_RUN = r"""
import sys
import torch
import hydra_kernels._C  # noqa: F401
sys.path.insert(0, "tests")
from helpers import random_tree_batch
outs = []
for seed, Hq, Hkv, D, sizes, seqlens in [(1, 9, 3, 64, [1], [300]), (2, 4, 2, 40, [5, 1], [0, 70]),
                                         (3, 4, 1, 288, [3, 2], [40, 7]), (4, 6, 3, 24, [2], [9])]:
    gen = torch.Generator().manual_seed(seed)
    mask = random_tree_batch(gen, sizes)[1].mask
    B, T = mask.shape[:2]
    kv = torch.randn(2, B, max(seqlens) + T + 2, Hkv, D, generator=gen)
    q = torch.randn(B, T, Hq, D, generator=gen)
    outs.append(torch.ops.hydra_kernels.tree_attention(q, kv[0], kv[1], torch.tensor(seqlens, dtype=torch.int32),
                                                       mask, None))
torch.save(outs, sys.argv[1])
"""


@pytest.mark.skipif(not {"avx2", "fma"} <= FLAGS, reason="a CPU with AVX2 and FMA")
def test_the_row_kernel_compiled_for_avx2_is_the_portable_one(tmp_path):
    import torch

    got = {}
    for limit in ("avx2", "portable"):
        out = tmp_path / f"{limit}.pt"
        run = subprocess.run([sys.executable, "-c", ROW_KERNEL_RUN, str(out)], env={**os.environ, "HK_CPU_ISA": limit},
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-4000:]
        got[limit] = torch.load(out)
    for a, b in zip(got["avx2"], got["portable"]):
        assert torch.isfinite(a).all() and torch.equal(a, b)
