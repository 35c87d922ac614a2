"""`endo bench quality`: per-row metrics against values computed by hand on a two-item toy set, KL of the full
context against itself, resumption, bad input, the JSON schema, and the chunk baselines. A tiny random model
(conftest.make_tiny_model) stands in for the default one: the numbers are plumbing checks, not quality."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_tiny_model
from endo_retrieval.eval import runner
from endo_retrieval.eval.data import DataError
from endo_retrieval.eval.metrics import exact_match, f1_score
from endo_retrieval.methods.base import Compressed

GOLD = {  # question -> (answer, its two gold sentences, the text the oracle method hands over)
    "Which river flows through Zanthor?": ("the Velna", ["Zanthor is a city on the Velna river.",
                                                         "The Velna rises in the Kesh hills."]),
    "Who founded the Orrin Guild?": ("Mara Tesk", ["The Orrin Guild was founded by Mara Tesk.",
                                                   "Mara Tesk was a weaver from Lund."]),
}
ORACLE_TEXT = {  # one of two gold sentences each; the first carries the answer, the second does not
    "Which river flows through Zanthor?": "Zanthor is a city on the Velna river.",
    "Who founded the Orrin Guild?": "Mara Tesk was a weaver from Lund.",
}
HAND = {  # (sp_recall, answer_recall) of ORACLE_TEXT, worked out by reading it
    "Which river flows through Zanthor?": (0.5, 1.0),
    "Who founded the Orrin Guild?": (0.5, 1.0),
}
TITLES = ("Zanthor", "Velna"), ("Orrin Guild", "Mara Tesk")


def toy_hotpotqa(path: Path) -> Path:
    items = []
    for i, ((question, (answer, (s1, s2))), titles) in enumerate(zip(GOLD.items(), TITLES)):
        filler = [[f"Filler {i}-{j}", [f"Paragraph {j} of item {i} says nothing useful.", "It is filler."]]
                  for j in range(3)]
        items.append({"_id": f"toy{i}", "question": question, "answer": answer, "type": "bridge", "level": "hard",
                      "supporting_facts": [[titles[0], 0], [titles[1], 0]],
                      "context": [[titles[0], [s1, "More words here."]], [titles[1], [s2]], *filler]})
    path.write_text(json.dumps(items))
    return path


class Oracle:
    name = "oracle"

    def __init__(self, backbone=None):
        self.backbone = backbone

    def compress(self, context: str, question: str, budget: int) -> Compressed:
        text = ORACLE_TEXT.get(question, context[:40])  # (the bench warms methods up on another question)
        return Compressed(text, [], self.backbone.count_tokens(text), self.name, budget)


class Whole(Oracle):
    """Returns the whole context: the same prompt as `full`."""

    name = "whole"

    def compress(self, context: str, question: str, budget: int) -> Compressed:
        return Compressed(context, [], self.backbone.count_tokens(context), self.name, budget)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from endo_retrieval.backbone import Backbone

    return Backbone(make_tiny_model("llama", tmp_path_factory.mktemp("tiny"), layers=2), device="cpu")


@pytest.fixture
def toy_methods(monkeypatch):
    monkeypatch.setitem(runner.METHODS, "oracle", f"{__name__}:Oracle")
    monkeypatch.setitem(runner.METHODS, "whole", f"{__name__}:Whole")


def config(tmp_path, data, methods=("full", "oracle", "whole"), **kw) -> runner.QualityConfig:
    kw = {"context_tokens": [160], "budgets": [64], "max_new_tokens": 3, "progress": False, **kw}
    return runner.QualityConfig(data=str(data), out=tmp_path / "q.json", methods=list(methods), **kw)


def records(out: Path) -> dict[tuple[str, str], dict]:
    lines = out.with_suffix(".records.jsonl").read_text().splitlines()[1:]
    return {(r["example"], r["method"]): r for r in map(json.loads, lines)}


def naive_answer_logits(bb, context: str, question: str, answer: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """One plain forward over the whole chat prompt plus answer (no cache, no token-by-token feeding) and
    transformers' own greedy generate: the reference for the runner's cached, rewound path."""
    user = runner.USER_TEMPLATE.format(context=context, question=question)
    prompt = bb.tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"][0]
    answer_ids = torch.tensor(bb.tokenizer(answer, add_special_tokens=False)["input_ids"])
    with torch.inference_mode():
        logits = bb.model(torch.cat([prompt, answer_ids])[None]).logits[0].float()
        generated = bb.model.generate(prompt[None], max_new_tokens=3, do_sample=False,
                                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      pad_token_id=bb.tokenizer.eos_token_id)[0, len(prompt):]
    stop = runner._eos_ids(bb)
    tokens = generated.tolist()
    ends = [i for i, t in enumerate(tokens) if t in stop]  # greedy stops at the first end-of-turn
    prediction = bb.tokenizer.decode(tokens[:ends[0]] if ends else tokens, skip_special_tokens=True).strip()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(answer_ids)], answer_ids, prediction


def kl_by_hand(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = np.exp(p_logits.double().numpy() - np.logaddexp.reduce(p_logits.double().numpy(), axis=1, keepdims=True))
    q = np.exp(q_logits.double().numpy() - np.logaddexp.reduce(q_logits.double().numpy(), axis=1, keepdims=True))
    return float(np.mean(np.sum(p * (np.log(p) - np.log(q)), axis=1)))


def test_rows_match_values_computed_by_hand(tmp_path, tiny, toy_methods):
    cfg = config(tmp_path, toy_hotpotqa(tmp_path / "toy.json"))
    result = runner.run_quality(cfg, tiny)
    examples = {e.id: e for e in runner.load_examples(cfg.data, count_tokens=tiny.count_tokens, context_tokens=160)}
    got = records(cfg.out)
    for example in examples.values():
        answer = example.answers[0]
        full, _, _ = naive_answer_logits(tiny, example.context, example.question, answer)
        oracle, answer_ids, prediction = naive_answer_logits(tiny, ORACLE_TEXT[example.question], example.question,
                                                             answer)
        r = got[example.id, "oracle"]
        assert (r["sp_recall"], r["answer_recall"]) == HAND[example.question]
        assert r["kl"] == pytest.approx(kl_by_hand(full, oracle), rel=1e-3, abs=1e-5)
        nll = -torch.log_softmax(oracle.double(), -1)[torch.arange(len(answer_ids)), answer_ids].mean()
        assert r["nll"] == pytest.approx(float(nll), rel=1e-3)
        assert r["prediction"] == prediction
        assert (r["f1"], r["em"]) == (f1_score(prediction, answer), exact_match(prediction, answer))
        n_context = tiny.count_tokens(example.context)
        assert r["compression"] == pytest.approx(n_context / tiny.count_tokens(ORACLE_TEXT[example.question]))
        # the whole context: every gold sentence covered, the full prompt again, so KL against full is 0
        for name in ("full", "whole"):
            assert got[example.id, name]["sp_recall"] == 1.0 and got[example.id, name]["answer_recall"] == 1.0
            assert got[example.id, name]["kl"] == pytest.approx(0.0, abs=1e-9)
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["oracle"]["n"] == 2 and rows["oracle"]["sp_recall"] == 0.5
    assert rows["oracle"]["kl"] == pytest.approx(np.mean([got[e, "oracle"]["kl"] for e in examples]))
    assert rows["oracle"]["retention"]["answer_recall"] == 1.0  # 1.0 / full's 1.0


def test_json_follows_the_schema_and_outputs_lie_beside_it(tmp_path, tiny, toy_methods):
    cfg = config(tmp_path, toy_hotpotqa(tmp_path / "toy.json"), methods=("full", "oracle"), generate=False)
    runner.run_quality(cfg, tiny)
    data = json.loads(cfg.out.read_text())
    assert data["schema"] == "endo-bench-quality/1"
    assert {"model", "data", "context_tokens", "budget", "seed"} <= data["config"].keys()
    assert data["config"]["context_tokens"] == 160 and data["config"]["budget"] == 64
    for row in data["rows"]:
        assert {"method", "n", "budget", "context_tokens", "sp_recall", "answer_recall", "kl", "nll", "f1", "em",
                "compression", "latency_ms", "peak_rss_mb"} <= row.keys()
        assert set(row["latency_ms"]) == {"index", "query", "generate"} and row["peak_rss_mb"] > 0
        assert row["f1"] is None and row["em"] is None  # --no-generate
    table = cfg.out.with_suffix(".md").read_text()
    assert "| 160 | 64 | oracle | 2 | 0.500 | 1.000 |" in table
    for plot in ("recall", "kl", "latency"):
        assert (tmp_path / f"q-{plot}.png").read_bytes()[:4] == b"\x89PNG"


def test_resume_computes_nothing_already_done(tmp_path, tiny, toy_methods, monkeypatch):
    cfg = config(tmp_path, toy_hotpotqa(tmp_path / "toy.json"), methods=("full", "oracle"), generate=False)
    first = runner.run_quality(cfg, tiny)
    store = cfg.out.with_suffix(".records.jsonl")
    lines = store.read_text().splitlines()
    store.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:10])  # interrupted while writing the last record
    calls = []
    original = runner.Evaluator.evaluate
    monkeypatch.setattr(runner.Evaluator, "evaluate", lambda self, *a: calls.append(a) or original(self, *a))
    second = runner.run_quality(cfg, tiny)
    assert len(calls) == 1  # only the cut-short record
    calls.clear()
    third = runner.run_quality(cfg, tiny)
    assert calls == []
    assert second["rows"] == third["rows"]
    metrics_of = lambda rows: [{k: r[k] for k in runner.METRIC_KEYS} for r in rows]  # latency is re-measured
    assert metrics_of(first["rows"]) == metrics_of(second["rows"])
    with pytest.raises(ValueError, match="other settings"):  # another seed would mix haystacks
        runner.run_quality(config(tmp_path, cfg.data, methods=("oracle",), seed=1), tiny)


def test_unknown_method_lists_the_known_ones(capsys):
    with pytest.raises(ValueError, match="known methods: full, s3, s3-hybrid, ilre, bm25, bm25-sent, dense"):
        runner.parse_methods("s3,nope")
    from endo_retrieval.cli import main

    assert main(["bench", "quality", "--data", "x.json", "--out", "x.json", "--methods", "nope"]) == 2
    assert "Unknown method(s) 'nope'; known methods: full, s3," in capsys.readouterr().err


def test_malformed_row_reported_by_line_and_skipped_only_when_asked(tmp_path, tiny, toy_methods):
    rows = [{"context": "Zanthor is a city on the Velna river.", "question": q, "answers": [a]}
            for q, (a, _) in GOLD.items()]
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps(rows[0]) + "\n{\"context\": 3}\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(DataError, match="line 2"):
        runner.run_quality(config(tmp_path, data, methods=("whole",), generate=False), tiny)
    result = runner.run_quality(config(tmp_path, data, methods=("whole",), generate=False, skip_bad=True), tiny)
    assert result["rows"][0]["n"] == 2
    assert len(result["config"]["skipped_rows"]) == 1 and "line 2" in result["config"]["skipped_rows"][0]


def test_unavailable_method_row_says_why(tmp_path, tiny, toy_methods, monkeypatch):
    monkeypatch.setitem(runner.METHODS, "whole", "no_such_peer_module:Press")
    result = runner.run_quality(config(tmp_path, toy_hotpotqa(tmp_path / "toy.json"), methods=("whole",),
                                       generate=False), tiny)
    (row,) = result["rows"]
    assert row["n"] == 0 and row["kl"] is None and "cannot run here" in row["note"]


def test_bm25_chunks_keep_best_chunks_in_source_order(tiny):
    from endo_retrieval.methods.baselines import BM25Chunks, Chunks

    context = " ".join(f"Sentence {i} talks about weather and clouds." for i in range(60))
    context += " The treasure is buried under the old oak tree."
    chunks = Chunks.of(tiny, context, size=32)
    assert "".join(chunks.texts) == context  # adjacent chunks concatenate back into the source
    assert all(s.n_tokens == 32 for s in chunks.spans[:-1])
    out = BM25Chunks(tiny, chunk_tokens=32).compress(context, "Where is the treasure buried?", budget=40)
    assert "treasure is buried under the old oak tree" in out.text
    assert out.n_tokens <= 40 and len(out.spans) == 1
    # two non-adjacent chunks: the "\n" between them costs tokens, taken from the weaker chunk, not a whole chunk
    two = BM25Chunks(tiny, chunk_tokens=32).compress("The treasure map is old. " + context, "treasure map", 64)
    assert len(two.spans) == 2 and two.spans[0].start == 0 and 60 <= two.n_tokens <= 64
    assert two.n_tokens == tiny.count_tokens(two.text)


def test_dense_ranks_the_matching_chunk_first(tiny):
    pytest.importorskip("sentence_transformers")
    from endo_retrieval.methods.baselines import Dense

    context = ("Volcanoes erupt molten rock called lava. " * 8 + "Penguins live in Antarctica and eat krill. " * 8
               + "The stock market fell sharply on Monday. " * 8)
    out = Dense(tiny, chunk_tokens=64).compress(context, "What do penguins eat?", budget=64)
    assert "Penguins live in Antarctica" in out.text and "Volcanoes" not in out.text


@pytest.mark.slow  # importing kvpress takes ~20 s here
def test_kvpress_peer_at_full_budget_is_full_and_keeps_the_matched_budget(tmp_path, tiny, toy_methods):
    pytest.importorskip("kvpress")
    cfg = config(tmp_path, toy_hotpotqa(tmp_path / "toy.json"), methods=("full", "streamingllm", "snapkv"),
                 budgets=[48, 1000], generate=False)
    runner.run_quality(cfg, tiny)
    lines = cfg.out.with_suffix(".records.jsonl").read_text().splitlines()[1:]
    got = {(r["example"], r["method"], r["budget"]): r for r in map(json.loads, lines)}
    for example in ("toy0", "toy1"):
        for peer in ("streamingllm", "snapkv"):
            assert got[example, peer, 1000]["kl"] == pytest.approx(0.0, abs=1e-6)  # nothing dropped
            assert got[example, peer, 48]["selected_tokens"] == 48
            assert got[example, peer, 48]["kl"] > 0 and got[example, peer, 48]["sp_recall"] is None
