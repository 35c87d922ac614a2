"""The documents hold together: every relative link in the README and docs/ points at a file or folder that exists
(and, with an anchor, at a heading there), every code file a document names exists, and every document under docs/ is
cited by something a reader reaches (the README, a doc, the code, the tests or the Makefile), by its path from the
repository root or from the citing file. The measurement records the documents stand on live in bench/results/;
tests/test_results.py holds them to the documents and to their manifest."""
from __future__ import annotations

import fnmatch
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# where the code, tests and build read or name a docs file (their text is searched for citations)
CODE = ["endo_retrieval", "kernels", "integrations", "bench", "examples", "tests", "tools", "Makefile",
        "pyproject.toml"]
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".venv", ".git", "build", ".cache", "bench-out"}
RECORDS = ROOT / "bench" / "results"  # measurement records, not code: they cite no document
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".ini", ".yml", ".yaml", ".json", ""}

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)=\"([^\"]+)\"", re.I)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def prose(text: str) -> str:
    """Markdown without fenced code blocks and inline code spans (a link inside code is not a link)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    body = prose(text)
    return [m.group(1) for m in LINK.finditer(body)] + [m.group(1) for m in REF_DEF.finditer(body)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, punctuation dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps only its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found = set(HTML_ANCHOR.findall(text))
    for m in HEADING.finditer(text):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings -1, -2, ...
    return found


def broken_links(md: Path) -> list[str]:
    bad = []
    for target in links(md.read_text(encoding="utf-8")):
        if not target or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if path and not dest.exists():
            bad.append(f"{md.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{md.relative_to(ROOT)}: {target} (no such heading)")
    return bad


def code_files() -> list[Path]:
    out = []
    for name in CODE:
        p = ROOT / name
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            for dirpath, dirnames, filenames in os.walk(p):
                if Path(dirpath).resolve() == RECORDS.resolve():
                    dirnames[:] = []
                    continue
                dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
                out += [Path(dirpath) / f for f in filenames if Path(f).suffix in TEXT_SUFFIXES]
    return [p for p in out if p.resolve() != Path(__file__).resolve()]  # this file's examples cite nothing


def cites(citer: Path, text: str, target: Path) -> bool:
    """`target` appears in `text` by its path from the repository root or from the citing file's folder."""
    forms = {target.relative_to(ROOT).as_posix(), Path(os.path.relpath(target, citer.parent)).as_posix()}
    return any(f in text and re.search(r"(?<![\w./-])" + re.escape(f) + r"(?![\w/-]|\.\w)", text) for f in forms)


def expand_braces(pattern: str) -> list[str]:
    """`run_{cpu,gpu}.json` -> [`run_cpu.json`, `run_gpu.json`] (the shell's brace expansion)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [e for alt in m.group(1).split(",") for e in expand_braces(pattern[:m.start()] + alt + pattern[m.end():])]


def glob_patterns(citer: Path, text: str) -> list[str]:
    """Paths with a wildcard or braces in `text` (`docs/perf/run*.md`, `docs/perf/run_{cpu,gpu}.json`), as absolute
    patterns: each cites every file it matches."""
    out = []
    for token in re.findall(r"[\w./{},*-]*[*{][\w./{},*-]*", text):
        for pattern in expand_braces(token):
            if "/" in pattern:
                out += [os.path.normpath(os.path.join(base, pattern)) for base in (ROOT, citer.parent)]
    return out


def glob_cites(citer: Path, text: str, target: Path) -> bool:
    return any(fnmatch.fnmatchcase(str(target), p) for p in glob_patterns(citer, text))


def uncited_docs() -> list[str]:
    """Files under docs/ that nothing a reader reaches cites. The roots are the README, the docs at the top of docs/
    and the code; a cited Markdown file under docs/ cites in turn (a result table citing its plot)."""
    targets = {p for p in DOCS.rglob("*") if p.is_file() and not set(p.relative_to(ROOT).parts) & SKIP_DIRS}
    texts = {p: p.read_text(encoding="utf-8", errors="replace") for p in targets if p.suffix == ".md"}
    roots = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *code_files()]
    queue = [(p, texts.get(p) or p.read_text(encoding="utf-8", errors="replace")) for p in roots]
    cited = set(p for p in roots if p in targets)
    while queue:
        citer, text = queue.pop()
        patterns = glob_patterns(citer, text)
        for target in targets - cited:
            if target != citer and (cites(citer, text, target)
                                    or any(fnmatch.fnmatchcase(str(target), p) for p in patterns)):
                for p in {target} | {c for c in targets - cited if companions(c, target)}:
                    cited.add(p)
                    if p in texts:
                        queue.append((p, texts[p]))
    return sorted(p.relative_to(ROOT).as_posix() for p in targets - cited)


def companions(a: Path, b: Path) -> bool:
    """Written together by one bench run: `x.json` beside its table `x.md`, plots `x.query.png` / `x-kl.png` and
    per-question records `x.records.jsonl.gz` (a doc cites a run by one of them)."""
    stem_a, stem_b = a.name.split(".")[0], b.name.split(".")[0]
    return a.parent == b.parent and (stem_a == stem_b or stem_a.startswith(stem_b + "-")
                                     or stem_b.startswith(stem_a + "-"))


def test_relative_links_resolve():
    bad = [b for md in markdown_files() for b in broken_links(md)]
    assert not bad, "links that point nowhere:\n" + "\n".join(bad)


def named_code_files(md: Path) -> list[str]:
    """The `.py` files a document names in code spans (`methods/ilre.py`), each of which must exist in the repo."""
    return [tok for span in INLINE_CODE.finditer(FENCE.sub("", md.read_text(encoding="utf-8")))
            for tok in re.findall(r"(?<![\w/.-])([\w./-]+\.py)\b", span.group(0))]


def test_named_code_files_exist():
    have = {p.relative_to(ROOT).as_posix() for p in code_files() if p.suffix == ".py"}
    bad = [f"{md.relative_to(ROOT)}: {name}" for md in markdown_files() for name in named_code_files(md)
           if not any(h == name or h.endswith("/" + name) for h in have)]
    assert not bad, "code files a document names that do not exist:\n" + "\n".join(bad)


def test_every_docs_file_is_cited():
    orphans = uncited_docs()
    assert not orphans, "files under docs/ that nothing cites (cite them or delete them):\n" + "\n".join(orphans)


def test_slug_follows_github():
    assert slug("Compressing one long context: `endo` against BM25 on dev300") == \
        "compressing-one-long-context-endo-against-bm25-on-dev300"
    assert slug("ILRe: passkey recall past the trained window") == "ilre-passkey-recall-past-the-trained-window"
    assert slug("Expansion and k for head_dim 64 (layer 15, 2000 steps, held out)") == \
        "expansion-and-k-for-head_dim-64-layer-15-2000-steps-held-out"


def test_checks_can_fail(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    md = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# Only heading\n")
    md.write_text("[x](b.md#only-heading) [y](missing.md) [z](b.md#nowhere) `[c](code.md)` [w](https://e.org/x)\n")
    assert broken_links(md) == ["a.md: missing.md (no such file)", "a.md: b.md#nowhere (no such heading)"]
    citer, target = tmp_path / "c.md", tmp_path / "perf" / "x.json"
    assert cites(citer, "see (perf/x.json).", target)
    assert not cites(citer, "see perf/x.json.gz", target)
    assert not cites(citer, "see sub/perf/x.json", target)
    assert glob_cites(citer, "perf/x*.json", target) and not glob_cites(citer, "perf/y*.json", target)
    assert glob_cites(citer, "`perf/{y,x}.json`", target) and not glob_cites(citer, "perf/{y,z}.json", target)


def test_uncited_files_are_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "DOCS", tmp_path / "docs")
    (tmp_path / "docs" / "perf").mkdir(parents=True)
    (tmp_path / "README.md").write_text("Numbers: [results](docs/results.md).\n")
    (tmp_path / "docs" / "results.md").write_text("wrote `perf/run.json`; the old run is in perf/old.md\n")
    (tmp_path / "docs" / "perf" / "old.md").write_text("![plot](history.png)\n")  # a cited table cites its plot
    for name in ["run.json", "run.md", "run.query.png", "history.png", "orphan.json", "orphan.md", "run2.json"]:
        (tmp_path / "docs" / "perf" / name).write_text("{}")
    assert uncited_docs() == ["docs/perf/orphan.json", "docs/perf/orphan.md", "docs/perf/run2.json"]
