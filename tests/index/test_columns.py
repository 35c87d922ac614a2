"""An index that is arrays: the corpus map, the passages and the embeddings' rows are array files, mapped when
opened (no object per document), and a save after an update hard-links the large files of the last generation and
writes only what changed, until the changes pass COMPACT_SHARE and a save writes the base anew."""
from __future__ import annotations

import os

import numpy as np
import pytest

from endo_retrieval.array_file import ArrayFile, write_arrays
from endo_retrieval.corpus import CorpusMap
from endo_retrieval.corpus_columns import Columns, id_hashes
from endo_retrieval.files import IndexCorruptError
from endo_retrieval.methods.search import Document, EndoIndex

from test_dense import build, stage1

BASE_FILES = ("corpus.arrays", "dense.npy", "dense_rows.arrays")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_tiny_model

    from endo_retrieval import Backbone
    return Backbone(make_tiny_model("llama", tmp_path_factory.mktemp("columns")), device="cpu")


def inodes(folder) -> dict[str, int]:
    return {name: os.stat(folder / name).st_ino for name in BASE_FILES}


def test_opening_maps_the_columns_and_makes_no_document_object(tiny, tmp_path):
    build(tiny).save(tmp_path / "idx")
    index = EndoIndex.load(tmp_path / "idx", backbone=tiny)
    runs = index.corpus._runs
    assert len(runs) == 1 and all(isinstance(runs[0].a[c], np.memmap) for c in ("text", "offsets", "ids"))
    assert not index.passages().bm25.docs.flags.owndata and not index.corpus._views  # a view of the map
    assert index.corpus.doc("bridge").text.startswith("The Zephyr bridge") and index.corpus._views


def test_an_update_links_the_base_files_and_a_large_one_writes_them_anew(tiny, tmp_path, monkeypatch):
    build(tiny).save(tmp_path / "idx")
    first = inodes(tmp_path / "idx")
    index = EndoIndex.load(tmp_path / "idx", backbone=tiny)
    monkeypatch.setattr("endo_retrieval.corpus.COMPACT_SHARE", 0.5)
    monkeypatch.setattr("endo_retrieval.index.dense.COMPACT_SHARE", 0.5)
    index.remove_document("bank")
    index.add_documents([Document("kitten", "A young kitten dozed beside the warm stove.")])
    index.save(tmp_path / "idx")
    assert inodes(tmp_path / "idx") == first  # two changes of four documents: linked, the delta written
    again = EndoIndex.load(tmp_path / "idx", backbone=tiny)
    assert again.doc_ids == index.doc_ids == ["cat", "bridge", "ship", "kitten"]
    assert len(again.corpus._runs) == 2 and not again.corpus._live[2]  # the base, the delta; "bank" removed
    for question in ("Where did a cat nap?", "quartz under the river bridge", "a kitten by the stove"):
        assert stage1(again, question, "hybrid")[0] == stage1(index, question, "hybrid")[0]
    again.remove_document("cat")  # four changes of four: past the share, a new base
    again.save(tmp_path / "idx")
    third = inodes(tmp_path / "idx")
    assert all(third[n] != first[n] for n in BASE_FILES)
    final = EndoIndex.load(tmp_path / "idx", backbone=tiny)
    assert final.doc_ids == ["bridge", "ship", "kitten"] and len(final.corpus._runs) == 1
    assert stage1(final, "a kitten by the stove", "hybrid")[0] == stage1(again, "a kitten by the stove", "hybrid")[0]
    again.remove_document("ship")  # the process that wrote the new base reads it from its next change on
    again.save(tmp_path / "idx")
    assert inodes(tmp_path / "idx") == third


def test_ids_are_found_by_their_hash_whatever_their_bytes():
    ids = ["a", "b", "ab", "ba", "é", "e\u0301", "日本", "x" * 300, "doc-1", "doc-10", "doc-100"]
    corpus = CorpusMap()
    for i, doc_id in enumerate(ids):
        corpus.add_document(doc_id, f"Text {i}.", np.array([[0, 4], [4, 7]]))
    corpus.remove_document("ba")
    assert corpus.doc_ids() == [d for d in ids if d != "ba"]
    assert all(corpus.doc(d).text.startswith("Text") for d in ids if d != "ba")
    assert "ba" not in corpus and "c" not in corpus and "abc" not in corpus
    raw = np.frombuffer(b"".join(d.encode() for d in ids), np.uint8)
    at = np.concatenate(([0], np.cumsum([len(d.encode()) for d in ids])))
    assert len(set(id_hashes(raw, at).tolist())) == len(ids)


def test_a_column_that_does_not_fit_the_others_is_refused(tmp_path):
    corpus = CorpusMap()
    corpus.add_document("a", "One. Two.", np.array([[0, 4], [4, 9]]))
    path = corpus.save(tmp_path / "c.arrays")
    with open(path, "rb") as f:
        arrays = {k: np.array(v) for k, v in ArrayFile.read(f, path, "corpus-map").arrays.items()}
    for name, bad in [("ends", arrays["ends"] + 5), ("offsets", arrays["offsets"] * 9),
                      ("id_hash", arrays["id_hash"] + np.uint64(1)), ("sent_at", arrays["sent_at"][::-1].copy())]:
        write_arrays(tmp_path / "bad.arrays", "corpus-map", {**arrays, name: bad}, {"next": corpus.n_positions})
        with pytest.raises(IndexCorruptError, match="damaged or inconsistent.*rebuild"):
            CorpusMap.load(tmp_path / "bad.arrays")
    assert Columns(arrays).doc_id(0) == "a"
