"""Every file the library's code and help texts cite exists in the repository (a help text once cited a guide that
ships with no copy of the project)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# a path under docs/ or the measurement records' tree bench/results/ (globs allowed), or a top-level document such as
# README.md
CITED = re.compile(r"\b((?:docs|bench/results)/[\w./*{},-]*[\w*}]|[A-Z][A-Z_]*\.md)\b")


def cited_files(text: str) -> list[str]:
    return CITED.findall(text)


def exists(cited: str) -> bool:
    if "{" in cited:  # bench/results/perf/perf_{cpu,h100}.json: every alternative
        head, rest = cited.split("{", 1)
        options, tail = rest.split("}", 1)
        return all(exists(head + option + tail) for option in options.split(","))
    return any(ROOT.glob(cited)) if "*" in cited else (ROOT / cited).exists()


def test_the_citation_finder_sees_what_it_checks():
    found = cited_files('help="print JSON (the contract in GUIDE.md)"  # docs/papers.md, '
                        'bench/results/quality/x*.json, .txt/.md files')
    assert found == ["GUIDE.md", "docs/papers.md", "bench/results/quality/x*.json"]
    assert not exists("GUIDE.md") and exists("README.md") and exists("bench/results/quality/*.json")
    assert not exists("docs/quality/*.json")  # the records live in bench/results/, not in docs/


def test_every_cited_file_exists():
    missing = [f"{path.relative_to(ROOT)}: {cited}" for path in sorted((ROOT / "endo_retrieval").rglob("*.py"))
               for cited in cited_files(path.read_text(encoding="utf-8")) if not exists(cited)]
    assert not missing, "files the code cites that the repository does not hold:\n" + "\n".join(missing)
