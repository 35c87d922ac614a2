"""Attention-output error versus read budget [RCA Eq. 12-16, 51-54]: relative l1, entropy terciles, the
token-equivalent accounting against hand-computed numbers, replay through the backends, and the bench contract."""
from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import ShapeBackbone

from endo_retrieval.attention import Dense
from endo_bench.attention_error import (
    EPS, capture_window, completion_reads, dense_mid_entropy, entropy_terciles, measure, mid_entropy,
    phi_cache_tokens, relative_l1, replay, retrieved)


def test_relative_l1_is_zero_against_itself_and_matches_hand_numbers():
    out = torch.tensor([[1.0, -2.0, 3.0]])
    assert relative_l1(out, out).item() == 0.0
    # |1.5-1| + |-2-(-2)| + |2-3| = 1.5 over ||ref||_1 = 6 [RCA Eq. 53]
    assert relative_l1(torch.tensor([[1.5, -2.0, 2.0]]), out).item() == pytest.approx(1.5 / (6 + EPS))


def test_uniform_heads_are_high_entropy_and_one_hot_heads_low():
    n = 50
    uniform = torch.zeros(n)
    one_hot = torch.full((n,), -1e4)
    one_hot[7] = 0.0
    assert mid_entropy(uniform).item() == pytest.approx(1.0)
    assert mid_entropy(one_hot).item() == pytest.approx(0.0, abs=1e-9)
    # six heads: two one-hot, two half-peaked, two uniform -> terciles low, mid, high
    half = torch.full((n,), -1e4)
    half[:5] = 0.0
    heads = torch.stack([uniform, one_hot, half, one_hot, uniform, half])
    assert entropy_terciles(mid_entropy(heads)).tolist() == [2, 0, 1, 0, 2, 1]


def test_read_accounting_matches_the_papers_worked_numbers():
    # appendix D.5 (Qwen3: d_h = d_phi = 128): R = 64 + 1 = 65, N = 16384, f = 1% -> n = 164, k_topk 144, k_hyb 79
    assert phi_cache_tokens(128, 128) == 65
    assert retrieved(164) == 144 and retrieved(164, offset=65) == 79
    # section 6.4: n(3%) = 492 -> 439 hybrid tokens with d_phi 64 / d_h 128 (n_off = ceil(32.5) = 33)
    assert math.ceil(phi_cache_tokens(64, 128)) == 33 and retrieved(492, offset=33) == 439
    # one step after 3 decoded tokens, N = 1000, n = 100, d_phi = d_h = 64 (n_off 33): 4 + 16 + 3 + 47 + 33
    assert completion_reads(100, 1000, 3, 64, 64) == 4 + 16 + 3 + 47 + 33
    assert completion_reads(100, 1000, 3, None, 64) == 4 + 16 + 3 + 80  # Top-K: no fetch, K = 80
    assert completion_reads(52, 1000, 0, 64, 64) is None  # 52 < 4 + 16 + 33: the paper's '-'
    assert completion_reads(10 ** 6, 1000, 2.5, 64, 64) == 1000 + 2.5  # K covers M: no remainder, no fetch


def _window(bb, n_prefill=80, queries=4, seed=0):
    from endo_bench.attention_error import Window

    g = torch.Generator().manual_seed(seed)
    T = n_prefill + queries
    states = {l: [torch.randn(h, t, bb.head_dim, generator=g) * 2 for h, t in
                  ((bb.n_heads, queries), (bb.n_kv_heads, T), (bb.n_kv_heads, T))] for l in range(bb.n_layers)}
    return Window(q={l: s[0] for l, s in states.items()}, k={l: s[1] for l, s in states.items()},
                  v={l: s[2] for l, s in states.items()}, n_prefill=n_prefill, scaling=bb.head_dim ** -0.5)


def test_top_k_covering_every_token_has_zero_error_and_reads_the_whole_context():
    bb = ShapeBackbone()
    window = _window(bb)
    reference = replay(bb, Dense(), window)
    dense = measure(bb, window, reference, "dense", 80)
    assert dense.error.abs().max().item() == 0.0 and dense.read_tokens == 80 + 2.5  # mean keys per step (Q = 4)
    full = measure(bb, window, reference, "topk", 10 ** 6)
    assert full.error.max().item() < 1e-5 and full.read_tokens == dense.read_tokens
    narrow = measure(bb, window, reference, "topk", 30)  # K = 10 of the 60 mid tokens
    assert narrow.error.mean().item() > 1e-3 and narrow.read_tokens == 4 + 16 + 2.5 + 10


def test_prhs_reads_are_counted_per_head_and_step():
    bb = ShapeBackbone()
    window = _window(bb)
    reference = replay(bb, Dense(), window)
    # top_k = 60 - 8 - 32 = 20 middle keys (of 80 - 40 + t); the gate shut, no PSAW: every head retrieves
    from endo_bench.attention_error import _CountingPrHS

    backend = _CountingPrHS(top_k=20, tau=1.1, psaw=False, etf=False)
    replay(bb, backend, window)
    assert backend.stats["retrievals"] == bb.n_layers * bb.n_heads * 4
    assert backend.attended / backend.head_steps == 8 + 32 + 20
    assert backend.scored / backend.head_steps == sum(80 + t + 1 - 40 for t in range(4)) / 4  # visible middles
    got = measure(bb, window, reference, "prhs", 60)
    assert got.rho_hat is not None and 0 < got.rho_hat <= 1 and got.error.mean().item() > 0


def test_infeasible_budget_is_a_dash_not_a_crash():
    from endo_retrieval.attention.phi import PhiMaps

    bb = ShapeBackbone()
    window = _window(bb)
    maps = PhiMaps({"model_hash": "shape", "head_dim": 8, "n_heads": 4, "n_kv_heads": 2, "layers": [0, 1],
                    "d_phi": 16, "scaling": 8 ** -0.5, "length": None})
    got = measure(bb, window, replay(bb, Dense(), window), "topk+phi", 25, phi=maps)  # 25 < 4 + 16 + ceil(8.5)
    assert got.error is None and got.read_tokens is None and "smaller than the anchors" in got.note


def test_bench_error_rows_keep_the_contract(tmp_path):
    from conftest import make_tiny_model
    from endo_retrieval.cli import main

    model = make_tiny_model("llama", tmp_path / "tiny", layers=2)
    text = tmp_path / "text.txt"
    text.write_text("The river bends twice before the bridge. Gulls circle the harbour at dawn. " * 60)
    out = tmp_path / "att.json"
    assert main(["bench", "attention", "--measure", "error", "--attention", "dense,topk,prhs", "--context-tokens",
                 "200", "--budgets", "0.2,0.5", "--error-text", str(text), "--error-windows", "1",
                 "--error-queries", "3", "--model", str(model), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["schema"] == "endo-bench-attention/1"
    rows = {(r["variant"], r["budget"]): r for r in result["rows"]}
    assert set(rows) == {("dense", None), ("topk", 40), ("topk", 100), ("prhs", 40), ("prhs", 100)}
    base = {"attention", "context_tokens", "budget", "n", "accuracy", "attn_rel_l1", "latency_ms", "peak_mem_mb",
            "device"}
    added = {"variant", "task", "budget_fraction", "attn_rel_l1_by_entropy", "read_tokens", "scoring_tokens",
             "rho_hat"}
    assert all(base | added <= set(r) for r in result["rows"])
    assert rows[("dense", None)]["attn_rel_l1"] == 0.0 and rows[("topk", 40)]["attention"] == "completion"
    assert rows[("topk", 40)]["read_tokens"] == 40 + 2  # n exact reads + (Q + 1) / 2 decoded keys
    assert rows[("topk", 40)]["attn_rel_l1"] > rows[("topk", 100)]["attn_rel_l1"] > 0
    assert set(rows[("prhs", 40)]["attn_rel_l1_by_entropy"]) == {"low", "mid", "high"}
    assert "| topk |" in out.with_suffix(".md").read_text() and (tmp_path / "att_error.png").stat().st_size > 0


def test_bad_measure_is_refused(tmp_path, capsys):
    from endo_retrieval.cli import main

    assert main(["bench", "attention", "--measure", "speed", "--out", str(tmp_path / "a.json")]) == 2
    assert "--measure takes" in capsys.readouterr().err


@pytest.mark.slow
def test_default_model_window_replays_to_zero_error_for_dense(backbone):
    ids = torch.as_tensor(backbone.encode("Gulls circle the harbour at dawn. " * 60).ids[:300])
    window = capture_window(backbone, ids, 296)
    assert window.q[0].shape == (backbone.n_heads, 4, backbone.head_dim) and window.k[0].shape[1] == 300
    reference = replay(backbone, Dense(), window)
    assert measure(backbone, window, reference, "topk", 10 ** 6).error.max().item() < 1e-4
    entropy = dense_mid_entropy(backbone, window)
    assert entropy.shape == (backbone.n_layers, backbone.n_heads, 4) and 0 <= entropy.min() <= entropy.max() <= 1
