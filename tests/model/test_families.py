"""Model families (`model/families/`): the registry the loader, the command line and the errors read; and what a
family may ask of the rest, checked on tiny random models of registered families: layers that attend through
windows of their own (Qwen2 with `use_sliding_window`: the machinery Gemma 3 relies on), and ids every sequence must
begin with. Each read, stream and attention backend is held against one plain forward of the whole model, whose
masks are transformers' own. Also: the GGUF header read without the weights, and the memory check before loading."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import transformers

from conftest import plain_states

from endo_retrieval.attention import AttentionError, Dense, ReAttention
from endo_retrieval.attention.completion import Completion
from endo_retrieval.attention.prhs import PrHS
from endo_retrieval.model import families, memory
from endo_retrieval.model.backbone import SUPPORTED_FAMILIES, Backbone, BackboneError, UnsupportedModelError
from endo_retrieval.model.gguf_header import read_gguf_header
from endo_retrieval.model.locate import default_gguf
from endo_retrieval.model.reading import ask, ask_parts, read

from gguf_writer import write_header_only

TEXT = "The river bends twice before the old mill. Farmers sell apples on Sundays. " * 6
WINDOW = 16


def tiny(family: str, folder, **overrides) -> Backbone:
    """A random-weight model of a registered family, from its own `tiny_config`, with the default model's tokenizer."""
    tok = transformers.AutoTokenizer.from_pretrained(Backbone.default().folder)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(
        families.by_name(family).tiny_config(len(tok), **overrides)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return Backbone(folder, device="cpu")


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """Qwen2 with full attention in layers 0-1 and a 16-token sliding window in layers 2-3 (layer_types)."""
    return tiny("qwen2", tmp_path_factory.mktemp("windowed"), use_sliding_window=True, sliding_window=WINDOW,
                max_window_layers=2)


@pytest.fixture(scope="module")
def all_sliding(tmp_path_factory):
    """Qwen2 whose two layers both attend through a 16-token window."""
    return tiny("qwen2", tmp_path_factory.mktemp("sliding"), layers=2, use_sliding_window=True, sliding_window=WINDOW,
                max_window_layers=0)


# ---------------------------------------------------------------- the registry


def test_every_family_is_one_module_and_the_loader_lists_them():
    assert SUPPORTED_FAMILIES == families.names() and {"llama", "mistral", "qwen2", "qwen3"} <= set(families.names())
    for f in families.registered():
        assert families.by_model_type(f.model_types[0]) is f and families.by_name(f.name) is f
        assert all(families.by_gguf_architecture(a) is f for a in f.gguf_architectures)
        assert getattr(transformers, f.config_class)  # its tiny test models can be made
    assert families.by_model_type("gpt2") is None and families.by_gguf_architecture("phi3") is None


def test_an_unknown_gguf_family_fails_at_once_naming_it_and_the_supported_ones(tmp_path):
    gguf = write_header_only(tmp_path / "phi-3.gguf", "phi3")
    start = time.perf_counter()
    with pytest.raises(UnsupportedModelError, match="'phi3' is not supported.*Supported families: " +
                       ", ".join(families.names())):
        Backbone(gguf)
    assert time.perf_counter() - start < 5


def test_the_gguf_header_is_read_without_the_weights():
    header = read_gguf_header(default_gguf())
    assert header.architecture == "llama" and 130e6 < header.n_parameters < 140e6  # SmolLM2-135M
    assert len(header.metadata["tokenizer.ggml.tokens"]) == 49152
    assert "tokenizer.ggml.tokens" not in read_gguf_header(default_gguf(), keep=()).metadata


def test_a_model_too_large_for_the_memory_fails_before_loading(windowed, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 << 20)  # 1 MiB free
    loads = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(a))
    with pytest.raises(memory.InsufficientMemoryError, match=r"needs about 0\.\d GiB of host memory to load .*"
                       r"M parameters x 4 bytes in float32.*0\.0 GiB is free"):
        Backbone(windowed.folder, device="cpu")
    assert loads == []  # refused before any weight was read
    monkeypatch.setenv("ENDO_SKIP_MEMORY_CHECK", "1")
    memory.check_fits("m", 10 ** 12, torch.float32, "cpu")  # skipped


# ---------------------------------------------------------------- windows of their own


def test_windows_come_from_the_config(windowed, all_sliding):
    assert windowed.windows == (None, None, WINDOW, WINDOW) and all_sliding.windows == (WINDOW, WINDOW)
    assert windowed.info()["windows"] == [None, None, WINDOW, WINDOW]
    assert not windowed.layout.window_binds(WINDOW) and windowed.layout.window_binds(WINDOW + 1)


def test_reads_and_query_parts_keep_each_layer_to_its_window(windowed):
    """A context longer than the window, read in one segment, then asked, alone and in batches: the states of one
    plain forward over context + query, whose sliding layers transformers masks itself."""
    bb = windowed
    ids, query = bb.encode(TEXT).ids, bb.encode("Question: where do farmers sell apples?").ids
    null = bb.encode("Question: N/A").ids
    assert len(ids) > 4 * WINDOW
    for layer in (1, 3):  # a full layer (it reads sliding layers' outputs only if deeper) and a sliding one
        keys, queries = plain_states(bb, np.concatenate([ids, query]), layer)
        reading = read(bb, ids, [layer])
        torch.testing.assert_close(reading.segments[0].keys[layer].float(), keys[:, :len(ids)], rtol=1e-4, atol=1e-4)
        asked = ask(bb, reading, query, [layer])
        torch.testing.assert_close(asked[0][layer], queries[:, len(ids):], rtol=1e-4, atol=1e-4)
        # the query parts behind the read in its own forward, and behind its cache: the plain `ask`'s queries
        together = read(bb, ids, [layer], parts=[query, null])
        got = ask_parts(bb, together, [query, null], [layer])
        torch.testing.assert_close(got[0][0][layer], asked[0][layer], rtol=1e-4, atol=1e-4)
        again = ask_parts(bb, reading, [query, null], [layer])
        torch.testing.assert_close(again[0][0][layer], asked[0][layer], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(again[1][0][layer], ask(bb, reading, null, [layer])[0][layer], rtol=1e-4,
                                   atol=1e-4)


def test_a_sink_window_stream_keeps_sliding_layers_to_their_window(windowed, all_sliding):
    bb = windowed
    ids = bb.encode(TEXT).ids[:200]
    full = plain_states(bb, ids, 3)[0]
    # a frame that holds the whole history is one causal pass, with the sliding layers' masks by stream position
    chunks = list(bb.stream(ids, [3], chunk_size=32, mode="sink_window", sink=4, window=len(ids)))
    got = torch.cat([bb.apply_rope(c.keys[3], c.rope_positions, 3) for c in chunks], 1)
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)
    # every layer sliding, a frame shorter than the window: the sink lies 20+ positions behind the chunk, out of
    # every layer's reach, so the chunk's keys are those of the window and the chunk read alone (transformers'
    # masks by index in the frame would let the chunk see the sink)
    bb = all_sliding
    for c in list(bb.stream(ids, [1], chunk_size=32, mode="sink_window", sink=4, window=4))[1:]:
        alone = plain_states(bb, ids[c.start - 4:c.end], 1, rotated=False)[0]  # pre-RoPE: frame positions differ
        torch.testing.assert_close(c.keys[1], alone[:, 4:], rtol=1e-4, atol=1e-4)
    with pytest.raises(BackboneError, match="frames='cache'.*windows of their own.*Use frames='recompute'"):
        list(bb.stream(ids, [1], chunk_size=32, mode="sink_window", window=20, frames="cache"))


def test_dense_and_reattention_decode_as_the_model_does_and_the_others_are_refused(windowed):
    bb = windowed
    ids = bb.chat_ids("Where do farmers sell apples? " * 6)[0]
    assert len(ids) > 2 * WINDOW
    with torch.inference_mode():
        want = bb.model.generate(ids[None], max_new_tokens=8, do_sample=False,
                                 attention_mask=torch.ones_like(ids)[None], pad_token_id=0)[0, len(ids):].tolist()
    assert list(Dense(chunk_size=8).generate_ids(bb, ids, 8)) == want
    # the full layers' selection covers their whole past (one pick widened by a span longer than the middle), the
    # sliding layers attend within their window: the model's own attention
    covering = ReAttention(chunk_size=8, global_size=4, local_size=16, span=1024, top_k_prime=1, window=2048)
    assert list(covering.generate_ids(bb, ids, 8)) == want
    for backend, why in ((PrHS(), "PSAW"), (Completion(), "anchors and a mid region")):
        with pytest.raises(AttentionError, match=f"windows of different lengths.*{why}.*attention=None"):
            backend.setup(bb)


# ---------------------------------------------------------------- ids every sequence begins with


@pytest.fixture
def prefixed(windowed, monkeypatch):
    """The windowed model told that every sequence begins with one id (as Gemma's begin with <bos>)."""
    monkeypatch.setattr(windowed, "prefix", [7])
    return windowed


def test_a_prefix_begins_every_read_and_chunk_without_being_handed_out(prefixed):
    bb = prefixed
    ids, query = bb.encode(TEXT).ids, bb.encode("Question: where do farmers sell apples?").ids
    keys, queries = plain_states(bb, np.concatenate([[7], ids, query]), 3)
    reading = read(bb, ids, [3])
    assert reading.segments[0].n_tokens == len(ids) and reading.segments[0].cached == len(ids) + 1
    torch.testing.assert_close(reading.segments[0].keys[3].float(), keys[:, 1:len(ids) + 1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ask(bb, reading, query, [3])[0][3], queries[:, len(ids) + 1:], rtol=1e-4, atol=1e-4)
    together = ask_parts(bb, read(bb, ids, [3], parts=[query]), [query], [3])
    torch.testing.assert_close(together[0][0][3], queries[:, len(ids) + 1:], rtol=1e-4, atol=1e-4)
    # an independent chunk is its own sequence: the prefix, then the chunk
    chunk = list(bb.stream(ids[:40], [3], chunk_size=40))[0]
    assert chunk.rope_positions.tolist() == list(range(1, 41))
    torch.testing.assert_close(bb.apply_rope(chunk.keys[3], chunk.rope_positions, 3),
                               plain_states(bb, np.concatenate([[7], ids[:40]]), 3)[0][:, 1:], rtol=1e-4, atol=1e-4)


def test_calibration_puts_the_heads_of_layers_that_see_the_whole_read_first(windowed):
    """Haystacks longer than the window: the eight heads kept are the two full layers' (QRHead's ranking decides
    the order within each group; the sliding layers' heads come after, whatever they score)."""
    from endo_retrieval.calibration.datasets import Example
    from endo_retrieval.calibration.heads import calibrate

    context = TEXT + "The vault combination is 4417, said the caretaker. " + TEXT
    examples = [Example(str(i), q, ["x"], context, ["The vault combination is 4417, said the caretaker."])
                for i, q in enumerate(["What is the vault combination?", "Who told the combination?"])]
    assert len(windowed.encode(context).ids) > WINDOW
    profile, _ = calibrate(windowed, [(64, examples)], n_heads=8, top=2)
    assert sorted({layer for layer, _ in profile["heads"]}) == [0, 1] and len(profile["heads"]) == 8
