"""PrHS/CPE: with CIS gated shut and no PSAW/ETF it is per-step Top-K; CIS sharing, dilation [PrHS Eq. 13],
the retrieval ratio, PSAW [PrHS Eq. 15] and ETF [PrHS Eq. 16] against hand-computed values."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from endo_retrieval.attention import AttentionError, Dense
from endo_retrieval.attention.prhs import PrHS
from endo_retrieval.kernels.prhs_step import prhs_step_reference

NEEDLE = ("The tram line follows the canal past the brewery and the old customs house. " * 12
          + "\n\nThe harbour master's name is Ilsabet Quorn. " + "Fog rolled over the quay every morning. " * 10
          + "\n\nWhat is the harbour master's name?")
PLAIN = dict(top_k=5, sink=2, local=4, tau=1.1, psaw=False, etf=False)  # tau > 1: the CIS gate never opens


@dataclass
class PerStepTopK(Dense):
    """Naive reference: dense prefill; at each decode step every head attends to the sinks, the local tokens and
    the top_k highest-scoring keys between them (a loop over heads, float64)."""

    top_k: int = 5
    sink: int = 2
    local: int = 4

    def attend(self, layer, q, k, v, scaling):
        if q.shape[1] > 1:
            return super().attend(layer, q, k, v, scaling)
        start = self.cache.length(layer)
        keys, values = self.cache.append(layer, self.rope(k, start, start + 1), v)
        qr, N, group = self.rope(q, start, start + 1)[:, 0].double(), keys.shape[1], q.shape[0] // k.shape[0]
        out = torch.empty_like(q)
        for h in range(q.shape[0]):
            scores = keys[h // group].double() @ qr[h] * scaling
            chosen = set(range(min(self.sink, N))) | set(range(max(N - self.local, 0), N))
            middle = scores[self.sink:N - self.local]
            if len(middle):
                chosen |= {self.sink + int(i) for i in middle.topk(min(self.top_k, len(middle))).indices}
            idx = torch.tensor(sorted(chosen))
            out[h, 0] = (torch.softmax(scores[idx], 0) @ values[h // group][idx].double()).to(q.dtype)
        return out


def drive(backend, bb, prefill: int, steps: int, layers=(0,), seed: int = 0) -> list[torch.Tensor]:
    """Feed random pre-RoPE states: one prefill chunk, then `steps` one-token steps; outputs of every call."""
    backend.setup(bb)
    g = torch.Generator().manual_seed(seed)
    H, Hkv, d = bb.n_heads, bb.n_kv_heads, bb.head_dim
    outs = []
    for T in [prefill] + [1] * steps:
        for layer in layers:
            q, k, v = (torch.randn(n, T, d, generator=g) for n in (H, Hkv, Hkv))
            outs.append(backend.attend(layer, q * 2, k * 2, v, d ** -0.5))
    return outs


def test_gated_shut_prhs_is_per_step_top_k_on_random_states(tiny_backbone):
    got = drive(PrHS(**PLAIN), tiny_backbone, 40, 30, layers=(0, 3))
    want = drive(PerStepTopK(top_k=5, sink=2, local=4), tiny_backbone, 40, 30, layers=(0, 3))
    dense = drive(Dense(), tiny_backbone, 40, 30, layers=(0, 3))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(got[-1], dense[-1], atol=1e-3)  # the selection does drop keys


def test_gated_shut_prhs_generates_the_per_step_top_k_tokens(tiny_backbone):
    ids = tiny_backbone.chat_ids("A prompt for a tiny random model, long enough for a middle region to exist.")[0]
    plain = PrHS(**PLAIN, chunk_size=16)
    got = list(plain.generate_ids(tiny_backbone, ids, 12))
    assert got == list(PerStepTopK(chunk_size=16).generate_ids(tiny_backbone, ids, 12))
    assert plain.stats["rho_hat"] == 1.0  # every head retrieves at every step


def test_retrieval_ratio_counts_one_retrieval_per_block_when_the_gate_is_open(tiny_backbone):
    always = PrHS(**{**PLAIN, "tau": -2.0}, block_size=4)
    drive(always, tiny_backbone, 20, 10, layers=range(tiny_backbone.n_layers))
    assert always.stats == {"decode_steps": 10, "retrievals": 3 * 4 * 4, "rho_hat": 0.3}  # ceil(10/4) per head


def test_cis_shares_the_dilated_set_of_the_reference_query(tiny_backbone):
    H, Hkv, d, N = tiny_backbone.n_heads, tiny_backbone.n_kv_heads, tiny_backbone.head_dim, 30
    keys = torch.zeros(Hkv, N + 1, d)
    keys[:, [10, 20, 15], 0] = torch.tensor([5.0, 4.0, 3.0])  # scores along q = e0: 10 > 20 > 15 > the rest
    values = torch.randn(Hkv, N + 1, d, generator=torch.Generator().manual_seed(0))
    q = torch.zeros(H, d)
    q[:, 0] = 1
    size = 3 + 1 * 3  # k + m (2r + 1) with m = floor(3/3) = 1, r = 1
    state = (torch.zeros(H, d), torch.zeros(H, size, dtype=torch.long), torch.full((H,), -1, dtype=torch.long))
    retrievals = torch.zeros((), dtype=torch.int32)
    settings = dict(block=0, window=0, sink=2, local=4, top_k=3, radius=1, tau=-2.0, cis=True, scaling=1.0)

    def by_hand(query, n, seen):  # softmax attention of every head over the listed keys
        seen = torch.tensor(seen)
        return torch.stack([torch.softmax(keys[h // (H // Hkv), seen] @ query[h], 0) @ values[h // (H // Hkv), seen]
                            for h in range(H)])

    first = prhs_step_reference(q, q, keys[:, :N], values[:, :N], *state, retrievals, **settings)
    assert torch.allclose(first, by_hand(q, N, [0, 1, 10, 15, 20, 26, 27, 28, 29]), atol=1e-6)  # S*_t undilated
    assert state[1][0].tolist() == [10, 20, 15, 9, 10, 11] and state[2].tolist() == [0] * H  # [PrHS Eq. 13] reference
    shared = prhs_step_reference(-q, -q, keys, values, *state, retrievals, **settings)  # gate open: no retrieval
    # the reference's set: the best index, 10, widened to 9..11, with 20 and 15; the local window moved by one
    assert torch.allclose(shared, by_hand(-q, N + 1, [0, 1, 9, 10, 11, 15, 20, 27, 28, 29, 30]), atol=1e-6)
    assert int(retrievals) == H


def test_psaw_window_and_etf_freezing_follow_eq_15_and_16(tiny_backbone):
    backend = PrHS(sink=2, start_layer=1, cis=False)
    out = drive(backend, tiny_backbone, 100, 0, layers=(3,), seed=1)[0]
    frac_p, frac_e = 1 - 0.7 ** (2 / 3), 1 - 0.5 ** (2 / 3)  # layer 3 of 4 from l_s = 1: exponent 2/3
    assert backend.window_start(3, torch.tensor([100])).item() == math.floor(frac_p * 100) == 21
    assert backend.frozen_end(3, 100) == math.floor(frac_e * 100) == 37
    assert backend.frozen_end(0, 100) == 0
    frozen = out[:, 2:37]
    assert torch.all(frozen == 0) and torch.all(out[:, 37:].abs().sum(-1) > 0) and torch.all(out[:, :2] != 0)
    g = torch.Generator().manual_seed(1)  # the same states again, attended by hand for the last query
    H, Hkv, d = tiny_backbone.n_heads, tiny_backbone.n_kv_heads, tiny_backbone.head_dim
    q, k, v = (torch.randn(n, 100, d, generator=g) for n in (H, Hkv, Hkv))
    pos = torch.arange(100)
    qr, kr = tiny_backbone.apply_rope(q * 2, pos), tiny_backbone.apply_rope(k * 2, pos)
    seen = torch.tensor([0, 1] + list(range(21, 100)))  # sinks + [P_3(100), 99]
    group = H // Hkv
    for h in range(H):
        w = torch.softmax(kr[h // group, seen] @ qr[h, 99] * d ** -0.5, 0)
        assert torch.allclose(out[h, 99], w @ v[h // group, seen], atol=1e-5)


def test_bad_prhs_settings_are_refused(tiny_backbone):
    for bad, message in [(dict(top_k=0), "top_k >= 1"), (dict(phi=1.5), "0 < phi, psi < 1"),
                         (dict(start_layer=9), "start_layer 9 is outside")]:
        with pytest.raises(AttentionError, match=message):
            PrHS(**bad).setup(tiny_backbone)


@pytest.mark.slow
def test_prhs_defaults_on_the_default_model(backbone):
    ids = backbone.chat_ids(NEEDLE)[0]
    prhs = PrHS(chunk_size=128)  # the needle lies ~150 tokens before the local window: only Top-K reaches it
    text = backbone.tokenizer.decode(list(prhs.generate_ids(backbone, ids, 12)))
    assert "Ilsabet" in text
    assert 0 < prhs.stats["rho_hat"] < 1
