"""The manifest of the measurement records under bench/results/: one entry per record with the command that wrote
it, the commit that holds it, the machine it ran on, the date, and the document sections that cite it.

    python bench/results/manifest.py          # writes bench/results/MANIFEST.json (run it after adding a record)
    python bench/results/manifest.py --check  # exits 1 where the manifest and the records disagree

A record belongs here when a document (README.md or a page under docs/) cites it: by its path from the repository
root (`bench/results/quality/x.json`), by a relative link, or by a pattern (`bench/results/perf/run_{cpu,gpu}.json`,
`bench/results/perf/run*.json`). A run's data goes with it: citing a bench's Markdown table `x.md` cites its JSON
`x.json`, and citing `x.json` cites its per-question records `x.records.jsonl[.gz]`. The fields `command`,
`machine` and `date` can be corrected by hand; writing the manifest again keeps them.
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
MANIFEST = RESULTS / "MANIFEST.json"
NOT_RECORDS = {"MANIFEST.json", "manifest.py", "README.md"}

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
# a path into the records' tree, possibly relative (../bench/results/...), with globs and braces
CITE = re.compile(r"(?:\.\./)*bench/results/[\w./*{},-]*[\w*}]")
MACHINES = [("h200", "NVIDIA H200"), ("h100", "NVIDIA H100 80GB HBM3"), ("cpu", "CPU")]


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def records() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file() and p.name not in NOT_RECORDS
                  and "__pycache__" not in p.parts)


def rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def expand_braces(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [e for alt in m.group(1).split(",") for e in expand_braces(pattern[:m.start()] + alt + pattern[m.end():])]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (as tests/test_docs.py computes it)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def sections(text: str) -> list[tuple[int, str]]:
    """(offset, anchor) of every heading outside code fences, GitHub's -1, -2 for repeats."""
    fences = [(m.start(), m.end()) for m in FENCE.finditer(text)]
    seen: dict[str, int] = {}
    out = []
    for m in HEADING.finditer(text):
        if any(a <= m.start() < b for a, b in fences):
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.append((m.start(), base if n == 0 else f"{base}-{n}"))
    return out


def citations() -> list[tuple[str, str, str]]:
    """(pattern from the repository root, citing document, its section) for every path into bench/results/."""
    out = []
    for doc in documents():
        text = doc.read_text(encoding="utf-8")
        heads = sections(text)
        for m in CITE.finditer(text):
            token = m.group(0).rstrip(".,")
            path = os.path.normpath(os.path.join(doc.parent, token)) if token.startswith("../") else \
                os.path.normpath(os.path.join(ROOT, token))
            anchor = next((a for off, a in reversed(heads) if off <= m.start()), "")
            where = rel(doc) + (f"#{anchor}" if anchor else "")
            for p in expand_braces(Path(path).relative_to(ROOT).as_posix()):
                out.append((p, rel(doc), where))
    return out


def run_of(record: str) -> list[str]:
    """The files whose citation cites `record` too: x.json for x.records.jsonl[.gz], x.md for x.json."""
    if ".records.jsonl" in record:
        return [record.split(".records.jsonl")[0] + ".json"]
    if record.endswith(".json"):
        return [record[:-5] + ".md"]
    return []


def cited_by(direct_only: bool = False) -> dict[str, list[str]]:
    """Each record -> the document sections citing it, directly or (unless `direct_only`) through its run."""
    recs = [rel(p) for p in records()]
    direct: dict[str, list[str]] = {r: [] for r in recs}
    for pattern, _doc, where in citations():
        for r in ([pattern] if pattern in direct else fnmatch.filter(recs, pattern) if "*" in pattern else []):
            if where not in direct[r]:
                direct[r].append(where)
    if direct_only:
        return direct
    out = {}
    for r in recs:
        found = list(direct[r])
        for other in run_of(r):
            for where in direct.get(other, []) + [w for o in run_of(other) for w in direct.get(o, [])]:
                if where not in found:
                    found.append(where)
        out[r] = found
    return out


def missing_citations() -> list[str]:
    """Paths into bench/results/ that a document names and that hold no record."""
    have = set(rel(p) for p in records()) | {rel(p) for p in RESULTS.rglob("*")}
    bad = []
    for pattern, doc, where in citations():
        ok = fnmatch.filter(sorted(have), pattern) if "*" in pattern else pattern in have
        if not ok:
            bad.append(f"{where}: {pattern}")
    return sorted(set(bad))


# --- the fields that come from the records and the docs ----------------------------------------------------------

def git_info(record: str) -> tuple[str, str]:
    out = subprocess.run(["git", "log", "--follow", "--diff-filter=AM", "-1", "--format=%H %cs", "--", record],
                         cwd=ROOT, capture_output=True, text=True).stdout.split()
    return (out[0], out[1]) if len(out) == 2 else ("", "")


def changed_since(record: str, commit: str) -> bool:
    """Whether the record's content differs from its version at `commit` (a record `commit` does not hold: no)."""
    before = subprocess.run(["git", "rev-parse", "-q", "--verify", f"{commit}:{record}"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    now = subprocess.run(["git", "hash-object", record], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return bool(before) and before != now


def load_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError, UnicodeDecodeError):
        return {}


def data_of(record: str) -> dict:
    """The JSON a record belongs to (itself, x.json for x.md and x.records.jsonl[.gz], x.json for its plots
    x-kl.png and x.query.png)."""
    folder, name = record.rsplit("/", 1)
    stem = folder + "/" + (name.split(".")[0].split("-")[0] if name.endswith(".png") else
                           name.split(".records.jsonl")[0] if ".records.jsonl" in name else name.rsplit(".", 1)[0])
    return load_json(ROOT / (stem + ".json"))


def section_text(where: str) -> str:
    """The body of a cited section (`docs/x.md#anchor`), up to the next heading."""
    doc, _, anchor = where.partition("#")
    text = (ROOT / doc).read_text(encoding="utf-8")
    heads = sections(text)
    for i, (off, a) in enumerate(heads):
        if a == anchor:
            return text[off:heads[i + 1][0] if i + 1 < len(heads) else len(text)]
    return ""


def machine(record: str, data: dict, where: list[str]) -> str:
    config = data.get("config") if isinstance(data.get("config"), dict) else {}
    for source in (config, data):
        if source.get("device_name"):
            name = str(source["device_name"])
            return "CPU (x86_64)" if name == "x86_64" else name
    name = Path(record).name.lower()
    for token, label in MACHINES:
        if re.search(rf"(^|[_.-]){token}([_.-]|$)", name):
            return label
    table = ROOT / (record.rsplit(".", 1)[0] + ".md")
    if table.exists():
        m = re.search(r"Device: ([^;\n]+)", table.read_text(encoding="utf-8", errors="replace"))
        if m:
            return m.group(1).strip()
    device = str(config.get("device") or data.get("device") or "")
    if device != "cpu":  # the GPU the citing paragraphs, else sections, name, where they name one kind
        stem = Path(record).name.split(".")[0]
        for scope in ("paragraph", "section"):
            named = set()
            for w in where:
                body = section_text(w)
                paragraphs = [para for para in re.split(r"\n\s*\n", body) if stem in para]
                texts = paragraphs if scope == "paragraph" else [body]
                named |= {label for text in texts for token, label in MACHINES[:2] if token.upper() in text}
            if len(named) == 1:
                return named.pop() + f" (as the citing {scope} says)"
    return {"cpu": "CPU", "cuda": "a GPU (which: the citing section)"}.get(device, "the citing section says")


def doc_commands() -> list[tuple[str, str]]:
    """(command, doc) for every command in the documents' code blocks, continuation lines joined."""
    out = []
    for doc in documents():
        for block in FENCE.finditer(doc.read_text(encoding="utf-8")):
            lines = block.group(0).splitlines()[1:-1]
            joined, cur = [], ""
            for line in lines:
                cur += line.rstrip("\\").rstrip() + " " if line.rstrip().endswith("\\") else line
                if not line.rstrip().endswith("\\"):
                    joined.append(re.sub(r"\s+", " ", cur.split("  #")[0]).strip())
                    cur = ""
            out += [(c, rel(doc)) for c in joined if c]
    return out


def command_from_docs(record: str, commands: list[tuple[str, str]]) -> str:
    targets = {record, *run_of(record)}
    if record.endswith(".png"):
        folder, name = record.rsplit("/", 1)
        targets.add(folder + "/" + name.split(".")[0].split("-")[0] + ".json")
    if record.endswith(".md"):
        targets.add(record[:-3] + ".json")
    for command, _doc in commands:
        for token in re.findall(r"bench/results/[\w./*{},-]+", command):
            for p in expand_braces(token):
                if any(fnmatch.fnmatchcase(t, p) for t in targets):
                    return command
    return ""


def command_from_config(record: str, data: dict) -> str:
    schema, config = str(data.get("schema", "")), data.get("config") or {}
    m = re.match(r"endo-bench-(\w+)/", schema)
    if not m or not isinstance(config, dict):
        return ""
    # the bench writes X.json with its table X.md and per-question X.records.jsonl beside it: --out names the JSON
    out = re.sub(r"(\.records\.jsonl(\.gz)?|\.md)$", ".json", record)
    args = [f"endo bench {m.group(1)}"]
    if config.get("model") and not str(config["model"]).startswith("SmolLM2-135M"):
        args.append(f"--model {Path(str(config['model'])).name}")
    for key, flag in (("data", "--data"), ("text", "--text")):
        if config.get(key):
            args.append(f"{flag} {config[key]}")
    for key, flag in (("systems", "--systems"), ("methods", "--methods"), ("sections", "--sections"),
                      ("context_tokens", "--context-tokens"), ("budget", "--budget"),
                      ("attention", "--attention"), ("limit", "--limit")):
        value = config.get(key)
        if value not in (None, [], ""):
            args.append(f"{flag} {','.join(map(str, value)) if isinstance(value, list) else value}")
    return " ".join(args + [f"--out {out}"])


def build(old: dict[str, dict] | None = None) -> list[dict]:
    old = old or {}
    commands = doc_commands()
    cites, direct = cited_by(), cited_by(direct_only=True)
    entries = []
    for record, where in cites.items():
        prev = old.get(record, {})
        data = data_of(record)
        # a record measured again since its entry was written gets the commit and date of its new version
        kept = prev.get("commit") and prev.get("date") and not changed_since(record, prev["commit"])
        commit, date = (prev["commit"], prev["date"]) if kept else git_info(record)
        command, source = prev.get("command"), prev.get("command_source")
        if not command:
            command, source = command_from_docs(record, commands), "the citing document"
            if not command:
                command, source = command_from_config(record, data), "rebuilt from the record's config"
            if not command:
                command, source = "", "the citing section describes it"
        entry = {"path": record, "command": command, "command_source": source, "commit": commit,
                 "machine": prev.get("machine") or machine(record, data, where), "date": date, "cited_by": where}
        if not direct[record]:
            entry["part_of"] = next(o for o in run_of(record) if direct.get(o) or cites.get(o))
        entries.append(entry)
    return entries


def read() -> list[dict]:
    return json.loads(MANIFEST.read_text(encoding="utf-8"))["records"] if MANIFEST.exists() else []


def write(entries: list[dict]) -> None:
    MANIFEST.write_text(json.dumps({
        "about": "One entry per measurement record under bench/results/: the command that wrote it, the commit that "
                 "holds it, the machine, the date (of that commit), and the document sections that cite it. "
                 "Written by `python bench/results/manifest.py`; tests/test_results.py holds it to the records.",
        "records": entries}, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def problems() -> list[str]:
    """What the test checks: every record cited, listed once and complete; every cited record present."""
    bad = [f"uncited record (cite it from a doc section or delete it): {r}"
           for r, where in cited_by().items() if not where]
    bad += [f"cited, but no such record: {c}" for c in missing_citations()]
    entries = read()
    listed = [e.get("path") for e in entries]
    recs = [rel(p) for p in records()]
    bad += [f"not in MANIFEST.json (run python bench/results/manifest.py): {r}" for r in recs if r not in listed]
    bad += [f"in MANIFEST.json, but no such record: {p}" for p in listed if p not in recs]
    bad += [f"listed twice in MANIFEST.json: {p}" for p in set(listed) if listed.count(p) > 1]
    cites = cited_by()
    for e in entries:
        if e.get("path") not in cites:
            continue
        for field in ("commit", "machine", "date"):
            if not e.get(field):
                bad.append(f"{e['path']}: no {field}")
        if not re.fullmatch(r"[0-9a-f]{40}", e.get("commit", "")):
            bad.append(f"{e['path']}: commit is not a commit id")
        if sorted(e.get("cited_by", [])) != sorted(cites[e["path"]]):
            bad.append(f"{e['path']}: cited_by is stale (run python bench/results/manifest.py)")
    return bad


if __name__ == "__main__":
    if "--check" in sys.argv[1:]:
        found = problems()
        print("\n".join(found) or "bench/results/MANIFEST.json agrees with the records")
        sys.exit(1 if found else 0)
    write(build({e["path"]: e for e in read()}))
    print(f"wrote {rel(MANIFEST)}: {len(records())} records")
