"""The README is for deciding: short, every figure in it linked to the docs section and the record that made it, and
its snippets run as written. docs/ holds documents only; the measurement records live in bench/results/
(tests/test_results.py holds them to their manifest).

Which README code blocks run: every ```python block, in a fresh interpreter of this environment, and every ```bash
block, with this environment's `endo` on PATH; both in an empty folder, offline. ```sh blocks (installing) and
```text blocks are not run."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 200
MAX_DOCS_FILES = 60

FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(([^)\s]+)\)")
# a measured figure: a decimal number, or a number with a unit of time, a percent sign or a times sign
FIGURE = re.compile(r"(?<![\w.-])\d[\d,]*(?:\.\d+)?(?:\s?(?:%|ms\b|s\b|x\b))|(?<![\w.-])\d+\.\d+(?![\w.])")


def blocks(lang: str) -> list[str]:
    return [body for tag, body in FENCE.findall(README.read_text(encoding="utf-8")) if tag == lang]


def figures_without_sources(text: str) -> list[str]:
    """Figures outside code and outside a link into docs/, or in a table cell / paragraph line with no link to a
    record under bench/results/."""
    bad = []
    for line in FENCE.sub("", text).splitlines():
        line = re.sub(r"\b95% (?:\w+ )?intervals?", "intervals", INLINE_CODE.sub("", line))  # a level, not a figure
        cells = line.split("|") if line.lstrip().startswith("|") else [line]
        for cell in cells:
            linked = [(m.group(1), m.group(2)) for m in LINK.finditer(cell)]
            bare = LINK.sub("", cell)
            bad += [f"not linked to a docs section: {f!r} in {cell.strip()[:80]!r}" for f in FIGURE.findall(bare)]
            for label, target in linked:
                if FIGURE.search(label):
                    if not re.match(r"docs/[\w/.-]+\.md#[\w-]+$", target):
                        bad.append(f"figure {label!r} links to {target}, not to a docs section")
                    if not any(t.startswith("bench/results/") for _, t in linked):
                        bad.append(f"figure {label!r} has no record linked beside it (bench/results/...)")
    return bad


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; at most {MAX_README_LINES} (move detail into docs/)"


def test_every_readme_figure_names_its_section_and_record():
    bad = figures_without_sources(README.read_text(encoding="utf-8"))
    assert not bad, "\n".join(bad)


def test_docs_hold_documents_only():
    files = [p for p in (ROOT / "docs").rglob("*") if p.is_file()]
    assert len(files) <= MAX_DOCS_FILES, f"docs/ holds {len(files)} files; at most {MAX_DOCS_FILES}"
    records = [p.relative_to(ROOT).as_posix() for p in files if p.suffix != ".md"]
    assert not records, "measurement records belong in bench/results/, not docs/:\n" + "\n".join(records)


def test_the_figure_check_can_fail():
    assert figures_without_sources("Recall rose to 66.0 points.")
    assert figures_without_sources("| [66.0](docs/results.md#x) |")  # no record beside it
    assert figures_without_sources("[23 ms](https://example.org) [rec](bench/results/a.json)")
    assert not figures_without_sources("| [66.0 / 81.8](docs/results.md#x) [rec](bench/results/a.json) |")
    assert not figures_without_sources("Qwen2.5-Coder-1.5B, `torch==2.13.0`, 20 candidates, recall@5, 95% intervals")


def snippet_env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}


def test_readme_has_snippets_to_run():
    assert len(blocks("python")) >= 3 and len(blocks("bash")) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_snippet_runs_as_written(index, tmp_path):
    code = blocks("python")[index]
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=snippet_env(), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, f"README python block {index}:\n{code}\n{out.stderr[-3000:]}"
    assert out.stdout.strip(), f"README python block {index} printed nothing"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(blocks("bash"))))
def test_bash_snippet_runs_as_written(index, tmp_path):
    code = blocks("bash")[index]
    out = subprocess.run(["bash", "-e", "-c", code], cwd=tmp_path, env=snippet_env(), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, f"README bash block {index}:\n{code}\n{out.stderr[-3000:]}"
    assert "quartz" in out.stdout, out.stdout
