"""Every example runs end to end on the default model, offline, and its answer holds the expected fact."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXPECTED = {  # example -> (a package it needs, the fact its answer must contain)
    "llamaindex_query_engine.py": ("llama_index.core", "lodzite"),
    "llamaindex_vector_compress.py": ("sentence_transformers", "Gdansk"),
    "vector_store_rerank.py": ("sentence_transformers", "Gdansk"),
    "langchain_lcel.py": ("langchain_classic", "green"),
    "agent_tool.py": ("langchain.agents", "seven"),
    "llamaindex_evaluator.py": ("llama_index.core", "endo hit rate 1.000"),
}


def test_every_example_is_exercised():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_answers_with_the_expected_fact(name):
    needs, fact = EXPECTED[name]
    pytest.importorskip(needs)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # prove it needs no network
    out = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    answer = out.stdout.split("\nA: ")[-1]
    assert fact.lower() in answer.lower(), out.stdout
