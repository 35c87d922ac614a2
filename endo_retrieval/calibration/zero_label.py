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
from endo_retrieval.methods.endo import GRID_STEP, SIGNALS, recall_in_budget, simplex
from endo_retrieval.methods.heads import HeadsError
from endo_retrieval.scoring.fusion import standardise

TASK_FORMS = ("keywords", "cloze")
TWO_HOP = "two-hop"
# real multi-hop sets are mostly bridge and comparison questions over two passages; a third of the made tasks two-hop
# gives the second hop enough tasks to earn weight without making the single-hop signals' tasks scarce
TWO_HOP_SHARE = 1 / 3
# a bridge is in at most this many chunks: more and it names a topic, not a link between two passages, and the
# other chunks holding it would be as good a second passage as the gold
BRIDGE_CHUNKS = 3
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


def _bridge_candidates(text: str) -> set[str]:
    """Names (a capitalised word, not a stop word, not opening its sentence) and numbers of three digits or more
    in `text`: words specific enough to link two passages."""
    out = set()
    for sentence in sentences(text):
        for k, t in enumerate(_TOKEN.findall(sentence)):
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
    lower = {t for c in chunks for t in _TOKEN.findall(c.text) if t.islower()}
    candidates = {b for b in candidates if b.lower() not in lower}
    where: dict[str, list[int]] = {}
    for i, c in enumerate(chunks):
        for t in set(_TOKEN.findall(c.text)) & candidates:
            where.setdefault(t, []).append(i)
    return {b: ids for b, ids in sorted(where.items()) if 2 <= len(ids) <= BRIDGE_CHUNKS}


def _holding(text: str, bridge: str) -> list[str]:
    at = re.compile(r"(?<![\w])" + re.escape(bridge) + r"(?![\w])")
    return [s for s in sentences(text) if at.search(s)]


def two_hop_question(first: str, second: str, bridge: str, rng: random.Random) -> str | None:
    """A few content words of `first` (2 to 4) and fewer of `second` (1 or 2), none holding the bridge, half of
    them inflected: the second passage is named less, as a bridge question names it through the bridge."""
    def usable(sentence: str) -> list[str]:
        return [w for w in content_words(sentence) if bridge.lower() not in w.lower()]

    a, b = usable(first), [w for w in usable(second) if w.lower() not in {x.lower() for x in usable(first)}]
    if len(a) < 2 or not b:
        return None
    kept_a = rng.sample(a, rng.randint(2, min(len(a), 4)))
    kept_b = rng.sample(b, rng.randint(1, min(len(b), 2)))
    for kept in (kept_a, kept_b):
        for i in rng.sample(range(len(kept)), len(kept) // 2):
            kept[i] = inflect(kept[i])
    return "Which passages tell about " + ", ".join(kept_a) + " and what links it to " + " and ".join(kept_b) + "?"


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

# A made question is a bag of the evidence's words (inflected or not); a reader's question is a sentence that names
# what it asks in its own words, and the model's retrieval heads read the two differently. `--questions-by model`
# asks the model to write each task's question from its evidence (two-hop: from both sentences, never naming the
# bridge), so the tasks are in the form the heads meet at query time.
WRITE_ONE = ("Here is a sentence from a document:\n\n{evidence}\n\nWrite one short question that this sentence "
             "answers, as someone who has not read it would ask: in your own words, not the sentence's. Reply with "
             "the question only.")
WRITE_TWO = ("Here are two sentences from two documents, linked by \"{bridge}\":\n\n1. {evidence}\n2. {evidence2}"
             "\n\nWrite one short question that needs both sentences to answer, in your own words, without saying "
             "\"{bridge}\". Reply with the question only.")
WRITTEN = "written"
# a question that points at its prompt ("...mentioned in the sentence?") asks nothing a reader would
_ABOUT_PROMPT = re.compile(r"\b(?:sentences?|passages?|paragraphs?|documents?)\b", re.I)


def written_question(reply: str) -> str | None:
    """The question in a model's reply: its first line, a leading "Question:" dropped, up to its first "?";
    None unless that is 3 to 40 words and does not point at the prompt (the sentence, the passage)."""
    line = next((x.strip() for x in reply.splitlines() if x.strip()), "")
    line = re.sub(r"^(?:\*\*)?(?:question|q)\s*\d*\s*[:.](?:\*\*)?\s*", "", line, flags=re.I).strip().strip('"*')
    if "?" not in line:
        return None
    line = line[: line.index("?") + 1]
    return line if 3 <= len(line.split()) <= 40 and not _ABOUT_PROMPT.search(line) else None


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
    import numpy as np


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


# ---------------------------------------------------------------- the whole-context fusion on made haystacks

# Made haystacks are easy: every signal finds the one evidence sentence within an eighth of the context, so at that
# budget every weight ties and a tie-break decides. The fit halves the budget while the best single signal still
# keeps more than SATURATED of the gold: below it, at least a tenth of the evidence is missed by the best signal,
# which is where the signals can differ.
SATURATED = 0.9
# never below this budget: a made evidence sentence is at most 60 words (about 80 tokens), so it always fits
MIN_BUDGET = 128
# weights whose recall is within this many standard errors of the best (paired over the items) are as good as it
NEAR = 1.0


def _flatness(w: dict) -> float:
    return sum(v * v for v in w.values())  # least for equal weights, most for one signal alone


def near_best(table: np.ndarray) -> list[int]:
    """The options (rows of `table`, options x items, higher is better) as good as the best: its row first, then
    every row whose mean is within NEAR standard errors of its mean (paired per-item differences), in row order.
    Fitted on made tasks, the best row is partly the draw's luck; any near row is as likely the method's best."""
    means = table.mean(1)
    best = int(np.argmax(means))
    diff = table[best] - table  # per item, how much each option loses to the best
    n = table.shape[1]
    se = diff.std(1, ddof=1) / np.sqrt(n) if n > 1 else np.zeros(len(table))
    return [best] + [i for i in range(len(table)) if i != best and diff[i].mean() <= NEAR * se[i] + 1e-12]


def flattest(grid: list[dict], table: np.ndarray) -> int:
    """Of the weights `grid` scored per item in `table` (weights x items), the flattest near the best: when the
    signals cannot be told apart the fusion hedges over them instead of falling to whichever corner a tie-break
    lists first; when one mixture is clearly best, only it and its close neighbours are near."""
    return min(near_best(table), key=lambda i: (_flatness(grid[i]), i))


def most_heads(counts: list[int], table: np.ndarray) -> int:
    """Of the head counts scored per item in `table` (counts x items), the most heads near the best: two
    zero-label runs on the same documents kept 4 and 12 heads of the 1.5B model (recall 0.978 against 0.975), and
    more heads average out what one draw of tasks favours."""
    return max(counts[i] for i in near_best(table))


def cheapest_setting(rows: list[dict], table: np.ndarray) -> int:
    """Of the pipeline's settings (`rows` of pipeline.fit_settings, scored per task in `table`), the one that reads
    least (depth x tokens per candidate) near the best; the better mean among equals."""
    means = table.mean(1)
    return min(near_best(table), key=lambda i: (rows[i]["depth"] * rows[i]["read_tokens"], -means[i]))


def fit_fusion(items: list[tuple[dict, np.ndarray, np.ndarray, int]], names: tuple[str, ...] | None = None,
               step: float | None = None) -> dict:
    """The whole-context fusion's weights on zero-label haystacks, `items` = [(signals, gold, lengths, budget)]
    as heads_calibrate.calibrate makes them:

    1. balanced: as many items on which BM25 does not rank the gold sentences first as items on which it does
       (the surplus of the larger kind dropped, in item order), as `balanced` does for the pipeline's tasks;
    2. budget: every item's budget halved, all together, while the best single signal's mean recall is above
       SATURATED and every budget stays at or above MIN_BUDGET;
    3. weights: on the simplex grid, the best mean recall; among the weights within NEAR standard errors of it
       (paired per-item differences), the flattest. When the signals cannot be told apart the fusion hedges over
       them instead of falling to whichever corner a tie-break lists first; when one mixture is clearly best, only
       it and its close neighbours are near, so the fit still picks it.
    """
    step = step or GRID_STEP
    items = [it for it in items if it[1].any()]
    if not items:
        raise HeadsError("No calibration item has a gold sentence in its haystack: check the documents.")
    names = [s for s in (names or SIGNALS) if all(s in it[0] for it in items)]
    z = [{s: standardise(sig[s]) for s in names} for sig, *_ in items]

    if "bm25" in names:
        first = [bool(g[np.argsort(-zi["bm25"], kind="stable")[: int(g.sum())]].all())
                 for zi, (_, g, *_) in zip(z, items)]
        hard = [i for i, f in enumerate(first) if not f]
        easy = [i for i, f in enumerate(first) if f]
        k = min(len(hard), len(easy))
        keep = sorted(hard[:k] + easy[:k]) if k else list(range(len(items)))
        items, z = [items[i] for i in keep], [z[i] for i in keep]

    def recalls(w: dict, scale: int) -> np.ndarray:
        return np.array([recall_in_budget(sum(w[s] * zi[s] for s in names), gold, lengths, budget // scale)
                         for zi, (_, gold, lengths, budget) in zip(z, items)])

    corners = {s: {t: float(t == s) for t in names} for s in names}
    scale = 1
    while True:
        single = {s: float(recalls(w, scale).mean()) for s, w in corners.items()}
        if max(single.values()) <= SATURATED or min(b for *_, b in items) // (2 * scale) < MIN_BUDGET:
            break
        scale *= 2

    grid = list(simplex(names, step))
    table = np.stack([recalls(w, scale) for w in grid])  # weights x items
    means = table.mean(1)
    near = near_best(table)
    best, chosen = near[0], flattest(grid, table)
    return {"weights": grid[chosen], "recall": round(float(means[chosen]), 4),
            "best": {"weights": grid[best], "recall": round(float(means[best]), 4)},
            "single": {s: round(r, 4) for s, r in single.items()}, "step": step, "n_items": len(items),
            "budget_scale": 1 / scale, "near_best": len(near),
            "rule": "zero-label: balanced items, budget halved past saturation, flattest near-best weights"}
