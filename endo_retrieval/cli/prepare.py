"""`endo prepare`: its arguments; its work is `calibration.prepare.run`."""
from __future__ import annotations

import argparse

from endo_retrieval.calibration import prepare
from endo_retrieval.cli.commands import int_list, model_argument


def prepare_add_arguments(p: argparse.ArgumentParser) -> None:
    model_argument(p)
    p.add_argument("--documents", metavar="DIR", default=None,
                   help="your own text files (a folder of .txt/.md/.rst, or one file): the calibration makes its "
                   "questions from them; no labels needed")
    p.add_argument("--methods", default="endo", help="methods to make ready, comma-separated (default endo, which "
                   f"also readies heads): {', '.join(prepare.METHODS)}")
    p.add_argument("--profile", default=None, metavar="PATH", help="the heads profile to write (default: where the "
                   "library looks for the model's; another path is used when $ENDO_HEADS_PROFILE names it)")
    p.add_argument("--tasks", type=int, default=None, help="haystacks for the heads (default: 40 on a CPU, 128 on "
                   "a GPU)")
    p.add_argument("--passkeys", type=int, default=None, help="passkey haystacks added to them (default 4 / 8)")
    p.add_argument("--questions", type=int, default=None, help="questions for the pipeline's fit (default 40 / 200)")
    p.add_argument("--context-tokens", type=int_list, default=None,
                   help="haystack lengths for the heads, comma-separated (default 1024 on a CPU, 4096 on a GPU); "
                   "the fusion is fitted at an eighth of each as the budget")
    p.add_argument("--depths", type=int_list, default=[20], help="pipeline candidate depths to try (default 20)")
    p.add_argument("--read-tokens", type=int_list, default=[128], help="tokens read per candidate to try "
                   "(default 128)")
    # the keys of calibration.pipeline.ORDERS (not imported: it loads torch, and --help must not)
    p.add_argument("--orders", nargs="+", choices=("best-last", "first-stage"), default=["best-last"],
                   help="candidate orders to try: best-last (the best candidate nearest the question; default) and "
                        "first-stage (the first stage's order)")
    p.add_argument("--questions-by", choices=("auto", "rules", "model"), default="auto",
                   help="who writes the tasks' questions: rules (a few of the evidence's words, some inflected), "
                        "model (the model writes each question from its evidence in its own words: a minute or two "
                        "more on a GPU), or auto (default: model for models of 1B parameters or more, else rules)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="make every asked-for artefact again")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--timings", default=None, metavar="FILE.json", help="also write each phase's seconds here")


def prepare_run(args) -> int:
    from endo_retrieval.cli.calibrate import command_args  # heavy: the other commands' modules import torch

    return prepare.run(args, command_args)
