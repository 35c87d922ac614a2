"""Fused position-agnostic top-k attention scores (ReAttention section 3.4, Figure 4), beside its torch twin.

For every query head h and query t, the k keys of the middle cache with the largest q_t . K^T (Eq. 2), without
writing the (H, T, M) score matrix: a program takes BLOCK_M queries of one head, walks the keys BLOCK_N at a time,
scores the tile in registers and folds it into a running top-k. A score and its key index travel together as one
int64, `order(score) << 32 | index`, where `order` maps float bits to integers that sort like the floats (negative
scores included), so one integer top-k carries both. Grouped-query attention: head h reads key head h // group.
Triton is imported lazily; without it (or on CPU) the twin runs.
"""
from __future__ import annotations

import functools
import warnings

import torch

from endo_retrieval.kernels.sae_topk import triton_available


def topk_scores_reference(q: torch.Tensor, k: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin: q (H, T, d), k (H_kv, M, d) -> (scores float32 (H, T, top_k), indices int64), largest first.

    It materialises the whole (H, T, M) score matrix, as a plain implementation does (the paper's baseline)."""
    group = q.shape[0] // k.shape[0]
    scores = torch.einsum("htd,hmd->htm", q.float(), k.float().repeat_interleave(group, dim=0))
    return scores.topk(min(top_k, k.shape[1]), dim=-1)


def order_bits(scores: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 with the same order (the kernel's packing; here for tests and decoding)."""
    b = scores.float().view(torch.int32)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 `order(score) << 32 | index` -> (scores float32, indices int64)."""
    hi = (packed >> 32).to(torch.int32)
    return (hi ^ ((hi >> 31) & 0x7FFFFFFF)).view(torch.float32), packed & 0xFFFFFFFF


def topk_scores(q: torch.Tensor, k: torch.Tensor, top_k: int, use_kernel: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the fused kernel for CUDA tensors when Triton is there, else the twin (same contract).

    A kernel that fails to compile on this GPU / Triton version warns once and falls back to the twin."""
    global _kernel_failed
    if use_kernel and q.is_cuda and triton_available() and not _kernel_failed and k.shape[1] > 0:
        try:
            return topk_scores_triton(q, k, top_k)
        except Exception as e:  # compile errors surface as many exception types across Triton versions
            _kernel_failed = True
            warnings.warn(f"Triton top-k attention kernel failed ({type(e).__name__}: {e}); using the torch twin.")
    return topk_scores_reference(q, k, top_k)


_kernel_failed = False


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def fused_topk_scores(q_ptr, k_ptr, out_ptr, T, M, D, GROUP,
                          K_OUT: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr):
        head = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        row_ok = rows < T
        q = tl.load(q_ptr + (head * T + rows[:, None]) * D + dims[None, :],
                    mask=row_ok[:, None] & (dims[None, :] < D), other=0.0)
        k_base = k_ptr + (head // GROUP) * M * D
        lowest = -9223372036854775807  # below every packed score
        best = tl.full((BLOCK_M, K), lowest, tl.int64)
        for n0 in range(0, M, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < M
            kt = tl.load(k_base + cols[:, None] * D + dims[None, :], mask=col_ok[:, None] & (dims[None, :] < D),
                         other=0.0)
            s = tl.dot(q, tl.trans(kt))  # (BLOCK_M, BLOCK_N) q . K^T, fp32 accumulate (Eq. 2)
            b = s.to(tl.int32, bitcast=True)
            key = ((b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32) | cols[None, :].to(tl.int64)
            key = tl.where(col_ok[None, :], key, lowest)
            tile_top = tl.topk(key, K, dim=1)
            best = tl.topk(tl.reshape(tl.join(best, tile_top), (BLOCK_M, 2 * K)), K, dim=1)
        out_cols = tl.arange(0, K)
        tl.store(out_ptr + (head * T + rows[:, None]) * K_OUT + out_cols[None, :], best,
                 mask=row_ok[:, None] & (out_cols[None, :] < K_OUT))

    return fused_topk_scores


def topk_scores_triton(q: torch.Tensor, k: torch.Tensor, top_k: int, block_m: int = 64, block_n: int = 64
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel on CUDA: same contract as `topk_scores_reference`; memory is the inputs plus (H, T, top_k)."""
    import triton

    H, T, D = q.shape
    M = k.shape[1]
    top_k = min(top_k, M)
    K = triton.next_power_of_2(top_k)
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    q, k = q.contiguous(), k.contiguous()
    packed = torch.empty((H, T, top_k), dtype=torch.int64, device=q.device)
    _kernel()[(triton.cdiv(T, block_m), H)](
        q, k, packed, T, M, D, H // k.shape[0], K_OUT=top_k, K=K, BLOCK_M=block_m, BLOCK_N=max(block_n, K),
        BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=4)
    return unpack(packed)
