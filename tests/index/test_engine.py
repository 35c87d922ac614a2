"""The S3 engine and its compressors on a tiny random model with random SAEs (plumbing, budgets, errors).

Quality on the real model with the shipped SAEs is in test_s3_real.py.
"""
import threading

import numpy as np
import pytest
import torch

from endo_retrieval import BM25, S3, Document, EndoIndex, S3Hybrid, SAEBank, TopKSAE

from conftest import make_tiny_model

FILLER = ("The river bends twice before the old mill. Farmers sell apples at the market on Sundays. "
          "A quiet road leads up the hill to the chapel. ") * 12
NEEDLE = "The vault combination is 4417, said the caretaker. "
QUESTION = "What is the vault combination?"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from endo_retrieval import Backbone

    bb = Backbone(make_tiny_model("llama", tmp_path_factory.mktemp("tiny")), device="cpu")
    torch.manual_seed(0)
    bank = SAEBank({l: TopKSAE(bb.head_dim, 256, 8) for l in (0, 2)},
                   {"d_latent": 256, "k": 8, "model_hash": bb.model_hash, "model": bb.model_id})
    return bb, bank


@pytest.mark.parametrize("handoff", [None, 100])  # 100: features reach the host every second chunk
def test_index_scores_match_a_naive_rebuild(tiny, handoff, monkeypatch):
    bb, bank = tiny
    if handoff:
        monkeypatch.setattr("endo_retrieval.index.engine.HANDOFF_TOKENS", handoff)
    idx = EndoIndex(bb, "s3-hybrid", saes=bank, chunk_size=64)
    idx.add_documents([Document("a", FILLER), Document("b", NEEDLE + FILLER[:300])])
    got = idx.s3_scores(QUESTION)
    # naive [S3 Eq. 7]: feature sets per position from a fresh pass, IDF over those sets, loops in Python
    q = idx.query_features(QUESTION)
    expected = np.zeros(idx.corpus.n_positions)
    for layer in bank.layers:
        feats = {}
        for doc in idx.corpus.documents():
            ids = bb.encode(doc.text).ids
            for ch in bb.stream(ids, [layer], chunk_size=64):
                f, a = bank.encode_keys(layer, ch.keys[layer])
                for t in range(f.shape[0]):
                    feats[doc.start + ch.start + t] = {int(x) for x, v in zip(f[t], a[t]) if v > 0}
        freq = {}
        for fs in feats.values():
            for f in fs:
                freq[f] = freq.get(f, 0) + 1
        w = {}
        for f, a in zip(*q[layer]):
            w[int(f)] = w.get(int(f), 0.0) + float(a)
        for t, fs in feats.items():
            expected[t] += sum(w[f] / (np.log(1 + freq[f]) + 1) for f in fs if f in w and freq[f] <= 5000)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", [S3, BM25, S3Hybrid])
def test_compress_meets_budget_in_source_order(tiny, method):
    bb, bank = tiny
    context = FILLER + NEEDLE + FILLER
    out = method(bb, saes=bank).compress(context, QUESTION, budget=60)
    assert 0 < bb.count_tokens(out.text) <= 60 and out.n_tokens == bb.count_tokens(out.text)
    assert [s.start for s in out.spans] == sorted(s.start for s in out.spans)
    for s in out.spans:  # every span is exact source text
        assert context[s.char_start:s.char_end] == s.text and s.signals
    if method is not S3:  # the lexical signal always finds the needle's sentence
        assert "4417" in out.text


def test_hybrid_records_each_signal(tiny):
    bb, bank = tiny
    out = S3Hybrid(bb, saes=bank).compress(FILLER + NEEDLE + FILLER, QUESTION, budget=120)
    signals = {sig for s in out.spans for sig in s.signals}
    assert {"s3", "bm25", "lead", "tail"} <= signals


def test_short_context_is_returned_whole(tiny):
    bb, bank = tiny
    out = S3(bb, saes=bank).compress(NEEDLE, QUESTION, budget=500)
    assert out.text == NEEDLE and out.spans[0].signals == ("all",)


def test_budget_smaller_than_a_sentence_trims_around_the_peak(tiny):
    bb, bank = tiny
    out = BM25(bb, saes=bank).compress(FILLER + NEEDLE + FILLER, QUESTION, budget=4)
    assert bb.count_tokens(out.text) <= 4 and len(out.spans) == 1


def test_remove_document_and_persistence(tiny, tmp_path):
    bb, bank = tiny
    idx = EndoIndex(bb, "s3-hybrid", saes=bank, chunk_size=64)
    idx.add_documents([Document("a", FILLER, {"src": "farm"}), Document("b", NEEDLE + FILLER[:200])])
    before = idx.index.n_postings
    hits = idx.search(QUESTION, k=2)
    assert hits[0].metadata in ({"src": "farm"}, {}) and hits[0].doc_id in ("a", "b")
    idx.save(tmp_path / "ix")
    again = EndoIndex.load(tmp_path / "ix", bb, saes=bank)
    assert [(h.doc_id, h.start, h.end) for h in again.search(QUESTION, k=2)] == \
           [(h.doc_id, h.start, h.end) for h in hits]
    start, end = idx.corpus.doc("b").start, idx.corpus.doc("b").end
    in_b = sum(int(((p >= start) & (p < end)).sum()) for l in bank.layers for p in [idx.index.postings(l)[1]])
    idx.remove_document("b")
    assert idx.index.n_postings == before - in_b and idx.doc_ids == ["a"]
    assert all(h.doc_id == "a" for h in idx.search(QUESTION, k=3))


@pytest.mark.parametrize("handoff, piece_chars", [(None, None), (100, None), (100, 200)])  # 200: many pieces
def test_nan_keys_leave_the_index_as_it_was(tiny, handoff, piece_chars, monkeypatch):
    bb, bank = tiny
    if handoff:
        monkeypatch.setattr("endo_retrieval.index.engine.HANDOFF_TOKENS", handoff)
    if piece_chars:
        monkeypatch.setattr("endo_retrieval.model.tokens.PIECE_CHARS", piece_chars)
    idx = EndoIndex(bb, "s3-hybrid", saes=bank, chunk_size=64)
    idx.add_documents([Document("a", FILLER)])
    before = idx.s3_scores(QUESTION)
    stream, calls = bb.stream, []

    def nan_after_a_while(ids, layers, **kw):  # the document's third chunk comes out NaN
        for chunk in stream(ids, layers, **kw):
            calls.append(1)
            if len(calls) == 3:
                chunk.keys[layers[0]] = torch.full_like(chunk.keys[layers[0]], float("nan"))
            yield chunk

    lines = FILLER.replace(". ", ".\n") * 2  # cut into pieces after its newlines with piece_chars=200
    assert (len(list(bb.encode_pieces(lines))) > 3) == bool(piece_chars)
    monkeypatch.setattr(bb, "stream", nan_after_a_while)
    with pytest.raises(ValueError, match="NaN or inf"):
        idx.add_documents([Document("b", lines)])
    assert len(calls) >= 3 and idx.doc_ids == ["a"]
    assert not [t for t in threading.enumerate() if t.name == "endo-tokenise"]  # the tokenising thread stopped
    np.testing.assert_array_equal(idx.s3_scores(QUESTION)[: len(before)], before)
    assert idx.index.positions_span <= len(before)  # no postings of the failed document remain


def test_bad_input(tiny, tmp_path):
    bb, bank = tiny
    idx = EndoIndex(bb, "s3-hybrid", saes=bank)
    with pytest.raises(ValueError, match="empty"):
        idx.search(QUESTION)
    with pytest.raises(ValueError, match="No documents"):
        idx.add_documents([])
    with pytest.raises(ValueError, match="Duplicate"):
        idx.add_documents([Document("x", FILLER), Document("x", FILLER)])
    with pytest.raises(ValueError, match="empty"):
        idx.add_documents([Document("y", "   ")])
    with pytest.raises(ValueError, match="binary|UTF-8"):
        idx.add_documents([Document("z", "abc\x00\x01def")])
    with pytest.raises(ValueError, match="JSON"):
        idx.add_documents([Document("m", FILLER, {"when": object()})])
    assert len(idx) == 0  # nothing half-added
    with pytest.raises(ValueError, match="budget"):
        S3(bb, saes=bank).compress(FILLER, QUESTION, budget=0)
    with pytest.raises(ValueError, match="Unknown method"):
        EndoIndex(bb, saes=bank, method="dense-ish")
    with pytest.raises(ValueError, match="no endo index"):
        EndoIndex.load(tmp_path, bb, saes=bank)


def test_query_without_active_features_scores_zero(tiny):
    bb, bank = tiny
    idx = EndoIndex(bb, "s3-hybrid", saes=bank, chunk_size=64)
    idx.add_documents([Document("a", FILLER)])
    empty = {l: (np.zeros(0, np.int64), np.zeros(0, np.float32)) for l in bank.layers}
    assert not idx.index.score(empty, n_positions=idx.corpus.n_positions).any()
    # S3 alone then has no peaks: the selection is empty rather than arbitrary
    idx.s3_scores = lambda q: np.zeros(idx.corpus.n_positions, np.float32)
    assert idx.select(QUESTION, 50, method="s3") == []


def test_corrupt_index_is_refused_and_old_one_survives(tiny, tmp_path):
    bb, bank = tiny
    idx = EndoIndex(bb, "s3-hybrid", saes=bank, chunk_size=64)
    idx.add_documents([Document("a", FILLER)])
    idx.save(tmp_path / "ix")
    blob = tmp_path / "ix" / "features" / "feature_index.bin"
    data = bytearray(blob.read_bytes())
    data[-5] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt|checksum|rebuild"):
        EndoIndex.load(tmp_path / "ix", bb, saes=bank)
    idx.save(tmp_path / "ix")  # a good save replaces it atomically
    assert len(EndoIndex.load(tmp_path / "ix", bb, saes=bank)) == 1


def test_a_document_indexed_piece_by_piece_is_indexed_as_in_one_piece(tiny, monkeypatch):
    """The stream pulls the text a batch of pieces at a time, so the accelerator starts early; the chunks, postings and
    corpus map must be those of one pass over the whole document."""
    bb, bank = tiny
    text = (FILLER.replace(". ", ".\n") + NEEDLE) * 3

    def build(piece_chars):
        monkeypatch.setattr("endo_retrieval.model.tokens.PIECE_CHARS", piece_chars)
        monkeypatch.setattr("endo_retrieval.model.tokens.PIECES_PER_BATCH", 2)
        idx = EndoIndex(bb, "s3-hybrid", saes=bank, chunk_size=64)
        idx.add_documents([Document("d", text)])
        return idx

    one, many = build(10**9), build(150)
    assert len(list(bb.encode_pieces(text, 150))) > 10
    for layer in one.index.layers:
        for a, b in zip(one.index.postings(layer), many.index.postings(layer)):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(one.corpus.sentence_starts(), many.corpus.sentence_starts())
    np.testing.assert_array_equal(one.corpus.doc("d").offsets, many.corpus.doc("d").offsets)
    assert [s.text for s in one.search(QUESTION, k=2)] == [s.text for s in many.search(QUESTION, k=2)]


def test_ahead_keeps_order_raises_the_producers_error_and_stops_when_closed():
    from endo_retrieval.index.indexing import ahead

    assert list(ahead(iter(range(50)), depth=3)) == list(range(50))

    def failing():
        yield 1
        raise KeyError("in the thread")

    got = ahead(failing(), depth=2)
    assert next(got) == 1
    with pytest.raises(KeyError, match="in the thread"):
        next(got)
    produced = []

    def endless():
        while True:
            produced.append(1)
            yield len(produced)

    got = ahead(endless(), depth=2)
    assert next(got) == 1
    got.close()
    assert not [t for t in threading.enumerate() if t.name == "endo-tokenise"]
    assert len(produced) <= 4  # the thread ran at most depth + 1 items ahead and stopped


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the device tool)")
def test_index_work_beside_the_forward_gives_the_same_postings(backbone, monkeypatch):
    """On CUDA the SAE encode, sort and copies run on a stream of their own, beside the forward: the postings are
    those of the same build on one stream, to the bit, across several hand-offs and replayed chunks."""
    from endo_retrieval.index import engine

    monkeypatch.setattr(engine, "HANDOFF_TOKENS", 2048)
    text = " ".join(f"Item {i}: {FILLER[(37 * i) % 500:][:120]}" for i in range(400))

    def build() -> EndoIndex:
        idx = EndoIndex(backbone, "s3-hybrid", chunk_size=512)
        idx.add_documents([Document("d", text)])
        return idx

    beside = build()
    assert engine.index_streams(backbone.device)[1] is not None
    monkeypatch.setattr(engine, "index_streams", lambda device: (None, None))
    one_stream = build()
    assert beside.corpus.n_tokens > 5 * 2048 and beside.index.n_postings > 0  # several hand-offs
    for layer in beside.index.layers:
        for a, b in zip(beside.index.postings(layer), one_stream.index.postings(layer)):
            np.testing.assert_array_equal(a, b)
