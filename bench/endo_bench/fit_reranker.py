"""`endo bench fit-reranker`: fit EndoReranker's fusion weights, one entry per kind of first stage, into the model's
heads profile (`endo_retrieval.calibration.reranker`).

The corpus and its nodes are those of `endo bench corpus`: every paragraph of a HotpotQA-layout file, pooled. For
each question, the first stage ('minilm' or 'bm25', built as that bench builds it) gives its top `--candidates`
paragraphs with their scores; a candidate is gold when its title is among the question's supporting-fact titles.
`fit_reranker_section` then weighs the first stage against the retrieval heads, and `save_reranker_entry` writes the
entry into the profile (default: the model's own heads profile, the shipped one for a model whose profile ships).
Prints the fitted entries as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_STAGES = "minilm,bm25"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from endo_retrieval.cli.commands import model_argument

    p.add_argument("--data", required=True, help="HotpotQA PATH.json to fit on (fit300.json; never the report set)")
    p.add_argument("--first-stages", default=DEFAULT_STAGES,
                   help=f"comma-separated first stages to fit an entry for (default {DEFAULT_STAGES})")
    p.add_argument("--candidates", type=int, default=20,
                   help="the first stage's top-k the reranker reads (default 20, as `endo bench corpus`)")
    p.add_argument("--step", type=float, default=0.1, help="grid step of the first stage's weight (default 0.1)")
    p.add_argument("--limit", type=int, default=None, help="the first N questions (the corpus is still every "
                   "paragraph of the file)")
    p.add_argument("--out", default=None, help="the heads profile to write into (default: the model's own)")
    model_argument(p)


def parse_stages(spec: str) -> list[str]:
    from endo_bench.corpus_bench import FIRST_STAGES

    names = list(dict.fromkeys(s.strip() for s in spec.split(",") if s.strip()))
    unknown = [s for s in names if s not in FIRST_STAGES]
    if unknown or not names:
        raise ValueError(f"--first-stages takes a comma-separated list of {', '.join(FIRST_STAGES)}, got {spec!r}.")
    return names


def fit_questions(first, items: list[dict], titles_of: dict[str, str]) -> list[dict]:
    """Each question with its first stage's candidates (their text as EndoReranker reads it), scores and gold
    flags, as `fit_reranker_section` takes them."""
    from llama_index.core.schema import MetadataMode
    from tqdm import tqdm

    from endo_bench.corpus_bench import gold_titles

    questions = []
    for item in tqdm(items, desc=f"{first.kind} candidates", unit="question", disable=None):
        found = first.retrieve(item["question"])
        gold = set(gold_titles(item))
        questions.append({"question": item["question"],
                          "candidates": [n.node.get_content(metadata_mode=MetadataMode.NONE) for n in found],
                          "first_stage_scores": [n.score for n in found],
                          "gold": [titles_of[n.node.node_id] in gold for n in found]})
    return questions


def run(args) -> int:
    from endo_bench import corpus_bench as cb
    from endo_retrieval.calibration.datasets import hotpotqa_corpus
    from endo_retrieval.calibration.reranker import fit_reranker_section, save_reranker_entry

    stages = parse_stages(args.first_stages)
    if args.candidates < 2:
        raise ValueError(f"--candidates must be at least 2 (a ranking to fit), got {args.candidates}")
    out = Path(args.out) if args.out else None
    if out is not None and not out.is_file():  # refused before the model loads and the heads read every question
        raise FileNotFoundError(f"--out {out}: no heads profile there; copy one first or leave --out out")
    cb.use_shipped_tiktoken_cache()
    titles, texts, items = hotpotqa_corpus(args.data, args.limit)
    items = [it for it in items if it["supporting_facts"]]  # no gold, nothing to fit
    if not items:
        raise ValueError(f"{args.data}: no question with supporting facts to fit on")
    nodes = cb.corpus_nodes(titles, texts)
    titles_of = {n.node_id: t for n, t in zip(nodes, titles)}
    bb = cb.load_backbone(args.model)
    shared, fitted = {}, {}
    for kind in stages:
        first = cb.FirstStage(kind, args.candidates)
        first.load(shared)
        first.build(nodes, shared)
        entry = fit_reranker_section(bb, fit_questions(first, items, titles_of), step=args.step,
                                     progress=sys.stderr.isatty())
        entry["fit"] |= {"data": Path(args.data).name, "candidates": args.candidates}
        path = save_reranker_entry(bb, kind, entry, out)
        fitted[kind] = entry
        print(f"fit-reranker: wrote the {kind!r} entry into {path}", file=sys.stderr)
    print(json.dumps(fitted, indent=1))
    return 0
