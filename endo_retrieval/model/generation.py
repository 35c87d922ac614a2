"""Chat-template generation with the backbone's model (`Backbone.generate`): greedy by default, optionally streamed
token by token; on CUDA plain greedy decoding replays CUDA-graph steps (decode.py).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

from endo_retrieval.model.decode import greedy_tokens, supports_graph_decode
from endo_retrieval.model.locate import BackboneError


def chat_ids(backbone, prompt_or_messages, system: str | None = None) -> torch.Tensor:
    msgs = [{"role": "user", "content": prompt_or_messages}] if isinstance(prompt_or_messages, str) \
        else list(prompt_or_messages)
    if system:
        msgs = [{"role": "system", "content": system}] + msgs
    ids = backbone.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                                 return_dict=True)["input_ids"]
    return ids.to(backbone.device)


def generate(backbone, prompt_or_messages, max_new_tokens: int = 64, stream: bool = False,
             system: str | None = None, do_sample: bool = False, attention=None, **gen_kwargs):
    """`Backbone.generate` (its docstring is the contract)."""
    ids = backbone.chat_ids(prompt_or_messages, system)
    if attention is not None:
        if isinstance(attention, str):
            raise BackboneError(f"attention takes a backend object, not a name: from endo_retrieval.attention "
                                f"import get_backend; generate(..., attention=get_backend({attention!r}))")
        if do_sample or gen_kwargs:
            raise BackboneError("attention backends decode greedily; drop do_sample and other generate options")
        return attention.generate(backbone, ids[0], max_new_tokens, stream=stream)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample,
                  attention_mask=torch.ones_like(ids), pad_token_id=backbone.tokenizer.eos_token_id, **gen_kwargs)
    if not do_sample:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    if not (stream or do_sample or gen_kwargs) and backbone.device.type == "cuda" \
            and supports_graph_decode(backbone.model):
        return generate_graphed(backbone, ids, max_new_tokens)
    if not stream:
        with backbone.lock, torch.inference_mode():
            out = backbone.model.generate(ids, **kwargs)
        return backbone.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    return generate_stream(backbone, ids, kwargs)


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
        with backbone.lock, torch.inference_mode():
            made = backbone.model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                           temperature=None, top_p=None, top_k=None, pad_token_id=pad)
        out += [tok.decode(m[width:], skip_special_tokens=True).strip() for m in made]
    return out


def generate_graphed(backbone, ids: torch.Tensor, max_new_tokens: int) -> str:
    """Greedy decoding with CUDA-graph steps over a static cache (`decode.py`; an eager Hugging Face step of the
    default model is nearly all kernel launches); stops at the model's end-of-sequence ids."""
    eos, out = backbone.eos_ids(), []
    with backbone.lock, contextlib.closing(greedy_tokens(backbone.model, ids, max_new_tokens)) as steps:
        for token in steps:  # closing: a stop at end-of-sequence puts the model's attention back at once
            if int(token) in eos:
                break
            out.append(int(token))
    return backbone.tokenizer.decode(out, skip_special_tokens=True).strip()


def eos_ids(backbone) -> set[int]:
    """The ids that end generation: the model's generation config, else the tokenizer's end-of-sequence."""
    eos = backbone.model.generation_config.eos_token_id
    return {eos} if isinstance(eos, int) else set(eos or [backbone.tokenizer.eos_token_id])


def generate_stream(backbone, ids, kwargs) -> Iterator[str]:
    from transformers import TextIteratorStreamer

    streamer = TextIteratorStreamer(backbone.tokenizer, skip_prompt=True, skip_special_tokens=True)
    errors: list[BaseException] = []

    def work():
        try:
            with backbone.lock, torch.inference_mode():
                backbone.model.generate(ids, streamer=streamer, **kwargs)
        except BaseException as e:  # surfaced to the consumer below
            errors.append(e)
            streamer.end()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    yield from (piece for piece in streamer if piece)
    thread.join()
    if errors:
        raise errors[0]
