"""Decode-time attention backends: dense against Hugging Face, ReAttention against dense, selection, bad input."""
from __future__ import annotations

import pytest
import torch

from endo_retrieval.attention import AttentionError, Dense, ReAttention, get_backend, installed
from endo_retrieval.model.backbone import BackboneError
from endo_retrieval.kernels.topk_attention import topk_scores_reference

PROMPT = ("Maple Street runs past the old mill, where the river bends twice before the bridge. " * 25
          + "\n\nThe lighthouse keeper's name is Orlanda Vesk. " + "Gulls circled the harbour all afternoon. " * 20
          + "\n\nWhat is the lighthouse keeper's name?")


def hf_greedy(bb, ids, n):
    eos = bb.eos_ids()
    with torch.inference_mode():
        mask = torch.ones(1, len(ids), dtype=torch.long, device=ids.device)
        out = bb.model.generate(ids.view(1, -1), max_new_tokens=n, do_sample=False, temperature=None, top_p=None,
                                top_k=None, attention_mask=mask,
                                pad_token_id=bb.tokenizer.eos_token_id, eos_token_id=sorted(eos))
    toks = out[0, len(ids):].tolist()
    return next((toks[:i] for i, t in enumerate(toks) if t in eos), toks)


def test_dense_backend_matches_hugging_face_on_every_family(tiny_backbone):
    ids = tiny_backbone.chat_ids("A short prompt for a tiny random model, long enough for two chunks.")[0]
    assert list(Dense(chunk_size=8).generate_ids(tiny_backbone, ids, 12)) == hf_greedy(tiny_backbone, ids, 12)
    assert "forward" not in tiny_backbone.model.model.layers[0].self_attn.__dict__  # uninstalled afterwards


def test_dense_and_covering_reattention_reproduce_hf_on_the_default_model(backbone):
    ids = backbone.chat_ids(PROMPT)[0]
    assert len(ids) > 600
    reference = hf_greedy(backbone, ids, 16)
    assert list(Dense(chunk_size=256).generate_ids(backbone, ids, 16)) == reference
    # a middle exists (global 32 + local 256 < prompt) and every selection covers it: one pick widened by a span
    # longer than the middle, so [global, selected, local] is the whole cache in order
    covering = ReAttention(global_size=32, local_size=256, span=1024, top_k_prime=1, chunk_size=128)
    assert list(covering.generate_ids(backbone, ids, 16)) == reference
    assert "Orlanda" in backbone.tokenizer.decode(reference)


class SinkAndLocalOnly(ReAttention):
    """The same scope with the middle never selected (StreamingLLM's view): the control for the test below."""

    def select(self, q, middle):
        return torch.zeros(0, dtype=torch.long, device=middle.device)


def test_a_narrow_reattention_scope_still_finds_the_needle(backbone):
    ids = backbone.chat_ids(PROMPT)[0]
    narrow = dict(global_size=4, local_size=64, span=8, top_k=1, top_k_prime=4, chunk_size=64)  # reads <= 100 keys
    found = backbone.tokenizer.decode(list(ReAttention(**narrow).generate_ids(backbone, ids, 16)))
    blind = backbone.tokenizer.decode(list(SinkAndLocalOnly(**narrow).generate_ids(backbone, ids, 16)))
    assert "Orlanda" in found  # the needle sits ~250 tokens before the local part: only selection reaches it
    assert "Orlanda" not in blind


def test_selection_finds_the_matching_key_and_respects_the_scope():
    torch.manual_seed(0)
    bb_free = ReAttention(global_size=4, local_size=16, span=8, top_k=2, top_k_prime=3, window=64)
    bb_free.local, bb_free.k_prime = 16, 3  # setup() without a model
    middle = torch.randn(2, 500, 16) * 0.1
    q = torch.randn(4, 3, 16)
    middle[1, 321] = q[2:].mean(dim=(0, 1)) * 10  # a key every query of heads 2-3 (kv head 1) aligns with
    chosen = bb_free.select(q, middle)
    assert 321 in chosen.tolist()
    assert torch.all(chosen[1:] > chosen[:-1])  # sorted, no duplicates
    assert len(chosen) <= 3 * 8
    span_around = chosen[(chosen >= 321 - 4) & (chosen < 321 + 4)]
    assert len(span_around) == 8  # widened to 8 neighbours


def test_backbone_generate_takes_an_attention_backend(backbone):
    text = backbone.generate(PROMPT, max_new_tokens=12, attention=get_backend("dense"))
    assert text == backbone.generate(PROMPT, max_new_tokens=12)
    pieces = list(backbone.generate(PROMPT, max_new_tokens=12, attention=ReAttention(local_size=512), stream=True))
    assert "".join(pieces).strip() == text  # 700 tokens fit in global + local: same as dense
    with pytest.raises(AttentionError, match="Unknown attention backend 'sparse'; known: dense, reattention"):
        get_backend("sparse")
    # the backbone does not know the backends by name: it says where the names live
    with pytest.raises(BackboneError, match=r"attention=get_backend\('dense'\)"):
        backbone.generate("hi", attention="dense")


def test_bad_reattention_settings_show_the_arithmetic(backbone):
    with pytest.raises(AttentionError, match=r"global 32 \+ k' 200 x span 32 \+ local 4096 = 10528 exceeds the "
                                             r"trained window 8192; use k' <= 127"):
        ReAttention(top_k_prime=200).setup(backbone)
    with pytest.raises(AttentionError, match="chunk_size 1024 > local 512"):
        ReAttention(local_size=512, chunk_size=1024).setup(backbone)
    rb = ReAttention()
    rb.setup(backbone)
    assert (rb.local, rb.k_prime) == (4096, 127)  # section 3.1's defaults at an 8k window


def test_a_model_without_rope_is_refused(tiny_backbone):
    rotary = tiny_backbone.model.model.rotary_emb
    try:
        tiny_backbone.model.model.rotary_emb = None
        with pytest.raises(AttentionError, match="no rotary position embedding"):
            with installed(tiny_backbone, get_backend("reattention")):
                pass
    finally:
        tiny_backbone.model.model.rotary_emb = rotary


def test_topk_twin_against_a_per_head_loop():
    torch.manual_seed(1)
    q, k = torch.randn(6, 5, 32), torch.randn(2, 300, 32)
    values, index = topk_scores_reference(q, k, 4)
    brute = torch.stack([q[h] @ k[h // 3].T for h in range(6)])  # query head h reads key head h // 3
    assert torch.allclose(values, brute.topk(4, dim=-1).values)
    assert torch.allclose(brute.gather(-1, index), values)


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and Triton (run on the device tool)")
@pytest.mark.parametrize("heads,kv_heads,dim,queries,keys,dtype", [(9, 3, 64, 512, 5000, torch.bfloat16),
                                                                   (32, 8, 128, 1, 70000, torch.float16),
                                                                   (4, 4, 64, 77, 129, torch.float32)])
def test_triton_topk_scores_agree_with_the_twin(heads, kv_heads, dim, queries, keys, dtype):
    from endo_retrieval.kernels.sae_topk import triton_available
    from endo_retrieval.kernels.topk_attention import topk_scores_triton

    if not triton_available():
        pytest.skip("Triton is not installed")
    torch.manual_seed(0)
    q = torch.randn(heads, queries, dim, device="cuda", dtype=dtype)
    k = torch.randn(kv_heads, keys, dim, device="cuda", dtype=dtype)
    values, index = topk_scores_triton(q, k, 4)
    ref_values, _ = topk_scores_reference(q, k, 4)
    exact = torch.einsum("htd,htkd->htk", q.float(), k.float().repeat_interleave(heads // kv_heads, 0)[
        torch.arange(heads, device="cuda")[:, None, None], index])  # true scores of the kernel's picks
    assert torch.allclose(values, exact, atol=2e-2, rtol=1e-3)  # the kernel's scores belong to its indices
    assert torch.allclose(values, ref_values, atol=2e-2, rtol=1e-3)  # and they are the top 4 (ties may reorder)
    assert torch.all(values[..., :-1] >= values[..., 1:])  # largest first


def _causal_attention_twin(q, k, v, scaling):
    """Every score written out: query i of T sees keys 0 .. N-T+i."""
    T, N = q.shape[1], k.shape[1]
    k, v = (x.float().repeat_interleave(q.shape[0] // x.shape[0], 0) for x in (k, v))
    scores = (q.float() @ k.transpose(1, 2)) * scaling
    seen = torch.arange(N, device=q.device)[None, :] <= torch.arange(N - T, N, device=q.device)[:, None]
    return scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.device, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the fused CUDA path needs a GPU (run on the device tool)")])])
@pytest.mark.parametrize("heads,kv_heads,queries,keys,dtype", [(9, 3, 512, 2048, torch.bfloat16),
                                                               (12, 2, 7, 300, torch.float32),
                                                               (4, 4, 1, 50, torch.float32)])
def test_causal_attention_against_its_twin(device, heads, kv_heads, queries, keys, dtype):
    from endo_retrieval.attention.base import causal_attention

    torch.manual_seed(0)
    q = torch.randn(heads, queries, 64, device=device, dtype=dtype)
    k, v = (torch.randn(kv_heads, keys, 64, device=device, dtype=dtype) for _ in range(2))
    got = causal_attention(q, k, v, 0.125).float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(got, _causal_attention_twin(q, k, v, 0.125), atol=tol, rtol=tol)


def test_bench_attention_writes_the_contract(tmp_path):
    import json

    from endo_retrieval.cli import main
    from conftest import make_tiny_model

    model = make_tiny_model("llama", tmp_path / "tiny")
    filler = tmp_path / "filler"
    filler.mkdir()
    (filler / "a.txt").write_text("The river bends twice before the bridge. Gulls circle the harbour. " * 40)
    out = tmp_path / "bench" / "att.json"
    assert main(["bench", "attention", "--data", f"passkey:{filler}", "--context-tokens", "300,600", "--depths", "2",
                 "--max-new-tokens", "3", "--model", str(model), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["schema"] == "endo-bench-attention/1"
    rows = {(r["attention"], r["context_tokens"]): r for r in result["rows"]}
    assert set(rows) == {(a, n) for a in ("dense", "reattention") for n in (300, 600)}
    assert rows[("reattention", 600)]["budget"] == 32 + 63 * 32 + 2048 == 4096  # 4096 window: local 2048, k' 63
    assert rows[("dense", 300)]["budget"] is None and rows[("dense", 300)]["n"] == 2
    assert {"accuracy", "attn_rel_l1", "latency_ms", "peak_mem_mb", "device"} <= set(rows[("dense", 300)])
    for row in rows.values():  # one score per example, in order, so backends pair; their mean is the accuracy
        assert len(row["scores"]) == row["n"] == 2 and sum(row["scores"]) / 2 == row["accuracy"]
        assert row["accuracy_ci"][0] <= row["accuracy"] <= row["accuracy_ci"][1]
    assert set(result["grid"]["reattention"]["600"]) == {"0.00", "1.00"}
    assert out.with_suffix(".png").stat().st_size > 0 and "| reattention | 4096 |" in out.with_suffix(".md").read_text()
    assert main(["bench", "attention", "--attention", "sparse", "--out", str(out)]) == 2  # unknown backend: listed

    # every finished example is a record; started again with the same settings, the bench reads them back instead of
    # generating again (a record edited here shows up in the row), and computes only a length it has not seen
    records = out.with_suffix(".records.jsonl")
    lines = records.read_text().splitlines()
    assert len(lines) == 1 + 8
    edited = json.loads(lines[1])
    edited["score"] = 0.25
    records.write_text("\n".join([lines[0], json.dumps(edited), *lines[2:]]) + "\n")
    assert main(["bench", "attention", "--data", f"passkey:{filler}", "--context-tokens", "300,600,400",
                 "--depths", "2", "--max-new-tokens", "3", "--model", str(model), "--out", str(out)]) == 0
    rows = {(r["attention"], r["context_tokens"]): r for r in json.loads(out.read_text())["rows"]}
    edited_row = rows[(edited["method"], edited["context_tokens"])]
    assert 0.25 in edited_row["scores"] and len(rows) == 6
    assert len(records.read_text().splitlines()) == 1 + 12
