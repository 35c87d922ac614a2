"""`endo ...`: the command line. Each command's arguments live here in cli/, its work in the module that owns it;
this file only wires them."""
from __future__ import annotations

import argparse
import functools
import importlib
import re
import sys
import warnings
from pathlib import Path
from typing import Callable

from endo_retrieval.cli.verbosity import add_verbose, configure, warning_printer


# command -> (module, prefix, help): the module exposes {prefix}add_arguments(parser) and {prefix}run(args).
COMMANDS = {
    "info": ("endo_retrieval.cli.info", "info_", "the model, device, cache, SAEs, ILRe layer and retrieval heads; with "
             "DIR, an index's committed generation and size"),
    "demo": ("endo_retrieval.cli.demo", "", "the main job on the default model and a built-in task (no network)"),
    "index": ("endo_retrieval.cli.indexing", "index_", "build an endogenous index over text files"),
    "query": ("endo_retrieval.cli.commands", "query_", "retrieve evidence for a question from an index"),
    "remove": ("endo_retrieval.cli.indexing", "remove_", "remove documents from an index"),
    "compress": ("endo_retrieval.cli.commands", "compress_", "compress one long context for one question"),
    "train-sae": ("endo_retrieval.cli.calibrate", "train_sae_", "train Top-k sparse autoencoders on key projections"),
    "train-phi": ("endo_retrieval.cli.calibrate", "train_phi_", "distil phi feature maps for completion attention"),
    "calibrate-ilre": ("endo_retrieval.cli.calibrate", "ilre_",
                       "pick ILRe's retrieval layer with a passkey or evidence task"),
    "calibrate-heads": ("endo_retrieval.cli.calibrate", "heads_",
                        "choose the retrieval heads and fit the fused ranking"),
    "calibrate-pipeline": ("endo_retrieval.cli.calibrate", "pipeline_", "fit the endo pipeline's depth, reading and "
                           "fusion on labelled questions"),
    "calibrate-fusion": ("endo_retrieval.cli.calibrate", "fusion_", "fit the fusion that adapts to each question "
                         "across labelled domains (the hybrid first stage's and the rerankers')"),
    "prepare": ("endo_retrieval.cli.prepare", "prepare_",
                "make everything the default pipeline needs for a model, from your documents, no labels"),
    "mcp": ("endo_retrieval.cli.mcp_server", "", "serve an index to agents over the Model Context Protocol (stdio)"),
    "serve": ("endo_retrieval.cli.serve", "", "answer `endo query --json` over HTTP from one long-lived process (the "
              "model loads once)"),
}


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
        add_verbose(p, on_command=True)
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
    add_verbose(parser)
    add_subcommands(parser, commands or COMMANDS | plugin_commands(), "command")
    return parser


# whole-number options the library's commands read alike, checked before a command loads anything: name -> least
# value (lists, e.g. --depths 10,20, value by value). k: as in the adapters, 0 asks for nothing and gets nothing
AT_LEAST = {"k": 0, "budget": 1, "budgets": 1, "depth": 1, "depths": 1, "read_tokens": 8, "workers": 1, "limit": 1,
            "context_tokens": 1}
# train-sae's k: the SAE's latents kept per vector; mcp's: the default of a search tool that refuses 0 (its search)
LEAST_BY_COMMAND = {("train-sae", "k"): 1, ("mcp", "k"): 1}
DEVICE = re.compile(r"(cpu|cuda(:\d+)?|mps)")
HUB_ID = re.compile(r"[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9])?/[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9])?(@\S+)?")


def check_arguments(args) -> str | None:
    """What is wrong with the parsed arguments of one of the library's commands, checked without importing torch
    or loading a model (so a mistake answers at once), else None: the whole-number options (AT_LEAST), --device,
    and --model where it names a local file or folder that is not there (a hub id is looked up when it loads)."""
    for name, least in AT_LEAST.items():
        value = getattr(args, name, None)
        least = LEAST_BY_COMMAND.get((args.command, name), least)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and v < least:
                flag = "--" + name.replace("_", "-")
                what = " (0 returns nothing)" if name == "k" and least == 0 else ""
                return f"{flag} must be a whole number >= {least}{what}, got {v}."
    device = getattr(args, "device", None)
    if isinstance(device, str) and not DEVICE.fullmatch(device):
        return f"--device must be cpu, cuda, cuda:N or mps, got {device!r}."
    model = getattr(args, "model", None)
    if isinstance(model, str) and model != "default" and not Path(model).expanduser().exists() and \
            (model.lower().endswith(".gguf") or not HUB_ID.fullmatch(model)):
        return (f"--model {model}: no such file or folder. Pass a GGUF file, a Hugging Face model folder, a hub id "
                "(owner/name[@revision]), or leave --model out for the default model.")
    return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    named = next((a for a in argv if not a.startswith("-")), None)
    # the entry points are read (and their modules imported) once, and only where the command may be a plugin's or
    # the help lists them all: scanning the installed distributions is a tenth of a second of a bm25 query
    commands = COMMANDS if named in COMMANDS and "-h" not in argv and "--help" not in argv else \
        COMMANDS | plugin_commands()
    parser = build_parser(commands)
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
    problem = check_arguments(args) if args.command in COMMANDS else None  # the plugins check their own
    if problem:
        print(f"endo {args.command}: error: {problem}", file=sys.stderr)
        return 2
    configure(args.verbose)
    _, run = resolve(commands, args.command)
    try:
        with warnings.catch_warnings():  # the library's warnings (a question cut): one line, no source line
            warnings.showwarning = warning_printer(args.command, args.verbose)
            rc = run(args)
        return rc if isinstance(rc, int) else 0  # some commands return their report (train-sae: the card)
    except (ValueError, OSError) as e:  # a model error (BackboneError), a damaged index, a full disk: one line
        print(f"endo {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
