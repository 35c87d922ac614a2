"""`reattention`: position-agnostic top-k KV selection over an un-rotated cache, RoPE applied after selection.

ReAttention: the cache keeps keys *without* rotation. At every step and layer the cache is split into
[global | middle | local] [ReAttention Eq. 1]; the new queries score the middle with q . K^T
([ReAttention Eq. 2], no positions), each head and query keeps its top-k, the picks are voted to the top-k' and
widened to spans of `span` neighbours; the selected cache [global, selected, local] is rotated at positions 0..n-1
in order and attended as usual [ReAttention Eq. 3].
Prefill runs in chunks [ReAttention Alg. 1], decoding one token at a time [ReAttention Alg. 2]. Because
global + k' x span + local never exceeds the trained window, no query-key distance is ever out of distribution.
Defaults are section 3.1's (global 32, local 4096, span 32, k 4, k' 127, chunk 512) with local scaled to half the
model's window and k' to fill the rest.
Where layers attend through windows of their own (Gemma 3's sliding layers), those layers are attended exactly within
their windows, which never exceed the trained window either (`AttentionBackend.attend_window`); the selection runs
in the layers that attend to the whole past, the ones the paper's extrapolation is about.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from endo_retrieval.attention.base import AttentionBackend, AttentionError, causal_attention
from endo_retrieval.model.backbone import Backbone
from endo_retrieval.kernels.topk_attention import topk_scores


@dataclass
class ReAttention(AttentionBackend):
    global_size: int = 32
    local_size: int | None = None  # None: half the model's trained window (4096 at 8k, section 4.1)
    span: int = 32
    top_k: int = 4
    top_k_prime: int | None = None  # None: as many spans as fit, (window - global - local) // span (127 at 8k)
    window: int | None = None  # None: the model's max_position_embeddings
    use_kernel: bool = True  # the fused Triton scores + top-k on CUDA

    name = "reattention"

    def setup(self, backbone: Backbone) -> None:
        super().setup(backbone)
        window = self.window or backbone.max_position
        if not window:
            raise AttentionError("the model does not state its trained window; pass window=N")
        local = self.local_size if self.local_size is not None else window // 2
        kp = self.top_k_prime if self.top_k_prime is not None else (window - self.global_size - local) // self.span
        if min(self.global_size, self.span, self.top_k) < 1 or local < 1 or kp < 1:
            raise AttentionError(f"global_size, local_size, span, top_k and k' must be >= 1 (got global "
                                 f"{self.global_size}, local {local}, span {self.span}, k {self.top_k}, k' {kp})")
        scope = self.global_size + kp * self.span + local
        if scope > window:
            raise AttentionError(
                f"the attended scope global {self.global_size} + k' {kp} x span {self.span} + local {local} = "
                f"{scope} exceeds the trained window {window}; use k' <= "
                f"{(window - self.global_size - local) // self.span} or a smaller span/local")
        if self.chunk_size > local:
            raise AttentionError(f"chunk_size {self.chunk_size} > local {local}: a prefill chunk must lie inside "
                                 "the local part (section 4.1)")
        self.local, self.k_prime = local, kp

    @property
    def scope(self) -> int:
        return self.global_size + self.k_prime * self.span + self.local

    def select(self, q: torch.Tensor, middle: torch.Tensor) -> torch.Tensor:
        """Sorted indices into `middle` (H_kv, M, d) that the queries (H, T, d) pick: [ReAttention Eq. 2] top-k per
        head and query, voted to the top-k', each widened to a span of neighbours (overlaps merged)."""
        M = middle.shape[1]
        _, picks = topk_scores(q, middle, self.top_k, use_kernel=self.use_kernel)
        votes = torch.bincount(picks.flatten(), minlength=M)
        n_voted = int((votes > 0).sum())
        winners = torch.sort(votes, descending=True, stable=True).indices[:min(self.k_prime, n_voted)]
        starts = (winners - self.span // 2).clamp(0, max(M - self.span, 0))
        keep = torch.zeros(M, dtype=torch.bool, device=middle.device)
        keep[(starts[:, None] + torch.arange(self.span, device=middle.device)).clamp(max=M - 1).flatten()] = True
        return keep.nonzero().squeeze(1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        keys, values = self.cache.append(layer, k, v)
        N, g = keys.shape[1], self.global_size
        if N > g + self.local:  # [ReAttention Eq. 1-2]: a middle exists; keep [global, selected, local]
            chosen = g + self.select(q, keys[:, g:N - self.local])
            index = torch.cat([torch.arange(g, device=keys.device), chosen,
                               torch.arange(N - self.local, N, device=keys.device)])
            keys, values = keys[:, index], values[:, index]
        n, T = keys.shape[1], q.shape[1]
        # [ReAttention Eq. 3]: positions 0..n-1 in order, the new queries last
        return causal_attention(self.rope(q, n - T, n, layer), self.rope(keys, 0, n, layer), values, scaling)
