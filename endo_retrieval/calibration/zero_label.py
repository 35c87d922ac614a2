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

A two-hop task (`two_hop_tasks`) joins two chunks that share a rare bridge (a name or number found in at most
`BRIDGE_CHUNKS` chunks): its question takes a few content words of A's sentence holding the bridge and fewer of B's,
never the bridge itself, and both chunks (both sentences) are its gold. This is the shape of a bridge question, whose
second passage is reached through an entity the question does not name; single-hop tasks alone can never give the
second hop (`hop2`) weight. `mixed` puts them among the others at `TWO_HOP_SHARE`.

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

import numpy as np

from endo_retrieval.index import passages
from endo_retrieval.index.text_files import read_text_file, text_files
from endo_retrieval.scoring.bm25 import OkapiPostings, stems, words
from endo_retrieval.calibration.datasets import Example, PARAGRAPH_SEPARATOR, make_passkey, passkey_needle
from endo_retrieval.calibration.heads import hard_haystacks
# one question from one sentence, in each form (made_questions); inflect is public here too, where callers import it
from endo_retrieval.calibration.made_questions import (  # noqa: F401
    SENTENCE_BREAK, TOKEN, WRITE_ONE, WRITE_TWO, cloze_question, content_words, inflect, keyword_question, sentences,
    two_hop_question, written_question)
# the fit on these tasks' haystacks (zero_label_fit), public here too, where callers import it
from endo_retrieval.calibration.zero_label_fit import (cheapest_setting, fit_fusion, flattest,  # noqa: F401
                                                      most_heads, near_best)

TASK_FORMS = ("keywords", "cloze")
TWO_HOP = "two-hop"
# real multi-hop sets are mostly bridge and comparison questions over two passages; a third of the made tasks two-hop
# gives the second hop enough tasks to earn weight without making the single-hop signals' tasks scarce
TWO_HOP_SHARE = 1 / 3
# a bridge is in at most this many chunks: more and it names a topic, not a link between two passages, and the
# other chunks holding it would be as good a second passage as the gold
BRIDGE_CHUNKS = 3
_PARAGRAPHS = re.compile(r"\n\s*\n")


@dataclass
class Chunk:
    """One candidate passage: whole paragraphs of one document, whitespace runs folded to one space."""

    id: str
    doc: str
    text: str


@dataclass
class Task:
    """A question with its evidence sentence (verbatim in `chunk`'s text) and, for a cloze, its answer; a two-hop
    task also has its second chunk and sentence, and the bridge that links them."""

    id: str
    question: str
    evidence: str
    chunk: int
    form: str
    answer: str = ""
    chunk2: int = -1
    evidence2: str = ""
    bridge: str = ""

    @property
    def golds(self) -> list[int]:
        return [self.chunk] + ([self.chunk2] if self.chunk2 >= 0 else [])

    @property
    def evidences(self) -> list[str]:
        return [self.evidence] + ([self.evidence2] if self.chunk2 >= 0 else [])


def read_documents(folder: str | Path) -> list[tuple[str, str]]:
    """(name, text) of every text file under `folder` (or the one file), as `endo index` reads them."""
    root = Path(folder)
    return [(str(f.relative_to(root)) if root.is_dir() else f.name, read_text_file(f).text)
            for f in text_files([str(folder)])]


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
                pieces += [s for s in SENTENCE_BREAK.split(paragraph) if s.strip()]
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


def _bridge_candidates(text: str) -> set[str]:
    """Names (a capitalised word, not a stop word, not opening its sentence) and numbers of three digits or more
    in `text`: words specific enough to link two passages."""
    out = set()
    for sentence in sentences(text):
        for k, t in enumerate(TOKEN.findall(sentence)):
            if t[0].isdigit():
                if len(t.replace(",", "").replace(".", "")) >= 3:
                    out.add(t)
            elif k > 0 and t[0].isupper() and len(t) >= 3 and t.lower() in set(words(t)):
                out.add(t)
    return out


def bridges(chunks: list[Chunk]) -> dict[str, list[int]]:
    """bridge -> the chunks holding it (2 to BRIDGE_CHUNKS of them), for every name or number rare enough to link
    passages. A chunk counts when the word is anywhere in it (a name opening a sentence too), so rarity is not
    overstated; a capitalised word also written in lower case somewhere ("Visual", "Units" of a title) is a common
    word, not a name."""
    candidates = set().union(*(_bridge_candidates(c.text) for c in chunks)) if chunks else set()
    lower = {t for c in chunks for t in TOKEN.findall(c.text) if t.islower()}
    candidates = {b for b in candidates if b.lower() not in lower}
    where: dict[str, list[int]] = {}
    for i, c in enumerate(chunks):
        for t in set(TOKEN.findall(c.text)) & candidates:
            where.setdefault(t, []).append(i)
    return {b: ids for b, ids in sorted(where.items()) if 2 <= len(ids) <= BRIDGE_CHUNKS}


def _holding(text: str, bridge: str) -> list[str]:
    at = re.compile(r"(?<![\w])" + re.escape(bridge) + r"(?![\w])")
    return [s for s in sentences(text) if at.search(s)]


def two_hop_tasks(chunks: list[Chunk], n: int, seed: int = 0, min_words: int = 5, max_words: int = 60
                  ) -> list[Task]:
    """Up to `n` two-hop tasks, one per bridge (in an order drawn from `seed`): two chunks holding it, a sentence
    holding it in each, the question made of both (two_hop_question)."""
    rng = random.Random(f"two-hop/{seed}")
    linked = bridges(chunks)
    order = list(linked)
    rng.shuffle(order)
    tasks: list[Task] = []
    for bridge in order:
        if len(tasks) >= n:
            break
        a, b = rng.sample(linked[bridge], 2)
        first = [s for s in _holding(chunks[a].text, bridge) if min_words <= len(s.split()) <= max_words]
        second = [s for s in _holding(chunks[b].text, bridge) if min_words <= len(s.split()) <= max_words]
        if not first or not second:
            continue
        s1, s2 = rng.choice(first), rng.choice(second)
        question = two_hop_question(s1, s2, bridge, rng)
        if question and not any(t.question == question for t in tasks):
            tasks.append(Task(f"zl2-{len(tasks)}", question, s1, a, TWO_HOP, chunk2=b, evidence2=s2, bridge=bridge))
    return tasks


# ---------------------------------------------------------------- questions the model writes itself

# the form of a task whose question the model wrote from its evidence (made_questions.WRITE_ONE, WRITE_TWO)
WRITTEN = "written"


def _terms(text: str) -> set[str]:
    return set(stems(words(text)))


def written_tasks(tasks: list[Task], write, progress=None, batch: int = 64) -> list[Task]:
    """`tasks` with the questions the model wrote from their evidence instead of the made ones (`write`: prompts
    -> replies, Backbone.chat.generate_many; `progress`: a tqdm bar, advanced per task). A task is dropped when the
    reply holds no question (written_question), when the question is the evidence itself, when it names a
    two-hop task's bridge, or when it shares no content word with each evidence sentence (a question about
    nothing, such as "What is the answer to this question?")."""
    prompts = [WRITE_TWO.format(bridge=t.bridge, evidence=t.evidence, evidence2=t.evidence2) if t.chunk2 >= 0
               else WRITE_ONE.format(evidence=t.evidence) for t in tasks]
    replies = []
    for at in range(0, len(prompts), batch):
        replies += write(prompts[at: at + batch])
        if progress is not None:
            progress.update(len(prompts[at: at + batch]))
    out = []
    for t, reply in zip(tasks, replies):
        question = written_question(reply)
        if question is None or question.rstrip("?").lower() in t.evidence.lower() \
                or (t.bridge and t.bridge.lower() in question.lower()):
            continue
        if not all(_terms(question) & _terms(e) - _terms(t.bridge) for e in t.evidences):
            continue
        form = f"{WRITTEN} {TWO_HOP}" if t.chunk2 >= 0 else WRITTEN
        out.append(Task(t.id, question, t.evidence, t.chunk, form, "", t.chunk2, t.evidence2, t.bridge))
    return out


def _zip_longest(lists: list[list[int]]):
    for k in range(max((len(x) for x in lists), default=0)):
        yield [x[k] for x in lists if k < len(x)]


def passkey_tasks(chunks: list[Chunk], n: int, context_tokens: int, count_tokens, seed: int = 0):
    """`n` passkey haystacks of `context_tokens` tokens in the user's text (eval.data's maker), the needle gold."""
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
    own = [Example(t.id, t.question, [t.answer] if t.answer else [],
                   PARAGRAPH_SEPARATOR.join(chunks[g].text for g in t.golds), t.evidences, {"form": t.form})
           for t in tasks]
    return list(hard_haystacks(own, [c.text for c in chunks], count_tokens, context_tokens, seed, n_hard))


def corpus_questions(tasks: list[Task], chunks: list[Chunk]) -> tuple[list[str], list[str], list[dict]]:
    """(titles, texts, questions) in the shape of eval.rerank.hotpotqa_corpus: every chunk one document, each
    task's chunks its gold."""
    return ([c.id for c in chunks], [c.text for c in chunks],
            [{"_id": t.id, "question": t.question, "supporting_facts": [[chunks[g].id, 0] for g in t.golds]}
             for t in tasks])


def bm25_ranks(tasks: list[Task], chunks: list[Chunk]) -> list[int]:
    """Per task, how many other chunks BM25 scores above its weakest gold chunk (0: BM25 ranks its gold first).
    BM25 as the pipeline's stage 1 has it (over stems unless `passages.STEMS` is off): judged over words, a task
    made hard by inflecting its words was easy for the stemmed stage 1, and the tasks' stage-1 recall@2 / @5 / @10
    on fit300's paragraphs was 80.7 / 91.2 / 94.3, against 57.8 / 77.4 / 90.0 for its real questions."""
    bm25 = OkapiPostings.build([words(c.text) for c in chunks], passages.STEMS)
    out = []
    for t in tasks:
        scores = bm25.get_scores(words(t.question))
        others = np.delete(scores, t.golds)
        out.append(int(np.sum(others > scores[t.golds].min())))
    return out


# of fit300's real questions whose weakest gold BM25 finds in its first 20 (its 2,960 paragraphs pooled), the
# share it does not rank first: 0.71. Made tasks balanced so have a stage-1 recall@2 / @5 / @10 of 58.0 / 79.5 /
# 90.0 on the same paragraphs, against the real questions' 57.8 / 77.4 / 90.0 (at a share of 0.5: 72.2 / 87.8 /
# 94.2; `tools/stage1_recall.py --made`)
HARD_SHARE = 0.7


def balanced(tasks: list[Task], chunks: list[Chunk], n: int, hard_share: float = HARD_SHARE, depth: int = 20
             ) -> list[Task]:
    """`n` of the tasks, `hard_share` of them ones BM25 does not rank first but within `depth` (the pipeline's
    candidates), the rest ones it ranks first; tasks BM25 cannot find in `depth` are dropped (no stage after it
    could recover them). Made tasks alone are easy for BM25 (their words come from the evidence), and weights
    fitted on easy tasks give BM25 everything (`HARD_SHARE`: as hard as real questions)."""
    ranks = bm25_ranks(tasks, chunks)
    hard = [t for t, r in zip(tasks, ranks) if 0 < r < depth]
    easy = [t for t, r in zip(tasks, ranks) if r == 0]
    n_hard = min(len(hard), round(hard_share * n))
    picked = hard[:n_hard] + easy[: n - n_hard]
    picked += hard[n_hard: n_hard + n - len(picked)]  # too few easy ones: more hard ones
    order = {id(t): i for i, t in enumerate(tasks)}
    return sorted(picked, key=lambda t: order[id(t)])


def mixed(single: list[Task], two_hop: list[Task], chunks: list[Chunk], n: int, share: float = TWO_HOP_SHARE,
          depth: int = 20, hard_share: float = HARD_SHARE) -> list[Task]:
    """`n` tasks, `share` of them two-hop (fewer when fewer were made; single-hop ones fill in), each kind balanced
    on its own (`balanced`, `hard_share` of each hard), spread evenly through the list so every leading part of it
    (the heads' tasks, then the pipeline's) holds about the same share."""
    two = balanced(two_hop, chunks, min(len(two_hop), round(share * n)), hard_share, depth) if two_hop else []
    one = balanced(single, chunks, n - len(two), hard_share, depth)
    placed = [((i + 0.5) / len(one), 0, t) for i, t in enumerate(one)]
    placed += [((i + 0.5) / len(two), 1, t) for i, t in enumerate(two)]
    return [t for *_, t in sorted(placed, key=lambda x: x[:2])]


def forms(tasks: list[Task]) -> dict[str, int]:
    """How many tasks of each form, for the profile's record."""
    out: dict[str, int] = {}
    for t in tasks:
        out[t.form] = out.get(t.form, 0) + 1
    return dict(sorted(out.items()))
