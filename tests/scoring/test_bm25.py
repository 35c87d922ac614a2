"""OkapiPostings gives rank-bm25's own Okapi scores."""
import numpy as np
from rank_bm25 import BM25Okapi

from endo_retrieval.scoring.bm25 import OkapiPostings


def test_scores_equal_rank_bm25():
    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(60)]
    corpus = [list(rng.choice(vocab, size=rng.integers(1, 30), p=np.linspace(2, 0.1, 60) / np.linspace(2, 0.1, 60)
                              .sum())) + ["w0"] * int(rng.random() < 0.8) for _ in range(200)]
    fast, slow = OkapiPostings.build(corpus), BM25Okapi(corpus)
    assert min(slow.idf.values()) == slow.epsilon * slow.average_idf  # the epsilon floor is exercised
    for query in (["w0", "w3", "w3", "w59"], ["nowhere"], [], vocab[:10]):
        np.testing.assert_allclose(fast.get_scores(query), slow.get_scores(query), rtol=1e-12, atol=1e-12)


def test_hand_computed():
    fast = OkapiPostings.build([["cat", "sat"], ["dog"], ["cat", "cat", "dog", "ran"]])
    idf_cat = np.log(3 - 2 + 0.5) - np.log(2 + 0.5)  # in 2 of 3 documents: negative, floored to eps * mean idf
    assert idf_cat < 0
    avgdl = 7 / 3
    eps = 0.25 * np.mean([idf_cat, np.log(2.5) - np.log(1.5), idf_cat, np.log(2.5) - np.log(1.5)])
    expected = [eps * 1 * 2.5 / (1 + 1.5 * (0.25 + 0.75 * 2 / avgdl)), 0.0,
                eps * 2 * 2.5 / (2 + 1.5 * (0.25 + 0.75 * 4 / avgdl))]
    np.testing.assert_allclose(fast.get_scores(["cat"]), expected, rtol=1e-12)


def test_stemmed_terms_meet_inflections():
    docs = [["universities", "europe"], ["dog", "runs"], ["北京", "1990s"]]
    plain, stemmed = OkapiPostings.build(docs), OkapiPostings.build(docs, stem=True)
    assert plain.get_scores(["university"])[0] == 0 and stemmed.get_scores(["university"])[0] > 0
    assert stemmed.get_scores(["running"])[1] > 0 and stemmed.get_scores(["北京"])[2] > 0  # other scripts as they are
    assert stemmed.term("universities") == stemmed.term("university") and plain.term("runs") == "runs"
    # a stemmed index scores as rank-bm25 over the stems themselves
    stems = [["univers", "europ"], ["dog", "run"], ["北京", "1990s"]]
    np.testing.assert_allclose(stemmed.get_scores(["universities", "dogs"]),
                               BM25Okapi(stems).get_scores(["univers", "dog"]), rtol=1e-12)
