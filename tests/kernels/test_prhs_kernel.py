"""The fused PrHS decode step against its torch twin (runs on the device; skipped without CUDA + Triton)."""
import pytest
import torch

from endo_retrieval.kernels.prhs_step import prhs_step_reference
from endo_retrieval.kernels.sae_topk import triton_available

needs_gpu = pytest.mark.skipif(not triton_available(), reason="needs a CUDA GPU and Triton (run on the device tool)")


def fresh_state(H, d, size, dtype):
    return [torch.zeros(H, d, dtype=dtype, device="cuda"), torch.zeros(H, size, dtype=torch.long, device="cuda"),
            torch.full((H,), -1, dtype=torch.long, device="cuda"), torch.zeros((), dtype=torch.int32, device="cuda")]


@needs_gpu
@pytest.mark.device
@pytest.mark.parametrize("dtype, window, cis, radius", [(torch.float32, 0, True, 1), (torch.bfloat16, 0, True, 1),
                                                        (torch.float32, 150, True, 2), (torch.float32, 0, False, 1)])
def test_fused_step_matches_the_twin_over_decode_steps(dtype, window, cis, radius):
    from endo_retrieval.kernels.prhs_step import prhs_step_triton

    g = torch.Generator().manual_seed(7)
    H, Hkv, d, n0, steps, top_k = 36, 12, 64, 700, 12, 88
    keys = (2 * torch.randn(Hkv, n0 + steps, d, generator=g)).to("cuda", dtype)
    values = torch.randn(Hkv, n0 + steps, d, generator=g).to("cuda", dtype)
    drift = torch.randn(H, d, generator=g)  # similar consecutive queries, so the gate opens for some heads
    queries = [(drift + 0.6 * torch.randn(H, d, generator=g)).to("cuda", dtype) for _ in range(steps)]
    size = top_k + (top_k // 3) * (2 * radius + 1)
    mine, twin = fresh_state(H, d, size, dtype), fresh_state(H, d, size, dtype)
    settings = dict(window=window, sink=8, local=32, top_k=top_k, radius=radius, tau=0.55, cis=cis, scaling=d ** -0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for t, q in enumerate(queries):
        qr = q.flip(-1)  # any second query works: the gate reads q, the scores and attention read qr
        n = n0 + t + 1
        got = prhs_step_triton(q, qr, keys[:, :n], values[:, :n], *mine, block=t // 4, **settings)
        want = prhs_step_reference(q, qr, keys[:, :n], values[:, :n], *twin, block=t // 4, **settings)
        assert (got.float() - want.float()).abs().max().item() < tol, f"step {t}"
        assert torch.equal(mine[2], twin[2]) and int(mine[3]) == int(twin[3])
        if cis:  # the kernel writes its set even without CIS (nothing reads it then)
            assert torch.equal(mine[1].sort(1).values, twin[1].sort(1).values)
    assert 0 < int(twin[3]) < H * steps if cis else int(twin[3]) == H * steps  # some heads shared


@needs_gpu
@pytest.mark.device
def test_prhs_backend_decodes_the_same_with_and_without_the_kernel():
    from conftest import ShapeBackbone

    from endo_retrieval.attention.prhs import PrHS

    tiny_backbone = ShapeBackbone(layers=4, heads=8, kv_heads=2, head_dim=64, device="cuda")
    outs = []
    for use_kernel in (True, False):
        backend = PrHS(top_k=12, sink=2, local=4, tau=0.0, block_size=4, start_layer=2, use_kernel=use_kernel)
        backend.setup(tiny_backbone)
        g = torch.Generator().manual_seed(3)
        H, Hkv, d = tiny_backbone.n_heads, tiny_backbone.n_kv_heads, tiny_backbone.head_dim
        steps = []
        for T in [60] + [1] * 10:
            for layer in range(tiny_backbone.n_layers):
                q, k, v = (torch.randn(n, T, d, generator=g).cuda() for n in (H, Hkv, Hkv))
                steps.append(backend.attend(layer, q, k, v, d ** -0.5))
        outs.append((torch.cat([s.flatten() for s in steps]), backend.stats))
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-4)
    assert outs[0][1] == outs[1][1] and 0 < outs[0][1]["rho_hat"] < 1


@needs_gpu
@pytest.mark.device
def test_fused_step_takes_exactly_k_when_scores_tie():
    from endo_retrieval.kernels.prhs_step import prhs_step_triton

    H, Hkv, d, n, top_k = 6, 2, 64, 600, 40
    keys = torch.zeros(Hkv, n, d, device="cuda")
    keys[:, [100, 200, 300, 400, 500], 0] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0], device="cuda")
    values = torch.randn(Hkv, n, d, device="cuda")
    q = torch.zeros(H, d, device="cuda")
    q[:, 0] = 1  # every other middle key scores exactly 0: 35 of the ~555 ties must be taken
    state = fresh_state(H, d, top_k + (top_k // 3) * 3, torch.float32)
    prhs_step_triton(q, q, keys, values, *state, block=0, window=0, sink=8, local=32, top_k=top_k, radius=1,
                     tau=0.5, cis=True, scaling=1.0)
    for row in state[1][:, :top_k].tolist():
        assert len(set(row)) == top_k and {100, 200, 300, 400, 500} <= set(row)
        assert all(8 <= p < n - 32 for p in row)
