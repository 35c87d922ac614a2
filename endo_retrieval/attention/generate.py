"""Greedy generation with an attention backend installed: chunked prefill (the backend's chunk size), then one
token at a time. Hugging Face's `generate` keeps its own rotated cache, so backends need this loop of their own."""
from __future__ import annotations

from typing import Iterator

import torch

from endo_retrieval.attention.base import AttentionBackend, installed
from endo_retrieval.backbone import Backbone


def eos_ids(backbone: Backbone) -> set[int]:
    """The ids that end generation: the model's generation config, else the tokenizer's end-of-sequence."""
    eos = backbone.model.generation_config.eos_token_id
    return {eos} if isinstance(eos, int) else set(eos or [backbone.tokenizer.eos_token_id])


def generate_ids(backbone: Backbone, ids, backend: AttentionBackend, max_new_tokens: int = 64) -> Iterator[int]:
    """Yield greedily chosen token ids after the prompt `ids` (1-D), stopping at end-of-sequence."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if len(ids) == 0:
        raise ValueError("the prompt is empty")
    eos = eos_ids(backbone)
    model = backbone.model

    def logits_after(x: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=x.view(1, -1).to(backbone.device), use_cache=False, logits_to_keep=1)
        return out.logits[0, -1]

    with backbone._lock, torch.inference_mode(), installed(backbone, backend):
        for chunk in ids.split(backend.chunk_size):  # Algorithm 1: chunked prefill
            logits = logits_after(chunk)
        for step in range(max_new_tokens):  # Algorithm 2: one token per step
            token = int(logits.argmax())
            if token in eos:
                return
            yield token
            if step + 1 < max_new_tokens:
                logits = logits_after(torch.tensor([token]))


def generate_text(backbone: Backbone, ids, backend: AttentionBackend, max_new_tokens: int = 64,
                  stream: bool = False):
    """Decoded text of `generate_ids`, or with stream=True an iterator of text pieces as they form."""
    tokens = generate_ids(backbone, ids, backend, max_new_tokens)
    if not stream:
        return backbone.tokenizer.decode(list(tokens), skip_special_tokens=True).strip()
    return _pieces(backbone, tokens)


def _pieces(backbone: Backbone, tokens: Iterator[int]) -> Iterator[str]:
    seen, emitted = [], ""
    for token in tokens:
        seen.append(token)
        text = backbone.tokenizer.decode(seen, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait until a multi-token character is whole
            yield text[len(emitted):]
            emitted = text
