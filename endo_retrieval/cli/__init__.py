"""`endo ...`: the command line. Each command's arguments live here in cli/, its work in the module that owns it;
this file only wires them."""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import warnings
from typing import Callable

from endo_retrieval.cli.commands import model_argument
from endo_retrieval.calibration.prepare import ready_methods
from endo_retrieval.model.profiles import heads_profile, ilre_profile, sae_card

# command -> (module, prefix, help): the module exposes {prefix}add_arguments(parser) and {prefix}run(args).
COMMANDS = {
    "info": ("endo_retrieval.cli", "info_", "the model, device, cache, SAEs, ILRe layer and retrieval heads"),
    "demo": ("endo_retrieval.cli.demo", "", "the main job on the default model and a built-in task (no network)"),
    "index": ("endo_retrieval.cli.commands", "index_", "build an endogenous index over text files"),
    "query": ("endo_retrieval.cli.commands", "query_", "retrieve evidence for a question from an index"),
    "compress": ("endo_retrieval.cli.commands", "compress_", "compress one long context for one question"),
    "train-sae": ("endo_retrieval.cli.calibrate", "train_sae_", "train Top-k sparse autoencoders on key projections"),
    "train-phi": ("endo_retrieval.cli.calibrate", "train_phi_", "distil phi feature maps for completion attention"),
    "calibrate-ilre": ("endo_retrieval.cli.calibrate", "ilre_",
                       "pick ILRe's retrieval layer with a passkey or evidence task"),
    "calibrate-heads": ("endo_retrieval.cli.calibrate", "heads_",
                        "choose the retrieval heads and fit the fused ranking"),
    "calibrate-pipeline": ("endo_retrieval.cli.calibrate", "pipeline_", "fit the endo pipeline's depth, reading and "
                           "fusion on labelled questions"),
    "prepare": ("endo_retrieval.cli.prepare", "prepare_",
                "make everything the default pipeline needs for a model, from your documents, no labels"),
    "mcp": ("endo_retrieval.cli.mcp_server", "", "serve an index to agents over the Model Context Protocol (stdio)"),
}


def info_add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON: model, model_hash, layers, device, cache_dir, "
                   "families, sae, ilre, heads and ready")
    model_argument(p)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")


def info_run(args) -> int:
    from endo_retrieval.model.backbone import SUPPORTED_FAMILIES, Backbone  # torch: off the CLI's fast path

    bb = Backbone(args.model, device=args.device)
    heads = heads_profile(bb)
    if heads:  # the chosen heads, the fused weights and the corpus pipeline's settings; the per-head scores and the
        # pipeline's fit table stay in the profile (and its plot)
        pipeline = {k: ({kk: vv for kk, vv in v.items() if kk != "fit"} if k == "cpu" else v)
                    for k, v in (heads.get("pipeline") or {}).items() if k != "fit"} or None
        heads = {k: heads[k] for k in ("heads", "fusion", "recall_by_count", "context_tokens", "budgets") if k in heads}
        heads["pipeline"] = pipeline
    data = {**bb.info(), "families": list(SUPPORTED_FAMILIES), "sae": sae_card(bb), "ilre": ilre_profile(bb),
            "heads": heads, "ready": ready_methods(bb)}
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        for k, v in data.items():
            print(f"{k:>14}: {v}")
    return 0


def resolve(table: dict, name: str):
    """(add_arguments, run) of command `name` in a table of name -> (module, prefix, help)."""
    module_name, prefix, _ = table[name]
    module = importlib.import_module(module_name)
    return getattr(module, prefix + "add_arguments"), getattr(module, prefix + "run")


class CommandParsers(argparse._SubParsersAction):
    """Sub-parsers whose arguments are added only when their command is chosen: building the parser imports no
    command's module (several import torch), so `endo --help` or an argument error answers at once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending: dict[str, Callable[[], None]] = {}  # command -> adds its arguments

    def __call__(self, parser, namespace, values, option_string=None):
        add_arguments = self.pending.pop(values[0], None)
        if add_arguments is not None:
            add_arguments()
        super().__call__(parser, namespace, values, option_string)


def add_subcommands(parser: argparse.ArgumentParser, table: dict, dest: str) -> None:
    """One sub-parser per table entry, its arguments added when it is chosen; an entry whose module cannot be
    imported says so when it is run."""
    sub = parser.add_subparsers(dest=dest, metavar=dest.upper(), action=CommandParsers)
    for name, (_, _, help_text) in table.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        sub.pending[name] = functools.partial(_add_arguments, p, table, name, parser.prog)


def _add_arguments(p: argparse.ArgumentParser, table: dict, name: str, prog: str) -> None:
    try:
        add_arguments, _ = resolve(table, name)
    except (ImportError, AttributeError) as e:
        p.set_defaults(_missing=f"`{prog} {name}` is not available in this build: {e}")
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        return
    add_arguments(p)


def plugin_commands() -> dict:
    """Commands other distributions add through the entry-point group `endo_retrieval.commands` (the bench in
    bench/ adds `endo bench`), as name -> (module, "", its HELP): the library itself imports none of them."""
    from importlib.metadata import entry_points

    found = {}
    for ep in entry_points(group="endo_retrieval.commands"):
        try:
            help_text = getattr(importlib.import_module(ep.value), "HELP", ep.name)
        except ImportError as e:
            help_text = f"(not available: {e})"
        found[ep.name] = (ep.value, "", help_text)
    return found


def build_parser(commands: dict | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="endo", description="Endogenous retrieval: a local LM finds evidence "
                                     "with its own attention signals (S3-Attention, ILRe).")
    add_subcommands(parser, commands or COMMANDS | plugin_commands(), "command")
    return parser


def main(argv=None) -> int:
    commands = COMMANDS | plugin_commands()  # the entry points are read (and their modules imported) once
    parser = build_parser(commands)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"] and "bench" not in commands:
        print("endo bench: the benchmarks are a distribution of their own, in this repository's bench/ folder: "
              "pip install -e bench (make setup installs it).", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 0
    if getattr(args, "_missing", None):
        print(args._missing, file=sys.stderr)
        return 2
    _, run = resolve(commands, args.command)
    from endo_retrieval.model.backbone import BackboneError  # torch: only once the arguments are parsed

    try:
        with warnings.catch_warnings():  # the library's warnings (a question cut): one line, no source line
            warnings.showwarning = lambda message, *_, **__: print(f"endo {args.command}: warning: {message}",
                                                                  file=sys.stderr)
            rc = run(args)
        return rc if isinstance(rc, int) else 0  # some commands return their report (train-sae: the card)
    except (BackboneError, ValueError, OSError) as e:  # a damaged index, a busy one, a full disk: one line
        print(f"endo {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
