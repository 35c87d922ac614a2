"""`endo query` and `endo compress`, and what the other commands share: `--model`, the checks made before anything
loads, the JSON of a hit, and `engine()`, the one way in to the heavy half of the command line."""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from types import ModuleType

from endo_retrieval.cli.saved import bm25_hits, read_header, read_saved
from endo_retrieval.files import set_aside
from endo_retrieval.index.text_files import read_text_file
from endo_retrieval.methods import DEFAULT_METHOD, REGISTRY, SEARCH_METHODS, compress
from endo_retrieval.model.families import names


def engine() -> ModuleType:
    """The heavy half of the command line (cli/engine.py: the index engine, the model, the adapters' search, and
    torch and transformers behind them; seconds to import on a 2-core CPU), imported when a command first needs the
    model, so parsing, --help, argument errors and the answers read from the folder alone (--method bm25, `endo info
    DIR`, `endo remove` of an id not held) import none of it."""
    from endo_retrieval.cli import engine as heavy  # torch: off the CLI's fast path (this function's reason)

    return heavy


def _method_help() -> str:
    return ", ".join(REGISTRY)


def model_argument(p) -> None:
    """`--model`, the same on every command that runs a model."""
    *most, last = names()
    p.add_argument("--model", default=None, metavar="PATH|ID", help=f"a model of the {', '.join(most)} or {last} "
                   "family: a GGUF file, a Hugging Face folder, or a hub id (owner/name[@revision], through the hub's "
                   "own cache) (default: the embedded SmolLM2-135M-Instruct)")


def query_add_arguments(p) -> None:
    p.add_argument("index", metavar="DIR", help="an index folder made by `endo index`")
    p.add_argument("question")
    p.add_argument("--k", type=int, default=4, help="number of hits, each from another document unless --passages "
                   "(default 4; 0 prints nothing, or [] with --json, as the adapters return [] for k=0)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--passages", action="store_true", help="the k best passages, several of one document "
                       "possible (the adapters' return_passages=True)")
    shape.add_argument("--whole", action="store_true", help="each hit's whole document, ranked by its best passage "
                       "(the adapters' return_document=True)")
    p.add_argument("--budget", type=int, default=None, help="token budget over all hits, each passage cut to its "
                   "best part (default: whole passages)")
    p.add_argument("--method", default=None, choices=SEARCH_METHODS, help="default: the index's own; bm25 ranks the "
                   "passages by BM25 alone and answers from the folder without loading the model")
    p.add_argument("--depth", type=int, default=None, help="endo: candidates the model reads (default: the model's "
                   "fitted value: 20 or 30 on a GPU, on a CPU the 135M model's 12; fewer is faster)")
    p.add_argument("--read-tokens", type=int, default=None, help="endo: tokens read of each candidate (default: "
                   "the fitted value, 128 or 256)")
    p.add_argument("--first-stage", choices=("hybrid", "bm25", "dense"), default=None,
                   help="endo: the candidates (default: the model's fitted first stage where the index holds "
                   "passage embeddings, else bm25)")
    p.add_argument("--json", action="store_true", help="print JSON")
    model_argument(p)  # the index's own model: an index answers only with the model that built it


def span_json(s) -> dict:
    return {"doc_id": s.doc_id, "char_start": s.char_start, "char_end": s.char_end, "tokens": [s.start, s.end],
            "score": s.score, "signals": list(s.signals), "text": s.text, "metadata": s.metadata,
            **({"stage_scores": s.stage_scores, "stage_ms": s.stage_ms} if s.stage_scores else {})}


def query_run(args) -> int:
    folder = Path(args.index)
    check_index_folder(folder)  # the arguments first: a mistake answers before the model loads
    check_question(args.question)
    if args.k == 0:  # nothing asked: nothing to read (the adapters' k=0 rule)
        if args.json:
            print("[]")
        return 0
    shape = "whole" if args.whole else "passages" if args.passages else "document"
    hits, corpus = bm25_query(args, folder, shape) or model_query(args, shape)
    print_hits(hits, args.json, corpus)
    return 0


def bm25_query(args, folder: Path, shape: str, saved=None) -> tuple[list, object] | None:
    """The hits of `--method bm25` (or an index built for bm25) read from the folder without the model (`saved`:
    read already), and the corpus they come from; None where the search needs the model (another method, or an
    index in segments)."""
    if (args.method or (saved.meta if saved else read_header(folder)).get("method")) != "bm25":
        return None
    tuned = [f for f, v in (("--depth", args.depth), ("--read-tokens", args.read_tokens),
                            ("--first-stage", args.first_stage)) if v is not None]
    if tuned:
        raise ValueError(f"{', '.join(tuned)} tune the endo pipeline; bm25 reads no candidates (drop them, or "
                         "pass --method endo).")
    saved = read_saved(folder, passages=True) if saved is None else saved
    if saved.corpus is None:
        return None
    hits = bm25_hits(saved, args.question, args.k, args.budget, shape)
    if len(hits) < args.k:
        warnings.warn(f"{len(hits)} of the {args.k} hits asked for: no {'more ' if hits else ''}"
                      f"{'passages' if shape == 'passages' else 'documents'} hold a word of the question.")
    return hits, saved.corpus


def model_query(args, shape: str, index=None, progress: bool | None = None) -> tuple[list, object]:
    """The hits of the index's method with its model loaded (`index`: loaded already; the shared adapters' search,
    `search_hits`), and the corpus they come from."""
    heavy = engine()
    index = heavy.EndoIndex.load(args.index, args.model) if index is None else index
    hits = heavy.search_hits(index, args.question, args.k, args.budget, args.method,
                                    return_passages=shape == "passages", return_document=shape == "whole",
                                    depth=args.depth, read_tokens=args.read_tokens, first_stage=args.first_stage,
                                    progress=progress)
    return hits, getattr(index, "corpus", None)


def print_hits(hits: list, as_json: bool, corpus=None) -> None:
    """The hits as JSON, or for a reader: a line per hit, then its text indented with its line breaks (code keeps
    its lines and, where the hit starts inside a line's indent, its first line's indent; runs of blank lines are
    one)."""
    if as_json:
        print(json.dumps([span_json(h) for h in hits], indent=2, ensure_ascii=False))
        return
    for rank, h in enumerate(hits, 1):
        section = f" § {h.metadata['section']}" if h.metadata.get("section") else ""
        print(f"[{rank}] {h.doc_id}{section}  chars {h.char_start}-{h.char_end}  score {h.score:.3f}  "
              f"({'+'.join(h.signals)})")
        print(indented(line_indent(corpus, h) + h.text))


def line_indent(corpus, hit) -> str:
    """The blanks between the start of the line a hit starts in and the hit, where only blanks lie there."""
    if corpus is None or hit.doc_id not in corpus:
        return ""
    text = corpus.doc(hit.doc_id).text
    before = text[text.rfind("\n", 0, hit.char_start) + 1:hit.char_start]
    return before if not before.strip() else ""


def indented(text: str, margin: str = "    ") -> str:
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    kept = [line for i, line in enumerate(lines) if line or (i and lines[i - 1])]
    return "\n".join(margin + line if line else "" for line in kept)


def compress_add_arguments(p) -> None:
    p.add_argument("--context", required=True, metavar="FILE",
                   help="the long context (a text file, UTF-8 or cp1252/Latin-1; - for stdin)")
    p.add_argument("--question", required=True)
    p.add_argument("--budget", type=int, default=1024, help="at most this many tokens are kept (default 1024)")
    p.add_argument("--method", default=DEFAULT_METHOD,
                   help=f"one of: {_method_help()} (default {DEFAULT_METHOD}, the best measured)")
    p.add_argument("--json", action="store_true", help="print JSON with the spans")
    model_argument(p)


def compress_run(args) -> int:
    check_question(args.question)  # the arguments first: a mistake answers before the model loads
    if args.method not in REGISTRY:
        raise ValueError(f"Unknown method {args.method!r}; use one of {_method_help()}.")
    if args.context != "-" and not Path(args.context).is_file():
        raise ValueError(f"--context {args.context}: no such file (give a text file, or - for standard input).")
    if args.context == "-":
        context = sys.stdin.read()
    else:
        source = read_text_file(Path(args.context))
        context = source.text
        if source.encoding == "cp1252":
            print(f"endo compress: {args.context} is not UTF-8; read it as cp1252/Latin-1", file=sys.stderr)
    out = compress(context, args.question, budget=args.budget, method=args.method, backbone=args.model)
    if args.json:
        print(json.dumps({"method": out.method, "budget": out.budget, "n_tokens": out.n_tokens, "text": out.text,
                          "spans": [span_json(s) for s in out.spans]}, indent=2, ensure_ascii=False))
    else:
        print(out.text)
    return 0


def check_index_folder(folder: Path) -> None:
    """A ValueError, before anything loads, when `folder` holds no index (its header, endo-index.json; mid-swap a
    writer's set-aside folder holds it, `files.read_folder`)."""
    if not any((f / "endo-index.json").is_file() for f in (folder, set_aside(folder))):
        why = "no such folder" if not folder.exists() else "it holds no endo index"
        raise ValueError(f"{folder}: {why}; build one with `endo index PATH... --out {folder}`.")


def check_question(question: str) -> None:
    if not question.strip():
        raise ValueError("The question is empty; ask something.")


def int_list(text: str) -> list[int]:
    """argparse type of a comma-separated list of whole numbers, e.g. 4096,8192."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, e.g. 4096,8192; got {text!r}")
