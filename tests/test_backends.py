"""Backend choice (ops/backend.py) and whole decoding runs per backend: a wrong or unusable backend is a
clear error, native tree_attention is a CPU kernel only, the extension is built where `make test` ran,
and generate() on the Triton and native backends is lossless against plain greedy decoding."""
import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.ops.backend import has_impl, plan_backends
from helpers import DEV


def test_unknown_or_unusable_backend_is_a_clear_error(monkeypatch):
    args = (torch.randn(1, 1, 2, 64), torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2, 64),
            torch.tensor([2], dtype=torch.int32), torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="backend must be one of"):
        hk.ops.tree_attention(*args, backend="cuda")
    with pytest.raises(ValueError, match="no 'native' implementation"):  # resblock: reference and Triton only
        hk.ops.resblock(torch.randn(2, 8), torch.randn(8, 8), torch.randn(8), backend="native")
    monkeypatch.setenv("HYDRA_KERNELS_BACKEND", "reference")
    assert hk.ops.tree_attention(*args).shape == (1, 1, 2, 64)


@pytest.mark.requires("native")
def test_tree_attention_native_is_a_cpu_kernel_only():
    """On other devices "native" has no tree_attention: the plan for a native run on CUDA picks another."""
    assert has_impl("tree_attention", "native", torch.device("cpu"))
    assert not has_impl("tree_attention", "native", torch.device("cuda"))
    assert plan_backends("native", torch.device("cpu"))["tree_attention"] == "native"
    if hk.ops.triton_available(torch.device("cuda")):
        assert plan_backends("native", torch.device("cuda"))["tree_attention"] != "native"


@pytest.mark.requires("native")
def test_extension_is_built_here():
    """`make test` installs the package with its extension: on this machine it must be there."""
    import hydra_kernels._C  # noqa: F401

    assert hasattr(torch.ops.hydra_kernels, "commit_kv")


@pytest.mark.requires("triton")
def test_generate_with_triton_backend_is_lossless():
    """backend="triton" runs commit_kv and greedy_verify as Triton kernels (the other ops fall back)."""
    from hydra_kernels.generate import generate
    from test_llama_vs_transformers import make_hf

    model = hk.Llama.from_hf(make_hf("gqa3-tied", seed=5)).to(DEV)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12]]
    plain = generate(model, prompts, max_new_tokens=20, eos_token_id=[], backend="reference").sequences
    torch.manual_seed(0)
    d = hk.new_drafter(model, kind="medusa", num_heads=4)
    out = generate(model, prompts, drafter=d, tree=hk.tree.default_tree(24), max_new_tokens=20, eos_token_id=[],
                   backend="triton")
    assert out.sequences == plain and out.mean_accepted_tokens > 1


@pytest.mark.requires("triton")
def test_generate_typical_with_triton_backend_runs_fused():
    """temperature > 0 with backend="triton": the statistics + fused acceptance path end to end
    (sampling: outputs are valid and reproducible with a seed, not comparable token for token)."""
    from hydra_kernels.generate import generate
    from test_llama_vs_transformers import make_hf

    model = hk.Llama.from_hf(make_hf("gqa3-tied", seed=5)).to(DEV)
    torch.manual_seed(0)
    d = hk.new_drafter(model, kind="hydra", num_heads=3)
    run = lambda: generate(model, [[1, 2, 3], [4, 5]], drafter=d, tree=hk.tree.default_tree(10, depth=3),  # noqa: E731
                           max_new_tokens=12, temperature=0.8, acceptance="typical", seed=7, eos_token_id=[],
                           backend="triton")
    a, b = run(), run()
    assert a.sequences == b.sequences and all(len(s) == 12 for s in a.sequences)
    assert all(0 <= t < model.config.vocab_size for s in a.sequences for t in s)


@pytest.mark.requires("native")
def test_generate_with_native_backend_is_lossless():
    from hydra_kernels.generate import generate
    from test_llama_vs_transformers import make_hf

    model = hk.Llama.from_hf(make_hf("gqa3-tied", seed=5)).to(DEV)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12]]
    plain = generate(model, prompts, max_new_tokens=30, eos_token_id=[], backend="reference").sequences
    for kind in ("medusa", "hydra"):
        torch.manual_seed(0)
        d = hk.new_drafter(model, kind=kind, num_heads=4)
        out = generate(model, prompts, drafter=d, tree=hk.tree.default_tree(24), max_new_tokens=30, eos_token_id=[],
                       backend="native")
        assert out.sequences == plain, kind
