"""`endo bench quality|perf|attention|signals|rerank|corpus|fit-reranker|scale|ann`: each benchmark is a module
exposing `add_arguments(parser)` and `run(args)`; add one by adding a line to BENCHES. A benchmark whose module is
absent says so when run."""
from __future__ import annotations

import argparse
import logging
import sys

from endo_retrieval.cli.commands import int_list, model_argument

HELP = "benchmarks: quality | perf | attention | signals | rerank | corpus | fit-reranker | scale | ann"

# benchmark -> (module, prefix, help): the module exposes {prefix}add_arguments(parser) and {prefix}run(args)
BENCHES = {
    "quality": ("endo_bench.bench", "quality_",
                "retrieval and answer quality of every method at matched budgets"),
    "perf": ("endo_bench.perf", "", "indexing and query speed, memory"),
    "attention": ("endo_bench.attention_bench", "", "decode-time sparse attention backends"),
    "signals": ("endo_bench.signals", "", "each ranking signal alone, and what it finds that BM25 misses"),
    "rerank": ("endo_bench.rerank", "", "a MiniLM vector store alone and followed by the heads reranker"),
    "corpus": ("endo_bench.corpus_bench", "",
               "corpus retrieval through LlamaIndex retrievers: paragraph recall@k, all-gold@k, MRR, intervals"),
    "fit-reranker": ("endo_bench.fit_reranker", "",
                     "fit EndoReranker's fusion weights per first stage into the model's heads profile"),
    "scale": ("endo_bench.scale", "", "an endo index at 10k / 100k / 1M passages: build, bytes, RAM, stage 1"),
    "ann": ("endo_bench.ann", "", "the dense stage's cells against the exact product: recall@20 and time, real and 1M"),
}


def quality_add_arguments(p: argparse.ArgumentParser) -> None:
    from endo_bench.runner import METHODS, MAX_NEW_TOKENS

    p.add_argument("--data", required=True, help="HotpotQA PATH.json, LongBench-style PATH.jsonl, or passkey:DIR")
    p.add_argument("--out", required=True, help="FILE.json; the Markdown table, plots and the resumable "
                   "FILE.records.jsonl go beside it")
    p.add_argument("--context-tokens", type=int_list, action="extend", default=None,
                   help="haystack length(s) in tokens, e.g. 4096,8192 (default 4096)")
    p.add_argument("--budget", type=int_list, action="extend", default=None,
                   help="context-token budget(s), e.g. 512,1024 (default 1024)")
    p.add_argument("--methods", default="", help=f"comma-separated (default all): {', '.join(METHODS)}")
    p.add_argument("--limit", type=int, default=None, help="the first N examples")
    p.add_argument("--seed", type=int, default=0, help="haystack shuffling seed")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed data rows (reported) instead of stopping")
    p.add_argument("--no-generate", action="store_true", help="skip greedy generation (no f1/em; faster)")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the full context's reference pass (no kl; past the model's window it is costly and "
                   "not a reference)")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help="greedy answer length")
    p.add_argument("--eager", action="store_true", help="on CUDA, the batched reads' forwards run eagerly, not "
                   "replayed from CUDA graphs (the same selections to float tolerance): for timing beside them")
    model_argument(p)


def quality_run(args) -> int:
    from endo_bench.runner import QualityConfig, run_quality

    config = QualityConfig(data=args.data, out=args.out, context_tokens=args.context_tokens or [4096],
                           budgets=args.budget or [1024], methods=args.methods, limit=args.limit, seed=args.seed,
                           skip_bad=args.skip_bad, generate=not args.no_generate, max_new_tokens=args.max_new_tokens,
                           reference=not args.no_reference, cuda_graphs=not args.eager)
    backbone = None
    if args.model:
        from endo_retrieval.model.backbone import Backbone

        backbone = Backbone(args.model)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    result = run_quality(config, backbone)
    for message in result["config"]["skipped_rows"]:
        print(f"skipped: {message}", file=sys.stderr)
    print(config.out.with_suffix(".md").read_text(encoding="utf-8"))
    print(f"wrote {config.out} and, beside it, {config.out.with_suffix('.md').name} and the plots")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from endo_retrieval.cli import add_subcommands

    add_subcommands(parser, BENCHES, "bench")


def run(args) -> int:
    if not getattr(args, "bench", None):
        print(f"endo bench: choose one of {', '.join(BENCHES)} (e.g. endo bench quality --help)", file=sys.stderr)
        return 2
    if getattr(args, "_missing", None):
        print(args._missing, file=sys.stderr)
        return 2
    from endo_retrieval.cli import resolve

    return resolve(BENCHES, args.bench)[1](args)
