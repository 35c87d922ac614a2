"""Gemma 3 (`model/families/gemma3.py`): a tiny random Gemma 3 (a 16-token sliding window in two layers of three,
per-layer rotary embeddings, q/k norms, <bos> first) read, streamed and decoded as one plain forward of the whole
model does, with transformers' own masks; what it cannot run is refused with the reason. Then the real Gemma 3
270M file, where it is on disk (`bash ../shared/tools/real-models.sh get gemma-3-270m`)."""
from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from conftest import plain_states

from endo_retrieval.attention import AttentionError, Dense, ReAttention
from endo_retrieval.attention.completion import Completion
from endo_retrieval.attention.prhs import PrHS
from endo_retrieval.methods.heads import rank_passages
from endo_retrieval.methods.ilre import ILRe, ILReError
from endo_retrieval.model import families, memory
from endo_retrieval.model.backbone import Backbone, BackboneError
from endo_retrieval.model.reading import ask, ask_parts, read

TEXT = "The river bends twice before the old mill. Farmers sell apples on Sundays. " * 6
FULL_LAYER, SLIDING_LAYER = 2, 3
REAL = sorted(Path.home().glob(".cache/endo-models/gemma-3-270m*.gguf"))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    tok = transformers.AutoTokenizer.from_pretrained(Backbone.default().folder)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(families.by_name("gemma3").tiny_config(len(tok))).save_pretrained(
        folder)
    tok.save_pretrained(folder)
    return Backbone(folder, device="cpu")


def test_gemma3_is_registered_by_its_config_and_gguf_names():
    family = families.by_name("gemma3")
    assert families.by_model_type("gemma3_text") is family and families.by_model_type("gemma3") is family
    assert families.by_gguf_architecture("gemma3") is family


def test_it_loads_with_its_windows_rotations_and_bos(gemma):
    bb = gemma
    assert bb.family == "gemma3" and bb.windows == (16, 16, None, 16) and bb.prefix == [bb.tokenizer.bos_token_id]
    x = torch.randn(1, 5, bb.head_dim)
    # sliding layers rotate with base 10k, full ones with 1M: the same at position 0, apart further on
    local, glob = (bb.apply_rope(x, torch.arange(5), layer) for layer in (SLIDING_LAYER, FULL_LAYER))
    torch.testing.assert_close(local[:, 0], glob[:, 0])
    assert not torch.allclose(local[:, 1:], glob[:, 1:])
    stacked = bb.layout.apply_rope_layers(torch.stack([x, x]), [FULL_LAYER, SLIDING_LAYER], torch.arange(5))
    torch.testing.assert_close(stacked[0], glob) and torch.testing.assert_close(stacked[1], local)


def test_ilre_refuses_a_sliding_layer_as_l_r_and_names_the_global_ones(gemma):
    with pytest.raises(ILReError, match="layer 1 .* 16-token sliding window.* use one of layers 2"):
        ILRe(backbone=gemma, layer=1)
    assert ILRe(backbone=gemma, layer=FULL_LAYER).layer == FULL_LAYER


def test_reads_and_query_parts_are_the_models_own_states(gemma):
    """<bos>, then the context (longer than the window), then the question: the reading's keys and the questions'
    queries, alone and in batches, at a full and a sliding layer, are one plain forward's."""
    bb = gemma
    ids, query = bb.encode(TEXT).ids, bb.encode("Question: where do farmers sell apples?").ids
    null = bb.encode("Question: N/A").ids
    assert len(ids) > 4 * 16
    for layer in (FULL_LAYER, SLIDING_LAYER):
        keys, queries = plain_states(bb, np.concatenate([bb.prefix, ids, query]), layer)
        reading = read(bb, ids, [layer])
        torch.testing.assert_close(reading.segments[0].keys[layer].float(), keys[:, 1:len(ids) + 1], rtol=1e-4,
                                   atol=1e-4)
        asked = ask(bb, reading, query, [layer])
        torch.testing.assert_close(asked[0][layer], queries[:, len(ids) + 1:], rtol=1e-4, atol=1e-4)
        together = ask_parts(bb, read(bb, ids, [layer], parts=[query, null]), [query, null], [layer])
        torch.testing.assert_close(together[0][0][layer], asked[0][layer], rtol=1e-4, atol=1e-4)
        behind = ask_parts(bb, reading, [query, null], [layer])
        torch.testing.assert_close(behind[0][0][layer], asked[0][layer], rtol=1e-4, atol=1e-4)


def test_streamed_chunks_begin_with_bos_and_keep_each_layer_to_its_window(gemma):
    bb = gemma
    ids = bb.encode(TEXT).ids[:150]
    chunk = next(iter(bb.stream(ids[:40], [SLIDING_LAYER], chunk_size=40)))  # an independent chunk: <bos> + chunk
    torch.testing.assert_close(bb.apply_rope(chunk.keys[SLIDING_LAYER], chunk.rope_positions, SLIDING_LAYER),
                               plain_states(bb, np.concatenate([bb.prefix, ids[:40]]), SLIDING_LAYER)[0][:, 1:],
                               rtol=1e-4, atol=1e-4)
    # a frame that holds the whole past: one plain forward, each layer within its window
    full = plain_states(bb, np.concatenate([bb.prefix, ids]), SLIDING_LAYER)[0][:, 1:]
    chunks = list(bb.stream(ids, [FULL_LAYER, SLIDING_LAYER], chunk_size=32, mode="sink_window", window=len(ids)))
    got = torch.cat([bb.apply_rope(c.keys[SLIDING_LAYER], c.rope_positions, SLIDING_LAYER) for c in chunks], 1)
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)
    with pytest.raises(BackboneError, match="frames='cache'.*gemma3 model cannot use.*frames='recompute'"):
        list(bb.stream(ids, [1], chunk_size=32, mode="sink_window", window=64, frames="cache"))


def test_generation_and_the_backends_that_hold_decode_as_the_model_does(gemma):
    bb = gemma
    ids = bb.chat_ids("Where do farmers sell apples? " * 6)[0]
    assert len(ids) > 2 * 16
    with torch.inference_mode():
        want = bb.model.generate(ids[None], max_new_tokens=8, do_sample=False,
                                 attention_mask=torch.ones_like(ids)[None], pad_token_id=0)[0, len(ids):].tolist()
    assert list(Dense(chunk_size=8).generate_ids(bb, ids, 8)) == want
    # one pick widened by a span longer than the middle: the full layers' selection is their whole past
    reattention = ReAttention(chunk_size=8, global_size=4, local_size=16, span=1024, top_k_prime=1, window=2048)
    assert list(reattention.generate_ids(bb, ids, 8)) == want
    assert isinstance(bb.generate("Where do farmers sell apples?", max_new_tokens=4), str)
    for backend, why in ((PrHS(), "PSAW"), (Completion(), "anchors and a mid region")):
        with pytest.raises(AttentionError, match=f"cannot run on .*gemma3.*windows of different lengths.*{why}"):
            backend.setup(bb)


def test_the_reranker_reads_passages_longer_than_the_window(gemma):
    passages = ["The vault combination is 4417, said the caretaker.", TEXT,
                "The research ship Albatross carries twelve scientists. Its home port is Gdansk."]
    scores = rank_passages(gemma, passages, "Where is the home port of the Albatross?",
                           heads=[(FULL_LAYER, 0), (SLIDING_LAYER, 1)])
    assert scores.shape == (3,) and np.isfinite(scores).all()


def test_a_multimodal_checkpoint_is_read_through_its_language_model(tmp_path):
    """4B and up ship as `Gemma3ForConditionalGeneration`: the family reads its language model (text only)."""
    tok = transformers.AutoTokenizer.from_pretrained(Backbone.default().folder)
    text = families.by_name("gemma3").tiny_config(len(tok))
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, image_token_index=len(tok) - 1)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    bb = Backbone(tmp_path, device="cpu")
    assert type(bb.model).__name__ == "Gemma3ForConditionalGeneration" and bb.windows == (16, 16, None, 16)
    ids, query = bb.encode(TEXT).ids, bb.encode("Question: where do farmers sell apples?").ids
    queries = plain_states(bb, np.concatenate([bb.prefix, ids, query]), SLIDING_LAYER)[1]
    got = ask_parts(bb, read(bb, ids, [SLIDING_LAYER], parts=[query]), [query], [SLIDING_LAYER])[0][0]
    torch.testing.assert_close(got[SLIDING_LAYER], queries[:, len(ids) + 1:], rtol=1e-4, atol=1e-4)
    assert isinstance(bb.generate("Where do farmers sell apples?", max_new_tokens=3), str)


# ---------------------------------------------------------------- the real file


@pytest.fixture(scope="module")
def real():
    if not REAL:
        pytest.skip("no Gemma 3 270M GGUF in ~/.cache/endo-models/: `bash ../shared/tools/real-models.sh get "
                    "gemma-3-270m` downloads it (253 MB); the tiny model above checks the same code")
    return Backbone(REAL[0], device="cpu", dtype=torch.float32)


@pytest.mark.slow
def test_the_real_file_loads_with_its_tokenizer_windows_and_end_of_turn(real):
    assert real.family == "gemma3" and real.n_layers == 18 and (real.n_heads, real.n_kv_heads) == (4, 1)
    assert real.windows == ((512,) * 5 + (None,)) * 3 and real.prefix == [2]
    assert real.encode("Hello world, the capital").ids.tolist() == [9259, 1902, 236764, 506, 5279]  # words, not chars
    assert 106 in real.eos_ids()  # <end_of_turn>
    assert real.tokenizer.decode(real.chat_ids("Hi")[0]).startswith("<bos><start_of_turn>user\nHi<end_of_turn>")
    ids = torch.as_tensor([2, *real.encode("Question: What is the capital of France?\nAnswer:").ids])[None]
    with torch.inference_mode():
        out = real.model.generate(ids, max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(ids))
    assert "Paris" in real.decode(out[0, ids.shape[1]:])


@pytest.mark.slow
def test_a_real_read_past_the_window_is_the_models_own(real):
    """2,000 tokens read, then a question: the states of one plain forward at a global and a sliding layer."""
    text = (Path(__file__).resolve().parents[2].parent / "shared" / "data" / "wikitext2" / "test.txt")
    if not text.exists():
        pytest.skip(f"{text} is absent (the project's shared data folder)")
    ids = real.encode(text.read_text()[:20000]).ids[:2000]
    query = real.encode("\n\nQuestion: Who is the subject of the article?\nAnswer:").ids
    for layer in (5, 9):  # global (the sixth), sliding
        keys, queries = plain_states(real, np.concatenate([real.prefix, ids, query]), layer)
        reading = read(real, ids, [layer], parts=[query])
        torch.testing.assert_close(reading.segments[0].keys[layer].float(), keys[:, 1:len(ids) + 1], rtol=1e-3,
                                   atol=1e-3)
        torch.testing.assert_close(ask_parts(real, reading, [query], [layer])[0][0][layer],
                                   queries[:, len(ids) + 1:], rtol=1e-3, atol=1e-3)


def test_a_real_file_too_large_for_the_memory_fails_before_its_conversion(tmp_path, monkeypatch):
    if not REAL:
        pytest.skip("no Gemma 3 270M GGUF in ~/.cache/endo-models/ (`bash ../shared/tools/real-models.sh get "
                    "gemma-3-270m`)")
    monkeypatch.setenv("ENDO_CACHE", str(tmp_path))
    monkeypatch.setattr(memory, "available_bytes", lambda device: 256 << 20)
    start = time.perf_counter()
    with pytest.raises(memory.InsufficientMemoryError, match=re.escape(REAL[0].name) + r" needs about 1\.1 GiB of "
                       r"host memory to convert \(268M parameters x 4 bytes in float32.*0\.2 GiB is free"):
        Backbone(REAL[0], device="cpu")
    assert time.perf_counter() - start < 10 and not any((tmp_path / "models").glob("*"))  # nothing converted
