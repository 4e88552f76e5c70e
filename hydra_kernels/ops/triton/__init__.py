"""Triton kernels, one file per op (ops/triton/<op>.py; what they share: common.py), registered as the
"triton" backend.

Kernel modules are imported on first use: Triton fixes interpreter mode (TRITON_INTERPRET=1, how the
CPU tier runs them) when a kernel is decorated, so importing them late lets the environment decide.
"""
from __future__ import annotations

import importlib.util

from ..backend import register


def _lazy(module: str, name: str):
    def call(*args, **kwargs):
        mod = importlib.import_module(f"{__name__}.{module}")
        return getattr(mod, name)(*args, **kwargs)

    call.__name__ = f"triton_{name}"
    return call


if importlib.util.find_spec("triton") is not None:
    register("commit_kv", "triton", _lazy("commit_kv", "commit_kv"))
    register("greedy_verify", "triton", _lazy("greedy_verify", "greedy_verify"))
    register("tree_attention", "triton", _lazy("tree_attention", "tree_attention"),
             mask_form=_lazy("tree_attention", "pack_kernel_mask"))  # bit-packed once per step
    register("lm_head_topk", "triton", _lazy("lm_head_topk", "lm_head_topk"))
    register("hydra_first_layer", "triton", _lazy("hydra_first_layer", "hydra_first_layer"))
    register("resblock", "triton", _lazy("resblock", "resblock"))
    register("lm_head_sample_stats", "triton", _lazy("lm_head_sample_stats", "lm_head_sample_stats"))
    register("typical_accept", "triton", _lazy("typical_accept", "typical_accept"))
