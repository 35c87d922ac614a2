import re

import numpy as np
import pytest

from endo_retrieval.corpus import CorpusMap, split_sentences
from endo_retrieval.index.inverted import IndexCorruptError


def word_offsets(text: str) -> np.ndarray:
    """A stand-in tokenizer: one token per word, spans include the leading space like BPE tokens do."""
    spans = [(m.start(), m.end()) for m in re.finditer(r"\s*\S+", text)]
    return np.array(spans, dtype=np.int64)


def pieces(text):
    starts = split_sentences(text).tolist()
    return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]


def test_sentence_splitter_keeps_abbreviations_decimals_and_initials():
    text = ('Dr. Smith paid 3.5 dollars, e.g. for tea. Was it good? Yes! "Stop." Then J. R. R. Tolkien left.\n'
            'Next line... and more. End')
    assert pieces(text) == ["Dr. Smith paid 3.5 dollars, e.g. for tea. ", "Was it good? ", "Yes! ", '"Stop." ',
                            "Then J. R. R. Tolkien left.\n", "Next line... and more. ", "End"]
    assert split_sentences("").tolist() == [0]


def make_corpus():
    corpus = CorpusMap()
    texts = {"a": "Alpha one. Alpha two is here.", "b": "Beta sentence.\nSecond beta line", "c": "Gamma."}
    for doc_id, text in texts.items():
        corpus.add_document(doc_id, text, word_offsets(text), {"source": doc_id + ".txt"})
    return corpus, texts


def test_sentences_split_piece_by_piece_are_the_whole_texts():
    from endo_retrieval.model.tokens import Tokens

    rng = np.random.default_rng(0)
    parts = ["Dr. Smith met J. Doe.", "e.g.", "It cost 3.5 dollars!", "...", "\u201cQuoted.\u201d", "(See fig.", "2).",
             "next one?", "\n", "\n\n", "  ", "Mr.", "\nNo. 5 was late.", "A", "b.", "\n...\nOk. ", "cf\n... So."]
    for _ in range(30):
        text = " ".join(rng.choice(parts, 400))
        cuts = Tokens._safe_cuts(text, 97)
        assert cuts  # the text offers cuts
        bounds = [0, *cuts, len(text)]
        pieces = np.concatenate([split_sentences(text, a, b) for a, b in zip(bounds[:-1], bounds[1:])])
        np.testing.assert_array_equal(pieces, split_sentences(text))


def test_positions_are_laid_out_and_located():
    corpus, _ = make_corpus()
    assert [(d.doc_id, d.start, d.end) for d in corpus.documents()] == [("a", 0, 6), ("b", 6, 11), ("c", 11, 12)]
    doc, off = corpus.locate(np.array([0, 5, 6, 10, 11, 12, -1]))
    assert doc.tolist() == [0, 0, 1, 1, 2, -1, -1]
    assert off.tolist() == [0, 5, 0, 4, 0, -1, -1]
    assert corpus.doc("b").metadata == {"source": "b.txt"}


def test_span_text_and_crossing_error():
    corpus, _ = make_corpus()
    assert corpus.span_text(2, 6) == ("a", 10, 29, " Alpha two is here.")
    assert corpus.span_text(6, 8) == ("b", 0, 14, "Beta sentence.")
    with pytest.raises(ValueError, match="one document"):
        corpus.span_text(4, 8)


def test_sentence_bounds_global():
    corpus, _ = make_corpus()
    # a: "Alpha one." | " Alpha two is here."  b: "Beta sentence." | "\nSecond beta line"  c: "Gamma."
    assert corpus.sentence_bounds("a").tolist() == [0, 2]
    assert corpus.sentence_bounds("b").tolist() == [6, 8]
    assert corpus.sentence_starts().tolist() == [0, 2, 6, 8, 11]


def test_remove_keeps_positions_and_never_reuses_range():
    corpus, _ = make_corpus()
    assert corpus.remove_document("b") == (6, 11)
    assert corpus.locate(np.array([7, 11]))[0].tolist() == [-1, 1]
    assert corpus.sentence_starts().tolist() == [0, 2, 11]
    assert corpus.add_document("d", "Delta.", word_offsets("Delta.")) == (12, 13)
    assert corpus.segment_bounds().tolist() == [0, 6, 11, 12, 13]
    with pytest.raises(KeyError):
        corpus.remove_document("b")


def test_bad_documents_are_refused():
    corpus, _ = make_corpus()
    with pytest.raises(ValueError, match="already"):
        corpus.add_document("a", "x", np.array([[0, 1]]))
    with pytest.raises(ValueError, match="no tokens"):
        corpus.add_document("e", "", np.zeros((0, 2)))
    with pytest.raises(ValueError, match="binary"):
        corpus.add_document("f", "ab\x00cd", np.array([[0, 5]]))
    with pytest.raises(ValueError, match="decode"):
        corpus.add_document("g", b"bytes", np.array([[0, 5]]))
    with pytest.raises(ValueError, match="'when'"):
        corpus.add_document("h", "ok", np.array([[0, 2]]), {"when": object()})
    with pytest.raises(ValueError, match="inside the text"):
        corpus.add_document("i", "ok", np.array([[0, 9]]))


def test_save_load_round_trip(tmp_path):
    corpus, _ = make_corpus()
    corpus.remove_document("b")
    path = corpus.save(tmp_path / "corpus.npz")
    loaded = CorpusMap.load(path)
    assert [(d.doc_id, d.start, d.end, d.text, d.metadata) for d in loaded.documents()] == \
           [(d.doc_id, d.start, d.end, d.text, d.metadata) for d in corpus.documents()]
    assert loaded.sentence_starts().tolist() == corpus.sentence_starts().tolist()
    assert loaded.span_text(2, 6) == corpus.span_text(2, 6)
    assert loaded.add_document("z", "Zed.", word_offsets("Zed.")) == (12, 13)  # removed range stays retired


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_corpus_file_is_refused_and_old_file_survives_failed_save(tmp_path, monkeypatch, damage):
    corpus, _ = make_corpus()
    path = corpus.save(tmp_path / "corpus.npz")
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 3] ^= 0xFF  # inside the stored JSON header / arrays
    bad = tmp_path / "bad.npz"
    bad.write_bytes(bytes(data))
    with pytest.raises(IndexCorruptError, match="rebuild"):
        CorpusMap.load(bad)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr("endo_retrieval.corpus.os.replace", crash)
    with pytest.raises(KeyboardInterrupt):
        CorpusMap().save(path)
    monkeypatch.undo()
    assert [d.doc_id for d in CorpusMap.load(path).documents()] == ["a", "b", "c"]
