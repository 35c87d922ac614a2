"""Fused position-agnostic top-k attention scores (ReAttention section 3.4, Figure 4), beside its torch twin.

For every query head h and query t, the k keys of the middle cache with the largest q_t . K^T [ReAttention Eq. 2],
without writing the (H, T, M) score matrix: a program takes BLOCK_M queries of one head, walks the keys BLOCK_N at a
time, scores the tile in registers and folds it into a running top-k: a tile whose best score beats no row's current
k-th best is skipped after one reduction (most tiles, once the running top-k is good); otherwise its k largest
scores are taken in turn and each replaces its row's weakest slot if larger. Grouped-query attention: head h
reads key head h // group.
Triton is imported lazily; without it (or on CPU) the twin runs.
"""
from __future__ import annotations

import functools

import torch

from endo_retrieval.kernels import kernel_or_twin
from endo_retrieval.kernels.sae_topk import triton_available


def topk_scores_reference(q: torch.Tensor, k: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin: q (H, T, d), k (H_kv, M, d) -> (scores float32 (H, T, top_k), indices int64), largest first.

    It materialises the whole (H, T, M) score matrix, as a plain implementation does (the paper's baseline)."""
    group = q.shape[0] // k.shape[0]
    scores = torch.einsum("htd,hmd->htm", q.float(), k.float().repeat_interleave(group, dim=0))
    return scores.topk(min(top_k, k.shape[1]), dim=-1)


def topk_scores(q: torch.Tensor, k: torch.Tensor, top_k: int, use_kernel: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the fused kernel for CUDA tensors when Triton is there, else the twin (same contract)."""
    if use_kernel and q.is_cuda and triton_available() and k.shape[1] > 0:
        return kernel_or_twin("top-k attention", topk_scores_triton, topk_scores_reference, q, k, top_k)
    return topk_scores_reference(q, k, top_k)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    # T, M and SPLIT_LEN change with every decode step: unspecialised, so a new length never recompiles
    @triton.jit(do_not_specialize=["T", "M", "SPLIT_LEN"])
    def fused_topk_scores(q_ptr, k_ptr, val_ptr, idx_ptr, T, M, D, GROUP, SPLIT_LEN,
                          K_OUT: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr):
        head = tl.program_id(1)
        part = tl.program_id(2)  # this program's share of the keys: [part * SPLIT_LEN, (part + 1) * SPLIT_LEN)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        slots = tl.arange(0, K)
        row_ok = rows < T
        q = tl.load(q_ptr + (head * T + rows[:, None]) * D + dims[None, :],
                    mask=row_ok[:, None] & (dims[None, :] < D), other=0.0)
        k_base = k_ptr + (head // GROUP) * M * D
        # the running top-k of each query row, unsorted; slots past K_OUT stay +inf so they are never replaced
        best = tl.where(slots[None, :] < K_OUT, float("-inf"), float("inf")) + tl.zeros((BLOCK_M, K), tl.float32)
        best_i = tl.zeros((BLOCK_M, K), tl.int32)
        n_end = tl.minimum(M, (part + 1) * SPLIT_LEN)
        for n0 in range(part * SPLIT_LEN, n_end, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < n_end
            kt = tl.load(k_base + cols[:, None] * D + dims[None, :], mask=col_ok[:, None] & (dims[None, :] < D),
                         other=0.0)
            s = tl.dot(q, tl.trans(kt))  # (BLOCK_M, BLOCK_N) q . K^T in registers, fp32 accumulate [ReAttention Eq. 2]
            s = tl.where(col_ok[None, :], s, float("-inf"))
            floor = tl.min(best, 1)
            if tl.max(tl.max(s, 1) - floor) > 0:  # some row improves; else nothing in this tile can enter
                for _ in tl.static_range(K_OUT):  # at most K_OUT of a tile enter: take its maxima in turn
                    c = tl.max(s, 1)
                    ci = tl.argmax(s, 1)
                    floor = tl.min(best, 1)
                    weakest = tl.argmin(best, 1)
                    swap = (slots[None, :] == weakest[:, None]) & (c > floor)[:, None]
                    best = tl.where(swap, c[:, None], best)
                    best_i = tl.where(swap, n0 + ci[:, None], best_i)
                    s = tl.where(tl.arange(0, BLOCK_N)[None, :] == ci[:, None], float("-inf"), s)
        out = ((part * tl.num_programs(1) + head) * T + rows[:, None]) * K_OUT + slots[None, :]
        ok = row_ok[:, None] & (slots[None, :] < K_OUT)
        tl.store(val_ptr + out, best, mask=ok)
        tl.store(idx_ptr + out, best_i, mask=ok)

    return fused_topk_scores


def topk_scores_triton(q: torch.Tensor, k: torch.Tensor, top_k: int, block_m: int = 64, block_n: int = 64
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel on CUDA: same contract as `topk_scores_reference`; memory beyond the inputs is
    splits x (H, T, top_k) candidates, merged by one small top-k."""
    import triton

    H, T, D = q.shape
    M = k.shape[1]
    top_k = min(top_k, M)
    K = triton.next_power_of_2(top_k)
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    q, k = q.contiguous(), k.contiguous()
    # split the keys over programs until the GPU is full (a decode step alone is only H programs)
    programs = triton.cdiv(T, block_m) * H
    splits = max(1, min(triton.cdiv(4 * _sm_count(q.device), programs), triton.cdiv(M, 4 * block_n)))
    split_len = triton.cdiv(triton.cdiv(M, splits), block_n) * block_n
    splits = triton.cdiv(M, split_len)
    values = torch.empty((splits, H, T, top_k), dtype=torch.float32, device=q.device)
    index = torch.empty((splits, H, T, top_k), dtype=torch.int32, device=q.device)
    _kernel()[(triton.cdiv(T, block_m), H, splits)](
        q, k, values, index, T, M, D, H // k.shape[0], split_len, K_OUT=top_k, K=K, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=4)
    values, index = values.permute(1, 2, 0, 3).flatten(2), index.permute(1, 2, 0, 3).flatten(2)
    values, order = values.topk(top_k, dim=-1)  # merge the splits' candidates, largest first
    return values, index.gather(-1, order).long()


@functools.cache
def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
