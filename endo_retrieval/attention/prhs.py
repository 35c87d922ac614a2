"""`prhs`: per-step Top-K token-sparse attention with the pre-hoc selectors of CPE (PrHS section IV).

Decoding (section IV-A a): every head attends to C_sink sink tokens, C_local local tokens and the k keys of the
middle [C_sink, t - C_local) with the largest scores (the top-k oracle). Three pre-hoc additions:
- CIS (IV-A): decode steps are cut into blocks of s; in a block, a head whose query is cosine-similar [PrHS Eq. 12] to
  the head's last retrieving query (> tau) reuses that query's set, dilated by +-r around its m = floor(k/3)
  best indices [PrHS Eq. 13], instead of retrieving. The retrieval ratio rho-hat (section V-A) counts how often heads
  still retrieve.
- PSAW (IV-B): from layer l_s on, keys in [C_sink, P_l(t)) are masked, in prefill and decoding [PrHS Eq. 15].
- ETF (IV-C): in prefill, from layer l_s on, tokens in [C_sink, E_l(t)) skip attention [PrHS Eq. 16].
Prefill is otherwise dense; keys are cached rotated at their absolute positions, as in `dense`. A decode step is
`endo_retrieval/kernels/prhs_step.py`: two fused Triton launches on CUDA (gate, scores, top-k, dilation,
gathered attention; the CIS state and the retrieval count stay on the device), its torch twin elsewhere. While the
middle holds fewer than k keys it is read whole (it is its own top-k) and nothing is counted as a retrieval.

Interface limits (documented, not hidden): the backend sees one layer's attention only, so an ETF-frozen token
gets a zero attention update (its residual stream passes through attention) but still runs the layer's MLP, and
t in [PrHS Eq. 16] is the end of the current prefill chunk (the paper's prompt length when prefill is one chunk). A call
with one new token counts as a decode step, including a one-token last prefill chunk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from endo_retrieval.attention.base import AttentionBackend, AttentionError
from endo_retrieval.model.backbone import Backbone
from endo_retrieval.kernels.prhs_step import prhs_step


@dataclass
class PrHS(AttentionBackend):
    top_k: int = 88  # k salient middle tokens per head; with sink 8 and local 32 the budget C_t is 128 (V-B)
    sink: int = 8
    local: int = 32
    cis: bool = True
    block_size: int = 8  # s
    tau: float = 0.8  # cosine gate; > 1 never shares
    radius: int = 1  # r
    psaw: bool = True
    phi: float = 0.7
    alpha: float = 1.0
    etf: bool = True
    psi: float = 0.5
    gamma: float = 1.0
    start_layer: int | None = None  # l_s; None: floor(3N/4) (section V-A)
    use_kernel: bool = True  # the fused Triton decode step on CUDA

    name = "prhs"
    windows_hold = False
    windows_fail = ("PrHS's pre-hoc selectors assume every layer reads the whole cache: PSAW's window and ETF's "
                    "frozen prefix grow with depth over all layers from l_s on [PrHS Eq. 15-16], which sliding layers "
                    "between full ones break, and a sliding layer's Top-K would pick keys the model never sees")

    def setup(self, backbone: Backbone) -> None:
        super().setup(backbone)
        if self.top_k < 1 or self.sink < 0 or self.local < 1 or self.block_size < 1 or self.radius < 0:
            raise AttentionError(f"PrHS needs top_k >= 1, sink >= 0, local >= 1, block_size >= 1 and radius >= 0 "
                                 f"(got k {self.top_k}, sink {self.sink}, local {self.local}, s {self.block_size}, "
                                 f"r {self.radius})")
        if not (0 < self.phi < 1 and 0 < self.psi < 1 and self.alpha >= 0 and self.gamma > 0):
            raise AttentionError(f"PSAW/ETF need 0 < phi, psi < 1, alpha >= 0 and gamma > 0 (got phi {self.phi}, "
                                 f"psi {self.psi}, alpha {self.alpha}, gamma {self.gamma})")
        n = backbone.n_layers
        self.l_s = self.start_layer if self.start_layer is not None else (3 * n) // 4
        if not 0 <= self.l_s < n:
            raise AttentionError(f"start_layer {self.l_s} is outside the model's layers 0..{n - 1}")
        self._step = [0] * n  # decode steps seen per layer
        self._cis: list[tuple | None] = [None] * n  # per layer: ref_q, ref_set, ref_block (see `_cis_state`)
        self._retrieved: torch.Tensor | None = None  # heads that retrieved, counted on the device (no host sync)

    @property
    def scope(self) -> int:
        """Keys one decode query reads: sink + local + k, plus the dilation of a shared set [PrHS Eq. 13]."""
        return self.sink + self.local + self.top_k + (self.top_k // 3) * 2 * self.radius * self.cis

    @property
    def stats(self) -> dict:
        """rho-hat = mean over decode steps and layers of R_t / H (section V-A; R_t / (H N) summed over layers)."""
        slots = sum(self._step) * self.backbone.n_heads  # (step, layer) pairs decoded, times heads
        retrievals = int(self._retrieved) if self._retrieved is not None else 0
        return {"decode_steps": max(self._step), "retrievals": retrievals,
                "rho_hat": retrievals / slots if slots else None}

    def _fraction(self, layer: int, base: float, power: float) -> float:
        """1 - base^(power (l - l_s) / (N - l_s)) for l >= l_s, else 0: the shared shape of [PrHS Eq. 15-16]."""
        if layer < self.l_s:
            return 0.0
        return 1.0 - base ** (power * (layer - self.l_s) / (self.backbone.n_layers - self.l_s))

    def window_start(self, layer: int, t: torch.Tensor) -> torch.Tensor:
        """P_l(t) of [PrHS Eq. 15] for step(s) t (number of tokens up to and including the query)."""
        return torch.floor(self._fraction(layer, self.phi, self.alpha) * t.double()).long()

    def frozen_end(self, layer: int, t: int) -> int:
        """E_l(t) of [PrHS Eq. 16]."""
        return math.floor(self._fraction(layer, self.psi, self.gamma) * t)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        start = self.cache.length(layer)
        stop = start + q.shape[1]
        keys, values = self.cache.append(layer, self.rope(k, start, stop, layer), v)
        qr = self.rope(q, start, stop, layer)
        if q.shape[1] == 1:
            return self._decode(layer, q, qr, keys, values, scaling)
        positions = torch.arange(start, stop, device=q.device)
        key_pos = torch.arange(stop, device=q.device)
        visible = key_pos[None, :] <= positions[:, None]  # causal (T, N)
        if self.psaw:  # [PrHS Eq. 15]: sinks plus [P_l(t), t]
            window = self.window_start(layer, positions + 1)[:, None]
            visible &= (key_pos[None, :] < self.sink) | (key_pos[None, :] >= window)
        out = _masked_attention(qr, keys, values, visible.expand(q.shape[0], -1, -1), scaling)
        if self.etf:  # [PrHS Eq. 16]: frozen tokens skip attention
            out[:, (positions >= self.sink) & (positions < self.frozen_end(layer, stop))] = 0
        return out

    def _decode(self, layer: int, q: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                scaling: float) -> torch.Tensor:
        """One decode step: `prhs_step` (fused on CUDA) once the middle holds at least k keys."""
        N = keys.shape[1]
        step = self._step[layer]
        self._step[layer] += 1
        # P_l(t) [PrHS Eq. 15]
        window = math.floor(self._fraction(layer, self.phi, self.alpha) * N) if self.psaw else 0
        if N - self.local - max(self.sink, window) < self.top_k:  # the middle is its own top-k: read it whole
            pos = torch.arange(N, device=q.device)
            visible = (pos < self.sink) | (pos >= window)
            return _masked_attention(qr, keys, values, visible.expand(q.shape[0], 1, N), scaling)
        out = self._sparse_step(q[:, 0], qr[:, 0], keys, values, self._cis_state(layer, q), scaling,
                                block=step // self.block_size, window=window, sink=self.sink, local=self.local,
                                top_k=self.top_k, radius=self.radius, tau=self.tau, cis=self.cis)
        return out[:, None]

    def _sparse_step(self, q, qr, keys, values, state, scaling, **selection) -> torch.Tensor:
        return prhs_step(q, qr, keys, values, *state, self._retrieved, use_kernel=self.use_kernel, scaling=scaling,
                         **selection)

    def _cis_state(self, layer: int, q: torch.Tensor) -> tuple:
        """This layer's CIS reference (ref_q, ref_set, ref_block = -1: nothing to share yet), made at first use."""
        if self._cis[layer] is None:
            H, d = q.shape[0], q.shape[2]
            size = self.top_k + (self.top_k // 3) * (2 * self.radius + 1)
            self._cis[layer] = (q.new_zeros(H, d), torch.zeros(H, size, dtype=torch.long, device=q.device),
                                torch.full((H,), -1, dtype=torch.long, device=q.device))
        if self._retrieved is None:
            self._retrieved = torch.zeros((), dtype=torch.int32, device=q.device)
        return self._cis[layer]


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float
                      ) -> torch.Tensor:
    """Softmax attention of q (H, T, d) over k, v (H_kv, N, d) restricted to mask (H, T, N)."""
    return F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0).to(q.dtype), v.unsqueeze(0).to(q.dtype),
                                          attn_mask=mask.unsqueeze(0), scale=scaling, enable_gqa=True)[0]
