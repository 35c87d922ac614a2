"""The real default model: greedy answers, chunked key states against a full pass (S3 appendix I)."""
import pytest

from endo_retrieval.eval.consistency import key_consistency

from conftest import shared_data

pytestmark = pytest.mark.slow


def test_greedy_answer_is_deterministic(backbone):
    first = backbone.generate("What is the capital of France? Answer in one word.", max_new_tokens=12)
    again = backbone.generate("What is the capital of France? Answer in one word.", max_new_tokens=12)
    assert "Paris" in first and first == again


def test_streamed_generation_matches(backbone):
    whole = backbone.generate("Name a primary colour.", max_new_tokens=10)
    pieces = list(backbone.generate("Name a primary colour.", max_new_tokens=10, stream=True))
    assert len(pieces) > 1 and "".join(pieces).strip() == whole


def test_chunked_keys_against_full_pass_on_real_8k_text(backbone):
    text = shared_data("wikitext2", "test.txt").read_text()[:60000]
    ids = backbone.encode(text).ids[:8192]
    assert len(ids) == 8192
    rows = key_consistency(backbone, ids, [0, 15, 29], chunk_sizes=(2048,), modes=("independent", "sink_window"))
    cos = {(r["mode"], r["layer"]): r["cosine"] for r in rows}
    rel = {(r["mode"], r["layer"]): r["rel_l2"] for r in rows}
    assert cos[("independent", 0)] > 0.999999 and rel[("independent", 0)] < 1e-5  # layer 0 sees no history
    assert cos[("independent", 15)] >= 0.95 and cos[("independent", 29)] >= 0.95
    for layer in (15, 29):  # sink + window keeps more of the history than a lone chunk
        assert rel[("sink_window", layer)] < rel[("independent", layer)]
