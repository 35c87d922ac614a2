"""`prhs`: per-step Top-K token-sparse attention with the pre-hoc selectors of CPE (seed 003, section IV).

Decoding (section IV-A a): every head attends to C_sink sink tokens, C_local local tokens and the k keys of the
middle [C_sink, t - C_local) with the largest scores (the top-k oracle). Three pre-hoc additions:
- CIS (IV-A): decode steps are cut into blocks of s; in a block, a head whose query is cosine-similar (Eq. 12) to
  the head's last retrieving query (> tau) reuses that query's set, dilated by +-r around its m = floor(k/3)
  best indices (Eq. 13), instead of retrieving. The retrieval ratio rho-hat (section V-A) counts how often heads
  still retrieve.
- PSAW (IV-B): from layer l_s on, keys in [C_sink, P_l(t)) are masked, in prefill and decoding (Eq. 15).
- ETF (IV-C): in prefill, from layer l_s on, tokens in [C_sink, E_l(t)) skip attention (Eq. 16).
Prefill is otherwise dense; keys are cached rotated at their absolute positions, as in `dense`.

Interface limits (documented, not hidden): the backend sees one layer's attention only, so an ETF-frozen token
gets a zero attention update (its residual stream passes through attention) but still runs the layer's MLP, and
t in Eq. 16 is the end of the current prefill chunk (the paper's prompt length when prefill is one chunk). A call
with one new token counts as a decode step, including a one-token last prefill chunk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from endo_retrieval.attention.base import AttentionBackend, AttentionError
from endo_retrieval.backbone import Backbone


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

    name = "prhs"

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
        self.group = backbone.n_heads // backbone.n_kv_heads
        self._step = [0] * n  # decode steps seen per layer
        self._ref_q: list[torch.Tensor | None] = [None] * n  # (H, d) pre-RoPE query of each head's last retrieval
        self._ref_set: list[torch.Tensor | None] = [None] * n  # (H, k + m(2r+1)) its dilated set (Eq. 13)
        self._ref_block: list[torch.Tensor | None] = [None] * n  # (H,) the CIS block of that retrieval
        self._retrievals, self._steps = 0, 0

    @property
    def scope(self) -> int:
        """Keys one decode query reads: sink + local + k, plus the dilation of a shared set (Eq. 13)."""
        return self.sink + self.local + self.top_k + (self.top_k // 3) * 2 * self.radius * self.cis

    @property
    def stats(self) -> dict:
        """rho-hat = mean over decode steps of R_t / (H * N) (section V-A)."""
        slots = self._steps * self.backbone.n_heads * self.backbone.n_layers
        return {"decode_steps": self._steps, "retrievals": self._retrievals,
                "rho_hat": self._retrievals / slots if slots else None}

    def _fraction(self, layer: int, base: float, power: float) -> float:
        """1 - base^(power (l - l_s) / (N - l_s)) for l >= l_s, else 0: the shared shape of Eq. 15 and 16."""
        if layer < self.l_s:
            return 0.0
        return 1.0 - base ** (power * (layer - self.l_s) / (self.backbone.n_layers - self.l_s))

    def window_start(self, layer: int, t: torch.Tensor) -> torch.Tensor:
        """P_l(t) of Eq. 15 for step(s) t (number of tokens up to and including the query)."""
        return torch.floor(self._fraction(layer, self.phi, self.alpha) * t.double()).long()

    def frozen_end(self, layer: int, t: int) -> int:
        """E_l(t) of Eq. 16."""
        return math.floor(self._fraction(layer, self.psi, self.gamma) * t)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        start = self.cache.length(layer)
        stop = start + q.shape[1]
        keys, values = self.cache.append(layer, self.rope(k, start, stop), v)
        positions = torch.arange(start, stop, device=q.device)
        key_pos = torch.arange(stop, device=q.device)
        visible = key_pos[None, :] <= positions[:, None]  # causal (T, N)
        if self.psaw:  # Eq. 15: sinks plus [P_l(t), t]
            window = self.window_start(layer, positions + 1)[:, None]
            visible &= (key_pos[None, :] < self.sink) | (key_pos[None, :] >= window)
        qr = self.rope(q, start, stop)
        if q.shape[1] > 1:  # prefill
            out = _masked_attention(qr, keys, values, visible.expand(q.shape[0], -1, -1), scaling)
            if self.etf:  # Eq. 16: frozen tokens skip attention
                out[:, (positions >= self.sink) & (positions < self.frozen_end(layer, stop))] = 0
            return out
        critical = self._critical_set(layer, q[:, 0], qr[:, 0], keys, visible[0])
        return _masked_attention(qr, keys, values, (critical & visible[0])[:, None, :], scaling)

    def _critical_set(self, layer: int, q: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor,
                      visible: torch.Tensor) -> torch.Tensor:
        """Boolean (H, N): sinks, local tokens and each head's middle set, retrieved or shared by CIS."""
        H, N = q.shape[0], keys.shape[1]
        key_pos = torch.arange(N, device=q.device)
        critical = ((key_pos < self.sink) | (key_pos >= N - self.local)).expand(H, N).clone()
        step = self._step[layer]
        self._step[layer] += 1
        if layer == 0:
            self._steps += 1
        block = step // self.block_size
        ref_q, ref_set, ref_block = self._ref_q[layer], self._ref_set[layer], self._ref_block[layer]
        share = torch.zeros(H, dtype=torch.bool, device=q.device)
        if self.cis and ref_q is not None:  # sharing stays inside a block, so its first query retrieves
            similar = F.cosine_similarity(q.float(), ref_q.float(), dim=-1) > self.tau  # Eq. 12
            share = (ref_block == block) & similar
        if bool(share.any()):
            critical[share] = critical[share].scatter(1, ref_set[share].clamp(0, N - 1), True)
        need = ~share
        self._retrievals += int(need.sum())
        middle = visible & (key_pos >= self.sink) & (key_pos < N - self.local)
        n_mid = int(middle.sum())
        if n_mid == 0:
            return critical
        heads = need.nonzero().squeeze(1)
        scores = torch.einsum("hd,hnd->hn", qr[heads].float(), keys[heads // self.group].float())
        picks = scores.masked_fill(~middle, float("-inf")).topk(min(self.top_k, n_mid), dim=-1).indices  # S*_t
        critical[heads] = critical[heads].scatter(1, picks, True)
        if self.cis:
            m = self.top_k // 3  # dilate the m best of S*_t by +-r (Eq. 13)
            offsets = torch.arange(-self.radius, self.radius + 1, device=q.device)
            dilated = torch.cat([picks, (picks[:, :m, None] + offsets).flatten(1)], dim=1)
            if ref_set is None or ref_set.shape[1] != dilated.shape[1]:  # k fills up while the middle is short
                self._ref_q[layer], self._ref_set[layer] = q.clone(), dilated.new_zeros(H, dilated.shape[1])
                self._ref_block[layer] = torch.full((H,), -1, dtype=torch.long, device=q.device)
            self._ref_q[layer][heads] = q[heads]
            self._ref_set[layer][heads] = dilated
            self._ref_block[layer][heads] = block
        return critical


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float
                      ) -> torch.Tensor:
    """Softmax attention of q (H, T, d) over k, v (H_kv, N, d) restricted to mask (H, T, N)."""
    return F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0).to(q.dtype), v.unsqueeze(0).to(q.dtype),
                                          attn_mask=mask.unsqueeze(0), scale=scaling, enable_gqa=True)[0]
