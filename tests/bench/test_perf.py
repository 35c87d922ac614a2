"""`endo bench perf` on a tiny random model with random SAEs: the JSON contract, tiling against real indexing, the
out-of-memory path, the ttft line fit, greedy decoding against Hugging Face's, and bad arguments. The numbers are
plumbing checks, not performance."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
from tqdm import tqdm

from conftest import make_tiny_model
from endo_retrieval.cli import main
from endo_bench import perf, perf_e2e

REQUIRED = {"index_tokens_per_s": "tok/s", "bare_forward_tokens_per_s": "tok/s", "peak_rss_mb": "MiB",
            "query_p50_ms": "ms", "query_p95_ms": "ms", "index_bytes_per_posting": "B/posting", "e2e_ms": "ms",
            "ttft_ms": "ms", "index_overhead": "ratio", "index_bytes_per_token": "B/token", "peak_accel_mb": "MiB"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from endo_retrieval import Backbone, SAEBank, TopKSAE

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from threads and loses much on a shared machine
    root = tmp_path_factory.mktemp("perf")
    folder = make_tiny_model("llama", root / "model", layers=3)
    bb = Backbone(folder, device="cpu")
    torch.manual_seed(0)
    bank = SAEBank({l: TopKSAE(bb.head_dim, 256, 8) for l in (0, 2)},
                   {"d_latent": 256, "k": 8, "model_hash": bb.model_hash, "model": bb.model_id})
    bank.save(root / "sae")
    (root / "text").mkdir()
    (root / "text" / "filler.txt").write_text(perf.generated_filler(sentences=240))  # ~3.5k tokens
    yield bb, bank, root
    torch.set_num_threads(threads)


def cli(root, *extra) -> int:
    return main(["bench", "perf", "--out", str(root / "out" / "perf.json"), "--model", str(root / "model"),
                 "--sae", str(root / "sae"), "--ilre-layer", "1", "--text", str(root / "text"), *extra])


SMALL = ["--index-tokens", "512", "--lengths", "256,512", "--corpus-sizes", "512,1024", "--e2e-lengths", "512",
         "--ttft-lengths", "384,512,640", "--budget", "128", "--max-new-tokens", "3", "--questions", "2",
         "--query-questions", "3", "--chunk-size", "128"]


def test_json_contract_and_outputs(tiny):
    bb, _, root = tiny
    assert cli(root, *SMALL) == 0
    result = json.loads((root / "out" / "perf.json").read_text())
    assert result["schema"] == "endo-bench-perf/1"
    assert {"device_name", "torch", "model"} <= set(result["config"])
    rows = result["rows"]
    for r in rows:
        assert {"metric", "method", "context_tokens", "value", "unit", "device"} <= set(r)
        assert r["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # the CLI's default device
        assert r["value"] is None or isinstance(r["value"], float)
    units = {r["metric"]: r["unit"] for r in rows}
    assert {m: units.get(m) for m in REQUIRED} == REQUIRED
    assert {r["section"] for r in rows} == set(perf.DEFAULT_SECTIONS)  # scale (Ray) only when asked for
    # the overhead row is the median of the rounds' paired ratios of the two throughput rows
    index = {r["metric"]: r for r in rows if r["section"] == "index" and r["method"] != "s3-index+corpus"}
    bare, built = index["bare_forward_tokens_per_s"]["per_round"], index["index_tokens_per_s"]["per_round"]
    paired = [b / i - 1 for b, i in zip(bare, built)]
    assert len(paired) == 5 and index["index_overhead"]["per_round"] == pytest.approx(paired)
    assert index["index_overhead"]["value"] == pytest.approx(sorted(paired)[2])
    assert index["bare_forward_tokens_per_s"]["value"] == pytest.approx(sorted(bare)[2])
    query = [r for r in rows if r["metric"] == "query_p50_ms"]
    assert [(r["context_tokens"], r["questions"]) for r in query] == [(512, 3), (1024, 3)]
    assert "tiled: 2 copies" in query[1]["note"] and query[0]["note"] == "indexed"
    # s3-hybrid's query in stages, each with its share of the query's p50, and endo's first stage alone
    stages = {(r["metric"], r["context_tokens"]): r for r in rows if r["metric"].startswith("stage_")}
    assert set(stages) == {(f"stage_{s}_p50_ms", n) for s in ("forward", "s3_score", "bm25", "selection")
                           for n in (512, 1024)}
    for (metric, n), r in stages.items():
        p50 = next(q["value"] for q in query if q["context_tokens"] == n)
        assert r["method"] == "s3-hybrid" and r["value"] > 0 and r["share"] == pytest.approx(r["value"] / p50)
    first = {(r["metric"], r["context_tokens"]) for r in rows if r["method"] == "endo"}
    assert first == {(m, n) for m in ("first_stage_p50_ms", "first_stage_p95_ms", "first_stage_first_ms")
                     for n in (512, 1024)} | {("endo_query_p50_ms", 512)}
    (whole,) = [r for r in rows if r["metric"] == "endo_query_p50_ms"]  # the tiny model has no heads profile
    assert whole["value"] is None and "calibrate-heads" in whole["note"]
    e2e = {(r["method"], r["questions"]) for r in rows if r["metric"] == "e2e_ms"}
    assert e2e == {("full", 1), ("ilre", 1), ("s3-hybrid", 1), ("s3-hybrid", 2)}
    assert all(r["value"] > 0 for r in rows if r["metric"] in ("e2e_ms", "ttft_ms"))
    (fit,) = result["ttft_fit"]
    assert (fit["method"], fit["points"], fit["lengths"]) == ("ilre", 3, [384, 512, 640])
    md = (root / "out" / "perf.md").read_text()
    assert "### query" in md and "| e2e_ms | s3-hybrid (2 q, amortised) | ms |" in md and "ttft fit, ilre" in md
    assert (root / "out" / "perf.query.png").stat().st_size > 0


def test_tiled_index_equals_indexing_the_copies(tiny):
    from endo_retrieval.methods.search import Document, EndoIndex

    bb, bank, _ = tiny
    text = perf.generated_filler(sentences=24)
    base = EndoIndex(bb, "s3-hybrid", saes=bank, chunk_size=64)
    base.add_documents([Document("d", text)])
    tiled = perf.tile_index(base, 3)
    real = EndoIndex(bb, "s3-hybrid", saes=bank, chunk_size=64)
    real.add_documents([Document(f"d#{c}", text) for c in range(3)])
    assert tiled.corpus.n_positions == real.corpus.n_positions == 3 * base.corpus.n_positions
    assert tiled.doc_ids == real.doc_ids
    np.testing.assert_array_equal(tiled.corpus.sentence_starts(), real.corpus.sentence_starts())
    for layer in bank.layers:
        for a, b in zip(tiled.index.postings(layer), real.index.postings(layer)):
            np.testing.assert_array_equal(a, b)
        assert tiled.index.n_tokens(layer) == real.index.n_tokens(layer)
    question = "What did the town council do on Tuesdays?"
    scores = tiled.s3_scores(question)
    np.testing.assert_array_equal(scores, real.s3_scores(question))
    assert scores.any()
    copies = scores.reshape(3, -1)  # every copy scores alike
    np.testing.assert_array_equal(copies[0], copies[2])
    assert tiled.index.bytes_per_posting() == real.index.bytes_per_posting()
    with pytest.raises(ValueError, match="copies must be >= 1"):
        perf.tile_index(base, 0)


def test_out_of_memory_is_recorded_and_the_run_goes_on(tiny, monkeypatch):
    bb, bank, root = tiny

    def out_of_memory(*_args, **_kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(perf_e2e, "time_full", lambda backbone, context, question, new: out_of_memory()
                        if len(context) > 1500 else perf_e2e.greedy(backbone, context, question, new)[0])
    source = perf.TextSource.load(bb, str(root / "text"))
    args = argparse.Namespace(budget=64, max_new_tokens=2, ilre_layer=1, questions=2, chunk_size=64)
    rows = perf_e2e.e2e_rows(bb, bank, source, [384, 512], args, tqdm(disable=True))
    full = {(r["context_tokens"]): r for r in rows if r["method"] == "full" and r["metric"] == "e2e_ms"}
    assert full[384]["value"] is None and full[384]["note"] == "out of memory"
    assert full[512]["value"] is None and "ran out at 384 tokens; skipped" in full[512]["note"]
    others = [r for r in rows if r["method"] != "full" and r["metric"] == "e2e_ms"]
    assert len(others) == 6 and all(r["value"] > 0 for r in others)


def test_fit_recovers_known_lines():
    a, b, r2 = perf_e2e.fit_line([1024, 4096, 16384], [3 + 0.5 * x for x in (1024, 4096, 16384)])
    assert (a, b, r2) == pytest.approx((3.0, 0.5, 1.0))
    # by hand: y = 1.5 + 0.5 x, residuals (-0.5, 1, -0.5), SS_res 1.5, SS_tot 2 -> R^2 0.25
    assert perf_e2e.fit_line([0, 1, 2], [1, 3, 2]) == pytest.approx((1.5, 0.5, 0.25))
    rows = [perf.row("ttft", "ttft_ms", "ilre", n, 10 + n / 100, "ms", "cpu") for n in (1000, 2000, 4000)]
    rows.append(perf.row("ttft", "ttft_ms", "ilre", 8000, None, "ms", "cpu", note="out of memory"))
    (fit,) = perf_e2e.fits(rows, "m")
    assert fit["model"] == "m" and fit["points"] == 3
    assert (fit["intercept_ms"], fit["ms_per_1k_tokens"], fit["r2"]) == pytest.approx((10.0, 10.0, 1.0))


def test_greedy_with_cache_matches_hugging_face_generate(tiny):
    bb, _, _ = tiny
    context, question = perf.generated_filler(sentences=6), "What ran twice a day?"
    timing, tokens = perf_e2e.greedy(bb, context, question, 6)
    ids = bb.chat_ids(perf_e2e.USER_TEMPLATE.format(context=context, question=question))
    expected = bb.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                                 do_sample=False, pad_token_id=bb.tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
    assert tokens == expected
    assert 0 < timing.ttft_s <= timing.total_s


@pytest.mark.parametrize("extra, message", [
    (["--sections", "index,speed"], "unknown section 'speed'"),
    (["--e2e-lengths", "1024"], "not longer than --budget 1024"),
    (["--corpus-sizes", "512,768", "--query-base", "512"], "768 is not a multiple of --query-base 512"),
    (["--lengths", "0,512"], "--lengths needs positive token counts"),
    (["--questions", "0"], "--questions must be >= 1"),
])
def test_bad_arguments_fail_before_loading_the_model(extra, message, capsys, tmp_path):
    assert main(["bench", "perf", "--out", str(tmp_path / "p.json"), "--model", str(tmp_path / "absent"),
                 *extra]) == 2
    assert message in capsys.readouterr().err  # the model folder does not exist: validation came first


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_random_8b_needs_cuda(capsys, tmp_path):
    assert main(["bench", "perf", "--out", str(tmp_path / "p.json"), "--random-llama-8b"]) == 2
    assert "--random-llama-8b needs a CUDA device" in capsys.readouterr().err


def test_text_errors_say_how_much_text_there_is(tiny, capsys, tmp_path):
    bb, _, root = tiny
    held = perf.TextSource.load(bb, str(root / "text")).n_tokens
    assert cli(root, "--sections", "memory", "--lengths", str(held + 1), "--no-repeat") == 2
    assert f"holds {held} tokens" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["bench", "perf", "--out", str(tmp_path / "p.json"), "--model", str(root / "model"), "--sae",
                 str(root / "sae"), "--text", str(tmp_path / "empty"), "--sections", "index"]) == 2
    assert "no .txt files" in capsys.readouterr().err
    source = perf.TextSource.load(bb, str(root / "text"))  # repeating: about n tokens, the text twice and more
    longer = source.take(2 * held + 100)
    assert longer.startswith(source.text * 2) and abs(bb.count_tokens(longer) - (2 * held + 100)) <= 4


def test_s3_timings_never_exceed_the_wall_clock(tiny, monkeypatch):
    """Each question's time is its selection plus one generation: the sum cannot exceed the elapsed time (a
    selection clock read after generating once counted every generation twice)."""
    import time

    bb, bank, root = tiny

    def slow_greedy(backbone, context, question, new):
        time.sleep(0.2)
        return perf_e2e.Timing(0.05, 0.2), [0]

    monkeypatch.setattr(perf_e2e, "greedy", slow_greedy)
    context = perf.TextSource.load(bb, str(root / "text")).take(512)
    start = time.perf_counter()
    index_s, timings = perf_e2e.time_s3(bb, bank, context, ["What do the ships carry?"] * 3, 64, 2, 128)
    wall = time.perf_counter() - start
    assert len(timings) == 3 and all(t.ttft_s < t.total_s for t in timings)
    assert index_s + sum(t.total_s for t in timings) <= wall + 1e-3
    assert all(t.total_s - t.ttft_s == pytest.approx(0.15) for t in timings)


def test_ilre_section_rows_and_agreement(tiny):
    """The ilre section on the tiny model: every variant's stages and rates, and its kept tokens against the
    default's: the same where the faster path computes the same states (text tokenised first, one chunk per
    forward), fewer where it computes others (the cached frame)."""
    from endo_bench.perf_ilre import VARIANTS, ilre_rows

    bb, _, root = tiny
    source = perf.TextSource.load(bb, str(root / "text"))
    rows = ilre_rows(bb, source, [2500], budget=128, layer=2, peak_tflops=1.0)
    by = {(r["method"], r["metric"]): r for r in rows}
    assert {m for m, _ in by} == set(VARIANTS)
    for method in VARIANTS:
        stages = sum(by[method, f"stage_{s}_ms"]["value"] for s in ("encode", "prefill", "scores", "allocate"))
        assert by[method, "total_ms"]["value"] == pytest.approx(stages, rel=1e-6)
        assert by[method, "prefill_tflops"]["value"] > 0
    overlap = {m: by[m, "kept_overlap"]["value"] for m in VARIANTS}
    assert overlap["ilre"] == overlap["ilre-tokenised-first"] == overlap["ilre-unbatched"] == 1.0
    assert overlap["ilre-cached"] < 1.0 and overlap["ilre-cached-compiled"] == pytest.approx(overlap["ilre-cached"],
                                                                                            abs=0.02)
    assert by["ilre", "total_ms"]["tokenising"] == "overlapped"
    assert by["ilre-tokenised-first", "total_ms"]["tokenising"] == "before"


def test_the_endo_pipeline_rows_count_its_forwards_and_time_its_stages(tiny):
    """The whole `endo` pipeline per question in the query section: its forwards (without a profile's weights the
    pipeline reads no second hop: one forward, the read with the question and the content-free question in it),
    its stages' p50, no CUDA rows off CUDA."""
    from endo_retrieval.corpus import CorpusMap
    from endo_retrieval.index.passages import Passages

    bb, _, _ = tiny
    corpus = CorpusMap()
    for i, text in enumerate(["The Varna bridge was built in 1871. Workers found quartz under its piers.",
                              "Quartz is a hard mineral made of silicon and oxygen.",
                              "The town hall of Varna has a clock tower. Its bell was cast in Vienna."]):
        corpus.add_document(f"d{i}", text, bb.encode(text).offsets)
    questions = ["What was found under the Varna bridge?", "Where was the bell cast?"]
    rows = perf.endo_pipeline_rows(bb, corpus, Passages.build(corpus), questions, 64, {"note": "indexed"},
                                   heads=[(1, 0), (1, 1)])
    by_metric = {r["metric"]: r for r in rows}
    assert by_metric["endo_forwards_per_question"]["value"] == 1.0
    assert {"endo_query_p50_ms", "endo_query_p95_ms", "endo_stage_read_p50_ms", "endo_stage_question_p50_ms",
            "endo_stage_first_stage_p50_ms"} <= set(by_metric) and "endo_stage_hop2_p50_ms" not in by_metric
    assert all(r["value"] >= 0 and r["method"] == "endo" for r in rows)
    assert not any("cuda" in m for m in by_metric)
