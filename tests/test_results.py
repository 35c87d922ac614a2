"""The measurement records under bench/results/ and their manifest hold together: every record is cited by a document
section (README.md or docs/), every record a document cites is present, and bench/results/MANIFEST.json lists each
record once with its command, commit, machine, date and the sections that cite it. After adding a record and citing
it, `python bench/results/manifest.py` writes the manifest again."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_manifest_module():
    spec = importlib.util.spec_from_file_location("results_manifest", ROOT / "bench" / "results" / "manifest.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


manifest = load_manifest_module()


def test_records_are_cited_present_and_listed():
    problems = manifest.problems()
    assert not problems, "bench/results/ and its manifest disagree:\n" + "\n".join(problems)


def test_manifest_entries_have_every_field():
    entries = json.loads(manifest.MANIFEST.read_text(encoding="utf-8"))["records"]
    for e in entries:
        assert set(e) >= {"path", "command", "commit", "machine", "date", "cited_by"}, e
        assert e["cited_by"] and all(c.startswith(("README.md", "docs/")) for c in e["cited_by"]), e


def test_checks_can_fail(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    results = tmp_path / "bench" / "results" / "perf"
    results.mkdir(parents=True)
    monkeypatch.setattr(manifest, "ROOT", tmp_path)
    monkeypatch.setattr(manifest, "RESULTS", tmp_path / "bench" / "results")
    monkeypatch.setattr(manifest, "MANIFEST", tmp_path / "bench" / "results" / "MANIFEST.json")
    (tmp_path / "README.md").write_text("# Top\n[numbers](docs/results.md)\n")
    (tmp_path / "docs" / "results.md").write_text(
        "# Results\n\n## Speed\n\nWrote [run](../bench/results/perf/run.json) and `bench/results/perf/gone.json`; "
        "the runs `bench/results/perf/ab_{a,b}.json`.\n")
    for name in ["run.json", "run.records.jsonl.gz", "ab_a.json", "ab_b.json", "orphan.json"]:
        (results / name).write_text("{}")
    cites = manifest.cited_by()
    assert cites["bench/results/perf/run.json"] == ["docs/results.md#speed"]
    assert cites["bench/results/perf/run.records.jsonl.gz"] == ["docs/results.md#speed"]  # with its run
    assert cites["bench/results/perf/ab_b.json"] == ["docs/results.md#speed"]
    assert cites["bench/results/perf/orphan.json"] == []
    problems = manifest.problems()
    assert "uncited record (cite it from a doc section or delete it): bench/results/perf/orphan.json" in problems
    assert "cited, but no such record: docs/results.md#speed: bench/results/perf/gone.json" in problems
    assert any(p.startswith("not in MANIFEST.json") for p in problems)


def test_a_rebuilt_command_writes_the_runs_json_whichever_of_its_files_is_listed():
    data = {"schema": "endo-bench-corpus/1", "config": {"data": "dev300.json", "systems": ["endo"]}}
    for record in ("bench/results/x/run.json", "bench/results/x/run.md", "bench/results/x/run.records.jsonl.gz"):
        assert manifest.command_from_config(record, data).endswith("--out bench/results/x/run.json")


def test_a_record_measured_again_is_seen_as_changed_since_its_entrys_commit():
    entries = json.loads(manifest.MANIFEST.read_text(encoding="utf-8"))["records"]
    entry = next(e for e in entries if e["path"].endswith(".json"))
    assert not manifest.changed_since(entry["path"], entry["commit"])
    first = manifest.subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.split()[0]
    assert not manifest.changed_since(entry["path"], first)  # a commit without the record: not "changed"
