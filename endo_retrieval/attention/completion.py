"""`completion`: selector + subtractive completion hybrid attention (RCA sections 4-5, appendices C-D).

Prefill is dense. At the first decode step of each layer the prefill of N tokens is split [RCA Eq. 2] into anchors
A = sinks [0, n_sink) + tail [N - n_tail, N) and the mid region M between them; generated tokens stay exact.
For each layer with phi maps, a fixed-size max-shifted summary (m, u~, T~) of M [RCA Eq. 34-36] is built once.
Each decode step and query head:
- E(q) = A + K(q) + generated tokens, K(q) = Top-K of M by q.k [RCA Eq. 3], attended exactly [RCA Eq. 4];
- the retrieved tokens' feature contributions are subtracted from the summary (one-way, [RCA Eq. 7-8 / 38-40]),
  leaving the remainder R(q) = M \\ K(q), whose mass and output come from phi [RCA Eq. 9, 41-43];
- exact and estimated numerator and denominator merge before one normalisation [RCA Eq. 10].
Without phi maps (or for layers they do not cover) the remainder is dropped: selection-only Top-K with subset
normalisation. Budgets are token-equivalent exact reads per step and KV head [RCA Eq. 13-16].
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from endo_retrieval.attention.base import AttentionBackend, AttentionError, causal_attention
from endo_retrieval.attention.phi import PhiMaps
from endo_retrieval.model.backbone import Backbone

EPS = 1e-6  # floor for the subtracted u~ (appendix C, numerical note)


@dataclass
class Completion(AttentionBackend):
    budget: int | float = 0.05  # n exact reads per step: tokens, or a fraction f of the prefill length [RCA Eq. 13]
    sink: int = 4
    tail: int = 16
    phi: PhiMaps | str | Path | None = None  # None: selection-only Top-K
    charge_phi_cache: bool = False  # True: pay the summary's one-time fetch every step ([RCA Eq. 15-16], L_gen = 1)
    length_tolerance: float | None = 2.0  # refuse maps distilled for a prefill length further than this factor

    name = "completion"
    windows_hold = False
    windows_fail = ("retrieval-completion splits every layer's prefill into anchors and a mid region it retrieves "
                    "from and completes [RCA Eq. 2-10], where a sliding layer sees only its last window: the "
                    "completed mass would be attention the model never pays")

    def setup(self, backbone: Backbone) -> None:
        super().setup(backbone)
        if self.sink < 0 or self.tail < 0:
            raise AttentionError(f"sink and tail must be >= 0 (got {self.sink}, {self.tail})")
        if isinstance(self.budget, float) and not 0 < self.budget <= 1:
            raise AttentionError(f"a fractional budget must lie in (0, 1], got {self.budget}")
        self.maps = PhiMaps.load(self.phi, backbone.model_id) if isinstance(self.phi, (str, Path)) else self.phi
        if self.maps is not None:
            self.maps.check(backbone)
        if isinstance(self.budget, int):
            self._top_k(self.budget)
        self.group = backbone.n_heads // backbone.n_kv_heads
        self._prefill: list[int | None] = [None] * backbone.n_layers
        self._summary: list[tuple | None] = [None] * backbone.n_layers
        self._share_sum, self._share_n = 0.0, 0

    @property
    def scope(self) -> int | None:
        """Exact reads per decode step when the budget is a token count (a fraction depends on the prefill)."""
        return self.budget if isinstance(self.budget, int) else None

    @property
    def stats(self) -> dict:
        """Mean completion mass share rho_Z = Z_R / (Z_E + Z_R) over completed (step, layer, head) [RCA Eq. 56]."""
        return {"completion_mass_share": self._share_sum / self._share_n if self._share_n else None}

    def _top_k(self, n: int) -> int:
        """K = n - n_sink - n_tail [RCA Eq. 14], less n_off = ceil(d_phi/2 + d_phi/d_h) when the phi cache is charged
        [RCA Eq. 16, 49]."""
        off = 0
        if self.charge_phi_cache and self.maps is not None:
            f, d = self.maps.card["d_phi"], self.backbone.head_dim
            off = math.ceil(f / 2 + f / d)
        if n < self.sink + self.tail + off:
            paid = f" + the phi cache's one-time fetch {off}" if off else ""
            raise AttentionError(f"budget {n} is smaller than the anchors: sink {self.sink} + tail {self.tail}{paid}"
                                 f" = {self.sink + self.tail + off} exact reads per step; raise the budget or "
                                 "shrink the anchors")
        return n - self.sink - self.tail - off

    def _begin_decoding(self, layer: int, n_prefill: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fix the mid region and build its stable summary [RCA Eq. 34-36]."""
        self._prefill[layer] = n_prefill
        slot = self.maps.index(layer) if self.maps is not None else None
        lo, hi = self.sink, max(n_prefill - self.tail, self.sink)
        if slot is None or hi == lo:
            return
        trained = self.maps.card.get("length")
        if self.length_tolerance and trained and not 1 / self.length_tolerance <= n_prefill / trained <= \
                self.length_tolerance:
            raise AttentionError(f"the phi maps were distilled at prefill length {trained} but this prefill has "
                                 f"{n_prefill} tokens; train maps at this length (`endo train-phi --length "
                                 f"{n_prefill}`) or pass length_tolerance=None")
        log_phi = self.maps.log_phi_k(slot, keys[:, lo:hi])  # (H_kv, |M|, d_phi)
        m = log_phi.amax(1)  # [RCA Eq. 34]
        w = torch.exp(log_phi - m[:, None])
        self._summary[layer] = (slot, m, w.sum(1), torch.einsum("hnf,hnd->hfd", w, values[:, lo:hi].float()))

    @torch.no_grad()  # the maps may be mid-training; attention never needs their gradient
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        start = self.cache.length(layer)
        stop = start + q.shape[1]
        keys, values = self.cache.append(layer, self.rope(k, start, stop, layer), v)
        qr = self.rope(q, start, stop, layer)
        if q.shape[1] > 1:  # prefill: exact
            return causal_attention(qr, keys, values, scaling)
        if self._prefill[layer] is None:
            self._begin_decoding(layer, start, keys, values)
        n_prefill, H, N = self._prefill[layer], q.shape[0], keys.shape[1]
        lo, hi = self.sink, max(n_prefill - self.tail, self.sink)  # M = [lo, hi) [RCA Eq. 2]
        n = self.budget if isinstance(self.budget, int) else math.ceil(self.budget * n_prefill)  # [RCA Eq. 13]
        kv = torch.arange(H, device=q.device) // self.group
        query = qr[:, 0].float()
        scores = torch.einsum("hd,hnd->hn", query, keys[kv].float()) * scaling
        picks = scores[:, lo:hi].topk(min(self._top_k(n), hi - lo), dim=-1).indices + lo  # K(q)
        anchors = torch.cat([torch.arange(min(lo, N), device=q.device), torch.arange(hi, N, device=q.device)])
        exact = torch.cat([anchors.expand(H, -1), picks], dim=1)  # E(q) [RCA Eq. 3]
        logits, vals = scores.gather(1, exact), values[kv[:, None], exact].float()  # [RCA Eq. 4]
        if self._summary[layer] is not None and picks.shape[1] < hi - lo:  # a remainder R(q) exists
            log_z, y_r = self._remainder(layer, query, keys[kv[:, None], picks], values[kv[:, None], picks], kv)
            logits, vals = torch.cat([logits, log_z[:, None]], 1), torch.cat([vals, y_r[:, None]], 1)
        weights = torch.softmax(logits, dim=-1)  # [RCA Eq. 10]: one normalisation over exact + completion terms
        if vals.shape[1] > exact.shape[1]:
            self._share_sum += float(weights[:, -1].sum())
            self._share_n += H
        return torch.einsum("hn,hnd->hd", weights, vals)[:, None].to(q.dtype)

    def _remainder(self, layer: int, query: torch.Tensor, k_picked: torch.Tensor, v_picked: torch.Tensor,
                   kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """log Z_R and the normalised completion output y_R per query head [RCA Eq. 38-43]."""
        slot, m, u, t = self._summary[layer]
        m, u, t = m[kv], u[kv], t[kv]
        w = torch.exp(self.maps.log_phi_k(slot, k_picked, heads=kv) - m[:, None])  # [RCA Eq. 38-39]
        u_r = (u - w.sum(1)).clamp_min(EPS)  # [RCA Eq. 40] (= [RCA Eq. 8] in the stable space)
        t_r = t - torch.einsum("hkf,hkd->hfd", w, v_picked.float())  # [RCA Eq. 40] (= [RCA Eq. 7])
        a = self.maps.log_phi_q(slot, query) + m + u_r.log()  # [RCA Eq. 41]
        y_r = torch.einsum("hf,hfd->hd", torch.softmax(a, -1), t_r / u_r[..., None])  # [RCA Eq. 43]
        return torch.logsumexp(a, -1), y_r  # [RCA Eq. 42]
