"""Quiet by default: third-party logs, progress bars and warnings raised in library code are not shown, endo's own
warnings are; `--verbose` (before or after the command) shows everything."""
from __future__ import annotations

import logging
import os
import sysconfig
from pathlib import Path

import pytest

from endo_retrieval.cli import build_parser
from endo_retrieval.cli import verbosity
from endo_retrieval.cli.verbosity import configure, warning_printer

LIBRARY_FILE = str(Path(sysconfig.get_paths()["purelib"]) / "torch" / "serialization.py")
ENDO_FILE = str(Path(verbosity.__file__).parents[1] / "index" / "engine.py")


@pytest.mark.parametrize("argv, verbose", [(["info"], False), (["--verbose", "info"], True),
                                           (["info", "--verbose"], True), (["query", "DIR", "q"], False),
                                           (["query", "DIR", "q", "--verbose"], True)])
def test_verbose_goes_before_or_after_the_command(argv, verbose):
    assert build_parser().parse_args(argv).verbose is verbose


def test_quiet_drops_the_libraries_warnings_and_keeps_endos(capsys):
    for verbose in (False, True):
        show = warning_printer("query", verbose)
        show("a library's chatter", UserWarning, LIBRARY_FILE, 1)
        show("the question was cut", UserWarning, ENDO_FILE, 1)
        show("a user's script warns", UserWarning, "/home/me/script.py", 1)
        err = capsys.readouterr().err
        assert "endo query: warning: the question was cut" in err and "a user's script warns" in err
        assert ("a library's chatter" in err) is verbose


def test_quiet_silences_the_libraries_loggers_and_verbose_opens_endos(monkeypatch):
    names = ("transformers", "sentence_transformers", "endo_retrieval")
    before = {name: logging.getLogger(name).level for name in names}
    for name in (verbosity.VERBOSE_ENV, "TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    try:
        configure(False)
        assert logging.getLogger("transformers").level == logging.ERROR
        assert logging.getLogger("sentence_transformers").level == logging.ERROR
        configure(True)
        assert logging.getLogger("endo_retrieval").level == logging.INFO
        assert os.environ[verbosity.VERBOSE_ENV] == "1"  # model.locate.quiet_transformers then leaves them be
    finally:
        for name, level in before.items():
            logging.getLogger(name).setLevel(level)
