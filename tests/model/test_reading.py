"""`model.reading`: a context read in segments, and a query part asked after it, against one plain forward of the
whole model over context + query part (every layer, no early exit, no cache): the same rotated keys and queries."""
from __future__ import annotations

import numpy as np
import torch

from endo_retrieval.model.reading import ask, read


def test_reading_and_asking_give_the_states_of_one_plain_forward(tiny_backbone):
    bb = tiny_backbone
    ids = bb.encode("The river bends twice before the old mill. Farmers sell apples on Sundays. " * 8).ids
    query = bb.encode("Question: where do farmers sell apples?").ids
    layer = 2  # the deepest asked for: the reading runs only its projections (backbone.Projections)
    states = {}
    attention = bb.model.model.layers[layer].self_attn
    hooks = [proj.register_forward_hook(lambda _m, _i, out, kind=kind: states.__setitem__(kind, out))
             for kind, proj in (("k", attention.k_proj), ("q", attention.q_proj))]
    try:
        with torch.inference_mode():
            bb.model(input_ids=torch.as_tensor(np.concatenate([ids, query]))[None])
    finally:
        for h in hooks:
            h.remove()
    positions = torch.arange(len(ids) + len(query))
    heads = lambda x: x.unflatten(-1, (-1, bb.head_dim))[0].transpose(0, 1).float()  # (heads, T, d)
    norm = lambda x, name: getattr(attention, name)(x.transpose(0, 1)).transpose(0, 1) if hasattr(attention, name) \
        else x  # Qwen3 normalises q and k per head before RoPE
    keys = bb.apply_rope(norm(heads(states["k"]), "k_norm"), positions)
    queries = bb.apply_rope(norm(heads(states["q"]), "q_norm"), positions)
    reading = read(bb, ids, [1, layer])
    torch.testing.assert_close(reading.segments[0].keys[layer].float(), keys[:, :len(ids)], rtol=1e-4, atol=1e-4)
    asked = ask(bb, reading, query, [1, layer])
    torch.testing.assert_close(asked[0][layer], queries[:, len(ids):], rtol=1e-4, atol=1e-4)
    again = ask(bb, reading, query, [1, layer])  # the cache was cropped back: the same answer twice
    torch.testing.assert_close(again[0][layer], asked[0][layer])
