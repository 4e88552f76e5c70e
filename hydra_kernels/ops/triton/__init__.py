"""Triton kernels, one file per op (ops/triton/<op>.py; what they share: common.py; the tree mask's packing:
tree_mask.py; the ops' torch.library forms: library.py), registered as the "triton" backend.

Kernel modules are imported on first use: Triton fixes interpreter mode (TRITON_INTERPRET=1, how the
CPU tier runs them) when a kernel is decorated, so importing them late lets the environment decide.
Under torch.compile each op is its torch.library custom op (library.py): one opaque node in the graph.
"""
from __future__ import annotations

import importlib
import importlib.util

import torch

from ..backend import register


def _lazy(module: str, name: str):
    """The launcher `name` of ops/triton/<module>.py, imported on first call. Traced code (torch.compile)
    calls the op's torch.library form instead (importlib cannot be traced); eager calls skip that
    dispatch (~5.5 us per call, measured in library.py's docstring)."""
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return library.traced_call(name, args, kwargs)
        mod = importlib.import_module(f"{__name__}.{module}")
        return getattr(mod, name)(*args, **kwargs)

    call.__name__ = f"triton_{name}"
    return call


if importlib.util.find_spec("triton") is not None:
    from . import library  # defines the torch.library ops; imports no kernel
    from .tree_mask import pack_kernel_mask  # pure torch: eager and traced alike

    register("commit_kv", "triton", _lazy("commit_kv", "commit_kv"))
    register("greedy_verify", "triton", _lazy("greedy_verify", "greedy_verify"))
    register("tree_attention", "triton", _lazy("tree_attention", "tree_attention"),
             mask_form=pack_kernel_mask)  # bit-packed once per step
    register("lm_head_topk", "triton", _lazy("lm_head_topk", "lm_head_topk"))
    register("hydra_first_layer", "triton", _lazy("hydra_first_layer", "hydra_first_layer"))
    register("resblock", "triton", _lazy("resblock", "resblock"))
    register("lm_head_sample_stats", "triton", _lazy("lm_head_sample_stats", "lm_head_sample_stats"))
    register("typical_accept", "triton", _lazy("typical_accept", "typical_accept"))
    register("lm_head_residual_sample", "triton", _lazy("lm_head_residual_sample", "lm_head_residual_sample"))
    register("rejection_accept", "triton", _lazy("rejection_accept", "rejection_accept"))
    register("rms_norm", "triton", _lazy("rms_norm", "rms_norm"))
    register("rope_write_kv", "triton", _lazy("rope_write_kv", "rope_write_kv"))
    register("silu_mul", "triton", _lazy("silu_mul", "silu_mul"))
