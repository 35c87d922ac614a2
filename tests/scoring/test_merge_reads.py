"""Several reads of candidate pools merged into one ranking (`fusion.merge_reads`), and the pipeline that reads a
BM25-led pool and the dense ranking's own pool as two contexts (`EndoPipeline.pools`)."""
from __future__ import annotations

import numpy as np
import pytest

from endo_retrieval.scoring.fusion import merge_reads, standardise


def test_each_read_is_standardised_alone_and_a_shared_candidate_gets_the_mean():
    a = (["p1", "p2", "p3"], {"heads": np.array([3.0, 1.0, 2.0]), "hop2": np.array([0.0, 1.0, 2.0])})
    b = (["p3", "p4"], {"heads": np.array([10.0, 30.0])})
    keys, scores = merge_reads([a, b])
    assert keys == ["p1", "p2", "p3", "p4"]  # the first read's order, then the new ones
    assert set(scores) == {"heads"}  # a stage one read lacks is not fused
    za, zb = standardise(a[1]["heads"]), standardise(b[1]["heads"])
    assert scores["heads"] == pytest.approx([za[0], za[1], (za[2] + zb[0]) / 2, zb[1]])
    one_keys, one = merge_reads([a])
    assert one_keys == a[0] and one["hop2"] == pytest.approx(standardise(a[1]["hop2"]))


def test_the_pipeline_reads_both_pools_and_merges_them_as_the_fit_does(backbone):
    from endo_retrieval import EndoIndex
    from endo_retrieval.methods.search import Document
    from endo_retrieval.methods.pipeline import EndoPipeline

    docs = ["The Varna bridge was built in 1871 over the river.",
            "Quartz deposits lie beneath the old crossing's stone piers.",  # no question word: dense finds it
            "The Varna river floods every spring; the bridge closes.",
            "A bridge of Varna has a clock tower cast in Vienna.",
            "Rice is planted on the banks when the floods recede.",
            "Silicon and oxygen make up the mineral quartz."]
    index = EndoIndex(backbone, method="endo", first_stage="hybrid")
    index.add_documents([Document(f"d{i}", t) for i, t in enumerate(docs)])
    corpus, passages = index.corpus, index.passages()
    question = "Which mineral lies under the Varna bridge?"
    weights = {"bm25": 0.2, "dense": 0.5, "heads": 0.3}
    alone = [EndoPipeline(backbone, first_stage=p, pools=(p,), depth=2, dense_share=0.5, weights=weights)
             .stage_scores(corpus, passages, question)[:2] for p in ("hybrid", "dense")]
    both = EndoPipeline(backbone, first_stage="hybrid", pools=("hybrid", "dense"), depth=2, dense_share=0.5,
                        weights=weights)
    top, signals, ms = both.stage_scores(corpus, passages, question)
    keys, merged = merge_reads([(t.tolist(), s) for t, s in alone])
    assert top.tolist() == keys and len(keys) > 2  # the dense pool added a passage the hybrid pool did not hold
    for name in ("bm25", "dense", "heads"):
        assert signals[name] == pytest.approx(merged[name])
    assert ms["heads"] > 0
    hits = both.passage_hits(corpus, passages, question, k=3)
    assert len(hits) == 3 and [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    with pytest.raises(ValueError, match="Unknown first stage"):
        EndoPipeline(backbone, pools=("hybrid", "sparse"))
    assert EndoPipeline(backbone, pools=("hybrid", "dense"), two_hop=True).pools == ("hybrid",)
