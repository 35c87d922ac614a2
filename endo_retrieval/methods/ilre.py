"""ILRe: Intermediate Layer Retrieval (ILRe sections 3.2-3.4, [ILRe Alg. 1]).

A streaming chunked prefill runs the backbone only up to one intermediate layer l_R (later layers never run);
lower layers keep S sink + W window tokens, l_R keeps the full-length key cache. The query part (question plus
answer prefix) is prefilled after the context; its attention to the context at l_R, maxed over heads and query
positions [ILRe Eq. 4-5], is pooled by 3 max x 16 average kernels that share the budget [ILRe Alg. 1]. The kept tokens
are gathered back to source text. l_R comes from the passkey calibration (`endo calibrate-ilre`, appendix A.1).
"""
from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain
from typing import ClassVar, Iterator, Sequence

import numpy as np
import torch

from endo_retrieval.core import Compressed, Span, check_budget
from endo_retrieval.model.backbone import Backbone, Encoding, PIECE_CHARS
from endo_retrieval.model.profiles import ilre_profile, ilre_profile_path, missing
from endo_retrieval.scoring.attention import attention_scores
from endo_retrieval.scoring.select import runs

DEFAULT_MAX_KERNELS = (2, 4, 8)
DEFAULT_AVG_KERNELS = tuple(range(1, 17))
PARALLEL_FROM = 65536  # context tokens from which the allocation ranks its kernel combinations in threads
POSITIONS = ("frame", "dca", "absolute")  # RoPE layouts of the streaming prefill (ILRe.positions)


class ILReError(ValueError):
    """Bad input or missing calibration for ILRe; the message says what to do."""


# ---------------------------------------------------------------- [ILRe Alg. 1]: context allocation


def _check_allocation_args(scores, budget: int, sink: int, max_kernels, avg_kernels) -> np.ndarray:
    a = scores.detach().float().cpu().numpy() if isinstance(scores, torch.Tensor) else np.asarray(scores)
    a = a.astype(np.float64)
    if a.ndim != 1:
        raise ILReError(f"scores must be 1-D (one attention weight per context token), got shape {a.shape}.")
    if np.isnan(a).any():
        raise ILReError("scores contain NaN; check the attention computation (e.g. an empty query part).")
    check_budget(budget)
    if sink < 0 or sink > budget:
        raise ILReError(f"sink must lie in 0..budget ({budget}), got {sink}.")
    if not max_kernels or not avg_kernels or min(max_kernels) < 1 or min(avg_kernels) < 1:
        raise ILReError("max_kernels and avg_kernels must be non-empty lists of sizes >= 1.")
    return a


def combination_budgets(budget: int, sink: int, n_combinations: int) -> list[int]:
    """B_c per (max, avg) combination: the budget after the sink, split evenly; the first `remainder`
    combinations (in loop order, max kernel outer) take one token more, so the total is met exactly."""
    base, extra = divmod(budget - sink, n_combinations)
    return [base + (c < extra) for c in range(n_combinations)]


def max_pool(a: np.ndarray, size: int) -> np.ndarray:
    """MaxPooling with size = stride = m [ILRe Alg. 1]; the last window may be partial."""
    padded = np.full(math.ceil(len(a) / size) * size, -np.inf)
    padded[: len(a)] = a
    return padded.reshape(-1, size).max(axis=1)


def avg_pool_same(a: np.ndarray, size: int) -> np.ndarray:
    """AvgPooling with stride 1 and 'same' length: window [p - (n-1)//2, p + n//2], mean over the part inside."""
    p = np.arange(len(a))
    lo, hi = np.maximum(p - (size - 1) // 2, 0), np.minimum(p + size // 2 + 1, len(a))
    prefix = np.concatenate([[0.0], np.cumsum(a)])
    return (prefix[hi] - prefix[lo]) / (hi - lo)


def _top_ranked(x: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k highest values (ties: lower position first), highest first; more than k on ties."""
    if k < len(x):
        threshold = np.partition(x, len(x) - k)[len(x) - k]
        candidates = np.flatnonzero(x >= threshold)
    else:
        candidates = np.arange(len(x))
    return candidates[np.lexsort((candidates, -x[candidates]))]


def allocate(scores: np.ndarray | torch.Tensor, budget: int, sink: int = 4,
             max_kernels: Sequence[int] = DEFAULT_MAX_KERNELS,
             avg_kernels: Sequence[int] = DEFAULT_AVG_KERNELS) -> np.ndarray:
    """[ILRe Alg. 1]: sorted unique token indices, exactly `budget` of them when len(scores) > budget.

    `scores` is A^C over the whole context (L,); its first `sink` entries are ignored (A^C "without sink part").
    The sink is kept and counts towards `budget`, so the kept context never exceeds it (the paper adds B to S).
    """
    a = _check_allocation_args(scores, budget, sink, max_kernels, avg_kernels)
    n = len(a)
    if n <= budget:
        return np.arange(n, dtype=np.int64)
    scored = a[sink:]
    combinations = [(m, size) for m in max_kernels for size in avg_kernels]
    pooled = {m: max_pool(scored, m) for m in max_kernels}

    def ranking(combination: tuple[int, int]) -> np.ndarray:  # K_m = B/m + 1 windows give > B tokens
        m, size = combination
        return _top_ranked(avg_pool_same(pooled[m], size), math.ceil((budget - sink) / m) + 1)

    # each combination's ranking is independent of the others (numpy runs them without the GIL), so a long
    # context ranks them on several cores; only taking their tokens is sequential
    if n >= PARALLEL_FROM:
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            rankings = list(pool.map(ranking, combinations))
    else:
        rankings = [ranking(c) for c in combinations]
    taken = np.zeros(n, dtype=bool)
    taken[:sink] = True  # I starts with the sink indices
    for (m, _), windows, b_c in zip(combinations, rankings, combination_budgets(budget, sink, len(combinations))):
        tokens = (sink + windows[:, None] * m + np.arange(m)).ravel()  # map back to indices of C
        tokens = tokens[tokens < n]
        fresh = tokens[~taken[tokens]][:b_c]  # already-allocated tokens are skipped
        taken[fresh] = True
    return np.flatnonzero(taken).astype(np.int64)


def allocate_reference(scores, budget: int, sink: int = 4, max_kernels=DEFAULT_MAX_KERNELS,
                       avg_kernels=DEFAULT_AVG_KERNELS) -> np.ndarray:
    """Naive pure-Python twin of `allocate` (the tests hold one against the other)."""
    a = [float(v) for v in _check_allocation_args(scores, budget, sink, max_kernels, avg_kernels)]
    n = len(a)
    if n <= budget:
        return np.arange(n, dtype=np.int64)
    chosen = set(range(sink))
    scored = a[sink:]
    shares = combination_budgets(budget, sink, len(max_kernels) * len(avg_kernels))
    c = 0
    for m in max_kernels:
        pooled = [max(scored[p: p + m]) for p in range(0, len(scored), m)]
        for size in avg_kernels:
            avg = []
            for p in range(len(pooled)):
                window = pooled[max(0, p - (size - 1) // 2): p + size // 2 + 1]
                avg.append(sum(window) / len(window))
            ranking = sorted(range(len(pooled)), key=lambda p: (-avg[p], p))
            added = 0
            for p in ranking:
                for t in range(sink + p * m, min(sink + (p + 1) * m, n)):
                    if added < shares[c] and t not in chosen:
                        chosen.add(t)
                        added += 1
            c += 1
    return np.array(sorted(chosen), dtype=np.int64)


def check_global_layers(backbone, layers: list[int]) -> None:
    """l_R must attend to the whole past: a sliding-window layer's A^C [ILRe Eq. 5] would weigh keys its queries
    never attended to in training (Gemma 3's sliding heads score gold near chance past their window: docs/models.md,
    Gemma 3, 'Which heads retrieve')."""
    sliding = [l for l in layers if backbone.windows[l] is not None]
    if sliding:
        whole = [l for l, w in enumerate(backbone.windows) if w is None]
        raise ILReError(f"layer {', '.join(map(str, sliding))} of {backbone.model_id} attends through a "
                        f"{backbone.windows[sliding[0]]}-token sliding window; ILRe's l_R must see the whole past: "
                        f"use one of layers {', '.join(map(str, whole))}.")


# ---------------------------------------------------------------- [ILRe Eq. 4-5]: query-to-context attention at l_R


def dca_key_positions(key_positions: torch.Tensor, chunk_starts: Sequence[int]) -> torch.Tensor:
    """[ILRe Eq. 7]: re-RoPE the l_R keys of chunk i < N_C - 1 by D_i, the distance to chunk N_C - 1 (the one before the
    last, which may be short), so every key lies within two chunks of the query part."""
    if len(chunk_starts) < 3:
        return key_positions
    base = chunk_starts[-2]
    shifted = key_positions.clone()
    for start, end in zip(chunk_starts[:-2], chunk_starts[1:-1]):
        shifted[start:end] += base - start
    return shifted


# ---------------------------------------------------------------- section 3.3: prefill to l_R only


@dataclass
class LayerStates:
    """What one streaming pass leaves at one layer: the full-length key cache and the query part's queries."""

    keys: torch.Tensor  # (n_kv, L, d) pre-RoPE, pre-allocated
    queries: torch.Tensor  # (n_heads, Lq, d) pre-RoPE
    key_positions: torch.Tensor  # (L,) RoPE positions of the context tokens
    query_positions: torch.Tensor  # (Lq,)
    chunk_starts: list[int] = field(default_factory=list)  # context chunk boundaries (for DCA)


def _preallocate(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The l_R key cache: on the accelerator when it fits, else in (pinned) host memory."""
    try:
        return torch.empty(shape, device=device)
    except torch.OutOfMemoryError:
        return torch.empty(shape, pin_memory=torch.cuda.is_available())


def prefill(backbone, context_ids: np.ndarray | Iterator[np.ndarray], query_ids: np.ndarray, layers: Sequence[int], *,
            sink: int = 4, window: int = 512, chunk_size: int = 1024, positions: str = "frame",
            batch_tokens: int | None = None, frames: str = "recompute", compiled: bool = False
            ) -> dict[int, LayerStates]:
    """One streaming chunked prefill of context + query part, run only up to max(layers) (early exit).

    Lower layers see sink + window tokens (the Lambda-shaped mask); each layer in `layers` keeps its full-length
    context keys and the query part's queries. The query part is its own chunk (split_at = len(context)).
    Passing several layers captures them all in one pass (the calibration does this). `positions`: the RoPE
    layout of `Backbone.stream` ("frame", "absolute", or "dca" for [ILRe Eq. 6]); `batch_tokens`: chunks forwarded
    together (each still sees only its own frame; 0: one chunk per forward); `frames`: "recompute" the sink + window
    frame with each chunk, or "cache" it per layer as [ILRe section 3.4] does; `compiled`: the layers below the
    captured ones run through torch.compile (`Backbone.stream`). `context_ids` may be an iterator over pieces of
    the ids, read as they arrive (tokenising overlaps the forwards).
    """
    if isinstance(context_ids, Iterator):
        return _prefill_arriving(backbone, context_ids, np.asarray(query_ids), layers, sink=sink, window=window,
                                 chunk_size=chunk_size, positions=positions, batch_tokens=batch_tokens,
                                 frames=frames, compiled=compiled)
    length = len(context_ids)
    shape = (backbone.n_kv_heads, length, backbone.head_dim)
    keys = {l: _preallocate(shape, backbone.device) for l in layers}
    key_positions = torch.empty(length, dtype=torch.long)
    queries: dict[int, list[torch.Tensor]] = {l: [] for l in layers}
    query_positions, chunk_starts = [], []
    ids = np.concatenate([np.asarray(context_ids), np.asarray(query_ids)])
    for ch in backbone.stream(ids, layers, chunk_size=chunk_size, mode="sink_window", sink=sink, window=window,
                              capture=("k", "q"), split_at=length, positions=positions, batch_tokens=batch_tokens,
                              frames=frames, compiled=compiled):
        if ch.start < length:
            chunk_starts.append(ch.start)
            key_positions[ch.start:ch.end] = ch.rope_positions.cpu()
            for l in layers:
                keys[l][:, ch.start:ch.end] = ch.keys[l]
        else:
            query_positions.append(ch.rope_positions.cpu())
            for l in layers:
                queries[l].append(ch.queries[l])
    q_pos = torch.cat(query_positions)
    return {l: LayerStates(keys[l], torch.cat(queries[l], dim=1), key_positions, q_pos, chunk_starts)
            for l in layers}


def _prefill_arriving(backbone, pieces: Iterator[np.ndarray], query_ids: np.ndarray, layers: Sequence[int],
                      **stream) -> dict[int, LayerStates]:
    """`prefill` of a context whose ids arrive in pieces: the length is known only at the end, so the chunks' keys
    are joined then (a moment at twice their memory), and the chunks that may still be the query part (its last
    len(query_ids) tokens) are held until then."""
    chunks, recent = [], []
    for ch in backbone.stream(chain(pieces, [query_ids]), layers, mode="sink_window", capture=("k", "q"),
                              split_at=-len(query_ids), **stream):
        chunks.append((ch.start, ch.rope_positions.cpu(), {l: ch.keys[l] for l in layers}))
        recent = [c for c in recent if c.end > ch.end - len(query_ids)] + [ch]
    length = chunks[-1][0] + len(chunks[-1][1]) - len(query_ids)
    context = [c for c in chunks if c[0] < length]
    query = [c for c in recent if c.start >= length]
    key_positions = torch.cat([pos for _, pos, _ in context])
    q_pos = torch.cat([c.rope_positions.cpu() for c in query])
    return {l: LayerStates(torch.cat([k[l] for *_, k in context], dim=1), torch.cat([c.queries[l] for c in query], 1),
                           key_positions, q_pos, [start for start, *_ in context]) for l in layers}


def context_scores(backbone, states: LayerStates, dca: bool = False) -> np.ndarray:
    """A^C [ILRe Eq. 5] from one layer's states, optionally with the DCA key positions ([ILRe Eq. 7]; meant for states
    prefilled with positions="dca", whose key positions are absolute)."""
    key_positions = dca_key_positions(states.key_positions, states.chunk_starts) if dca else states.key_positions
    return attention_scores(states.keys, states.queries, key_positions, states.query_positions, backbone.apply_rope)


# ---------------------------------------------------------------- the method


@dataclass
class ILRe:
    """ILRe: keep the context tokens that the query part attends to most at one
    intermediate layer l_R, allocated by multi-kernel pooling [ILRe Alg. 1].

    layer None takes the calibrated l_R from the shipped profile of the backbone's model.
    """

    name: ClassVar[str] = "ilre"
    query_template: ClassVar[str] = "\n\nQuestion: {question}\nAnswer:"

    backbone: object = None
    layer: int | None = None
    sink: int = 4
    window: int = 512
    chunk_size: int = 1024
    query_tokens: int = 64
    max_kernels: tuple[int, ...] = DEFAULT_MAX_KERNELS
    avg_kernels: tuple[int, ...] = DEFAULT_AVG_KERNELS
    # RoPE layout of the streaming prefill: "frame" keeps every distance inside the trained window by
    # construction (our default: 1.0 passkey recall to 128k, docs/ilre.md); "dca" is the paper's Dual Chunk
    # Attention ([ILRe Eq. 6] in the lower layers, [ILRe Eq. 7] at l_R); "absolute" is the paper's ILRe without DCA.
    positions: str = "frame"
    # the sink + window frame: "recompute" it with each chunk (chunks are then independent, and a small model
    # forwards them in batches), or "cache" its keys and values per layer as [ILRe section 3.4] does (1/1.5 of the
    # arithmetic at 1024-token chunks: the faster choice for a large model; docs/ilre.md)
    frames: str = "recompute"
    # the layers below l_R through torch.compile (fused elementwise work; each new shape compiles first): with
    # frames="cache", the large-model setting on a GPU (docs/ilre.md)
    compiled: bool = False

    def __post_init__(self):
        self.backbone = Backbone.of(self.backbone)  # None: the default model; a path: that model, shared
        if self.layer is None:
            profile = ilre_profile(self.backbone)
            if profile is None:
                raise ILReError(missing(self.backbone, "ilre", ilre_profile_path(self.backbone))
                                + " Or pass layer=N.")
            self.layer = int(profile["layer"])
        if not 0 <= self.layer < self.backbone.n_layers:
            raise ILReError(f"layer must lie in 0..{self.backbone.n_layers - 1}, got {self.layer}.")
        check_global_layers(self.backbone, [self.layer])
        if self.positions not in POSITIONS:
            raise ILReError(f"positions must be one of {POSITIONS}, got {self.positions!r}.")
        if self.query_tokens < 1 or self.chunk_size < 1 or self.window < 0 or self.sink < 0:
            raise ILReError("query_tokens and chunk_size must be >= 1, window and sink >= 0.")

    def scores(self, context_ids: np.ndarray | Iterator[np.ndarray], query_ids: np.ndarray) -> np.ndarray:
        """A^C at l_R [ILRe Eq. 5] of the context tokens for this query part: one early-exit streaming prefill
        (`context_ids` may be an iterator over pieces of them, read as they arrive)."""
        self.check_query(query_ids)
        states = prefill(self.backbone, context_ids, query_ids, [self.layer], sink=self.sink, window=self.window,
                         chunk_size=self.chunk_size, positions=self.positions, frames=self.frames,
                         compiled=self.compiled)[self.layer]
        return context_scores(self.backbone, states, dca=self.positions == "dca")

    def check_query(self, query_ids: np.ndarray) -> None:
        """The query part must fit the window W the model reads it in."""
        if len(query_ids) > self.window:
            raise ILReError(
                f"The query part is {len(query_ids)} tokens, longer than the window W={self.window}: pass the "
                f"question alone, or a whole prompt to compress_prompt(), which keeps its last {self.query_tokens}.")

    def select(self, context_ids: np.ndarray, query_ids: np.ndarray, budget: int) -> np.ndarray:
        """Sorted indices of the context tokens to keep (at most `budget`): prefill, [ILRe Eq. 4-5], [ILRe Alg. 1]."""
        check_budget(budget)
        if len(context_ids) <= budget:
            return np.arange(len(context_ids), dtype=np.int64)
        return self.allocate(self.scores(context_ids, query_ids), budget)

    def compress(self, context: str, question: str, budget: int) -> Compressed:
        """Keep at most `budget` tokens of `context` that answer `question`, in source order."""
        check_budget(budget)
        if not isinstance(question, str) or not question.strip():
            raise ILReError("question is empty: ILRe ranks the context by the question's attention; give one.")
        query_ids = self.backbone.encode(self.query_template.format(question=question.strip())).ids
        self.check_query(query_ids)
        if len(context) > PIECE_CHARS:  # several pieces: the model reads the first while the rest are tokenised
            pieces: list[Encoding] = []
            scores = self.scores(self.backbone.tokens.arriving_ids(context, pieces), query_ids)
            enc = Encoding.join(pieces)
        else:
            enc = self.backbone.encode(context)
            scores = None if len(enc) <= budget else self.scores(enc.ids, query_ids)
        if len(enc) <= budget:
            return self._compressed(context, enc, np.arange(len(enc)), budget)
        return self._fit(context, enc, scores, budget)

    def compress_prompt(self, prompt: str, budget: int) -> Compressed:
        """LongBench protocol: the last `query_tokens` tokens of a whole prompt are the query part, kept whole
        (they count towards `budget`); the tokens before them are the context, compressed to the rest."""
        if budget <= self.query_tokens:
            raise ILReError(f"budget ({budget}) must exceed query_tokens ({self.query_tokens}) for a whole prompt.")
        enc = self.backbone.encode(prompt)
        if len(enc) <= budget:
            return self._compressed(prompt, enc, np.arange(len(enc)), budget)
        split = len(enc) - self.query_tokens
        tail = np.arange(split, len(enc))
        return self._fit(prompt, enc, self.scores(enc.ids[:split], enc.ids[split:]), budget, tail)

    def allocate(self, scores: np.ndarray, budget: int) -> np.ndarray:
        """Sorted indices of at most `budget` tokens to keep given their scores [ILRe Alg. 1], sinks first."""
        return allocate(scores, budget, min(self.sink, budget), self.max_kernels, self.avg_kernels)

    def _fit(self, text: str, enc, scores: np.ndarray, budget: int, tail: np.ndarray = np.empty(0, np.int64)
             ) -> Compressed:
        """[ILRe Alg. 1] at the budget; the newline between runs can cost tokens when the text is re-encoded, so the
        allocation shrinks by the excess until the joined text fits."""
        target = budget - len(tail)
        while True:
            out = self._compressed(text, enc, np.concatenate([self.allocate(scores, target), tail]), budget, scores)
            if out.n_tokens <= budget or target == 1:
                return out
            target = max(1, target - (out.n_tokens - budget))

    def _compressed(self, text: str, enc, keep: np.ndarray, budget: int, scores: np.ndarray | None = None
                    ) -> Compressed:
        spans = []
        for start, end in runs(np.asarray(keep)):
            cs, ce = int(enc.offsets[start, 0]), int(enc.offsets[end - 1, 1])
            score = float(scores[start:end].max(initial=0.0)) if scores is not None else 0.0
            spans.append(Span(start, end, cs, ce, text[cs:ce], score=score, signals=("ilre",),
                              metadata={"layer": self.layer}))
        joined = "\n".join(s.text for s in spans)
        return Compressed(joined, spans, self.backbone.count_tokens(joined), self.name, budget)
