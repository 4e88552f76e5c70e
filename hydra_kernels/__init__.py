"""hydra_kernels: fast, exact draft-head speculative decoding (Hydra, Hydra++, Medusa) for Llama models."""
from . import ops
from .model import NAMED_CONFIGS, KVCache, Llama, LlamaConfig, load_model

__version__ = "0.1.0"
__all__ = ["Llama", "LlamaConfig", "KVCache", "NAMED_CONFIGS", "load_model", "ops", "__version__"]
