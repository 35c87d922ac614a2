"""The per-model profiles the package ships: each valid, made for the model file users get, found by its hash alone
(so `EndoRetriever.from_defaults(nodes=..., backbone="qwen2.5-coder-1.5b-instruct.gguf")` runs `endo` with no
prepare step), and within the model's own shape."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from endo_retrieval.model.profiles import ASSETS, _valid, heads_profile, ilre_profile

# layers and query heads of each model a profile ships for (the models' configs)
SHAPES = {"smollm2-135m-instruct": (30, 9), "qwen2.5-coder-0.5b-instruct": (24, 14),
          "qwen2.5-coder-1.5b-instruct": (28, 12)}
REAL_MODELS_TOOL = Path(__file__).resolve().parents[3] / "shared" / "tools" / "real-models.sh"
REAL_MODELS = Path.home() / ".cache" / "endo-models"


class ModelWithHash:
    """What the profile lookup reads of a backbone: its hash and id."""

    def __init__(self, model_hash: str, model_id: str = "renamed.gguf"):
        self.model_hash, self.model_id = model_hash, model_id


def shipped(kind: str) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((ASSETS / kind).glob("*.json"))}


def test_every_model_ships_both_profiles_within_its_shape():
    heads, ilre = shipped("heads"), shipped("ilre")
    assert set(heads) == set(ilre) == set(SHAPES)
    for name, profile in heads.items():
        layers, n_heads = SHAPES[name]
        assert _valid("heads", profile) and _valid("ilre", ilre[name])
        assert profile["model_hash"] == ilre[name]["model_hash"]
        assert all(0 <= layer < layers and 0 <= head < n_heads for layer, head in profile["heads"])
        assert 0 <= ilre[name]["layer"] < layers
        pipeline = profile["pipeline"]
        assert {"depth", "read_tokens", "best_last", "weights", "fit"} <= set(pipeline)
        assert abs(sum(pipeline["weights"].values()) - 1) < 1e-6
        assert pipeline["fit"]["table"], f"{name}: the pipeline's fit table is empty"


def test_a_model_finds_its_profiles_by_hash_under_any_name():
    for name, profile in shipped("heads").items():
        model = ModelWithHash(profile["model_hash"])
        assert heads_profile(model)["heads"] == profile["heads"]
        assert ilre_profile(model)["layer"] == shipped("ilre")[name]["layer"]
    assert heads_profile(ModelWithHash("0" * 64)) is None  # another model gets none of them


def test_real_model_profiles_are_for_the_files_users_download():
    if not REAL_MODELS_TOOL.exists():
        pytest.skip(f"{REAL_MODELS_TOOL} is absent: it lists the real models' SHA-256 (../shared beside the "
                    "repository, which CI provides)")
    recorded = dict(re.findall(r"\[([\w.-]+)\]=([0-9a-f]{64})", REAL_MODELS_TOOL.read_text()))
    heads = shipped("heads")
    for name in ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"):
        assert heads[name]["model_hash"] == recorded[name]


@pytest.mark.slow
def test_the_real_model_retrieves_with_its_shipped_profile_and_no_prepare():
    path = REAL_MODELS / "qwen2.5-coder-0.5b-instruct.gguf"
    if not path.exists():
        pytest.skip(f"{path} is absent: `bash ../shared/tools/real-models.sh get qwen2.5-coder-0.5b-instruct` "
                    "downloads it (1 min, 491 MB)")
    from llama_index.core.schema import TextNode
    from llama_index.retrievers.endo import EndoRetriever

    texts = ["The Zephyr bridge crosses the Varna river near the old mill.",
             "Workers found quartz under the Zephyr bridge in 1921.",
             "The town council meets every second Tuesday in the library.",
             "Varna is known for its river festival in early summer."]
    retriever = EndoRetriever.from_defaults(nodes=[TextNode(text=t, id_=f"n{i}") for i, t in enumerate(texts)],
                                            backbone=str(path), similarity_top_k=2)
    hits = retriever.retrieve("Which mineral was found under the bridge?")
    assert hits[0].node.node_id == "n1"
    assert set(hits[0].node.metadata["endo_stage_scores"]) >= {"bm25", "heads"}


@pytest.mark.parametrize("model, cpu_rule", [("smollm2-135m-instruct", True), ("qwen2.5-coder-0.5b-instruct", False),
                                             ("qwen2.5-coder-1.5b-instruct", True)])
def test_the_model_ships_the_fusions_that_carried_to_held_out_domains_on_both_devices(model, cpu_rule):
    """The hybrid first stage (GPU entry and its CPU entry) reads two pools, and each entry (both rerankers too)
    carries the adaptive rule exactly where, fitted without a domain, it ranked that domain better than the fixed
    fusion did (its `fit.held_out`), else its fixed weights; fitted on the seven domains' train splits read by that
    model (the default, and the 0.5B and 1.5B readers). `cpu_rule`: whether the CPU entry's rule carried (for the
    0.5B it fell further than the fixed fusion on its worst domain, docs/results.md). The fixed weights keep the floor
    (`fusion_rule.FLOOR`) on every domain of their fit."""
    from fusion_checks import held_out_wins

    from endo_retrieval.calibration.fusion_rule import FLOOR

    from endo_retrieval.scoring.adaptive import AdaptiveWeights

    profile = shipped("heads")[model]
    hybrid = profile["pipeline"]["first_stages"]["hybrid"]
    assert profile["pipeline"]["first_stage"] == "hybrid"
    entries = [(hybrid, ("bm25", "dense", "heads", "hop2")), (hybrid["cpu"], ("bm25", "dense", "heads"))]
    entries += [(profile["reranker"][name], ("first_stage", "heads")) for name in ("minilm", "bm25")]
    for entry, stages in entries:
        held = entry["fit"]["held_out"]
        assert len(held) == len(entry["fit"]["data"]) == 7
        # the fixed weights keep every domain they were fitted on within FLOOR of its better first stage alone
        # (both figures rounded to 0.1, hence the slack)
        fitted = entry["fit"]["ndcg10"]
        assert all(fitted[d]["fixed"] >= held[d]["first_stage_alone"] - FLOOR - 0.1 for d in fitted), entry["fit"]
        assert ("adaptive" in entry) == held_out_wins(entry["fit"])
        if "adaptive" in entry:
            assert AdaptiveWeights.from_json(entry["adaptive"]).stages == stages
    for entry in entries[:2]:
        assert entry[0]["pools"] == ["hybrid", "dense"] and 0 < entry[0]["dense_share"] < 1
        assert set(entry[0]["weights"]) == set(entry[1])
    assert ("adaptive" in hybrid["cpu"]) == cpu_rule
