"""`endo bench quality`: per-row metrics against values computed by hand on a two-item toy set, KL of the full
context against itself, resumption, bad input, the JSON schema, and the chunk baselines. A tiny random model
(conftest.make_tiny_model) stands in for the default one: the numbers are plumbing checks, not quality."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_tiny_model, shared_data
from endo_bench import runner
from endo_retrieval.calibration.datasets import DataError
from endo_bench.metrics import exact_match, f1_score
from endo_retrieval.core import Compressed

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
    from endo_retrieval.model.backbone import Backbone

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
        assert {"sp_recall_ci", "answer_recall_ci"} <= row.keys() and "diff_to_bm25" not in row  # no bm25 row
    table = cfg.out.with_suffix(".md").read_text()
    assert "| 160 | 64 | oracle | 2 | 0.500 [0.500, 0.500] | 1.000 [1.000, 1.000] | – | – |" in table
    for plot in ("recall", "kl", "latency"):
        assert (tmp_path / f"q-{plot}.png").read_bytes()[:4] == b"\x89PNG"


def test_no_reference_skips_the_full_context_pass(tmp_path, tiny, toy_methods, monkeypatch):
    """--no-reference (long contexts past the window): no full-context pass for a compressed row, so no kl;
    the other metrics as with it."""
    cfg = config(tmp_path, toy_hotpotqa(tmp_path / "toy.json"), methods=("oracle",), generate=False, reference=False)
    whole = []
    monkeypatch.setattr(runner.Evaluator, "whole_prompt", lambda self, *a: whole.append(a))
    runner.run_quality(cfg, tiny)
    assert whole == []
    got = records(cfg.out)
    assert got and all(r["kl"] is None and r["nll"] is not None and r["sp_recall"] is not None for r in got.values())
    assert json.loads(cfg.out.read_text())["config"]["reference"] is False


def test_rows_carry_bootstrap_intervals_and_the_paired_difference_to_bm25(tmp_path):
    cfg = runner.QualityConfig(data="toy.json", out=tmp_path / "q.json", context_tokens=[160], budgets=[64],
                               methods=["bm25", "s3", "ilre"])

    def record(example, method, sp, ans, **extra):
        return {"example": example, "method": method, "budget": 64, "context_tokens": 160, "sp_recall": sp,
                "answer_recall": ans, **dict.fromkeys(("kl", "nll", "f1", "em", "compression")),
                "latency_ms": {"index": 1.0, "query": 1.0, "generate": 1.0}, "peak_rss_mb": 1.0, **extra}

    records = [record("e1", "bm25", 0.5, 1.0), record("e2", "bm25", 1.0, None), record("e3", "bm25", 0.0, 0.0),
               record("e1", "s3", 1.0, 1.0), record("e2", "s3", 1.0, 1.0), record("e3", "s3", 0.5, None),
               record("e4", "s3", 0.0, 0.0, error="boom")]  # failed: left out of means and pairs alike
    rows = {r["method"]: r for r in runner.aggregate(records, cfg, {"ilre": "cannot run here: test"})}
    s3, bm25 = rows["s3"], rows["bm25"]
    assert s3["sp_recall_ci"][0] <= s3["sp_recall"] <= s3["sp_recall_ci"][1]
    assert bm25["answer_recall_ci"] == [0.0, 1.0]  # two examples, 1 and 0: resampled means 0, 0.5 or 1
    # sp_recall pairs e1, e2, e3: differences 0.5, 0, 0.5; answer_recall pairs only e1 (e2, e3 have a None)
    assert s3["diff_to_bm25"]["sp_recall"]["value"] == pytest.approx(1 / 3)
    assert s3["diff_to_bm25"]["sp_recall"]["lo"] == 0.0 and s3["diff_to_bm25"]["sp_recall"]["hi"] == 0.5
    assert s3["diff_to_bm25"]["answer_recall"] == {"value": 0.0, "lo": 0.0, "hi": 0.0}
    assert all(d == {"value": 0.0, "lo": 0.0, "hi": 0.0} for d in bm25["diff_to_bm25"].values())
    assert rows["ilre"]["sp_recall_ci"] is None and "diff_to_bm25" not in rows["ilre"]
    table = runner.markdown_table({"config": {"model": "m", "data": "d", "seed": 0, "n_examples": {}, "generate": False,
                                              "wall_s": 0, "notes": []}, "rows": list(rows.values())})
    assert "| 160 | 64 | s3 | 3 | 0.833 [" in table and "| +0.333 [+0.000, +0.500] | +0.000 [+0.000, +0.000] |" in table


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
    with pytest.raises(ValueError, match="known methods: full, s3, s3-hybrid, ilre, heads, endo, endo-context, "
                                         "endo-2stage, bm25, bm25-sent, dense"):
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
    from endo_bench.baselines import BM25Chunks, Chunks

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
    from endo_bench.baselines import Dense

    context = ("Volcanoes erupt molten rock called lava. " * 8 + "Penguins live in Antarctica and eat krill. " * 8
               + "The stock market fell sharply on Monday. " * 8)
    out = Dense(tiny, chunk_tokens=64).compress(context, "What do penguins eat?", budget=64)
    assert "Penguins live in Antarctica" in out.text and "Volcanoes" not in out.text


@pytest.mark.slow  # importing kvpress takes tens of seconds
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


def test_feeding_several_tokens_in_one_forward_equals_one_at_a_time(tiny):
    """runner.feed's one multi-token forward (explicit positions, mask from the cache) against single tokens, on a
    full cache, on a cache with pairs dropped from its middle (positions run past its length, as after kvpress),
    and on layers of different lengths (PyramidKV), where feed itself falls back to single tokens."""
    import copy

    from transformers import DynamicCache

    model = tiny.model
    ids = torch.tensor(tiny.encode("The Velna rises in the Kesh hills and flows north to Zanthor.").ids)
    new = torch.tensor(tiny.encode(" Mara Tesk was a weaver").ids)
    for case in ("full", "dropped", "uneven"):
        cache = DynamicCache()
        with torch.inference_mode():
            model.model(input_ids=ids[None], past_key_values=cache)
        for i, layer in enumerate(cache.layers):
            if case != "full":
                keep = torch.cat([torch.arange(3), torch.arange(8 + (i if case == "uneven" else 0), len(ids))])
                layer.keys, layer.values = layer.keys[..., keep, :], layer.values[..., keep, :]
        other = copy.deepcopy(cache)
        with torch.inference_mode():
            together = runner.feed(model, cache, new, len(ids))
            alone = torch.cat([runner.feed(model, other, new[i:i + 1], len(ids) + i) for i in range(len(new))])
        assert together.shape == (len(new), model.config.vocab_size)
        torch.testing.assert_close(together, alone, atol=1e-4, rtol=1e-4)
        assert [l.keys.shape[-2] for l in cache.layers] == [l.keys.shape[-2] for l in other.layers]


def naive_press_scored(bb, prompt: runner.Prompt, press, max_new_tokens: int) -> tuple[torch.Tensor, str, int]:
    """The press on its own, as kvpress documents it (`with press(model)` around the prefill), then every token
    fed alone: the reference for the runner's one shared prefill and its multi-token feeds."""
    from transformers import DynamicCache

    model, cache, position = bb.model, DynamicCache(), len(prompt.prefill)
    with torch.inference_mode():
        with press(model) if press is not None else torch.inference_mode():
            model.model(input_ids=prompt.prefill[None], past_key_values=cache)
        kept = cache.get_seq_length()
        rows = []
        for token in torch.cat([prompt.suffix, prompt.answer]).tolist():
            out = model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                        position_ids=torch.tensor([[position]]))
            rows.append(out.logits[0, -1].float())
            position += 1
        logits = torch.stack(rows[len(prompt.suffix) - 1: -1])
        for layer in cache.layers:  # back to the end of the header
            n = layer.keys.shape[-2] - len(prompt.answer)
            layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]
        position -= len(prompt.answer)
        tokens = [int(logits[0].argmax())]
        stop = runner._eos_ids(bb)
        while tokens[-1] not in stop and len(tokens) < max_new_tokens:
            out = model(input_ids=torch.tensor([tokens[-1:]]), past_key_values=cache,
                        position_ids=torch.tensor([[position]]))
            tokens.append(int(out.logits[0, -1].argmax()))
            position += 1
    return logits, bb.tokenizer.decode([t for t in tokens if t not in stop], skip_special_tokens=True).strip(), kept


@pytest.mark.slow  # importing kvpress takes tens of seconds
def test_one_shared_prefill_equals_each_press_alone(tiny):
    pytest.importorskip("kvpress")
    from endo_bench.baselines import PyramidKV, SnapKV, StreamingLLM

    # long enough that PyramidKV at ratio 0.2 gives its layers different budgets (kvpress: >= 1,280 kept pairs)
    context = " ".join(f"Paragraph {i} says the river Velna passes mill {i}." for i in range(160))
    prompt = runner.Prompter(tiny)(context, "Which river passes the mills?", "the Velna")
    presses = [None] + [peer().make_press(0.6) for peer in (SnapKV, StreamingLLM, PyramidKV)]
    presses.append(PyramidKV().make_press(0.2))
    got = runner.score_prompt(tiny, prompt, presses, max_new_tokens=4)
    for press, scored in zip(presses, got):
        logits, prediction, kept = naive_press_scored(tiny, prompt, press, 4)
        torch.testing.assert_close(scored.answer_logits, logits, atol=1e-4, rtol=1e-4)
        assert (scored.prediction, scored.kv_kept) == (prediction, kept)
        assert scored.prefill_ms > 0 and scored.generate_ms >= scored.prefill_ms
    assert got[1].kv_kept < got[0].kv_kept == len(prompt.prefill)
    assert got[4].kv_kept > len(prompt.prefill) * 0.8 + 1  # layer 0 holds more than the mean: uneven layers


class Indexed:
    """A two-stage method whose index is shared with others of its `index_kind`; counts its indexing."""

    index_kind = "words"
    built: list = []

    def __init__(self, backbone=None):
        self.backbone = backbone

    def prepare(self, context: str):
        self.built.append(type(self).__name__)
        return context.split()

    def select(self, words: list[str], question: str, budget: int) -> Compressed:
        text = " ".join(words[:budget])
        return Compressed(text, [], self.backbone.count_tokens(text), "indexed", budget)


class IndexedToo(Indexed):
    pass


class OwnIndex(Indexed):
    index_kind = None


def test_methods_of_one_index_kind_share_the_index(tmp_path, tiny, monkeypatch):
    for name, cls in (("indexed", "Indexed"), ("indexed-too", "IndexedToo"), ("own", "OwnIndex")):
        monkeypatch.setitem(runner.METHODS, name, f"{__name__}:{cls}")
    Indexed.built.clear()
    cfg = config(tmp_path, toy_hotpotqa(tmp_path / "toy.json"), methods=("indexed", "indexed-too", "own"),
                 budgets=[8, 16], generate=False)
    runner.run_quality(cfg, tiny)
    # per example: one index for both methods of kind "words" at both budgets; the kind-less one builds each time
    assert Indexed.built == ["Indexed", "OwnIndex", "OwnIndex"] * 2
    got = records(cfg.out)
    for example in ("toy0", "toy1"):
        assert got[example, "indexed-too"]["latency_ms"]["index"] == got[example, "indexed"]["latency_ms"]["index"]
        assert got[example, "indexed-too"]["latency_ms"]["index"] > 0


def test_bm25_index_skips_the_sae_pass_and_refuses_s3(tiny):
    from endo_retrieval import BM25, Document, EndoIndex, SAEBank, TopKSAE

    torch.manual_seed(0)
    bank = SAEBank({l: TopKSAE(tiny.head_dim, 64, 4) for l in (0, 1)},
                   {"d_latent": 64, "k": 4, "model_hash": tiny.model_hash, "model": tiny.model_id})
    context = " ".join(f"Sentence {i} is about clouds over the hills." for i in range(40))
    context += " Zanthor lies on the Velna."
    lexical = EndoIndex(tiny, method="bm25", saes=bank)
    lexical.add_documents([Document("context", context)])
    assert lexical.index.n_postings == 0
    with pytest.raises(ValueError, match="method='bm25'.*'s3'"):
        lexical.search("Where is Zanthor?", method="s3")
    both = EndoIndex(tiny, method="s3-hybrid", saes=bank)
    both.add_documents([Document("context", context)])
    assert both.index.n_postings > 0
    question = "Where does Zanthor lie?"
    assert lexical.select(question, 40, "bm25") == both.select(question, 40, "bm25")
    out = BM25(tiny, saes=bank).compress(context, question, 40)
    assert "Zanthor lies on the Velna." in out.text and out.n_tokens <= 40


def test_legacy_cache_adapter_round_trips_llmlinguas_tuples(tiny):
    """llmlingua slices the returned cache as (keys, values) pairs and hands it back: logits must equal one plain
    forward over the whole text."""
    from endo_bench.baselines import _LegacyCacheModel

    ids = torch.from_numpy(tiny.encode("Zanthor is a city on the Velna river, founded by weavers.").ids)[None]
    wrapped = _LegacyCacheModel(tiny.model)
    with torch.inference_mode():
        whole = tiny.model(ids).logits
        first = wrapped(ids[:, :6], attention_mask=torch.ones(1, 6, dtype=torch.long), use_cache=True)
        pairs = first.past_key_values
        assert isinstance(pairs, list) and all(len(p) == 2 for p in pairs) and pairs[0][0].shape[2] == 6
        pairs = [[k[:, :, :5], v[:, :, :5]] for k, v in pairs]  # llmlingua drops the last position and refeeds it
        rest = wrapped(ids[:, 5:], attention_mask=torch.ones(ids.shape, dtype=torch.long), past_key_values=pairs)
    torch.testing.assert_close(rest.logits, whole[:, 5:], atol=1e-4, rtol=1e-4)
    assert wrapped.config is tiny.model.config


@pytest.mark.slow  # importing llmlingua takes seconds
def test_longllmlingua_compresses_with_the_local_model(tiny):
    pytest.importorskip("llmlingua")
    from endo_bench.baselines import LongLLMLingua

    mills = [f"Mill {i}: the river Velna turns the wheel of mill {i} every spring." for i in range(12)]
    # the first paragraph does not survive the tokenizer's default decode clean-up (" ," -> ","), which
    # llmlingua's get_prefix_length asserts against
    context = "\n\n".join(['Algiers (Arabic: \u0627\u0644\u062c\u0627\u0645\u0639 \u200e , "Jemaa Kebir") is old .']
                           + mills)
    out = LongLLMLingua(tiny).compress(context, "Which river turns the wheels?", budget=40)
    assert 0 < out.n_tokens <= 40 and out.n_tokens == tiny.count_tokens(out.text)


def test_bm25_chunks_shorten_the_weakest_chunk_as_often_as_needed(tiny):
    """HotpotQA dev example 152b9e..: the first shortening of the weakest chunk was not enough and the second one
    looked the shortened chunk up among the originals (ValueError)."""
    from endo_bench.baselines import BM25Chunks

    data = shared_data("hotpotqa", "dev30.json")
    (example,) = [e for e in runner.load_examples(str(data), count_tokens=tiny.count_tokens, context_tokens=4096,
                                                  limit=5, seed=0) if e.id.startswith("152b9e2c")]
    out = BM25Chunks(tiny).compress(example.context, example.question, 1024)
    assert 1000 <= out.n_tokens <= 1024 and out.n_tokens == tiny.count_tokens(out.text)
