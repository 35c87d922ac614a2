"""`endo bench corpus` and the bootstrap intervals every bench figure carries: the intervals on inputs whose answer
is known, the corpus metrics on rankings scored by hand, the command end to end on a made-up HotpotQA file, the
rerankers' rows, and `endo bench fit-reranker`."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from endo_bench.corpus_bench import (METRICS, add_intervals, by_type, distinct, paragraph_id, question_metrics,
                                     question_types, score_ranking)
from endo_bench.metrics import bootstrap_ci, paired_diff_ci

# ---------------------------------------------------------------- bootstrap intervals


def test_a_constant_vectors_interval_is_the_point():
    mean, lo, hi = bootstrap_ci([0.4] * 17, seed=3)
    assert mean == pytest.approx(0.4, abs=1e-15) and lo == pytest.approx(mean, abs=1e-15) \
        and hi == pytest.approx(mean, abs=1e-15)


def test_paired_difference_of_identical_vectors_is_exactly_zero():
    x = np.random.default_rng(1).random(50)
    assert paired_diff_ci(x, x.copy(), seed=0) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("values", [
    np.random.default_rng(2).integers(0, 2, 40),       # hits
    np.random.default_rng(3).random(25),               # recalls
    [1.0, 0.0, 0.0, 0.0],                              # skewed and tiny
])
def test_interval_contains_the_mean(values):
    mean, lo, hi = bootstrap_ci(values, seed=7)
    assert mean == pytest.approx(np.mean(values)) and lo <= mean <= hi and lo < hi


def test_interval_has_95_percent_width():
    # 400 fair coin flips: the mean's standard error is 0.025, so a 95% interval is about 0.098 wide
    flips = np.random.default_rng(4).integers(0, 2, 400)
    _, lo, hi = bootstrap_ci(flips, seed=0)
    assert 0.085 < hi - lo < 0.11


def test_seed_reproduces_and_another_seed_resamples_otherwise():
    values = np.random.default_rng(5).random(60)
    assert bootstrap_ci(values, seed=11) == bootstrap_ci(values, seed=11)
    assert bootstrap_ci(values, seed=11) != bootstrap_ci(values, seed=12)
    assert paired_diff_ci(values, values[::-1], seed=11) == paired_diff_ci(values, values[::-1], seed=11)


def test_pairing_resamples_the_same_questions_for_both_systems():
    """Two systems that differ by a small constant on every question: the paired difference is that constant
    with a tight interval, though each system's own interval is wide."""
    a = np.random.default_rng(6).random(80)
    b = a - 0.05
    value, lo, hi = paired_diff_ci(a, b, seed=0)
    assert value == pytest.approx(0.05) and lo == pytest.approx(0.05) and hi == pytest.approx(0.05)
    _, a_lo, a_hi = bootstrap_ci(a, seed=0)
    assert a_hi - a_lo > 0.05
    c = np.random.default_rng(7).random(80)  # unrelated: the paired value is the difference of the means
    assert paired_diff_ci(a, c, seed=0)[0] == pytest.approx(a.mean() - c.mean())


def test_bootstrap_bad_input():
    assert bootstrap_ci([], seed=0) == (None, None, None)
    with pytest.raises(ValueError, match="same questions"):
        paired_diff_ci([1.0, 0.0], [1.0], seed=0)
    with pytest.raises(ValueError, match="finite"):
        bootstrap_ci([1.0, float("nan")], seed=0)


# ---------------------------------------------------------------- corpus metrics, worked out by hand


def test_distinct_keeps_first_appearance():
    assert distinct(["a", "a", "b", "c", "b", "d"], top=3) == ["a", "b", "c"]


def test_rankings_scored_by_hand():
    ranking = ["x1", "A", "x2", "x3", "B", "x4", "x5", "x6", "x7", "x8", "C"]  # C is 11th: past the top 10
    assert score_ranking(ranking, {"A", "B"}) == {"hits@2": 1, "hits@5": 2, "hits@10": 2, "first_gold_rank": 2,
                                                  "gold_ranks": [2, 5]}
    assert score_ranking(ranking, {"C"}) == {"hits@2": 0, "hits@5": 0, "hits@10": 0, "first_gold_rank": None,
                                             "gold_ranks": []}
    assert score_ranking(ranking, {"x1", "x6", "Z"}) == {"hits@2": 1, "hits@5": 1, "hits@10": 2,
                                                         "first_gold_rank": 1, "gold_ranks": [1, 8]}


def test_question_metrics_by_hand():
    # three questions: golds 2, 1, 3; hits as scored above
    per_question = {"hits@2": [1, 0, 1], "hits@5": [2, 0, 1], "hits@10": [2, 0, 2], "first_gold_rank": [2, None, 1],
                    "gold_ranks": [[2, 5], [], [1, 8]]}
    got = question_metrics(per_question, [2, 1, 3])
    # nDCG@10, binary gain: DCG over the gold's ranks, over the ideal DCG of min(gold, 10) at the top
    ndcg = [(1 / np.log2(3) + 1 / np.log2(6)) / (1 + 1 / np.log2(3)), 0,
            (1 + 1 / np.log2(9)) / (1 + 1 / np.log2(3) + 1 / np.log2(4))]
    expected = {"recall@2": [0.5, 0, 1 / 3], "recall@5": [1, 0, 1 / 3], "recall@10": [1, 0, 2 / 3],
                "all@2": [0, 0, 0], "all@5": [1, 0, 0], "all@10": [1, 0, 0], "mrr": [0.5, 0, 1],
                "hit@1": [0, 0, 1], "ndcg@10": ndcg}
    assert set(got) == set(METRICS)
    for name, values in expected.items():
        np.testing.assert_allclose(got[name], values, err_msg=name)


def test_by_type_splits_the_questions_and_pairs_each_type_with_the_reference():
    mine = {"recall@2": np.array([1.0, 0.0, 1.0, 0.5]), "recall@5": np.ones(4), "recall@10": np.ones(4)}
    ref = {"recall@2": np.array([0.0, 0.0, 1.0, 1.0]), "recall@5": np.ones(4), "recall@10": np.ones(4)}
    got = by_type(mine, ref, ["bridge", "bridge", "comparison", "comparison"], seed=0)
    assert got["bridge"]["n"] == 2 and got["bridge"]["recall@2"]["value"] == 0.5
    assert got["comparison"]["recall@2"]["value"] == 0.75
    assert got["bridge"]["diff"]["recall@2"]["value"] == 0.5 and got["comparison"]["diff"]["recall@2"]["value"] == -0.25
    assert got["bridge"]["diff"]["recall@5"] == {"value": 0.0, "lo": 0.0, "hi": 0.0}
    assert "diff" not in by_type(mine, None, ["a", "a", "b", "b"], seed=0)["a"]
    # one type, or a question without one: no split
    assert question_types([{"type": "bridge"}, {"type": "bridge"}]) == ["bridge", "bridge"]
    assert question_types([{"type": "bridge"}, {}]) is None
    rows = [{"system": "s", "per_question": {"hits@2": [1, 0], "hits@5": [1, 1], "hits@10": [1, 1],
                                             "first_gold_rank": [1, 3]}}]
    add_intervals(rows, [1, 1], None, 0, ["bridge", "bridge"])
    assert "by_type" not in rows[0]


# ---------------------------------------------------------------- the command end to end

SIGNED_CELL = r"[+-]\d\.\d{3} \[[+-]\d\.\d{3}, [+-]\d\.\d{3}\]"


TOPICS = [  # (question, gold paragraphs, a distractor of the same item)
    ("Which river flows through Zanthor?",
     [("Zanthor", ["Zanthor is a city on the Velna river.", "It has a market."]),
      ("Velna", ["The Velna river rises in the Kesh hills."])], ("Kesh cheese", ["Kesh cheese is sold in Lund."])),
    ("Who founded the Orrin Guild of weavers?",
     [("Orrin Guild", ["The Orrin Guild of weavers was founded by Mara Tesk."]),
      ("Mara Tesk", ["Mara Tesk led the Orrin Guild.", "She lived in Lund."])], ("Lund", ["Lund is a quiet town."])),
    ("What colour is the Zephyr bridge?",
     [("Zephyr bridge", ["The Zephyr bridge is painted green."])], ("Ferry", ["A ferry crossed before 1932."])),
    ("Which ship has its home port in Gdansk?",
     [("Albatross", ["The research ship Albatross carries twelve scientists."]),
      ("Gdansk port", ["Gdansk is the home port of the Albatross ship."])], ("Pierogi", ["The cook makes pierogi."])),
]


def made_up_hotpotqa(path, topics=TOPICS):
    items = []
    for i, (question, gold, distractor) in enumerate(topics):
        filler = [(f"Weather {i}", [f"Report {i} says it rained in the hills all week."])]
        context = [*gold, distractor, *filler]
        kind = "comparison" if i == 2 else "bridge"
        items.append({"_id": f"toy{i}", "question": question, "answer": "x", "type": kind, "level": "hard",
                      "supporting_facts": [[title, 0] for title, _ in gold],
                      "context": [[title, sentences] for title, sentences in context]})
    path.write_text(json.dumps(items))
    return path  # 4 questions, 15 paragraphs, golds of 2, 2, 1, 2 titles


def check_report(out, systems, reference):
    result = json.loads(out.read_text())
    assert result["schema"] == "endo-bench-corpus/1"
    cfg = result["config"]
    assert cfg["corpus_paragraphs"] == 15 and cfg["n_questions"] == 4 and cfg["reference"] == reference
    assert cfg["gold_per_question"] == [2, 2, 1, 2] and cfg["question_ids"] == [f"toy{i}" for i in range(4)]
    rows = {r["system"]: r for r in result["rows"]}
    assert list(rows) == systems
    for name, row in rows.items():
        assert "skipped" not in row, row.get("skipped")
        assert row["n"] == 4 and row["index_s"] > 0
        assert {"p50", "p95"} == set(row["latency_ms"]["query"]) and row["latency_ms"]["query"]["p50"] > 0
        for m in METRICS:
            cell = row[m]
            assert 0 <= cell["lo"] <= cell["value"] <= cell["hi"] <= 1, (name, m, cell)
        for k in (2, 5, 10):  # the row's figures come from its stored per-question hits
            recall = np.mean(np.array(row["per_question"][f"hits@{k}"]) / cfg["gold_per_question"])
            assert row[f"recall@{k}"]["value"] == pytest.approx(recall, abs=1e-4)
        assert set(row["diff"]) == set(METRICS)
        assert all(d["lo"] <= d["value"] <= d["hi"] for d in row["diff"].values())
    assert all(d == {"value": 0.0, "lo": 0.0, "hi": 0.0} for d in rows[reference]["diff"].values())
    types = np.array(["bridge", "bridge", "comparison", "bridge"])
    for name, row in rows.items():  # each type's recall is the mean over its own questions
        assert set(row["by_type"]) == {"bridge", "comparison"}
        for kind, v in row["by_type"].items():
            assert v["n"] == int((types == kind).sum())
            for k in (2, 5, 10):
                hits = np.array(row["per_question"][f"hits@{k}"]) / cfg["gold_per_question"]
                assert v[f"recall@{k}"]["value"] == pytest.approx(hits[types == kind].mean(), abs=1e-4)
    assert "Recall by question type" in out.with_suffix(".md").read_text()
    return result


def test_llamaindex_bm25_row_end_to_end(tmp_path, capsys):
    """LlamaIndex's BM25Retriever alone: no model is loaded, so this runs in the fast suite."""
    pytest.importorskip("llama_index.retrievers.bm25")
    from endo_retrieval.cli import main

    out = tmp_path / "corpus.json"
    assert main(["bench", "corpus", "--data", str(made_up_hotpotqa(tmp_path / "toy.json")), "--out", str(out),
                 "--systems", "llamaindex-bm25"]) == 0
    result = check_report(out, ["llamaindex-bm25"], "llamaindex-bm25")
    assert result["config"]["model"] is None
    row = result["rows"][0]
    # every question shares rare words with its gold paragraphs and with no other: all of them in the top 5
    assert row["all@5"]["value"] == 1.0 and row["mrr"]["value"] == 1.0
    table = out.with_suffix(".md").read_text()
    assert "| llamaindex-bm25 | 4 | " in table and "1.000 [1.000, 1.000]" in table
    assert "Difference to `llamaindex-bm25`" in table
    assert capsys.readouterr().out.startswith("Corpus retrieval: 15 paragraphs")
    # an earlier result file split by type afterwards (tools/corpus_by_type.py): the figures the bench wrote
    tool = Path(__file__).parents[2] / "tools" / "corpus_by_type.py"
    split = subprocess.run([sys.executable, str(tool), str(tmp_path / "toy.json"), str(out)], capture_output=True,
                           text=True, check=True).stdout
    bridge = row["by_type"]["bridge"]["recall@2"]["value"]
    assert f"| corpus.json | llamaindex-bm25 | {100 * bridge:.1f} (+0.0) |" in split


def test_missing_llamaindex_bm25_is_a_skipped_row_not_a_crash(tmp_path, monkeypatch):
    from endo_retrieval.cli import main

    monkeypatch.setitem(sys.modules, "llama_index.retrievers.bm25", None)  # import fails
    out = tmp_path / "corpus.json"
    assert main(["bench", "corpus", "--data", str(made_up_hotpotqa(tmp_path / "toy.json")), "--out", str(out),
                 "--systems", "llamaindex-bm25"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["n"] == 0 and "llama-index-retrievers-bm25 is not installed" in row["skipped"]
    assert "- skipped llamaindex-bm25: " in out.with_suffix(".md").read_text()


def test_bad_options_are_one_line_errors(tmp_path, capsys):
    from endo_retrieval.cli import main

    data = str(made_up_hotpotqa(tmp_path / "toy.json"))
    assert main(["bench", "corpus", "--data", data, "--out", str(tmp_path / "c.json"), "--systems", "nope"]) == 2
    assert "known systems: endo, endo-2hop, bm25" in capsys.readouterr().err
    assert main(["bench", "corpus", "--data", data, "--out", str(tmp_path / "c.json"), "--candidates", "5"]) == 2
    assert main(["bench", "corpus", "--data", data, "--out", str(tmp_path / "c.txt")]) == 2


def test_paragraph_ids_are_stable_per_title():
    assert paragraph_id("Zanthor") == paragraph_id("Zanthor") != paragraph_id("Velna")


@pytest.mark.slow
def test_bench_corpus_end_to_end(tmp_path, backbone):
    """The engine's BM25 through EndoRetriever beside LlamaIndex's BM25Retriever (loads the default model)."""
    pytest.importorskip("llama_index.retrievers.bm25")
    from endo_retrieval.cli import main

    out = tmp_path / "corpus.json"
    assert main(["bench", "corpus", "--data", str(made_up_hotpotqa(tmp_path / "toy.json")), "--out", str(out),
                 "--systems", "bm25,llamaindex-bm25", "--seed", "3"]) == 0
    result = check_report(out, ["bm25", "llamaindex-bm25"], "llamaindex-bm25")
    assert result["config"]["model"] == backbone.model_id and result["config"]["seed"] == 3
    bm25 = result["rows"][0]
    assert bm25["recall@10"]["value"] == 1.0  # 15 paragraphs, gold words shared with nothing else
    table = out.with_suffix(".md").read_text().splitlines()
    assert table[2].startswith("| system | n | recall@2 | recall@5 | recall@10 | all@2 |")
    assert any(line.startswith("| bm25 | 4 | ") for line in table)
    diff_table = table[table.index(next(line for line in table if line.startswith("Difference to"))):]
    bm25_diff = next(line for line in diff_table if line.startswith("| bm25 | "))
    cells = bm25_diff.strip("| ").split(" | ")[1:]
    assert len(cells) == len(METRICS) and all(re.fullmatch(SIGNED_CELL, c) for c in cells), bm25_diff
    typed = [line.strip("| ").split(" | ") for line in table if line.startswith("| bm25 | bridge | ")]
    assert len(typed) == 1 and typed[0][2] == "3" and all(re.fullmatch(SIGNED_CELL, c) for c in typed[0][6:])


def test_a_rows_forwards_are_counted_per_question_and_cuda_counts_only_on_cuda():
    """`measure` counts the decoder's calls each question makes (here a stand-in model: 3, then 1, then 2 calls)."""
    from types import SimpleNamespace

    import torch

    from endo_bench.corpus_bench import Row, measure
    from endo_bench.launches import cuda_launches

    decoder = torch.nn.Identity()
    bb = SimpleNamespace(model=SimpleNamespace(model=decoder), device=torch.device("cpu"))
    calls = {"warm": 1, "q0": 3, "q1": 1, "q2": 2}

    class Asks(Row):
        name = "stand-in"

        def load(self, shared):
            pass

        def build(self, nodes, shared):
            pass

        def ask(self, question):
            for _ in range(calls.get(question, calls["warm"])):
                decoder(torch.zeros(1))
            return ["a"], {}

    items = [{"question": f"q{i}", "supporting_facts": [["A", 0]]} for i in range(3)]
    row = measure(Asks(), [], items, {"a": "A"}, {}, bb)
    assert row["per_question"]["forwards"] == [3, 1, 2] and row["forwards_per_question"] == 2.0
    assert "cuda_per_question" not in row and cuda_launches(lambda: None, "cpu") is None
    assert "forwards" not in measure(Asks(), [], items, {"a": "A"}, {})["per_question"]  # no model, no count


@pytest.mark.slow
def test_the_endo_rows_forwards_are_the_pipelines_calls_batched_and_plain(tmp_path, backbone, monkeypatch):
    """`endo bench corpus` reports the forwards each question made, counted apart from the bench by wrapping the
    decoder's forward: the shipped profile reads two pools, each its own read, so at the GPU's setting (depth 20,
    whose fusion weighs the second hop) 2 a pool with batched reads, 5 with --plain-reads; at a CPU's own setting (no
    second hop) 1 a pool; the model's stages in the table."""
    from endo_retrieval.cli import main
    from endo_retrieval.methods.pipeline import EndoPipeline

    made = []
    forward = backbone.model.model.forward
    monkeypatch.setattr(backbone.model.model, "forward", lambda *a, **k: made.append(1) or forward(*a, **k))
    data = made_up_hotpotqa(tmp_path / "toy.json")
    gpu = ["--depth", "20"]
    pools = len(EndoPipeline(backbone).pools)
    assert pools == 2
    for flags, per_pool in ((gpu, 2), ([*gpu, "--plain-reads"], 5), ([], 1)):
        per_question = pools * per_pool
        out = tmp_path / f"corpus{len(flags)}.json"
        made.clear()
        assert main(["bench", "corpus", "--data", str(data), "--out", str(out), "--systems", "endo", *flags]) == 0
        result = json.loads(out.read_text())
        (row,) = result["rows"]
        assert row["per_question"]["forwards"] == [per_question] * 4 and row["forwards_per_question"] == per_question
        assert len(made) == 5 * per_question  # the warm-up question and the four asked
        assert result["config"]["reads"] == ("plain" if "--plain-reads" in flags else "batched")
        assert {"read", "question"} <= set(row["latency_ms"]) and ("hop2" in row["latency_ms"]) == (flags != [])
        assert f"| endo | {per_question} | – | – | – |" in out.with_suffix(".md").read_text()
        assert result["config"]["pipeline"]["depth"] == (20 if flags else EndoPipeline(backbone).depth)


def test_the_pipelines_knobs_reach_the_endo_rows_and_the_record(tmp_path, backbone, monkeypatch):
    """--depth and --read-tokens are the retriever's own knobs: the pipeline reads that many candidates, and the
    result file records the settings it read with."""
    from endo_retrieval.cli import main
    from endo_retrieval.methods import pipeline

    read = []
    real = pipeline.EndoPipeline.read_texts
    monkeypatch.setattr(pipeline.EndoPipeline, "read_texts",
                        lambda self, *a: read.append((self.depth, self.read_tokens)) or real(self, *a))
    out = tmp_path / "knobs.json"
    assert main(["bench", "corpus", "--data", str(made_up_hotpotqa(tmp_path / "toy.json")), "--out", str(out),
                 "--systems", "endo", "--depth", "3", "--read-tokens", "32"]) == 0
    assert read[0] == (3, 32) and {t for _, t in read} == {32}  # deeper reads only to fill k documents
    assert json.loads(out.read_text())["config"]["pipeline"]["depth"] == 3


# ---------------------------------------------------------------- rerankers after a first stage


def scripted_llm(answer: str):
    """A LlamaIndex LLM that answers every prompt with one fixed text (the bench's handling of LLMRerank's parse
    is under test, not the model); `calls` counts its answers."""
    from llama_index.core.llms import CompletionResponse, CustomLLM, LLMMetadata

    class Scripted(CustomLLM):
        calls: int = 0

        @property
        def metadata(self) -> LLMMetadata:
            return LLMMetadata()

        def complete(self, prompt, formatted=False, **kwargs):
            self.calls += 1
            return CompletionResponse(text=answer)

        def stream_complete(self, prompt, formatted=False, **kwargs):
            raise NotImplementedError

    return Scripted()


class ListedFirstStage:
    """A first stage that returns the same nodes, best first, for any question."""

    kind = "listed"

    def __init__(self, n: int):
        from llama_index.core.schema import NodeWithScore, TextNode

        self.nodes = [NodeWithScore(node=TextNode(id_=f"c{i}", text=f"candidate {i}"), score=float(n - i))
                      for i in range(n)]

    def load(self, shared):
        pass

    def retrieve(self, question):
        return list(self.nodes)


@pytest.mark.parametrize("answer, top, empty, calls", [
    ("I cannot rank these.", [f"c{i}" for i in range(10)], 1, 2),  # nothing parsed: the first stage's order
    # each batch of 10 names its 2nd document: c1 and c11 lead, the first stage's order fills the rest
    ("Doc: 2, Relevance: 9", ["c1", "c11", "c0", *(f"c{i}" for i in range(2, 9))], 0, 2),
    ("Doc: -40, Relevance: 3", [f"c{i}" for i in range(10)], 1, 1),  # LLMRerank raises IndexError at once
])
def test_llmrerank_shortfall_is_filled_from_the_first_stage_and_counted(answer, top, empty, calls):
    from llama_index.core.postprocessor import LLMRerank

    from endo_bench.corpus_bench import TOP, Reranked

    llm = scripted_llm(answer)
    row = Reranked("listed+llmrerank", ListedFirstStage(15),
                   lambda: LLMRerank(llm=llm, top_n=TOP, choice_batch_size=10))
    row.load({})
    ids, stages = row.ask("Which candidate?")
    assert ids == top and llm.calls == calls  # 15 candidates: batches of 10 and 5
    assert (row.filled, row.empty) == (1, empty) and set(stages) == {"first_stage", "rerank"}
    assert row.note() == ("questions with fewer than 10 distinct paragraphs from the reranker: 1 "
                          f"(with none: {empty}); the rest of their top 10 came in the first stage's order")
    row.reset()
    assert row.note() is None


def test_a_full_answer_needs_no_fill():
    from llama_index.core.postprocessor import LLMRerank

    from endo_bench.corpus_bench import Reranked

    answer = "\n".join(f"Doc: {i}, Relevance: {i}" for i in range(1, 11))  # the highest number is the best
    row = Reranked("listed+llmrerank", ListedFirstStage(10), lambda: None)
    row.postprocessor = LLMRerank(llm=scripted_llm(answer), top_n=10, choice_batch_size=10)
    ids, _ = row.ask("Which candidate?")
    assert ids == [f"c{i}" for i in range(9, -1, -1)] and row.filled == 0 and row.note() is None


def test_bm25_llmrerank_row_end_to_end_with_a_scripted_model(tmp_path, monkeypatch):
    """The row as `endo bench corpus` runs it, the model's answers unparsable: every question's top is BM25's, so
    its figures are llamaindex-bm25's, and the note and the stage latencies are reported."""
    pytest.importorskip("llama_index.retrievers.bm25")
    from endo_bench import corpus_bench
    from endo_retrieval.cli import main

    monkeypatch.setattr(corpus_bench, "load_backbone", lambda model, dtype=None: None)
    monkeypatch.setattr(corpus_bench, "endo_llm", lambda bb: scripted_llm("Sorry, no idea."))
    out = tmp_path / "corpus.json"
    assert main(["bench", "corpus", "--data", str(made_up_hotpotqa(tmp_path / "toy.json")), "--out", str(out),
                 "--systems", "llamaindex-bm25,bm25+llmrerank", "--choice-batch-size", "4"]) == 0
    result = check_report(out, ["llamaindex-bm25", "bm25+llmrerank"], "llamaindex-bm25")
    bm25, llm = result["rows"]
    assert llm["per_question"] | {"query_ms": None} == bm25["per_question"] | {"query_ms": None}
    assert llm["note"].startswith("questions with fewer than 10 distinct paragraphs from the reranker: 4 "
                                  "(with none: 4)")
    assert set(llm["latency_ms"]) == {"query", "first_stage", "rerank"} and "note" not in bm25
    assert result["config"]["choice_batch_size"] == 4
    table = out.with_suffix(".md").read_text()
    assert "| bm25+llmrerank | rerank | " in table and "- bm25+llmrerank: questions with fewer than 10" in table


@pytest.mark.slow
def test_reranker_rows_end_to_end(tmp_path, backbone):
    """Every reranker row on the real default model: each runs and reports, with its two stages timed."""
    pytest.importorskip("llama_index.retrievers.bm25")
    from endo_bench.corpus_bench import RERANKED
    from endo_retrieval.cli import main

    out = tmp_path / "corpus.json"
    systems = ["llamaindex-bm25", *RERANKED]
    assert main(["bench", "corpus", "--data", str(made_up_hotpotqa(tmp_path / "toy.json")), "--out", str(out),
                 "--systems", ",".join(systems), "--choice-batch-size", "20"]) == 0
    result = check_report(out, systems, "llamaindex-bm25")
    for row in result["rows"][1:]:
        assert {"first_stage", "rerank"} <= set(row["latency_ms"]), row["system"]
        assert row["recall@10"]["value"] == 1.0, row["system"]  # 15 paragraphs: every gold in any top 10
    notes = [r for r in result["rows"] if "note" in r]
    assert all(r["system"].endswith("+llmrerank") for r in notes)


# ---------------------------------------------------------------- fit-reranker


def test_fit_reranker_writes_its_entry_into_the_given_profile(tmp_path, monkeypatch, capsys):
    """BM25 candidates, their scores and gold flags reach the fit (stubbed: the heads need the model), and its entry
    lands in the --out profile beside what the profile held."""
    pytest.importorskip("llama_index.retrievers.bm25")
    from endo_bench import corpus_bench
    from endo_retrieval.calibration import reranker
    from endo_retrieval.cli import main

    seen = []

    def fake_fit(bb, questions, step=0.1, progress=False):
        seen.extend(questions)
        return {"first_stage": 0.3, "heads": 0.7, "fit": {"n_questions": len(questions), "step": step}}

    monkeypatch.setattr(corpus_bench, "load_backbone", lambda model, dtype=None: None)
    monkeypatch.setattr(reranker, "fit_reranker_section", fake_fit)
    profile = tmp_path / "heads.json"
    profile.write_text(json.dumps({"heads": [[3, 1]], "reranker": {"minilm": {"first_stage": 0.6, "heads": 0.4}}}))
    assert main(["bench", "fit-reranker", "--data", str(made_up_hotpotqa(tmp_path / "toy.json")),
                 "--first-stages", "bm25", "--candidates", "5", "--step", "0.25", "--out", str(profile)]) == 0
    saved = json.loads(profile.read_text())
    entry = {"first_stage": 0.3, "heads": 0.7,
             "fit": {"n_questions": 4, "step": 0.25, "data": "toy.json", "candidates": 5}}
    assert saved == {"heads": [[3, 1]], "reranker": {"minilm": {"first_stage": 0.6, "heads": 0.4}, "bm25": entry}}
    assert json.loads(capsys.readouterr().out) == {"bm25": entry}
    assert [q["question"] for q in seen] == [t[0] for t in TOPICS]
    for q, gold_count in zip(seen, [2, 2, 1, 2]):
        scores = q["first_stage_scores"]
        assert len(q["candidates"]) == len(q["gold"]) == len(scores) == 5
        assert scores == sorted(scores, reverse=True) and scores[0] > 0
        assert sum(q["gold"]) == gold_count  # BM25 has every gold paragraph in its top 5 here
    # the candidates are the paragraphs' texts, as the reranker reads them
    assert seen[2]["candidates"][0] == "Zephyr bridge: The Zephyr bridge is painted green." and seen[2]["gold"][0]


def test_fit_reranker_bad_options(tmp_path, capsys):
    from endo_retrieval.cli import main

    data = str(made_up_hotpotqa(tmp_path / "toy.json"))
    assert main(["bench", "fit-reranker", "--data", data, "--first-stages", "minilm,dense"]) == 2
    assert "--first-stages takes a comma-separated list of minilm, bm25" in capsys.readouterr().err
    assert main(["bench", "fit-reranker", "--data", data, "--out", str(tmp_path / "none.json")]) == 2
    assert "no heads profile there" in capsys.readouterr().err


@pytest.mark.slow
def test_fit_reranker_on_the_default_model(tmp_path, backbone, capsys):
    """The real fit into a copy of the model's heads profile: a weight on the grid, the recall it reached."""
    pytest.importorskip("llama_index.retrievers.bm25")
    import shutil

    from endo_retrieval.cli import main
    from endo_retrieval.model.profiles import heads_profile_path

    profile = tmp_path / "heads.json"
    shutil.copy(heads_profile_path(backbone), profile)
    before = json.loads(profile.read_text())
    assert main(["bench", "fit-reranker", "--data", str(made_up_hotpotqa(tmp_path / "toy.json")),
                 "--first-stages", "bm25", "--candidates", "10", "--out", str(profile)]) == 0
    entry = json.loads(profile.read_text())["reranker"]["bm25"]
    assert entry == json.loads(capsys.readouterr().out)["bm25"]
    assert entry["first_stage"] + entry["heads"] == pytest.approx(1.0) and round(entry["first_stage"] * 10) \
        == pytest.approx(entry["first_stage"] * 10)
    assert entry["fit"]["n_questions"] == 4 and entry["fit"]["recall"]["@5"] == 1.0
    assert {k: v for k, v in json.loads(profile.read_text()).items() if k != "reranker"} \
        == {k: v for k, v in before.items() if k != "reranker"}


# ---------------------------------------------------------------- tiktoken's cache


def test_tiktoken_cache_pointed_at_llamaindex_copy_when_the_variable_misses_it(tmp_path, monkeypatch):
    import hashlib

    from endo_bench.corpus_bench import CL100K_FILE, use_shipped_tiktoken_cache

    url = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
    assert CL100K_FILE == hashlib.sha1(url.encode()).hexdigest()  # tiktoken's cache key for the file
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # set, without the file
    use_shipped_tiktoken_cache()
    shipped = os.environ["TIKTOKEN_CACHE_DIR"]
    assert shipped.endswith("llama_index/core/_static/tiktoken_cache") and (Path(shipped) / CL100K_FILE).is_file()

    (tmp_path / CL100K_FILE).write_text("a cache of one's own")  # the file where the variable says: left alone
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    use_shipped_tiktoken_cache()
    assert os.environ["TIKTOKEN_CACHE_DIR"] == str(tmp_path)

    monkeypatch.delenv("TIKTOKEN_CACHE_DIR")  # unset: llama_index.core uses its copy itself
    use_shipped_tiktoken_cache()
    assert "TIKTOKEN_CACHE_DIR" not in os.environ


def test_dtype_loads_the_model_in_that_type(tiny_backbone):
    """`endo bench corpus --dtype bfloat16` reads with bf16 weights (on a CPU with bf16 units about twice as fast);
    without it the device's default (fp32 on a CPU)."""
    import torch

    from endo_bench import corpus_bench

    assert corpus_bench.load_backbone(str(tiny_backbone.folder), "bfloat16").dtype == torch.bfloat16
    assert corpus_bench.load_backbone(str(tiny_backbone.folder)).dtype == torch.float32
