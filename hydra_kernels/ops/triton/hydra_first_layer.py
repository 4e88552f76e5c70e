"""Triton hydra_first_layer: a Hydra head's first layer fused (gather + concat-free matmul + SiLU +
linear residual).

Head d's first ResBlock maps x = cat(h, E(t_0), ..., E(t_d)) ((d+2)H wide) to H:
    y = R x + b_R + SiLU(W x + b_W)
We never build x. The weights are read in H-wide column blocks: W x = W_0 h + sum_j W_{j+1} E(t_j).
The h-term (W_0 h, R_0 h) is shared by every node of a sequence, so it is computed once per sequence
(two small GEMMs over [B, H]) and added in; the kernel gathers embedding rows by token id straight
from the table and accumulates both products in one pass over the weight columns (tensor-core dots,
each weight tile read once per row block, all nodes of the depth and all sequences in one launch).

Too few output tiles to fill the GPU (SmolLM2, H = 576: 9 programs on 132 SMs) and the reduction is
split (common.k_splits) along k within every column block: program (o, r, s) adds up columns
(j+1)H + [k_lo, k_hi) of slice s for every path position j into fp32 partials [2, splits, R, H] (W and
R), and a second kernel sums them in split order (deterministic: no atomics) before the h-terms,
biases and SiLU -- the epilogue needs the full sums.
Grid: (output tiles of H, row blocks of B * n, K splits); the finishing kernel's: (output tiles, row blocks).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import ieee_dots, k_splits, row_block
from .tuning import k_configs, launch


@triton.jit
def _first_layer_epilogue(acc_l, acc_r, hl_ptr, hr_ptr, bl_ptr, br_ptr, out_ptr, offs_r, offs_o, R, n, H,
                          HAS_BL: tl.constexpr, HAS_BR: tl.constexpr):
    """out = (acc_r + h_res + b_R) + SiLU(acc_l + h_lin + b_W) (acc_*: the full fp32 sums over the path)."""
    o_ok = offs_o < H
    b = offs_r // n  # the row's sequence: its shared h-term
    both = (offs_r < R)[:, None] & o_ok[None, :]
    acc_l += tl.load(hl_ptr + b[:, None].to(tl.int64) * H + offs_o[None, :], mask=both, other=0.0).to(tl.float32)
    acc_r += tl.load(hr_ptr + b[:, None].to(tl.int64) * H + offs_o[None, :], mask=both, other=0.0).to(tl.float32)
    if HAS_BL:
        acc_l += tl.load(bl_ptr + offs_o, mask=o_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BR:
        acc_r += tl.load(br_ptr + offs_o, mask=o_ok, other=0.0).to(tl.float32)[None, :]
    y = acc_r + acc_l * tl.sigmoid(acc_l)
    tl.store(out_ptr + offs_r[:, None].to(tl.int64) * H + offs_o[None, :], y.to(out_ptr.dtype.element_ty), mask=both)


@triton.jit
def _hydra_first_layer_kernel(tok_ptr, emb_ptr, wl_ptr, wr_ptr, hl_ptr, hr_ptr, bl_ptr, br_ptr, out_ptr, part_ptr,
                              R, n, H, D1, k_per, s_e, s_wl, s_wr, HAS_BL: tl.constexpr, HAS_BR: tl.constexpr,
                              SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr,
                              BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_o = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # row = (sequence b, node) flattened
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    r_ok = offs_r < R
    o_ok = offs_o < H
    # this program's K slice: columns (j+1)H + k_lo + [0, k_len) of the weights, k_lo + [0, k_len) of the
    # embedding rows (pointers moved to the slice: slice bounds kept live in the loops spilled)
    k_lo = pid_k * k_per
    k_len = tl.minimum(k_per, H - k_lo)
    emb_ptr += k_lo
    wl_ptr += k_lo
    wr_ptr += k_lo
    acc_l = tl.zeros([BLOCK_R, BLOCK_O], tl.float32)
    acc_r = tl.zeros([BLOCK_R, BLOCK_O], tl.float32)
    for j in range(0, D1):  # path position j: token t_j, weight columns (j+1)H + k_lo + [0, k_len)
        tok = tl.load(tok_ptr + offs_r.to(tl.int64) * D1 + j, mask=r_ok, other=0)
        for k0 in range(0, k_len, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_len
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
    if SPLIT:  # partials [2, splits, R, H] fp32 (W's, then R's); the finishing kernel applies the epilogue
        both = r_ok[:, None] & o_ok[None, :]
        p = part_ptr + (pid_k * R + offs_r[:, None]).to(tl.int64) * H + offs_o[None, :]
        tl.store(p, acc_l, mask=both)
        tl.store(p + tl.num_programs(2).to(tl.int64) * R * H, acc_r, mask=both)
    else:
        _first_layer_epilogue(acc_l, acc_r, hl_ptr, hr_ptr, bl_ptr, br_ptr, out_ptr, offs_r, offs_o, R, n, H,
                              HAS_BL, HAS_BR)


@triton.jit
def _hydra_first_layer_finish_kernel(part_ptr, hl_ptr, hr_ptr, bl_ptr, br_ptr, out_ptr, R, n, H, n_splits,
                                     HAS_BL: tl.constexpr, HAS_BR: tl.constexpr, BLOCK_R: tl.constexpr,
                                     BLOCK_O: tl.constexpr):
    """Sums of the split partials in split order, then the epilogue."""
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_o = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
    both = (offs_r < R)[:, None] & (offs_o < H)[None, :]
    acc_l = tl.zeros([BLOCK_R, BLOCK_O], tl.float32)
    acc_r = tl.zeros([BLOCK_R, BLOCK_O], tl.float32)
    for s in range(0, n_splits):
        p = part_ptr + (s * R + offs_r[:, None]).to(tl.int64) * H + offs_o[None, :]
        acc_l += tl.load(p, mask=both, other=0.0)
        acc_r += tl.load(p + n_splits.to(tl.int64) * R * H, mask=both, other=0.0)
    _first_layer_epilogue(acc_l, acc_r, hl_ptr, hr_ptr, bl_ptr, br_ptr, out_ptr, offs_r, offs_o, R, n, H,
                          HAS_BL, HAS_BR)


def _configs(dtype: torch.dtype, BLOCK_R: int) -> list:
    """Launch configs (tuning.k_configs), the hand-picked one first: the K step (common.k_step) at 4 warps.
    fp32 with 64-row tiles takes 8 warps: its two FMA-dot accumulators at 4 warps kept 255 registers and
    a stack frame on sm_80 even at a K step of 16 (while 16-row tiles at 8 warps kept a 16-byte one).
    Two accumulators leave less room than the other kernels: fp32 drops the doubled step and 16-bit the
    4-stage pipeline (each kept an 8-16 byte stack frame with 64-row tiles)."""
    fp32 = dtype == torch.float32
    return k_configs("BLOCK_K", dtype, 8 if fp32 and BLOCK_R >= 64 else 4, longer_warps=None if fp32 else 8,
                     deeper=fp32)


def hydra_first_layer(h, path_tokens, emb, w_lin, b_lin, w_res, b_res, *, splits: int | None = None, config=None):
    """Same contract as reference.hydra_first_layer. splits: K splits (default: common.k_splits from the grid
    and the SM count; tests force 1 or several); config: a tuning override (tests)."""
    B, n, D1 = path_tokens.shape
    H = h.shape[1]
    R = B * n
    out = torch.empty(B, n, H, dtype=h.dtype, device=h.device)
    if R == 0:
        return out
    # the h-term once per sequence: [B, H] each (column block 0 of both weights; strided views, no copy)
    h_lin = torch.nn.functional.linear(h, w_lin[:, :H]).contiguous()
    h_res = torch.nn.functional.linear(h, w_res[:, :H]).contiguous()
    tok = path_tokens.reshape(R, D1).to(torch.int64).contiguous()
    w_lin = w_lin if w_lin.stride(1) == 1 else w_lin.contiguous()
    w_res = w_res if w_res.stride(1) == 1 else w_res.contiguous()
    emb = emb if emb.stride(1) == 1 else emb.contiguous()
    BLOCK_R, BLOCK_O = row_block(R), 64
    grid = (triton.cdiv(H, BLOCK_O), triton.cdiv(R, BLOCK_R))
    n_splits, k_per = k_splits(H, grid[0] * grid[1], h.device, splits)
    part = torch.empty(2, n_splits, R, H, dtype=torch.float32, device=h.device) if n_splits > 1 else out
    bl, br = (b_lin if b_lin is not None else h_lin), (b_res if b_res is not None else h_res)
    flags = dict(HAS_BL=b_lin is not None, HAS_BR=b_res is not None, BLOCK_R=BLOCK_R, BLOCK_O=BLOCK_O)
    launch(_hydra_first_layer_kernel, (*grid, n_splits),
           (tok, emb, w_lin, w_res, h_lin, h_res, bl, br, out, part, R, n, H, D1, k_per, emb.stride(0),
            w_lin.stride(0), w_res.stride(0)),
           dict(flags, SPLIT=n_splits > 1, IEEE=ieee_dots(h.dtype)), _configs(h.dtype, BLOCK_R),
           key=["R", "H", "D1", "k_per"], config=config)
    if n_splits > 1:
        _hydra_first_layer_finish_kernel[grid](part, h_lin, h_res, bl, br, out, R, n, H, n_splits, **flags)
    return out
