"""Fused Triton encode + top-k against its torch twin (runs on the device; skipped without CUDA + Triton)."""
import pytest
import torch

from endo_retrieval.kernels.sae_topk import sae_topk, sae_topk_reference, triton_available


def weights(d_in, d_latent, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    W = torch.nn.functional.normalize(torch.randn(d_latent, d_in, generator=g), dim=1)
    b_enc, b_dec = 0.1 * torch.randn(d_latent, generator=g), torch.randn(d_in, generator=g)
    return W.to(device), b_enc.to(device), b_dec.to(device)


def test_twin_matches_dense_topk_on_cpu():
    W, b_enc, b_dec = weights(16, 96)
    x = torch.randn(40, 16)
    ids, acts = sae_topk(x, W, b_enc, b_dec, 8)  # CPU dispatches to the twin
    z = torch.relu((x - b_dec) @ W.T + b_enc)
    assert torch.allclose(acts, z.topk(8, dim=1).values)
    assert torch.allclose(z.gather(1, ids), acts)
    ids2, _ = sae_topk_reference(x, W, b_enc, b_dec, 8, rows_per_step=7)  # blocking does not change results
    assert torch.equal(ids, ids2)


needs_gpu = pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and Triton (run on the device tool)")


@needs_gpu
@pytest.mark.device
@pytest.mark.parametrize("n, d_in, d_latent, k", [(1000, 64, 4096, 32), (333, 64, 1000, 20), (64, 48, 512, 64)])
def test_triton_matches_twin(n, d_in, d_latent, k):
    from endo_retrieval.kernels.sae_topk import sae_topk_triton

    W, b_enc, b_dec = weights(d_in, d_latent, device="cuda")
    x = (3 * torch.randn(n, d_in, generator=torch.Generator().manual_seed(n))).to("cuda")  # seeded: no flaky ties
    ids, acts = sae_topk_triton(x, W, b_enc, b_dec, k)
    ref_ids, ref_acts = sae_topk_reference(x, W, b_enc, b_dec, k)
    z = torch.relu((x - b_dec) @ W.T + b_enc)  # exact fp32 activations of every latent
    tol = 1e-2 * ref_acts[:, :1].clamp_min(1.0)  # bf16 tolerance relative to the row's largest activation
    assert (acts - ref_acts).abs().le(tol).all()  # the k sorted activations agree
    assert (z.gather(1, ids) - acts).abs().le(tol).all()  # each returned id really has its activation
    same = torch.tensor([set(a) == set(b) for a, b in zip(ids.tolist(), ref_ids.tolist())])
    # sets differ only where the k-th activation ties with the (k+1)-th within tolerance
    kth, next_ = z.topk(k + 1, dim=1).values[:, -2:].unbind(1)
    assert ((kth - next_).abs() <= tol[:, 0])[~same].all()
    assert same.float().mean() > 0.95
    assert ids.unique(dim=None).numel() > 1 and (ids >= 0).all() and (ids < d_latent).all()
    assert all(len(set(r)) == k for r in ids.tolist())  # no latent twice in a row


@needs_gpu
@pytest.mark.device
@pytest.mark.parametrize("heads, n, blocks", [(3, 2048, {}), (3, 2048, dict(block_m=16, block_n=128, num_warps=4)),
                                             (9, 77, {}), (1, 300, dict(block_m=32, block_n=64, num_warps=2))])
def test_triton_heads_max_matches_twin(heads, n, blocks):
    """(G, N, d): one top-k per token over each latent's largest activation across its G heads, whatever the
    blocks."""
    from endo_retrieval.kernels.sae_topk import sae_topk_triton

    W, b_enc, b_dec = weights(64, 1024, device="cuda")
    x = (3 * torch.randn(heads, n, 64, generator=torch.Generator().manual_seed(n))).to("cuda")
    ids, acts = sae_topk_triton(x, W, b_enc, b_dec, 16, **blocks)
    ref_ids, ref_acts = sae_topk_reference(x, W, b_enc, b_dec, 16)
    z = torch.relu((x - b_dec) @ W.T + b_enc).amax(0)  # exact fp32 maxima over the heads
    tol = 1e-2 * ref_acts[:, :1].clamp_min(1.0)
    assert (acts - ref_acts).abs().le(tol).all()
    assert (z.gather(1, ids) - acts).abs().le(tol).all()
    same = torch.tensor([set(a) == set(b) for a, b in zip(ids.tolist(), ref_ids.tolist())])
    assert same.float().mean() > 0.95
