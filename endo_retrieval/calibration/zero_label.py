"""Zero-label calibration tasks: questions the library makes from any text, with the evidence known by
construction, so a model's retrieval heads and fusion weights can be fitted on the user's own documents.

The documents are cut into chunks of whole paragraphs (at most `chunk_tokens` tokens; one chunk is one candidate of
the corpus pipeline, as a HotpotQA paragraph is). A task takes one sentence of a chunk as the evidence and asks a
question made from it, in one of two forms:

- `keywords`: a few of the sentence's content words, shuffled; a third of them replaced by another inflection
  (plural and singular, -ed and -ing stripped or added), which BM25's exact words miss and the model still reads as
  the same word; plus a word of the chunk's first sentence, which names what the chunk is about (as a multi-hop
  question names the bridge entity rather than the evidence's own words);
- `cloze`: the sentence as a question, its key span (a number, a name inside the sentence, else its longest
  content word) replaced by "what", a third of its other content words dropped and a third inflected; the span is
  the answer.

Made questions are easier for BM25 than real ones (their words come from the evidence), and weights fitted on easy
tasks give BM25 everything; `balanced` keeps as many tasks BM25 ranks below first (within the pipeline's
candidates) as tasks it ranks first.

The distractors are the chunk's other sentences, the chunks BM25 ranks highest for the question (the same
document's other chunks among them) and random chunks, up to the haystack lengths the calibration reads; for the
corpus pipeline, every chunk is a candidate. Passkeys hidden in the user's text (ILRe's task) are added to the
heads' haystacks. Nothing here reads labelled data.
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from pathlib import Path

from endo_retrieval.scoring.bm25 import words

TASK_FORMS = ("keywords", "cloze")
_PARAGRAPHS = re.compile(r"\n\s*\n")
# a sentence ends at . ! ? (closing quotes or a [7] note after it) before a capital or digit, spaced or glued
_SENTENCE = re.compile(r"(?<=[.!?])[\"'\u201d\u2019)]*(?:\[\d+\])?\s+(?=[\"'\u201c\u2018(]?[A-Z0-9])"
                       r"|(?<=[a-z][.!?])(?:\[\d+\])?(?=[A-Z][a-z])")
# words that carry no topic, beyond BM25's stop words: a question made of them would match anything
_WEAK = set("""can could would should might must may will shall not any one two also such many much more most
very just even still well really thing things way ways lot lots like make made get got let say said says see
seem seems know knew want good bad new old first last other others another every each some something about
since though although indeed without anything everything nothing along while whether yet already""".split())
_TOKEN = re.compile(r"[A-Za-z][A-Za-z'-]*[A-Za-z]|\d[\d,.]*\d|\d")


@dataclass
class Chunk:
    """One candidate passage: whole paragraphs of one document, whitespace runs folded to one space."""

    id: str
    doc: str
    text: str


@dataclass
class Task:
    """A question with its evidence sentence (verbatim in `chunk`'s text) and, for a cloze, its answer."""

    id: str
    question: str
    evidence: str
    chunk: int
    form: str
    answer: str = ""


def read_documents(folder: str | Path) -> list[tuple[str, str]]:
    """(name, text) of every text file under `folder` (or the one file), as `endo index` reads them."""
    from endo_retrieval.cli.commands import _files, _read

    root = Path(folder)
    return [(str(f.relative_to(root)) if root.is_dir() else f.name, _read(f)) for f in _files([str(folder)])]


def fingerprint(documents: list[tuple[str, str]]) -> str:
    """A hash of the documents' names and texts: tasks made from other documents are never reused."""
    h = hashlib.sha256()
    for name, text in documents:
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:16]


def chunk_documents(documents: list[tuple[str, str]], count_tokens, chunk_tokens: int = 200) -> list[Chunk]:
    """Each document's paragraphs joined into chunks of at most `chunk_tokens` tokens (a longer paragraph is cut
    between sentences, a longer sentence kept whole)."""
    out = []
    for name, text in documents:
        pieces = []
        for paragraph in _PARAGRAPHS.split(text):
            paragraph = " ".join(paragraph.split())
            if not paragraph:
                continue
            if count_tokens(paragraph) <= chunk_tokens:
                pieces.append(paragraph)
            else:
                pieces += [s for s in _SENTENCE.split(paragraph) if s.strip()]
        current, used = [], 0
        for piece in pieces:
            n = count_tokens(piece)
            if current and used + n > chunk_tokens:
                out.append(Chunk(f"{name}#{len(out)}", name, " ".join(current)))
                current, used = [], 0
            current.append(piece)
            used += n
        if current:
            out.append(Chunk(f"{name}#{len(out)}", name, " ".join(current)))
    return out


def sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE.split(text) if s.strip()]


def content_words(sentence: str) -> list[str]:
    """The sentence's words that BM25 keeps (stop words out), at least three letters or a number, first
    occurrence order, no repeats (case-insensitive)."""
    kept = set(words(sentence))
    out, seen = [], set()
    for w in _TOKEN.findall(sentence):
        low = w.lower()
        if low in kept and low not in _WEAK and low not in seen and (len(low) >= 3 or low.isdigit()):
            out.append(w)
            seen.add(low)
    return out


def inflect(word: str) -> str:
    """Another inflection of an English word (the same word to a reader, another term to BM25)."""
    low = word.lower()
    if low.isdigit() or len(low) < 4 or word[0].isupper() or low.endswith(("ly", "ss", "us")):
        return word
    for suffix, repl in (("ies", "y"), ("ing", ""), ("ed", ""), ("es", ""), ("s", "")):
        if low.endswith(suffix) and len(low) - len(suffix) >= 3:
            return word[: len(word) - len(suffix)] + repl
    return word + ("es" if low.endswith(("s", "x", "ch", "sh")) else "s")


def key_span(sentence: str, rng: random.Random) -> str | None:
    """What a cloze removes: a number, else a capitalised word inside the sentence, else the longest content word."""
    tokens = _TOKEN.findall(sentence)
    numbers = [t for t in tokens if t[0].isdigit()]
    if numbers:
        return rng.choice(numbers)
    names = [t for t in tokens[1:] if t[0].isupper() and t.lower() in set(words(t))]
    if names:
        return rng.choice(names)
    content = content_words(sentence)
    return max(content, key=len) if content else None


def keyword_question(sentence: str, subject: list[str], rng: random.Random) -> str | None:
    content = content_words(sentence)
    if len(content) < 3:
        return None
    kept = rng.sample(content, rng.randint(2, min(len(content), 6)))  # few words: BM25 has less to match
    for i in rng.sample(range(len(kept)), (len(kept) + 1) // 2):
        kept[i] = inflect(kept[i])
    extra = [w for w in subject if w.lower() not in {k.lower() for k in content}]
    if extra and rng.random() < 0.5:
        kept.append(rng.choice(extra))
    rng.shuffle(kept)
    return "Which passage tells about " + ", ".join(kept[:-1]) + " and " + kept[-1] + "?"


def cloze_question(sentence: str, rng: random.Random) -> tuple[str, str] | None:
    span = key_span(sentence, rng)
    if span is None:
        return None
    at = re.search(r"(?<![\w])" + re.escape(span) + r"(?![\w])", sentence)
    if at is None:
        return None
    rest = [w for w in content_words(sentence) if w != span]
    changed = dict.fromkeys(rng.sample(rest, len(rest) // 3), "")  # a third of the other content words dropped,
    changed |= {w: inflect(w) for w in rng.sample(rest, len(rest) // 3) if w not in changed}  # a third inflected
    text = sentence[: at.start()] + "\0" + sentence[at.end():]
    for w, new in changed.items():
        text = re.sub(r"(?<![\w])" + re.escape(w) + r"(?![\w])", new, text, count=1)
    question = " ".join(text.replace("\0", "what").split()).strip().rstrip(".!?\"'") + "?"
    return question[0].upper() + question[1:], span


def make_tasks(chunks: list[Chunk], n: int, seed: int = 0, forms: tuple[str, ...] = TASK_FORMS,
               min_words: int = 8, max_words: int = 60) -> list[Task]:
    """`n` tasks, each from another chunk where there are enough (spread over the documents), forms in turn."""
    rng = random.Random(seed)
    order = list(range(len(chunks)))
    rng.shuffle(order)
    by_doc: dict[str, list[int]] = {}
    for i in order:
        by_doc.setdefault(chunks[i].doc, []).append(i)
    # round-robin over the documents, so a few long files do not take every task
    queue = [i for batch in _zip_longest(list(by_doc.values())) for i in batch]
    tasks = []
    for i in queue * 3:  # a chunk may give a second task when there are fewer chunks than tasks
        if len(tasks) >= n:
            break
        candidates = [s for s in sentences(chunks[i].text) if min_words <= len(s.split()) <= max_words]
        if not candidates:
            continue
        sentence = rng.choice(candidates)
        form = forms[len(tasks) % len(forms)]
        subject = content_words(sentences(chunks[i].text)[0])
        if form == "keywords":
            question, answer = keyword_question(sentence, subject, rng), ""
        else:
            made = cloze_question(sentence, rng)
            question, answer = made if made else (None, "")
        if question and not any(t.question == question for t in tasks):
            tasks.append(Task(f"zl-{len(tasks)}", question, sentence, i, form, answer))
    return tasks


def _zip_longest(lists: list[list[int]]):
    for k in range(max((len(x) for x in lists), default=0)):
        yield [x[k] for x in lists if k < len(x)]


def passkey_tasks(chunks: list[Chunk], n: int, context_tokens: int, count_tokens, seed: int = 0):
    """`n` passkey haystacks of `context_tokens` tokens in the user's text (eval.data's maker), the needle gold."""
    import numpy as np

    from endo_retrieval.calibration.datasets import make_passkey, passkey_needle

    rng = random.Random(f"passkey/{seed}")
    start = rng.randrange(len(chunks))
    filler = " ".join(c.text for c in (chunks[start:] + chunks[:start])[: max(1, 4 * context_tokens // 100)])
    out = []
    for depth in (np.linspace(0.05, 0.95, n) if n > 1 else [0.5])[:n]:
        key = str(rng.randint(10000, 99999))
        e = make_passkey(filler, context_tokens, float(depth), key, count_tokens)
        e.supporting = [passkey_needle(key)]
        e.id = f"zl-{e.id}"
        out.append(e)
    return out


def haystacks(tasks: list[Task], chunks: list[Chunk], count_tokens, context_tokens: int, seed: int = 0,
              n_hard: int = 8):
    """The heads calibration's examples: each task's chunk, the chunks BM25 ranks highest for its question, then
    random chunks, up to `context_tokens`, shuffled (heads_calibrate.hard_haystacks)."""
    from endo_retrieval.calibration.datasets import Example
    from endo_retrieval.calibration.heads import hard_haystacks

    own = [Example(t.id, t.question, [t.answer] if t.answer else [], chunks[t.chunk].text, [t.evidence],
                   {"form": t.form}) for t in tasks]
    return list(hard_haystacks(own, [c.text for c in chunks], count_tokens, context_tokens, seed, n_hard))


def corpus_questions(tasks: list[Task], chunks: list[Chunk]) -> tuple[list[str], list[str], list[dict]]:
    """(titles, texts, questions) in the shape of eval.rerank.hotpotqa_corpus: every chunk one document, each
    task's chunk its gold."""
    return ([c.id for c in chunks], [c.text for c in chunks],
            [{"_id": t.id, "question": t.question, "supporting_facts": [[chunks[t.chunk].id, 0]]} for t in tasks])


def bm25_ranks(tasks: list[Task], chunks: list[Chunk]) -> list[int]:
    """Per task, how many chunks BM25 scores above its own chunk (0: BM25 finds it first)."""
    import numpy as np

    from endo_retrieval.scoring.bm25 import OkapiPostings

    bm25 = OkapiPostings.build([words(c.text) for c in chunks])
    out = []
    for t in tasks:
        scores = bm25.get_scores(words(t.question))
        out.append(int(np.sum(scores > scores[t.chunk])))
    return out


def balanced(tasks: list[Task], chunks: list[Chunk], n: int, hard_share: float = 0.5, depth: int = 20
             ) -> list[Task]:
    """`n` of the tasks, `hard_share` of them ones BM25 does not rank first but within `depth` (the pipeline's
    candidates), the rest ones it ranks first; tasks BM25 cannot find in `depth` are dropped (no stage after it
    could recover them). Made tasks alone are easy for BM25 (their words come from the evidence), and weights
    fitted on easy tasks give BM25 everything; real questions are about half of each kind."""
    ranks = bm25_ranks(tasks, chunks)
    hard = [t for t, r in zip(tasks, ranks) if 0 < r < depth]
    easy = [t for t, r in zip(tasks, ranks) if r == 0]
    n_hard = min(len(hard), round(hard_share * n))
    picked = hard[:n_hard] + easy[: n - n_hard]
    picked += hard[n_hard: n_hard + n - len(picked)]  # too few easy ones: more hard ones
    order = {id(t): i for i, t in enumerate(tasks)}
    return sorted(picked, key=lambda t: order[id(t)])
