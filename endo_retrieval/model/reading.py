"""Reading a context once and asking it any number of query parts, with the model's own caches.

The model reads the context (`read`) in segments (default: one; the heads use the model's trained window) cut at
sentence starts, one causal forward each with its own KV cache, and a query part (`ask`: a question, a content-free
question, a second hop) is read after every segment: within a segment the query part sees every token at every
layer, as in one forward. Long contexts keep the segments' caches in host memory, so the accelerator holds one
segment at a time. `stream=True` reads with ILRe's streaming prefill instead (ILRe section 3.3: chunks behind S
sink + W window tokens), bounded without segments, but a query part then sees only the frame at the lower layers.

A small model's forward over a few thousand tokens costs less than launching its kernels, so query parts known
together go together: `ask_parts` reads several behind the cache in one forward, and `read(..., parts=...)` reads
them in the segment's own forward, behind its tokens. Each part sees the context and itself, never another part
(`parts_mask`), at the positions it has when asked alone, so its queries are the plain `ask`'s (the twin the tests
hold them against); the ids the parts begin with in common (a second hop's evidence) are read once.

A segment's forward begins with the family's prefix ids (`Backbone.prefix`, e.g. Gemma's <bos>), kept in its cache
but not among its keys. Where a layer attends through a window of its own (Gemma 3's sliding layers), the model's
masks keep it to that window in a segment and in a query part asked behind it (`Layout.window_masks`), as in
one pass over the segment and the part.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from endo_retrieval.model.backbone import BackboneError
from endo_retrieval.model.parts_graph import CONTEXT, LEAD, context_then_parts, group_mask
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
    prefix: int = 0  # the family's prefix ids in front of the segment's tokens in its cache (`Backbone.prefix`)

    @property
    def n_tokens(self) -> int:
        return next(iter(self.keys.values())).shape[1]

    @property
    def cached(self) -> int:
        """Tokens in the segment's cache: the prefix and its own; a query part asked behind it starts here."""
        return self.prefix + self.n_tokens


@dataclass
class Reading:
    n_tokens: int
    segments: list[Segment]
    on_host: bool = False  # the segments' caches and keys wait in host memory; each comes over when asked
    int8: bool = False  # read through the int8 copy of the layers (CPU): its query parts must be too
    # query parts the read's own forwards asked (`read(..., parts=)`): their ids' bytes -> `ask`'s answer at the
    # read's layers; `ask_parts` takes each once
    asked: dict = field(default_factory=dict)
    threads: int | None = None  # CPU: the threads the read was fitted to (`model.threads`); `ask_parts` keeps them

    @property
    def streamed(self) -> bool:
        return self.segments[0].cache is None


class StageClock:
    """Milliseconds per stage of one piece of work, each read once the accelerator has run the stage (its kernels
    run asynchronously: unwaited, a stage would be charged to the next one that reads a result)."""

    def __init__(self, device):
        self.device, self.ms = torch.device(device), {}
        self.last = self.now()

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, stage: str) -> None:
        t = self.now()
        self.ms[stage] = self.ms.get(stage, 0.0) + 1000 * (t - self.last)
        self.last = t


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
        reading = _read(backbone, ids, layers, **options)
        reading.threads = torch.get_num_threads() if backbone.device.type == "cpu" else None
        return reading


@contextmanager
def _read_threads(reading: Reading):
    """The read's fitted CPU thread count for the query parts asked after it: a second hop's parts are a few
    hundred tokens, and beside a busy process torch's own count collapsed on them as on a read (seconds, not tens
    of milliseconds)."""
    if reading.threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(reading.threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _read(backbone, ids: np.ndarray, layers: Sequence[int], *, cuts: Sequence[int] | None = None,
          stream: bool = False, sink: int = 4, window: int = 512, chunk_size: int = 2048, int8: bool = False,
          parts: Sequence[np.ndarray] = ()) -> Reading:
    """Forward the context up to max(layers) and keep what its query parts need.

    Default: one causal forward per segment (`cuts`, default one segment), each with its own KV cache, so a query
    part read after a segment sees all of it at every layer; contexts past HOST_CACHES_FROM tokens keep the caches
    in host memory, and accelerator memory holds one segment at a time. stream=True: ILRe's streaming prefill
    instead (chunks behind S sink + W window tokens, positions framed), whose query part sees only the frame at
    the lower layers: memory is bounded without segments, but the heads rank worse (docs/papers.md).
    int8 (CPU): through dynamically int8-quantized linear maps, about twice as fast.
    parts: query parts read in each segment's forward behind its tokens (`parts_mask`), kept in `Reading.asked`
    for `ask_parts`: a question then costs no forward of its own (not with stream=True: asked afterwards; not with
    int8, whose linear maps quantize each forward's activations by that forward's own range, so parts read together
    would not score as they do alone)."""
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
                keys[l][:, ch.start:ch.end] = backbone.apply_rope(ch.keys[l], ch.rope_positions, l)
        frame = np.concatenate([ids[:sink], ids[max(sink, len(ids) - window):]])
        return Reading(len(ids), [Segment(0, keys, None, frame)])
    from transformers import DynamicCache

    if int8 and len(parts):
        raise BackboneError("int8 reads ask their query parts one at a time (each forward is quantized by its own "
                            "range): pass no parts")
    cuts = list(cuts) if cuts is not None else [0, len(ids)]
    on_host = len(ids) >= HOST_CACHES_FROM and backbone.device.type != "cpu"
    parts = [np.asarray(p, dtype=np.int64) for p in parts]
    segments, asked = [], [[] for _ in parts]
    prefix = np.asarray(backbone.prefix, dtype=np.int64)
    p = len(prefix)
    for a, b in zip(cuts[:-1], cuts[1:]):
        cache = DynamicCache()
        lead = np.concatenate([prefix, ids[a:b]])
        n = len(lead)  # the cache's tokens: the prefix, then the segment's
        if parts:  # the segment, then every part behind it (`parts_mask`), in one forward
            store = _forward_parts(backbone, cache, lead, parts, n, layers, ("k", "q"), int8)
            for mine, queries in zip(asked, _part_queries(backbone, store, layers, parts, n, n)):
                mine.append(queries)
        else:
            x = torch.as_tensor(lead, device=backbone.device)[None]
            with backbone.lock, torch.inference_mode(), \
                    backbone.run_to(layers[-1], layers, ("k",), int8, projections_only=True) as store:
                backbone.decoder(input_ids=x, attention_mask=torch.ones_like(x), past_key_values=cache,
                                 use_cache=True)
        positions = torch.arange(p, n, device=backbone.device)
        stacked = torch.stack([store["k"][l][0][:, p:n] for l in layers])
        keys = by_layer(layers, backbone.layout.apply_rope_layers(stacked, layers, positions).to(backbone.dtype))
        if on_host:
            _move_cache(cache, "cpu")
            keys = {l: _to(k, "cpu") for l, k in keys.items()}
        segments.append(Segment(a, keys, cache, prefix=p))
    reading = Reading(len(ids), segments, on_host, int8)
    reading.asked = {_key(p, layers): queries for p, queries in zip(parts, asked)}
    return reading


# ---------------------------------------------------------------- query parts together

def shared_lead(parts: Sequence[np.ndarray]) -> int:
    """How many leading ids every part shares (at most all but the last of the shortest): read once, as its rows
    are the same in each (a second hop's evidence, "Question:")."""
    if len(parts) < 2:
        return 0
    shortest = min(len(p) for p in parts) - 1
    same = np.all([p[:shortest] == parts[0][:shortest] for p in parts[1:]], axis=0)
    return int(np.argmin(np.append(same, False)))


def parts_mask(before: int, parts: Sequence[np.ndarray], device) -> torch.Tensor:
    """Which keys each query part's token attends to, (1, 1, rows, before + rows) over the rows `_behind` lays
    out (the parts' shared lead once, then each part's tail): the `before` tokens in front of the parts (the
    context, read in this forward or cached), then its own part's tokens up to itself; never another part's, so
    each part reads as if it were asked alone. The rule is `group_mask`'s, which the CUDA graphs apply to the
    groups `_behind` gives the rows."""
    _, _, groups = _behind(np.empty(0, np.int64), parts, before)
    return group_mask(torch.as_tensor(np.concatenate([np.full(before, CONTEXT), groups]), device=device), before)


def _behind(context: np.ndarray, parts: Sequence[np.ndarray], start: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, positions, groups) of the rows of one forward: `context`, then the parts' shared lead once and each
    part's tail, every part at positions start, start + 1, ... (where it would be asked alone); each row's group
    (`parts_graph`: context, the lead, or part i's own, i + 1) says which rows it may see (`parts_mask`)."""
    lead = shared_lead(parts)
    ids = np.concatenate([context, parts[0][:lead], *(p[lead:] for p in parts)])
    positions = np.concatenate([np.arange(len(context)), np.arange(start, start + lead)] +
                               [np.arange(start + lead, start + len(p)) for p in parts])
    groups = np.concatenate([np.full(len(context), CONTEXT), np.full(lead, LEAD)] +
                            [np.full(len(p) - lead, i + 1) for i, p in enumerate(parts)])
    return ids.astype(np.int64), positions.astype(np.int64), groups.astype(np.int64)


def _part_queries(backbone, store, layers, parts, first_row: int, start: int) -> list[dict[int, torch.Tensor]]:
    """Each part's RoPE-rotated queries, layer -> (n_heads, len(part), d), out of one forward's captured states
    over `_behind`'s rows from `first_row` on: the shared lead's rows, then its tail's."""
    lead = shared_lead(parts)
    positions = torch.arange(start, start + max(len(p) for p in parts), device=backbone.device)
    states = torch.stack([store["q"][l][0] for l in layers])  # every layer rotated at once: one launch, not one each
    out, row = [], first_row + lead
    for p in parts:
        tail = len(p) - lead
        mine = torch.cat([states[:, :, first_row:first_row + lead], states[:, :, row:row + tail]], 2)
        out.append(by_layer(layers, backbone.layout.apply_rope_layers(mine, layers, positions[:len(p)])))
        row += tail
    return out


def by_layer(layers: Sequence[int], stacked: torch.Tensor) -> dict[int, torch.Tensor]:
    """layer -> its slice of `stacked` (one row per layer of `layers`): views, no copies."""
    return dict(zip(layers, stacked.unbind(0)))


def _key(part: np.ndarray, layers: Sequence[int]) -> tuple:
    return np.asarray(part, dtype=np.int64).tobytes(), tuple(layers)


def ask_parts(backbone, reading: Reading, parts: Sequence[np.ndarray], layers: Sequence[int]
              ) -> list[list[dict[int, torch.Tensor]]]:
    """`ask` for each of `parts`, in one forward per segment (`parts_mask`) instead of one per part and segment;
    a part the read already asked at these layers (`read(..., parts=)`) is taken from it, once."""
    layers = sorted({int(l) for l in layers})
    parts = [np.asarray(p, dtype=np.int64) for p in parts]
    out = [reading.asked.pop(_key(p, layers), None) for p in parts]
    todo = [i for i, got in enumerate(out) if got is None]
    # one part per forward where reading them together gains nothing (a streamed frame is recomputed per part) or
    # changes the scores (int8 quantizes each forward's activations by their own range)
    if todo and (reading.streamed or reading.int8):
        for i in todo:
            out[i] = ask(backbone, reading, parts[i], layers)
    elif todo:
        asked, todo_parts = [[] for _ in todo], [parts[i] for i in todo]
        for segment in reading.segments:
            cache = segment.cache
            if reading.on_host:
                _move_cache(cache, backbone.device)
            n = segment.cached
            store = _forward_parts(backbone, cache, np.empty(0, np.int64), todo_parts, n, layers, ("q",),
                                   reading.int8, threads=_read_threads(reading), back_to_host=reading.on_host)
            for mine, queries in zip(asked, _part_queries(backbone, store, layers, todo_parts, 0, n)):
                mine.append(queries)
        for i, queries in zip(todo, asked):
            out[i] = queries
    return out


def _forward_parts(backbone, cache, lead: np.ndarray, parts: list[np.ndarray], n: int, layers: Sequence[int],
                   capture: tuple[str, ...], int8: bool, threads=nullcontext(), back_to_host: bool = False) -> dict:
    """One forward of `lead` (the segment's tokens, or none when `cache` holds them) with every part behind its `n`
    tokens (`parts_mask`); the cache is cut back to the segment (and moved to the host, `back_to_host`). The
    hooked projections (`Backbone.run_to`) come back. On a GPU, a shape seen before replays a CUDA graph
    (`parts_graph.py`): the same states, to float tolerance, at one launch."""
    ids, pos, groups = _behind(lead, parts, n)
    with backbone.lock:  # a capture, a replay and the copies of its outputs, one thread at a time
        graph = None if int8 or back_to_host else \
            backbone.parts_graphs.get(backbone, n - len(lead), len(ids), layers, capture, context=len(lead))
        if graph is not None:
            store, kv = graph(ids, pos, groups, cache if not len(lead) else None, n - len(lead), context=len(lead))
            if len(lead):  # the segment's cache, copied out of the graph's buffers
                _fill_cache(cache, kv, n)
            # copies of the real rows' states: the next replay (another thread's, maybe) rewrites the outputs
            # (one stacked copy per kind and run of rows, not one per layer)
            runs = graph.runs(len(ids), len(lead))
            return {kind: by_layer(sorted(states), _stacked_rows(states, runs)) if states else {}
                    for kind, states in store.items()}
    x, pos = (torch.as_tensor(t, device=backbone.device)[None] for t in (ids, pos))
    mask = parts_mask(n, parts, backbone.device)
    if backbone.layout.window_binds(n + len(ids) - len(lead)):  # a part's row sees the segment and its own part
        rows = pos[0, len(lead):]
        mask = backbone.layout.window_masks(rows, torch.cat([torch.arange(n, device=rows.device), rows]), mask)
    with backbone.lock, torch.inference_mode(), threads, \
            backbone.run_to(layers[-1], layers, capture, int8, projections_only=True) as store, \
            context_then_parts(backbone):
        try:
            backbone.decoder(input_ids=x, position_ids=pos, attention_mask=mask, past_key_values=cache,
                                 use_cache=True)
        finally:
            cache.crop(n)
            if back_to_host:
                _move_cache(cache, "cpu")
    return store


def _fill_cache(cache, kv: dict[int, tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
    """An empty DynamicCache given the first `n` keys and values of every layer of `kv`, all copied in one launch
    (the next replay rewrites the graph's outputs). `cache.update` per layer cost two host-to-device allocations
    and a copy per layer: 46 waits on the host per question with the 1.5B model."""
    from transformers.cache_utils import DynamicLayer

    layers = sorted(kv)
    if cache.layers or layers != list(range(len(layers))):
        for l in layers:
            cache.update(kv[l][0][:, :, :n], kv[l][1][:, :, :n], l)
        return
    kept = torch.stack([t[:, :, :n] for l in layers for t in kv[l]])
    for i in range(len(layers)):
        layer = DynamicLayer()
        layer.keys, layer.values = kept[2 * i], kept[2 * i + 1]
        layer.dtype, layer.device, layer.is_initialized = kept.dtype, kept.device, True
        cache.layers.append(layer)


def _stacked_rows(states: dict[int, torch.Tensor], runs: list[tuple[int, int]]) -> torch.Tensor:
    """The layers' states (1, heads, rows, d) stacked, their rows `runs` [(first, count)] joined in order."""
    stacked = [torch.stack([states[l][:, :, a:a + r] for l in sorted(states)]) for a, r in runs]
    return stacked[0] if len(stacked) == 1 else torch.cat(stacked, dim=-2)


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
        for ch in backbone.stream(ids, layers, chunk_size=len(ids), capture=("q",)):
            positions = ch.rope_positions[start:].to(backbone.device)
            return [{l: backbone.apply_rope(q[:, start:], positions, l) for l, q in ch.queries.items()}]
    out = []
    x = torch.tensor(np.asarray(query_ids), device=backbone.device)[None]  # a copy: a kept encoding is read-only
    for segment in reading.segments:
        cache = segment.cache
        if reading.on_host:
            _move_cache(cache, backbone.device)
        n = segment.cached
        positions = torch.arange(n, n + len(query_ids), device=backbone.device)
        with backbone.lock, torch.inference_mode(), \
                backbone.run_to(layers[-1], layers, ("q",), reading.int8, projections_only=True) as store:
            try:
                backbone.decoder(input_ids=x, position_ids=positions[None], past_key_values=cache,
                                     attention_mask=torch.ones(1, n + len(query_ids), dtype=torch.long,
                                                               device=backbone.device), use_cache=True)
            finally:
                cache.crop(n)
                if reading.on_host:
                    _move_cache(cache, "cpu")
        out.append({l: backbone.apply_rope(store["q"][l][0], positions, l) for l in layers})
    return out
