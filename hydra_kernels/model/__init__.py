from .config import NAMED_CONFIGS, LlamaConfig
from .kv_cache import KVCache
from .llama import Llama
from .load import embedded_gguf_path, load_model

__all__ = ["Llama", "LlamaConfig", "KVCache", "NAMED_CONFIGS", "load_model", "embedded_gguf_path"]
