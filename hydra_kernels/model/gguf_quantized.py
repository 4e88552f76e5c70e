"""A GGUF file loaded with its projection weights kept as stored (4-8-bit blocks) for the CPU.

The layer projections of a GGUF in a format model/gguf_blocks.py decodes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K) go straight from the file's blocks into quantized panels (ops/quantized_linear.py), the
only copy of each weight in memory (one fused weight is decoded at a time; load_model caches the GGUF's config and
tokenizer only: an fp32 conversion is made for weights="fp32" alone). A fused weight (q / k / v, gate / up) whose
parts differ in format takes the widest layout (lossless); one with a part in another type (F16, IQ4_XS, ...)
loads as fp32. Norms load as fp32. The LM head and the token embedding in a decoded format are kept as stored too,
their panels the only copy (tied, one set of panels is both): an embedding lookup reads its rows from them
(model/quantized_embedding.py), and Llama.lm_head_weight / lm_head_rows / embedding_weight give fp32 values to the
code that needs them. An fp32 table would be the largest item in memory: 113 MB for SmolLM2's tied table, 2.1 GB
each for Llama-3-8B's untied embedding and head (V = 128256, H = 4096) beside ~0.3-0.4 GB as Q4_K / Q6_K blocks.

Every dequantized value equals gguf's (as a number: +0 where gguf may write -0), so where the fp32 model runs
the packed kernel too (AVX-512) this model's logits are bit-identical to the fp32 model convert_gguf_cached
makes of the same file (tests/test_quantized_model.py); on an AVX2-only CPU the fp32 model runs MKL, whose
summation order differs: equal to fp32 accuracy there, not bit for bit.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import torch

from .config import LlamaConfig
from .gguf_blocks import DECODERS, BlockWeight, concat_rows, decode_blocks
from .gguf_convert import check_finite, gguf_config, hf_name, unpermute_rope_rows
from .gguf_index import GGUFIndex
from .hf_names import _key_map, hf_to_ours
from .llama import Llama
from .memory import return_freed_memory
from .quantized_embedding import QuantizedEmbedding

_PROJECTIONS = (".wqkv.weight", ".wo.weight", ".w13.weight", ".w2.weight")


def _rope_heads(name: str, cfg: LlamaConfig) -> int | None:
    """The head count whose rows llama.cpp reordered in this weight (Q, K), else None."""
    if name.endswith("q_proj.weight"):
        return cfg.num_heads
    return cfg.num_kv_heads if name.endswith("k_proj.weight") else None


class _GGUFTensors:
    """A GGUF file's tensors by HF name, each decoded on demand (so a load holds one fused weight's blocks at a
    time, not the whole file's): `blocks(name)` for the formats gguf_blocks.py decodes, `dense(name)` fp32."""

    def __init__(self, path):
        self.path = path
        self.reader = GGUFIndex(path)  # not gguf's reader: its parsed tokenizer arrays would double the load's peak
        self.cfg = gguf_config(self.reader)
        self.tensors = {hf_name(t.name): t for t in self.reader.tensors}

    def undecoded_quantized(self) -> dict[str, int]:
        """Quantized types of 2-D weights not decoded here (IQ4_XS, ...: they load as fp32) -> their fp32 bytes."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            kind = t.tensor_type.name
            if len(t.shape) == 2 and kind not in DECODERS and kind not in ("F32", "F16", "BF16"):
                out[kind] = out.get(kind, 0) + 4 * int(np.prod([int(n) for n in t.shape]))
        return out

    def decodable(self, name: str) -> bool:
        t = self.tensors.get(name)
        return t is not None and t.tensor_type.name in DECODERS and len(t.shape) == 2

    def _shape(self, t) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first

    def blocks(self, name: str) -> BlockWeight:
        t = self.tensors[name]
        shape = self._shape(t)
        bw = decode_blocks(t.data, t.tensor_type.name, shape)
        check_finite(t.name, bw.s, self.path)  # a corrupt scale field: refused, naming file and tensor
        if bw.o is not None:
            check_finite(t.name, bw.o, self.path)
        heads = _rope_heads(name, self.cfg)
        return bw if heads is None else bw.rows(unpermute_rope_rows(np.arange(shape[0]), heads))

    def dense(self, name: str) -> torch.Tensor:
        from gguf.quants import dequantize

        t = self.tensors[name]
        kind = t.tensor_type.name
        w = np.asarray(t.data, dtype=np.float32) if kind in ("F32", "F16") else \
            dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        check_finite(t.name, w, self.path)
        w = w.reshape(self._shape(t))
        heads = _rope_heads(name, self.cfg)
        if heads is not None:
            w = unpermute_rope_rows(w, heads)
        return torch.from_numpy(np.array(w, dtype=np.float32, order="C"))


def load_gguf_quantized(path: str | os.PathLike) -> Llama:
    """An fp32 CPU Llama whose projections (and LM head) run on the GGUF's own blocks (see the module doc).
    One fused weight's blocks are decoded and packed at a time (peak memory: the panels plus one weight)."""
    f = _GGUFTensors(path)
    cfg = f.cfg
    undecoded = f.undecoded_quantized()
    if undecoded:  # said once per load, before the work: the memory it costs is the user's to weigh
        warnings.warn(f"{os.path.basename(path)}: weights in {', '.join(sorted(undecoded))} are not decoded by the "
                      f"quantized CPU kernel ({', '.join(DECODERS)}) and load as fp32 "
                      f"({sum(undecoded.values()) / 2**20:.0f} MB); a file in one of those formats keeps its blocks")
    tied = cfg.tie_word_embeddings
    # the vocabulary tables kept as stored where decodable: the LM head's panels (tied: the embedding's tensor),
    # and an untied embedding's own
    vocab_tables = {"model.embed_tokens.weight": "output.weight"} if tied else \
        {"lm_head.weight": "output.weight", "model.embed_tokens.weight": "tok_embeddings.weight"}
    dense, panels = {}, {}
    for ours, names in _key_map(cfg).items():
        present = [n for n in names if n in f.tensors]
        if ours.endswith(_PROJECTIONS) and present == names and all(f.decodable(n) for n in names):
            panels[ours] = concat_rows([f.blocks(n) for n in names]).panels()
            return_freed_memory()  # the decoded blocks' pages, before the next weight's: one weight's at a time
            continue
        for n in present:  # norms, biases, embedding, LM head, and weights in formats not decoded here
            if n in vocab_tables and f.decodable(n):
                panels[vocab_tables[n]] = f.blocks(n).panels()  # as stored, the only copy (no fp32 values)
            else:
                dense[n] = f.dense(n)
    del f  # the index (the tensors' bytes were read and freed one weight at a time)
    return_freed_memory()  # before the layout passes below take their transient copies: a lower peak
    # the embedding as its panels (tied: the LM head's), no fp32 table (quantized_embedding.py)
    embedding = panels.pop("tok_embeddings.weight", None)
    if tied:
        embedding = panels.get("output.weight")
    placeholders = set(panels) | ({"tok_embeddings.weight"} if embedding is not None else set())
    model = Llama.empty(cfg)
    model.load_state_dict(hf_to_ours(cfg, dense, allow_missing=placeholders), strict=False, assign=True)
    del dense
    if embedding is not None:
        model.tok_embeddings = QuantizedEmbedding(embedding)
    model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.is_meta and n not in placeholders]
    if still_meta:
        raise ValueError(f"{path}: the GGUF did not provide {still_meta[:5]}")
    model.use_input_major_weights()
    model.use_quantized_cpu_weights(panels)  # first: then packing the fp32 layers skips the LM head's panels
    model.use_packed_cpu_weights()  # the fp32 layers (formats not decoded here)
    return model.eval()
