"""What can be indexed, from real folders and from callers' texts: which files `endo index` reads, and the one rule
that turns bytes (or a given text) into text to index, used by `endo index`, `endo compress` and the MCP server.

A folder of notes often holds a file saved by an old editor in Latin-1 or Windows-1252, an empty file or a stray
binary one; such a file should not cost the whole folder its index. Light to import (no torch): the command line
reads the files before it loads the model.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text"}  # what a folder contributes; a file named on its own is read anyway
# control characters other than whitespace (tab, newline, vertical tab, form feed, carriage return): bytes that
# decode as cp1252 into any of these are a binary file, not text (cp1252 decodes almost every byte)
CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")


class Unreadable(ValueError):
    """A file or a text that cannot be indexed; the message says why."""


def indexable_text(source: bytes | str) -> tuple[str, str | None]:
    """(text, encoding) of `source` when it can be indexed, else Unreadable saying why. Bytes are read as UTF-8 (a
    byte-order mark dropped) when they decode so; else as cp1252 (Latin-1's printable characters plus Windows'
    quotes and dashes in 0x80-0x9F) when they decode and look like text, i.e. hold no control character other than
    whitespace; else they are refused. Then, bytes or a given str (encoding None): a text that is blank, holds NUL
    (a binary file, or UTF-16) or a lone surrogate (not Unicode) cannot be indexed."""
    text, encoding = source, None
    if isinstance(source, bytes):
        try:
            text, encoding = source.decode("utf-8-sig"), "utf-8"
        except UnicodeDecodeError:
            try:
                text, encoding = source.decode("cp1252"), "cp1252"
            except UnicodeDecodeError:
                raise Unreadable("binary or an unknown encoding (neither UTF-8 nor cp1252/Latin-1)") from None
            if CONTROL.search(text):
                raise Unreadable("binary (neither UTF-8 nor cp1252/Latin-1 text: it holds control characters)")
    if not isinstance(text, str):
        raise Unreadable(f"not text but {type(text).__name__}")
    if not text.strip():
        raise Unreadable("empty")
    if "\x00" in text:
        raise Unreadable("binary (it holds NUL characters; UTF-16 text must be converted to UTF-8 first)")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise Unreadable(f"not valid Unicode (a lone surrogate at character {e.start})") from None
    return text, encoding


@dataclass(frozen=True)
class TextFile:
    path: Path
    text: str
    encoding: str  # "utf-8" or "cp1252"


def text_files(paths: list[str]) -> list[Path]:
    """The files to index: each file named, and the text files (TEXT_SUFFIXES) under each folder, sorted.
    FileNotFoundError for a path that does not exist, ValueError when there is no file at all."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"{p} does not exist; pass text files or folders of "
                                    f"{'/'.join(sorted(TEXT_SUFFIXES))} files.")
    if not out:
        raise ValueError(f"No text files found under {', '.join(paths)} (looked for {sorted(TEXT_SUFFIXES)}).")
    return out


def read_text_files(files: list[Path]) -> tuple[list[TextFile], list[tuple[Path, str]]]:
    """The files that can be indexed, read, and (path, why) for each one that cannot (`indexable_text`, or the
    operating system's reason, e.g. permission denied)."""
    read, skipped = [], []
    for path in files:
        try:
            read.append(TextFile(path, *indexable_text(path.read_bytes())))
        except Unreadable as e:
            skipped.append((path, str(e)))
        except OSError as e:
            skipped.append((path, e.strerror or str(e)))
    return read, skipped


def read_text_file(path: Path) -> TextFile:
    """One file that must be indexable (`endo compress --context`): ValueError saying why not and what to do."""
    try:
        return TextFile(path, *indexable_text(path.read_bytes()))
    except Unreadable as e:
        raise ValueError(f"{path} cannot be read as text: {e}; convert it to UTF-8 text or pass another file."
                         ) from None
