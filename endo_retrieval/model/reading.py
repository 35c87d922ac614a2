"""Reading a context once and asking it any number of query parts, with the model's own caches.

The model reads the context (`read`) in segments (default: one; the heads use the model's trained window) cut at
sentence starts, one causal forward each with its own KV cache, and a query part (`ask`: a question, a content-free
question, a second hop) is read after every segment: within a segment the query part sees every token at every
layer, as in one forward. Long contexts keep the segments' caches in host memory, so the accelerator holds one
segment at a time. `stream=True` reads with ILRe's streaming prefill instead (ILRe section 3.3: chunks behind S sink
+ W window tokens), bounded without segments, but a query part then sees only the frame at the lower layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from endo_retrieval.model.backbone import BackboneError
from endo_retrieval.model.threads import threads_for_cpu_work

HOST_CACHES_FROM = 32768  # contexts at least this long keep their segments' caches in host memory between questions


@dataclass
class Segment:
    """One piece of a read context: its first token, its keys at the heads' layers (RoPE-rotated at the positions
    they were computed at) and what a query part continues from: the segment's KV cache (layers 0..max(layers)),
    or for a streamed reading the sink + window frame."""

    start: int
    keys: dict[int, torch.Tensor]  # layer -> (n_kv, T, d)
    cache: object | None = None
    frame_ids: np.ndarray | None = None

    @property
    def n_tokens(self) -> int:
        return next(iter(self.keys.values())).shape[1]


@dataclass
class Reading:
    n_tokens: int
    segments: list[Segment]
    on_host: bool = False  # the segments' caches and keys wait in host memory; each comes over when asked
    int8: bool = False  # read through the int8 copy of the layers (CPU): its query parts must be too

    @property
    def streamed(self) -> bool:
        return self.segments[0].cache is None


def segment_cuts(sentence_starts: np.ndarray, n_tokens: int, segment: int) -> list[int]:
    """Segment bounds [0, ..., n_tokens]: each segment as long as possible up to `segment` tokens, cut at a
    sentence start (a sentence longer than a segment is cut inside)."""
    starts, cuts = np.asarray(sentence_starts), [0]
    while n_tokens - cuts[-1] > segment:
        fits = starts[(starts > cuts[-1]) & (starts <= cuts[-1] + segment)]
        cuts.append(int(fits[-1]) if len(fits) else cuts[-1] + segment)
    return cuts + [n_tokens]


def read(backbone, ids: np.ndarray, layers: Sequence[int], **options) -> Reading:
    """`_read` with as many CPU threads as other processes leave idle (`model.threads`; the read is most of a
    question's CPU time, the query parts after it are short)."""
    with threads_for_cpu_work(backbone.device):
        return _read(backbone, ids, layers, **options)


def _read(backbone, ids: np.ndarray, layers: Sequence[int], *, cuts: Sequence[int] | None = None,
          stream: bool = False, sink: int = 4, window: int = 512, chunk_size: int = 2048, int8: bool = False
          ) -> Reading:
    """Forward the context up to max(layers) and keep what its query parts need.

    Default: one causal forward per segment (`cuts`, default one segment), each with its own KV cache, so a query
    part read after a segment sees all of it at every layer; contexts past HOST_CACHES_FROM tokens keep the caches
    in host memory, and accelerator memory holds one segment at a time. stream=True: ILRe's streaming prefill
    instead (chunks behind S sink + W window tokens, positions framed), whose query part sees only the frame at
    the lower layers: memory is bounded without segments, but the heads rank worse (docs/papers.md).
    int8 (CPU): through dynamically int8-quantized linear maps, about twice as fast."""
    ids = np.asarray(ids, dtype=np.int64)
    layers = sorted({int(l) for l in layers})
    if len(ids) == 0:
        raise BackboneError("The context is empty; give at least one token of text.")
    if stream:
        if int8:
            raise BackboneError("int8 reads segments only; pass stream=False")
        keys = {l: torch.empty(backbone.n_kv_heads, len(ids), backbone.head_dim, device=backbone.device,
                               dtype=backbone.dtype) for l in layers}  # bf16 on a GPU: 2 bytes per key element
        for ch in backbone.stream(ids, layers, chunk_size=chunk_size, mode="sink_window", sink=sink, window=window,
                                  capture=("k",)):
            for l in layers:
                keys[l][:, ch.start:ch.end] = backbone.apply_rope(ch.keys[l], ch.rope_positions)
        frame = np.concatenate([ids[:sink], ids[max(sink, len(ids) - window):]])
        return Reading(len(ids), [Segment(0, keys, None, frame)])
    from transformers import DynamicCache

    cuts = list(cuts) if cuts is not None else [0, len(ids)]
    on_host = len(ids) >= HOST_CACHES_FROM and backbone.device.type != "cpu"
    segments = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        cache = DynamicCache()
        x = torch.as_tensor(ids[a:b], device=backbone.device)[None]
        with backbone.lock, torch.inference_mode(), \
                backbone.run_to(layers[-1], layers, ("k",), int8, projections_only=True) as store:
            backbone.model.model(input_ids=x, attention_mask=torch.ones_like(x), past_key_values=cache,
                                 use_cache=True)
        positions = torch.arange(b - a, device=backbone.device)
        keys = {l: backbone.apply_rope(store["k"][l][0], positions).to(backbone.dtype) for l in layers}
        if on_host:
            _move_cache(cache, "cpu")
            keys = {l: _to(k, "cpu") for l, k in keys.items()}
        segments.append(Segment(a, keys, cache))
    return Reading(len(ids), segments, on_host, int8)


def _move_cache(cache, device) -> None:
    """Move a KV cache's tensors to `device` in place (pinned in host memory, so they come back quickly)."""
    for layer in cache.layers:
        layer.keys, layer.values = (_to(t, device) for t in (layer.keys, layer.values))


def _to(t: torch.Tensor, device) -> torch.Tensor:
    return t.cpu().pin_memory() if torch.device(device).type == "cpu" else t.to(device, non_blocking=True)


def ask(backbone, reading: Reading, query_ids: np.ndarray, layers: Sequence[int]) -> list[dict[int, torch.Tensor]]:
    """A query part read after each segment: per segment, its RoPE-rotated queries, layer -> (n_heads, Lq, d).
    Each cache is cropped back afterwards, so the reading serves the next query part unchanged."""
    query_ids = np.asarray(query_ids, dtype=np.int64)
    layers = sorted({int(l) for l in layers})
    if reading.streamed:  # the query part behind the frame, as ILRe's prefill forwards it (split at the context)
        ids = np.concatenate([reading.segments[0].frame_ids, query_ids])
        start = len(reading.segments[0].frame_ids)
        positions = torch.arange(start, len(ids), device=backbone.device)
        for ch in backbone.stream(ids, layers, chunk_size=len(ids), capture=("q",)):
            return [{l: backbone.apply_rope(q[:, start:], positions) for l, q in ch.queries.items()}]
    out = []
    x = torch.as_tensor(query_ids, device=backbone.device)[None]
    for segment in reading.segments:
        cache = segment.cache
        if reading.on_host:
            _move_cache(cache, backbone.device)
        n = segment.n_tokens
        positions = torch.arange(n, n + len(query_ids), device=backbone.device)
        with backbone.lock, torch.inference_mode(), \
                backbone.run_to(layers[-1], layers, ("q",), reading.int8, projections_only=True) as store:
            try:
                backbone.model.model(input_ids=x, position_ids=positions[None], past_key_values=cache,
                                     attention_mask=torch.ones(1, n + len(query_ids), dtype=torch.long,
                                                               device=backbone.device), use_cache=True)
            finally:
                cache.crop(n)
                if reading.on_host:
                    _move_cache(cache, "cpu")
        out.append({l: backbone.apply_rope(store["q"][l][0], positions) for l in layers})
    return out
