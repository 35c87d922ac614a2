"""Stream chunks replayed from CUDA graphs: the causal attention they use against masked SDPA (CPU), and the replayed
stream against the eager one (device)."""
import numpy as np
import pytest
import torch


def test_causal_chunk_attention_is_masked_causal_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from endo_retrieval.model.chunk_graph import causal_chunk_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 50, 8, generator=g) for h in (6, 2, 2))
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 3, True, False
    causal = torch.ones(1, 1, 50, 50, dtype=torch.bool).tril()
    got, _ = causal_chunk_attention(module, q, k, v, torch.ones_like(causal), scaling=0.3)  # any mask is dropped
    want, _ = sdpa_attention_forward(module, q, k, v, causal, scaling=0.3)
    torch.testing.assert_close(got, want)


def test_cpu_stream_captures_nothing(tiny_backbone):
    list(tiny_backbone.stream(np.arange(40) + 5, [1], chunk_size=8))
    assert not tiny_backbone.chunk_graphs.graphs


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the device tool)")
@pytest.mark.parametrize("mode, positions, capture", [("independent", "frame", ("k",)),
                                                      ("sink_window", "dca", ("k", "q"))])
def test_replayed_stream_equals_eager(backbone, mode, positions, capture):
    ids = np.random.default_rng(0).integers(100, 20000, 20 * 256 + 77)
    # sink_window chunks go two to a batch (4 + 128 + 256 tokens each): a shape repeated often enough to be captured
    kw = dict(chunk_size=256, mode=mode, positions=positions, capture=capture, window=128, batch_tokens=2 * 388)

    def run(graphs: bool):
        backbone.chunk_graphs.enabled = graphs
        try:
            return list(backbone.stream(ids, [3, 11], **kw))
        finally:
            backbone.chunk_graphs.enabled = True

    backbone.chunk_graphs.graphs.clear()
    eager, replayed = run(False), run(True)
    assert backbone.chunk_graphs.graphs  # the repeated shape was captured
    assert [(c.start, c.end) for c in replayed] == [(c.start, c.end) for c in eager]
    for a, b in zip(eager, replayed):
        torch.testing.assert_close(b.rope_positions, a.rope_positions)
        for kind in ("keys", "queries"):
            got, want = getattr(b, kind), getattr(a, kind)
            assert got.keys() == want.keys()
            for layer in want:
                torch.testing.assert_close(got[layer], want[layer], rtol=2e-2, atol=2e-2)
    assert replayed[-2].keys[3].data_ptr() != replayed[-4].keys[3].data_ptr()  # each replay's own copy
