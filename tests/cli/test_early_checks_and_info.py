"""The command line checks its arguments before it loads a model (a fresh interpreter that parses and runs the
command must not import torch), `endo query --k 0` answers nothing at once as the adapters answer k=0, and plain
`endo info` is a short summary (`--json` keeps the full dict)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from endo_retrieval.cli import check_arguments
from endo_retrieval.cli.info import model_summary

ASSETS = Path(__file__).resolve().parents[2] / "endo_retrieval" / "assets"
# a fresh interpreter runs `endo ...` through main, then reports its exit status and whether torch was imported
RUN = """
import sys
from endo_retrieval.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
sys.stdout.flush()
print(f"exit={code} torch={'torch' in sys.modules}", file=sys.stderr)
"""


def endo(*argv: str) -> tuple[str, str, float]:
    """(stdout, last line of stderr, seconds) of `endo argv...` in a fresh interpreter."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", RUN, *argv], capture_output=True, text=True, timeout=120)
    return done.stdout, done.stderr.strip().splitlines()[-1], time.perf_counter() - start


@pytest.fixture
def index_dir(tmp_path) -> Path:
    """A folder that looks like an index to the argument checks (its header); nothing in it is ever loaded."""
    folder = tmp_path / "ix"
    folder.mkdir()
    (folder / "endo-index.json").write_text("{}")
    return folder


def test_query_k_zero_prints_nothing_and_exits_zero_before_the_model_loads(index_dir):
    out, status, seconds = endo("query", str(index_dir), "Where is the ship?", "--k", "0")
    assert (out, status) == ("", "exit=0 torch=False")
    out, status, _ = endo("query", str(index_dir), "Where is the ship?", "--k", "0", "--json")
    assert json.loads(out) == [] and status == "exit=0 torch=False"
    assert seconds < 10  # under a second on an idle machine; the bound leaves room for a busy test machine


@pytest.mark.parametrize("argv, message", [
    (["query", "{ix}", "q", "--k", "-1"], "--k must be a whole number >= 0"),
    (["query", "{ix}", "q", "--budget", "0"], "--budget must be a whole number >= 1"),
    (["query", "{ix}", "q", "--depth", "0"], "--depth must be a whole number >= 1"),
    (["query", "{ix}", "q", "--read-tokens", "4"], "--read-tokens must be a whole number >= 8"),
    (["query", "{ix}", "   "], "The question is empty"),
    (["query", "{missing}", "q"], "no such folder"),
    (["query", "{empty}", "q"], "holds no endo index"),
    (["query", "{ix}", "q", "--model", "{missing}.gguf"], "no such file or folder"),
    (["compress", "--context", "{missing}", "--question", "q"], "no such file"),
    (["compress", "--context", "{file}", "--question", "q", "--method", "magic"], "Unknown method 'magic'"),
    (["compress", "--context", "{file}", "--question", "q", "--budget", "0"], "--budget must be"),
    (["index", "{file}", "--out", "{missing}", "--workers", "0"], "--workers must be"),
    (["info", "--device", "gpu"], "--device must be cpu, cuda"),
    (["info", "--model", "not/a/model/path"], "no such file or folder"),
    (["demo", "--budget", "-5"], "--budget must be"),
])
def test_argument_errors_answer_before_anything_loads(argv, message, index_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "c.txt").write_text("Some text.")
    names = {"ix": index_dir, "missing": tmp_path / "missing", "empty": tmp_path / "empty",
             "file": tmp_path / "c.txt"}
    argv = [a.format(**names) for a in argv]
    done = subprocess.run([sys.executable, "-c", RUN, *argv], capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == "exit=2 torch=False"
    assert message in "\n".join(lines[:-1])


def test_the_checks_take_k_as_each_command_means_it():
    from argparse import Namespace

    assert check_arguments(Namespace(command="query", k=0)) is None
    assert "--k must be a whole number >= 0" in check_arguments(Namespace(command="query", k=-1))
    assert "--k must be a whole number >= 1" in check_arguments(Namespace(command="mcp", k=0))
    assert "--k must be a whole number >= 1" in check_arguments(Namespace(command="train-sae", k=0))  # SAE's top-k
    assert "--depths must be" in check_arguments(Namespace(command="calibrate-pipeline", depths=[10, 0]))
    assert check_arguments(Namespace(command="info", model="owner/name@main", device="cuda:1")) is None


# ---- endo info: a short summary -------------------------------------------------------------------------------------
MODEL = {"model": "SmolLM2-135M-Instruct", "model_hash": "b179c9523d0e6a0f98a3", "family": "llama", "layers": 30,
         "heads": 9, "kv_heads": 3, "head_dim": 64, "max_position": 8192, "device": "cpu", "dtype": "bfloat16",
         "cache_dir": "/home/me/.cache/endo-retrieval"}


def shipped(kind: str, name: str) -> dict:
    return json.loads((ASSETS / kind / name).read_text())


def check_short(lines: list[str]) -> str:
    text = "\n".join(lines)
    assert len(lines) <= 40 and len(text) <= 2500, text
    return text


def test_info_summary_of_the_shipped_artefacts_is_short_and_names_their_headline_figures():
    heads = shipped("heads", "smollm2-135m-instruct.json")
    sae = shipped("sae", "smollm2-135m-instruct/card.json")
    ilre = shipped("ilre", "smollm2-135m-instruct.json")
    data = {"families": ["llama", "mistral", "qwen2", "qwen3"], "sae": sae, "ilre": ilre, "heads": heads,
            "ready": ["bm25", "s3", "s3-hybrid", "ilre", "heads", "endo"]}
    text = check_short(model_summary(MODEL, data, heads, "/x/heads.json"))
    assert text.startswith("SmolLM2-135M-Instruct (llama family, hash b179c9523d0e)")
    for expected in ("30 layers, 9 heads (3 KV, head_dim 64), window 8,192 tokens", "cpu (bfloat16)",
                     "/home/me/.cache/endo-retrieval", "ready      bm25, s3, s3-hybrid, ilre, heads, endo",
                     f"{len(heads['heads'])} retrieval heads", f"depth {heads['pipeline']['depth']}",
                     f"CPU: depth {heads['pipeline']['cpu']['depth']}", "recall@2/@5/@10", "reranker   after minilm",
                     f"layers {', '.join(map(str, sae['layers']))}", f"ilre       layer {ilre['layer']}",
                     "endo info --json"):
        assert expected in text, expected


def test_info_summary_of_a_model_without_artefacts_says_how_to_make_them():
    model = MODEL | {"model": "my-model", "max_position": None}
    text = check_short(model_summary(model, {"families": ["llama"], "sae": None, "ilre": None, "heads": None,
                                             "ready": ["bm25"]}, None))
    for command in ("endo calibrate-heads", "endo train-sae", "endo calibrate-ilre"):
        assert f"`{command}`" in text
    assert "window" not in text


def test_info_summary_never_fails_on_a_profile_missing_its_figures():
    heads = {"heads": [[3, 1]], "fusion": {"weights": {"heads": 1.0}}, "pipeline": {"depth": 10},
             "reranker": {"bm25": {"first_stage": 0.5, "heads": 0.5}}}
    text = check_short(model_summary(MODEL, {"sae": {"layers": [3]}, "ilre": {"layer": 2}, "heads": heads}, heads))
    assert "1 retrieval heads in layers 3-3" in text and "pipeline   depth 10" in text


@pytest.mark.slow
def test_plain_info_is_at_most_40_lines_and_2500_characters_and_json_keeps_the_contract(capsys):
    from endo_retrieval.cli import main

    assert main(["info"]) == 0
    text = check_short(capsys.readouterr().out.rstrip("\n").splitlines())
    assert "SmolLM2-135M-Instruct" in text and "{" not in text  # no nested dicts
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"model", "model_hash", "layers", "device", "cache_dir", "families", "sae", "ilre", "heads",
            "ready"} <= set(info)
