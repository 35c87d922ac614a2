"""Retrieval-completion attention (RCA): K = all mid tokens is dense attention, phi off is selection-only Top-K,
the stable-cache hybrid equals the natural (S, u) form of [RCA Eq. 6-10] computed naively, and bad input is refused."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest
import torch

from endo_retrieval.attention import AttentionError, Dense
from endo_retrieval.attention.completion import Completion
from endo_retrieval.attention.phi import PhiMaps, shipped_dir

ALL = 10 ** 9  # a budget above any mid region: K covers M


@dataclass
class SinkTailTopK(Dense):
    """Naive selection-only reference: dense prefill; each decode step every head attends to the sinks, the prefill
    tail, the generated tokens and its top_k mid keys, normalised over that subset (loop over heads, float64)."""

    top_k: int = 6
    sink: int = 4
    tail: int = 16

    def attend(self, layer, q, k, v, scaling):
        if q.shape[1] > 1:
            return super().attend(layer, q, k, v, scaling)
        start = self.cache.length(layer)
        self.__dict__.setdefault("n_prefill", {}).setdefault(layer, start)
        keys, values = self.cache.append(layer, self.rope(k, start, start + 1), v)
        qr, N, group = self.rope(q, start, start + 1)[:, 0].double(), keys.shape[1], q.shape[0] // k.shape[0]
        hi = max(self.n_prefill[layer] - self.tail, self.sink)
        out = torch.empty_like(q)
        for h in range(q.shape[0]):
            scores = keys[h // group].double() @ qr[h] * scaling
            mid = scores[self.sink:hi]
            chosen = list(range(min(self.sink, N))) + list(range(hi, N))
            chosen += [self.sink + int(i) for i in mid.topk(min(self.top_k, len(mid))).indices]
            out[h, 0] = (torch.softmax(scores[chosen], 0) @ values[h // group][chosen].double()).to(q.dtype)
        return out


def drive(backend, bb, prefill=60, steps=8, layers=(0, 2), seed=0, scale=2.0):
    """Random pre-RoPE states: one prefill chunk, then one-token steps; the outputs of every call."""
    backend.setup(bb)
    g = torch.Generator().manual_seed(seed)
    outs = []
    for T in [prefill] + [1] * steps:
        for layer in layers:
            q, k, v = (torch.randn(n, T, bb.head_dim, generator=g) for n in (bb.n_heads, bb.n_kv_heads, bb.n_kv_heads))
            outs.append(backend.attend(layer, q * scale, k * scale, v, bb.head_dim ** -0.5))
    return outs


def random_maps(bb, d_phi=32, length=None):
    return PhiMaps.for_backbone(bb, layers=range(bb.n_layers), d_phi=d_phi, length=length)


def test_k_covering_the_mid_region_is_dense_attention(tiny_backbone):
    for got, want in zip(drive(Completion(budget=ALL, phi=random_maps(tiny_backbone)), tiny_backbone),
                         drive(Dense(), tiny_backbone)):
        assert torch.allclose(got, want, atol=1e-5)
    ids = tiny_backbone.chat_ids("A prompt for a tiny random model, long enough for a mid region to exist.")[0]
    hybrid = Completion(budget=ALL, phi=random_maps(tiny_backbone), chunk_size=16)
    assert list(hybrid.generate_ids(tiny_backbone, ids, 10)) == list(Dense().generate_ids(tiny_backbone, ids, 10))


def test_phi_off_is_selection_only_top_k(tiny_backbone):
    got = drive(Completion(budget=26, phi=None), tiny_backbone)  # K = 26 - 4 - 16 = 6
    want = drive(SinkTailTopK(top_k=6), tiny_backbone)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(got[-1], drive(Dense(), tiny_backbone)[-1], atol=1e-3)  # keys were dropped
    ids = tiny_backbone.chat_ids("A prompt for a tiny random model, long enough for a mid region to exist.")[0]
    selection = Completion(budget=26, chunk_size=16)
    assert list(selection.generate_ids(tiny_backbone, ids, 10)) == list(
        SinkTailTopK(top_k=6, chunk_size=16).generate_ids(tiny_backbone, ids, 10))


def test_stable_hybrid_equals_the_natural_form_of_eq_6_to_10(tiny_backbone):
    """[RCA Eq. 10] by hand in float64: (N_E + phi_q^T S_R) / (Z_E + phi_q^T u_R), S_R and u_R summed over R."""
    bb = tiny_backbone
    maps = random_maps(bb, d_phi=16)
    out = drive(Completion(budget=24, phi=maps), bb, prefill=50, steps=1, layers=(1,), scale=1.0)[-1]
    g = torch.Generator().manual_seed(0)
    H, Hkv, d = bb.n_heads, bb.n_kv_heads, bb.head_dim
    q0, k0, v0 = (torch.randn(n, 50, d, generator=g) for n in (H, Hkv, Hkv))
    q1, k1, v1 = (torch.randn(n, 1, d, generator=g) for n in (H, Hkv, Hkv))
    keys = bb.apply_rope(torch.cat([k0, k1], 1), torch.arange(51)).double()
    values, q = torch.cat([v0, v1], 1).double(), bb.apply_rope(q1, torch.tensor([50]))[:, 0]
    with torch.no_grad():
        phi_q = maps.log_phi_q(1, q).double().exp()
        phi_k = maps.log_phi_k(1, keys.float()).double().exp()  # (H_kv, 51, d_phi)
    mid = torch.arange(4, 50 - 16)
    for h in range(H):
        kvh = h // (H // Hkv)
        s = keys[kvh] @ q[h].double() * d ** -0.5
        picked = mid[s[mid].topk(4).indices]  # K = 24 - 20
        exact = torch.cat([torch.arange(4), torch.arange(34, 51), picked])
        rest = torch.tensor([i for i in mid.tolist() if i not in picked.tolist()])
        z_r = phi_q[h] @ phi_k[kvh, rest].sum(0)  # [RCA Eq. 9] over R
        n_r = phi_q[h] @ (phi_k[kvh, rest, :, None] * values[kvh, rest, None, :]).sum(0)
        y = ((s[exact].exp() @ values[kvh, exact]) + n_r) / (s[exact].exp().sum() + z_r)  # [RCA Eq. 10]
        assert torch.allclose(out[h, 0].double(), y, rtol=1e-4, atol=1e-5)


def test_random_feature_completion_beats_subset_normalisation_on_diffuse_heads(tiny_backbone):
    """Performer features are unbiased for exp(s): with many of them, completing a diffuse remainder cuts the
    relative l1 error (appendix H.3) of selection-only Top-K."""
    kw = dict(prefill=300, steps=4, layers=(0,), scale=0.5)
    dense = drive(Dense(), tiny_backbone, **kw)[1:]
    errors = {}
    for name, phi in [("topk", None), ("hybrid", random_maps(tiny_backbone, d_phi=4096))]:
        outs = drive(Completion(budget=40, phi=phi), tiny_backbone, **kw)[1:]
        errors[name] = sum(float((o - r).abs().sum() / r.abs().sum()) for o, r in zip(outs, dense)) / len(dense)
    assert errors["hybrid"] < 0.5 * errors["topk"]


def test_bad_completion_input_is_refused(tiny_backbone, tmp_path):
    with pytest.raises(AttentionError, match=r"budget 12 is smaller than the anchors: sink 4 \+ tail 16 = 20"):
        Completion(budget=12).setup(tiny_backbone)
    maps = random_maps(tiny_backbone, d_phi=32)
    with pytest.raises(AttentionError, match=r"tail 16 \+ the phi cache's one-time fetch 18 = 38"):
        Completion(budget=30, phi=maps, charge_phi_cache=True).setup(tiny_backbone)  # ceil(32/2 + 32/16) = 18
    other = PhiMaps({**maps.card, "model_hash": "0" * 64})
    with pytest.raises(AttentionError, match="trained for another model: model_hash"):
        Completion(phi=other).setup(tiny_backbone)
    wide = PhiMaps({**maps.card, "head_dim": 32})
    with pytest.raises(AttentionError, match=r"head_dim 32 \(model has 16\)"):
        Completion(phi=wide).setup(tiny_backbone)
    with pytest.raises(AttentionError, match="holds no phi maps"):
        Completion(phi=tmp_path).setup(tiny_backbone)
    short = random_maps(tiny_backbone, length=20)
    with pytest.raises(AttentionError, match="distilled at prefill length 20 but this prefill has 60 tokens"):
        drive(Completion(budget=30, phi=short), tiny_backbone)


def test_train_phi_lowers_the_distillation_loss_and_round_trips(tiny_backbone, tmp_path):
    from endo_retrieval.calibration.train_phi import DistillLoss, log_traces, run, train_maps
    from endo_retrieval.cli.calibrate import train_phi_add_arguments as add_arguments

    text = ("Ships left the harbour at dawn while the gulls argued over the nets. " * 40
            + "The archive keeps maps of every coastline the guild has charted. " * 40)
    traces = log_traces(tiny_backbone, text, [1, 3], length=96, queries=8, windows=4)
    q, k = traces[3]
    assert q.shape == (tiny_backbone.n_heads, 4, 8, 16)
    assert k.shape == (tiny_backbone.n_kv_heads, 4, 96 - 8 - 16 - 4, 16)  # the mid region before the queries
    maps = PhiMaps.for_backbone(tiny_backbone, [1, 3], d_phi=16, length=96)
    losses = train_maps(maps, traces, steps=40, lr=3e-2)
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])
    s = torch.tensor([[0.0, -1.0, -20.0]])  # the loss is zero when the student copies the teacher
    assert float(DistillLoss()(s, s)) == pytest.approx(0.0, abs=1e-7)
    assert float(DistillLoss()(s, s + 1.0)) > 0  # and counts an inflated partition [RCA Eq. 30]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(text)
    args = add_arguments(argparse.ArgumentParser()).parse_args(
        ["--model", str(tiny_backbone.folder), "--corpus", str(corpus), "--out", str(tmp_path / "phi"), "--layers",
         "0,2", "--length", "96", "--queries", "8", "--windows", "2", "--steps", "3", "--d-phi", "8"])
    assert run(args) == 0
    loaded = PhiMaps.load(tmp_path / "phi")
    assert loaded.card["train"]["steps"] == 3
    assert loaded.layers == [0, 2] and loaded.card["length"] == 96 and loaded.card["model_hash"] == \
        tiny_backbone.model_hash
    maps.save(tmp_path / "again")
    again = PhiMaps.load(tmp_path / "again")
    x = torch.randn(tiny_backbone.n_heads, 5, 16)
    assert torch.equal(again.log_phi_q(1, x), maps.log_phi_q(1, x).detach())
    Completion(phi=tmp_path / "phi").setup(tiny_backbone)  # loads from the folder and passes the model check


def test_the_default_models_maps_ship_and_fit_only_it(backbone, tiny_backbone):
    shipped = PhiMaps.load("default")
    assert shipped.card["model_hash"] == backbone.model_hash and shipped.card["length"] == 8192
    assert shipped.layers == list(range(backbone.n_layers)) and shipped.card["train"]["steps"] > 0
    Completion(phi="default").setup(backbone)
    with pytest.raises(AttentionError, match="trained for another model"):
        Completion(phi=shipped_dir()).setup(tiny_backbone)
    # "default" is the backbone's own model's maps, where `endo train-phi --model` writes them: none for this one
    with pytest.raises(AttentionError, match=f"no phi maps ship in .*{shipped_dir(tiny_backbone.model_id).name}.*"
                                             "train-phi --model"):
        Completion(phi="default").setup(tiny_backbone)
