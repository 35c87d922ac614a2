"""`endo index` over real folders: a Latin-1/cp1252 file is read, a binary or empty one is skipped with a warning
and listed, and --strict refuses the run with the index on disk untouched. The rule itself (`indexable_text`)
is tested on bytes first; the command runs on the tiny random model (tokenising only: the default method needs no
forward pass to build)."""
import hashlib
import os

import pytest

from endo_retrieval.cli import main
from endo_retrieval.index.text_files import Unreadable, indexable_text, read_text_files

from tiny import DOCS, tiny_engine

LATIN = "Caf\u00e9 cr\u00e8me \u2013 \u201cna\u00efve\u201d notes on the \u00e9l\u00e8ve's r\u00e9sum\u00e9."
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"


def test_utf8_is_read_first_and_its_byte_order_mark_dropped():
    assert indexable_text(LATIN.encode("utf-8")) == (LATIN, "utf-8")
    assert indexable_text(b"\xef\xbb\xbfhello") == ("hello", "utf-8")


@pytest.mark.parametrize("encoding", ["latin-1", "cp1252"])
def test_latin1_and_cp1252_text_is_decoded_as_cp1252(encoding):
    text = LATIN if encoding == "cp1252" else "Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9.\r\n\tEnd."
    assert indexable_text(text.encode(encoding)) == (text, "cp1252")


@pytest.mark.parametrize("data, why", [
    (PNG, "binary"),                                     # control characters once read as cp1252
    (b"\x81\x8d\x90 no such cp1252 bytes", "binary"),    # bytes cp1252 leaves undefined
    ("hi there".encode("utf-16"), "binary"),             # NUL in every other byte
    (b"ok\x00\x00", "binary"),                           # valid UTF-8, but NUL
    (b"", "empty"), (b" \n\t\r\n", "empty"),
    ("text with a lone \ud800 surrogate", "not valid Unicode"),
])
def test_what_cannot_be_indexed_says_why(data, why):
    with pytest.raises(Unreadable, match=f"^{why}"):
        indexable_text(data)


def test_a_given_text_is_checked_but_not_decoded():
    assert indexable_text("plain text") == ("plain text", None)


def folder_of_notes(root):
    notes = root / "notes"
    notes.mkdir()
    (notes / "ship.txt").write_text(DOCS["ship"], encoding="utf-8")
    (notes / "cafe.md").write_bytes(LATIN.encode("cp1252"))
    (notes / "scan.txt").write_bytes(PNG)
    (notes / "todo.md").write_bytes(b"\n")
    return notes


def test_reading_a_folder_keeps_the_readable_files_and_says_why_for_the_rest(tmp_path):
    read, skipped = read_text_files(sorted(folder_of_notes(tmp_path).iterdir()))
    assert [(f.path.name, f.encoding) for f in read] == [("cafe.md", "cp1252"), ("ship.txt", "utf-8")]
    assert read[0].text == LATIN
    assert [(p.name, why.split()[0]) for p, why in skipped] == [("scan.txt", "binary"), ("todo.md", "empty")]


def why_not(data) -> str:
    with pytest.raises(Unreadable) as e:
        indexable_text(data)
    return str(e.value)


def snapshot(root) -> dict:
    """Every file under `root` with the hash of its bytes: what the disk holds."""
    return {os.path.relpath(os.path.join(d, f), root): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, files in os.walk(root) for f in files}


def test_index_skips_unreadable_files_lists_them_and_strict_refuses(tmp_path, capsys):
    from endo_retrieval import EndoIndex

    backbone, _ = tiny_engine()
    notes, out = folder_of_notes(tmp_path), tmp_path / "ix"
    assert main(["index", str(notes), "--out", str(out), "--model", backbone.source]) == 0
    printed = capsys.readouterr()
    assert f"warning: skipping {notes / 'scan.txt'}: binary" in printed.err
    assert f"read as cp1252/Latin-1 (not UTF-8): {notes / 'cafe.md'}" in printed.out
    listed = printed.out.rstrip().splitlines()[-3:]  # the skipped files, at the end
    assert listed == ["skipped 2 file(s) that cannot be read as text:",
                      f"  {notes / 'scan.txt'}: {why_not(PNG)}", f"  {notes / 'todo.md'}: empty"]
    index = EndoIndex.load(out, backbone)
    assert index.doc_ids == ["cafe.md", "ship.txt"]  # paths under the folder given
    assert index.corpus.doc("cafe.md").text == LATIN

    (notes / "more.txt").write_text(DOCS["vault"], encoding="utf-8")
    before = snapshot(tmp_path)
    assert main(["index", str(notes), "--out", str(out), "--append", "--strict", "--model", backbone.source]) == 2
    assert "--strict: 2 of 5 file(s) cannot be read as text" in capsys.readouterr().err
    assert snapshot(tmp_path) == before  # the index, its lock and its neighbours: not a byte changed
    assert EndoIndex.load(out, backbone).doc_ids == index.doc_ids


def test_a_folder_with_nothing_readable_is_an_error(tmp_path, capsys):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "scan.txt").write_bytes(PNG)
    assert main(["index", str(notes), "--out", str(tmp_path / "ix")]) == 2
    assert "none of the 1 file(s) can be read as text" in capsys.readouterr().err
    assert not (tmp_path / "ix").exists()


def test_the_summary_says_what_the_index_holds_for_its_method(tmp_path, capsys):
    from endo_retrieval.cli.indexing import index_summary
    from endo_retrieval.index.engine import Document

    from tiny import new_index

    backbone, _ = tiny_engine()
    notes = tmp_path / "notes"
    notes.mkdir()
    for name in ("ship", "cafe"):
        (notes / f"{name}.txt").write_text(DOCS[name], encoding="utf-8")
    out = tmp_path / "ix"
    assert main(["index", str(notes), "--out", str(out), "--model", backbone.source]) == 0
    tokens = sum(backbone.count_tokens(DOCS[name]) for name in ("ship", "cafe"))
    on_disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    assert capsys.readouterr().out == (f"indexed 2 document(s) -> {out}; it holds 2 documents, 2 passages, {tokens} "
                                       f"tokens, {on_disk:,} bytes on disk (method endo)\n")  # no postings to count

    s3 = new_index("s3-hybrid")  # the tiny engine's SAEs: feature postings
    s3.add_documents([Document(name, DOCS[name]) for name in ("ship", "cafe")])
    s3.save(tmp_path / "s3")
    assert f", {s3.index.n_postings:,} postings (" in index_summary(s3, tmp_path / "s3")
    assert s3.index.n_postings > 0
