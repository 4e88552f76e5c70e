"""Triton hydra_first_layer: a Hydra head's first layer fused (gather + concat-free matmul + SiLU +
linear residual).

Head d's first ResBlock maps x = cat(h, E(t_0), ..., E(t_d)) ((d+2)H wide) to H:
    y = R x + b_R + SiLU(W x + b_W)
We never build x. The weights are read in H-wide column blocks: W x = W_0 h + sum_j W_{j+1} E(t_j).
The h-term (W_0 h, R_0 h) is shared by every node of a sequence, so it is computed once per sequence
(two small GEMMs over [B, H]) and added in; the kernel gathers embedding rows by token id straight
from the table and accumulates both products in one pass over the weight columns (tensor-core dots,
each weight tile read once per row block, all nodes of the depth and all sequences in one launch).
Grid: (output tiles of H, row blocks of B * n).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import ieee_dots, k_step, row_block
from .tuning import cfg, launch


@triton.jit
def _hydra_first_layer_kernel(tok_ptr, emb_ptr, wl_ptr, wr_ptr, hl_ptr, hr_ptr, bl_ptr, br_ptr, out_ptr,
                              R, n, H, D1, s_e, s_wl, s_wr, HAS_BL: tl.constexpr, HAS_BR: tl.constexpr,
                              BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                              IEEE: tl.constexpr):
    pid_o = tl.program_id(0)
    pid_r = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # row = (sequence b, node) flattened
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    r_ok = offs_r < R
    o_ok = offs_o < H
    acc_l = tl.zeros([BLOCK_R, BLOCK_O], tl.float32)
    acc_r = tl.zeros([BLOCK_R, BLOCK_O], tl.float32)
    for j in range(0, D1):  # path position j: token t_j, weight columns [(j+1)H, (j+2)H)
        tok = tl.load(tok_ptr + offs_r.to(tl.int64) * D1 + j, mask=r_ok, other=0)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < H
            e = tl.load(emb_ptr + tok[:, None] * s_e + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            col = (j + 1) * H + offs_k
            wm = o_ok[:, None] & k_ok[None, :]
            wl = tl.load(wl_ptr + offs_o[:, None].to(tl.int64) * s_wl + col[None, :], mask=wm, other=0.0)
            wr = tl.load(wr_ptr + offs_o[:, None].to(tl.int64) * s_wr + col[None, :], mask=wm, other=0.0)
            if IEEE:
                e32 = e.to(tl.float32)
                acc_l += tl.dot(e32, tl.trans(wl.to(tl.float32)), input_precision="ieee")
                acc_r += tl.dot(e32, tl.trans(wr.to(tl.float32)), input_precision="ieee")
            else:
                acc_l += tl.dot(e, tl.trans(wl))
                acc_r += tl.dot(e, tl.trans(wr))
    b = offs_r // n  # the row's sequence: its shared h-term
    both = r_ok[:, None] & o_ok[None, :]
    acc_l += tl.load(hl_ptr + b[:, None].to(tl.int64) * H + offs_o[None, :], mask=both, other=0.0).to(tl.float32)
    acc_r += tl.load(hr_ptr + b[:, None].to(tl.int64) * H + offs_o[None, :], mask=both, other=0.0).to(tl.float32)
    if HAS_BL:
        acc_l += tl.load(bl_ptr + offs_o, mask=o_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BR:
        acc_r += tl.load(br_ptr + offs_o, mask=o_ok, other=0.0).to(tl.float32)[None, :]
    y = acc_r + acc_l * tl.sigmoid(acc_l)
    tl.store(out_ptr + offs_r[:, None].to(tl.int64) * H + offs_o[None, :], y.to(out_ptr.dtype.element_ty), mask=both)


def _configs(dtype: torch.dtype, BLOCK_R: int) -> list:
    """Launch configs (tuning.py), the hand-picked one first: the K step (common.k_step), warps, stages.
    fp32 with 64-row tiles takes 8 warps: its two FMA-dot accumulators at 4 warps kept 255 registers and
    a stack frame on sm_80 even at a K step of 16 (while 16-row tiles at 8 warps kept a 16-byte one)."""
    return [cfg(BLOCK_K=k_step(dtype), num_warps=8 if dtype == torch.float32 and BLOCK_R >= 64 else 4)]


def hydra_first_layer(h, path_tokens, emb, w_lin, b_lin, w_res, b_res, *, config=None):
    """Same contract as reference.hydra_first_layer. config: a tuning override (tests)."""
    B, n, D1 = path_tokens.shape
    H = h.shape[1]
    R = B * n
    out = torch.empty(B, n, H, dtype=h.dtype, device=h.device)
    if R == 0:
        return out
    # the h-term once per sequence: [B, H] each (column block 0 of both weights; strided views, no copy)
    h_lin = torch.nn.functional.linear(h, w_lin[:, :H])
    h_res = torch.nn.functional.linear(h, w_res[:, :H])
    tok = path_tokens.reshape(R, D1).to(torch.int64).contiguous()
    w_lin = w_lin if w_lin.stride(1) == 1 else w_lin.contiguous()
    w_res = w_res if w_res.stride(1) == 1 else w_res.contiguous()
    emb = emb if emb.stride(1) == 1 else emb.contiguous()
    BLOCK_R, BLOCK_O = row_block(R), 64
    launch(_hydra_first_layer_kernel, (triton.cdiv(H, BLOCK_O), triton.cdiv(R, BLOCK_R)),
           (tok, emb, w_lin, w_res, h_lin.contiguous(), h_res.contiguous(),
            b_lin if b_lin is not None else h_lin, b_res if b_res is not None else h_res, out,
            R, n, H, D1, emb.stride(0), w_lin.stride(0), w_res.stride(0)),
           dict(HAS_BL=b_lin is not None, HAS_BR=b_res is not None, BLOCK_R=BLOCK_R, BLOCK_O=BLOCK_O,
                IEEE=ieee_dots(h.dtype)), _configs(h.dtype, BLOCK_R), key=["R", "H", "D1"], config=config)
    return out
