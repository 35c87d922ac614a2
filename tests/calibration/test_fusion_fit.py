"""`endo calibrate-fusion` from signals files into a profile, and `endo prepare`'s hybrid first stage for a model
prepared without labels: made signals (no model read), the real CLI."""
from __future__ import annotations

import gzip
import json

import numpy as np

from endo_retrieval.calibration.fusion_rule import domain_name, transferred
from endo_retrieval.scoring.adaptive import AdaptiveWeights
from fusion_checks import held_out_wins


def signals_file(path, rng, trusted: str, n: int = 40) -> None:
    """Records in `signals.collect`'s layout whose gold candidate the `trusted` pipeline stage favours."""
    with gzip.open(path, "wt") as f:
        for q in range(n):
            docs = [f"q{q}d{i}" for i in range(12)]
            gold = int(rng.integers(12))
            pipe = {s: rng.normal(size=12) for s in ("bm25", "dense", "heads", "hop2")}
            pipe[trusted][gold] += 3.0
            rerank = {"docs": docs, "first": np.sort(rng.normal(size=12))[::-1], "heads": rng.normal(size=12)}
            rerank["heads"][gold] += 3.0
            record = {"id": str(q), "gold": [docs[gold]], "pipe": {"docs": docs} | pipe,
                      "cpu": {"heads": pipe["heads"][:8]}, "minilm": rerank, "bm25": rerank}
            f.write(json.dumps(record, default=lambda a: a.tolist()) + "\n")


def test_calibrate_fusion_writes_rules_the_pipeline_and_the_reranker_load(tmp_path):
    from endo_retrieval.cli import main

    rng = np.random.default_rng(0)
    files = [tmp_path / "fit300.jsonl.gz", tmp_path / "code_train.jsonl.gz"]
    signals_file(files[0], rng, "bm25")
    signals_file(files[1], rng, "dense")
    assert [domain_name(f) for f in files] == ["hotpotqa", "code"]
    out = tmp_path / "profile.json"
    out.write_text(json.dumps({"heads": [[1, 0]], "pipeline": {"depth": 20}}))
    assert main(["calibrate-fusion", "--signals", *map(str, files), "--out", str(out)]) in (0, None)
    profile = json.loads(out.read_text())
    assert profile["heads"] == [[1, 0]] and profile["pipeline"]["depth"] == 20  # the rest is kept
    hybrid = profile["pipeline"]["first_stages"]["hybrid"]
    assert profile["pipeline"]["first_stage"] == "hybrid" and hybrid["dense_share"] == 0.5
    assert set(hybrid["fit"]["ndcg10"]) == {"hotpotqa", "code"}
    # each entry's rule is shipped only where, fitted without a domain, it ranks that domain better than the fixed
    # fusion fitted without it does
    for entry, stages in ((hybrid, ("bm25", "dense", "heads", "hop2")), (hybrid["cpu"], ("bm25", "dense", "heads")),
                          (profile["reranker"]["minilm"], ("first_stage", "heads"))):
        held = entry["fit"]["held_out"]
        assert set(held) == {"hotpotqa", "code"}
        assert ("adaptive" in entry) == held_out_wins(entry["fit"])
        assert entry["fit"]["rule"].startswith("adaptive" if "adaptive" in entry else "fixed")
        if "adaptive" in entry:
            assert AdaptiveWeights.from_json(entry["adaptive"]).stages == stages


def test_a_model_prepared_without_labels_gets_the_hybrid_first_stage_fitted_across_domains():
    profile = transferred({"heads": [[1, 0]], "pipeline": {"depth": 10, "weights": {"bm25": 0.5, "heads": 0.5}}})
    hybrid = profile["pipeline"]["first_stages"]["hybrid"]
    assert profile["pipeline"]["first_stage"] == "hybrid" and profile["pipeline"]["depth"] == 10
    assert "smollm2" in hybrid["fit"]["from"] and hybrid["weights"] and hybrid["pools"] == ["hybrid", "dense"]
    assert AdaptiveWeights.from_json(hybrid["cpu"]["adaptive"])  # the CPU entry's rule carried to held-out domains
    assert {"minilm", "bm25"} <= set(profile["reranker"])
    own = {"pipeline": {"first_stages": {"hybrid": {"dense_share": 0.2}}}}
    assert transferred(own)["pipeline"]["first_stages"]["hybrid"] == {"dense_share": 0.2}  # its own fit stays
