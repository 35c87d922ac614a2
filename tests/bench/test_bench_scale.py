"""`endo bench scale` at a tiny size: a real index (the shared data, tokenised and embedded) and a synthetic one
with cells, each opened in its own process and measured; the JSON and the Markdown table come out."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "scifact").is_dir(), reason="needs ../shared/data")
def test_bench_scale_tiny(tmp_path, backbone):
    from endo_retrieval.cli import main

    out = tmp_path / "out"
    assert main(["bench", "scale", "--sizes", "40,1500", "--real-max", "40", "--questions", "4", "--whole", "1",
                 "--ann-min", "1000", "--work", str(tmp_path), "--out", str(out)]) == 0
    result = json.loads((out / "scale.json").read_text())
    real, synthetic = result["rows"]
    assert real["text"] == "real" and real["passages"] >= 40 and not real["cells"]
    assert synthetic["text"] == "synthetic" and synthetic["passages"] == 1500 and synthetic["cells"]
    for row in (real, synthetic):
        assert row["stage1_ms_p50"] > 0 and row["whole_ms_p50"] > 0 and row["whole_n"] == 1
        assert row["disk_embedding_bytes_per_passage"] == pytest.approx(1536, abs=10)  # 384 float32, and the header
        assert row["parts"]["corpus_offsets"] > 0 and row["parts"]["bm25_postings"] > 0
        assert row["update_docs"] >= 1 and row["update_s"] > 0 and row["rebuild_s"] > 0
    assert synthetic["parts"]["dense_cells"] > 0
    table = (out / "scale.md").read_text()
    assert "| 1,500 | synthetic |" in table and "| passages | text | build s |" in table
    assert not list(tmp_path.glob("tmp*/n*"))  # each size's indexes are deleted after it is measured
