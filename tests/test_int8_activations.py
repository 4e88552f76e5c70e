"""A model on int8 activations (Llama.use_int8_activations, load_model(activations="int8"): its quantized projections
on the int8 dot kernel). The native plain and verify steps give the module path's tokens, hidden states, acceptance
and KV cache bit for bit (so the fused steps and the Python layers are one model); greedy speculative decoding with
every shipped drafter family, the default drafter's table and its adaptive budget, a ragged batch included, emits
exactly plain greedy decoding's tokens of the same int8 model on real prompts; a layer keeps one copy of its weight
(the dot layout) and its state_dict is the exact model's; bad requests are refused with what to change."""
import os
import subprocess
import sys

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.budget import whole_tree_budget
from hydra_kernels.chat import chat_prompt_ids
from hydra_kernels.generate import generate
from hydra_kernels.model.packed_linear import Linear, packed_linear_available
from hydra_kernels.ops.int8_dot_linear import Int8DotPanels, int8_dot_linear_available
from hydra_kernels.ops.quantized_linear import QuantizedPanels
from hydra_kernels.training import mtbench_questions
from test_decode_stack import model_of
from test_quantized_linear import FLAGS
from test_plain_step import assert_same_decoding, with_quantized_head
from test_tree_step import assert_same_steps

pytestmark = pytest.mark.skipif(not int8_dot_linear_available(), reason="the int8 dot kernel (AVX-512 VNNI or AVX2)")


# the small models of test_decode_stack (model_of) keep fp32 layers on the packed kernel (AVX-512), as the native
# steps' own tests do
needs_packed = pytest.mark.skipif(not packed_linear_available(), reason="the packed CPU kernel (AVX-512)")


def int8_model(layout: str, seed: int, tied_head: bool | None = True):
    m = model_of(layout, False, seed=seed)
    if tied_head is not None:
        m = with_quantized_head(m, tied=tied_head, seed=seed)
    m.use_int8_activations()
    return m


@needs_packed
@pytest.mark.parametrize("layout", ["a", "b"])
@pytest.mark.parametrize("B", [1, 3])
def test_native_plain_step_is_the_module_path_bit_for_bit(layout, B):
    m = int8_model(layout, seed=B + 30)
    assert isinstance(m.output._panels, Int8DotPanels) and m.output.step_weights(B)[1] >= 1000
    assert_same_decoding(m, B)


@needs_packed
@pytest.mark.parametrize("layout", ["a", "b"])
@pytest.mark.parametrize("B", [1, 3])
def test_native_verify_step_is_the_module_path_bit_for_bit(layout, B):
    lengths = assert_same_steps(int8_model(layout, seed=B + 40), B, seed=B)
    assert len(lengths) >= 3, f"accept lengths seen: {lengths}"


@needs_packed
def test_an_untied_quantized_head_and_fp32_head():
    assert_same_decoding(int8_model("a", seed=51, tied_head=False), 3)
    m = int8_model("b", seed=52, tied_head=None)  # the head stays fp32 panels: only the layers run int8
    assert not isinstance(m.output.packed_weight(), QuantizedPanels)
    assert_same_decoding(m, 3)


@needs_packed
def test_a_layer_keeps_one_copy_and_its_state_dict_is_the_exact_models():
    exact = with_quantized_head(model_of("a", False, seed=60), tied=True, seed=60)
    want = {k: v.clone() for k, v in exact.state_dict().items()}
    n = exact.use_int8_activations()
    assert n == 4 * 3 + 1  # every projection of 3 layers and the head
    for name, mod in exact.named_modules():
        if isinstance(mod, Linear):
            p = mod._panels
            assert isinstance(p, Int8DotPanels)
            assert (p.packed is not None) == (mod is exact.output), name  # the head keeps its rows' layout
    assert exact.output._panels.packed is exact.tok_embeddings.panels.packed  # tied: one exact copy, shared
    got = exact.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert exact.use_int8_activations() == n  # a second call changes nothing
    assert isinstance(exact.layers[0].attention.wqkv._panels, Int8DotPanels)


@pytest.fixture(scope="module")
def int8_smollm2():
    return hk.load_model(activations="int8")


@pytest.fixture(scope="module")
def prompts(int8_smollm2):
    _, tok = int8_smollm2
    return [chat_prompt_ids(tok, q["turns"][0]) for q in mtbench_questions()[:4]]


@pytest.fixture(scope="module")
def plain(int8_smollm2, prompts):
    model, _ = int8_smollm2
    return generate(model, prompts, max_new_tokens=40, eos_token_id=[]).sequences


@pytest.mark.parametrize("kind", ["hydra", "medusa", "mlp_speculator", "amphista", "combined"])
def test_greedy_speculative_decoding_on_int8_activations_is_its_plain_decoding(int8_smollm2, prompts, plain, kind):
    """The embedded model on int8 activations: a ragged batch of 4 MT-Bench prompts, the batch's own plain greedy
    tokens (a row's values do not depend on the rows beside it, in a step or a tree). The whole tree every step: the
    CPU tables plain-decode a batch of 4 (nothing would be tested)."""
    model, _ = int8_smollm2
    d = hk.load_drafter(model=model, kind=kind)
    out = generate(model, prompts, drafter=d, max_new_tokens=40, eos_token_id=[],
                   budget=whole_tree_budget(d, None, "cpu"))
    assert out.sequences == plain
    assert out.mean_accepted_tokens > 1.0  # it drafted, and drafts were accepted


def test_the_adaptive_budget_on_int8_activations(int8_smollm2, prompts):
    model, _ = int8_smollm2
    d = hk.load_drafter(model=model)
    for p in prompts[:2]:
        out = generate(model, [p], drafter=d, max_new_tokens=40, eos_token_id=[], budget="adaptive")
        assert out.sequences == generate(model, [p], max_new_tokens=40, eos_token_id=[]).sequences
        assert max(out.step_nodes) > 1  # it drafted


def test_ngram_and_lookahead_on_int8_activations(int8_smollm2, prompts, plain):
    model, _ = int8_smollm2
    for kind in ("ngram", "lookahead"):
        out = generate(model, prompts[:2], drafter=hk.new_drafter(model, kind=kind), max_new_tokens=40,
                       eos_token_id=[])
        assert out.sequences == generate(model, prompts[:2], max_new_tokens=40, eos_token_id=[]).sequences, kind


def test_bad_requests_say_what_to_change():
    with pytest.raises(ValueError, match="activations must be 'fp32'"):
        hk.load_model(activations="int4")
    with pytest.raises(ValueError, match="activations='int8' runs on quantized weights"):
        hk.load_model(weights="fp32", activations="int8")
    with pytest.raises(ValueError, match="load a quantized GGUF"):
        hk.load_model(weights="fp32")[0].use_int8_activations()  # fp32 weights: nothing to run in int8
    env = dict(os.environ, HK_CPU_ISA="portable")  # as on a CPU without AVX2
    run = subprocess.run([sys.executable, "-c", "import hydra_kernels as hk; hk.load_model(activations='int8')"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "AVX-512 VNNI or AVX2" in run.stderr and "activations='fp32'" in run.stderr


# the embedded model on int8 activations with every kernel limited to AVX2 (the int8 kernel's AVX2 path, as on a CPU
# without AVX-512 VNNI): the native plain and verify steps run, and a drafted run emits the plain tokens
AVX2_RUN = r"""
import torch
import hydra_kernels as hk
from hydra_kernels.budget import whole_tree_budget
from hydra_kernels.chat import chat_prompt_ids
from hydra_kernels.generate import generate
from hydra_kernels.model import plain_step, tree_step
from hydra_kernels.ops.int8_dot_linear import DOT_ISA_AVX2, int8_dot_linear_isa
assert int8_dot_linear_isa() == DOT_ISA_AVX2
model, tok = hk.load_model(activations="int8")
prompts = [chat_prompt_ids(tok, q) for q in ("Name three rivers in Africa.", "What is 17*23? Explain.")]
calls, real = [], tree_step.TREE_GREEDY_STEP
tree_step.TREE_GREEDY_STEP = lambda *a: calls.append(1) or real(*a)
want = generate(model, prompts, max_new_tokens=24).sequences
d = hk.load_drafter(model=model)
spec = generate(model, prompts, drafter=d, max_new_tokens=24, budget=whole_tree_budget(d, None, "cpu"))
assert spec.sequences == want and len(calls) == spec.num_steps > 0 and spec.mean_accepted_tokens > 1
exact, _ = hk.load_model()
same = generate(exact, prompts, max_new_tokens=24).sequences
print("diverge", [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), 24) for x, y in zip(want, same)])
"""


def test_the_avx2_path_runs_the_model_losslessly():
    if not {"avx2", "fma", "f16c"} <= FLAGS:
        pytest.skip("a CPU with AVX2, FMA and F16C")
    env = {**os.environ, "HK_CPU_ISA": "avx2"}
    run = subprocess.run([sys.executable, "-c", AVX2_RUN], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]


def test_the_demo_shows_int8_activations_beside_the_exact_model(int8_smollm2, prompts, capsys):
    from hydra_kernels.demo import int8_plain

    model, tok = int8_smollm2
    exact = generate(hk.load_model()[0], [prompts[0]], max_new_tokens=12).sequences[0]
    int8_plain(prompts[0], exact, 12, tok)
    line = capsys.readouterr().out
    assert "plain greedy on int8 activations" in line and "tokens/s" in line
    same = generate(model, [prompts[0]], max_new_tokens=12).sequences[0]
    k = next((i for i, (a, b) in enumerate(zip(same, exact)) if a != b), 12)
    assert f"its first {k} tokens the same here" in line
