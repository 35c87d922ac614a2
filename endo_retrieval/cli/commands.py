"""`endo index`, `endo query`, `endo compress`: the engine from the command line."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from endo_retrieval.index.text_files import read_text_file, read_text_files, text_files
from endo_retrieval.index.passages import PASSAGE_TOKENS, passage_cuts
from endo_retrieval.methods import DEFAULT_METHOD, REGISTRY, S3_METHODS, SEARCH_METHODS, compress
from endo_retrieval.files import writer_lock


def _method_help() -> str:
    return ", ".join(REGISTRY)


def model_argument(p) -> None:
    """`--model`, the same on every command that runs a model."""
    p.add_argument("--model", default=None, metavar="PATH|ID", help="a model of the llama, mistral, qwen2 or qwen3 "
                   "family: a GGUF file, a Hugging Face folder, or a hub id (owner/name[@revision], through the hub's "
                   "own cache) (default: the embedded SmolLM2-135M-Instruct)")


# ---- endo index --------------------------------------------------------------------------------------------
def index_add_arguments(p) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH", help="text files or folders (.txt, .md, .rst)")
    p.add_argument("--out", required=True, metavar="DIR", help="index folder (written atomically)")
    p.add_argument("--append", action="store_true", help="add to the index already in DIR instead of replacing it")
    p.add_argument("--strict", action="store_true", help="refuse the whole run, writing nothing, when a file cannot "
                   "be read as text (binary, empty, an unknown encoding); without it such files are skipped with a "
                   "warning and listed at the end")
    p.add_argument("--method", default=DEFAULT_METHOD, choices=SEARCH_METHODS,
                   help=f"default search method stored with the index (default {DEFAULT_METHOD}; s3 and s3-hybrid "
                   "need the slower SAE pass, and an index built for them serves every method)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="build with Ray workers (the `ray` extra), one per GPU or CPU slot: join the cluster at "
                   "ADDRESS (e.g. auto, or HEAD:6379 from `ray start --head`), or start a local one without it")
    p.add_argument("--workers", type=int, default=None, help="Ray workers (default: one per GPU, else per CPU)")
    model_argument(p)


def index_run(args) -> int:
    from endo_retrieval.methods.search import Document, EndoIndex  # torch: off the CLI's fast path

    files, skipped = read_text_files(text_files(args.paths))
    for path, why in skipped:
        print(f"endo index: warning: skipping {path}: {why}", file=sys.stderr)
    if skipped and args.strict:  # checked before the model loads or anything is written
        raise ValueError(f"--strict: {len(skipped)} of {len(files) + len(skipped)} file(s) cannot be read as text "
                         "(listed above) and nothing was written; convert or remove them, or drop --strict to "
                         "index the rest.")
    if not files:
        raise ValueError(f"none of the {len(skipped)} file(s) can be read as text (listed above); nothing was "
                         "written.")
    out = Path(args.out)
    docs = [Document(str(f.path), f.text, {"path": str(f.path.resolve())}) for f in files]
    if args.ray is not None:
        from endo_retrieval import distributed  # torch, and Ray only when asked for
        from endo_retrieval.index import segments  # torch

        # every method: an index for endo or bm25 only tokenises, but its segments are what ShardedIndex opens as
        # shards (the pipeline's stage 1 where the corpus lives; docs/scale.md)
        distributed.connect(args.ray or None)
        distributed.RayIndexer(args.workers, setup=distributed.ModelRecipe(args.model), method=args.method
                               ).build(out, docs, append=args.append)
        parts = segments.listed_committed(out)
        print(f"indexed {len(docs)} document(s) on Ray workers -> {out} ({len(parts)} segment(s), "
              f"{sum(p['tokens'] for p in parts)} tokens in all)")
        print_read_report(files, skipped)
        return 0
    with writer_lock(out):  # from load to save: a second writer gets IndexBusyError, no append is lost
        idx = EndoIndex.load(out, args.model) if args.append else EndoIndex(args.model, method=args.method)
        idx.add_documents(docs)  # a progress bar when standard error is a terminal
        idx.save(out)
    print(f"indexed {len(docs)} document(s) -> {out}; it holds {index_summary(idx, out)}")
    print_read_report(files, skipped)
    return 0


def index_summary(index, folder: Path) -> str:
    """What a saved index holds for its method: documents, the passages the `endo` pipeline ranks, tokens and bytes
    on disk, and the S3 feature postings where it has them (an index for endo or bm25 has none)."""

    # cut as Passages.build cuts them, without building its BM25
    passages = sum(len(passage_cuts(d.sentence_starts, d.end, PASSAGE_TOKENS)) - 1 for d in index.corpus.documents())
    holds = [f"{len(index):,} documents", f"{passages:,} passages", f"{index.corpus.n_tokens:,} tokens"]
    if index.method in S3_METHODS:
        postings = index.index.n_postings
        features = sum(f.stat().st_size for f in (folder / "features").rglob("*") if f.is_file())
        holds.append(f"{postings:,} postings ({features / max(postings, 1):.2f} bytes/posting)")
    on_disk = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    return f"{', '.join(holds)}, {on_disk:,} bytes on disk (method {index.method})"


def print_read_report(files, skipped: list[tuple[Path, str]]) -> None:
    """After the summary: the files read as cp1252 rather than UTF-8, and those skipped, with why."""
    decoded = [str(f.path) for f in files if f.encoding == "cp1252"]
    if decoded:
        print(f"read as cp1252/Latin-1 (not UTF-8): {', '.join(decoded)}")
    if skipped:
        print(f"skipped {len(skipped)} file(s) that cannot be read as text:")
        for path, why in skipped:
            print(f"  {path}: {why}")


# ---- endo query ------------------------------------------------------------------------------------------------
def query_add_arguments(p) -> None:
    p.add_argument("index", metavar="DIR", help="an index folder made by `endo index`")
    p.add_argument("question")
    p.add_argument("--k", type=int, default=4, help="number of evidence spans (default 4)")
    p.add_argument("--budget", type=int, default=None, help="token budget over all spans (default 128 per span)")
    p.add_argument("--method", default=None, choices=SEARCH_METHODS, help="default: the index's own")
    p.add_argument("--depth", type=int, default=None, help="endo: candidates the model reads (default: the model's "
                   "fitted value: 20 or 30 on a GPU, on a CPU the 135M model's 12; fewer is faster)")
    p.add_argument("--read-tokens", type=int, default=None, help="endo: tokens read of each candidate (default: "
                   "the fitted value, 128 or 256)")
    p.add_argument("--json", action="store_true", help="print JSON")
    model_argument(p)  # the index's own model: an index answers only with the model that built it


def span_json(s) -> dict:
    return {"doc_id": s.doc_id, "char_start": s.char_start, "char_end": s.char_end, "tokens": [s.start, s.end],
            "score": s.score, "signals": list(s.signals), "text": s.text, "metadata": s.metadata,
            **({"stage_scores": s.stage_scores, "stage_ms": s.stage_ms} if s.stage_scores else {})}


def query_run(args) -> int:
    from endo_retrieval.methods.search import EndoIndex  # torch: off the CLI's fast path

    index = EndoIndex.load(args.index, args.model)
    hits = index.search(args.question, k=args.k, budget=args.budget, method=args.method, depth=args.depth,
                        read_tokens=args.read_tokens)
    if args.json:
        print(json.dumps([span_json(h) for h in hits], indent=2, ensure_ascii=False))
        return 0
    for rank, h in enumerate(hits, 1):
        print(f"[{rank}] {h.doc_id} chars {h.char_start}-{h.char_end}  score {h.score:.3f}  "
              f"({'+'.join(h.signals)})\n    {' '.join(h.text.split())}")
    return 0


# ---- endo compress ---------------------------------------------------------------------------------------------
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


def int_list(text: str) -> list[int]:
    """argparse type of a comma-separated list of whole numbers, e.g. 4096,8192."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, e.g. 4096,8192; got {text!r}")
