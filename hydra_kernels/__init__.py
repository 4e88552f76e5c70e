"""hydra_kernels: fast, exact draft-head speculative decoding (Hydra, Hydra++, Medusa) for Llama models."""
from . import ops, tree
from .drafters import Drafter, load_drafter, new_drafter
from .model import NAMED_CONFIGS, KVCache, Llama, LlamaConfig, load_model
from .tree import Tree

__version__ = "0.1.0"
__all__ = ["Llama", "LlamaConfig", "KVCache", "NAMED_CONFIGS", "load_model", "ops", "tree", "Tree", "Drafter",
           "new_drafter", "load_drafter", "__version__"]
