"""The faster paths stage 1 takes over a large corpus, each held to the plain definition it replaces:
`fused_top` (each ranking's head and counted ranks) against sorting every ranking whole, `OkapiPostings.build`
from a stream against rank-bm25, `words`' common case against its per-word rule, and the dense stage's cells
against the exact product."""
from __future__ import annotations

import numpy as np
import pytest
from rank_bm25 import BM25Okapi

from endo_retrieval.index import dense, dense_cells
from endo_retrieval.index.dense import Cells, DenseVectors, spherical_kmeans
from endo_retrieval.index import first_stage
from endo_retrieval.index.first_stage import fused_top, fused_top_plain
from endo_retrieval.scoring import bm25 as bm25_module
from endo_retrieval.scoring.bm25 import OkapiPostings, words


def plain(bm25, dense_, share, n, keep=None):
    allowed = np.arange(len(bm25)) if keep is None else np.flatnonzero(keep)
    if share in (0.0, 1.0):
        s = (bm25 if share == 0.0 else dense_)[allowed]
        return allowed[np.argsort(-s, kind="stable")[:n]]
    return allowed[fused_top_plain([bm25[allowed], dense_[allowed]], [1 - share, share], n)]


@pytest.mark.parametrize("seed", range(6))
def test_fused_top_over_a_large_corpus_is_the_plain_fusion(seed, monkeypatch):
    if seed % 3 == 0:  # the rankings' pools and heads side by side, as from PARALLEL_MIN passages
        monkeypatch.setattr(first_stage, "PARALLEL_MIN", 0)
    rng = np.random.default_rng(seed)
    size = int(rng.integers(1500, 5000))  # past the 1024-passage heads, so the counting path runs
    bm25 = np.round(rng.random(size) * 4, 1)  # ties among BM25's scores
    bm25[rng.random(size) < 0.8] = 0.0  # most passages share no word with the question
    dense_ = rng.standard_normal(size)
    if seed % 2:
        dense_[rng.random(size) < 0.9] = -np.inf  # outside the cells searched
    dense_[:50] = dense_[50]  # tied cosines
    keep = rng.random(size) < 0.7
    for share in (0.0, 0.2, 0.5, 0.8, 1.0):
        for n in (1, 12, 20, 300):
            assert fused_top(bm25, dense_, share, n).tolist() == plain(bm25, dense_, share, n).tolist()
        assert fused_top(bm25, dense_, share, 20, keep).tolist() == plain(bm25, dense_, share, 20, keep).tolist()
    assert fused_top(bm25, dense_, 0.5, size).tolist() == plain(bm25, dense_, 0.5, size).tolist()


def test_postings_built_from_a_stream_hold_no_per_document_dicts_and_score_as_rank_bm25():
    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(40)]
    corpus = [list(rng.choice(vocab, size=rng.integers(1, 300))) for _ in range(300)]
    fast, slow = OkapiPostings.build(iter(corpus)), BM25Okapi(corpus)
    assert fast.okapi.doc_freqs == [] and fast.docs.dtype == np.int32 and fast.tf.dtype.itemsize <= 2
    assert fast.okapi.idf == slow.idf and fast.okapi.avgdl == slow.avgdl
    np.testing.assert_array_equal(fast.get_scores(vocab[:7] + ["w3"]), slow.get_scores(vocab[:7] + ["w3"]))
    saved = OkapiPostings.from_arrays(fast.arrays())  # what an index saves and reads back scores the same
    assert saved.okapi.idf == slow.idf and saved.stem == fast.stem
    np.testing.assert_array_equal(saved.get_scores(vocab[:7] + ["w3"]), slow.get_scores(vocab[:7] + ["w3"]))


def test_merged_postings_are_a_fresh_build_of_the_kept_and_new_documents():
    rng = np.random.default_rng(2)
    vocab = [f"w{i}" for i in range(60)]
    docs = lambda n: [list(rng.choice(vocab, size=rng.integers(1, 80))) for _ in range(n)]  # noqa: E731
    before, added = docs(150) + [["only", "w1"]], docs(50)  # "only": a term one old document holds
    old, new = OkapiPostings.build(iter(before)), OkapiPostings.build(iter(added))
    query = vocab[:12] + ["only"]
    appended, fresh = old.merged(np.ones(151, bool), new), OkapiPostings.build(iter(before + added))
    assert appended.okapi.idf == fresh.okapi.idf  # adds only: bit for bit, the terms in first-seen order
    np.testing.assert_array_equal(appended.get_scores(query), fresh.get_scores(query))
    keep = rng.random(151) > 0.3
    keep[-1] = False  # the only document holding "only" goes, and the term with it
    kept = [d for d, k in zip(before, keep) if k]
    merged = old.merged(keep, new)
    assert "only" not in merged.terms and set(merged.terms) == set(BM25Okapi(kept + added).idf)
    np.testing.assert_allclose(merged.get_scores(query), BM25Okapi(kept + added).get_scores(query), rtol=1e-12)
    np.testing.assert_allclose(old.merged(keep).get_scores(query), BM25Okapi(kept).get_scores(query), rtol=1e-12)


def postings_by_term(model: OkapiPostings) -> dict[str, tuple[list, list]]:
    return {t: (model.docs[model.indptr[r]: model.indptr[r + 1]].tolist(),
                model.tf[model.indptr[r]: model.indptr[r + 1]].tolist()) for t, r in model.terms.items()}


@pytest.mark.parametrize("seed", range(5))
def test_merged_postings_hold_each_terms_postings_as_a_fresh_build_does(seed):
    """Postings kept, renumbered and joined with the added ones row by row (no sort): each term's documents and
    counts are a fresh build's, with removes and adds, new terms, terms only removed documents held, counts past a
    byte in the added documents, and no change at all."""
    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(int(rng.integers(5, 200)))]
    docs = lambda n: [list(rng.choice(vocab, size=rng.integers(1, 60))) for _ in range(n)]  # noqa: E731
    before = docs(int(rng.integers(1, 120)))
    added = docs(int(rng.integers(0, 30))) + [["brand", "new"] + ["w0"] * 300]
    keep = rng.random(len(before)) > rng.random()
    old = OkapiPostings.build(iter(before))
    for new, docs_after in ((OkapiPostings.build(iter(added)), added), (None, [])):
        merged = old.merged(keep, new)
        fresh = OkapiPostings.build(iter([d for d, k in zip(before, keep) if k] + docs_after))
        assert postings_by_term(merged) == postings_by_term(fresh)
        assert merged.okapi.idf == pytest.approx(fresh.okapi.idf, rel=1e-12)
    assert postings_by_term(old.merged(np.ones(len(before), bool))) == postings_by_term(old)


@pytest.mark.parametrize("text", ["The Zephyr bridge, 1990s: e.g. what's new?", "北京 is in 中国 and Tokyo",
                                  "ＡＢＣ café naïve", ""])
def test_words_common_case_is_the_per_word_rule(text, monkeypatch):
    fast = words(text)
    monkeypatch.setattr(bm25_module, "_NO_SPACES", _AlwaysSearch(bm25_module._NO_SPACES))
    assert words(text) == fast


class _AlwaysSearch:
    """The no-spaces pattern, except that the whole-text check always finds something: every word takes the
    per-word rule."""

    def __init__(self, pattern):
        self.pattern, self.first = pattern, True

    def search(self, s):
        if self.first:
            self.first = False
            return True
        return self.pattern.search(s)

    def __getattr__(self, name):
        return getattr(self.pattern, name)


def unit(rng, n, dim=32):
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_cells_score_the_probed_passages_exactly_and_all_cells_are_the_exact_product():
    rng = np.random.default_rng(0)
    matrix, query = unit(rng, 3000), unit(rng, 1)[0]
    centroids = spherical_kmeans(matrix, 40)
    cells = Cells(centroids, dense.nearest_cells(matrix, centroids))
    some = cells.scores(matrix, query, probe=4)
    found = np.isfinite(some)
    assert 0 < found.sum() < len(matrix)
    np.testing.assert_allclose(some[found], (matrix @ query)[found], atol=1e-6)  # BLAS blocks rows its own way
    np.testing.assert_allclose(cells.scores(matrix, query, probe=40), matrix @ query, atol=1e-6)


def test_cells_are_trained_at_save_follow_adds_and_removes_and_load_back(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    monkeypatch.setattr(dense, "ANN_MIN", 500)
    vectors = DenseVectors()
    vectors.rows = {f"d{i}": unit(rng, 3) for i in range(200)}  # 600 passages
    ids = list(vectors.rows)
    vectors.save(tmp_path, ids)
    assert vectors.centroids is not None and len(vectors.centroids) == int(np.sqrt(600))
    monkeypatch.setattr(dense, "embed", lambda name, texts, device, progress=False: unit(rng, len(texts)))
    vectors.add(["new"], [["a", "b"]])
    assert len(vectors.cells["new"]) == 2
    vectors.remove("d0")
    assert "d0" not in vectors.cells
    loaded = DenseVectors.read(lambda name: open(tmp_path / name, "rb"), tmp_path)
    np.testing.assert_array_equal(loaded.centroids, vectors.centroids)
    assert all(np.array_equal(loaded.cells[d], vectors.cells[d]) for d in ids[1:])
    whole = loaded.matrix(ids)
    lists = loaded.cells_for(ids, whole)
    query = unit(rng, 1)[0]
    scores = lists.scores(whole, query)
    np.testing.assert_allclose(scores[np.isfinite(scores)], (whole @ query)[np.isfinite(scores)], atol=1e-6)


@pytest.mark.parametrize("parallel_rows", [1, dense_cells.PARALLEL_ROWS])
def test_saved_cells_read_each_probed_cell_in_place_and_score_as_the_gathered_rows(tmp_path, monkeypatch,
                                                                                  parallel_rows):
    """The saved rows in cell order (dense_by_cell.npy): a probed cell is one slice of it. Opened as saved, and
    opened after documents were removed and added (the saved rows less the removed, then the added ones), the scores
    are the gathered rows' (`Cells` without the copy) over the same matrix, -inf where they are; the probed cells
    scored in one part a core (parallel_rows 1) or in one."""
    rng = np.random.default_rng(2)
    monkeypatch.setattr(dense, "ANN_MIN", 500)
    monkeypatch.setattr(dense_cells, "PARALLEL_ROWS", parallel_rows)
    monkeypatch.setattr(dense, "embed", lambda name, texts, device, progress=False: unit(rng, len(texts)))
    vectors = DenseVectors()
    vectors.rows = {f"d{i}": unit(rng, 3) for i in range(300)}
    ids = list(vectors.rows)
    (tmp_path / "g1").mkdir(), (tmp_path / "g2").mkdir()
    vectors.save(tmp_path / "g1", ids)
    opened = lambda g: DenseVectors.read(lambda name: open(tmp_path / g / name, "rb"), tmp_path / g)

    def same_as_gathered(loaded, doc_ids, kind):
        matrix = loaded.matrix(tuple(dense.encoded_ids(doc_ids)))
        cells = loaded.cells_for(doc_ids, matrix)
        assert type(cells).__name__ == kind
        gathered = Cells(loaded.centroids, np.concatenate([loaded.cells[d] for d in doc_ids]))
        for query in unit(rng, 5):
            got, want = cells.scores(matrix, query, probe=3), gathered.scores(np.asarray(matrix), query, probe=3)
            assert 0 < np.isfinite(got).sum() < len(got)
            np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
            np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], atol=1e-6)

    loaded = opened("g1")
    assert loaded.by_cell is not None and len(loaded.by_cell) == 900
    same_as_gathered(loaded, ids, "SavedCells")
    loaded.remove("d7")
    loaded.add(["new", "d9"], [["a", "b"], ["c"]])  # a new document, and one saved before, replaced
    now = [d for d in ids if d not in ("d7", "d9")] + ["new", "d9"]
    loaded.save(tmp_path / "g2", now, previous=tmp_path / "g1")  # a delta: the base files are linked
    assert (tmp_path / "g2" / dense.BY_CELL_FILE).samefile(tmp_path / "g1" / dense.BY_CELL_FILE)
    same_as_gathered(opened("g2"), now, "SavedCells")
