import logging
import os
import sys

# The CPU tier runs every Triton kernel in Triton's interpreter; the mode is fixed when a kernel is
# decorated, so it is set before anything imports the kernels (they load lazily on first use).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/helpers.py
logging.getLogger("transformers").setLevel(logging.ERROR)

from helpers import DEV  # noqa: E402

# Under pytest-xdist (make test: 2 workers on 2 cores) each worker runs torch on one thread: two workers of
# torch's default thread count would oversubscribe the cores (OpenMP threads spin while they wait). Tests
# that check results across thread counts set the counts they compare themselves.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


# ---- backends: one test per op, run once per backend -----------------------------------------------
def pytest_configure(config):
    config.addinivalue_line(
        "markers", "backends(*names, op=None): run the test (which takes a `backend` argument) once per named "
        "backend; one that cannot run `op` here is skipped, saying why")
    config.addinivalue_line(
        "markers", "requires(backend, op=None): skip the test (which takes no `backend`) where that backend "
        "cannot run here")


def why_backend_cannot_run(backend: str, op: str | None = None) -> str | None:
    """Why `backend` cannot run `op` on the test device (helpers.DEV) on this machine, or None. The one
    place the test suite decides to skip a backend."""
    from hydra_kernels.ops.backend import has_impl, native_available, triton_available

    dev = torch.device(DEV)
    if backend == "triton" and not triton_available(dev):
        return "Triton needs triton installed and CUDA, or TRITON_INTERPRET=1 on the CPU"
    if backend == "native" and not native_available():
        return "the extension hydra_kernels._C is not built"
    if op is not None and not has_impl(op, backend, dev):
        return f"{op} has no {backend} implementation for {dev.type} tensors"
    return None


def pytest_generate_tests(metafunc):
    """A test taking `backend` runs once per backend its `backends` marker names (module- or test-level)."""
    if "backend" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("backends")
    if marker is None:
        raise pytest.UsageError(f"{metafunc.definition.nodeid} takes `backend`: mark it @pytest.mark.backends(...)")
    op = marker.kwargs.get("op")
    params = []
    for name in marker.args:
        why = why_backend_cannot_run(name, op)
        params.append(pytest.param(name, id=name, marks=[pytest.mark.skip(reason=why)] if why else []))
    metafunc.parametrize("backend", params)


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("requires")
    if marker is not None:
        why = why_backend_cannot_run(*marker.args, **marker.kwargs)
        if why:
            pytest.skip(why)



@pytest.fixture(scope="session")
def smollm2():
    """(our Llama, tokenizer) of the embedded default, fp32 on the CPU."""
    import hydra_kernels as hk

    return hk.load_model(device="cpu")


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own LlamaForCausalLM read from the same GGUF: independent dequantisation and
    Q/K un-permutation, so agreeing with it checks our GGUF conversion too."""
    from transformers import LlamaForCausalLM

    from hydra_kernels.model import embedded_gguf_path

    p = embedded_gguf_path()
    return LlamaForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


# ---- the order pytest-xdist hands files out in ---------------------------------------------------------
# With --dist loadfile, xdist gives each worker whole files, by default the files with the most tests first; the
# Triton AOT test (3 tests, ~280 s) then started last and ran with the other worker idle (~150 s of a 1510-s CI
# run, 2-core Xeon VM, 2026-11-30). The Makefile passes --no-loadscope-reorder, so files go out in collection
# order, which this hook makes the longest first (a CI run's per-file totals, same day): the workers end together.
LONGEST_FILES = ["test_lossless_smollm2.py", "test_install_paths.py", "test_bench_scripts.py", "test_triton_aot.py",
                 "test_runner.py", "test_per_sequence_trees.py", "test_compiled_step.py", "test_int8_activations.py",
                 "test_sampling_exactness.py", "test_smollm2.py", "test_lookahead.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
