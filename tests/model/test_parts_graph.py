"""The batched reads' forwards over bucketed, padded shapes (`model/parts_graph.py`): the key groups' mask against
`parts_mask` and the causal mask, the padded forwards (run eagerly: the twin of the replay) against the plain
batched reads (CPU), and the replay against the eager forwards (device)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from endo_retrieval.model import parts_graph
from endo_retrieval.model.parts_graph import PAD, group_mask, parts_attention
from endo_retrieval.model.reading import _behind, ask_parts, parts_mask, read

CONTEXT = "The river bends twice before the old mill. Farmers sell apples on Sundays. " * 8
LAYERS = [1, 2]


def test_group_mask_is_the_causal_context_then_parts_mask():
    a, b = np.array([7, 8, 9, 1]), np.array([7, 8, 2])
    n = 5
    ids, _, groups = _behind(np.arange(n), [a, b], n)
    T, pad = len(ids), 3
    labels = torch.as_tensor(np.concatenate([groups, np.full(pad, PAD)]))
    mask = group_mask(labels, 0)[0, 0]
    want = torch.zeros(T, T, dtype=torch.bool)
    want[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()  # the context reads causally
    want[n:] = parts_mask(n, [a, b], "cpu")[0, 0]
    assert torch.equal(mask[:T, :T], want)
    assert not mask[:T, T:].any()  # no real row sees a padded key
    assert mask[T:].diagonal(T).all() and not mask[T:, T:].triu(1).any()  # a padded row sees itself, never later

    # behind a cache of n tokens held in a buffer of 8: the parts see the cached tokens, never the buffer's rest
    _, _, groups = _behind(np.empty(0, np.int64), [a, b], n)
    labels = torch.as_tensor(np.concatenate([np.full(n, -1), np.full(3, PAD), groups]))
    mask = group_mask(labels, 8)[0, 0]
    assert torch.equal(torch.cat([mask[:, :n], mask[:, 8:]], 1), parts_mask(n, [a, b], "cpu")[0, 0])
    assert not mask[:, n:8].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parts_attention_is_sdpa_over_the_mask(dtype):
    """The parts' attention (two matmuls, query heads grouped over their key/value head) against SDPA with the keys
    and values repeated per head, as Hugging Face's attention calls it; a bool mask and the same as an additive one."""
    torch.manual_seed(0)
    B, H, kv, R, K, d = 1, 12, 2, 7, 50, 16
    q, k, v = torch.randn(B, H, R, d), torch.randn(B, kv, K, d), torch.randn(B, kv, K, d)
    mask = torch.rand(1, 1, R, K) > 0.3
    mask[..., 0] = True  # every row sees a key
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(H // kv, 1), v.repeat_interleave(H // kv, 1), attn_mask=mask).transpose(1, 2)
    got = parts_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask, d ** -0.5)
    assert got.shape == (B, R, H, d) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(parts_attention(q, k, v, additive, d ** -0.5), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cuts", [None, "segments"])
def test_padded_forwards_give_the_plain_batched_states(tiny_backbone, monkeypatch, cuts):
    bb = tiny_backbone
    bb.parts_graphs = parts_graph.PartsGraphs()  # none captured by an earlier test
    monkeypatch.setattr(parts_graph, "BUCKET", 64)  # the tiny model's read pads to 128 rows, its hop to 64
    monkeypatch.setattr(parts_graph, "MIN_REPLAYS", 1)
    ids = bb.encode(CONTEXT).ids
    cuts = None if cuts is None else [0, 50, len(ids)]
    question = bb.encode("\n\nQuestion: where do farmers sell apples?\nAnswer:").ids
    null = bb.encode("\n\nQuestion: N/A\nAnswer:").ids
    evidence = bb.encode("\n\nEvidence: The mill grinds wheat.").ids
    hop, hop_null = np.concatenate([evidence, question]), np.concatenate([evidence, null])

    def run(twin: bool):
        bb.parts_graphs.twin = twin
        try:
            reading = read(bb, ids, LAYERS, cuts=cuts, parts=[question, null])
            asked = ask_parts(bb, reading, [question, null], LAYERS) + ask_parts(bb, reading, [hop, hop_null], LAYERS)
            return reading, asked
        finally:
            bb.parts_graphs.twin = False

    plain, expected = run(False)
    assert not bb.parts_graphs.graphs
    padded, got = run(True)
    shapes = sorted(k[:2] for k in bb.parts_graphs.graphs)
    assert shapes and all(c % 64 == 0 and r % 64 == 0 for c, r in shapes)  # every forward went through a graph
    assert any(c for c, _ in shapes)  # ... the second hop's behind its cache, bucketed
    assert any(k[4] for k in bb.parts_graphs.graphs)  # ... the read's with its context's rows apart (causal)
    for g, e in zip(got, expected):
        for mine, theirs in zip(g, e):
            for layer in LAYERS:
                torch.testing.assert_close(mine[layer], theirs[layer], rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(padded.segments, plain.segments):  # the same keys and caches
        assert mine.cache.get_seq_length() == theirs.cache.get_seq_length() == mine.n_tokens
        for layer in LAYERS:
            torch.testing.assert_close(mine.keys[layer], theirs.keys[layer], rtol=1e-4, atol=1e-4)
        for m, t in zip(mine.cache.layers, theirs.cache.layers):
            torch.testing.assert_close(m.keys, t.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(m.values, t.values, rtol=1e-4, atol=1e-4)


def test_graphs_past_their_memory_go_least_recently_used_first(tiny_backbone, monkeypatch):
    bb = tiny_backbone
    bb.parts_graphs = graphs = parts_graph.PartsGraphs()
    monkeypatch.setattr(parts_graph, "BUCKET", 64)
    monkeypatch.setattr(parts_graph, "MIN_REPLAYS", 1)
    graphs.twin = True
    ids = bb.encode(CONTEXT).ids
    question = bb.encode("\n\nQuestion: where do farmers sell apples?\nAnswer:").ids
    reading = read(bb, ids, LAYERS, parts=[question])
    first = next(iter(graphs.graphs.values()))
    assert first.nbytes >= first.ids.numel() * 8 and not first.prefix  # a read keeps no cache buffers
    graphs.max_bytes = first.nbytes  # room for one read graph only
    ask_parts(bb, reading, [np.concatenate([question, question[:3]])], LAYERS)  # behind the cache: a second shape
    (kept,) = graphs.graphs.values()
    assert kept.cached and kept.nbytes > first.nbytes  # the newest stays even alone past the bound
    graphs.max_bytes = None
    read(bb, ids, LAYERS, parts=[question])
    assert len(graphs.graphs) == 2  # without a bound, KEEP alone limits them


def test_a_capture_that_fails_turns_the_graphs_off_and_reads_eagerly(tiny_backbone, monkeypatch, caplog):
    bb = tiny_backbone
    bb.parts_graphs = graphs = parts_graph.PartsGraphs()
    monkeypatch.setattr(parts_graph, "MIN_REPLAYS", 1)
    graphs.twin = True

    def fails(*args, **kwargs):
        raise RuntimeError("no capture here")

    monkeypatch.setattr(parts_graph, "PartsGraph", fails)
    ids = bb.encode(CONTEXT).ids
    with caplog.at_level("WARNING", logger="endo_retrieval.model.parts_graph"):
        got = read(bb, ids, LAYERS, parts=[np.array([5, 6, 7])])
    assert not graphs.enabled and not graphs.graphs and "no capture here" in caplog.text
    want = read(bb, ids, LAYERS, parts=[np.array([5, 6, 7])])  # the eager read, as before
    for layer in LAYERS:
        torch.testing.assert_close(got.segments[0].keys[layer], want.segments[0].keys[layer])


def test_off_cuda_nothing_is_captured(tiny_backbone):
    tiny_backbone.parts_graphs = parts_graph.PartsGraphs()
    reading = read(tiny_backbone, tiny_backbone.encode(CONTEXT).ids, LAYERS, parts=[np.array([5, 6, 7])] * 2)
    ask_parts(tiny_backbone, reading, [np.array([9, 9])], LAYERS)
    assert not tiny_backbone.parts_graphs.graphs and not tiny_backbone.parts_graphs.seen


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the device tool)")
def test_replayed_pipeline_reads_equal_eager(backbone):
    """The default pipeline's question on the GPU, its forwards replayed from graphs, against the eager forwards."""
    from endo_retrieval.methods.heads import read_passages, profile_heads

    passages = [f"Passage {i} tells of the river that bends {i} times before the mill at Yorn." for i in range(20)]
    heads = profile_heads(backbone)

    def run(enabled: bool):
        backbone.parts_graphs.enabled = enabled
        try:
            return [read_passages(backbone, passages, "How often does the river bend?", heads, second_hop=True,
                                  first_stage=np.arange(20.0)) for _ in range(3)]
        finally:
            backbone.parts_graphs.enabled = True

    eager, replayed = run(False), run(True)
    assert backbone.parts_graphs.graphs  # the repeated shapes were captured
    for a, b in zip(eager, replayed):
        for name in a.signals:
            np.testing.assert_allclose(b.signals[name], a.signals[name], rtol=0.05, atol=0.02)
