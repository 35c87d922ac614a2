"""Updating an index from the command line as a user expects: `endo index --append` is an upsert keyed by a
normalised document id (the same folder twice changes nothing; a changed file's new text replaces its old one; the
same file typed two ways is one document), `endo remove` takes documents out, `endo info DIR` says the committed
generation, a killed writer's leftovers are cleaned by the next writer, and no lock file stays after a clean exit.
Runs on the tiny random model with the BM25 method (tokenising only)."""
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from endo_retrieval import files
from endo_retrieval.cli import main

from tiny import DOCS, tiny_engine


def endo(*args: str) -> tuple[int, str, str]:
    """`endo ARGS` in this process, with the tiny model where the command loads one: (exit code, stdout, stderr)."""
    model = ["--model", tiny_engine()[0].source] if args[0] in ("index", "query", "remove") else []
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([*args, *model])
    return rc, out.getvalue(), err.getvalue()


def info(folder: str = "ix") -> dict:
    rc, out, err = endo("info", folder, "--json")
    assert rc == 0, err
    return json.loads(out)


def snapshot(root: Path) -> dict:
    """Every file and folder under `root` with its bytes: what the disk holds."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.fixture
def notes(tmp_path, monkeypatch):
    """A folder of two notes indexed from the folder above it (ids are paths under the folder given)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").mkdir()
    for name in ("ship", "cafe"):
        (tmp_path / "notes" / f"{name}.txt").write_text(DOCS[name], encoding="utf-8")
    assert endo("index", "notes", "--out", "ix", "--method", "bm25")[0] == 0
    return tmp_path / "notes"


def test_appending_the_same_folder_twice_succeeds_and_changes_nothing(notes, tmp_path):
    before = snapshot(tmp_path)
    for typed in ("notes", "./notes/", str(notes), str(notes / "ship.txt")):  # the same files, typed four ways
        rc, out, err = endo("index", typed, "--out", "ix", "--append")
        assert rc == 0, err
        assert out.startswith(f"added 0, replaced 0, unchanged {1 if typed.endswith('.txt') else 2}, removed 0 -> ix, "
                              "generation 1 (nothing changed, nothing written)")
    assert snapshot(tmp_path) == before  # not a byte changed, and no lock file left
    assert info()["generation"] == 1
    rc, out, _ = endo("info", "ix", "--documents")
    assert out.split() == ["cafe.txt", "ship.txt"]  # one document per file, however it was typed


def test_a_changed_file_is_found_by_its_new_text_and_not_by_its_old(notes, tmp_path):
    (notes / "cafe.txt").write_text(DOCS["vault"], encoding="utf-8")  # the cafe note now holds the vault's text
    (notes / "mill.txt").write_text(DOCS["mill"], encoding="utf-8")
    rc, out, err = endo("index", str(notes), "--out", "ix", "--append")
    assert rc == 0, err
    assert out.startswith("added 1, replaced 1, unchanged 1, removed 0 -> ix, generation 2;")
    rc, out, _ = endo("query", "ix", "What is the vault combination?", "--json", "--k", "4")
    hits = json.loads(out)
    assert any(h["doc_id"] == "cafe.txt" and "4417" in h["text"] for h in hits)
    rc, out, _ = endo("query", "ix", "When does the cafe serve espresso?", "--json", "--k", "4")
    assert not any("espresso" in h["text"] for h in json.loads(out))  # the old text is gone from the index
    assert info()["documents"] == 3 and sorted(os.listdir(tmp_path)) == ["ix", "notes"]


def test_a_deleted_or_now_unreadable_file_is_removed_and_other_documents_stay(notes, tmp_path):
    (tmp_path / "other.txt").write_text(DOCS["mill"], encoding="utf-8")
    assert endo("index", "other.txt", "--out", "ix", "--append")[0] == 0
    (notes / "ship.txt").unlink()
    (notes / "cafe.txt").write_bytes(b"\x00\x01 binary now")
    (notes / "new.md").write_text(DOCS["vault"], encoding="utf-8")
    rc, out, err = endo("index", "notes", "--out", "ix", "--append")
    assert rc == 0 and "warning: skipping notes/cafe.txt: binary" in err
    assert out.startswith("added 1, replaced 0, unchanged 0, removed 2 -> ix, generation 3;")
    assert endo("info", "ix", "--documents")[1].split() == ["other.txt", "new.md"]  # other.txt: not under notes


def test_remove_takes_documents_out_by_any_spelling_and_refuses_unknown_ids(notes, tmp_path):
    before = snapshot(tmp_path)
    rc, _, err = endo("remove", "ix", "ship.txt", "no-such-doc")
    assert rc == 2 and "holds no document 'no-such-doc', so nothing was removed; list its ids with `endo info ix " \
                       "--documents`" in err
    assert snapshot(tmp_path) == before
    rc, out, err = endo("remove", "ix", str(notes / "ship.txt"))  # the file's path names its id
    assert rc == 0, err
    assert out.startswith("removed 1 document(s) -> ix, generation 2; it holds 1 documents")
    assert endo("info", "ix", "--documents")[1].split() == ["cafe.txt"]
    assert sorted(os.listdir(tmp_path)) == ["ix", "notes"]


def test_python_upsert_keeps_ids_as_given_and_skips_unchanged_documents(monkeypatch):
    from endo_retrieval import Document

    from tiny import new_index

    idx = new_index("bm25")
    idx.add_documents([Document("./a", DOCS["ship"], {"n": 1}), Document("b", DOCS["cafe"])])
    indexed, add = [], type(idx).add_documents

    def counted(self, docs, *args, **kwargs):
        indexed.extend(d.doc_id for d in docs)
        return add(self, docs, *args, **kwargs)

    monkeypatch.setattr(type(idx), "add_documents", counted)
    done = idx.update_documents([Document("./a", DOCS["ship"], {"n": 1}), Document("b", DOCS["vault"]),
                                 Document("c", DOCS["mill"])])
    assert done == {"added": ["c"], "replaced": ["b"], "unchanged": ["./a"]} and indexed == ["b", "c"]
    assert idx.doc_ids == ["./a", "b", "c"] and idx.corpus.doc("b").text == DOCS["vault"]
    assert idx.update_documents([Document("./a", DOCS["ship"], {"n": 2})])["replaced"] == ["./a"]  # metadata too
    with pytest.raises(ValueError, match="Document 'b': .*empty"):  # a bad document: nothing changes
        idx.update_documents([Document("c", DOCS["ship"]), Document("b", " ")])
    assert idx.corpus.doc("c").text == DOCS["mill"] and idx.corpus.doc("b").text == DOCS["vault"]
    with pytest.raises(ValueError, match="'c' is given twice"):
        idx.update_documents([Document("c", "x"), Document("c", "y")])


def test_a_replacement_that_fails_midway_keeps_the_old_version(monkeypatch):
    from endo_retrieval import Document

    from tiny import new_index

    idx = new_index("bm25")
    idx.add_documents([Document("a", DOCS["ship"])])

    def out_of_memory(text):
        raise MemoryError("out of memory")

    monkeypatch.setattr(idx.backbone, "encode_pieces", out_of_memory)
    with pytest.raises(MemoryError):
        idx.update_documents([Document("a", DOCS["cafe"])])
    assert idx.doc_ids == ["a"] and idx.corpus.doc("a").text == DOCS["ship"]


def test_the_next_writer_cleans_what_a_killed_one_left_even_when_it_writes_nothing(notes, tmp_path):
    shutil.copytree(tmp_path / "ix", tmp_path / ".ix.old")  # killed after the swap, before the old one went
    (tmp_path / ".ix.tmp-k1ll3d").mkdir()  # killed while it filled its temp folder
    (tmp_path / ".ix.lock").touch()  # a killed writer's lock file (no one holds it)
    assert info()["leftovers"] == [".ix.old", ".ix.tmp-k1ll3d"]
    lines = endo("info", "ix")[1].splitlines()
    assert lines[0] == "     index: ix" and lines[2] == "    method: bm25"
    assert lines[3:6] == ["generation: 1 (committed)", " documents: 2", "  passages: 2"]
    assert lines[-1].startswith("      note: an unfinished write (killed, or still running) left .ix.old, "
                                ".ix.tmp-k1ll3d; the generation above is what is committed")
    assert endo("index", "notes", "--out", "ix", "--append")[0] == 0  # nothing to write, but it cleans
    assert sorted(os.listdir(tmp_path)) == ["ix", "notes"]


# a real kill: the child runs `endo index --append` and dies with os._exit at the named step
CHILD = textwrap.dedent("""
    import os, sys
    from endo_retrieval import files
    from endo_retrieval.cli import main
    files.crash_hook = lambda what: os._exit(9) if what.startswith(sys.argv[1]) else None
    sys.exit(main(sys.argv[2:]))
""")


@pytest.mark.parametrize("die_at, committed", [("rename the new ix into place", False), ("remove the old ix", True)])
def test_after_a_kill_at_the_swap_endo_info_says_whether_the_append_was_committed(notes, tmp_path, die_at,
                                                                                  committed):
    (notes / "mill.txt").write_text(DOCS["mill"], encoding="utf-8")
    run = subprocess.run([sys.executable, "-c", CHILD, die_at, "index", "notes", "--out", "ix", "--append",
                          "--model", tiny_engine()[0].source], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(files.__file__).parents[1])})
    assert run.returncode == 9, run.stderr
    assert (tmp_path / ".ix.old").exists()  # the leftover the kill made
    after = info()
    assert (after["generation"], after["documents"]) == ((2, 3) if committed else (1, 2))
    assert after["leftovers"][0] == ".ix.old"  # and, before the commit, the new state's temp folder
    rc, out, _ = endo("index", "notes", "--out", "ix", "--append")  # the user runs it again
    assert rc == 0 and out.startswith("added 0, replaced 0, unchanged 3, removed 0 -> ix, generation 2 (nothing"
                                      if committed else "added 1, replaced 0, unchanged 2, removed 0 -> ix, "
                                      "generation 2;")
    assert sorted(os.listdir(tmp_path)) == ["ix", "notes"]


HOLDER = textwrap.dedent("""
    import importlib.util, os, sys, time
    spec = importlib.util.spec_from_file_location("files", sys.argv[1])
    files = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(files)  # only this module: no torch in the child
    for _ in range(int(sys.argv[4])):
        with files.writer_lock(sys.argv[2], wait=30):
            with open(sys.argv[3], "a") as log:
                log.write(f"in {os.getpid()}\\n")
                log.flush()
                time.sleep(0.002)  # another writer inside now would write between these lines
                log.write(f"out {os.getpid()}\\n")
""")


def test_removing_the_lock_file_keeps_one_writer_at_a_time(tmp_path):
    """Each writer removes the lock file as it lets go; one that was waiting on the removed file must not run beside
    one that took the new file: the log never shows two writers inside at once."""
    log = tmp_path / "log"
    children = [subprocess.Popen([sys.executable, "-c", HOLDER, files.__file__, str(tmp_path / "ix"), str(log), "60"])
                for _ in range(3)]
    assert [c.wait(timeout=120) for c in children] == [0, 0, 0]
    words = log.read_text().split()
    entries = [words[i:i + 4] for i in range(0, len(words), 4)]
    assert len(entries) == 180 and all(e[0] == "in" and e[2] == "out" and e[1] == e[3] for e in entries)
    assert sorted(os.listdir(tmp_path)) == ["log"]  # no lock file left
