"""The command line on the real default model: help, info contract, index/query/compress round trip, demo."""
import json

import pytest

from endo_retrieval.cli import COMMANDS, main

DOC_A = ("The Harbour Bridge was finished in 1932. Its granite came from a quarry near Moruya. "
         "Engineers tested the arch with seventy-two locomotives. ") * 3
DOC_B = ("Lodzite, a rare green mineral, was found in 1981 under the old stone bridge at Kelso. "
         "Collectors still search the riverbank after floods. ") * 3


def test_help_lists_every_command(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_unknown_method_is_a_clear_error(tmp_path, capsys):
    ctx = tmp_path / "c.txt"
    ctx.write_text(DOC_A)
    assert main(["compress", "--context", str(ctx), "--question", "q?", "--method", "magic"]) == 2
    assert "Unknown method 'magic'" in capsys.readouterr().err


@pytest.mark.slow
def test_info_json_contract(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"model", "model_hash", "layers", "device", "cache_dir", "sae", "ilre"} <= set(info)
    assert info["layers"] == 30 and info["model"] == "SmolLM2-135M-Instruct"
    sae = info["sae"]
    assert {"layers", "d_latent", "k", "fvu_k", "fvu_q", "dead_share"} <= set(sae)
    assert all(sae["fvu_k"][str(l)] <= 0.10 for l in sae["layers"])
    assert all(sae["dead_share"][str(l)] <= 0.05 for l in sae["layers"])
    assert isinstance(info["ilre"]["layer"], int) and info["ilre"]["recall"]


@pytest.mark.slow
def test_index_query_compress_round_trip(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "bridge.txt").write_text(DOC_A)
    (docs / "mineral.md").write_text(DOC_B)
    (docs / "skip.bin").write_bytes(b"\x00\x01")  # not a text suffix: ignored
    assert main(["index", str(docs), "--out", str(tmp_path / "ix")]) == 0
    assert "indexed 2 document(s)" in capsys.readouterr().out
    assert main(["query", str(tmp_path / "ix"), "Which mineral was found under the bridge?", "--k", "2",
                 "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert len(hits) == 2 and any("Lodzite" in h["text"] for h in hits)
    for h in hits:  # offsets point into the source file
        src = (docs / h["doc_id"].split("/")[-1]).read_text()
        assert src[h["char_start"]:h["char_end"]] == h["text"]
    ctx = tmp_path / "ctx.txt"
    ctx.write_text(DOC_A + DOC_B)
    assert main(["compress", "--context", str(ctx), "--question", "Which mineral was found?", "--budget", "40",
                 "--method", "bm25", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_tokens"] <= 40 and "Lodzite" in out["text"]
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    assert main(["compress", "--context", str(bad), "--question", "q?"]) == 2
    assert "cannot be read as text: binary" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_shows_evidence_and_an_answer(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    for method in ("s3-hybrid", "bm25", "s3", "endo (the default)"):
        assert f"--- {method}:" in out
    assert "local model's answer from the endo evidence" in out
    assert "local model's answer from the s3-hybrid evidence" in out
    # two rounds of BM25 find both hops of the built-in task (the second by the founder's name)
    assert "--- bm25: 2/2 gold sentences, answer found" in out
