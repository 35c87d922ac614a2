"""The zero-label task maker's two-hop tasks and the whole-context fusion's fit on made haystacks, on small
synthetic inputs: bridges are rare names or numbers shared by two chunks and never asked for, both golds are kept
everywhere a task goes, and a saturated fit table does not fall to BM25's corner while an informative one still
picks its best."""
from __future__ import annotations

import random

import numpy as np
import pytest

from endo_retrieval.calibration import zero_label
from endo_retrieval.calibration.zero_label import (BRIDGE_CHUNKS, TWO_HOP, Chunk, Task, bm25_ranks, bridges,
                                                  corpus_questions, fit_fusion, haystacks, mixed, two_hop_question,
                                                  two_hop_tasks)

TEXTS = [
    "The harbour of Saltmarsh was rebuilt after the storm. The engineer Aldous Merrow drew the new quay walls.",
    "Aldous Merrow trained in Glasgow as a surveyor. In later life he designed iron lighthouses for the coast.",
    "The orchestra toured the northern towns every spring. Its conductor recorded the symphony in 1937 with care.",
    "A printing press opened in the valley in 1937 and sold almanacs. Farmers bought them before the harvest.",
    "The river flooded the lower meadows every winter. Shepherds moved the flocks to the chalk hills above.",
    "Copper mines employed most families in the district. The miners' chapel held a choir on feast days.",
]
# "the" and "every" are everywhere; Saltmarsh and Glasgow are in one chunk only: none of them links two chunks
COMMON = [f"Chunk {i} is about the district and its Market, every week." for i in range(BRIDGE_CHUNKS + 1)]


def chunks() -> list[Chunk]:
    return [Chunk(f"c{i}", f"d{i % 3}", t) for i, t in enumerate(TEXTS + COMMON)]


def test_bridges_are_rare_names_and_numbers_shared_by_two_chunks():
    found = bridges(chunks())
    assert found["Merrow"] == [0, 1] and found["1937"] == [2, 3]
    assert "Market" not in found  # in more than BRIDGE_CHUNKS chunks: a topic, not a link
    assert not {"Saltmarsh", "Glasgow", "The"} & set(found)  # in one chunk only, or opening its sentence
    titled = [Chunk("a", "d", "Songs of the Visual Age were sung by Ilsa Varn."), Chunk("b", "d", "Ilsa Varn wrote "
              "about Visual Age poets."), Chunk("c", "d", "The visual arts of the coast.")]
    assert set(bridges(titled)) == {"Ilsa", "Varn", "Age"}  # "Visual" is written in lower case too: a word


def test_two_hop_tasks_never_ask_the_bridge_and_keep_both_golds():
    cs = chunks()
    tasks = two_hop_tasks(cs, 10, seed=3)
    assert {t.bridge for t in tasks} >= {"Merrow", "1937"}
    for t in tasks:
        assert t.form == TWO_HOP and t.chunk != t.chunk2 and len(t.golds) == 2
        assert t.bridge.lower() not in t.question.lower()
        assert t.evidence in cs[t.chunk].text and t.evidence2 in cs[t.chunk2].text
        assert t.bridge in t.evidence and t.bridge in t.evidence2
        # the question names both sentences: a content word of each, the bridge aside
        asked = {w.lower() for w in zero_label.TOKEN.findall(t.question)}
        for sentence in t.evidences:
            own = {w.lower() for w in zero_label.content_words(sentence)}
            assert asked & {w for w in own | {zero_label.inflect(x).lower() for x in own}}
    # deterministic from the seed, whatever the global random state
    random.seed(99)
    again = two_hop_tasks(cs, 10, seed=3)
    assert [vars(t) for t in again] == [vars(t) for t in tasks]

    titles, _, questions = corpus_questions(tasks, cs)
    assert all(len(q["supporting_facts"]) == 2 for q in questions)
    assert {f[0] for f in questions[0]["supporting_facts"]} == {cs[g].id for g in tasks[0].golds}
    for e, t in zip(haystacks(tasks, cs, lambda s: len(s.split()), 200), tasks):
        assert cs[t.chunk].text in e.context and cs[t.chunk2].text in e.context
        assert e.supporting == [t.evidence, t.evidence2]


def test_the_bridge_is_never_asked_whatever_words_are_drawn():
    first, second = "Aldous Merrow drew the quay walls.", "Merrow trained at Merrowfield as a surveyor."
    for seed in range(50):
        question = two_hop_question(first, second, "Merrow", random.Random(seed))
        assert question and "merrow" not in question.lower()


def test_a_two_hop_task_is_hard_for_bm25_until_both_golds_lead():
    cs = [Chunk(f"c{i}", "d", t) for i, t in enumerate(["blue boats", "red pears", "yellow boats on the lake"])]
    both = Task("t", "blue boats pears", "", 0, TWO_HOP, chunk2=1)
    one = Task("u", "blue boats", "", 0, TWO_HOP, chunk2=1)
    assert bm25_ranks([both, one], cs) == [0, 1]  # for "blue boats" the lake chunk outranks the pears chunk


def test_mixed_spreads_the_share_of_two_hop_tasks(monkeypatch):
    single = [Task(f"s{i}", f"q{i}", "", 0, "keywords") for i in range(20)]
    linked = [Task(f"l{i}", f"p{i}", "", 0, TWO_HOP, chunk2=1) for i in range(20)]
    monkeypatch.setattr(zero_label, "bm25_ranks", lambda ts, cs: [i % 2 for i in range(len(ts))])
    tasks = mixed(single, linked, [], 12, share=1 / 3)
    assert len(tasks) == 12 and sum(t.form == TWO_HOP for t in tasks) == 4
    assert sum(t.form == TWO_HOP for t in tasks[:6]) == 2  # each half holds its share
    assert mixed(single, [], [], 12) == mixed(single[:], [], [], 12) and len(mixed(single, [], [], 12)) == 12


def items_ranked(ranks: dict[str, list[int]], n_sentences: int = 64, length: int = 32, budget: int = 2048,
                 seed: int = 0):
    """Fit items with one gold sentence each, every signal putting it at the given rank (per item) and ranking the
    other sentences at random."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(len(next(iter(ranks.values())))):
        gold = np.zeros(n_sentences, dtype=bool)
        gold[7] = True
        sig = {}
        for name, rank in ranks.items():
            others = rng.permutation(np.delete(np.arange(n_sentences), 7))
            order = np.insert(others, rank[k], 7)  # sentence ids best first
            score = np.empty(n_sentences)
            score[order] = np.arange(n_sentences, 0, -1)
            sig[name] = score
        out.append((sig, gold, np.full(n_sentences, length), budget))
    return out


def test_a_saturated_fit_hedges_instead_of_taking_the_bm25_corner():
    items = items_ranked({s: [0] * 30 for s in ("bm25", "heads", "hop2")})
    fit = fit_fusion(items)
    assert fit["recall"] == 1.0 and set(fit["single"].values()) == {1.0}
    assert fit["weights"]["bm25"] < 1 and max(fit["weights"].values()) <= 0.35 and min(fit["weights"].values()) > 0
    assert fit["budget_scale"] == 1 / 16  # halved down to MIN_BUDGET, still saturated there


def test_the_budget_is_halved_until_the_best_signal_misses_some_evidence():
    ranks = [2, 12] * 15  # kept within 64, 32 and 16 sentences; within 8 only half the time
    fit = fit_fusion(items_ranked({"bm25": ranks, "heads": ranks, "hop2": ranks}))
    assert fit["budget_scale"] == 1 / 8 and fit["single"]["bm25"] == 0.5


def test_an_informative_fit_still_picks_its_best():
    rng = random.Random(1)
    n = 40
    items = items_ranked({"bm25": [rng.randrange(20, 60) for _ in range(n)],
                          "heads": [rng.randrange(0, 3) for _ in range(n)],
                          "hop2": [rng.randrange(20, 60) for _ in range(n)]})
    fit = fit_fusion(items)
    assert fit["single"]["heads"] == 1.0 and fit["best"]["recall"] == 1.0
    assert fit["recall"] == pytest.approx(fit["best"]["recall"], abs=0.03)
    assert fit["weights"]["heads"] == max(fit["weights"].values()) >= 0.5


def test_written_questions_replace_the_made_ones_and_bad_replies_drop_their_task():
    cs = chunks()
    one = Task("a", "made", "The engineer Aldous Merrow drew the new quay walls.", 0, "keywords")
    two = Task("b", "made", cs[0].text.split(". ")[1], 0, TWO_HOP, chunk2=1, evidence2="Aldous Merrow trained in "
               "Glasgow as a surveyor.", bridge="Merrow")
    replies = {"one": "Question: Who designed the harbour's new walls? It was an engineer.",
               "two": "Which surveyor trained in Scotland drew walls for a harbour?"}
    write = lambda prompts: [replies["two" if "two sentences" in p else "one"] for p in prompts]  # noqa: E731
    got = zero_label.written_tasks([one, two], write)
    assert [t.question for t in got] == ["Who designed the harbour's new walls?", replies["two"]]
    assert [t.form for t in got] == [zero_label.WRITTEN, f"{zero_label.WRITTEN} {TWO_HOP}"]
    assert [(t.chunk, t.chunk2, t.evidences) for t in got] == [(t.chunk, t.chunk2, t.evidences) for t in (one, two)]
    for bad in ("What is the answer to this question?",  # about nothing in the evidence
                "Who is Merrow and which walls did he draw?",  # names the bridge (dropped for the two-hop task)
                "Sure! Here is a question", "Which?",  # no question, too short
                "Which walls are mentioned in the sentence?"):  # points at the prompt
        kept = zero_label.written_tasks([one, two], lambda prompts: [bad] * len(prompts))
        assert two.id not in {t.id for t in kept}
        assert not kept or bad.startswith("Who is Merrow")  # the single-hop task may ask about Merrow
    copy = zero_label.written_tasks([one], lambda p: ["The engineer Aldous Merrow drew the new quay walls?"])
    assert copy == []  # the evidence itself, turned into a question


def test_near_best_keeps_what_the_noise_cannot_separate_from_the_best():
    rng = np.random.default_rng(0)
    base = rng.random(200)
    noise = 0.05 * rng.standard_normal(200)
    table = np.stack([base, base + noise - noise.mean() - 1e-4, base - 0.3])  # as good in the mean; clearly worse
    assert zero_label.near_best(table) == [0, 1]


def test_zero_label_keeps_the_most_heads_near_the_best():
    rng = np.random.default_rng(1)
    per_item = rng.random(300)
    table = np.stack([per_item, per_item, per_item, per_item - 0.4])  # 4, 8, 12 as good; 16 clearly not
    jitter = 0.05 * rng.standard_normal((4, 300))
    assert zero_label.most_heads([4, 8, 12, 16], table + jitter) == 12


def test_zero_label_takes_the_cheapest_near_best_setting_unless_one_is_clearly_better():
    rows = [{"depth": 30, "read_tokens": 128}, {"depth": 20, "read_tokens": 256}, {"depth": 20, "read_tokens": 128}]
    rng = np.random.default_rng(2)
    noise = rng.standard_normal((3, 300))
    assert zero_label.cheapest_setting(rows, 0.7 + 0.3 * noise) == 2
    clear = 0.7 + 0.3 * noise
    clear[0] += 0.2  # depth 30 finds a fifth more of the gold on every task
    assert zero_label.cheapest_setting(rows, clear) == 0


def test_the_pipeline_fit_with_the_flattest_rule_hedges_between_equal_stages():
    from endo_retrieval.calibration.pipeline import fit

    rng = np.random.default_rng(3)
    items = []
    for _ in range(60):  # both stages rank the one gold first: every weight ties
        s = rng.random(10)
        s[0] = 2.0
        items.append(({"bm25": s.copy(), "heads": s.copy(), "hop2": s.copy()}, [f"d{i}" for i in range(10)],
                      {"d0"}))
    plain, _ = fit(items)
    hedged, recall = fit(items, choose=zero_label.flattest)
    assert max(plain.values()) == 1.0  # the argmax keeps the first corner it meets
    assert max(hedged.values()) < 0.5 and recall[2] == 1.0
