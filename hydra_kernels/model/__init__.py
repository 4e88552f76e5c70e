from .config import NAMED_CONFIGS, LlamaConfig
from .hf_checkpoint import load_hf_dir, save_hf_dir
from .kv_cache import KVCache
from .llama import Llama
from .pretrained import embedded_gguf_path, load_model

__all__ = ["Llama", "LlamaConfig", "KVCache", "NAMED_CONFIGS", "load_model", "embedded_gguf_path", "load_hf_dir",
           "save_hf_dir"]
