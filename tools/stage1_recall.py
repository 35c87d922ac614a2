"""Recall of the `endo` pipeline's first stage alone (BM25 over passages, no model) on a HotpotQA-layout file's
pooled paragraphs, over stems (as shipped) and over words, beside LlamaIndex's BM25Retriever.

    .venv/bin/python tools/stage1_recall.py ../shared/data/hotpotqa/dev300.json
    .venv/bin/python tools/stage1_recall.py ../shared/data/hotpotqa/fit300.json --made

--made: the same recall on the tasks `endo prepare` makes from the file's paragraphs (one document per question's
ten, as plain text: no question or label read; 100 heads tasks and 300 pipeline tasks, the pipeline's counted),
judged hard by BM25 over words or over stems, at two shares of hard tasks (`zero_label.HARD_SHARE`).

--written MODEL N: the first N single-hop and N/2 two-hop tasks made as above, asked as made and as MODEL writes
them (`endo prepare --questions-by model`; zero_label.written_tasks), none balanced: how many replies are usable,
and stage 1's recall on the same tasks under each kind of question (on a CPU the 1.5B model writes ~30 a minute).

    .venv/bin/python tools/stage1_recall.py ../shared/data/hotpotqa/fit300.json \
        --written qwen2.5-coder-1.5b-instruct.gguf 96

--tasks TASKS.json MODEL: how hard the tasks an `endo prepare` run kept are for stage 1 (its `tasks.json`, made
from the file's paragraphs with MODEL's tokenizer): the share whose gold BM25 ranks first, 2nd to 5th, 6th to
10th, 11th to 20th and past 20th, for all tasks, for the pipeline's (all but the first 100, the heads') and for the
file's real questions (their weakest gold among its pooled paragraphs).

    .venv/bin/python tools/stage1_recall.py ../shared/data/hotpotqa/fit300.json \
        --tasks bench/results/quality/sizes/zero_label_written_tasks_qwen1.5b.json qwen2.5-coder-1.5b-instruct.gguf
"""
import json
import os
import sys

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # bm25s imports JAX where it is installed
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

from endo_bench.corpus_bench import corpus_nodes, gold_titles  # noqa: E402

from endo_retrieval.calibration.datasets import hotpotqa_corpus  # noqa: E402
from endo_retrieval.index import passages as stage1  # noqa: E402
from endo_retrieval import Document, EndoIndex  # noqa: E402

KS = (2, 5, 10, 20)


def recall(ranked: list[list[str]], items: list[dict]) -> dict[int, float]:
    return {k: float(np.mean([len(set(r[:k]) & set(gold_titles(it))) / len(set(gold_titles(it)))
                              for r, it in zip(ranked, items)])) for k in KS}


def pipeline_stage1(titles, texts, items, stem: bool) -> list[list[str]]:
    stage1.STEMS = stem
    index = EndoIndex(method="endo")
    index.add_documents([Document(f"d{i}", text, {"title": t}) for i, (t, text) in enumerate(zip(titles, texts))],
                        progress=False)
    corpus, passages, docs = index.corpus, index.passages(), list(index.corpus.documents())
    ranked = []
    for it in items:
        top, _ = index.pipeline().candidates(corpus, passages, it["question"], depth=2 * max(KS))
        seen = dict.fromkeys(docs[d].metadata["title"] for d in corpus.locate(passages.starts[top])[0])
        ranked.append(list(seen)[:max(KS)])
    return ranked


def llamaindex_bm25(titles, texts, items) -> list[list[str]]:
    from llama_index.retrievers.bm25 import BM25Retriever

    retriever = BM25Retriever.from_defaults(nodes=corpus_nodes(titles, texts), similarity_top_k=max(KS))
    return [[n.node.metadata["title"] for n in retriever.retrieve(it["question"])] for it in items]


def main(path: str) -> None:
    titles, texts, items = hotpotqa_corpus(path, None)
    items = [it for it in items if it["supporting_facts"]]
    for name, ranked in (("stage 1, stems", pipeline_stage1(titles, texts, items, True)),
                         ("stage 1, words", pipeline_stage1(titles, texts, items, False)),
                         ("LlamaIndex BM25Retriever", llamaindex_bm25(titles, texts, items))):
        print(name, " ".join(f"recall@{k} {100 * v:.1f}" for k, v in recall(ranked, items).items()))


def question_documents(path: str) -> list[tuple[str, str]]:
    """The file's paragraphs as `endo prepare` gets them: one plain document per question's ten, nothing else."""
    return [(f"q{i:03d}.txt", "\n\n".join(t + ": " + " ".join(s) for t, s in it["context"]))
            for i, it in enumerate(json.load(open(path)))]


def made_tasks(path: str, written: tuple[str, int] | None = None) -> None:
    from endo_retrieval import Backbone
    from endo_retrieval.calibration import zero_label
    from endo_retrieval.scoring.bm25 import OkapiPostings, words

    documents = question_documents(path)
    chunks = zero_label.chunk_documents(documents, Backbone().count_tokens)
    made = zero_label.make_tasks(chunks, 8 * 400, 0)
    linked = zero_label.two_hop_tasks(chunks, 8 * round(zero_label.TWO_HOP_SHARE * 400), 0)
    bm25 = OkapiPostings.build([words(c.text) for c in chunks], True)  # the pipeline's stage 1

    def stage1_recall(tasks) -> str:
        found = {k: [] for k in KS}
        for t in tasks:
            order = np.argsort(-bm25.get_scores(words(t.question)), kind="stable")
            for k in KS:
                found[k].append(len(set(order[:k].tolist()) & set(t.golds)) / len(t.golds))
        return " ".join(f"recall@{k} {100 * np.mean(v):.1f}" for k, v in found.items())

    if written:
        model, n = written
        asked = made[:n] + linked[: n // 2]
        wrote = zero_label.written_tasks(asked, Backbone(model).chat.generate_many)
        ids = {t.id for t in wrote}
        print(f"{model} wrote {len(wrote)} usable questions of {len(asked)} asked "
              f"({sum(t.chunk2 >= 0 for t in wrote)} of {len(asked) - n} two-hop)")
        print("the same tasks, made questions:", stage1_recall([t for t in asked if t.id in ids]))
        print("the same tasks, written questions:", stage1_recall(wrote))
        for t in wrote[:: max(1, len(wrote) // 12)]:
            print(f"  {t.form}: {t.question}")
        return
    for judged_by, share in (("words", 0.5), ("stems", 0.5), ("stems", zero_label.HARD_SHARE)):
        stage1.STEMS = judged_by == "stems"  # what `bm25_ranks` judges a task's difficulty with
        tasks = zero_label.mixed(made, linked, chunks, 400, depth=20, hard_share=share)[100:]
        stage1.STEMS = True
        print(f"made tasks judged by BM25 over {judged_by}, hard share {share}:", stage1_recall(tasks))


def kept_tasks(path: str, tasks_path: str, model: str) -> None:
    from endo_retrieval import Backbone
    from endo_retrieval.calibration import zero_label

    documents = question_documents(path)
    chunks = zero_label.chunk_documents(documents, Backbone(model, device="cpu").count_tokens)
    tasks = [zero_label.Task(**t) for t in json.load(open(tasks_path))]
    ranks = np.array(zero_label.bm25_ranks(tasks, chunks))  # other chunks above the weakest gold
    # the real questions of the file, the same way over its pooled paragraphs (as chunks), for scale
    titles, texts, items = hotpotqa_corpus(path, None)
    row = {t: i for i, t in enumerate(titles)}
    paragraphs = [zero_label.Chunk(t, t, text) for t, text in zip(titles, texts)]
    questions = []
    for it in items:
        golds = sorted({row[t] for t, _ in it["supporting_facts"] if t in row})
        if golds:
            questions.append(zero_label.Task(it["_id"], it["question"], "", golds[0], "real",
                                             chunk2=golds[1] if len(golds) > 1 else -1))
    real = zero_label.bm25_ranks(questions, paragraphs)
    bands = {"1st": (0, 0), "2nd-5th": (1, 4), "6th-10th": (5, 9), "11th-20th": (10, 19), "past 20th": (20, 10 ** 9)}
    for name, r in (("all tasks", ranks), ("the pipeline's", ranks[100:]), ("the file's real questions", real)):
        r = np.asarray(r)
        print(f"{name} ({len(r)}):", ", ".join(f"{band} {100 * np.mean((r >= a) & (r <= b)):.1f}%"
                                                for band, (a, b) in bands.items()))


if __name__ == "__main__":
    if "--tasks" in sys.argv[2:]:
        at = sys.argv.index("--tasks")
        kept_tasks(sys.argv[1], sys.argv[at + 1], sys.argv[at + 2])
    elif "--written" in sys.argv[2:]:
        at = sys.argv.index("--written")
        made_tasks(sys.argv[1], (sys.argv[at + 1], int(sys.argv[at + 2])))
    else:
        made_tasks(sys.argv[1]) if "--made" in sys.argv[2:] else main(sys.argv[1])
