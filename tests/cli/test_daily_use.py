"""Daily use of the command line on a folder of docs: what needs no model answers without importing torch
(`endo query --method bm25`, `endo remove` of an unknown id, `endo info DIR`), and a document's id is its path under
the folder given, whatever the current folder (an index named another way keeps its names). Runs on the tiny random
model (tokenising only)."""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest

from endo_retrieval.cli import main

from tiny import DOCS, tiny_engine

# a fresh interpreter runs `endo ...` through main, then reports its exit status and whether torch was imported
RUN = """
import sys
from endo_retrieval.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
sys.stdout.flush()
print(f"exit={code} torch={'torch' in sys.modules}", file=sys.stderr)
"""


def endo(*args: str) -> tuple[int, str, str]:
    """`endo ARGS` in this process, with the tiny model where the command loads one: (exit code, stdout, stderr)."""
    model = ["--model", tiny_engine()[0].source] if args[0] in ("index", "query", "remove") else []
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([*args, *model])
    return rc, out.getvalue(), err.getvalue()


def fresh(*args: str, cwd) -> tuple[str, str]:
    """(stdout, the last line of stderr: exit status and torch) of `endo ARGS` in a fresh interpreter, no --model."""
    done = subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, timeout=120, cwd=cwd)
    return done.stdout, done.stderr.strip().splitlines()[-1]


@pytest.fixture
def docs(tmp_path, monkeypatch):
    """A folder of four notes, one in a subfolder, indexed for bm25 from the folder above it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    for name in ("ship", "cafe", "vault"):
        (tmp_path / "docs" / f"{name}.txt").write_text(DOCS[name], encoding="utf-8")
    (tmp_path / "docs" / "sub" / "mill.md").write_text(DOCS["mill"], encoding="utf-8")
    rc, _, err = endo("index", "docs", "--out", "ix", "--method", "bm25")
    assert rc == 0, err
    return tmp_path / "docs"


def test_a_bm25_query_remove_and_info_answer_without_torch(docs, tmp_path):
    out, status = fresh("query", "ix", "Where is the home port of the Albatross?", "--k", "2", "--json",
                        cwd=tmp_path)
    hits = json.loads(out)
    assert status == "exit=0 torch=False"
    assert hits[0]["doc_id"] == "ship.txt" and "Gdansk" in hits[0]["text"] and hits[0]["signals"] == ["bm25"]
    assert len({h["doc_id"] for h in hits}) == len(hits)  # a hit per document
    for h in hits:  # offsets point into the source file
        assert (docs / h["doc_id"]).read_text()[h["char_start"]:h["char_end"]] == h["text"]
    out, status = fresh("query", "ix", "Albatross", "--whole", "--json", "--k", "3", cwd=tmp_path)
    assert status == "exit=0 torch=False" and [h["text"] for h in json.loads(out)] == [DOCS["ship"]]
    _, status = fresh("remove", "ix", "no-such-doc", cwd=tmp_path)
    assert status == "exit=2 torch=False"
    out, status = fresh("info", "ix", cwd=tmp_path)
    assert status == "exit=0 torch=False" and f"ids: paths under {docs}" in out


def test_the_bm25_hits_are_the_engines_own_passages(docs):
    """The folder read without the model ranks the passages the engine cuts, by the BM25 it keeps of them."""
    from endo_retrieval.methods.search import EndoIndex

    rc, out, _ = endo("query", "ix", "When does the cafe open?", "--json", "--passages", "--k", "3")
    passages = EndoIndex.load("ix", tiny_engine()[0]).passages()
    scores = passages.bm25.get_scores(["cafe", "open"])
    best = int(scores.argmax())
    assert json.loads(out)[0]["tokens"] == [int(passages.starts[best]), int(passages.ends[best])]
    assert json.loads(out)[0]["score"] == pytest.approx(scores[best])


def test_ids_stay_put_whatever_the_current_folder(docs, tmp_path, monkeypatch):
    assert endo("info", "ix", "--documents")[1].split() == ["cafe.txt", "ship.txt", "sub/mill.md", "vault.txt"]
    for cwd in ("/", docs / "sub", tmp_path):  # the same folder appended from three working folders
        monkeypatch.chdir(cwd)
        rc, out, err = endo("index", str(docs), "--out", str(tmp_path / "ix"), "--append")
        assert rc == 0, err
        assert out.startswith("added 0, replaced 0, unchanged 4, removed 0 ->")
    # nothing to do: said from the folder without the model, in the words the model-loaded run uses
    fast, status = fresh("index", str(docs), "--out", str(tmp_path / "ix"), "--append", cwd="/")
    assert status == "exit=0 torch=False" and fast == out
    monkeypatch.chdir(tmp_path)
    rc, out, _ = endo("index", "docs/sub", "--out", "ix", "--append")  # a subfolder: its documents keep their ids
    assert out.startswith("added 0, replaced 0, unchanged 1, removed 0 ->")
    rc, out, _ = endo("remove", "ix", str(docs / "sub" / "mill.md"))  # a file's path names its document
    assert rc == 0 and endo("info", "ix", "--documents")[1].split() == ["cafe.txt", "ship.txt", "vault.txt"]


def test_an_index_named_from_another_folder_keeps_its_names(docs, tmp_path, monkeypatch):
    """An index whose ids are paths under the folder above (as one made from there when ids followed the current
    folder) keeps them on every append, from anywhere, and names a new file the same way."""
    rc, out, err = endo("index", "docs", "--out", "old", "--method", "bm25", "--root", ".")
    assert rc == 0, err
    named = ["docs/cafe.txt", "docs/ship.txt", "docs/sub/mill.md", "docs/vault.txt"]
    assert endo("info", "old", "--documents")[1].split() == named
    (docs / "new.txt").write_text(DOCS["vault"].replace("4417", "9021"), encoding="utf-8")
    monkeypatch.chdir("/")
    rc, out, err = endo("index", str(docs), "--out", str(tmp_path / "old"), "--append")
    assert rc == 0, err
    assert out.startswith("added 1, replaced 0, unchanged 4, removed 0 ->")
    assert "docs/new.txt" in endo("info", str(tmp_path / "old"), "--documents")[1].split()
    assert f"ids: paths under {tmp_path}" in endo("info", str(tmp_path / "old"))[1]
    rc, _, err = endo("index", str(docs), "--out", str(tmp_path / "old"), "--append", "--root", str(docs / "sub"))
    assert rc == 2 and "does not lie under it" in err


def test_indexing_says_one_line_a_phase_and_a_missing_folder_names_every_suffix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "ship.txt").write_text(DOCS["ship"], encoding="utf-8")
    rc, out, err = endo("index", "notes", "--out", "ix", "--method", "bm25")
    assert rc == 0 and out.startswith("indexed 1 document(s) -> ix;")
    lines = err.splitlines()  # not a terminal: no bar, a line a phase
    assert [line.split(":")[0] for line in lines] == ["endo index"] * 4
    assert lines[0] == f"endo index: 1 file(s) read ({len(DOCS['ship']):,} characters)"
    assert "loaded (cpu) in " in lines[1] and "1 document(s) indexed in " in lines[2]
    assert lines[3].startswith("endo index: written to ix in ")
    rc, _, err = endo("index", "missing", "--out", "ix2")
    assert rc == 2 and "missing does not exist; pass text files or folders of .md/.rst/.text/.txt files" in err
