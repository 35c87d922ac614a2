"""EndoLLM and ChatEndo generate answers that end: a RAG-sized default max_new_tokens, the answer cut where it
repeats itself, transformers' repetition options passed through, streams that yield as tokens come, stop sequences
that stop the model, compress_to with its time in the response."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("langchain_core")

from conftest import make_tiny_model  # noqa: E402

LOOP = " The band played in Tulsa."
LONG_CONTEXT = " ".join(f"Fact {i}: the lighthouse number {i} stands on island {i * 7 % 101}." for i in range(300))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from endo_retrieval import Backbone

    return Backbone(make_tiny_model("llama", tmp_path_factory.mktemp("wrappers")), device="cpu")


@pytest.fixture
def looping(tiny, monkeypatch):
    """The tiny model, made to write LOOP over and over as a small model's greedy loop does."""
    from transformers import LogitsProcessorList

    ids = tiny.tokenizer.encode(LOOP, add_special_tokens=False)
    real = tiny.generate

    def generate(prompt_or_messages, max_new_tokens=64, stream=False, system=None, do_sample=False, attention=None,
                 **kw):
        start = tiny.chat_ids(prompt_or_messages, system).shape[1]

        def loop(input_ids, scores):
            scores = scores.clone()
            scores[:, ids[(input_ids.shape[1] - start) % len(ids)]] += 1e4
            return scores

        return real(prompt_or_messages, max_new_tokens, stream, system, do_sample, attention,
                    logits_processor=LogitsProcessorList([loop]), **kw)

    monkeypatch.setattr(tiny, "generate", generate)
    return tiny


def test_defaults_fit_a_rag_answer_and_stop_on_repeat():
    from langchain_endo import ChatEndo
    from llama_index.llms.endo import EndoLLM

    for cls in (EndoLLM, ChatEndo):
        fields = cls.model_fields
        assert fields["max_new_tokens"].default == 128 and fields["stop_on_repeat"].default == 8
        assert fields["repetition_penalty"].default == 1.0 and fields["no_repeat_ngram_size"].default == 0
        assert fields["compress_to"].default is None


def test_endo_llm_ends_a_looping_answer_in_complete_chat_and_streams(looping):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.endo import EndoLLM

    llm = EndoLLM(backbone=looping)
    response = llm.complete("Where did the band play?")
    assert response.text == LOOP.strip()
    info = response.additional_kwargs["generation"]
    assert info["stopped"] == "repeat" and info["new_tokens"] < 20 and info["prompt_tokens"] > 0
    streamed = list(llm.stream_complete("Where did the band play?"))
    assert len(streamed) > 3 and "".join(r.delta for r in streamed) == streamed[-1].text == response.text
    messages = [ChatMessage(role="user", content="Where did the band play?")]
    assert llm.chat(messages).message.content == response.text
    assert list(llm.stream_chat(messages))[-1].message.content == response.text
    assert EndoLLM(backbone=looping, stop_on_repeat=0, max_new_tokens=40).complete("Where?").text.count("Tulsa") > 4


def test_endo_llm_passes_the_repetition_options_and_compress_to(tiny):
    from llama_index.llms.endo import EndoLLM

    prompt = "Say it again and again."
    options = dict(repetition_penalty=1.5, no_repeat_ngram_size=2)
    assert EndoLLM(backbone=tiny, max_new_tokens=12, **options).complete(prompt).text == \
        tiny.generate(prompt, max_new_tokens=12, stop_on_repeat=8, **options)
    message = f"Context:\n{LONG_CONTEXT}\n\nQuestion: Where does lighthouse number 42 stand?"
    info = EndoLLM(backbone=tiny, max_new_tokens=2, compress_to=300, compress_method="bm25").complete(
        message).additional_kwargs["generation"]
    assert info["compressed_from"] > 2000 and info["prompt_tokens"] <= 300 and info["compress_s"] >= 0


def test_chat_endo_ends_a_looping_answer_and_streams_it(looping):
    from langchain_endo import ChatEndo

    chat = ChatEndo(backbone=looping)
    message = chat.invoke("Where did the band play?")
    assert message.content == LOOP.strip() and message.response_metadata["generation"]["stopped"] == "repeat"
    chunks = list(chat.stream("Where did the band play?"))
    assert "".join(c.content for c in chunks) == message.content and len(chunks) > 3
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert whole.content == message.content and whole.response_metadata["generation"]["stopped"] == "repeat"
    assert ChatEndo(backbone=looping, stop_on_repeat=0, max_new_tokens=40).invoke("Where?").content.count("Tulsa") > 4


def test_chat_endo_stop_sequence_stops_the_model(looping):
    from langchain_endo import ChatEndo

    calls = []
    handle = looping.model.register_forward_hook(lambda *a: calls.append(time.perf_counter()))
    try:
        message = ChatEndo(backbone=looping, stop_on_repeat=0, max_new_tokens=100).invoke("Where?", stop=["Tulsa"])
    finally:
        handle.remove()
    assert message.content == "The band played in "
    assert message.response_metadata["generation"]["stopped"] == "stop_sequence"
    assert len(calls) < 20  # the model stopped with the stream, not after 100 tokens


def test_chat_endo_passes_compress_to(tiny):
    from langchain_endo import ChatEndo

    message = f"Context:\n{LONG_CONTEXT}\n\nQuestion: Where does lighthouse number 42 stand?"
    out = ChatEndo(backbone=tiny, max_new_tokens=2, compress_to=300, compress_method="bm25").invoke(message)
    info = out.response_metadata["generation"]
    assert info["compressed_from"] > 2000 and info["prompt_tokens"] <= 300 and info["compress_s"] >= 0
