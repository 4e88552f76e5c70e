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
