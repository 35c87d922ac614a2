"""Generation that ends: the chat template's stop tokens, the answer cut where it repeats itself, transformers'
repetition processors over the answer only, streams that yield as tokens come and stop the model when closed, the
CPU's thread count, and long prompts compressed first (`compress_to`) with the time logged."""
from __future__ import annotations

import logging
import time

import pytest
import torch

import endo_retrieval.methods  # noqa: F401  registers compress_to's compressor (the methods sit above the model)
from endo_retrieval.model import generation
from endo_retrieval.model.generation import RepeatStop, answer_ids

from conftest import make_tiny_model


class WordTokenizer:
    """Token id i decodes to WORDS[i] (enough of a tokenizer for RepeatStop)."""

    WORDS = ["<eos>", "The", " band", " played", " in", " Tulsa", ".", " It", " was", " 2009", "\n", "Tulsa", " and",
             " Oklahoma"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.WORDS[i] for i in ids)

    def ids(self, text_tokens: str) -> list[int]:
        return [self.WORDS.index(w.replace("_", " ")) for w in text_tokens.split("|")]


def run_guard(guard: RepeatStop, tokens: list[int]) -> list[int]:
    """What answer_ids keeps of `tokens` under `guard`."""
    answer = []
    for t in tokens:
        answer.append(t)
        if (keep := guard.cut(answer)) is not None:
            return answer[:keep]
    keep = guard.finish(answer)
    return answer if keep is None else answer[:keep]


def test_repeat_stop_ends_a_looping_answer_before_the_repeat():
    tok = WordTokenizer()
    # "The band played in Tulsa.The band played in Tulsa...." as a model loops: the first sentence only
    looping = tok.ids("The|_band|_played|_in|_Tulsa|.") * 8
    for ngram in (3, 4, 6):
        assert tok.decode(run_guard(RepeatStop(tok, ngram=ngram), looping)) == "The band played in Tulsa."


def test_repeat_stop_cuts_a_repeated_short_sentence_and_keeps_an_answer_that_does_not_repeat():
    tok = WordTokenizer()
    # a sentence shorter than the run, repeated on its own line: the second is dropped when the third begins
    short = tok.ids("Tulsa|.|\n|Tulsa|.|\n|Tulsa|.")
    assert tok.decode(run_guard(RepeatStop(tok, ngram=8), short)) == "Tulsa.\n"
    # ... and at the end of decoding (finish) when it is the last sentence
    assert tok.decode(run_guard(RepeatStop(tok, ngram=8), tok.ids("Tulsa|.|\n|Tulsa|."))) == "Tulsa.\n"
    fine = tok.ids("The|_band|_played|_in|_Tulsa|.|_It|_was|_in|_Tulsa|_and|_Oklahoma|.")  # " in Tulsa" twice: short
    assert run_guard(RepeatStop(tok, ngram=4), fine) == fine
    with pytest.raises(ValueError, match="stop_on_repeat"):
        RepeatStop(tok, ngram=1)


def test_repeat_stop_drops_the_unfinished_sentence_a_repeat_began_in():
    tok = WordTokenizer()
    answer = tok.ids("The|_band|_played|_in|_Tulsa|.|_It|_played|_in|_Tulsa|.")  # " played in Tulsa." again
    assert tok.decode(run_guard(RepeatStop(tok, ngram=4), answer)) == "The band played in Tulsa."
    # a run that begins with the line breaks closing a sentence: that sentence stays
    lines = tok.ids("Tulsa|\n|\n|The|_band|_played|\n|\n|The|_band|_played")
    assert tok.decode(run_guard(RepeatStop(tok, ngram=5), lines)).strip() == "Tulsa\n\nThe band played"


def test_a_stream_keeps_what_it_showed_and_the_whole_answer_drops_the_unfinished_sentence():
    bb, tok = FakeBackbone(), WordTokenizer()
    looping = tok.ids("Tulsa|.|\n|The|_band|_played|_in|_Tulsa|_and") + tok.ids("_band|_played|_in|_Tulsa|_and") * 6
    whole = list(answer_ids(bb, iter(looping), RepeatStop(tok, ngram=4), {"prompt_tokens": 1}, stream=False))
    assert tok.decode(whole).strip() == "Tulsa."  # cut 10 tokens back, more than a stream holds
    shown = list(answer_ids(bb, iter(looping), RepeatStop(tok, ngram=4), {"prompt_tokens": 1}, stream=True))
    assert tok.decode(shown) == "Tulsa.\nThe band played in Tulsa and"  # what it had shown stays; no repeat


class FakeBackbone:
    device = torch.device("cpu")
    model_id = "fake"

    def __init__(self):
        self.tokenizer = WordTokenizer()

    def eos_ids(self):
        return {0}


def test_answer_ids_stop_at_a_stop_token_and_hold_back_what_a_repeat_may_take():
    bb, tok = FakeBackbone(), WordTokenizer()
    stats = {"prompt_tokens": 3}
    assert list(answer_ids(bb, iter(tok.ids("The|_band|<eos>|_played")), None, stats)) == tok.ids("The|_band")
    assert stats["stopped"] == "stop_token" and stats["new_tokens"] == 2 and "first_token_s" in stats
    stats = {"prompt_tokens": 3}
    looping = tok.ids("The|_band|_played|_in|_Tulsa|.") + tok.ids("The|_band|_played|_in|_Tulsa|.") * 5
    shown = []
    for token in answer_ids(bb, iter(looping), RepeatStop(tok, ngram=4), stats):
        shown.append(token)  # a stream: never a token of the repeat, though the first sentence came before it
    assert tok.decode(shown) == "The band played in Tulsa." and stats["stopped"] == "repeat"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from endo_retrieval import Backbone

    return Backbone(make_tiny_model("llama", tmp_path_factory.mktemp("gen")), device="cpu")


def test_stop_ids_hold_the_chat_templates_end_of_turn_token(tiny, monkeypatch):
    im_end = tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generation.end_of_turn_id(tiny.tokenizer) == im_end
    monkeypatch.setattr(tiny.model.generation_config, "eos_token_id", None)  # a conversion that names none
    assert im_end in tiny.eos_ids()


def ngrams(ids: list[int], n: int) -> list[tuple]:
    return [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]


class Loop:
    """A logits processor that makes the model write `ids` over and over (as a small model's greedy loop does)."""

    def __init__(self, ids: list[int], prompt_len: int, bias: float = 1e4):
        self.ids, self.prompt_len, self.bias = ids, prompt_len, bias

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.ids[(input_ids.shape[1] - self.prompt_len) % len(self.ids)]] += self.bias
        return scores


def test_stop_on_repeat_ends_the_greedy_answer_without_changing_it(tiny):
    from transformers import LogitsProcessorList

    prompt = "Where did the band play?"
    sentence = tiny.tokenizer.encode(" The band played in Tulsa.", add_special_tokens=False)
    loop = LogitsProcessorList([Loop(sentence, tiny.chat_ids(prompt).shape[1])])
    plain = tiny.generate(prompt, max_new_tokens=40, logits_processor=loop)
    assert plain.count("The band played in Tulsa.") > 4
    stats = {}
    ended = tiny.generate(prompt, max_new_tokens=40, stop_on_repeat=4, logits_processor=loop, stats=stats)
    assert ended == "The band played in Tulsa."
    assert stats["stopped"] == "repeat" and stats["new_tokens"] == len(sentence) and plain.startswith(ended)
    pieces = list(tiny.generate(prompt, max_new_tokens=40, stop_on_repeat=4, logits_processor=loop, stream=True))
    assert "".join(pieces) == ended and len(pieces) > 3
    # a sentence shorter than the run, on lines of its own: the second copy is dropped
    short = tiny.tokenizer.encode("Tulsa.\n", add_special_tokens=False)
    loop = LogitsProcessorList([Loop(short, tiny.chat_ids(prompt).shape[1])])
    assert tiny.generate(prompt, max_new_tokens=40, stop_on_repeat=8, logits_processor=loop) == "Tulsa."


def reference_answer(backbone, prompt: str, n: int, penalty: float, ngram: int, loop: Loop) -> str:
    """A plain greedy loop with the penalty and the n-gram block over the answer's tokens only, then `loop`."""
    ids = backbone.chat_ids(prompt)[0].tolist()
    answer = []
    eos = backbone.eos_ids()
    with torch.inference_mode():
        for _ in range(n):
            logits = backbone.model(torch.tensor([ids + answer])).logits[0, -1].clone()
            for t in set(answer):
                logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
            for i in range(len(answer) - ngram + 1):
                if answer[i:i + ngram - 1] == answer[len(answer) - ngram + 1:]:
                    logits[answer[i + ngram - 1]] = -float("inf")
            token = int(loop(torch.tensor([ids + answer]), logits[None])[0].argmax())
            if token in eos:
                break
            answer.append(token)
    return backbone.tokenizer.decode(answer, skip_special_tokens=True).strip()


def test_repetition_penalty_and_ngram_block_apply_to_the_answer_only(tiny):
    from transformers import LogitsProcessorList

    prompt = "Where did the band play?"
    sentence = tiny.tokenizer.encode(" The band played in Tulsa.", add_special_tokens=False)
    loop = Loop(sentence, tiny.chat_ids(prompt).shape[1], bias=4.0)  # a pull towards a loop the options resist
    plain = tiny.generate(prompt, max_new_tokens=30, logits_processor=LogitsProcessorList([loop]))
    got = tiny.generate(prompt, max_new_tokens=30, repetition_penalty=1.8, no_repeat_ngram_size=2,
                        logits_processor=LogitsProcessorList([loop]))
    assert got == reference_answer(tiny, prompt, 30, 1.8, 2, loop) and got != plain
    ids = tiny.tokenizer.encode(got, add_special_tokens=False)
    assert len(set(ngrams(ids, 2))) == len(ngrams(ids, 2))
    # the prompt's tokens are neither penalised nor blocked: only the answer's (after prompt_len)
    penalty, block = generation.answer_processors(3, 2.0, 2)
    ids = torch.tensor([[7, 8, 7, 8, 9]])  # prompt 7 8 7 | answer 8 9: "7 8" repeats in the prompt only
    scores = penalty(ids, torch.ones(1, 12))
    assert scores[0, 7] == 1 and scores[0, 8] == scores[0, 9] == 0.5
    assert block(torch.tensor([[7, 8, 7, 8, 9, 8]]), torch.ones(1, 12))[0].isinf().nonzero().flatten().tolist() == [9]
    assert not block(ids, torch.ones(1, 12)).isinf().any()
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        tiny.generate(prompt, max_new_tokens=4, no_repeat_ngram_size=-1)
    with pytest.raises(ValueError, match="repetition_penalty"):
        tiny.generate(prompt, max_new_tokens=4, repetition_penalty=0)


def test_a_stream_yields_as_tokens_come_and_closing_it_stops_the_model(tiny):
    calls = []

    def slow(module, args, out):
        calls.append(time.perf_counter())
        time.sleep(0.02)

    text = tiny.generate("Tell me a story.", max_new_tokens=40)
    handle = tiny.model.register_forward_hook(slow)
    try:
        pieces = tiny.generate("Tell me a story.", max_new_tokens=40, stream=True)
        first = next(pieces)
        at_first = len(calls)
        pieces.close()
        time.sleep(0.1)
        after_close = len(calls)
    finally:
        handle.remove()
    assert first and text.startswith(first)
    assert at_first < 10 and after_close < 12  # the first piece before the 40 steps; none ran on after close
    assert "".join(tiny.generate("Tell me a story.", max_new_tokens=40, stream=True)) == text
    assert tiny.lock.acquire(blocking=False)  # the worker let go of the model
    tiny.lock.release()


def test_cpu_generation_runs_with_the_fitted_thread_count(tiny, monkeypatch):
    seen = []
    monkeypatch.setenv("ENDO_THREADS", "1")
    before = torch.get_num_threads()
    handle = tiny.model.register_forward_hook(lambda *a: seen.append(torch.get_num_threads()))
    try:
        tiny.generate("Name a colour.", max_new_tokens=4)
        list(tiny.generate("Name a colour.", max_new_tokens=4, stream=True))
    finally:
        handle.remove()
    assert seen and set(seen) == {1} and torch.get_num_threads() == before


LONG_CONTEXT = " ".join(f"Fact {i}: the lighthouse number {i} stands on island {i * 7 % 101}." for i in range(300))


def test_compress_to_fits_a_long_prompt_and_logs_the_time(tiny, caplog):
    message = f"Context:\n{LONG_CONTEXT}\n\nAnswer the question.\nQuestion: Where does lighthouse number 42 stand?"
    stats = {}
    with caplog.at_level(logging.INFO, logger="endo_retrieval.model.generation"):
        tiny.generate(message, max_new_tokens=4, compress_to=300, compress_method="bm25", stats=stats)
    assert stats["compressed_from"] > 2000 and stats["prompt_tokens"] <= 300 and stats["compress_s"] >= 0
    assert any("compressed a" in r.message and " s" in r.message for r in caplog.records)
    kept = generation.compress_messages(tiny, [{"role": "user", "content": message}], 300, "bm25")
    assert kept[0]["content"].endswith("Question: Where does lighthouse number 42 stand?")
    assert "lighthouse number 42 stands" in kept[0]["content"]
    short = [{"role": "user", "content": "Question: Where is it?"}]
    assert generation.compress_messages(tiny, short, 300) == short  # under the limit: as it is
    with pytest.raises(Exception, match="no context before a question"):
        generation.compress_messages(tiny, [{"role": "user", "content": LONG_CONTEXT}], 300, "bm25")
    with pytest.raises(Exception, match="raise it"):
        generation.compress_messages(tiny, [{"role": "user", "content": message}], 40, "bm25")


def test_compress_to_takes_the_compressor_given_else_the_registered_one(tiny, monkeypatch):
    """The model asks no module above it: a compressor is passed in, or found where the methods registered theirs
    (core.Compressors, one floor below both); with neither, the error says what to import."""
    from endo_retrieval.core import Compressed, Compressors

    asked = []

    def first_lines(context, question, budget, backbone, **kw):
        asked.append((question, budget, kw))
        return Compressed(context[:200], [], 40, "first-lines", budget)

    message = f"Context:\n{LONG_CONTEXT}\n\nQuestion: Where does lighthouse number 42 stand?"
    stats = {}
    kept = generation.compress_messages(tiny, [{"role": "user", "content": message}], 300, stats=stats,
                                        compressor=first_lines)
    assert asked == [("Question: Where does lighthouse number 42 stand?", asked[0][1], {})] and 32 <= asked[0][1] < 300
    assert kept[0]["content"] == message[:200].rstrip() + "\n\nQuestion: Where does lighthouse number 42 stand?"
    assert stats["compress_method"] == "first-lines"
    assert Compressors.get()[1] == endo_retrieval.methods.DEFAULT_METHOD  # the methods registered theirs on import
    monkeypatch.setattr(Compressors, "_registered", None)
    with pytest.raises(ValueError, match="import endo_retrieval.methods"):
        generation.compress_messages(tiny, [{"role": "user", "content": message}], 300)


def test_a_long_prompt_on_a_cpu_warns_once_with_its_time(tiny, monkeypatch, caplog):
    monkeypatch.setattr(generation, "LONG_CPU_PROMPT", 20)
    monkeypatch.setattr(generation, "_hinted", set())
    with caplog.at_level(logging.WARNING, logger="endo_retrieval.model.generation"):
        for _ in range(2):
            tiny.generate("A prompt of more than twenty tokens, " * 3, max_new_tokens=2)
    hints = [r.message for r in caplog.records if "compress_to" in r.message]
    assert len(hints) == 1 and " s to read" in hints[0]


def test_the_graph_steps_and_attention_backends_end_the_same_way(tiny):
    """The CUDA path's token source (its eager twin on a CPU) gives generate's greedy tokens, and a backend's own
    loop is ended by the same stop rules."""
    ids = tiny.chat_ids("Tell me a story.")
    hf = tiny.model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones_like(ids), temperature=None, top_p=None, top_k=None)
    assert list(generation.graphed_tokens(tiny, ids, 12)) == hf[0, ids.shape[1]:].tolist()
    attn = tiny.model.config._attn_implementation
    steps = generation.graphed_tokens(tiny, ids, 12)
    next(steps)
    next(steps)  # the decode steps have begun: the model reads with the step's own attention
    steps.close()  # ended early (a stop token or a repeat): the model's lock is let go and its attention put back
    assert tiny.lock.acquire(blocking=False)
    tiny.lock.release()
    assert tiny.model.config._attn_implementation == attn

    sentence = tiny.tokenizer.encode("The band played in Tulsa.", add_special_tokens=False)

    class LoopingBackend:
        def generate_ids(self, backbone, ids, max_new_tokens):
            for i in range(max_new_tokens):
                yield sentence[i % len(sentence)]

    assert tiny.generate("Where?", max_new_tokens=40, attention=LoopingBackend(), stop_on_repeat=4) == \
        "The band played in Tulsa."
    assert tiny.generate("Where?", max_new_tokens=40, attention=LoopingBackend()).count("Tulsa") > 4
    with pytest.raises(Exception, match="decode greedily"):
        tiny.generate("Where?", max_new_tokens=4, attention=LoopingBackend(), repetition_penalty=1.2)

    class OwnBackend:  # a backend with only `generate`: called as it is
        def generate(self, backbone, ids, max_new_tokens, stream=False):
            return "own"

    assert tiny.generate("Where?", attention=OwnBackend()) == "own"
