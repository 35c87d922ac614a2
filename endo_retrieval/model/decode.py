"""Greedy decoding over a static KV cache, each step replayed from a CUDA graph.

An eager decode step of the default model is almost all Python and kernel launches, so 64 new tokens cost the same
in every method of `endo bench perf`'s end-to-end section; replayed, a step takes a fraction of that
(docs/papers.md). The prompt is prefilled into a `StaticCache` of prompt + new tokens rounded up to SPLIT slots; one
step (token, position and a 4-D mask of the filled slots, all in fixed buffers) is captured once per generation and
replayed, so the graph never reads a host value. Without CUDA, or with `graph=False`, the same steps run eagerly: the
twin the tests hold the graph against.

The step's attention is not SDPA: with the mask a static cache needs, SDPA takes a kernel that does not split the
keys, and a long context's step was many times slower (`bench/results/perf/perf_h200_e2e_graph_tried.json`).
`grouped_decode_attention` reads the cache once, as matmuls: each KV head's query heads against every slot (the
unfilled ones masked), then weights . V in splits of SPLIT slots side by side.
"""
from __future__ import annotations

from typing import Iterator

import torch

from endo_retrieval.model.chunk_graph import capture_graph

GRAPH_ATTENTION = "endo_grouped_decode"
SPLIT = 256  # cache slots per split of the decode step's weights . V; the static cache is a multiple of it


def grouped_decode_attention(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0,
                             **kwargs):
    """Attention of one new token per sequence: query (B, H, 1, d) over key / value (B, H_kv, L, d), mask
    (B, 1, 1, L) of the filled slots; Hugging Face's attention-interface contract, output (B, 1, H, d). Anything
    else (a prefill) goes to SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, T, d = query.shape
    if T != 1 or attention_mask is None or attention_mask.dtype != torch.bool or key.shape[2] % SPLIT:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    Hkv, L = key.shape[1], key.shape[2]
    q = query.reshape(B, Hkv, -1, d)  # query head h reads KV head h // (H / H_kv)
    scores = torch.matmul(q, key.transpose(-1, -2)) * scaling
    weights = torch.softmax(scores.masked_fill(~attention_mask, float("-inf")), dim=-1, dtype=torch.float32)
    # weights . V over the slots in splits of SPLIT (as many matmuls run side by side as there are splits): one
    # matmul with a 32k-long inner dimension and 3 x 64 outputs keeps only a few SMs busy
    splits = L // SPLIT
    w = weights.to(value.dtype).reshape(B, Hkv, -1, splits, SPLIT).transpose(2, 3)
    out = torch.matmul(w, value.reshape(B, Hkv, splits, SPLIT, d)).sum(2)  # (B, H_kv, H / H_kv, d)
    return out.reshape(B, H, 1, d).transpose(1, 2), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(GRAPH_ATTENTION, grouped_decode_attention)


def _full_attention(model) -> bool:
    """Every layer attends to the whole cache (a sliding window would need its own cache layout and mask)."""
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "sliding_window", None) is None and getattr(config, "layer_types", None) in (
        None, ["full_attention"] * config.num_hidden_layers)


def supports_graph_decode(model) -> bool:
    """Full attention in every layer, and a generation config that adds nothing to the argmax (these steps apply
    no penalties or forced tokens, so they would not be `model.generate`'s)."""
    gen = getattr(model, "generation_config", None)
    neutral = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
               "min_length": 0, "min_new_tokens": 0}
    adds = [name for name, same in neutral.items() if getattr(gen, name, None) not in (None, same)] + [
        name for name in ("bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id",
                          "forced_eos_token_id", "sequence_bias") if getattr(gen, name, None)]
    return _full_attention(model) and not adds


@torch.inference_mode()
def greedy_tokens(model, ids: torch.Tensor, max_new_tokens: int, graph: bool | None = None) -> Iterator[torch.Tensor]:
    """Greedy tokens (1, 1) on the device, the first from the prefill of `ids` (1, n); never synchronises, so the
    caller decides when to read them. graph: None = on CUDA. A model with a sliding window decodes eagerly."""
    from transformers import StaticCache

    if not _full_attention(model):  # a sliding window: Hugging Face's own cache, one eager step at a time
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        for _ in range(max_new_tokens):
            token = out.logits[:, -1:].argmax(-1)
            yield token
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
        return
    n, device = ids.shape[1], ids.device
    graph = device.type == "cuda" if graph is None else graph
    slots = -(-(n + max_new_tokens) // SPLIT) * SPLIT  # the slots past n + max_new_tokens stay masked
    cache = StaticCache(config=model.config, max_cache_len=slots)
    out = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(n, device=device), use_cache=True,
                logits_to_keep=1)
    token = out.logits[:, -1:].argmax(-1)  # the buffer each step reads
    yield token.clone()
    if max_new_tokens < 2:
        return
    pos = torch.tensor([n], device=device)
    filled = torch.zeros(1, 1, 1, slots, dtype=torch.bool, device=device)
    filled[..., : n + 1] = True  # the prompt and the token this step feeds

    def step() -> torch.Tensor:
        logits = model(input_ids=token, attention_mask=filled, position_ids=pos[None], cache_position=pos,
                       past_key_values=cache, use_cache=True).logits
        return logits[:, -1:].argmax(-1)

    _register()
    config, before = model.config, model.config._attn_implementation
    config._attn_implementation = GRAPH_ATTENTION  # read by every attention module at each call
    try:
        yield from _steps(step, token, pos, filled, n, max_new_tokens, graph)
    finally:
        config._attn_implementation = before


def _steps(step, token, pos, filled, n: int, max_new_tokens: int, graph: bool) -> Iterator[torch.Tensor]:
    if graph:  # the warm-up writes the slot the first replay rewrites
        captured, following = capture_graph(step, token.device)
    for i in range(max_new_tokens - 1):
        if graph:
            captured.replay()
            nxt = following.clone()
        else:
            nxt = step()
        yield nxt
        token.copy_(nxt)
        pos += 1
        filled[..., n + 1 + i] = True
