"""Labelled data, read by the calibrations (`endo calibrate-heads`, `endo calibrate-pipeline`) and by the bench:
HotpotQA long haystacks and corpora, LongBench-style JSONL, and passkey haystacks. Everything is read from local
files; nothing downloads.

`load_examples(spec, ...)` accepts three forms of `spec`:
  * `PATH.json`    HotpotQA official layout; each question's ten paragraphs plus pooled distractors
  * `PATH.jsonl`   one {"context", "question", "answers"} object a line (LongBench layout)
  * `passkey:DIR`  passkey needles in filler text made from the .txt files in DIR
"""
from __future__ import annotations

import functools
import gzip
import json
import logging
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

logger = logging.getLogger(__name__)

TokenCounter = Callable[[str], int]

ACCEPTED_FORMS = (
    "accepted data specs: PATH.json (HotpotQA official layout), PATH.jsonl (one {context, question, answers} "
    "object a line, LongBench layout), passkey:DIR (a folder of .txt filler files)"
)
PARAGRAPH_SEPARATOR = "\n\n"
PASSKEY_QUESTION = "What is the pass key? The pass key is"
PASSKEY_DEFAULT_ITEMS = 10
# Sentence ends: whitespace after . ! ?, or none at all before a capital (the essays glue some paragraphs: "out.The").
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[a-z][.!?])(?=[A-Z])")


class DataError(ValueError):
    """A data file or row that cannot be used; the message names the file, the row and what is wrong."""


@dataclass
class Example:
    id: str
    question: str
    answers: list[str]
    context: str
    supporting: list[str] = field(default_factory=list)  # gold supporting sentences (HotpotQA), verbatim in context
    meta: dict = field(default_factory=dict)


@dataclass
class Dataset:
    """The loaded examples (list-like) and one message per malformed row skipped under `skip_bad`."""

    examples: list[Example]
    skipped: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.examples)

    def __iter__(self) -> Iterator[Example]:
        return iter(self.examples)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]


def load_examples(spec: str, *, count_tokens: TokenCounter, context_tokens: int | None = None,
                  limit: int | None = None, seed: int = 0, skip_bad: bool = False) -> Dataset:
    """Load `spec` (see module docstring). `context_tokens` sizes HotpotQA and passkey haystacks (JSONL contexts
    are used as given); `limit` keeps the first N examples; malformed rows raise `DataError` unless `skip_bad`."""
    if limit is not None and limit < 0:
        raise DataError(f"limit must be >= 0, got {limit}")
    if context_tokens is not None and context_tokens <= 0:
        raise DataError(f"context_tokens must be positive, got {context_tokens}")
    if spec.startswith("passkey:"):
        return _load_passkey(Path(spec[len("passkey:"):]), count_tokens, context_tokens, limit, seed)
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"{spec}: no such file; {ACCEPTED_FORMS}")
    if path.suffix == ".jsonl":
        return _load_jsonl(path, limit, skip_bad)
    if path.suffix == ".json":
        return _load_hotpotqa(path, count_tokens, context_tokens, limit, seed, skip_bad)
    raise DataError(f"{spec}: unknown data form; {ACCEPTED_FORMS}")


def _reject(message: str, skip_bad: bool, skipped: list[str]) -> None:
    if not skip_bad:
        raise DataError(f"{message} (pass skip_bad=True / --skip-bad to skip malformed rows)")
    logger.warning("skipping %s", message)
    skipped.append(message)


# ---------------------------------------------------------------- LongBench-style JSONL


def _parse_jsonl_row(line: str) -> Example:
    row = json.loads(line)  # JSONDecodeError is a ValueError: reported by the caller
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    for key in ("context", "question"):
        if not isinstance(row.get(key), str):
            raise ValueError(f"'{key}' must be a string")
    answers = row.get("answers")
    answers = [answers] if isinstance(answers, str) else answers
    if not (isinstance(answers, list) and answers and all(isinstance(a, str) for a in answers)):
        raise ValueError("'answers' must be a string or a non-empty list of strings")
    extra = {k: v for k, v in row.items() if k not in ("context", "question", "answers", "_id", "id")}
    return Example(id=str(row.get("_id", row.get("id", ""))), question=row["question"], answers=answers,
                   context=row["context"], meta=extra)


def _load_jsonl(path: Path, limit: int | None, skip_bad: bool) -> Dataset:
    examples: list[Example] = []
    skipped: list[str] = []
    with path.open(encoding="utf-8") as lines:
        for line_no, line in enumerate(lines, start=1):
            if limit is not None and len(examples) >= limit:
                break
            if not line.strip():
                continue
            try:
                example = _parse_jsonl_row(line)
            except ValueError as err:
                _reject(f"{path}: line {line_no}: {err}", skip_bad, skipped)
                continue
            example.id = example.id or f"{path.stem}:{line_no}"
            example.meta["line"] = line_no
            examples.append(example)
    return Dataset(examples, skipped)


# ---------------------------------------------------------------- HotpotQA long haystacks


def _check_hotpotqa_item(item: object) -> None:
    if not isinstance(item, dict):
        raise ValueError(f"expected a JSON object, got {type(item).__name__}")
    for key in ("_id", "question", "answer"):
        if not isinstance(item.get(key), str):
            raise ValueError(f"'{key}' must be a string")
    context = item.get("context")
    if not (isinstance(context, list) and context and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], list)
            and all(isinstance(s, str) for s in p[1]) for p in context)):
        raise ValueError("'context' must be a non-empty list of [title, [sentence, ...]]")
    sentences = {title: sents for title, sents in context}
    facts = item.get("supporting_facts")
    if not isinstance(facts, list) or not all(isinstance(f, list) and len(f) == 2 for f in facts):
        raise ValueError("'supporting_facts' must be a list of [title, sentence_index]")
    for title, index in facts:
        if title not in sentences or not isinstance(index, int) or not 0 <= index < len(sentences[title]):
            raise ValueError(f"supporting fact [{title!r}, {index!r}] names no sentence of the context")


def render_paragraph(title: str, sentences: list[str]) -> str:
    """'Title: s1 s2 ...' with each sentence stripped and kept whole, so gold sentences occur verbatim."""
    return f"{title}: " + " ".join(s.strip() for s in sentences)


def _load_hotpotqa(path: Path, count_tokens: TokenCounter, context_tokens: int | None, limit: int | None,
                   seed: int, skip_bad: bool) -> Dataset:
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: line {err.lineno}: not valid JSON ({err.msg})") from err
    if not isinstance(items, list):
        raise DataError(f"{path}: expected a JSON list of HotpotQA items (for one object a line use .jsonl)")
    skipped: list[str] = []
    valid = []
    for index, item in enumerate(items):
        try:
            _check_hotpotqa_item(item)
            valid.append(item)
        except ValueError as err:
            _reject(f"{path}: item {index}: {err}", skip_bad, skipped)
    # The distractor pool: every paragraph of the file once (by title: one Wikipedia article, one paragraph).
    pool: dict[str, str] = {}
    for item in valid:
        for title, sentences in item["context"]:
            pool.setdefault(title, render_paragraph(title, sentences))
    counts: dict[str, int] = {}  # tokens per rendered paragraph, counted once for the whole file

    def cost(text: str) -> int:
        # Counted with the separator before it, as it tokenizes inside the haystack ("\n\n" alone may merge
        # into one token, "\n\n" before a title often does not).
        if text not in counts:
            counts[text] = count_tokens(PARAGRAPH_SEPARATOR + text)
        return counts[text]

    chosen = valid if limit is None else valid[:limit]
    examples = [_hotpotqa_haystack(item, pool, cost, count_tokens, context_tokens, seed) for item in chosen]
    return Dataset(examples, skipped)


def _fit_length(build: Callable[[int], str], target: int, count_tokens: TokenCounter) -> tuple[str, int]:
    """`build(budget)` fills text to `budget` tokens by summing per-piece counts, counted once each. Subword
    counts are not exactly additive across joins, so count the built text once, move the budget by the error
    and rebuild: the longest build that fits `target` wins (a few whole-text counts, not one per piece).
    Returns the last build, over `target`, only when none fits (the required pieces alone exceed it)."""
    budget, best, counted = target, None, {}
    for _ in range(8):
        text = build(budget)
        if text not in counted:
            counted[text] = count_tokens(text)
        n = counted[text]
        if n <= target and (best is None or n > best[1]):
            best = (text, n)
        if n == target:
            break
        budget += target - n
    return best or (text, n)


def _hotpotqa_haystack(item: dict, pool: dict[str, str], cost: TokenCounter,
                       count_tokens: TokenCounter, context_tokens: int | None, seed: int) -> Example:
    rng = random.Random(f"{seed}/{item['_id']}")  # str seeds hash stably: the same haystack in every process
    own = {title: render_paragraph(title, sents) for title, sents in item["context"]}
    sentences = {title: sents for title, sents in item["context"]}
    gold_titles = list(dict.fromkeys(title for title, _ in item["supporting_facts"]))
    others = [t for t in own if t not in gold_titles]
    rng.shuffle(others)
    distractors = [t for t in pool if t not in own]
    rng.shuffle(distractors)
    # Gold paragraphs first (always kept), then the question's other paragraphs, then distractors, each kept
    # while it still fits (one that does not is passed over, so a long paragraph cannot stop the haystack far
    # short of its length). Without context_tokens: the question's own ten paragraphs only.
    candidates = [own[t] for t in gold_titles + others]
    if context_tokens is not None:
        candidates += [pool[t] for t in distractors]
    order_seed = rng.random()
    paragraphs_of: dict[str, list[str]] = {}  # built text -> its paragraphs

    def build(budget: float) -> str:
        kept: list[str] = []
        total = 0
        for position, text in enumerate(candidates):
            if position < len(gold_titles) or total + cost(text) <= budget:
                kept.append(text)
                total += cost(text)
        random.Random(order_seed).shuffle(kept)
        text = PARAGRAPH_SEPARATOR.join(kept)
        paragraphs_of[text] = kept
        return text

    if context_tokens is None:
        context = build(math.inf)
        n_tokens = count_tokens(context)
    else:
        context, n_tokens = _fit_length(build, context_tokens, count_tokens)
    kept = paragraphs_of[context]
    n_own = len(set(kept) & set(own.values()))
    meta = {"type": item.get("type"), "level": item.get("level"), "n_tokens": n_tokens,
            "n_paragraphs": len(kept), "n_distractors": len(kept) - n_own, "gold_titles": gold_titles,
            "own_paragraphs_dropped": len(own) - n_own,  # > 0: the own ones exceed the length; gold kept first
            "over_budget": context_tokens is not None and n_tokens > context_tokens}
    supporting = [sentences[title][index].strip() for title, index in item["supporting_facts"]]
    return Example(id=item["_id"], question=item["question"], answers=[item["answer"]], context=context,
                   supporting=supporting, meta=meta)


# ---------------------------------------------------------------- passkey haystacks (ILRe appendix A.1)


def passkey_needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key."


def make_passkey(filler_text: str, n_tokens: int, depth: float, key: str, count_tokens: TokenCounter) -> Example:
    """A haystack of at most `n_tokens` tokens: `filler_text` (repeated if short) with the needle inserted at the
    sentence boundary nearest `depth` (a fraction of the filler's tokens, 0 = start, 1 = end)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    sentences = [s for s in _SENTENCE_END.split(filler_text.strip()) if s]
    if not sentences:
        raise ValueError("filler_text is empty: give some text to hide the pass key in")
    needle = passkey_needle(key)
    needle_cost = count_tokens(" " + needle)
    needle_depths: dict[str, float] = {}  # built text -> tokens before the needle / filler tokens

    @functools.cache
    def sentence_cost(index: int) -> int:  # counted once, and only for the sentences the haystack reaches
        # " " + sentence: the space joins the first word as it does inside the text (a trailing one would not).
        cost = count_tokens(" " + sentences[index])
        if cost <= 0:
            raise ValueError(f"count_tokens gave {cost} for the filler sentence {sentences[index]!r}: need >= 1")
        return cost

    def build(budget: int) -> str:
        costs: list[int] = []
        total = needle_cost
        while total + sentence_cost(len(costs) % len(sentences)) <= budget:
            costs.append(sentence_cost(len(costs) % len(sentences)))
            total += costs[-1]
        cumulative = np.cumsum([0] + costs)
        boundary = int(np.argmin(np.abs(cumulative - depth * cumulative[-1])))  # sentence boundary nearest depth
        pieces = [sentences[i % len(sentences)] for i in range(len(costs))]
        text = " ".join(pieces[:boundary] + [needle] + pieces[boundary:])
        needle_depths[text] = float(cumulative[boundary] / max(cumulative[-1], 1))
        return text

    context, length = _fit_length(build, n_tokens, count_tokens)
    if length > n_tokens:
        raise ValueError(f"n_tokens={n_tokens} is too small to hold the needle {needle!r}")
    return Example(id=f"passkey-{n_tokens}-{depth:.3f}-{key}", question=PASSKEY_QUESTION, answers=[key],
                   context=context,
                   meta={"depth": depth, "needle_depth": needle_depths[context], "needle_char": context.index(needle),
                         "n_tokens": length, "context_tokens": n_tokens, "key": key})


def _load_passkey(folder: Path, count_tokens: TokenCounter, context_tokens: int | None, limit: int | None,
                  seed: int) -> Dataset:
    if context_tokens is None:
        raise DataError("passkey haystacks need a length: give context_tokens (--context-tokens)")
    files = sorted(folder.glob("*.txt")) if folder.is_dir() else []
    if not files:
        raise DataError(f"passkey:{folder}: no .txt filler files there; {ACCEPTED_FORMS}")
    rng = random.Random(seed)
    rng.shuffle(files)
    filler = PARAGRAPH_SEPARATOR.join(f.read_text(encoding="utf-8").strip() for f in files)
    n_items = PASSKEY_DEFAULT_ITEMS if limit is None else limit
    depths = np.linspace(0.0, 1.0, n_items) if n_items > 1 else np.array([0.5])[:n_items]
    keys = [str(rng.randint(10000, 99999)) for _ in range(n_items)]
    return Dataset([make_passkey(filler, context_tokens, float(d), k, count_tokens) for d, k in zip(depths, keys)])


def hotpotqa_corpus(path: str | Path, limit: int | None = None) -> tuple[list[str], list[str], list[dict]]:
    """Titles and rendered paragraphs of every paragraph in the file (one per title, as the quality bench's
    distractor pool), and the first `limit` items."""
    items = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(items, list):
        raise DataError(f"{path}: expected a JSON list of HotpotQA items")
    for i, item in enumerate(items):
        try:
            _check_hotpotqa_item(item)
        except ValueError as err:
            raise DataError(f"{path}: item {i}: {err}") from err
    pool: dict[str, str] = {}
    for item in items:
        for title, sentences in item["context"]:
            pool.setdefault(title, render_paragraph(title, sentences))
    return list(pool), list(pool.values()), items[:limit]


BEIR_SPLITS = ("train", "dev", "test")


def corpus_questions(spec: str | Path, limit: int | None = None) -> tuple[list[str], list[str], list[dict]]:
    """(titles, texts, questions) of a corpus-retrieval set, in `hotpotqa_corpus`'s shape: a HotpotQA JSON file, or
    a BEIR-layout file (`{"corpus": [{id, title, text}], "queries": {split: [{id, text, relevant}]}}`, gzip or not,
    as ../shared/data/scifact/ holds SciFact) named `PATH:SPLIT` (default split: test). A BEIR document's title is
    its id (ids are unique where titles need not be) and its text the title, a new line, the abstract; a
    question's gold are its relevant ids, as `supporting_facts` [[id, 0], ...], and its `type` the file's name."""
    path, _, split = str(spec).partition(":") if not Path(str(spec)).exists() else (str(spec), "", "")
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise DataError(f"{spec}: cannot read it as a JSON corpus-retrieval set ({err})") from None
    if isinstance(data, list):
        if split:
            raise DataError(f"{spec}: a HotpotQA file has no splits; pass the path alone")
        return hotpotqa_corpus(path, limit)
    if not (isinstance(data, dict) and isinstance(data.get("corpus"), list) and isinstance(data.get("queries"), dict)):
        raise DataError(f"{spec}: neither a HotpotQA list nor a BEIR-layout object with 'corpus' and 'queries'")
    split = split or "test"
    if split not in data["queries"]:
        raise DataError(f"{spec}: no split {split!r}; the file holds {', '.join(sorted(data['queries']))}")
    titles = [str(d["id"]) for d in data["corpus"]]
    texts = [f"{d.get('title') or ''}\n{d['text']}".strip() for d in data["corpus"]]
    name = path.name.split(".")[0]
    questions = [{"_id": str(q["id"]), "question": q["text"], "answer": "", "type": name,
                  "supporting_facts": [[str(r), 0] for r in q["relevant"]]} for q in data["queries"][split]]
    return titles, texts, questions[:limit]
