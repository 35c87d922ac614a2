"""The structure of a text file: the headings of Markdown and reStructuredText, and blank-line paragraphs.

A file read from disk (its document's metadata names it: `endo index` writes "path", LlamaIndex's readers
"file_path", LangChain's loaders "source") is cut into passages at its headings and, where a section is longer than a
passage, preferably at its paragraphs (index/passages.py), and each hit names its file, its title and its section.
Any other document (a text given from Python, a benchmark's paragraph) has no structure here and is cut at sentences
alone, as it always was. Light to import (no torch).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import PurePath

import numpy as np

PATH_KEYS = ("path", "file_path", "source")  # where a document's metadata names the file it was read from
MARKUP = {".md": "markdown", ".markdown": "markdown", ".rst": "rst", ".txt": None, ".text": None}
# reStructuredText's adornment characters; a title is underlined (and maybe overlined) by a run of one of them
RST_ADORNMENT = re.compile(r"([=\-`:'\"~^_*+#<>.!$%&,/;?@\\|])\1{2,}[ \t]*")
ATX = re.compile(r" {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*")
SETEXT = re.compile(r" {0,3}(=+|-+)[ \t]*")
FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
PARAGRAPH = re.compile(r"\n[ \t]*\n\s*")  # a blank line; the paragraph starts at the next text


@dataclass(frozen=True)
class Heading:
    start: int  # character where the heading's block starts (its overline, or its text)
    end: int  # character one past its block (past its underline)
    title: str
    level: int  # 1 the top; reStructuredText's levels follow the order its adornments first appear in


def file_path(metadata: dict) -> str | None:
    """The file a document was read from, as its metadata names it, or None."""
    for key in PATH_KEYS:
        value = metadata.get(key) if isinstance(metadata, dict) else None
        if isinstance(value, str) and PurePath(value).suffix.lower() in MARKUP:
            return value
    return None


def markup(metadata: dict) -> str | None:
    """"markdown" or "rst" where the document was read from such a file, else None."""
    path = file_path(metadata)
    return MARKUP[PurePath(path).suffix.lower()] if path else None


def headings(text: str, kind: str | None) -> list[Heading]:
    """The headings of `text` written in `kind` ("markdown", "rst"; None: none), in order."""
    if kind == "markdown":
        return _markdown(text)
    if kind == "rst":
        return _rst(text)
    return []


@functools.lru_cache(maxsize=256)
def cached_headings(text: str, kind: str | None) -> tuple[Heading, ...]:
    return tuple(headings(text, kind))


def _lines(text: str) -> list[tuple[int, str]]:
    """(character start, line without its newline) of each line."""
    out, at = [], 0
    for line in text.split("\n"):
        out.append((at, line))
        at += len(line) + 1
    return out


def _markdown(text: str) -> list[Heading]:
    """ATX headings (# Title) and setext ones (a line underlined by === or ---, after a blank line or a heading),
    outside fenced code blocks."""
    lines, out, fence = _lines(text), [], None
    for i, (at, line) in enumerate(lines):
        m = FENCE.match(line)
        if m and (fence is None or m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence)):
            fence = m.group(1) if fence is None else None
            continue
        if fence is not None:
            continue
        if m := ATX.fullmatch(line):
            out.append(Heading(at, at + len(line), m.group(2).strip() or line.strip(), len(m.group(1))))
            continue
        below = lines[i + 1][1] if i + 1 < len(lines) else ""
        starts_block = i == 0 or not lines[i - 1][1].strip() or (out and out[-1].end == at - 1)
        if line.strip() and starts_block and not line.startswith((" " * 4, "\t")) and SETEXT.fullmatch(below):
            out.append(Heading(at, lines[i + 1][0] + len(below), line.strip(), 1 if "=" in below else 2))
    return out


def _rst(text: str) -> list[Heading]:
    """Section titles: a line of text at the margin underlined (and maybe overlined with the same run) by a run of
    one adornment character at least as long as half the title; the levels in the order the styles appear."""
    lines, out, styles = _lines(text), [], []
    i = 0
    while i + 1 < len(lines):
        (at, line), (_, below) = lines[i], lines[i + 1]
        over = RST_ADORNMENT.fullmatch(line)
        if over and i + 2 < len(lines) and _titles(below.strip(), lines[i + 2][1], over) and \
                lines[i + 2][1].strip() == line.strip():  # overline, title, underline
            style, title, end = (line.strip()[0], True), below.strip(), lines[i + 2][0] + len(lines[i + 2][1])
            i += 3
        elif line.strip() and not line[0].isspace() and not over and _titles(line.strip(), below):
            style, title, end = (below.strip()[0], False), line.strip(), lines[i + 1][0] + len(below)
            i += 2
        else:
            i += 1
            continue
        if style not in styles:
            styles.append(style)
        out.append(Heading(at, end, title, styles.index(style) + 1))
    return out


def _titles(title: str, below: str, over=None) -> bool:
    """Whether `below` underlines `title` (a run of one adornment at least half its length; the overline's own
    character where there is one)."""
    m = RST_ADORNMENT.fullmatch(below)
    return bool(title) and m is not None and len(below.strip()) * 2 >= len(title) and \
        (over is None or over.group(1) == m.group(1))


def paragraph_starts(text: str) -> list[int]:
    """Characters where a paragraph starts after a blank line."""
    return [m.end() for m in PARAGRAPH.finditer(text) if m.end() < len(text)]


def token_positions(doc, chars) -> np.ndarray:
    """The document's global token positions where the characters `chars` start: the first token whose span ends
    after each (as sentence starts are placed, corpus.py)."""
    ends = np.maximum.accumulate(doc.offsets[:, 1])
    local = np.searchsorted(ends, np.asarray(chars, dtype=np.int64), side="right")
    return doc.start + np.minimum(local, doc.n_tokens - 1)


def section_metadata(doc, char: int) -> dict:
    """What a hit at character `char` of `doc` says of where it lies: the file's name, the document's title (its
    first heading) and the section it lies in (the last heading at or before it); {} for a document not read from a
    file."""
    path = file_path(doc.metadata)
    if path is None:
        return {}
    out = {"file_name": PurePath(path).name}
    found = cached_headings(doc.text, markup(doc.metadata))
    if found:
        out["title"] = ([h for h in found if h.level == 1] or found)[0].title
        before = [h for h in found if h.start <= char]
        if before:
            out["section"] = before[-1].title
    return out
