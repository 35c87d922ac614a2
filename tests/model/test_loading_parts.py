"""Loading does no repeated work: a GGUF file is hashed once per state of the file. And `Backbone` is one face of
parts split by concern (tokens, layout, capture, chat, graphs) with a short public surface."""
from __future__ import annotations

import inspect
import os

import pytest

from endo_retrieval.model import locate
from endo_retrieval.model.backbone import Backbone


def test_a_gguf_file_is_hashed_once_per_size_and_time(tmp_path, monkeypatch):
    monkeypatch.setenv("ENDO_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    digest = locate.gguf_digest(gguf)
    assert digest == locate.file_sha256(gguf)

    def no_hashing(path):
        raise AssertionError("hashed again")

    monkeypatch.setattr(locate, "file_sha256", no_hashing)
    assert locate.gguf_digest(gguf) == digest  # read from the cache
    gguf.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 64)  # same size, new contents and time
    os.utime(gguf, ns=(1, 1))
    with pytest.raises(AssertionError, match="hashed again"):
        locate.gguf_digest(gguf)


def test_the_backbone_keeps_a_short_public_surface():
    public = [name for name, value in vars(Backbone).items()
              if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, (classmethod,
                                                                                           staticmethod, property)))]
    assert len(public) <= 15, public
    for name in ("default", "of", "random", "encode", "decode", "stream", "generate", "apply_rope", "info"):
        assert name in public  # what the docs and the adapters use


def test_the_parts_answer_for_the_backbone():
    from tiny import tiny_engine

    bb, _ = tiny_engine()
    assert bb.encode("The vault combination is 4417.").ids.tolist() == bb.tokens.encode(
        "The vault combination is 4417.").ids.tolist()
    assert bb.layers is bb.layout.layers and bb.decoder is bb.layout.decoder
    assert bb.layout.check_layers([1, 0, 1]) == [0, 1]
    assert bb.eos_ids() == bb.chat.eos_ids()
    with bb.run_to(1, [1], ("k",), projections_only=True) as store:
        bb.decoder(input_ids=bb.chat_ids("Hello")[:, :5])
        assert set(store["k"]) == {1}
    assert list(bb.layers) == list(bb.layout.spec.layers(bb.model))  # the full stack is back after the read
