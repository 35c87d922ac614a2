"""`endo prepare` on a tiny random model and a folder of made-up documents: it makes a heads profile with a fitted
pipeline, a second run skips it, a run stopped part way resumes at the item where it stopped, and the LlamaIndex
retriever answers with what it made. Also the zero-label task maker's guarantees (the evidence is verbatim in its
chunk and in its haystack). Random weights test the plumbing; quality is measured on the default model."""
from __future__ import annotations

import argparse
import json
import random

import pytest

from conftest import make_tiny_model
from endo_retrieval.calibration import heads as heads_calibrate, prepare
from endo_retrieval.cli import main

NAMES = ["Albatross", "Kestrel", "Orion", "Marlow", "Thornbury", "Calder", "Wrenfield", "Penhallow"]
THINGS = ["lamps", "bicycles", "pianos", "umbrellas", "telescopes", "clocks", "kettles", "spectacles"]
TOWNS = ["Gdansk", "Saltmarsh", "Greywater", "Brightmoor", "Ravensholt", "Linden Vale", "Tarn Abbey", "Whitcombe"]


def write_documents(folder, n_docs: int = 6, seed: int = 0):
    rng = random.Random(seed)
    for d in range(n_docs):
        paragraphs = []
        for p in range(4):
            name, thing, town = rng.choice(NAMES), rng.choice(THINGS), rng.choice(TOWNS)
            paragraphs.append(
                f"The workshop of {name} in {town} made {thing} for {1850 + rng.randrange(90)} years. "
                f"Its founder sold the first {thing} at the market near the harbour of {town}. "
                f"In {1900 + rng.randrange(99)} the company moved to a larger building beside the railway station. "
                f"Visitors remember the smell of oil and the sound of hammers in the long brick hall.")
        (folder / f"doc{d}.txt").write_text("\n\n".join(paragraphs))
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepare")
    model = make_tiny_model("llama", root / "model", layers=2)
    (root / "docs").mkdir()
    docs = write_documents(root / "docs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ENDO_CACHE", str(root / "cache"))  # the profile goes to this model's folder in a fresh cache
        yield model, docs, root


def prepare_argv(model, docs, *extra):
    return ["prepare", "--model", str(model), "--documents", str(docs), "--device", "cpu", "--tasks", "6",
            "--passkeys", "1", "--questions", "4", "--context-tokens", "256", "--depths", "4",
            "--read-tokens", "32", *extra]


def test_tasks_keep_their_evidence_verbatim(setup):
    from endo_retrieval.model.backbone import Backbone
    from endo_retrieval.calibration.zero_label import (chunk_documents, corpus_questions, haystacks, make_tasks,
                                                      passkey_tasks, read_documents)

    model, docs, _ = setup
    bb = Backbone.of(str(model), device="cpu")
    chunks = chunk_documents(read_documents(docs), bb.count_tokens, chunk_tokens=80)
    assert len({c.doc for c in chunks}) == 6 and all(bb.count_tokens(c.text) <= 80 for c in chunks)
    tasks = make_tasks(chunks, 10, seed=1)
    assert len(tasks) == 10 and {t.form for t in tasks} == {"keywords", "cloze"}
    for t in tasks:
        assert t.evidence in chunks[t.chunk].text and t.question != t.evidence
        if t.form == "cloze":
            assert t.answer in t.evidence and "what" in t.question.lower() and t.question.endswith("?")
    for e, t in zip(haystacks(tasks, chunks, bb.count_tokens, 256), tasks):
        assert e.context.count(t.evidence) >= 1 and bb.count_tokens(e.context) <= 256
    (key,) = passkey_tasks(chunks, 1, 200, bb.count_tokens)
    assert key.supporting[0] in key.context
    titles, texts, questions = corpus_questions(tasks, chunks)
    assert all(q["supporting_facts"][0][0] in titles for q in questions)


def test_balanced_tasks_are_a_share_of_ones_bm25_does_not_rank_first(monkeypatch):
    from endo_retrieval.calibration import zero_label
    from endo_retrieval.calibration.zero_label import Chunk, Task, balanced, bm25_ranks
    from endo_retrieval.index import passages

    chunks = [Chunk(f"c{i}", "d", t) for i, t in enumerate(["blue boats", "yellow boats on the lake", "red pears"])]
    asks = [Task("a", "blue boats", "", 0, "keywords"), Task("b", "boats", "", 1, "keywords")]
    assert bm25_ranks(asks, chunks) == [0, 1]  # the shorter chunk wins "boats"
    # BM25 as the pipeline's stage 1: over stems an inflected word still finds its chunk, over words it does not
    inflected = [Task("c", "blue pear", "", 2, "keywords")]  # "blue" is the boats chunk's
    assert bm25_ranks(inflected, chunks) == [0]
    monkeypatch.setattr(passages, "STEMS", False)
    assert bm25_ranks(inflected, chunks) == [1]
    monkeypatch.setattr(passages, "STEMS", True)

    ranks = [0, 5, 0, 0, 40, 2, 0, 0, 1, 0]  # BM25's rank of each task's own chunk
    tasks = [Task(str(i), f"q{i}", "", 0, "keywords") for i in range(len(ranks))]
    monkeypatch.setattr(zero_label, "bm25_ranks", lambda ts, cs: [ranks[int(t.id)] for t in ts])
    picked = [int(t.id) for t in balanced(tasks, chunks, 6, hard_share=0.5, depth=20)]
    assert picked == [0, 1, 2, 3, 5, 8]  # the three hard ones found in 20, three easy ones, in the made order
    assert [int(t.id) for t in balanced(tasks, chunks, 4, hard_share=0.75, depth=20)] == [0, 1, 5, 8]
    assert [int(t.id) for t in balanced(tasks, chunks, 6, hard_share=0.5, depth=3)] == [0, 2, 3, 5, 6, 8]  # 5 > 3


def test_prepare_makes_skips_resumes_and_the_retriever_answers(setup, monkeypatch, capsys):
    from endo_retrieval.model.backbone import Backbone
    from endo_retrieval.model.profiles import heads_profile, heads_profile_path

    model, docs, root = setup
    bb = Backbone.of(str(model), device="cpu")
    assert heads_profile(bb) is None

    # a run stopped at the third haystack (Ctrl-C) leaves the two it finished
    real_label, calls, stop = heads_calibrate.label, [], [3]

    def label(*a, **k):
        calls.append(1)
        if len(calls) in stop:
            stop.clear()
            raise KeyboardInterrupt
        return real_label(*a, **k)

    monkeypatch.setattr(heads_calibrate, "label", label)
    assert main(prepare_argv(model, docs)) == 130
    assert heads_profile(bb) is None
    # the rerun resumes: the two finished haystacks are not read again (6 tasks + 1 passkey in all)
    calls.clear()
    assert main(prepare_argv(model, docs, "--timings", str(root / "t.json"))) == 0
    assert len(calls) == 7 - 2
    profile = heads_profile(bb)
    assert profile["heads"] and profile["fusion"]["weights"] and profile["data"] == ["zero-label"]
    assert profile["pipeline"]["depth"] == 4 and profile["pipeline"]["read_tokens"] == 32
    # what was made is recorded: the task forms and the two-hop share, the fusion's rule and the budget it used
    made = profile["zero_label"]
    assert made["two_hop_share"] == round(1 / 3, 4) and sum(made["forms"].values()) == made["tasks"] == 6
    assert set(made["forms"]) <= {"keywords", "cloze", "two-hop"}
    assert made["questions_by"] == "rules"  # auto: a model this small does not write them
    assert "flattest" in profile["fusion"]["rule"]
    assert profile["budgets"] == [int(256 // 8 * profile["fusion"]["budget_scale"])]
    assert sum(profile["pipeline"]["fit"]["forms"].values()) == profile["pipeline"]["fit"]["n_questions"]
    assert set(json.loads((root / "t.json").read_text())["phases_s"]) >= {"load", "tasks", "heads", "pipeline"}
    assert not (heads_profile_path(bb).parent / "heads.prepare" / "items").exists()

    # a second run skips it
    calls.clear()
    capsys.readouterr()
    assert main(prepare_argv(model, docs)) == 0
    out = capsys.readouterr().out
    assert not calls and "heads: already made, skipped" in out and "ready for: bm25, heads, endo" in out

    assert main(["info", "--model", str(model), "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ready"] == ["bm25", "heads", "endo"]

    pytest.importorskip("llama_index.core")
    from llama_index.core import Document

    from llama_index.retrievers.endo import EndoRetriever

    documents = [Document(id_=f.name, text=f.read_text()) for f in sorted(docs.glob("*.txt"))]
    retriever = EndoRetriever.from_defaults(documents=documents, backbone=str(model), similarity_top_k=2)
    nodes = retriever.retrieve("Which workshop made pianos in Gdansk?")
    assert 1 <= len(nodes) <= 2 and all(n.node.text for n in nodes)


def test_without_documents_it_says_what_to_give(setup, capsys):
    model, _, root = setup
    assert main(["prepare", "--model", str(model), "--device", "cpu", "--profile", str(root / "other.json")]) == 2
    assert "--documents DIR" in capsys.readouterr().err


def test_the_default_model_is_ready_and_its_shipped_profile_is_never_overwritten(capsys):
    assert main(["prepare", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "heads: already made, skipped" in out and "pipeline: already made, skipped" in out
    assert "is ready for: bm25, s3, s3-hybrid, ilre, heads, endo" in out
    assert main(["prepare", "--device", "cpu", "--force"]) == 2
    assert "pass --profile PATH" in capsys.readouterr().err


def test_questions_written_by_the_model_make_the_tasks(setup, monkeypatch, capsys):
    """`--questions-by model`: the questions the model writes are the tasks' (a writer stands in for a model able to
    write them: the tiny random one writes noise, which gets the clear error)."""
    import re

    from endo_retrieval.model.chat import Chat
    from endo_retrieval.calibration import zero_label

    model, docs, root = setup
    argv = prepare_argv(model, docs, "--questions-by", "model", "--profile", str(root / "written.json"))
    assert main(argv) == 2
    assert "pass --questions-by rules" in capsys.readouterr().err

    def write(self, prompts, max_new_tokens=48, batch=16):  # a few longer words of each sentence, never the bridge
        out = []
        for p in prompts:
            bridge = re.search(r'linked by "([^"]+)"', p)
            avoid = {bridge.group(1).lower()} if bridge else set()
            lines = [x for x in re.findall(r"^(?:\d\. )?([A-Z].*[.])$", p, flags=re.M)
                     if not x.startswith(("Here ", "Write "))]  # the evidence, not the instructions
            picked = [w for line in lines for w in re.findall(r"[a-z]{6,}", line)[:2] if w not in avoid]
            out.append("Which record mentions " + " and ".join(picked) + "?")
        return out

    monkeypatch.setattr(Chat, "generate_many", write)  # the model's generation (bb.chat)
    assert main(argv) == 0
    profile = json.loads((root / "written.json").read_text())
    assert set(profile["zero_label"]["forms"]) <= {zero_label.WRITTEN, f"{zero_label.WRITTEN} two-hop"}
    assert profile["zero_label"]["questions_by"] == "model"
    tasks = json.loads((root / "written.prepare" / "tasks.json").read_text())
    assert tasks and all(t["question"].startswith("Which record mentions ") for t in tasks)
    # auto: the model writes them from WRITER_PARAMS on (here every model is that large)
    monkeypatch.setattr(prepare, "WRITER_PARAMS", 0)
    auto = prepare_argv(model, docs, "--profile", str(root / "auto.json"))
    assert main(auto) == 0
    assert json.loads((root / "auto.json").read_text())["zero_label"]["questions_by"] == "model"


def test_the_orders_offered_are_the_pipelines():
    from endo_retrieval.calibration.pipeline import ORDERS
    from endo_retrieval.cli import prepare as prepare_cli

    parser = argparse.ArgumentParser()
    prepare_cli.prepare_add_arguments(parser)
    orders = next(a for a in parser._actions if a.dest == "orders")
    assert set(orders.choices) == set(ORDERS) and set(orders.default) <= set(ORDERS)


def test_a_profile_written_elsewhere_says_what_it_makes_ready_and_how_to_use_it(setup, capsys, monkeypatch):
    from endo_retrieval.calibration import prepare
    from endo_retrieval.model.backbone import Backbone

    model, docs, root = setup
    bb = Backbone(str(model), device="cpu")
    made = root / "elsewhere.json"
    assert main(prepare_argv(model, docs, "--profile", str(made))) == 0
    monkeypatch.setattr(prepare, "heads_profile_path", lambda _: root / "none.json")  # the library finds nothing
    capsys.readouterr()
    prepare._ready(bb, made)
    assert f"ready for: bm25, heads, endo (set ENDO_HEADS_PROFILE={made} to use it)" in capsys.readouterr().out
