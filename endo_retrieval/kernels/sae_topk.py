"""Fused SAE encode + Top-k [S3 Eq. 2-3] in Triton, beside its plain torch twin.

The kernel never writes the (N, d_latent) activations to global memory: each program takes BLOCK_M rows, loops
over latent tiles of BLOCK_N, computes ReLU((x - b_dec) W_enc^T + b_enc) for the tile in registers, and folds it
into a running top-k. An activation (>= 0 after ReLU, so its float bits order like integers) and its latent id
are packed into one int64 key, `bits << 32 | id`, so a single integer top-k carries both.
Given the G heads of each token, (G, N, d), one top-k runs over each latent's largest activation across the heads:
the "max" union of the heads' own top-k (`endo_retrieval.model.sae.aggregate_heads`) is this set, since a feature among
the k largest maxima is within the top-k of the head that attains its maximum.
Triton is imported lazily: on a machine without it the twin runs.
"""
from __future__ import annotations

import functools

import torch

from endo_retrieval.kernels import kernel_or_twin


def sae_topk_reference(x: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor, b_dec: torch.Tensor, k: int,
                       rows_per_step: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin: x (N, d) or the heads of N tokens (G, N, d) -> (ids int64 (N, k), acts (N, k)), largest first;
    materialises z a block of rows at a time."""
    heads = x if x.ndim == 3 else x.unsqueeze(0)
    ids, acts = [], []
    for part in heads.split(rows_per_step, dim=1):
        z = torch.relu((part - b_dec) @ W_enc.T + b_enc).amax(0)  # [S3 Eq. 2], each latent at its largest head
        a, i = z.topk(k, dim=1)  # [S3 Eq. 3]
        ids.append(i)
        acts.append(a)
    if not ids:
        return x.new_zeros((0, k), dtype=torch.int64), x.new_zeros((0, k))
    return torch.cat(ids), torch.cat(acts)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def sae_topk(x: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor, b_dec: torch.Tensor, k: int,
             use_kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the fused kernel for CUDA tensors when Triton is there, else the twin (same contract)."""
    if use_kernel and x.is_cuda and triton_available() and x.shape[-2] > 0:
        return kernel_or_twin("SAE", sae_topk_triton, sae_topk_reference, x, W_enc, b_enc, b_dec, k)
    return sae_topk_reference(x, W_enc, b_enc, b_dec, k)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    # N (rows) varies with every chunk tail and question: left unspecialised, so a new N never recompiles
    # (a recompile takes seconds, inside an index build or a first query)
    @triton.jit(do_not_specialize=["N"])
    def fused_encode_topk(x_ptr, w_ptr, b_enc_ptr, b_dec_ptr, ids_ptr, acts_ptr, N, D, L, G,
                          K_OUT: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        row_ok = rows < N
        x_mask = row_ok[:, None] & (dims[None, :] < D)
        b_dec = tl.load(b_dec_ptr + dims, mask=dims < D, other=0.0)
        best = tl.full((BLOCK_M, K), -1, tl.int64)  # below every packed key (keys are >= 0)
        for n0 in range(0, L, BLOCK_N):
            lat = n0 + tl.arange(0, BLOCK_N)
            lat_ok = lat < L
            w = tl.load(w_ptr + lat[:, None] * D + dims[None, :], mask=lat_ok[:, None] & (dims[None, :] < D),
                        other=0.0)
            b_enc = tl.load(b_enc_ptr + lat, mask=lat_ok, other=0.0)[None, :].to(tl.float32)
            z = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for g in range(G):  # a token's heads, each latent at its largest (not unrolled: 9 overflow shared memory)
                x = tl.load(x_ptr + (g * N + rows[:, None]) * D + dims[None, :], mask=x_mask, other=0.0)
                z = tl.maximum(z, tl.dot(x - b_dec[None, :], tl.trans(w), input_precision=PRECISION) + b_enc)
            z = tl.where(z > 0, z, 0.0)  # ReLU, [S3 Eq. 2] (+0.0, never -0.0, so bits stay >= 0)
            key = (z.to(tl.int32, bitcast=True).to(tl.int64) << 32) | lat[None, :].to(tl.int64)
            key = tl.where(lat_ok[None, :], key, -1)
            tile_top = tl.topk(key, K, dim=1)  # [S3 Eq. 3] on this tile
            both = tl.reshape(tl.join(best, tile_top), (BLOCK_M, 2 * K))
            best = tl.topk(both, K, dim=1)  # running top-k over the tiles seen so far
        out_cols = tl.arange(0, K)
        out_ok = row_ok[:, None] & (out_cols[None, :] < K_OUT)
        offs = rows[:, None] * K_OUT + out_cols[None, :]
        tl.store(ids_ptr + offs, best - ((best >> 32) << 32), mask=out_ok)
        tl.store(acts_ptr + offs, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), mask=out_ok)

    return fused_encode_topk


def sae_topk_triton(x: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor, b_dec: torch.Tensor, k: int,
                    block_m: int = 64, block_n: int | None = None, precision: str = "tf32",
                    num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused encode + top-k on CUDA: x (N, d) or (G, N, d) -> (ids int64 (N, k), acts float32 (N, k)), largest
    first.

    Blocks: for k <= 16, 64 rows x 256 latents with 8 warps, the fastest of 27 (block_m 16/32/64 x block_n
    64/128/256 x warps 2/4/8) for an index chunk (3 heads x 2048 tokens, d 64, 1024 latents, k 16; the timings are
    in docs/papers.md). A larger k keeps 64 x 128 with 4 warps (256 latents failed to compile for the test shapes
    with k 20-64).
    precision: "tf32" (tensor cores; activations agree with fp32 to ~1e-3 relative) or "ieee" (fp32 FMA).
    """
    import triton

    heads = x if x.ndim == 3 else x.unsqueeze(0)
    G, N, D = heads.shape
    L = W_enc.shape[0]
    K = triton.next_power_of_2(k)
    block_n = max(block_n or (256 if K <= 16 else 128), K)
    num_warps = num_warps or (8 if K <= 16 else 4)
    heads = heads.float().contiguous()
    W = W_enc.float().contiguous()
    ids = torch.empty((N, k), dtype=torch.int64, device=x.device)
    acts = torch.empty((N, k), dtype=torch.float32, device=x.device)
    _kernel()[(triton.cdiv(N, block_m),)](
        heads, W, b_enc.float().contiguous(), b_dec.float().contiguous(), ids, acts, N, D, L, G,
        K_OUT=k, K=K, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)),
        PRECISION=precision, num_warps=num_warps)
    return ids, acts
