"""One PrHS decode step (PrHS section IV-A) fused into two Triton launches, beside its torch twin.

Per query head h, with N cached keys, the middle M = [lo, hi) (lo = max(sink, PSAW window), hi = N - local):
1. CIS gate [PrHS Eq. 12]: h shares when its reference retrieval lies in this block and cos(q, q_ref) > tau.
2. A head that does not share scores M by q . K^T and keeps its top-k S*_t; its reference becomes q, the block,
   and S*_t with its m = floor(k/3) best indices dilated by +-r [PrHS Eq. 13].
3. Attention over sinks [0, sink) + local [hi, N) + (S*_t, or the shared dilated set), restricted to the visible
   keys (pos < sink or pos >= window, [PrHS Eq. 15]), one softmax.
The CIS state (ref_q (H, d), ref_set (H, k + m(2r+1)), ref_block (H,)) is updated in place and the retrieving
heads are added to `retrievals`, on the device: a step never synchronises with the host.

Kernel A scores only the retrieving heads' middles, split over many programs (a decode step alone is H programs),
each KV tile loaded once for its query heads. Kernel B, one program per head, takes the top-k by a radix select
over the scores' order-preserving integer keys (four 256-bin histograms, no sort) and the m best among those k,
writes the new reference, removes duplicate positions of a dilated set (each slot stakes its position in a scratch
row; the slot that wins keeps it) and attends with gathered keys. The middle must hold at least k keys (the
caller's job).
Triton is imported lazily; without it (or on CPU) the twin runs.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from endo_retrieval.kernels import kernel_or_twin
from endo_retrieval.kernels.sae_topk import triton_available


def prhs_reads(q, qr, keys, ref_q, ref_set, ref_block, retrievals, *, block: int, window: int, sink: int,
               local: int, top_k: int, radius: int, tau: float, cis: bool) -> torch.Tensor:
    """The twin's selection: boolean (H, N) of the keys each head reads this step, updating the CIS state.
    q, qr (H, d): the step's query before / after RoPE; keys (H_kv, N, d): the rotated cache with the new token."""
    H, N = q.shape[0], keys.shape[1]
    pos = torch.arange(N, device=q.device)
    lo, hi = max(sink, window), N - local
    critical = ((pos < sink) | (pos >= hi)).expand(H, N).clone()
    similar = F.cosine_similarity(q.float(), ref_q.float(), dim=-1) > tau  # [PrHS Eq. 12]
    share = (ref_block == block) & similar if cis else torch.zeros(H, dtype=torch.bool, device=q.device)
    critical[share] = critical[share].scatter(1, ref_set[share].clamp(0, N - 1), True)
    kv = torch.arange(H, device=q.device) // (H // keys.shape[0])
    scores = torch.einsum("hd,hnd->hn", qr.float(), keys[kv, lo:hi].float())
    picks = scores.topk(top_k, dim=-1).indices + lo  # S*_t, best first
    need = ~share
    critical[need] = critical[need].scatter(1, picks[need], True)
    if cis:  # [PrHS Eq. 13]: the m best of S*_t widened by +-r become the set a similar query may share
        offsets = torch.arange(-radius, radius + 1, device=q.device)
        dilated = torch.cat([picks, (picks[:, :top_k // 3, None] + offsets).flatten(1)], dim=1)
        ref_q[need], ref_set[need], ref_block[need] = q[need], dilated[need], block
    retrievals += need.sum()
    return critical & ((pos < sink) | (pos >= window))  # visible: sinks and [P_l(t), t] [PrHS Eq. 15]


def attend_reads(qr, keys, values, reads, scaling: float) -> torch.Tensor:
    """Attention of qr (H, d) over the keys (H_kv, N, d) that `reads` (H, N) marks; (H, d) in qr's dtype."""
    return F.scaled_dot_product_attention(qr[None, :, None], keys[None].to(qr.dtype), values[None].to(qr.dtype),
                                          attn_mask=reads[None, :, None, :], scale=scaling, enable_gqa=True)[0, :, 0]


def prhs_step_reference(q, qr, keys, values, ref_q, ref_set, ref_block, retrievals, *, scaling: float, **selection
                        ) -> torch.Tensor:
    """Torch twin: attention of qr over the keys `prhs_reads` selects; returns (H, d) in q's dtype."""
    reads = prhs_reads(q, qr, keys, ref_q, ref_set, ref_block, retrievals, **selection)
    return attend_reads(qr, keys, values, reads, scaling)


def prhs_step(q, qr, keys, values, ref_q, ref_set, ref_block, retrievals, use_kernel: bool = True, **settings
              ) -> torch.Tensor:
    """Dispatch: the fused kernels for CUDA tensors when Triton is there, else the twin (same contract)."""
    if use_kernel and q.is_cuda and triton_available():
        run = lambda *a: prhs_step_triton(*a, **settings)
        twin = lambda *a: prhs_step_reference(*a, **settings)
        return kernel_or_twin("PrHS step", run, twin, q, qr, keys, values, ref_q, ref_set, ref_block, retrievals)
    return prhs_step_reference(q, qr, keys, values, ref_q, ref_set, ref_block, retrievals, **settings)


@functools.cache
def _device_functions():
    """The device functions both kernels call: the CIS gate, row loads, logits, and the radix select's parts."""
    import triton
    import triton.language as tl

    @triton.jit
    def shares(q_ptr, ref_q_ptr, ref_block_ptr, h, block, tau, D: tl.constexpr):
        """[PrHS Eq. 12] for head h (as torch's cosine_similarity: x.y / sqrt(max(|x|^2 |y|^2, eps^2)))."""
        dims = tl.arange(0, D)
        x = tl.load(q_ptr + h * D + dims).to(tl.float32)
        y = tl.load(ref_q_ptr + h * D + dims).to(tl.float32)
        cos = tl.sum(x * y) / tl.sqrt(tl.maximum(tl.sum(x * x) * tl.sum(y * y), 1e-16))
        return (tl.load(ref_block_ptr + h) == block) & (cos > tau)

    @triton.jit
    def rows(base, row_stride, idx, ok, D: tl.constexpr):
        """Rows idx of a (N, D) matrix at base, as fp32; zeros where not ok."""
        dims = tl.arange(0, D)
        return tl.load(base + idx[:, None] * row_stride + dims[None, :], mask=ok[:, None], other=0.0).to(tl.float32)

    @triton.jit
    def logits(k_head, k_row_stride, idx, ok, q, scaling, D: tl.constexpr):
        """q . k * scaling for the keys idx; -inf where not ok."""
        return tl.where(ok, tl.sum(rows(k_head, k_row_stride, idx, ok, D) * q[None, :], 1) * scaling, float("-inf"))

    @triton.jit
    def top(key, valid, K):
        """Mask of exactly K largest int32 keys where valid: a radix select, one 8-bit digit at a time from the top
        (a 256-bin histogram of the candidates' digit finds the digit of the K-th largest); ties at the threshold
        are taken in position order."""
        bins = tl.arange(0, 256)
        cand = valid  # keys that share the K-th largest key's digits so far
        taken = tl.zeros(key.shape, tl.int1)  # keys already known to be above it
        left = K  # places still to fill from cand
        for d in tl.static_range(4):
            digit = (key >> (24 - 8 * d)) & 0xFF
            if d == 0:
                digit = digit ^ 0x80  # the sign bit: negative keys below positive ones
            hist = tl.histogram(digit, 256, mask=cand)
            above = tl.cumsum(hist, 0, reverse=True) - hist  # candidates with a larger digit than each bin's
            b = tl.max(tl.where((above < left) & (above + hist >= left), bins, -1))
            left = left - tl.sum(tl.where(bins == b, above, 0))
            taken = taken | (cand & (digit > b))
            cand = cand & (digit == b)
        if tl.sum(cand.to(tl.int32)) > left:  # rare: more keys equal the threshold than places are left
            cand = cand & (tl.cumsum(cand.to(tl.int32), 0) <= left)
        return taken | cand

    @triton.jit
    def sortable(s):
        """float32 -> int32 with the same order."""
        bits = s.to(tl.int32, bitcast=True)
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)

    return shares, rows, logits, top, sortable


@functools.cache
def _score_middle():
    """Kernel A: the retrieving heads' scores over the middle."""
    import triton
    import triton.language as tl

    shares, rows, _, _, _ = _device_functions()

    @triton.jit(do_not_specialize=["lo", "hi", "block", "score_stride"])
    def score_middle(q_ptr, qr_ptr, k_ptr, ref_q_ptr, ref_block_ptr, score_ptr, k_head_stride, k_row_stride,
                     score_stride, lo, hi, block, tau, GROUP: tl.constexpr, D: tl.constexpr,
                     BLOCK_N: tl.constexpr):
        kv = tl.program_id(0)  # one KV head's tile, scored for each of its query heads that retrieves
        cols = lo + tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, D)
        any_need = ~shares(q_ptr, ref_q_ptr, ref_block_ptr, kv * GROUP, block, tau, D)
        for g in tl.static_range(1, GROUP):
            any_need = any_need | ~shares(q_ptr, ref_q_ptr, ref_block_ptr, kv * GROUP + g, block, tau, D)
        ok = (cols < hi) & any_need  # a group whose heads all share loads nothing
        kt = rows(k_ptr + kv * k_head_stride, k_row_stride, cols, ok, D)
        for g in tl.static_range(GROUP):
            h = kv * GROUP + g
            need = ~shares(q_ptr, ref_q_ptr, ref_block_ptr, h, block, tau, D)
            q = tl.load(qr_ptr + h * D + dims).to(tl.float32)
            tl.store(score_ptr + h * score_stride + cols, tl.sum(kt * q[None, :], 1), mask=ok & need)

    return score_middle


@functools.cache
def _select_attend():
    """Kernel B: per head, the top-k and the CIS reference, the dilated set's duplicates removed, the attention."""
    import triton
    import triton.language as tl

    shares, rows, logits, top, sortable = _device_functions()

    @triton.jit(do_not_specialize=["N", "lo", "hi", "window", "block", "score_stride", "owner_stride"])
    def select_attend(q_ptr, qr_ptr, k_ptr, v_ptr, ref_q_ptr, ref_set_ptr, ref_block_ptr, score_ptr, owner_ptr,
                      out_ptr, count_ptr, k_head_stride, k_row_stride, v_head_stride, v_row_stride, score_stride,
                      owner_stride, N, lo, hi, window, block, tau, scaling, GROUP: tl.constexpr, D: tl.constexpr,
                      SINK: tl.constexpr, SINK_PAD: tl.constexpr, LOCAL: tl.constexpr, LOCAL_PAD: tl.constexpr,
                      TOP_K: tl.constexpr, M_BEST: tl.constexpr, RADIUS: tl.constexpr, SET: tl.constexpr,
                      SET_PAD: tl.constexpr, MID_PAD: tl.constexpr, TOP_PAD: tl.constexpr, CIS: tl.constexpr):
        h = tl.program_id(0)
        need = ~shares(q_ptr, ref_q_ptr, ref_block_ptr, h, block, tau, D)
        dims = tl.arange(0, D)
        row = ref_set_ptr + h * SET
        if need:  # S*_t: the top-k of the middle, and the reference a later query may share [PrHS Eq. 13]
            cols = lo + tl.arange(0, MID_PAD)
            inside = cols < hi
            key = sortable(tl.load(score_ptr + h * score_stride + cols, mask=inside, other=0.0))
            picked = top(key, inside, TOP_K)
            tl.store(row + tl.cumsum(picked.to(tl.int32), 0) - 1, cols, mask=picked)  # in position order
            tl.debug_barrier()
            if M_BEST > 0:
                slot = tl.arange(0, TOP_PAD)  # the m best are taken among the k picks only
                pick = tl.load(row + slot, mask=slot < TOP_K, other=0)
                best = top(sortable(tl.load(score_ptr + h * score_stride + pick, mask=slot < TOP_K, other=0.0)),
                           slot < TOP_K, M_BEST)
                at = TOP_K + (tl.cumsum(best.to(tl.int32), 0) - 1) * (2 * RADIUS + 1)
                for o in tl.static_range(2 * RADIUS + 1):
                    tl.store(row + at + o, pick + o - RADIUS, mask=best)
            if CIS:
                tl.store(ref_q_ptr + h * D + dims, tl.load(q_ptr + h * D + dims))
                tl.store(ref_block_ptr + h, block)
            tl.atomic_add(count_ptr, 1)
        tl.debug_barrier()  # the row just written is read back by other threads
        slots = tl.arange(0, SET_PAD)
        idx = tl.load(row + slots, mask=slots < tl.where(need, TOP_K, SET), other=-1)
        idx = tl.minimum(tl.maximum(idx, 0), N - 1)  # as the twin's clamp
        ok = (slots < tl.where(need, TOP_K, SET)) & (idx >= lo) & (idx < hi)  # sinks / local come below
        stake = owner_ptr + h * owner_stride + idx
        tl.store(stake, slots, mask=ok)  # a position listed twice: one slot's stake survives
        tl.debug_barrier()
        ok = ok & (tl.load(stake, mask=ok, other=-1) == slots)

        q = tl.load(qr_ptr + h * D + dims).to(tl.float32)
        k_head, v_head = k_ptr + (h // GROUP) * k_head_stride, v_ptr + (h // GROUP) * v_head_stride
        sp = tl.arange(0, SINK_PAD)
        sink_ok = sp < SINK
        lp = hi + tl.arange(0, LOCAL_PAD)
        local_ok = (tl.arange(0, LOCAL_PAD) < LOCAL) & (lp >= window)
        a_sink = logits(k_head, k_row_stride, sp, sink_ok, q, scaling, D)
        a_local = logits(k_head, k_row_stride, lp, local_ok, q, scaling, D)
        a_set = logits(k_head, k_row_stride, idx, ok, q, scaling, D)
        top_logit = tl.maximum(tl.maximum(tl.max(a_sink), tl.max(a_local)), tl.max(a_set))
        p_sink, p_local, p_set = tl.exp(a_sink - top_logit), tl.exp(a_local - top_logit), tl.exp(a_set - top_logit)
        acc = tl.sum(p_sink[:, None] * rows(v_head, v_row_stride, sp, sink_ok, D), 0) \
            + tl.sum(p_local[:, None] * rows(v_head, v_row_stride, lp, local_ok, D), 0) \
            + tl.sum(p_set[:, None] * rows(v_head, v_row_stride, idx, ok, D), 0)
        total = tl.sum(p_sink) + tl.sum(p_local) + tl.sum(p_set)
        tl.store(out_ptr + h * D + dims, (acc / total).to(out_ptr.dtype.element_ty))

    return select_attend


def prhs_step_triton(q, qr, keys, values, ref_q, ref_set, ref_block, retrievals, *, block: int, window: int,
                     sink: int, local: int, top_k: int, radius: int, tau: float, cis: bool, scaling: float,
                     block_n: int = 128, warps: int = 8) -> torch.Tensor:
    """The fused kernels on CUDA: same contract as `prhs_step_reference`."""
    import triton

    score_middle, select_attend = _score_middle(), _select_attend()
    H, D = q.shape
    N = keys.shape[1]
    lo, hi = max(sink, window), N - local
    if hi - lo < top_k:
        raise ValueError(f"the middle holds {hi - lo} keys, fewer than top_k {top_k}")
    if keys.stride(2) != 1 or values.stride(2) != 1 or D != triton.next_power_of_2(D):
        raise ValueError("the fused PrHS step needs row-contiguous keys/values and a power-of-two head size")
    q, qr = q.contiguous(), qr.contiguous()
    group = H // keys.shape[0]
    mid_pad = triton.next_power_of_2(hi - lo)
    scores = torch.empty((H, lo + mid_pad), dtype=torch.float32, device=q.device)
    owner = torch.empty((H, N), dtype=torch.int32, device=q.device)
    out = torch.empty((H, D), dtype=q.dtype, device=q.device)
    score_middle[(keys.shape[0], triton.cdiv(hi - lo, block_n))](
        q, qr, keys, ref_q, ref_block, scores, keys.stride(0), keys.stride(1), scores.stride(0), lo, hi, block,
        tau, GROUP=group, D=D, BLOCK_N=block_n, num_warps=4)
    set_size = ref_set.shape[1]
    select_attend[(H,)](
        q, qr, keys, values, ref_q, ref_set, ref_block, scores, owner, out, retrievals, keys.stride(0),
        keys.stride(1), values.stride(0), values.stride(1), scores.stride(0), owner.stride(0), N, lo, hi, window,
        block, tau, scaling, GROUP=group, D=D, SINK=sink, SINK_PAD=max(16, triton.next_power_of_2(sink)),
        LOCAL=local, LOCAL_PAD=max(16, triton.next_power_of_2(local)), TOP_K=top_k, M_BEST=top_k // 3,
        RADIUS=radius, SET=set_size, SET_PAD=max(16, triton.next_power_of_2(set_size)), MID_PAD=mid_pad,
        TOP_PAD=max(16, triton.next_power_of_2(top_k)), CIS=cis,
        num_warps=warps)
    return out
