"""Argument errors and --help answer before any heavy import: parsing `endo ...` loads neither torch nor
transformers (each fresh interpreter below would otherwise spend seconds importing them)."""
import subprocess
import sys

import pytest

from endo_retrieval.cli import COMMANDS

# a fresh interpreter parses the command line through the console script's entry point, then reports what it loaded
PARSE_ONLY = """
import sys
{prelude}
from endo_retrieval.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
heavy = sorted({"torch", "transformers"} & set(sys.modules))
print(f"exit={code} heavy={heavy}", file=sys.stderr)
"""
# commands whose arguments live in modules that import torch at the top (outside the CLI package)
HEAVY_HELP = {"train-sae", "train-phi", "calibrate-ilre", "calibrate-heads", "calibrate-pipeline", "calibrate-fusion"}


def parse(*argv: str, prelude: str = "") -> str:
    done = subprocess.run([sys.executable, "-c", PARSE_ONLY.replace("{prelude}", prelude), *argv], capture_output=True,
                          text=True, timeout=120)
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("argv", [["index", "--bogus"], ["index", "notes/"], ["query"], ["query", "ix"],
                                  ["compress", "--question", "q"], ["index", "x", "--out", "y", "--method", "magic"],
                                  ["no-such-command"]])
def test_argument_errors_import_nothing_heavy(argv):
    assert parse(*argv) == "exit=2 heavy=[]"


@pytest.mark.parametrize("command", [[]] + [[name] for name in sorted(set(COMMANDS) - HEAVY_HELP)])
def test_help_imports_nothing_heavy(command):
    assert parse(*command, "--help") == "exit=0 heavy=[]"


@pytest.mark.parametrize("command", sorted(HEAVY_HELP))
def test_help_of_the_calibration_commands_answers(command):
    assert parse(command, "--help").startswith("exit=0 ")  # they may import torch, but their arguments must parse


def test_the_check_sees_a_heavy_import():
    assert parse("index", "--bogus", prelude="import torch") == "exit=2 heavy=['torch']"
