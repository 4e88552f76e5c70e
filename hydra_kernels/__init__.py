"""hydra_kernels: fast, exact draft-head speculative decoding (Hydra, Hydra++, Medusa) for Llama models."""
import os

# HK_CPU_ISA=avx2 / portable runs every CPU kernel as on a CPU without AVX-512 / AVX2 (csrc/cpu_features.h: for
# tests of those paths on a machine that has both); the kernels read it without checking, so it is checked here
if os.environ.get("HK_CPU_ISA", "avx512") not in ("avx512", "avx2", "portable"):
    raise ValueError(f"HK_CPU_ISA must be avx512, avx2 or portable (or unset), got {os.environ['HK_CPU_ISA']!r}")

from . import ops, tree  # noqa: E402
from .drafters import Drafter, load_drafter, new_drafter  # noqa: E402
from .model import NAMED_CONFIGS, KVCache, Llama, LlamaConfig, load_model  # noqa: E402
from .tree import Tree  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Llama", "LlamaConfig", "KVCache", "NAMED_CONFIGS", "load_model", "ops", "tree", "Tree", "Drafter",
           "new_drafter", "load_drafter", "__version__"]
