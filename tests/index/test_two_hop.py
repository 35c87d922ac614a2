"""`endo-2hop`: the bridge taken from the heads' attention (no model: token scores given by hand), and a second hop
that retrieves a passage sharing no word with the question, which `endo` at the same depth cannot reach."""
from __future__ import annotations

import numpy as np
import pytest

from endo_retrieval.methods.heads import bridge_terms

QUESTION = "In which town was the founder of Tallow & Wick born?"
# A names the founder; B says where he grew up and shares no word with the question; the rest share its words
TWO_HOP = {
    "a": "Tallow & Wick is a candle maker. The company was founded in 1890 by Jonas Eberle, who ran its workshop "
         "for forty years.",
    "b": "Jonas Eberle grew up in Kelmscott Bay, the youngest of four children of a fisherman.",
    "c": "Tallow is rendered animal fat. Candle makers once bought tallow from butchers in every town.",
    "d": "A wick is a cord of braided cotton. The town of Farrow Cross held a candle fair every winter.",
    "e": "The founder of Ivory Row was born in Linden Vale and sold pianos to the town's schools.",
    "f": "Saltmarsh is a town on the coast. Many of its people were born at sea and worked as sailors.",
    "g": "Greywater was founded as a mill town; its founder built a bridge over the river.",
}


def tokens(pieces: list[str]) -> tuple[str, np.ndarray]:
    """The text the pieces make and each piece's character offsets."""
    text, offsets = "", []
    for p in pieces:
        offsets.append((len(text), len(text) + len(p)))
        text += p
    return text, np.asarray(offsets)


def scored(pieces: list[str], scores: dict[str, float]) -> tuple[str, np.ndarray, np.ndarray]:
    text, offsets = tokens(pieces)
    return text, offsets, np.array([scores.get(p, 0.0) for p in pieces])


def test_a_token_grows_into_its_word_and_capitalised_neighbours_into_a_name():
    text, offsets, s = scored(["It", " was", " run", " by", " Jon", "as", " E", "ber", "le", " in", " Ulm", "."],
                              {"ber": 0.9, " run": 0.2})
    # one token of "Eberle" scores the whole name; stop words ("It", "was", "by", "in") are never terms
    assert bridge_terms(text, offsets, s, "Who ran it?", n=3) == [("Jonas Eberle", 0.9), ("run", 0.2), ("Ulm", 0.0)]


def test_question_words_stop_words_and_their_forms_are_not_a_bridge():
    text, offsets, s = scored(["The", " founder", " founded", " the", " town", "'s", " mill", " with", " 1890",
                               " Tallow", " Marta", " Gross"],
                              {"The": 5.0, " founder": 4.0, " founded": 3.0, " the": 3.0, " town": 3.0, "'s": 3.0,
                               " with": 3.0, " 1890": 3.0, " Tallow": 3.0, " Marta": 1.0, " mill": 0.5})
    terms = bridge_terms(text, offsets, s, "Which town's founder ran Tallow?", n=5)
    words = [t for t, _ in terms]
    assert words[:2] == ["Marta Gross", "mill"]  # "Tallow" (asked) breaks no name it is not in
    for skipped in ("The", "founder", "founded", "town's", "with", "1890", "Tallow"):
        assert skipped not in words


def test_a_question_word_or_punctuation_splits_a_run_of_capitalised_words():
    text, offsets, s = scored(["Jonas", " Tallow", " Eberle", ",", " Kurt"],
                              {"Jonas": 0.7, " Tallow": 1.0, " Eberle": 0.6, " Kurt": 0.5})
    assert bridge_terms(text, offsets, s, "Tallow?", n=3) == [("Jonas", 0.7), ("Eberle", 0.6), ("Kurt", 0.5)]


def test_tokens_outside_the_passages_give_nothing_and_terms_are_distinct():
    text, offsets, s = scored(["Anna", " Berg", " met", " Anna", " Berg", " and", " Carl"],
                              {"Anna": 0.3, " Berg": 0.4, " met": 0.1, " Carl": 2.0})
    s[-1] = -np.inf  # "Carl" lies outside the passages a bridge is taken from
    assert bridge_terms(text, offsets, s, "Who?", n=4) == [("Anna Berg", 0.4), ("met", 0.1)]


# ---------------------------------------------------------------- the real model


def two_hop_corpus(backbone):
    from endo_retrieval.corpus import CorpusMap
    from endo_retrieval.index.passages import Passages

    corpus = CorpusMap()
    for doc_id, text in TWO_HOP.items():
        corpus.add_document(doc_id, text, backbone.encode(text).offsets)
    return corpus, Passages.build(corpus)


@pytest.mark.slow
def test_the_second_hop_retrieves_what_bm25_and_endo_at_the_same_depth_cannot(backbone):
    from endo_retrieval.methods.pipeline import EndoPipeline
    from endo_retrieval.scoring.bm25 import words

    corpus, passages = two_hop_corpus(backbone)
    b = list(TWO_HOP).index("b")
    assert passages.bm25.get_scores(words(QUESTION))[b] == 0  # B shares no word with the question
    endo = EndoPipeline(backbone, depth=2).passage_hits(corpus, passages, QUESTION, k=4)
    assert "b" not in {h.doc_id for h in endo}
    hits = EndoPipeline(backbone, depth=2, two_hop=True).passage_hits(corpus, passages, QUESTION, k=4)
    found = {h.doc_id: h for h in hits}
    assert "b" in found and found["b"].stage_scores["hop"] == 2
    assert "Jonas Eberle" in found["b"].stage_scores["bridge"]
    assert all(found[h.doc_id].stage_scores["hop"] == 1 for h in endo)  # the first hop's candidates stay hop 1
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert found["b"].stage_ms["hop2_read"] > 0


@pytest.mark.slow
def test_endo_ranks_as_the_first_read_alone_and_endo_2hop_keeps_its_first_hop_scores(backbone):
    """`endo` is the first read, fused and sorted, bit for bit (computed here from its parts as before the second
    hop existed); `endo-2hop` adds passages, never changes a first-hop passage's scores."""
    from endo_retrieval.methods.pipeline import EndoPipeline
    from endo_retrieval.methods.heads import passage_signals
    from endo_retrieval.scoring.fusion import fuse

    corpus, passages = two_hop_corpus(backbone)
    pipe = EndoPipeline(backbone, depth=4)
    top, first = pipe.candidates(corpus, passages, QUESTION)  # stage 1's scores of its candidates
    texts = pipe.read_texts(corpus, passages, top, QUESTION)
    order = np.arange(len(top))[::-1] if pipe.best_last else np.arange(len(top))
    read = passage_signals(backbone, [texts[i] for i in order], QUESTION, pipe.heads,
                           second_hop=bool(pipe.weights.get("hop2")), first_stage=-order.astype(np.float64))
    signals = dict(first) | {name: s[np.argsort(order)] for name, s in read.items()}
    fused = fuse(signals, pipe.weights)
    rank = np.lexsort((np.arange(len(top)), -fused))
    hits = pipe.passage_hits(corpus, passages, QUESTION, k=4)
    assert [h.start for h in hits] == passages.starts[top[rank]].tolist()
    assert [h.score for h in hits] == fused[rank].tolist()  # exactly, not approximately
    assert all("hop" not in h.stage_scores and "bridge" not in h.stage_ms for h in hits)
    two = {h.doc_id: h for h in EndoPipeline(backbone, depth=4, two_hop=True).passage_hits(corpus, passages, QUESTION,
                                                                                      k=len(TWO_HOP))}
    for h in hits:
        assert two[h.doc_id].score == h.score and two[h.doc_id].stage_scores["hop"] == 1
        assert {k: v for k, v in two[h.doc_id].stage_scores.items() if k != "hop"} == h.stage_scores


@pytest.mark.slow
def test_an_index_searches_with_endo_2hop_and_saves_as_before(backbone, tmp_path):
    from endo_retrieval import EndoIndex
    from endo_retrieval.index.engine import Document

    index = EndoIndex(backbone, "endo-2hop")
    index.add_documents([Document(k, v, {"kind": k}) for k, v in TWO_HOP.items()])
    assert index.methods == ("endo", "endo-2hop", "bm25")
    loaded = EndoIndex.load(index.save(tmp_path / "ix"), backbone)
    assert loaded.method == "endo-2hop"
    hits = loaded.search(QUESTION, k=3, where=lambda m: m["kind"] != "a")
    assert hits and all(h.doc_id != "a" and h.stage_scores["hop"] in (1, 2) for h in hits)
    assert [h.doc_id for h in loaded.search(QUESTION, k=3, method="endo")] == \
        [h.doc_id for h in index.search(QUESTION, k=3, method="endo")]
    with pytest.raises(ValueError, match="endo-2hop pipeline ranks passages: use search"):
        index.select(QUESTION, 64, "endo-2hop")


def test_one_context_refuses_the_corpus_only_method_and_names_what_to_use():
    from endo_retrieval import compress

    with pytest.raises(ValueError, match="'endo-2hop' ranks a corpus.*use 'endo'"):
        compress("The bridge crosses the river.", "What crosses the river?", method="endo-2hop")


@pytest.mark.slow
def test_endo_2hop_with_batched_reads_ranks_as_its_plain_twin_in_fewer_forwards(backbone):
    """Both reads of `endo-2hop` (the first hop's and the second hop's), their query parts read together against
    one forward per part: the same passages in the same order, the same bridge, scores to float tolerance; 4
    forwards where the plain reads take 10."""
    from endo_retrieval.methods.pipeline import EndoPipeline

    corpus, passages = two_hop_corpus(backbone)
    count = [0]
    handle = backbone.model.model.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    hits, forwards = {}, {}
    try:
        for batched in (False, True):
            count[0] = 0
            # a fusion that weighs the first hop's second hop (the GPU's; a CPU's own leaves it out)
            hits[batched] = EndoPipeline(backbone, depth=2, two_hop=True, batched_reads=batched,
                                         weights={"bm25": 0.4, "heads": 0.3, "hop2": 0.3}).passage_hits(
                corpus, passages, QUESTION, k=len(TWO_HOP))
            forwards[batched] = count[0]
    finally:
        handle.remove()
    assert forwards == {False: 10, True: 4}
    assert [h.doc_id for h in hits[True]] == [h.doc_id for h in hits[False]]
    for mine, theirs in zip(hits[True], hits[False]):
        assert mine.score == pytest.approx(theirs.score, rel=1e-5, abs=1e-6)
        assert mine.stage_scores.get("bridge") == theirs.stage_scores.get("bridge")
