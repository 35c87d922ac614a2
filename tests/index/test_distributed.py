"""Ray on a local cluster of 2 CPUs (started once for the module) with a tiny random Llama and random SAEs:
segments built by workers and committed by a manifest, sharded queries, ILRe over two workers, a killed worker."""
import os
import random
import shutil
import sys

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'endo-retrieval[ray]'): these tests run "
                          "Ray workers on a local cluster")

from endo_retrieval import Document, EndoIndex, SAEBank, TopKSAE  # noqa: E402
from endo_retrieval import distributed  # noqa: E402
from endo_retrieval.index import segments  # noqa: E402
from endo_retrieval.cli.demo import FILLER  # noqa: E402
from endo_retrieval.methods.ilre import ILRe  # noqa: E402

from conftest import make_tiny_model  # noqa: E402

QUESTIONS = ["Which mineral was found under the bridge?", "When does the market open?", "Who built the old mill?"]


def _docs(n: int, seed: int, prefix: str) -> list[Document]:
    rng = random.Random(seed)
    return [Document(f"{prefix}{i}", " ".join(rng.choice(FILLER) for _ in range(rng.randint(4, 14))),
                     {"i": i}) for i in range(n)]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the dying setup below travels by value
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, cluster):
    from endo_retrieval import Backbone

    folder = make_tiny_model("llama", tmp_path_factory.mktemp("tiny"))
    bb = Backbone(folder, device="cpu")
    torch.manual_seed(0)
    saes = SAEBank({l: TopKSAE(bb.head_dim, 256, 8) for l in (0, 2)},
                   {"d_latent": 256, "k": 8, "model_hash": bb.model_hash, "model": bb.model_id})
    sae_dir = tmp_path_factory.mktemp("sae")
    saes.save(sae_dir, dtype=torch.float32)
    saes = SAEBank.load(sae_dir, bb.model_hash)  # what the workers load
    recipe = distributed.ModelRecipe(str(folder), str(sae_dir))
    return bb, saes, distributed.start_workers(2, recipe), recipe


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    """Documents indexed by the two workers, then more appended: a segment per worker and build, four in all."""
    bb, saes, workers, _ = tiny
    first, more = _docs(7, 0, "a"), _docs(3, 1, "b")
    folder = tmp_path_factory.mktemp("ray") / "index"
    indexer = distributed.RayIndexer(workers, chunk_size=128)
    indexer.build(folder, first)
    indexer.build(folder, more, append=True)
    return folder, first + more


def _same_index(a: EndoIndex, b: EndoIndex) -> None:
    for layer in a.index.layers:
        for x, y in zip(a.index.postings(layer), b.index.postings(layer)):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(a.index.tokens(layer), b.index.tokens(layer))
    assert [(d.doc_id, d.start, d.end, d.metadata) for d in a.corpus.documents()] == \
        [(d.doc_id, d.start, d.end, d.metadata) for d in b.corpus.documents()]
    np.testing.assert_array_equal(a.corpus.sentence_starts(), b.corpus.sentence_starts())


def test_workers_build_the_postings_of_one_process(tiny, built):
    bb, saes, *_ = tiny
    folder, docs = built
    one = EndoIndex(bb, "s3-hybrid", saes=saes, chunk_size=128)
    one.add_documents(docs)
    parts = segments.listed_committed(folder)
    assert len(parts) == 4 and [d for p in parts for d in p["documents"]] == [d.doc_id for d in docs]
    assert sorted(p.name for p in (folder / segments.SEGMENTS).iterdir()) == sorted(p["name"] for p in parts)
    loaded = EndoIndex.load(folder, bb, saes)
    assert one.index.n_postings > 0
    _same_index(loaded, one)
    for q in QUESTIONS:
        assert loaded.search(q) == one.search(q)


def test_sharded_queries_equal_the_union(tiny, built):
    bb, saes, *_ = tiny
    folder, _ = built
    union = EndoIndex.load(folder, bb, saes)
    full = 0  # selections that fill the budget: the comparison is not between empty answers
    for shards in (2, 3):
        sharded = distributed.ShardedIndex(folder, shards=shards, backbone=bb, saes=saes)
        assert len(sharded.shards) == shards
        for q in QUESTIONS:
            for method in ("s3-hybrid", "s3", "bm25"):
                for budget in (40, 200):
                    got, want = sharded.select(q, budget, method), union.select(q, budget, method)
                    assert got == want, (q, method, budget)
                    full += sum(s.end - s.start for s in got) == budget
            assert sharded.search(q, k=3) == union.search(q, k=3)
    assert full >= 20


@pytest.mark.parametrize("positions", ["frame", "dca"])
def test_ilre_over_two_workers_equals_one_process(tiny, positions):
    bb, _, workers, _ = tiny
    ilre = ILRe(bb, layer=2, chunk_size=64, window=48, positions=positions)
    context = bb.encode(" ".join(random.Random(3).choice(FILLER) for _ in range(40))).ids
    query = bb.encode(ilre.query_template.format(question=QUESTIONS[0])).ids
    assert len(context) > 6 * ilre.chunk_size
    one = ilre.scores(context, query)
    spread = distributed.ilre_scores(ilre, context, query, workers)
    np.testing.assert_allclose(spread, one, rtol=1e-5, atol=1e-8)
    assert abs(spread.sum() - one.sum()) < 1e-4 * one.sum()  # A^C: whole-context softmax maxed over heads, queries
    for budget in (32, 100):
        np.testing.assert_array_equal(distributed.ilre_select(ilre, context, query, budget, workers),
                                      ilre.select(context, query, budget))


def _dies(recipe):
    """A worker whose process exits in the middle of its first document, as a crash or a lost node would."""
    backbone, saes = recipe()
    backbone.stream = lambda *a, **k: os._exit(1)
    return backbone, saes


def test_a_killed_worker_fails_the_build_and_the_old_index_stays(tiny, built, tmp_path):
    bb, saes, workers, recipe = tiny
    folder = tmp_path / "index"
    shutil.copytree(built[0], folder)
    before = EndoIndex.load(folder, bb, saes)
    answers = [before.search(q) for q in QUESTIONS]
    parts = segments.listed_committed(folder)
    dying = ray.remote(distributed.ModelWorker).options(num_cpus=0, max_restarts=0).remote(lambda: _dies(recipe))
    indexer = distributed.RayIndexer([dying, workers[1]], chunk_size=128)
    with pytest.raises(distributed.BuildError, match="nothing was committed"):
        indexer.build(folder, _docs(4, 5, "c"), append=True)
    assert segments.listed_committed(folder) == parts
    assert sorted(p.name for p in (folder / segments.SEGMENTS).iterdir()) == sorted(p["name"] for p in parts)
    after = EndoIndex.load(folder, bb, saes)
    _same_index(after, before)
    assert [after.search(q) for q in QUESTIONS] == answers


def test_bench_scale_section_writes_its_rows(tiny, tmp_path):
    """`endo bench perf --sections scale` at a tiny size: 1 worker against 2, indexing and ILRe, in one run."""
    import json

    from endo_retrieval.cli import main

    bb, _, workers, recipe = tiny
    for w in workers:  # the section starts its own workers on the cluster's 2 CPUs
        ray.kill(w)
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("\n\n".join(" ".join(random.Random(i).choice(FILLER) for _ in range(6))
                                            for i in range(40)))
    out = tmp_path / "scale.json"
    assert main(["bench", "perf", "--sections", "scale", "--model", recipe.model, "--sae", recipe.sae,
                 "--ilre-layer", "2", "--text", str(text), "--scale-tokens", "1024", "--scale-docs", "4",
                 "--chunk-size", "128", "--budget", "64", "--out", str(out)]) == 0
    rows = {(r["metric"], r["method"]): r for r in json.loads(out.read_text())["rows"]}
    for key in [("index_tokens_per_s", "ray-1-worker"), ("index_tokens_per_s", "ray-2-workers"),
                ("ilre_ms", "ilre-1-worker"), ("ilre_ms", "ilre-2-workers")]:
        assert rows[key]["value"] > 0 and rows[key]["section"] == "scale"
    assert rows[("index_speedup", "ray")]["value"] == pytest.approx(
        rows[("index_tokens_per_s", "ray-2-workers")]["value"] / rows[("index_tokens_per_s", "ray-1-worker")]["value"])
    ilre_diff = rows[("ilre_max_abs_diff", "ilre")]
    assert ilre_diff["value"] < 1e-5 and ilre_diff["same_allocation"]
    assert 0 < rows[("ilre_compute_share", "ilre-1-worker")]["value"] < 1
