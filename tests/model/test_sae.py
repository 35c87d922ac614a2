"""TopKSAE [S3 Eq. 2-3], head aggregation, files, training and resume: small random data, seconds on CPU."""
import hashlib
import json
import math
import os
from pathlib import Path

import pytest
import torch

from endo_retrieval.model.sae import SAEBank, SAEError, SAEModelMismatch, TopKSAE, aggregate_heads


def small_sae(d_in=8, d_latent=32, k=4, seed=0):
    torch.manual_seed(seed)
    sae = TopKSAE(d_in, d_latent, k)
    with torch.no_grad():
        sae.b_enc.normal_(0, 0.1)
        sae.b_dec.normal_(0, 0.1)
        sae.W_enc.add_(0.3 * torch.randn_like(sae.W_enc))
    return sae


def test_encode_matches_naive_equations():
    sae = small_sae()
    x = torch.randn(50, 8)
    ids, acts = sae.encode(x)
    assert ids.shape == acts.shape == (50, 4) and ids.dtype == torch.int64
    sae.requires_grad_(False)
    for n in range(50):  # [S3 Eq. 2-3] written out per vector
        z = [max(0.0, float(sae.W_enc[i] @ (x[n] - sae.b_dec) + sae.b_enc[i])) for i in range(32)]
        order = sorted(range(32), key=lambda i: -z[i])[:4]
        assert acts[n].tolist() == pytest.approx([z[i] for i in order], abs=1e-5)
        positive = [i for i in order if z[i] > 0]
        assert ids[n, : len(positive)].tolist() == positive
    assert (acts[:, :-1] >= acts[:, 1:]).all()


def test_decode_and_fvu_by_hand():
    sae = small_sae()
    ids = torch.tensor([[3, 7, 0, 1]])
    acts = torch.tensor([[2.0, 0.5, 0.0, 1.0]])
    expect = 2.0 * sae.W_dec[3] + 0.5 * sae.W_dec[7] + 1.0 * sae.W_dec[1] + sae.b_dec
    assert torch.allclose(sae.decode(ids, acts)[0], expect, atol=1e-6)
    x = torch.randn(40, 8)
    x_hat = sae.decode(*sae.encode(x))
    fvu = float(((x - x_hat.detach()) ** 2).sum() / ((x - x.mean(0)) ** 2).sum())
    assert sae.fvu(x) == pytest.approx(fvu, rel=1e-5)


def test_encode_keeps_leading_dims():
    sae = small_sae()
    x = torch.randn(3, 5, 8)
    ids, acts = sae.encode(x)
    ids2, acts2 = sae.encode(x.reshape(15, 8))
    assert ids.shape == (3, 5, 4) and torch.equal(ids.reshape(15, 4), ids2)


@pytest.mark.parametrize("shape", [(4, 7), (9,)])
def test_wrong_width_names_expected_and_got(shape):
    with pytest.raises(ValueError) as e:
        small_sae().encode(torch.randn(*shape))
    assert "dimension 8" in str(e.value) and str(shape) in str(e.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_input_rejected(value):
    x = torch.randn(4, 8)
    x[2, 3] = value
    with pytest.raises(ValueError, match="NaN or inf"):
        small_sae().encode(x)


def test_aggregate_heads_max_and_sum_by_hand():
    ids = torch.tensor([[[5, 2, 9]], [[2, 7, 5]]])  # (H=2, T=1, k=3)
    acts = torch.tensor([[[3.0, 2.0, 0.5]], [[2.5, 1.0, 0.7]]])
    i, a = aggregate_heads(ids, acts, 3, "max")  # 5:3.0, 2:2.5, 7:1.0, 9:0.5
    assert i.tolist() == [[5, 2, 7]] and a.tolist() == [[3.0, 2.5, 1.0]]
    i, a = aggregate_heads(ids, acts, 3, "sum")  # 2:4.5, 5:3.7, 7:1.0, 9:0.5
    assert i.tolist() == [[2, 5, 7]] and a == pytest.approx(torch.tensor([[4.5, 3.7, 1.0]]))


def test_aggregate_heads_matches_dense_reference():
    torch.manual_seed(1)
    H, T, k, L = 3, 20, 6, 16
    ids = torch.stack([torch.stack([torch.randperm(L)[:k] for _ in range(T)]) for _ in range(H)])
    acts = torch.rand(H, T, k)
    for rule, reduce in (("max", "amax"), ("sum", "sum")):
        dense = torch.zeros(T, L).scatter_reduce(1, ids.permute(1, 0, 2).reshape(T, -1),
                                                 acts.permute(1, 0, 2).reshape(T, -1), reduce)
        want_a, want_i = dense.topk(k, dim=1)
        got_i, got_a = aggregate_heads(ids, acts, k, rule)
        assert torch.allclose(got_a, want_a, atol=1e-6)
        assert torch.equal(got_i.sort(1).values, want_i.sort(1).values)


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_encode_heads_is_the_max_union_of_the_heads_top_k(heads):
    torch.manual_seed(heads)
    sae = TopKSAE(8, 64, 5)
    x = 2 * torch.randn(heads, 30, 8)
    ids, acts = sae.encode(x)  # (heads, T, k): each head's own top-k
    want_i, want_a = aggregate_heads(ids, acts, 5, "max")
    got_i, got_a = sae.encode_heads(x)
    assert torch.allclose(got_a, want_a, atol=1e-6)
    positive = want_a > 0  # ids of zero activations carry no meaning
    assert all(set(g[p].tolist()) == set(w[p].tolist()) for g, w, p in zip(got_i, want_i, positive))
    assert positive.float().mean() > 0.5


def test_aggregate_rejects_bad_shapes():
    with pytest.raises(ValueError, match="heads, T, k"):
        aggregate_heads(torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, 4), 2)


def test_save_load_roundtrip_and_card(tmp_path):
    sae = small_sae()
    sae.save(tmp_path / "s", dtype=torch.float32, model_hash="abc", fvu_k=0.05)
    back = TopKSAE.load(tmp_path / "s", expect_model_hash="abc")
    x = torch.randn(30, 8)
    assert torch.equal(back.encode(x)[0], sae.encode(x)[0])
    card = json.loads((tmp_path / "s" / "card.json").read_text())
    assert card.pop("weights_sha256") == hashlib.sha256((tmp_path / "s" / "sae.safetensors").read_bytes()).hexdigest()
    assert card == {"model_hash": "abc", "fvu_k": 0.05, "d_in": 8, "d_latent": 32, "k": 4}


def test_truncated_and_corrupt_files_give_clear_errors(tmp_path):
    small_sae().save(tmp_path / "s")
    weights = tmp_path / "s" / "sae.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(SAEError, match="truncated or corrupt"):
        TopKSAE.load(tmp_path / "s")
    (tmp_path / "s" / "card.json").write_text("{not json")
    with pytest.raises(SAEError, match="corrupt"):
        TopKSAE.load(tmp_path / "s")
    with pytest.raises(SAEError, match="No SAE card"):
        TopKSAE.load(tmp_path / "missing")


def test_model_hash_mismatch_names_the_model(tmp_path):
    bank = SAEBank({3: small_sae()}, {"model": "TinyLM", "model_hash": "f" * 64, "k": 4})
    bank.save(tmp_path / "b")
    with pytest.raises(SAEModelMismatch, match="trained for model TinyLM"):
        SAEBank.load(tmp_path / "b", expect_model_hash="0" * 64)
    assert SAEBank.load(tmp_path / "b", expect_model_hash="f" * 64).layers == [3]


def test_bank_encodes_heads_to_k_per_token(tmp_path):
    sae = small_sae()
    bank = SAEBank({2: sae}, {"model_hash": "h", "k": 4, "aggregation": "max"})
    keys = torch.randn(3, 10, 8)
    ids, acts = bank.encode_keys(2, keys)
    assert ids.shape == acts.shape == (10, 4)
    per_head = sae.pre_acts(keys).amax(0)  # max over heads, then top k (the "max" rule)
    assert torch.allclose(acts, per_head.topk(4, dim=1).values, atol=1e-5)
    q_ids, _ = bank.encode_queries(2, torch.randn(9, 10, 8))
    assert q_ids.shape == (10, 4)
    with pytest.raises(SAEError, match="layers \\[2\\]"):
        bank.encode_keys(5, keys)


def _blobs(n, d=8, centers=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(centers, d, generator=g) * 3
    return c[torch.randint(0, centers, (n,), generator=g)] + 0.05 * torch.randn(n, d, generator=g) + 5.0


def test_training_reduces_fvu_and_keeps_unit_decoder():
    from endo_retrieval.calibration.train_sae import TrainConfig, train_sae

    x = _blobs(4000)
    untrained = TopKSAE(8, 32, 4)
    cfg = TrainConfig(d_latent=32, k=4, steps=80, batch_size=128, lr=1e-2, seed=0, dead_window=4000)
    sae, stats = train_sae(x, cfg)
    assert sae.fvu(_blobs(1000, seed=0)) < 0.05 < untrained.fvu(_blobs(1000, seed=0))
    assert torch.allclose(sae.W_dec.norm(dim=1), torch.ones(32), atol=1e-5)
    assert stats["steps"] == 80 and 0.0 <= stats["dead_share_train"] <= 1.0


def test_auxk_loss_by_hand_and_gradient_reaches_only_dead_latents():
    from endo_retrieval.calibration.train_sae import auxk_loss

    W_dec = torch.eye(4, 2).requires_grad_(True)  # latents 0, 1 = unit axes; 2, 3 = zero rows
    with torch.no_grad():
        W_dec[2] = torch.tensor([0.6, 0.8])
    pre = torch.tensor([[5.0, 0.3, 0.5, 0.9], [5.0, 0.2, 0.4, 0.0]], requires_grad=True)
    dead = torch.tensor([False, True, True, False])
    residual = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    loss = auxk_loss(pre, dead, residual, W_dec, aux_k=1)
    # row 0 picks dead latent 2 (0.5 > 0.3): recon (0.3, 0.4); row 1 picks latent 2 (0.4): recon (0.24, 0.32)
    err = (1 - 0.3) ** 2 + 0.4 ** 2 + 0.24 ** 2 + (1 - 0.32) ** 2
    assert loss.item() == pytest.approx(err / 1.0, rel=1e-5)  # residual's variance about its mean: 4 * 0.25
    loss.backward()
    assert pre.grad[:, 2].abs().sum() > 0 and pre.grad[:, [0, 3]].abs().sum() == 0


def test_resume_after_interrupt_matches_uninterrupted(tmp_path):
    from endo_retrieval.calibration.train_sae import TrainConfig, TrainingInterrupted, train_sae

    x = _blobs(3000)
    cfg = TrainConfig(d_latent=32, k=4, steps=40, batch_size=128, seed=3, dead_window=512, checkpoint_every=10)
    full, _ = train_sae(x, cfg)
    ckpt = tmp_path / "ckpt.pt"
    with pytest.raises(TrainingInterrupted):
        train_sae(x, cfg, checkpoint=ckpt, stop_after=25)  # simulated crash after step 25
    assert torch.load(ckpt, weights_only=True)["step"] == 20  # last checkpoint before the crash
    resumed, stats = train_sae(x, cfg, checkpoint=ckpt)
    assert stats["resumed_from"] == 20
    assert torch.allclose(resumed.W_dec, full.W_dec, atol=1e-6)


@pytest.mark.slow
def test_shipped_saes_reconstruct_heldout_keys():
    data = Path(os.environ.get("ENDO_DATA", Path(__file__).parents[3] / "shared" / "data")) / "wikitext2" / "test.txt"
    if not data.exists():
        pytest.skip(f"held-out text not found at {data} (set ENDO_DATA to the shared data folder)")
    from endo_retrieval.model.backbone import Backbone

    bb = Backbone.default()
    bank = SAEBank.for_backbone(bb)
    ids = bb.encode(data.read_text()[:20000]).ids[:1024]
    layers = bank.layers
    chunk = next(bb.stream(ids, layers, chunk_size=1024, capture=("k",)))
    for layer in layers:
        sae = bank.saes[layer]
        fvu = sae.fvu(chunk.keys[layer].reshape(-1, sae.d_in))
        assert fvu <= 0.12, f"layer {layer}: held-out key FVU {fvu:.3f}"
        assert math.isclose(bank.card["fvu_k"][str(layer)], fvu, abs_tol=0.05)


@pytest.mark.parametrize("fit", ["keys", "keys+queries"])
def test_train_sae_command_fits_keys_or_keys_and_queries(fit, tmp_path):
    """`endo train-sae` end to end on a tiny model: exit code 0, and keys+queries trains on as many queries as keys."""
    from conftest import make_tiny_model
    from endo_retrieval.cli import main

    folder = make_tiny_model("llama", tmp_path / "model", layers=2)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The harbour master counted the ships that came in with the tide. " * 30)
    out = tmp_path / "sae"
    assert main(["train-sae", "--model", str(folder), "--corpus", str(corpus), "--heldout", "none", "--layers", "1",
                 "--out", str(out), "--steps", "3", "--batch-size", "32", "--expansion", "4", "--k", "4",
                 "--fit", fit, "--device", "cpu"]) == 0
    card = json.loads((out / "card.json").read_text())
    tokens, kv_heads = card["training_tokens"], 2  # make_tiny_model: 2 KV heads
    assert card["fit"] == fit
    assert card["training_vectors"]["1"] == tokens * kv_heads * (2 if fit == "keys+queries" else 1)
