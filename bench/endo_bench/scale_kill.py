"""kill -9 during an update of a large index: each round a child process opens the index (the model included),
removes UPDATE_DOCS documents, brings the passages up to date and saves the new generation; it is killed at a
random moment of the save. After each kill the index must open (model-free, as `endo query --method bm25` reads it)
and be the old generation, holding the removed documents and answering as before, or the new one, without them.

    python -m endo_bench.scale_kill DIR [--kills 5] [--seed 0]

DIR: an `endo` index, e.g. one `endo bench scale --keep --work W` left in W/n1000000/index. Prints one line per
round and a summary; exits 1 on any failure. A round that finishes before its kill is counted apart.
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from endo_retrieval.cli.saved import read_saved
from endo_retrieval.scoring.bm25 import words

UPDATE_DOCS = 100

CHILD = """
import sys, time
from endo_retrieval.methods.search import EndoIndex
folder, gone = sys.argv[1], sys.argv[2].split(",")
index = EndoIndex.load(folder)
for doc_id in gone:
    index.remove_document(doc_id)
index.passages()
print("saving", flush=True)
t = time.perf_counter()
index.save(folder)
print(f"saved {time.perf_counter() - t:.2f}", flush=True)
"""


def state(folder: Path, question: str) -> tuple[int, set, list]:
    """(generation, ids of the documents, the ids of the best BM25 passages for `question`), read without the
    model; raises where the index does not open."""
    saved = read_saved(folder, passages=True)
    scores = saved.passages.bm25.get_scores(words(question))
    best = scores.argsort()[::-1][:5]
    ids = set(saved.corpus.doc_ids())
    located = saved.corpus.locate(saved.passages.starts[best])[0]
    return saved.meta.get("generation", 0), ids, [saved.corpus.document_at(int(i)).doc_id for i in located]


def run(folder: Path, kills: int, seed: int) -> int:
    rng, failures, outcomes, save_s = random.Random(seed), 0, {"old": 0, "new": 0, "finished": 0}, 20.0
    for round_ in range(kills):
        ids = read_saved(folder).corpus.doc_ids()
        gone = rng.sample(ids, UPDATE_DOCS)
        question = " ".join(read_saved(folder).corpus.doc(gone[0]).text.split()[:12])
        before = state(folder, question)
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(folder), ",".join(gone)], stdout=subprocess.PIPE,
                                 text=True)
        line = child.stdout.readline()
        if not line.startswith("saving"):
            print(f"round {round_}: the child failed before saving: {line!r}")
            return 1
        time.sleep(rng.uniform(0, save_s))
        child.send_signal(signal.SIGKILL)
        rest = child.stdout.read()
        child.wait()
        if rest.startswith("saved"):
            save_s = float(rest.split()[1])  # the kills of later rounds land inside a save this long
        try:
            after = state(folder, question)
        except Exception as err:  # noqa: BLE001 - neither state: the failure this checks for
            print(f"round {round_}: the index does not open after the kill: {type(err).__name__}: {err}")
            failures += 1
            continue
        if after[0] == before[0]:
            ok, kind = after[1] == before[1] and after[2] == before[2], "old"
        else:
            ok, kind = after[0] == before[0] + 1 and after[1] == before[1] - set(gone), "new"
        kind = "finished" if rest.startswith("saved") else kind
        outcomes[kind] += 1
        failures += not ok
        print(f"round {round_}: killed {'after' if kind == 'finished' else 'during'} the save; generation "
              f"{before[0]} -> {after[0]} ({kind}), {'ok' if ok else 'NEITHER'}", flush=True)
    print(json.dumps({"kills": kills, "outcomes": outcomes, "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    sys.exit(run(a.folder, a.kills, a.seed))
