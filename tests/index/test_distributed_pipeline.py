"""The default pipeline `endo` served by Ray on a local cluster of 2 CPUs: an endo index built by workers from the
command line, its passages embedded there; stage 1 on shards (BM25 with the whole index's statistics and the dense
ranking, fused: hybrid, the profile's default here), the model on reader actors, answers equal to one process's,
through LlamaIndex and LangChain as well, every option included. A tiny random Llama with a two-head profile
(plumbing, not quality), and once the real default model."""
import copy
import json
import os
import shutil
import random

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'endo-retrieval[ray]'): these tests run "
                          "Ray workers on a local cluster")

from endo_retrieval import Document, EndoIndex  # noqa: E402
from endo_retrieval.cli.demo import FILLER  # noqa: E402
from endo_retrieval.distributed import ModelRecipe, ShardedIndex  # noqa: E402
from endo_retrieval.distributed.first_stage import sharded_candidates  # noqa: E402
from endo_retrieval.distributed_pipeline import Reader, ReaderPool  # noqa: E402
from endo_retrieval.index import segments  # noqa: E402

QUESTIONS = ["Which mineral was found under the Varna bridge?", "When does the market open?",
             "Who cast the bell of the town hall?", "Where do farmers sell apples?", "What does the mill make?",
             "zzz qqq"]  # the last one shares no word with the corpus: stage 1 ties everywhere
FACTS = ["Workers found quartz under the Varna bridge in 1871.", "The market opens at seven on Sundays.",
         "The bell of the town hall was cast in Vienna by a guild of smiths.", "The mill makes flour from rye."]


def _write_corpus(folder, seed: int, n: int) -> None:
    """`n` text files of filler, a fact hidden in some; one file long enough to be cut into several passages."""
    rng = random.Random(seed)
    folder.mkdir()
    for i in range(n):
        words = 300 if i == 1 else rng.randint(10, 40)
        text = " ".join(rng.choice(FILLER) for _ in range(words // 8 + 1))
        if i % 2 == 0:
            text = text + " " + FACTS[(seed + i // 2) % len(FACTS)]
        (folder / f"s{seed}-{i:02d}.txt").write_text(text)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model's folder, and a heads profile for it (with pipeline settings that read the second hop, two
    pools and cut passages to their best part), found through ENDO_HEADS_PROFILE by this process and by Ray's
    workers."""
    from tiny import tiny_engine

    bb = tiny_engine()[0]
    profile = tmp_path_factory.mktemp("profile") / "heads.json"
    profile.write_text(json.dumps({"model_hash": bb.model_hash, "heads": [[0, 0], [1, 1]],
                                   "fusion": {"weights": {"heads": 1.0}},
                                   "pipeline": {"depth": 6, "read_tokens": 24, "best_last": True,
                                                "first_stage": "hybrid",
                                                "weights": {"bm25": 0.4, "heads": 0.3, "hop2": 0.3},
                                                # two pools read, as the shipped profile's GPU entry reads
                                                "first_stages": {"hybrid": {"pools": ["hybrid", "dense"]}}}}))
    before = os.environ.get("ENDO_HEADS_PROFILE")
    os.environ["ENDO_HEADS_PROFILE"] = str(profile)  # before the cluster starts: its workers inherit it
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield bb
    ray.shutdown()
    if before is None:
        os.environ.pop("ENDO_HEADS_PROFILE")
    else:
        os.environ["ENDO_HEADS_PROFILE"] = before


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    """An endo index built by `endo index --ray` on 2 workers: a segment each."""
    from endo_retrieval.cli import main

    top = tmp_path_factory.mktemp("endo-ray")
    _write_corpus(top / "docs", 0, 12)
    assert main(["index", str(top / "docs"), "--out", str(top / "index"), "--method", "endo", "--ray", "--workers",
                 "2", "--model", str(tiny.folder)]) == 0
    return top / "index"


@pytest.fixture(scope="module")
def one(tiny, built):
    return EndoIndex.load(built, tiny)


@pytest.fixture(scope="module")
def sharded(built):
    return ShardedIndex(built, shards=2)


@pytest.fixture(scope="module")
def pool(tiny, sharded):
    return ReaderPool(sharded, readers=2, setup=ModelRecipe(str(tiny.folder)))


def _same_hits(got, want) -> None:
    """Same passages in the same order; scores equal to float rounding (the processes run other thread counts)."""
    assert [(s.doc_id, s.start, s.end, s.char_start, s.char_end, s.text, s.signals, s.whole_document, s.metadata)
            for s in got] == [(s.doc_id, s.start, s.end, s.char_start, s.char_end, s.text, s.signals,
                               s.whole_document, s.metadata) for s in want]
    np.testing.assert_allclose([s.score for s in got], [s.score for s in want], rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want):
        assert set(g.stage_scores) == set(w.stage_scores) and set(g.stage_ms) == set(w.stage_ms)
        for name, value in w.stage_scores.items():
            assert g.stage_scores[name] == pytest.approx(value, rel=1e-5, abs=1e-5), name


def test_an_endo_index_is_built_by_ray_workers_from_the_command_line(tiny, built, one):
    parts = segments.listed_committed(built)
    assert len(parts) == 2 and {p["header"]["method"] for p in parts} == {"endo"}
    assert len(one) == 12 and one.method == "endo" and one.index.n_postings == 0  # tokenised only, no SAE pass


def test_stage_one_over_shards_equals_one_index(one, sharded):
    """Each shard scores its passages with the whole index's BM25 statistics and their embeddings; the fused
    candidates over both shards are one index's, in order, BM25's scores bit for bit; sentence BM25 (`bm25`) too,
    from an index that holds no S3 postings."""
    passages = one.passages()
    assert sharded.encoder is None and sharded.methods == ("bm25",) and len(sharded.shards) == 2
    assert sharded.embedder == one.dense.embedder and passages.vectors is not None  # both hold the embeddings
    owners = set()
    for stage in ("hybrid", "bm25", "dense"):
        pipeline = one.pipeline("endo", first_stage=stage)
        for q in QUESTIONS:
            top, scores = pipeline.candidates(one.corpus, passages, q)
            found = sharded_candidates(sharded.shards, pipeline.stage_one(vectors=True), q, pipeline.depth, None,
                                       _settings(pipeline), one.dense.query(q) if stage != "bm25" else None)
            assert found.starts.tolist() == passages.starts[top].tolist(), (stage, q)
            assert found.scores["bm25"].tolist() == scores["bm25"].tolist(), q  # the same idf, mean length, sums
            if stage != "bm25":
                np.testing.assert_allclose(found.scores["dense"], scores["dense"], rtol=1e-5, atol=1e-6)
            assert found.texts == pipeline.read_texts(one.corpus, passages, top, q)
            owners |= set(found.shards.tolist())
    assert owners == {0, 1}  # both shards hold candidates
    for q in QUESTIONS:
        assert sharded.search(q, k=3, method="bm25") == one.search(q, k=3, method="bm25")


def _settings(pipeline):
    """What a reader sends the shards: the pipeline without its model."""
    settings = copy.copy(pipeline)
    settings.backbone = None
    return settings


def test_readers_answer_as_one_process(tiny, one, pool):
    assert len(pool.readers) == 2 and pool.methods == ("endo", "bm25")
    assert pool.pipeline("endo").depth == one.pipeline("endo").depth == 6
    assert one.pipeline("endo").pools == ("hybrid", "dense")
    for q in QUESTIONS[:3]:
        _same_hits(pool.search(q, k=3), one.search(q, k=3))
        _same_hits(pool.search(q, k=2, budget=20), one.search(q, k=2, budget=20))  # each cut to its best part
    assert any(s.whole_document for s in pool.search(QUESTIONS[1], k=6))
    assert any(not s.whole_document for s in pool.search(QUESTIONS[0], k=6))  # the long file's passages
    late = lambda m: m["path"].endswith(("03.txt", "04.txt"))  # noqa: E731 - only two documents pass
    _same_hits(pool.search(QUESTIONS[0], k=4, where=late), one.search(QUESTIONS[0], k=4, where=late))
    assert pool.search(QUESTIONS[0], where=lambda m: False) == []
    _same_hits(pool.search(QUESTIONS[0], k=3, depth=3, read_tokens=16),
               one.search(QUESTIONS[0], k=3, depth=3, read_tokens=16))
    assert "dense" in pool.search(QUESTIONS[0], k=1)[0].stage_scores  # the hybrid stage 1 by default
    for stage in ("bm25", "dense"):
        _same_hits(pool.search(QUESTIONS[2], k=3, first_stage=stage), one.search(QUESTIONS[2], k=3, first_stage=stage))
        assert pool.pipeline("endo", first_stage=stage).first_stage == stage
    many = pool.search_many(QUESTIONS, k=3)
    assert len(many) == len(QUESTIONS)
    for q, got in zip(QUESTIONS, many):
        _same_hits(got, one.search(q, k=3))
    pids = {ray.get(r.__ray_call__.remote(lambda self: os.getpid())) for r in pool.readers}
    assert len(pids) == 2  # two reader processes took the questions
    assert pool.search_many(QUESTIONS[:2], k=2, method="bm25") == [one.search(q, k=2, method="bm25")
                                                                    for q in QUESTIONS[:2]]


def test_llamaindex_and_langchain_retrieve_through_the_pool(tiny, one, pool):
    """Every option a retriever over an index takes, over the pool too: first_stage, depth, read_tokens, passages."""
    from langchain_endo import EndoRetriever as LCRetriever
    from llama_index.retrievers.endo import EndoRetriever

    q = QUESTIONS[0]
    for options in ({}, {"first_stage": "bm25", "depth": 4, "read_tokens": 16}, {"first_stage": "hybrid", "depth": 5},
                    {"first_stage": "dense", "read_tokens": 32, "return_passages": True}):
        got = EndoRetriever(pool, similarity_top_k=3, **options).retrieve(q)
        want = EndoRetriever(one, similarity_top_k=3, **options).retrieve(q)
        assert [n.node.node_id for n in got] == [n.node.node_id for n in want] and len(got) == 3, options
        np.testing.assert_allclose([n.score for n in got], [n.score for n in want], rtol=1e-5, atol=1e-6)
        got = LCRetriever.from_index(pool, k=2, **options).invoke(q)
        want = LCRetriever.from_index(one, k=2, **options).invoke(q)
        assert [(d.id, d.page_content) for d in got] == [(d.id, d.page_content) for d in want] and len(got) == 2
    with pytest.raises(ValueError, match="depth must be"):
        EndoRetriever(pool, depth=0)
    with pytest.raises(ValueError, match="Unknown first stage"):
        LCRetriever.from_index(pool, first_stage="bm42")


@pytest.fixture(scope="module")
def wide(tiny, tmp_path_factory):
    """A larger corpus (170 passages, more than a ranking's head in `test_the_hybrid_pool_ranks_as_one_process`),
    built as two segments with their embeddings, and a pool of one reader over its two shards."""
    rng = random.Random(3)
    words = sorted({w.strip(".,") for line in FILLER + FACTS for w in line.split() if len(w) > 3})
    docs = [Document(f"w{i:03d}", " ".join(rng.choice(FILLER + FACTS) for _ in range(rng.randint(1, 4))),
                     {"half": i % 2}) for i in range(160)]
    folder = tmp_path_factory.mktemp("wide") / "index"
    for half in (docs[:80], docs[80:]):
        part = EndoIndex(tiny, method="endo")
        part.add_documents(half)
        segments.commit(folder, segments.listed_committed(folder) + [segments.write(folder, segments.as_files(part))])
    sharded = ShardedIndex(folder, shards=2)
    reader = ray.remote(Reader).options(num_cpus=0).remote(ModelRecipe(str(tiny.folder)), sharded.shards)
    questions = [" ".join(rng.sample(words, rng.randint(2, 6))) + "?" for _ in range(50)]
    return EndoIndex.load(folder, tiny), sharded, ReaderPool(sharded, readers=[reader]), questions


def test_the_hybrid_pool_ranks_as_one_process(wide):
    """50 questions, 2 shards: the hybrid stage 1's top 10 over the shards is one process's, also where the heads
    are smaller than the corpus (81 > RRF_K + 2 x 10 passages of 170: ranks outside them counted on the shards), and
    the pool's top 10 hits are one process's."""
    one, sharded, pool, questions = wide
    passages = one.passages()
    assert len(passages) > 81 and passages.vectors is not None and sharded.embedder == one.dense.embedder
    pipeline = one.pipeline("endo", depth=10, first_stage="hybrid")
    stage = pipeline.stage_one(vectors=True)
    assert stage.used == ["bm25", "dense"]
    half = lambda m: m["half"] == 1  # noqa: E731
    for q in questions:
        for where in (None, half):
            top, scores = stage.candidates(one.corpus, passages, q, 10, where)
            for head in (None, 81):
                found = sharded_candidates(sharded.shards, stage, q, 10, where, _settings(pipeline),
                                           one.dense.query(q), head=head)
                assert found.starts.tolist() == passages.starts[top].tolist(), (q, head)
                assert found.scores["bm25"].tolist() == scores["bm25"].tolist()
    for q, got in zip(questions, pool.search_many(questions, k=10, depth=10, first_stage="hybrid")):
        want = one.search(q, k=10, depth=10, first_stage="hybrid")
        assert len(want) == 10
        _same_hits(got, want)


def test_bad_input_is_refused_with_what_to_do(tiny, pool, tmp_path):
    with pytest.raises(ValueError, match="k must be a whole number"):
        pool.search(QUESTIONS[0], k=0)
    with pytest.raises(ValueError, match="second hop"):
        pool.search(QUESTIONS[0], method="endo-2hop")
    with pytest.raises(ValueError, match="cannot search with 's3'"):
        pool.search(QUESTIONS[0], method="s3")
    with pytest.raises(ValueError, match="depth must be"):
        pool.search(QUESTIONS[0], depth=0)
    with pytest.raises(ValueError, match="reads no candidates"):
        pool.search(QUESTIONS[0], method="bm25", depth=3)
    with pytest.raises(ValueError, match="reads no candidates"):
        pool.search(QUESTIONS[0], method="bm25", first_stage="hybrid")
    with pytest.raises(ValueError, match="Unknown first stage"):
        pool.search(QUESTIONS[0], first_stage="bm42")
    with pytest.raises(ValueError, match="list of questions"):
        pool.search_many(QUESTIONS[0])
    with pytest.raises(ValueError, match="ReaderPool"):
        pool.index.search(QUESTIONS[0], method="endo")
    with pytest.raises(ValueError, match="read-only"):
        pool.add_documents([])
    other = shutil.copytree(tiny.folder, tmp_path / "other")  # another config file: another model hash
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"rope_theta": 5000.0}))
    reader = ray.remote(Reader).options(num_cpus=0).remote(ModelRecipe(str(other)), pool.index.shards)
    with pytest.raises(ValueError, match="built with model .* the readers load another"):
        ReaderPool(pool.index, readers=[reader])


@pytest.mark.slow
def test_the_default_model_ranks_on_two_readers_as_in_one_process(backbone, pool, tmp_path):
    """The real default model with its shipped profile at the GPU's setting (depth 20, whose fusion weighs the
    second hop; a CPU's own leaves the hop out): two plain indexes committed as the segments of one, two shards,
    two readers."""
    for reader in pool.readers:  # their CPU slots go to the default model's readers
        ray.kill(reader)
    rng = random.Random(7)
    docs = [Document(f"d{i}", " ".join(rng.choice(FILLER) for _ in range(rng.randint(1, 3)))
                     + (" " + FACTS[i // 2 % len(FACTS)] if i % 2 == 0 else "")) for i in range(8)]
    folder = tmp_path / "index"
    for half in (docs[:4], docs[4:]):
        part = EndoIndex(backbone)
        part.add_documents(half)
        entry = segments.write(folder, segments.as_files(part))
        segments.commit(folder, segments.listed_committed(folder) + [entry])
    one = EndoIndex.load(folder, backbone)
    real = ReaderPool(ShardedIndex(folder, shards=2), readers=2)
    for q, got in zip(QUESTIONS[:2], real.search_many(QUESTIONS[:2], k=4, depth=20)):
        want = one.search(q, k=4, depth=20)
        assert "hop2" in want[0].stage_scores and len(want) == 4
        _same_hits(got, want)
