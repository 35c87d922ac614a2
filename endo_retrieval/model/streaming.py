"""The streaming chunked prefill with early exit (`Backbone.stream`): layers after the deepest requested one never
run, and each chunk's pre-RoPE key (and query) states are handed out and dropped, so memory does not grow with the
stream; `independent` chunks (S3-Attention appendix I) or `sink_window` chunks that attend to S sink tokens and a
W-token sliding window (ILRe section 3.3). Its options are one `StreamOptions`.

Two things the model's family may ask for (families/): every forward begins with the family's prefix ids
(`Backbone.prefix`, e.g. Gemma's <bos>), whose states are never handed out; and where a layer attends through a
window of its own shorter than a forward (Gemma 3's sliding layers), the forward gets per-layer masks by the
tokens' places in the stream, so that layer's queries see only the keys within its window, as in one pass over the
stream (a sink_window frame is not contiguous: its sink lies further back than the frame's length says).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from endo_retrieval.model.chunk_graph import MIN_REPLAYS
from endo_retrieval.model.frame_cache import FrameCache
from endo_retrieval.model.locate import BackboneError

BATCH_TOKENS = 16384  # sink_window chunks forwarded together on CUDA (docs/ilre.md: 16k-128k within 20% at 1M)


@dataclass(frozen=True)
class StreamOptions:
    """How `stream_chunks` runs; each is the `Backbone.stream` argument of the same name, which says what it does."""

    chunk_size: int = 1024
    mode: str = "independent"
    sink: int = 4
    window: int = 512
    capture: Sequence[str] = ("k",)
    split_at: int | None = None
    positions: str = "frame"
    int8: bool = False
    start: int = 0
    batch_tokens: int | None = None
    frames: str = "recompute"
    compiled: bool = False


class ArrivingIds:
    """Token ids that arrive in pieces, e.g. from `Backbone.encode_pieces` while the model reads the first ones:
    `need(n)` takes pieces until n ids are here or none are left (the device runs the forwards queued before)."""

    def __init__(self, pieces: Iterator):
        self.pieces, self.ids, self.done = pieces, np.zeros(0, np.int64), False
        self._buffer = np.zeros(1 << 16, np.int64)

    def need(self, n: int) -> int:
        """Ids here once at least n are, or all of them: their count."""
        while len(self.ids) < n and not self.done:
            piece = next(self.pieces, None)
            if piece is None:
                self.done = True
                break
            piece, have = np.asarray(piece, dtype=np.int64).reshape(-1), len(self.ids)
            if have + len(piece) > len(self._buffer):  # doubling: each id is copied a bounded number of times
                self._buffer = np.concatenate([self._buffer[:have], np.zeros(max(have, len(piece)), np.int64)])
            self._buffer[have: have + len(piece)] = piece
            self.ids = self._buffer[: have + len(piece)]
        return len(self.ids)


@dataclass
class Chunk:
    """One step of the streaming prefill: absolute stream positions [start, end) and what was captured."""

    start: int
    end: int
    rope_positions: torch.Tensor  # (T,) positions RoPE used for these tokens
    keys: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (n_kv_heads, T, head_dim), pre-RoPE
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (n_heads, T, head_dim), pre-RoPE


def chunk_bounds(length: int, chunk_size: int, split_at: int | None = None) -> list[int]:
    """Chunk starts and the end of a stream of `length` ids: every `chunk_size`, and no chunk crossing `split_at`."""
    parts = [0, split_at, length] if split_at is not None and 0 < split_at < length else [0, length]
    return sorted({b for a, z in zip(parts[:-1], parts[1:]) for b in range(a, z, chunk_size)} | {length})


def to_device(device: torch.device, host: torch.Tensor) -> torch.Tensor:
    """A host tensor on the device, through pinned memory on CUDA (a copy from pageable memory waits for the
    device to finish its queue, and then the device waits for the host)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def checked_ids(backbone, ids, layers: Sequence[int], o: StreamOptions):
    """(ids, split_at, layers) as `stream_chunks` reads them: ids a tensor unless they arrive in pieces, split_at
    from the start (None: no split), layers sorted; BackboneError for an option it cannot honour."""
    split_at = o.split_at
    arriving = isinstance(ids, Iterator)
    if arriving and split_at is not None and split_at >= 0:
        raise BackboneError("With ids arriving in pieces, split_at counts from the end: pass a negative one.")
    if not arriving:
        ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))
        if ids.ndim != 1 or len(ids) == 0:
            raise BackboneError("stream() takes a non-empty 1-D sequence of token ids.")
        if split_at is not None and split_at < 0:
            split_at += len(ids)
        if split_at is not None and not 0 < split_at < len(ids):  # nothing to split
            split_at = None
    if o.mode not in ("independent", "sink_window"):
        raise BackboneError(f"Unknown mode {o.mode!r}; use 'independent' or 'sink_window'.")
    if o.chunk_size < 1 or o.sink < 0 or o.window < 0:
        raise BackboneError("chunk_size must be >= 1 and sink, window >= 0.")
    if o.positions not in ("frame", "absolute", "dca"):
        raise BackboneError(f"Unknown positions {o.positions!r}; use 'frame', 'absolute' or 'dca'.")
    if not set(o.capture) <= {"k", "q"}:
        raise BackboneError("capture takes 'k' and/or 'q'.")
    layers = backbone.layout.check_layers(layers)
    if o.frames not in ("recompute", "cache"):
        raise BackboneError(f"Unknown frames {o.frames!r}; use 'recompute' or 'cache'.")
    if o.compiled and o.int8:
        raise BackboneError("compiled and int8 exclude each other; int8 runs its own quantized layers.")
    if o.frames == "cache" and (o.mode != "sink_window" or o.positions == "dca" or o.start or o.int8):
        raise BackboneError("frames='cache' streams one whole sink_window pass with 'frame' or 'absolute' "
                            "positions (no dca, start or int8).")
    if o.frames == "cache" and (backbone.prefix or backbone.layout.window_binds(o.sink + o.window + o.chunk_size)):
        why = backbone.spec.refused.get("frames=cache") or (
            f"its sequences begin with {len(backbone.prefix)} prefix id(s)" if backbone.prefix else
            f"some of its layers attend through windows of their own ({sorted({w for w in backbone.windows if w})})")
        raise BackboneError(f"frames='cache' keeps one sink + window frame of keys for every layer, which a "
                            f"{backbone.family} model cannot use: {why}. Use frames='recompute'.")
    return ids, split_at, layers


def stream_chunks(backbone, ids, layers: Sequence[int], options: StreamOptions) -> Iterator[Chunk]:
    """`Backbone.stream`: forward `ids` chunk by chunk up to max(layers) only, yielding each chunk's pre-RoPE
    states; checks the options as it starts (`checked_ids`)."""
    o = options
    chunk_size, mode, sink, window, capture = o.chunk_size, o.mode, o.sink, o.window, o.capture
    positions, int8, start, batch_tokens, frames, compiled = (o.positions, o.int8, o.start, o.batch_tokens, o.frames,
                                                              o.compiled)
    ids, split_at, layers = checked_ids(backbone, ids, layers, o)
    arriving = isinstance(ids, Iterator)
    if batch_tokens is None:  # a CPU is bound by arithmetic already
        batch_tokens = BATCH_TOKENS if backbone.device.type == "cuda" else 0
    source = ArrivingIds(ids if arriving else iter([ids.numpy()]))
    back = 0 if split_at is None else (-split_at if arriving else len(ids) - split_at)
    bounds = arriving_bounds(source, chunk_size, back)
    if frames == "cache":
        yield from stream_cached(backbone, source, bounds, layers, capture, sink, window, positions, batch_tokens,
                                 compiled)
        return
    # sink_window: the chunk is forwarded behind its S sink tokens and the W tokens before it. "frame" places
    # them at 0..S+W+T-1, so every query-key distance stays inside the trained window however long the stream
    # (absolute positions past an 8k window lost every passkey at 32k: docs/ilre.md).
    spans = (((min(sink, s), min(s, max(sink, s - window))) if mode == "sink_window" else (0, s)) + (s, e)
             for s, e in bounds)
    seen: Counter = Counter()  # forwards of each shape in this stream
    graphed = backbone.chunk_graphs.enabled and backbone.device.type == "cuda" and not (int8 or compiled)
    prefix = np.asarray(backbone.prefix, dtype=np.int64)
    p = len(prefix)
    for batch in batches(spans, start, batch_tokens if mode == "sink_window" else 0):
        x = torch.from_numpy(np.stack([np.concatenate([prefix, source.ids[:n_sink], source.ids[w0:e]])
                                       for _, (n_sink, w0, _, e) in batch]))
        pos = torch.stack([torch.cat([torch.arange(p), p + frame_positions(i, n_sink, w0, e, chunk_size, mode,
                                                                           positions)])
                           for i, (n_sink, w0, _, e) in batch])
        x, device_pos = (to_device(backbone.device, t) for t in (x, pos))
        shape = tuple(x.shape)
        seen[shape] += 1  # a capture costs about 3 forwards: a shape is captured once it has come MIN_REPLAYS times
        # a layer whose window is shorter than the forward: no graph (its causal kernel knows no window), and a
        # sink_window frame, which is not contiguous, gets masks by the tokens' places in the stream (an
        # independent chunk is contiguous: the model's own masks are right)
        binds = backbone.layout.window_binds(shape[1])
        if graphed and not binds and (seen[shape] >= MIN_REPLAYS or backbone.chunk_graphs.has(shape, layers, capture)):
            with backbone.lock:  # a repeated shape, or one captured before: replayed (chunk_graph.py)
                store = backbone.chunk_graphs.get(shape, layers, capture)(x, device_pos)
        else:  # an explicit all-ones mask: else transformers reads a jump in position_ids as a new packed
            # sequence and hides the sink from the chunk
            mask = torch.ones_like(x)
            if binds and mode == "sink_window":
                mask = stream_masks(backbone, [(n_sink, w0, e) for _, (n_sink, w0, _, e) in batch], p)
            with backbone.lock, torch.inference_mode(), \
                    backbone.run_to(layers[-1], layers, capture, int8, compiled, projections_only=True) as store:
                backbone.decoder(input_ids=x, position_ids=device_pos, attention_mask=mask, use_cache=False)
        for b, (_, (n_sink, w0, s, e)) in enumerate(batch):
            n = p + n_sink + s - w0
            yield Chunk(s, e, pos[b, n:], keys={l: k[b, :, n:] for l, k in store["k"].items()},
                        queries={l: q[b, :, n:] for l, q in store["q"].items()})


def stream_masks(backbone, frames: list[tuple[int, int, int]], prefix: int):
    """Per-layer masks (`Layout.window_masks`) of a batch of forwards of `prefix` ids, a sink of n_sink ids and
    the ids [w0, e), (n_sink, w0, e) per batch row: causal, and in a windowed layer only the keys within its window
    by their places in the stream (the prefix just before its start)."""
    places = torch.stack([torch.cat([torch.arange(-prefix, 0), torch.arange(n_sink), torch.arange(w0, e)])
                          for n_sink, w0, e in frames]).to(backbone.device)
    n = places.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=backbone.device).tril()
    masks = backbone.layout.window_masks(places, places, causal)
    return {k: m[:, None] for k, m in masks.items()} if isinstance(masks, dict) else masks[:, None]


def stream_cached(backbone, source: ArrivingIds, bounds: Iterator[tuple[int, int]], layers: list[int],
                  capture: Sequence[str], sink: int, window: int, positions: str, batch_tokens: int,
                  compiled: bool) -> Iterator[Chunk]:
    """`stream` with the frame cached (frame_cache.py): each chunk forwards its own tokens only; chunks whose
    frame is a full sink + window (and of one length, at least W) go through the model several at a time.
    Nothing in the loop waits for the device, so the host tokenises and queues the next forward while the
    device runs."""
    frame = FrameCache(backbone, sink, window, positions)
    batch: list[tuple[int, int]] = []

    def forward(batch):
        return forward_cached(backbone, source, batch, layers, capture, frame, compiled)

    for s, e in bounds:
        steady = s >= sink + window and e - s >= window  # its frame is S + W; its own last W are a frame
        if batch and steady and e - s == batch[0][1] - batch[0][0] and (len(batch) + 1) * (e - s) <= batch_tokens:
            batch.append((s, e))
            continue
        if batch:
            yield from forward(batch)
        batch = [(s, e)]
        if not steady:  # alone: its frame is still filling
            yield from forward(batch)
            batch = []
    if batch:
        yield from forward(batch)


def arriving_bounds(source: ArrivingIds, chunk_size: int, back: int) -> Iterator[tuple[int, int]]:
    """The chunks of `chunk_bounds` while the ids arrive: a whole chunk once its ids and the `back` ids after it
    are here, the rest once all are."""
    s = 0
    while source.need(s + chunk_size + back) >= s + chunk_size + back:
        yield s, s + chunk_size
        s += chunk_size
    total = source.need(s + chunk_size + back)
    if total == 0:
        raise BackboneError("stream() takes a non-empty 1-D sequence of token ids.")
    bounds = [b for b in chunk_bounds(total, chunk_size, total - back if back else None) if b >= s]
    yield from zip(bounds[:-1], bounds[1:])


def forward_cached(backbone, source: ArrivingIds, batch: list[tuple[int, int]], layers: list[int],
                   capture: Sequence[str], frame, compiled: bool) -> Iterator[Chunk]:
    """One forward of consecutive chunks [s, e) of one length, a batch row each, through the frame cache."""
    (first, _), rows, length = batch[0], len(batch), batch[0][1] - batch[0][0]
    x = to_device(backbone.device, torch.from_numpy(source.ids[first: first + rows * length]).view(rows, length))
    # every row sits right behind a frame of the same length ("frame"), or at its own place ("absolute");
    # made on each side, as a copy from pageable host memory would wait for the device
    start, step = (frame.length, 0) if frame.positions == "frame" else (first, length)
    pos, device_pos = ((torch.arange(length, device=d) + start + step * torch.arange(rows, device=d)[:, None])
                       for d in ("cpu", backbone.device))
    with backbone.lock, torch.inference_mode(), frame.attending(), \
            backbone.run_to(layers[-1], layers, capture, compiled=compiled, projections_only=True) as store:
        backbone.decoder(input_ids=x, position_ids=device_pos, use_cache=False)
        frame.advance(*batch[-1])
    for b, (s, e) in enumerate(batch):
        yield Chunk(s, e, pos[b], keys={l: k[b] for l, k in store["k"].items()},
                    queries={l: q[b] for l, q in store["q"].items()})


def frame_positions(i: int, n_sink: int, w0: int, e: int, chunk_size: int, mode: str, positions: str
                    ) -> torch.Tensor:
    """RoPE positions of chunk i's forwarded tokens (sink, window, chunk), on the host."""
    if mode == "independent" or positions == "frame":
        return torch.arange(n_sink + e - w0)
    # [ILRe Eq. 6]: chunk i (1-based) re-RoPEs the sink by (i-2) D_C for i > 2; i - 2 = this loop's i - 1
    shift = (i - 1) * chunk_size if positions == "dca" and i >= 2 else 0
    return torch.cat([torch.arange(n_sink) + shift, torch.arange(w0, e)])


def batches(spans: Iterable[tuple], start: int, batch_tokens: int) -> Iterator[list[tuple[int, tuple]]]:
    """(stream index, span) of consecutive spans of one forwarded length, up to batch_tokens tokens per forward
    (at least one span; 0: one span each). Sink + window chunks are independent of one another (each
    recomputes its frame), so a batch of them gives each chunk the states it gets alone, in fewer and larger
    launches."""
    batch, length = [], 0
    for i, (n_sink, w0, s, e) in enumerate(spans):
        if s < start:
            continue
        n = n_sink + e - w0
        if batch and (n != length or n * (len(batch) + 1) > batch_tokens):
            yield batch
            batch = []
        batch.append((i, (n_sink, w0, s, e)))
        length = n
    if batch:
        yield batch
