"""Query-focused retrieval heads and the fused `endo` ranking: shapes and the content-free subtraction on a tiny
random model, the fusion weights' fit on toy sets whose answer is known by hand, calibration end to end, and on
the real model a short haystack whose gold sentence the heads must rank first."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from endo_retrieval.scoring.fusion import fuse, rrf, standardise
from endo_retrieval.methods.endo import Endo, fit_weights, recall_in_budget, simplex
from endo_retrieval.methods.heads import (NULL_QUESTION, HeadsError, RetrievalHeads, calibrated_attention,
                                          calibrated_scores, head_attention, prepare_context, rank_passages, read,
                                          segment_cuts, sentence_max)

HAYSTACK = ("Marie Curie was born in Warsaw in 1867. She moved to Paris to study physics. "
            "The Eiffel Tower was finished in 1889. Many tourists visit it every year. "
            "Curie discovered polonium and radium with her husband Pierre. Bread is baked from flour and water. "
            "The river Seine flows through Paris. Copper conducts electricity well.")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_tiny_model

    from endo_retrieval import Backbone

    return Backbone(make_tiny_model("llama", tmp_path_factory.mktemp("heads")), device="cpu")


def tiny_heads(bb):
    return [(1, 0), (2, 3), (3, 1)]


# ---------------------------------------------------------------- reading and scoring, tiny model


def test_segments_are_each_a_distribution_over_their_tokens(tiny):
    prepared = prepare_context(tiny, HAYSTACK, [1, 2, 3], segment=24)
    n = prepared.corpus.n_positions
    cuts = [s.start for s in prepared.reading.segments] + [n]
    assert len(prepared.reading.segments) > 1 and cuts[0] == 0
    assert set(cuts[1:-1]) <= set(prepared.sentence_starts.tolist())  # cut at sentence starts
    from endo_retrieval.methods.heads import query_part
    from endo_retrieval.model.reading import ask

    ids, rows = query_part(tiny, "Where was Curie born?")
    attention = head_attention(prepared.reading, ask(tiny, prepared.reading, ids, [1, 2, 3]), tiny_heads(tiny), rows)
    assert attention.shape == (3, n)
    for a, b in zip(cuts[:-1], cuts[1:]):
        torch.testing.assert_close(attention[:, a:b].sum(1), torch.ones(3))


def test_one_segment_matches_the_whole_forward_and_the_cache_is_restored(tiny):
    """The queries read after the cached context equal those of one forward over context + query part, and
    asking leaves the cache as it was (a second ask gives the same)."""
    from endo_retrieval.methods.heads import query_part
    from endo_retrieval.model.reading import ask

    enc = tiny.encode(HAYSTACK)
    reading = read(tiny, enc.ids, [2])
    ids, _ = query_part(tiny, "Where was Curie born?")
    first, again = ask(tiny, reading, ids, [2])[0][2], ask(tiny, reading, ids, [2])[0][2]
    torch.testing.assert_close(first, again)
    whole = np.concatenate([enc.ids, ids])
    (chunk,) = list(tiny.stream(whole, [2], chunk_size=len(whole), capture=("q",)))
    expected = tiny.apply_rope(chunk.queries[2][:, len(enc):], torch.arange(len(enc), len(whole)))
    torch.testing.assert_close(first, expected, atol=1e-4, rtol=1e-4)


def test_the_content_free_question_scores_zero(tiny):
    prepared = prepare_context(tiny, HAYSTACK, [1, 2, 3])
    calibrated, _ = calibrated_attention(tiny, prepared, tiny_heads(tiny), NULL_QUESTION)
    assert np.abs(calibrated).max() < 1e-6
    real, _ = calibrated_attention(tiny, prepared, tiny_heads(tiny), "Who discovered radium?")
    assert np.abs(real).max() > 1e-4
    assert calibrated_scores(tiny, prepared, tiny_heads(tiny), "Who discovered radium?").shape == \
        (len(prepared.sentence_starts),)


def test_batched_passage_reads_score_as_the_plain_reads_in_two_forwards_not_five(tiny):
    """The question and the content-free question in the read's own forward, the second hop's two in one more:
    the plain twin's signals (one forward per query part) to float tolerance, its token scores too. int8 reads
    stay one part per forward, bit for bit the plain path."""
    from endo_retrieval.methods.heads import read_passages

    passages = HAYSTACK.split(". ")
    count = [0]
    handle = tiny.model.model.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    got = {}
    try:
        for batched, int8 in ((False, False), (True, False), (False, True), (True, True)):
            count[0] = 0
            got[batched, int8] = read_passages(tiny, passages, "Who discovered radium?", tiny_heads(tiny),
                                               second_hop=True, int8=int8, batched=batched)
            got[batched, int8].forwards = count[0]
    finally:
        handle.remove()
    plain, batched = got[False, False], got[True, False]
    assert (plain.forwards, batched.forwards) == (5, 2)
    for name in ("heads", "hop2"):
        np.testing.assert_allclose(batched.signals[name], plain.signals[name], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(batched.token_scores, plain.token_scores, rtol=1e-5, atol=1e-7)
    assert set(batched.ms) == set(plain.ms) == {"read", "question", "hop2"}
    assert got[True, True].forwards == got[False, True].forwards == 5
    for name in ("heads", "hop2"):
        np.testing.assert_array_equal(got[True, True].signals[name], got[False, True].signals[name])


def test_sentence_max_and_segment_cuts():
    scores = np.array([[0.1, 0.5, 0.2, 0.0, 0.3]])
    np.testing.assert_array_equal(sentence_max(scores, np.array([0, 2, 3])), [[0.5, 0.2, 0.3]])
    assert segment_cuts(np.array([0, 5, 9, 14]), 20, 10) == [0, 9, 14, 20]
    assert segment_cuts(np.array([0]), 25, 10) == [0, 10, 20, 25]  # one long sentence is cut inside


def test_streamed_reading_gives_one_distribution(tiny):
    prepared = prepare_context(tiny, HAYSTACK * 3, [2, 3], stream=True, chunk_size=32, window=16)
    assert prepared.reading.streamed
    scores = calibrated_scores(tiny, prepared, [(2, 0), (3, 2)], "Who discovered radium?")
    assert scores.shape == (len(prepared.sentence_starts),) and np.isfinite(scores).all()


def test_methods_fit_the_budget_and_name_their_signals(tiny):
    heads = RetrievalHeads(backbone=tiny, heads=tiny_heads(tiny))
    out = heads.compress(HAYSTACK, "Who discovered radium?", budget=20)
    assert 0 < out.n_tokens <= 20 and out.method == "heads"
    fused = Endo(backbone=tiny, heads=tiny_heads(tiny), weights={"bm25": 0.5, "heads": 0.3, "hop2": 0.2})
    out = fused.compress(HAYSTACK, "Who discovered radium?", budget=30)
    assert 0 < out.n_tokens <= 30 and all(s.signals for s in out.spans)
    assert {sig for s in out.spans for sig in s.signals} <= {"bm25", "heads", "hop2", "endo"}
    assert rank_passages(tiny, HAYSTACK.split(". "), "Who discovered radium?", tiny_heads(tiny)).shape == (8,)


def test_endo_builds_its_sentence_bm25_while_preparing(tiny):
    """BM25 over the context's sentences needs no question: `endo` builds it in prepare() (on a GPU, while the
    read's kernels run), only when BM25 has weight, and select() then uses that one."""
    fused = Endo(backbone=tiny, heads=tiny_heads(tiny), weights={"bm25": 0.5, "heads": 0.5})
    prepared = fused.prepare(HAYSTACK)
    assert "bm25" in prepared.__dict__  # the cached property, built
    built = prepared.bm25
    fused.select(prepared, "Who discovered radium?", 30)
    assert prepared.bm25 is built
    heads_only = Endo(backbone=tiny, heads=tiny_heads(tiny), weights={"heads": 1.0}).prepare(HAYSTACK)
    assert "bm25" not in heads_only.__dict__


def test_the_fusions_ilre_signal_is_ilres_attention_per_segment(tiny):
    """[ILRe Eq. 4-5] at l_R, per segment: the max over heads and question positions of the softmax over the
    segment's keys (GQA: query head h reads kv head h // group), then each sentence's max; held against a plain
    one-line computation."""
    from endo_retrieval.methods.endo import signals

    prepared = prepare_context(tiny, HAYSTACK, [1, 2, 3], segment=24)
    got = signals(tiny, prepared, "Who discovered radium?", tiny_heads(tiny), ilre_layer=2, second_hop=False)
    _, queries = calibrated_attention(tiny, prepared, tiny_heads(tiny), "Who discovered radium?", layers=[2])
    plain = []
    for segment, q in zip(prepared.reading.segments, queries):
        keys = segment.keys[2].float().repeat_interleave(q[2].shape[0] // segment.keys[2].shape[0], 0)
        plain.append((q[2].float() @ keys.transpose(1, 2) / q[2].shape[-1] ** 0.5).softmax(-1).amax(dim=(0, 1)).numpy())
    expected = np.maximum.reduceat(np.concatenate(plain), prepared.sentence_starts)
    assert len(prepared.reading.segments) > 1 and got["ilre"].shape == expected.shape
    np.testing.assert_allclose(got["ilre"], expected, rtol=1e-5, atol=1e-7)


def test_bad_input_says_what_to_do(tiny):
    with pytest.raises(HeadsError, match="pairs"):
        RetrievalHeads(backbone=tiny, heads=[(99, 0)])
    with pytest.raises(HeadsError, match="question is empty"):
        RetrievalHeads(backbone=tiny, heads=tiny_heads(tiny)).compress(HAYSTACK, "  ", 20)
    with pytest.raises(HeadsError, match="Unknown signal"):
        Endo(backbone=tiny, heads=tiny_heads(tiny), weights={"bm25": 1.0, "colour": 1.0})
    with pytest.raises(HeadsError, match="calibrate-heads"):
        RetrievalHeads(backbone=tiny)  # a model without a heads profile


# ---------------------------------------------------------------- the fusion's fit, by hand


def test_simplex_holds_every_corner():
    grid = list(simplex(["a", "b", "c"], 0.25))
    assert len(grid) == 15 and all(abs(sum(w.values()) - 1) < 1e-9 for w in grid)
    for s in "abc":
        assert {t: float(t == s) for t in "abc"} in grid


def toy(gold_at: int, a_best: int, b_best: int, n: int = 6):
    """One context of n one-token sentences, budget 1: signal a ranks sentence a_best first, b ranks b_best first,
    c is noise; gold is sentence gold_at."""
    a, b = np.zeros(n), np.zeros(n)
    a[a_best], b[b_best] = 1.0, 1.0
    a[(a_best + 1) % n] = b[(b_best + 1) % n] = 0.5
    gold = np.zeros(n, dtype=bool)
    gold[gold_at] = True
    return {"a": a, "b": b, "c": np.arange(n, dtype=float)[::-1]}, gold, np.ones(n, dtype=int), 1


def test_fit_picks_the_single_signal_that_is_right():
    items = [toy(0, 0, 3), toy(2, 2, 5), toy(4, 4, 1)]  # a is always right, b never
    fit = fit_weights(items, ("a", "b", "c"))
    assert fit["weights"]["a"] == 1.0 and fit["recall"] == 1.0 and fit["single"]["b"] == 0.0


def test_fit_needs_a_mix_and_is_never_below_its_best_single_signal():
    # gold is each signal's runner-up: only a blend of a and b puts it first (a first on one item, b on another)
    items = [toy(1, 0, 1), toy(1, 1, 5), toy(4, 4, 1)]
    fit = fit_weights(items, ("a", "b"))
    assert fit["recall"] >= max(fit["single"].values())
    assert fit["recall"] == 1.0 and 0 < fit["weights"]["a"] < 1  # neither alone gets all three
    assert fit["single"]["a"] < 1.0 and fit["single"]["b"] < 1.0


def test_fuse_standardises_and_rrf_ranks():
    np.testing.assert_allclose(standardise(np.array([1.0, 3.0])), [-1.0, 1.0])
    assert standardise(np.ones(3)).tolist() == [0, 0, 0]
    f = fuse({"a": np.array([0.0, 10.0]), "b": np.array([5.0, 0.0])}, {"a": 0.5, "b": 0.5})
    assert f[0] == f[1]
    assert np.argmax(rrf(np.array([3.0, 1, 2]), np.array([3.0, 2, 1]))) == 0
    assert recall_in_budget(np.array([1.0, 0, 2]), np.array([True, False, False]), np.array([2, 1, 2]), 4) == 1.0


def test_calibrate_heads_end_to_end(tiny, tmp_path):
    """The command on a tiny labelled file: a profile with heads, their scores, and fitted weights."""
    import argparse

    from endo_retrieval.calibration.heads import run
    from endo_retrieval.cli.calibrate import heads_add_arguments as add_arguments

    items = [{"_id": f"q{i}", "question": q, "answer": a, "type": "bridge", "level": "hard",
              "supporting_facts": [[t, 0]], "context": [[t, [s]], [f"Other {i}", ["Nothing to see here at all."]]]}
             for i, (q, a, t, s) in enumerate([
                 ("Where was Curie born?", "Warsaw", "Curie", "Marie Curie was born in Warsaw."),
                 ("What does copper conduct?", "electricity", "Copper", "Copper conducts electricity well."),
                 ("When was the tower finished?", "1889", "Tower", "The Eiffel Tower was finished in 1889.")])]
    data = tmp_path / "labelled.json"
    data.write_text(json.dumps(items))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "heads.json"
    args = parser.parse_args(["--data", str(data), "--distractors", "none", "--context-tokens", "64",
                              "--heads", "2", "--out", str(out)])
    args.model = tiny
    profile = run(args)
    saved = json.loads(out.read_text())
    assert saved["heads"] == profile["heads"] and len(saved["heads"]) == 2
    assert np.asarray(saved["head_scores"]).shape == (tiny.n_layers, tiny.n_heads)
    fusion = saved["fusion"]
    assert abs(sum(fusion["weights"].values()) - 1) < 1e-6
    assert fusion["recall"] >= max(fusion["single"].values())


# ---------------------------------------------------------------- the real model


@pytest.mark.slow
def test_real_heads_rank_the_gold_sentence_first(backbone):
    filler = ("The committee met on Tuesday to discuss the budget. Several members asked for more time. "
              "The weather that week was mild and dry. A new bakery opened near the station. ")
    needle = "The lighthouse keeper's cat was named Admiral Whiskers."
    context = filler * 6 + needle + " " + filler * 6
    heads = RetrievalHeads(backbone=backbone)
    prepared = heads.prepare(context)
    scores = heads.sentence_scores(prepared, "What was the name of the lighthouse keeper's cat?")
    assert needle in prepared.sentence_text(int(np.argmax(scores)))
    out = Endo(backbone=backbone).compress(context, "What was the name of the lighthouse keeper's cat?", 48)
    assert needle in out.text and out.n_tokens <= 48
