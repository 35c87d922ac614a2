"""Sentence boundaries of a text: where the corpus map (corpus.py) starts its sentences."""
from __future__ import annotations

import re

import numpy as np

# Words whose trailing period does not end a sentence (compared lower-case, without the final period).
ABBREVIATIONS = frozenset(
    "e.g i.e cf vs al mr mrs ms dr prof sr jr st mt no fig figs eq eqs approx ca inc ltd co corp dept est "
    "jan feb mar apr jun jul aug sep sept oct nov dec u.s u.k ph.d".split()
)
# . ! ? then whitespace; a newline; or the full-width 。！？ of scripts written without spaces (no space follows them)
_SENTENCE_END = re.compile(r"[.!?]+[\"'\u201d\u2019)\]]*\s+|\n\s*"
                           r"|[\u3002\uff01\uff1f]+[\u300d\u300f\u201d\u2019\uff09]*\s*")


def split_sentences(text: str, start: int = 0, end: int | None = None) -> np.ndarray:
    """Character offsets where sentences start: after . ! ? (plus closing quotes/brackets) and whitespace, and after
    every newline. A period does not split after a known abbreviation ('e.g.'), a single-letter initial ('J.'), or
    when the next word starts in lower case; decimals ('3.5') never split since no whitespace follows the period.

    `start`, `end`: only the starts in [start, end), where `start` is 0 or follows a newline and a non-blank
    character (a cut of `Backbone.encode_pieces`): no match crosses such a point, so the starts are the whole
    text's (the indexer splits each piece while the accelerator runs)."""
    end = len(text) if end is None else end
    starts = [start]
    for m in _SENTENCE_END.finditer(text, start, end):
        nxt = m.end()
        if nxt >= end:
            break
        if "\n" not in m.group():
            if text[nxt].islower():
                continue
            if set(m.group().rstrip().rstrip("\"'\u201d\u2019)]")) == {"."}:  # ended by periods only
                before = text[max(0, m.start() - 64): m.start()].split()  # the word before (not the whole prefix)
                word = before[-1].lstrip("(\"'[").lower() if before else ""
                if word in ABBREVIATIONS or (len(word) == 1 and word.isalpha()):
                    continue
        starts.append(nxt)
    return np.unique(np.asarray(starts, dtype=np.int64))
