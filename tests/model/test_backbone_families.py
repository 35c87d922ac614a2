"""Tiny random models of the four supported families: capture shapes, early exit, exactness of the modes."""
import numpy as np
import pytest
import torch

from endo_retrieval.model.backbone import BackboneError
from endo_bench.consistency import stream_keys

IDS = np.random.default_rng(0).integers(10, 1000, size=300)


def test_capture_shapes(tiny_backbone):
    bb = tiny_backbone
    chunks = list(bb.stream(IDS, [0, 2], chunk_size=128, capture=("k", "q")))
    assert [(c.start, c.end) for c in chunks] == [(0, 128), (128, 256), (256, 300)]
    last = chunks[-1]
    assert last.keys[2].shape == (bb.n_kv_heads, 44, bb.head_dim)
    assert last.queries[0].shape == (bb.n_heads, 44, bb.head_dim)
    assert torch.equal(last.rope_positions, torch.arange(44))  # independent chunks restart at 0


def test_early_exit_skips_later_layers(tiny_backbone):
    bb = tiny_backbone
    layers = bb.model.model.layers
    modules = {**dict(enumerate(layers)), "k1": layers[1].self_attn.k_proj, "q1": layers[1].self_attn.q_proj,
               "attention1": layers[1].self_attn, "mlp1": layers[1].mlp}
    calls = dict.fromkeys(modules, 0)
    hooks = [m.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1)) for i, m in modules.items()]
    try:
        list(bb.stream(IDS, [1], chunk_size=100))
    finally:
        for h in hooks:
            h.remove()
    # layer 1, the deepest asked for, runs only its norm and key projection (Projections); layers 2-3 never run
    assert calls == {0: 3, 1: 0, 2: 0, 3: 0, "k1": 3, "q1": 0, "attention1": 0, "mlp1": 0}
    assert len(bb.model.model.layers) == bb.n_layers  # the model is whole again afterwards


def test_independent_equals_full_pass_at_layer0_and_sink_window_with_room_is_exact(tiny_backbone):
    bb = tiny_backbone
    full = stream_keys(bb, IDS, [0, 3], chunk_size=len(IDS))
    indep = stream_keys(bb, IDS, [0, 3], chunk_size=64)
    torch.testing.assert_close(indep[0], full[0], rtol=0, atol=1e-6)
    assert not torch.allclose(indep[3], full[3], atol=1e-4)  # later layers do see the missing history
    # A window that covers the whole history is ordinary causal attention: same keys at every layer.
    wide = stream_keys(bb, IDS, [0, 3], chunk_size=64, mode="sink_window", sink=4, window=len(IDS))
    torch.testing.assert_close(wide[3], full[3], rtol=1e-4, atol=1e-4)


def test_sink_window_frames_each_chunk_behind_sink_and_window(tiny_backbone):
    chunks = list(tiny_backbone.stream(IDS, [0], chunk_size=128, mode="sink_window", window=64, split_at=250))
    assert [(c.start, c.end) for c in chunks] == [(0, 128), (128, 250), (250, 300)]
    # chunk 2 sits behind 4 sink + 64 window tokens, at positions 68.. (inside the trained window at any length)
    assert torch.equal(chunks[1].rope_positions, torch.arange(68, 68 + 122))
    assert torch.equal(chunks[0].rope_positions, torch.arange(128))


def test_absolute_and_dca_positions(tiny_backbone):
    """positions="absolute": every token at its own index; "dca": the same, except that from the third chunk on the
    sink is re-RoPEd by (i-2) chunk sizes [ILRe Eq. 6], which changes the later layers' keys of that chunk only."""
    bb = tiny_backbone
    kw = dict(chunk_size=128, mode="sink_window", window=64, split_at=250, capture=("k",))
    absolute = list(bb.stream(IDS, [2], positions="absolute", **kw))
    dca = list(bb.stream(IDS, [2], positions="dca", **kw))
    assert [c.rope_positions.tolist() for c in absolute] == [list(range(0, 128)), list(range(128, 250)),
                                                             list(range(250, 300))]
    assert [c.rope_positions.tolist() for c in dca] == [c.rope_positions.tolist() for c in absolute]
    torch.testing.assert_close(dca[1].keys[2], absolute[1].keys[2])  # chunk 2: no shift yet
    assert not torch.allclose(dca[2].keys[2], absolute[2].keys[2], atol=1e-4)
    # chunk 3 by hand: sink tokens 0..3 at positions 128..131 (one chunk size up), window 186..249, chunk 250..299
    ids = torch.as_tensor(np.concatenate([IDS[:4], IDS[186:300]]))[None]
    pos = torch.cat([torch.arange(4) + 128, torch.arange(186, 300)])[None]
    with torch.inference_mode(), bb.run_to(2, [2], ("k",)) as store:
        bb.model.model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=False)
    torch.testing.assert_close(dca[2].keys[2], store["k"][2][0, :, 68:])
    with pytest.raises(BackboneError, match="positions"):
        list(bb.stream(IDS, [0], positions="relative"))


def test_query_states_and_rope(tiny_backbone):
    bb = tiny_backbone
    q = bb.query_states(IDS[:20], [1])[1]
    assert q.shape == (bb.n_heads, 20, bb.head_dim)
    rotated = bb.apply_rope(q, torch.arange(20))
    torch.testing.assert_close(rotated[:, 0], q[:, 0])  # position 0 is not rotated
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1))  # rotations keep the norm


@pytest.mark.parametrize("layers", [[4], [-1], []])
def test_layer_out_of_range(tiny_backbone, layers):
    with pytest.raises(BackboneError, match="out of range|at least one layer"):
        list(tiny_backbone.stream(IDS, layers))


def test_bad_inputs(tiny_backbone):
    with pytest.raises(BackboneError, match="empty"):
        tiny_backbone.encode("   ")
    with pytest.raises(BackboneError, match="not UTF-8"):
        tiny_backbone.encode(b"caf\xe9 au lait")
    assert len(tiny_backbone.encode("caf\xe9".encode("utf-8"))) > 0
    with pytest.raises(BackboneError, match="mode"):
        list(tiny_backbone.stream(IDS, [0], mode="sliding"))
