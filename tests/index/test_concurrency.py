"""Threads and processes on one index: shared queries return what a sequential run returns; readers beside a writer
see the old or the new index, never a mix; of two writers one wins and the other gets IndexBusyError."""
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from endo_retrieval import files
from endo_retrieval.files import IndexBusyError, writer_lock

from endo_retrieval import Document

from tiny import DOCS, QUESTIONS, answers, docs, load, new_index


def run_threads(n, target):
    errors = []

    def guarded(i):
        try:
            target(i)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, errors


def spans(index, question):
    return [(s.doc_id, s.start, s.end, s.score) for s in index.search(question, k=3)]


def test_16_threads_on_one_index_return_the_sequential_results():
    idx = new_index()
    idx.add_documents(docs("mill", "vault", "ship", "cafe"))
    expected = {q: spans(idx, q) for q in QUESTIONS}  # the real query forward, not a cached one
    got = [[] for _ in range(16)]
    threads, errors = run_threads(16, lambda i: got[i].extend(
        (q, spans(idx, q)) for q in (QUESTIONS * 2)[i % 3:][:4]))
    for t in threads:
        t.join()
    assert errors == []
    assert all(result == expected[q] for per_thread in got for q, result in per_thread) and all(got)


def test_readers_beside_appends_in_memory_see_the_old_or_the_new_index():
    extra = [Document(f"cafe{i}", DOCS["cafe"] + " It closes late." * i) for i in range(6)]
    replay, states = new_index(), set()  # what each question gets after 0, 1, ... appends
    replay.add_documents(docs("mill", "vault", "ship"))
    for doc in [None, *extra]:
        if doc:
            replay.add_documents([doc])
        states |= {(q, r) for q, r in zip(QUESTIONS, answers(replay)[1])}
    shared = new_index()
    shared.add_documents(docs("mill", "vault", "ship"))
    done, seen = threading.Event(), []

    def read(i):  # each search is one read: it must see one state
        while not done.is_set():
            q = QUESTIONS[i % 3]
            seen.append((q, answers(shared, [q])[1][0]))

    threads, errors = run_threads(6, read)
    for doc in extra:
        shared.add_documents([doc])
    done.set()
    for t in threads:
        t.join()
    assert errors == [] and seen
    assert set(seen) <= states, "a reader saw a partly added document"


def test_readers_beside_a_writer_on_disk_see_the_old_or_the_new_index(tmp_path):
    states = [new_index(), new_index("bm25")]
    states[0].add_documents(docs("mill", "vault", "ship"))
    states[1].add_documents(docs("cafe", "ship"))
    expected = {answers(s) for s in states}
    folder = tmp_path / "ix"
    states[0].save(folder)
    done, seen = threading.Event(), []

    def read(i):
        while not done.is_set():
            seen.append(answers(load(folder)))

    threads, errors = run_threads(3, read)
    for i in range(30):
        states[i % 2].save(folder)
    done.set()
    for t in threads:
        t.join()
    assert errors == [], errors[:1]
    assert len(seen) >= 3 and set(seen) <= expected


HOLDER = textwrap.dedent("""
    import importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("files", sys.argv[1])
    files = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(files)
    with files.writer_lock(sys.argv[2]):
        print("held", flush=True)
        sys.stdin.readline()  # until the parent says so
""")


def test_two_writers_one_wins_the_other_gets_a_clear_error_and_nothing_is_lost(tmp_path):
    folder = tmp_path / "ix"
    base = new_index()
    base.add_documents(docs("mill", "ship"))
    base.save(folder)

    def append(doc_id):
        with writer_lock(folder):
            idx = load(folder)
            idx.add_documents(docs(doc_id))
            idx.save(folder)

    # another process holds the folder: this one's append is refused at once, with what to do
    child = subprocess.Popen([sys.executable, "-c", HOLDER, files.__file__, str(folder)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    with pytest.raises(IndexBusyError, match="another writer is updating .* retry when it has finished"):
        append("vault")
    with pytest.raises(IndexBusyError):
        base.save(folder)  # a whole rebuild too
    child.communicate("go\n")
    # two threads of this process: the second waits out the first or is refused, then retries; both land
    gate, results = threading.Event(), []

    def writer(i):
        for _ in range(200):
            try:
                append(["vault", "cafe"][i])
                results.append(i)
                return
            except IndexBusyError:
                gate.wait(0.01)

    threads, errors = run_threads(2, writer)
    for t in threads:
        t.join()
    assert errors == [] and sorted(results) == [0, 1]
    assert sorted(load(folder).doc_ids) == ["cafe", "mill", "ship", "vault"]
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["ix"]  # no lock file after a clean exit


def test_readers_that_join_the_added_documents_at_once_join_them_once(monkeypatch):
    """The first lookups after adds join the added documents into a run; readers share the corpus, so two at once
    must not both join them (a run twice over puts every later position in the wrong document)."""
    import time

    import numpy as np

    from endo_retrieval import corpus_columns
    from endo_retrieval.corpus import CorpusMap

    corpus = CorpusMap()
    for i, text in enumerate(["a b c", "d e", "f g h i"]):
        corpus.add_document(f"d{i}", text, np.array([[j * 2, j * 2 + 1] for j in range(len(text.split()))]))
    slow = corpus_columns.Columns.of_documents.__func__

    def slowly(cls, docs):  # widens the window in which a second reader could join the same documents
        time.sleep(0.2)
        return slow(cls, docs)

    monkeypatch.setattr(corpus_columns.Columns, "of_documents", classmethod(slowly))
    threads, errors = run_threads(4, lambda i: corpus.locate(np.arange(9)))
    for t in threads:
        t.join()
    assert errors == [] and len(corpus._runs) == 1
    assert corpus.locate(np.arange(9))[0].tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
