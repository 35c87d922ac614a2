"""One question made from one evidence sentence (or two), in each form zero_label.py's tasks take: a few of its
content words (`keywords`), the sentence with its key span asked for (`cloze`), words of two sentences linked by a
bridge (`two-hop`), or the question in the reply of a model asked to write one (`written`). Some words are inflected,
so BM25's exact words miss them while the model still reads the same word.
"""
from __future__ import annotations

import random
import re

from endo_retrieval.scoring.bm25 import words

# a sentence ends at . ! ? (closing quotes or a [7] note after it) before a capital or digit, spaced or glued
SENTENCE_BREAK = re.compile(r"(?<=[.!?])[\"'\u201d\u2019)]*(?:\[\d+\])?\s+(?=[\"'\u201c\u2018(]?[A-Z0-9])"
                            r"|(?<=[a-z][.!?])(?:\[\d+\])?(?=[A-Z][a-z])")
# words that carry no topic, beyond BM25's stop words: a question made of them would match anything
_WEAK = set("""can could would should might must may will shall not any one two also such many much more most
very just even still well really thing things way ways lot lots like make made get got let say said says see
seem seems know knew want good bad new old first last other others another every each some something about
since though although indeed without anything everything nothing along while whether yet already""".split())
TOKEN = re.compile(r"[A-Za-z][A-Za-z'-]*[A-Za-z]|\d[\d,.]*\d|\d")


def sentences(text: str) -> list[str]:
    return [s.strip() for s in SENTENCE_BREAK.split(text) if s.strip()]


def content_words(sentence: str) -> list[str]:
    """The sentence's words that BM25 keeps (stop words out), at least three letters or a number, first
    occurrence order, no repeats (case-insensitive)."""
    kept = set(words(sentence))
    out, seen = [], set()
    for w in TOKEN.findall(sentence):
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
    tokens = TOKEN.findall(sentence)
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
