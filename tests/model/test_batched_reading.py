"""Query parts read together (`model.reading`: `read(..., parts=)`, `ask_parts`) against the plain twin, one `ask`
per part after a plain read: the same keys and queries, in fewer forwards, the caches left as they were."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from endo_retrieval.model.reading import ask, ask_parts, parts_mask, read, shared_lead

CONTEXT = "The river bends twice before the old mill. Farmers sell apples on Sundays. " * 8
LAYERS = [1, 2]


def counted(bb):
    """A one-item list counting the decoder's forwards from here on, and the handle that stops it."""
    count = [0]
    handle = bb.model.model.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count, handle


def assert_same_queries(got, expected):
    assert len(got) == len(expected)  # one entry per segment
    for g, e in zip(got, expected):
        for layer in LAYERS:
            torch.testing.assert_close(g[layer], e[layer], rtol=1e-5, atol=1e-5)


def test_shared_lead_and_the_mask_by_hand():
    a, b = np.array([7, 8, 9, 1]), np.array([7, 8, 2])
    assert shared_lead([a, b]) == 2 and shared_lead([a]) == 0 and shared_lead([a, a]) == 3  # a tail stays
    assert shared_lead([np.array([5, 1]), b]) == 0
    mask = parts_mask(2, [a, b], "cpu")[0, 0].int().tolist()
    # rows: the lead 7 8, then a's tail 9 1, then b's tail 2; columns: 2 tokens before, then the same rows
    assert mask == [[1, 1, 1, 0, 0, 0, 0],
                    [1, 1, 1, 1, 0, 0, 0],
                    [1, 1, 1, 1, 1, 0, 0],   # a's 9 sees the lead
                    [1, 1, 1, 1, 1, 1, 0],   # a's 1 sees the lead and 9
                    [1, 1, 1, 1, 0, 0, 1]]   # b's 2 sees the lead, never a's tail


@pytest.mark.parametrize("cuts", [None, "segments"])
def test_parts_read_together_give_the_plain_queries_in_one_forward_per_segment(tiny_backbone, cuts):
    bb = tiny_backbone
    ids = bb.encode(CONTEXT).ids
    cuts = None if cuts is None else [0, 50, len(ids)]
    question = bb.encode("\n\nQuestion: where do farmers sell apples?\nAnswer:").ids
    null = bb.encode("\n\nQuestion: N/A\nAnswer:").ids
    evidence = bb.encode("\n\nEvidence: The mill grinds wheat.").ids  # a shared lead of many tokens
    hop, hop_null = np.concatenate([evidence, question]), np.concatenate([evidence, null])
    plain = read(bb, ids, LAYERS, cuts=cuts)
    segments = len(plain.segments)
    expected = [ask(bb, plain, p, LAYERS) for p in (question, null, hop, hop_null)]

    count, handle = counted(bb)
    try:
        together = read(bb, ids, LAYERS, cuts=cuts, parts=[question, null])
        assert count[0] == segments  # the parts rode in the read's own forwards
        got = ask_parts(bb, together, [question, null], LAYERS)
        assert count[0] == segments and not together.asked  # taken from the read, once
        got += ask_parts(bb, together, [hop, hop_null], LAYERS)
        assert count[0] == 2 * segments
    finally:
        handle.remove()
    for g, e in zip(got, expected):
        assert_same_queries(g, e)
    for mine, theirs in zip(together.segments, plain.segments):  # the same keys, the caches cropped back
        assert mine.cache.get_seq_length() == theirs.cache.get_seq_length() == mine.n_tokens
        for layer in LAYERS:
            torch.testing.assert_close(mine.keys[layer], theirs.keys[layer], rtol=1e-5, atol=1e-5)
    assert_same_queries(ask_parts(bb, together, [question], LAYERS)[0], expected[0])  # asked again: a forward


def test_int8_readings_ask_one_part_per_forward(tiny_backbone):
    """int8 quantizes each forward's activations by their own range: parts read together would score otherwise
    than alone, so an int8 reading asks them one at a time (and its read takes none)."""
    from endo_retrieval.model.backbone import BackboneError

    bb = tiny_backbone
    ids = bb.encode(CONTEXT).ids
    parts = [bb.encode("Question: where are apples sold?").ids, bb.encode("Question: N/A").ids]
    with pytest.raises(BackboneError, match="one at a time"):
        read(bb, ids, LAYERS, int8=True, parts=parts)
    reading = read(bb, ids, LAYERS, int8=True)
    count, handle = counted(bb)
    try:
        got = ask_parts(bb, reading, parts, LAYERS)
    finally:
        handle.remove()
    assert count[0] == 2
    for g, p in zip(got, parts):
        for mine, theirs in zip(g, ask(bb, reading, p, LAYERS)):
            for layer in LAYERS:
                torch.testing.assert_close(mine[layer], theirs[layer], rtol=0, atol=0)
