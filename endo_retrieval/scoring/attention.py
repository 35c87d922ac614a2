"""Query-to-context attention, the one place softmax(q K^T / sqrt(d)) over grouped-query heads is written.

`logits` is the primitive ([ILRe Eq. 4]'s q K^T / sqrt(d)); `attention_scores` and `ContextLogits` take its
softmax over a whole context a block at a time (ILRe's A^C [ILRe Eq. 5], also split over GPUs), and the retrieval
heads (methods/heads.py) take it over one segment at a time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


def logits(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q K^T / sqrt(d) [ILRe Eq. 4] in float32: queries (..., n_heads, Lq, d), keys (..., n_kv, L, d) ->
    (..., n_heads, Lq, L), leading axes batched (several layers at once). GQA: query head h reads kv head
    h // (n_heads / n_kv), one matmul per kv group (its heads' queries side by side). Keys move to the queries'
    device."""
    *batch, n_heads, n_q, d = queries.shape
    n_kv = keys.shape[-3]
    q = queries.float().reshape(*batch, n_kv, (n_heads // n_kv) * n_q, d) / math.sqrt(d)
    return (q @ keys.to(q.device, torch.float32).transpose(-1, -2)).reshape(*batch, n_heads, n_q, -1)


MIN_BLOCK = 8192  # keys per block of the softmax over the context, at least,
LOGITS_PER_BLOCK = 1 << 25  # and about this many logits per block (128 MiB in float32)


def attention_scores(keys: torch.Tensor, queries: torch.Tensor, key_positions: torch.Tensor,
                     query_positions: torch.Tensor, rope, block: int | None = None) -> np.ndarray:
    """A^C = max over heads h and query positions q of softmax_C(q K^T / sqrt(d)) [ILRe Eq. 4-5], shape (L,).

    keys (n_kv, L, d) and queries (n_heads, Lq, d) are pre-RoPE; `rope(x, positions)` rotates them [ILRe Eq. 1, 3]
    (rope=None: both are rotated already, and the positions are not used).
    GQA: query head h reads kv head h // (n_heads / n_kv). The softmax runs over the whole context in blocks of
    `block` keys, two passes (logsumexp, then probabilities), so memory is n_heads x Lq x block, not x L (None: as
    many keys as keep that near LOGITS_PER_BLOCK; at 1M tokens, 8192-key blocks spent more time launching than
    computing).
    """
    context = ContextLogits(keys, queries, key_positions, query_positions, rope, block)
    return context.probabilities(context.logsumexp())


@dataclass
class ContextLogits:
    """`logits` of [ILRe Eq. 4] over some of the context's keys, a block at a time. [ILRe Eq. 5]'s softmax runs over
    the whole context: keys held in parts (one per GPU) each give `logsumexp()`, the parts' values are combined with
    torch.logaddexp, and each part's `probabilities(lse)` is then exactly its slice of A^C."""

    keys: torch.Tensor
    queries: torch.Tensor
    key_positions: torch.Tensor
    query_positions: torch.Tensor
    rope: object
    block: int | None = None

    def __post_init__(self):
        if self.block is None:
            self.block = max(MIN_BLOCK, LOGITS_PER_BLOCK // (self.queries.shape[0] * self.queries.shape[1]))
        if self.rope is None:
            self.rope = lambda x, _positions: x
            self.key_positions = self.query_positions = torch.zeros(0)  # unused
        self.q = self.rope(self.queries.float(), self.query_positions.to(self.queries.device))

    def _blocks(self):
        device, length = self.q.device, self.keys.shape[1]
        for s in range(0, length, self.block):
            e = min(s + self.block, length)
            k = self.rope(self.keys[:, s:e].to(device, torch.float32), self.key_positions[s:e].to(device))
            yield s, e, logits(self.q, k)  # (n_heads, Lq, block)

    def logsumexp(self) -> torch.Tensor:
        lse = torch.full(self.q.shape[:2], -math.inf, device=self.q.device)
        for *_, block in self._blocks():
            lse = torch.logaddexp(lse, block.logsumexp(-1))
        return lse

    def probabilities(self, lse: torch.Tensor) -> np.ndarray:
        out = torch.empty(self.keys.shape[1])
        for s, e, block in self._blocks():
            out[s:e] = (block - lse.to(block.device)[..., None]).exp().amax(dim=(0, 1)).cpu()
        return out.numpy()
