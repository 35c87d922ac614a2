"""The real default model: greedy answers, chunked key states against a full pass (S3 appendix I)."""
import numpy as np
import pytest
import torch

from endo_bench.consistency import key_consistency

from conftest import shared_data

pytestmark = pytest.mark.slow


def test_greedy_answer_is_deterministic(backbone):
    first = backbone.generate("What is the capital of France? Answer in one word.", max_new_tokens=12)
    again = backbone.generate("What is the capital of France? Answer in one word.", max_new_tokens=12)
    assert "Paris" in first and first == again


def test_streamed_generation_matches(backbone):
    if backbone.device.type == "cuda":
        pytest.skip("on CUDA, generate() replays CUDA-graph steps; bf16 near-ties may part them from the streamed "
                    "model.generate (README 'Decoding')")
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


def test_long_texts_tokenise_in_pieces_exactly_as_in_one_pass(backbone, monkeypatch):
    """Cuts after newlines are kept only where a window across them agrees; the result is the one-pass encoding."""
    text = "".join(f"Record {i}: the harbour master logged {i * 7} ships, “{i % 13}” of them late — é.\n\n"
                   f"  An indented note follows line {i}.\n" for i in range(400))
    whole = backbone.tokens._encode_batch([text])[0]
    for piece_chars, batch in ((1000, 8), (4096, 8), (1000, 3), (1000, None)):  # None: batches of 2, 4, 8 pieces
        pieces = list(backbone.encode_pieces(text, piece_chars, batch))
        assert len(pieces) > 5  # the cuts were used
        assert [b for _, b, _ in pieces[:-1]] == [a for a, _, _ in pieces[1:]] and pieces[-1][1] == len(text)
        joined = backbone.encode(text, piece_chars=piece_chars)
        assert np.array_equal(joined.ids, whole.ids) and np.array_equal(joined.offsets, whole.offsets)
        assert np.array_equal(np.concatenate([e.ids for *_, e in pieces]), whole.ids)
    unsafe = "alpha beta gamma.\n   " * 3000  # every newline starts a whitespace run the tokenizer keeps whole
    assert len(list(backbone.encode_pieces(unsafe, 1000))) == 1  # so no cut is offered
    assert np.array_equal(backbone.encode(unsafe, piece_chars=1000).ids,
                          backbone.tokens._encode_batch([unsafe])[0].ids)
    clean = len(list(backbone.encode_pieces(text, 1000, 4)))
    one_pass = backbone.tokens._encode_batch

    def odd_pieces(texts, starts=None):  # a tokenizer whose piece edges differ from one pass: the check must see it
        out = one_pass(texts, starts)
        for e, t in zip(out, texts):
            if len(texts) > 1 and t.startswith("Record 3"):  # a piece (not a window) that starts at record 3..39
                e.ids = e.ids.copy()
                e.ids[0] += 1
        return out

    monkeypatch.setattr(backbone.tokens, "_encode_batch", odd_pieces)
    fewer = list(backbone.encode_pieces(text, 1000, 4))
    assert len(fewer) < clean
    assert np.array_equal(np.concatenate([e.ids for *_, e in fewer]), whole.ids)  # the bad cuts were joined over


def test_int8_question_forward_stays_close_to_fp32(backbone):
    if backbone.device.type != "cpu":
        pytest.skip("int8 question forwards run on a CPU backbone only")
    question = "Who was the harbour master of the old town, and when did the customs house close?"
    exact = backbone.query_states(question, [3, 11, 19])
    fast = backbone.query_states(question, [3, 11, 19], int8=True)
    assert len(backbone.capture.int8_twins) < backbone.n_layers  # quantized only as deep as questions go (layer 19)
    for layer in exact:
        cos = torch.nn.functional.cosine_similarity(exact[layer].flatten(1), fast[layer].flatten(1), dim=1)
        assert not torch.equal(exact[layer], fast[layer])  # the quantized maps really ran
        assert cos.min() > 0.9, (layer, cos)  # every head's queries still point the same way


def test_short_texts_keep_their_encoding_read_only(backbone):
    """A question is tokenised for its read, its calibration and its second hop: the second time costs nothing,
    gives the one-pass encoding, and nobody can write into the shared arrays."""
    question = "\n\nQuestion: Which harbour logged the most ships in 1887?\nAnswer:"
    first = backbone.encode(question)
    assert backbone.encode(question) is first
    whole = backbone.tokens._encode_batch([question])[0]
    assert np.array_equal(first.ids, whole.ids) and np.array_equal(first.offsets, whole.offsets)
    with pytest.raises(ValueError):
        first.ids[0] = 0
    long_text = "harbour " * 400  # past SHORT_TEXT: tokenised afresh each time
    assert backbone.encode(long_text) is not backbone.encode(long_text)
