"""What the command line says beside its answers. Quiet by default: what third-party libraries log, their progress
bars and the warnings raised in their own code are not shown; endo's warnings and its one-line reports are.
`--verbose` shows all of it, and endo's own INFO lines (each load, each compression)."""
from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import sysconfig
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # endo_retrieval/
THIRD_PARTY = ("transformers", "sentence_transformers", "huggingface_hub", "accelerate", "torch", "safetensors",
               "tokenizers", "urllib3", "httpx", "httpcore", "filelock", "uvicorn", "starlette", "mcp")
VERBOSE_ENV = "ENDO_VERBOSE"  # read by model.locate.quiet_transformers, which otherwise silences transformers


def add_verbose(parser: argparse.ArgumentParser, on_command: bool = False) -> None:
    """`--verbose`, before the command (`endo --verbose query ...`) or after it (`endo query ... --verbose`); a
    command's own leaves the one given before it as it is when absent."""
    parser.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS if on_command else False,
                        help="also show what third-party libraries log and warn (transformers, sentence-transformers, "
                        "the Hugging Face hub, torch) and endo's own INFO lines; quiet by default")


def configure(verbose: bool) -> None:
    """Set the process's logging for a command: quiet, or everything (`--verbose`)."""
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
        logging.getLogger("endo_retrieval").setLevel(logging.INFO)
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # read when transformers is first imported
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(logging.ERROR)


@functools.cache
def libraries() -> tuple[Path, ...]:
    """Where installed libraries and the standard library live: a warning raised in their code is theirs."""
    return tuple({Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib", "stdlib")})


def theirs(filename: str) -> bool:
    """Whether a warning was raised in a library's code (not endo's, not the user's script)."""
    path = Path(filename).resolve()
    if path.is_relative_to(PACKAGE):
        return False
    return any(path.is_relative_to(root) for root in libraries())


def warning_printer(command: str, verbose: bool):
    """A `warnings.showwarning` that prints endo's warnings as one line each (no source line) and, unless verbose,
    drops those raised in third-party code."""
    def show(message, category, filename, lineno, file=None, line=None):
        if verbose or not theirs(filename):
            print(f"endo {command}: warning: {message}", file=sys.stderr)

    return show
