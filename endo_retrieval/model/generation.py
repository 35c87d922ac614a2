"""Chat-template generation with the backbone's model (`Backbone.generate`): greedy by default, optionally streamed
token by token; on CUDA plain greedy decoding replays CUDA-graph steps (decode.py).

Every way of decoding (Hugging Face's `generate` on a worker thread, the CUDA-graph steps, an attention backend's
own loop) is a source of token ids; `answer_ids` reads it, ends the answer at the chat template's stop tokens and,
where asked, where the answer starts repeating itself (`RepeatStop`), and closes the source so the model stops too.
Options beside Hugging Face's generate keywords (all off unless given; `EndoLLM` and `ChatEndo` set their own):

- stop_on_repeat=N: the answer ends before a run of N tokens it already wrote, or a sentence it already wrote.
- repetition_penalty=P, no_repeat_ngram_size=N: transformers' own logits processors, over the answer's tokens only
  (a RAG answer copies names and phrases from its context; penalising the prompt's tokens would forbid that).
- compress_to=T (compress_method=M): a chat prompt longer than T tokens has the context of its last user message
  compressed first, so that the whole prompt fits T tokens: with `compressor=` where given (a function of
  `endo_retrieval.compress`'s signature), else with what endo_retrieval.methods registers (`core.Compressors`).
- stats=dict(): filled with what happened (prompt tokens, compression, seconds to the first token, new tokens,
  why it stopped); the same goes to the `endo_retrieval.model.generation` logger at INFO.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import re
import threading
import time
from typing import Iterator

import torch

from endo_retrieval.core import Compressors
from endo_retrieval.model.decode import greedy_tokens, supports_graph_decode
from endo_retrieval.model.locate import BackboneError
from endo_retrieval.model.threads import threads_for_cpu_work

log = logging.getLogger(__name__)

# A CPU prompt longer than this many tokens gets a one-time warning with its measured prefill time and the way to
# compress it (`compress_to`): a 4,000-token prompt (16,000 characters) took 5-20 s to read on 2 busy cores
# (docs/generation.md).
LONG_CPU_PROMPT = 2048
_hinted: set[str] = set()
OPTIONS = ("stop_on_repeat", "repetition_penalty", "no_repeat_ngram_size", "compress_to", "compress_method",
           "compressor", "stats")


def as_messages(prompt_or_messages, system: str | None = None) -> list[dict]:
    msgs = [{"role": "user", "content": prompt_or_messages}] if isinstance(prompt_or_messages, str) \
        else [dict(m) for m in prompt_or_messages]
    if system:
        msgs = [{"role": "system", "content": system}] + msgs
    return msgs


def chat_ids(backbone, prompt_or_messages, system: str | None = None) -> torch.Tensor:
    ids = backbone.tokenizer.apply_chat_template(as_messages(prompt_or_messages, system), add_generation_prompt=True,
                                                 return_tensors="pt", return_dict=True)["input_ids"]
    return ids.to(backbone.device)


def generate(backbone, prompt_or_messages, max_new_tokens: int = 64, stream: bool = False,
             system: str | None = None, do_sample: bool = False, attention=None, **gen_kwargs):
    """`Backbone.generate` (its docstring is the contract; the options above come through `gen_kwargs`)."""
    stop_on_repeat = gen_kwargs.pop("stop_on_repeat", None)
    penalty = gen_kwargs.pop("repetition_penalty", None)
    ngram = gen_kwargs.pop("no_repeat_ngram_size", None)
    compress_to = gen_kwargs.pop("compress_to", None)
    compress_method = gen_kwargs.pop("compress_method", None)
    compressor = gen_kwargs.pop("compressor", None)
    stats = gen_kwargs.pop("stats", None)
    stats = {} if stats is None else stats
    messages = as_messages(prompt_or_messages, system)
    if compress_to:
        messages = compress_messages(backbone, messages, compress_to, compress_method, stats, compressor)
    ids = backbone.chat_ids(messages)
    stats["prompt_tokens"] = int(ids.shape[1])
    processors = answer_processors(ids.shape[1], penalty, ngram)
    if attention is not None:
        if isinstance(attention, str):
            raise BackboneError(f"attention takes a backend object, not a name: from endo_retrieval.attention "
                                f"import get_backend; generate(..., attention=get_backend({attention!r}))")
        if do_sample or gen_kwargs or processors:
            raise BackboneError("attention backends decode greedily; drop do_sample, repetition_penalty, "
                                "no_repeat_ngram_size and other generate options (stop_on_repeat works)")
        if not hasattr(attention, "generate_ids"):  # a backend of its own making: its generate as it is
            return attention.generate(backbone, ids[0], max_new_tokens, stream=stream)
        tokens = backend_tokens(backbone, attention, ids, max_new_tokens)
    elif not (do_sample or gen_kwargs or processors) and backbone.device.type == "cuda" \
            and supports_graph_decode(backbone.model):
        tokens = graphed_tokens(backbone, ids, max_new_tokens)
    else:
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, attention_mask=torch.ones_like(ids),
                      pad_token_id=backbone.tokenizer.eos_token_id, eos_token_id=sorted(backbone.eos_ids()),
                      **gen_kwargs)
        if processors:  # before the caller's own, as generate puts its built-in processors before them
            from transformers import LogitsProcessorList

            kwargs["logits_processor"] = LogitsProcessorList(processors + list(gen_kwargs.get("logits_processor", [])))
        if not do_sample:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        tokens = hf_tokens(backbone, ids, kwargs)
    guard = RepeatStop(backbone.tokenizer, stop_on_repeat) if stop_on_repeat else None
    answer = answer_ids(backbone, tokens, guard, stats, compressed=bool(compress_to), stream=stream)
    if stream:
        return text_pieces(backbone.tokenizer, answer)
    return backbone.tokenizer.decode(list(answer), skip_special_tokens=True).strip()


def generate_many(backbone, prompts: list[str], max_new_tokens: int = 48, batch: int = 32) -> list[str]:
    """Greedy chat-template answers to many prompts, `batch` at a time: the prompts left-padded so that every
    sequence's next token sits in the last column (a batch of 32 takes about the time of one prompt on a GPU)."""
    tok, out = backbone.tokenizer, []
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for at in range(0, len(prompts), batch):
        rows = [backbone.chat_ids(p)[0] for p in prompts[at: at + batch]]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long, device=backbone.device)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
        with backbone.lock, threads_for_cpu_work(backbone.device), torch.inference_mode():
            made = backbone.model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                           temperature=None, top_p=None, top_k=None, pad_token_id=pad,
                                           eos_token_id=sorted(backbone.eos_ids()))
        out += [tok.decode(m[width:], skip_special_tokens=True).strip() for m in made]
    return out


# ---- stop tokens ------------------------------------------------------------------------------------------------
def eos_ids(backbone) -> set[int]:
    """The ids that end generation: the model's generation config's end-of-sequence ids, the tokenizer's, and the
    token the chat template closes a turn with (SmolLM2's and Qwen's `<|im_end|>`, Llama 3's `<|eot_id|>`), which
    a converted model's generation config does not always name."""
    eos = backbone.model.generation_config.eos_token_id
    ids = {eos} if isinstance(eos, int) else set(eos or ())
    if backbone.tokenizer.eos_token_id is not None:
        ids.add(backbone.tokenizer.eos_token_id)
    turn_end = end_of_turn_id(backbone.tokenizer)
    return ids | ({turn_end} if turn_end is not None else set())


def end_of_turn_id(tokenizer) -> int | None:
    """The special token the chat template writes right after an assistant turn's text, if it writes one."""
    marker = "endo-turn-marker"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "q"},
                                              {"role": "assistant", "content": marker}], tokenize=False)
    except Exception:  # no chat template, or one that refuses these turns: the other stop ids stand
        return None
    after = text[text.rfind(marker) + len(marker):] if marker in text else ""
    ids = tokenizer.encode(after, add_special_tokens=False) if after else []
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return ids[0] if ids and ids[0] in special else None


# ---- repetition -------------------------------------------------------------------------------------------------
_WORDS = re.compile(r"\w+")


class RepeatStop:
    """Where an answer starts repeating itself. `cut(answer)`, called with the answer's token ids after each new
    token, returns None while it does not repeat, else how many of its tokens to keep:

    - a run of `ngram` tokens that the answer already holds (greedy decoding of a small model loops: one sentence
      nine times until the token limit): the answer keeps what came before the run, less the unfinished sentence
      the run began in (unless that is the first sentence, or a stream has shown part of it);
    - a sentence (up to . ! ? before a space, or a line) equal to an earlier one in its words, any shorter than the
      run: the answer keeps what came before it. `finish(answer)` checks the last sentence when decoding ends.

    Nothing is changed in the model's choices: the answer is the plain greedy one, ended earlier."""

    def __init__(self, tokenizer, ngram: int = 8):
        if not isinstance(ngram, int) or isinstance(ngram, bool) or ngram < 2:
            raise ValueError(f"stop_on_repeat takes a run length in tokens >= 2 (0 or None: off), got {ngram!r}")
        self.tokenizer, self.ngram = tokenizer, ngram
        self.runs: set[tuple[int, ...]] = set()
        self.starts = [0]  # token index where each sentence begins
        self.sentences: set[str] = set()
        self.pieces: list[str] = []

    def _sentence(self, answer: list[int], start: int, end: int) -> str:
        return " ".join(_WORDS.findall(self.tokenizer.decode(answer[start:end], skip_special_tokens=True).lower()))

    def _seen_sentence(self, answer: list[int], start: int, end: int) -> bool:
        words = self._sentence(answer, start, end)
        if words and words in self.sentences:
            return True
        if words:
            self.sentences.add(words)
        return False

    def cut(self, answer: list[int], shown: int = 0) -> int | None:
        """`shown`: how many of the answer's tokens a stream has shown already; a repeat's unfinished sentence is
        dropped only where none of it has been shown."""
        i = len(answer) - 1
        piece = self.tokenizer.decode(answer[i:], skip_special_tokens=True)
        self.pieces.append(piece)
        before = self.pieces[-2] if i else ""
        # a sentence ends after a line break, or after . ! ? when the next piece begins with a space
        if i and ("\n" in before or (before.rstrip()[-1:] in (".", "!", "?") and piece[:1].isspace())):
            if self._seen_sentence(answer, self.starts[-1], i):
                return self.starts[-1]
            self.starts.append(i)
        if len(answer) >= self.ngram:
            run = tuple(answer[-self.ngram:])
            if run in self.runs:
                begin = len(answer) - self.ngram
                while begin < i and not self.pieces[begin].strip():  # line breaks that end the sentence before
                    begin += 1
                sentence = max(s for s in self.starts if s <= begin)
                return sentence if 0 < sentence and sentence >= shown else begin
            self.runs.add(run)
        return None

    def finish(self, answer: list[int]) -> int | None:
        start = self.starts[-1]
        return start if start < len(answer) and self._seen_sentence(answer, start, len(answer)) else None


class _AnswerOnly:
    """A transformers logits processor applied to the answer's tokens only (the ids after the prompt)."""

    def __init__(self, processor, prompt_len: int):
        self.processor, self.prompt_len = processor, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return self.processor(input_ids[:, self.prompt_len:], scores)


def answer_processors(prompt_len: int, penalty: float | None, ngram: int | None) -> list:
    """transformers' RepetitionPenaltyLogitsProcessor and NoRepeatNGramLogitsProcessor over the answer's tokens (in
    generate's own order: the penalty first); none for a penalty of 1 or an n-gram size of 0."""
    from transformers.generation.logits_process import (NoRepeatNGramLogitsProcessor,
                                                        RepetitionPenaltyLogitsProcessor)

    out = []
    if penalty is not None and penalty != 1.0:
        if not isinstance(penalty, (int, float)) or isinstance(penalty, bool) or penalty <= 0:
            raise ValueError(f"repetition_penalty must be a number > 0 (1: none), got {penalty!r}")
        out.append(_AnswerOnly(RepetitionPenaltyLogitsProcessor(float(penalty)), prompt_len))
    if ngram:
        if not isinstance(ngram, int) or isinstance(ngram, bool) or ngram < 1:
            raise ValueError(f"no_repeat_ngram_size must be a whole number >= 1 (0: none), got {ngram!r}")
        out.append(_AnswerOnly(NoRepeatNGramLogitsProcessor(ngram), prompt_len))
    return out


# ---- token sources ----------------------------------------------------------------------------------------------
def hf_tokens(backbone, ids: torch.Tensor, kwargs: dict) -> Iterator[int]:
    """Hugging Face's generate on a worker thread (holding the model's lock, with the CPU's fitted thread count),
    its new token ids as they come. The prompt is prefilled in one forward: on a CPU, prefilling it in chunks into a
    cache was 1.2-10x slower (docs/generation.md). Closing the iterator stops the generation at its next step."""
    from transformers import StoppingCriteria, StoppingCriteriaList
    from transformers.generation.streamers import BaseStreamer

    arrived: queue.Queue = queue.Queue()
    halt = threading.Event()
    errors: list[BaseException] = []

    class Feed(BaseStreamer):
        prompt_seen = False

        def put(self, value):
            if not self.prompt_seen:  # generate hands the prompt over first
                self.prompt_seen = True
                return
            for token in value.flatten().tolist():
                arrived.put(token)

        def end(self):
            arrived.put(None)

    class Halt(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            return torch.full((input_ids.shape[0],), halt.is_set(), dtype=torch.bool, device=input_ids.device)

    def work():
        try:
            with backbone.lock, threads_for_cpu_work(backbone.device), torch.inference_mode():
                backbone.model.generate(ids, streamer=Feed(), stopping_criteria=StoppingCriteriaList([Halt()]),
                                        **kwargs)
        except BaseException as e:  # surfaced to the consumer below
            errors.append(e)
        finally:
            arrived.put(None)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        while (token := arrived.get()) is not None:
            yield token
    finally:
        halt.set()
        thread.join()
    if errors:
        raise errors[0]


def graphed_tokens(backbone, ids: torch.Tensor, max_new_tokens: int) -> Iterator[int]:
    """Greedy tokens from CUDA-graph steps over a static cache (`decode.py`; an eager Hugging Face step of the
    default model is nearly all kernel launches); closing the iterator puts the model's attention back at once."""
    with backbone.lock, contextlib.closing(greedy_tokens(backbone.model, ids, max_new_tokens)) as steps:
        for token in steps:
            yield int(token)


def backend_tokens(backbone, attention, ids: torch.Tensor, max_new_tokens: int) -> Iterator[int]:
    """A decode-time attention backend's greedy tokens (its own loop: chunked prefill, then one token per step)."""
    with threads_for_cpu_work(backbone.device), contextlib.closing(
            attention.generate_ids(backbone, ids[0], max_new_tokens)) as steps:
        yield from steps


# ---- the answer -------------------------------------------------------------------------------------------------
def answer_ids(backbone, tokens: Iterator[int], guard: RepeatStop | None, stats: dict,
               compressed: bool = False, stream: bool = True) -> Iterator[int]:
    """The answer's token ids from a token source: up to the first stop token, and with `guard` up to where the
    answer starts repeating itself. With a guard, a stream holds the last `guard.ngram` tokens back until the next
    arrives (a repeat found later takes them back), so it never shows the start of a repeat; without stream,
    nothing is given out before the end."""
    eos = backbone.eos_ids()
    hold = 0 if guard is None else guard.ngram if stream else float("inf")
    start, answer, shown, stopped = time.perf_counter(), [], 0, "max_new_tokens"
    with _closing(tokens):
        for token in tokens:
            if "first_token_s" not in stats:
                stats["first_token_s"] = round(time.perf_counter() - start, 3)
                _hint_long_prompt(backbone, stats, compressed)
            if token in eos:
                stopped = "stop_token"
                break
            answer.append(token)
            if guard is not None and (keep := guard.cut(answer, shown)) is not None:
                del answer[max(keep, shown):]
                stopped = "repeat"
                break
            while len(answer) - shown > hold:
                yield answer[shown]
                shown += 1
    if guard is not None and stopped != "repeat" and (keep := guard.finish(answer)) is not None:
        del answer[max(keep, shown):]
        stopped = "repeat"
    yield from answer[shown:]
    stats.update(new_tokens=len(answer), seconds=round(time.perf_counter() - start, 3), stopped=stopped)
    log.info("%d new tokens after a %d-token prompt in %.1f s (first token after %.1f s), stopped at %s",
             len(answer), stats["prompt_tokens"], stats["seconds"], stats.get("first_token_s", 0.0), stopped)


@contextlib.contextmanager
def _closing(tokens: Iterator):
    """Close a token source (a generator: its model stops) when its reader is done with it, however that ends."""
    try:
        yield tokens
    finally:
        if hasattr(tokens, "close"):
            tokens.close()


def _hint_long_prompt(backbone, stats: dict, compressed: bool) -> None:
    if backbone.device.type != "cpu" or compressed or stats["prompt_tokens"] <= LONG_CPU_PROMPT \
            or backbone.model_id in _hinted:
        return
    _hinted.add(backbone.model_id)
    log.warning("A %d-token prompt took %.1f s to read on this CPU before the first new token; compress_to=1024 "
                "(EndoLLM, ChatEndo, Backbone.generate) compresses a long prompt's context first.",
                stats["prompt_tokens"], stats["first_token_s"])


def text_pieces(tokenizer, tokens: Iterator[int]) -> Iterator[str]:
    """The text of `tokens` piece by piece as they come, each piece yielded once no multi-token character is left
    half-done; white space at either end is held back until text follows it, so the pieces join to the stripped
    answer that the call without stream returns."""
    seen, emitted = [], ""
    with _closing(tokens):
        for token in tokens:
            seen.append(token)
            text = tokenizer.decode(seen, skip_special_tokens=True).strip()
            if text and not text.endswith("\ufffd") and len(text) > len(emitted):
                yield text[len(emitted):]
                emitted = text


# ---- compression ------------------------------------------------------------------------------------------------
_QUESTION_LINE = re.compile(r"^[ \t]*(?:query|question)[ \t]*:", re.IGNORECASE | re.MULTILINE)


def split_question(content: str) -> tuple[str, str]:
    """(context, question part) of a user message: the question part from its last line that starts with
    'Query:' or 'Question:' (LlamaIndex's and ChatEndo's RAG prompts), else its last line."""
    lines = list(_QUESTION_LINE.finditer(content))
    at = lines[-1].start() if lines else content.rstrip().rfind("\n") + 1
    return content[:at], content[at:]


def compress_messages(backbone, messages: list[dict], compress_to: int, method: str | None = None,
                      stats: dict | None = None, compressor=None) -> list[dict]:
    """`messages` whose chat prompt fits `compress_to` tokens: when it is longer, the context of the last user
    message (what comes before its question, `split_question`) is compressed for that question to the tokens the
    rest of the prompt leaves (by `compressor`, else the registered one); the time taken is logged and put in
    `stats`."""
    compress, default_method = (compressor, None) if compressor is not None else Compressors.get()

    if not isinstance(compress_to, int) or isinstance(compress_to, bool) or compress_to < 1:
        raise ValueError(f"compress_to takes a number of prompt tokens >= 1 (None: no compression), got "
                         f"{compress_to!r}")
    stats = {} if stats is None else stats
    total = int(backbone.chat_ids(messages).shape[1])
    if total <= compress_to:
        return messages
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    context, question = split_question(messages[last]["content"]) if last is not None else ("", "")
    if not context.strip() or not question.strip():
        raise BackboneError(f"The prompt has {total} tokens, over compress_to={compress_to}, and its last user "
                            "message has no context before a question to compress (its last line is the question).")
    room = compress_to - (total - backbone.count_tokens(context)) - 4  # 4: the seam's newlines
    if room < 32:
        raise BackboneError(f"compress_to={compress_to} leaves {max(room, 0)} tokens for the context once the rest "
                            f"of the prompt ({total - backbone.count_tokens(context)} tokens) is in; raise it.")
    method = method or default_method
    start = time.perf_counter()
    chosen = {"method": method} if method else {}  # none: a given compressor's own default
    kept = compress(context, question, budget=room, backbone=backbone, **chosen)
    seconds = time.perf_counter() - start
    method = method or getattr(kept, "method", None)
    out = [dict(m) for m in messages]
    out[last]["content"] = kept.text.rstrip() + "\n\n" + question.lstrip()
    stats.update(compressed_from=total, compress_method=method, compress_s=round(seconds, 3))
    log.info("compressed a %d-token prompt's context to %d tokens (%s) in %.1f s", total, room, method, seconds)
    return out
