"""`endo demo`: the main job end to end on the embedded model and a task the demo writes itself (no network).

It writes a small corpus of company profiles and biographies in filler text, hides a two-hop fact chain in it
(company -> founder, founder -> birthplace), indexes it once, shows the evidence S3-Hybrid, BM25 and S3-Pure
select for the multi-hop question in two rounds (the first round's evidence joins the question of the second; the
gold sentences highlighted on a terminal), then the passages the default `endo` pipeline ranks first (BM25
candidates, read by the model, ranked by its retrieval heads) and those `endo-2hop` adds (asking the index again
with the bridge words the heads found in the first hop's best passages), and lets the local model answer from each.
"""
from __future__ import annotations

import random
import sys
import time

from endo_retrieval.cli.commands import engine
from endo_retrieval.core import join_spans

FIRST = ["Oriel", "Tamsin", "Bryn", "Ilse", "Corwin", "Maren", "Eskil", "Liora", "Davin", "Nerys", "Anselm", "Petra"]
LAST = ["Vantresse", "Holloway", "Ashcombe", "Kestrel", "Marlow", "Quill", "Thornbury", "Wrenfield", "Calder",
        "Penhallow", "Strand", "Oakes"]
TOWNS = ["Kelmscott Bay", "Farrow Cross", "Linden Vale", "Saltmarsh", "Greywater", "Hollin Ford", "Brightmoor",
         "Cinder Hill", "Ravensholt", "Mistle End", "Tarn Abbey", "Whitcombe"]
GOODS = ["lamps", "bicycles", "pianos", "umbrellas", "telescopes", "clocks", "kettles", "sailcloth", "paper",
         "spectacles", "harnesses", "inks"]
BRANDS = ["Tallow & Wick", "Spoke and Chain", "Ivory Row", "Canopy Works", "Farsight", "Escapement", "Copper Spout",
          "North Canvas", "Ragleaf", "Clearglass", "Bridle Line", "Oakgall"]
FILLER = [
    "The weather that spring was mild, and the roads were dry for most of the season.",
    "Local newspapers printed long columns about the harvest and the price of coal.",
    "Visitors often remarked on the narrow streets and the smell of the sea.",
    "The town council met every second Tuesday in a room above the library.",
    "Trains ran twice a day to the capital, and more often in summer.",
    "Many families kept small gardens with beans, onions and a few apple trees.",
    "A travelling circus came through in August and stayed for a week.",
    "The old bridge was repaired with stone taken from a ruined mill.",
    "Schoolchildren learned arithmetic, penmanship and a little geography.",
    "In the evenings people gathered at the inn to hear the latest news.",
    "The river froze in the hard winter, and skaters crowded onto the ice.",
    "Merchants complained about taxes, and the taxes rose all the same.",
]
QUESTION = "In which town was the founder of Tallow & Wick born?"
ANSWER = "Kelmscott Bay"


def build_task(seed: int = 7):
    """(documents, gold sentences): a profile and a biography per person, filler around every fact."""
    Document = engine().Document
    rng = random.Random(seed)
    people = [f"{f} {l}" for f, l in zip(FIRST, LAST)]
    towns, goods = TOWNS[:], GOODS[:]
    docs, gold = [], []

    def filler(n):
        return " ".join(rng.choice(FILLER) for _ in range(n))

    for i, person in enumerate(people):
        brand, town, good = BRANDS[i], towns[i], goods[i]
        founded = f"{brand} was founded in {1890 + 7 * i} by {person}, who ran it for many years."
        born = f"{person} was born in {town}, the youngest of four children."
        docs.append(Document(f"company-{i:02d}", f"{brand} makes {good}. {filler(3)} {founded} {filler(5)} "
                             f"Its workshop became known for careful {good}. {filler(3)}", {"kind": "company"}))
        docs.append(Document(f"person-{i:02d}", f"{filler(4)} {born} {filler(4)} Later {person.split()[0]} "
                             f"travelled widely before settling down. {filler(3)}", {"kind": "biography"}))
        if i == 0:
            gold += [founded, born]
    rng.shuffle(docs)
    return docs, gold


def two_hop(index, question: str, budget: int, method: str):
    """Two rounds of retrieval, half the budget each: the first round's evidence joins the question of the second,
    so the second hop (the founder's birthplace) can be found by the name the first hop revealed."""
    first = index.select(question, budget // 2, method)
    follow_up = f"{question} {join_spans(first, method, budget).text}"
    seen = {(s.start, s.end) for s in first}
    second = [s for s in index.select(follow_up, budget - budget // 2, method) if (s.start, s.end) not in seen]
    covered = {t for s in first for t in range(s.start, s.end)}
    return sorted(first + [s for s in second if not covered & set(range(s.start, s.end))], key=lambda s: s.start)


def add_arguments(parser) -> None:
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--budget", type=int, default=256, help="evidence tokens per method (default 256)")


def _show(text: str, gold: list[str], color: bool) -> str:
    text = " ".join(text.split())
    for g in gold + [ANSWER]:
        if color:
            text = text.replace(g, f"\033[1;32m{g}\033[0m")
    return text


def run(args) -> int:
    heavy = engine()
    color = sys.stdout.isatty()
    bb = heavy.Backbone.default(device=args.device)
    docs, gold = build_task()
    print(f"endo demo: {bb.model_id} ({bb.n_layers} layers) on {bb.device.type}")
    t = time.perf_counter()
    idx = heavy.EndoIndex(bb, "s3-hybrid")  # also serves the S3 methods the demo compares
    idx.add_documents(docs, progress=sys.stderr.isatty())
    print(f"indexed {len(docs)} documents, {idx.corpus.n_tokens} tokens, {idx.index.n_postings} postings "
          f"at SAE layers {idx.saes.layers} in {time.perf_counter() - t:.1f}s\n")
    print(f"Q: {QUESTION}   (two hops: company -> founder -> birthplace; gold answer: {ANSWER})\n")
    evidence = {}
    for method in ("s3-hybrid", "bm25", "s3"):
        t = time.perf_counter()
        spans = two_hop(idx, QUESTION, args.budget, method)
        text = join_spans(spans, method, args.budget).text
        evidence[method] = text
        found = sum(g in text for g in gold)
        print(f"--- {method}: {found}/{len(gold)} gold sentences, answer {'found' if ANSWER in text else 'missing'}"
              f" ({time.perf_counter() - t:.2f}s)")
        for s in sorted(spans, key=lambda s: s.start):
            print(f"  [{s.doc_id} {'+'.join(s.signals)}] {_show(s.text, gold, color)}")
        print()
    for method, label in (("endo", "endo (the default)"), ("endo-2hop", "endo-2hop (a second hop that retrieves)")):
        t = time.perf_counter()  # BM25 candidates, the model reads them, its heads rank them (then a second hop)
        spans = idx.search(QUESTION, k=4, method=method)
        evidence[method] = "\n".join(s.text for s in spans)
        print(f"--- {label}: {sum(g in evidence[method] for g in gold)}/{len(gold)} gold sentences in the top "
              f"{len(spans)} passages, answer {'found' if ANSWER in evidence[method] else 'missing'} "
              f"({time.perf_counter() - t:.2f}s)")
        for s in spans:
            stages = ", ".join(f"{k} {v:.2f}" for k, v in s.stage_scores.items() if k not in ("hop", "bridge"))
            if "hop" in s.stage_scores:
                bridge = s.stage_scores.get("bridge")
                stages += f", hop {s.stage_scores['hop']}" + (f" through {bridge!r}" if bridge else "")
            text = " ".join(s.text.split())
            print(f"  [{s.doc_id} {stages}] {_show(text if len(text) < 240 else text[:240] + ' ...', gold, color)}")
        print()
    for method in ("endo", "endo-2hop", "s3-hybrid", "bm25"):
        prompt = (f"Use the notes to answer.\nNotes:\n{evidence[method]}\n\nQuestion: {QUESTION}\n"
                  "Answer with the town name only.")
        answer = bb.generate(prompt, max_new_tokens=16)
        verdict = "correct" if ANSWER.lower() in answer.lower() else "not the gold answer"
        print(f"local model's answer from the {method} evidence: {answer!r} ({verdict})")
    return 0
