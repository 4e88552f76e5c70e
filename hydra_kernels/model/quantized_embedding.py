"""The token embedding of a quantized checkpoint, served from quantized panels: tied, the LM head's; untied, its own.

On the CPU a quantized GGUF's LM head runs on its Q8_0 (or other) panels (ops/quantized_linear.py), whose rows
dequantize to exactly the fp32 values the file stores, and an untied embedding in such a format is packed the same
way. Keeping an fp32 copy of the table beside them cost 113 MB for SmolLM2 (V = 49152, H = 576), the largest single
item in a decoding process's peak memory after torch itself (issue 44: 591 MB with the default drafter, 2.4x
llama.cpp), and 2.1 GB for Llama-3-8B's untied embedding (V = 128256, H = 4096).

Here the embedding holds no fp32 table: a lookup reads the rows it needs from the panels (quantized_rows, the
same values bit for bit as the fp32 table's rows), and `weight` is a meta placeholder of the table's shape and
dtype, as for a released Linear (model/packed_linear.py). Code that needs the whole table's values asks the
model (Llama.embedding_weight / lm_head_weight, a transient fp32 copy; Llama.lm_head_rows for some rows). `.to()`,
state_dict and load_state_dict bring the fp32 table back first, so nothing reads a placeholder as values.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops.quantized_linear import QuantizedPanels


class QuantizedEmbedding(nn.Embedding):
    """nn.Embedding (same name and state_dict) whose table is `panels` [V, H] while they are set."""

    def __init__(self, panels: QuantizedPanels):
        # the placeholder: shape and dtype only. Given as _weight, so that no init runs: on the meta device
        # init.normal_ imports torch._dynamo and Triton (~90 MB resident; Llama.empty skips it likewise)
        super().__init__(panels.n, panels.k, _weight=torch.empty(panels.n, panels.k, device="meta"),
                         _freeze=True)
        self.panels: QuantizedPanels | None = panels

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.panels is None:
            return super().forward(ids)
        if ids.dtype not in (torch.int32, torch.int64) or not ids.is_cpu:
            raise ValueError(f"token ids must be int32/int64 CPU tensors for the quantized embedding, got {ids.dtype} "
                             f"on {ids.device}")
        flat = ids.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token ids must be in [0, {self.num_embeddings}), got [{int(flat.min())}, "
                             f"{int(flat.max())}]")
        return self.panels.rows(flat).view(*ids.shape, self.embedding_dim)

    def dense(self) -> torch.Tensor:
        """The table's exact fp32 values [V, H] (a new tensor while the panels hold them)."""
        return self.weight if self.panels is None else self.panels.dequantize()

    def restore_original(self) -> None:
        """The table becomes a real fp32 Parameter again (the panels dropped from this module)."""
        if self.panels is not None:
            dense = self.panels.dequantize()
            self.panels = None
            self.weight = nn.Parameter(dense, requires_grad=False)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.panels is not None:
            destination[prefix + "weight"] = self.panels.dequantize()

    def _load_from_state_dict(self, *args, **kwargs):
        self.restore_original()  # loading writes into (or assigns) a real table
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        panels = self.panels
        self.restore_original()  # .to() / .cuda() / .half() move the real table
        out = super()._apply(fn, *args, **kwargs)
        w = self.weight
        if panels is not None and w.device.type == "cpu" and w.dtype == torch.float32 and torch.equal(
                w, panels.dequantize()):  # still the fp32 CPU table (e.g. .to("cpu")): the panels only again
            self.weight = nn.Parameter(torch.empty(w.shape, device="meta"), requires_grad=False)
            self.panels = panels
        return out
