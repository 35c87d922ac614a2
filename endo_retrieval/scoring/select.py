"""Adaptive granularity (S3 section 3.5; [S3 Alg. 1] lines 22-23): scores -> density -> peaks -> spans.

S' = Conv1D(S) with a box kernel (Table 6: 48, or 8 for QA); greedy non-maximum suppression picks density peaks
(Table 6: N = 40 centres); each peak grows to its enclosing sentence and spans are taken in peak order until the
token budget is filled.

How the budget is filled: whole sentences are added peak by peak (a sentence already taken adds nothing); the first
sentence that does not fit is trimmed around its peak to exactly the tokens left, so the budget is met exactly and
never exceeded. Fewer tokens come back only when the peaks run out: with `fill=True` (default) NMS keeps going past
the top N centres until the budget is met or no position with positive density is left; with `fill=False` it
stops at N, as the paper does. A sentence longer than the whole budget is likewise trimmed around its peak.
Methods that rank whole sentences (heads, endo) fill the budget by the same rule, in rank order (`sentence_spans`).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from endo_retrieval.core import Span, check_budget

QA_KERNEL = 8  # Table 6, "Convolution Kernel Size for QA"
DEFAULT_KERNEL = 48  # Table 6
TOP_CENTRES = 40  # Table 6, "Retrieval Top Centers (N)"


def density(scores: np.ndarray, kernel: int = QA_KERNEL, segment_bounds: np.ndarray | None = None) -> np.ndarray:
    """Semantic density curve S' = Conv1D(S): box-kernel mean, zero-padded, same length (as np.convolve 'same').

    With `segment_bounds` (sorted document boundaries) each segment is smoothed on its own, so one document's hits
    never raise the density of its neighbour (or of a removed document's empty range).
    """
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1:
        raise ValueError(f"scores must be 1-D, got shape {s.shape}")
    if int(kernel) != kernel or kernel < 1:
        raise ValueError(f"kernel must be a positive integer, got {kernel}")
    if kernel == 1:  # the window is the position itself
        return s.astype(np.float32)
    # window of position t: [t - kernel//2, t + (kernel-1)//2], clipped to t's segment (zero padding beyond). Each
    # window is summed in one fixed order (kernel shifted adds), so a position's density does not depend on where its
    # document lies in the corpus: a shard's curve equals the whole index's bit for bit (a prefix sum carries the
    # rounding of everything before it). Only positions within a kernel of a bound (0 and n among them) are clipped.
    n, back = len(s), kernel // 2
    padded = np.zeros(n + kernel - 1)
    padded[back: back + n] = s
    total = np.zeros(n)
    for j in range(kernel):
        total += padded[j: j + n]
    bounds = np.unique(np.clip(np.concatenate(([0], np.asarray(
        segment_bounds if segment_bounds is not None else [], dtype=np.int64), [n])), 0, n))
    near = (bounds[:, None] + np.arange(-kernel, kernel + 1)).ravel()
    t = np.unique(near[(near >= 0) & (near < n)])
    seg = np.minimum(np.searchsorted(bounds, t, side="right"), len(bounds) - 1)
    lo, hi = bounds[seg - 1], bounds[seg]
    clipped = np.zeros(len(t))
    for j in range(kernel):  # the same adds, with the terms outside t's segment zero
        i = t - back + j
        clipped += np.where((i >= lo) & (i < hi), s[np.clip(i, 0, n - 1)], 0.0)
    total[t] = clipped
    return (total / kernel).astype(np.float32)


def iter_peaks(density: np.ndarray, radius: int = QA_KERNEL, segment_bounds: np.ndarray | None = None
               ) -> Iterator[int]:
    """Greedy NMS, highest density first: take the highest remaining local maximum, suppress +-radius around it.

    Only positive density counts. On a flat top (a box kernel turns an isolated hit into a plateau) the centre is the
    middle of the plateau, so the span grows around the hit and not around the plateau's edge.
    With `segment_bounds`, a peak's neighbours, flat top and suppression stay inside its segment (document).
    """
    return (centre for _, centre in ranked_peaks(density, radius, segment_bounds))


def ranked_peaks(density: np.ndarray, radius: int = QA_KERNEL, segment_bounds: np.ndarray | None = None
                 ) -> Iterator[tuple[int, int]]:
    """`iter_peaks` as (candidate, centre): NMS takes candidates by (density desc, position asc). With segment
    bounds no peak reaches past its document, so the peaks of disjoint sets of documents (index shards) merge into
    the whole corpus's stream by that key."""
    d = np.asarray(density)
    n = len(d)
    if n == 0:
        return
    bounds = np.unique(np.clip(np.concatenate(([0], np.asarray(
        segment_bounds if segment_bounds is not None else [], dtype=np.int64), [n])), 0, n))
    # local maxima, compared in the curve's own dtype (exact); the plateau tests below use float64. They are marked in
    # a mask, where a document's edges are re-tested in place, and read out once, sorted: on BM25's sentence plateaus
    # nearly every position is a candidate, too many to merge with the edges by a set union on every query
    inner = d[1:-1]
    is_peak = np.zeros(n, dtype=bool)
    is_peak[1:-1] = (inner > 0) & (inner >= d[:-2]) & (inner >= d[2:])
    is_peak[0] = d[0] > 0 and (n == 1 or d[0] >= d[1])
    if n > 1:
        is_peak[-1] = d[-1] > 0 and d[-1] >= d[-2]
    if len(bounds) > 2:  # a document's first and last positions have no neighbour across its bounds
        inside = bounds[1:-1]
        edges = np.unique(np.concatenate((inside - 1, inside)))
        seg = np.searchsorted(bounds, edges, side="right")
        lo, hi = bounds[seg - 1], bounds[seg]
        is_peak[edges] = (d[edges] > 0) & ((edges == lo) | (d[edges] >= d[np.maximum(edges - 1, 0)])) & \
            ((edges == hi - 1) | (d[edges] >= d[np.minimum(edges + 1, n - 1)]))
    candidates = np.flatnonzero(is_peak)
    suppressed = np.zeros(n, dtype=bool)
    for c in _by_height(candidates, d):
        if suppressed[c]:
            continue
        seg = int(np.searchsorted(bounds, c, side="right"))
        seg_lo, seg_hi = int(bounds[seg - 1]), int(bounds[seg])
        # extent of the flat top around c, looked for within +-radius (float noise can make plateau values differ
        # in the last bits, hence the tolerance)
        w0, w1 = max(c - radius, seg_lo), min(c + radius + 1, seg_hi)
        window, top = d[w0: w1].astype(np.float64), float(d[c])
        uneven = np.flatnonzero(np.abs(window - top) > 1e-6 * top) + w0
        lo = int(uneven[uneven < c].max(initial=w0 - 1)) + 1
        hi = int(uneven[uneven > c].min(initial=w1)) - 1
        centre = (lo + hi) // 2
        suppressed[max(centre - radius, seg_lo): min(centre + radius + 1, seg_hi)] = True
        suppressed[lo: hi + 1] = True
        yield int(c), int(centre)


def _by_height(candidates: np.ndarray, d: np.ndarray, batch: int = 1024) -> Iterator[int]:
    """Candidates in descending density (ties: leftmost first), sorted a batch at a time: NMS usually stops after
    a few dozen peaks, so sorting all local maxima of a 1M-token curve would be wasted work."""
    while len(candidates):
        if len(candidates) > batch:
            # every candidate above the (batch+1)-th height; on a tie across that cut, the leftmost of the tied: the
            # batches then follow (density desc, position asc) exactly, whatever the curve's length
            neg = -d[candidates]
            kth = np.partition(neg, batch)[batch]
            top = neg < kth if (neg < kth).any() else np.isin(np.arange(len(neg)), np.flatnonzero(neg == kth)[:batch])
            head, candidates = candidates[top], candidates[~top]
            batch *= 4
        else:
            head, candidates = candidates, candidates[:0]
        yield from head[np.lexsort((head, -d[head]))].tolist()


def peaks(density: np.ndarray, n: int | None = TOP_CENTRES, radius: int | None = None) -> np.ndarray:
    """The first `n` NMS centres (all of them for n=None), highest first; radius defaults to the QA kernel (8)."""
    out = []
    for p in iter_peaks(density, QA_KERNEL if radius is None else radius):
        if n is not None and len(out) >= n:
            break
        out.append(p)
    return np.asarray(out, dtype=np.int64)


def runs(indices: np.ndarray, breaks: np.ndarray | None = None) -> list[tuple[int, int]]:
    """Contiguous runs [start, end) of a sorted array of distinct indices; a run is also cut at every `breaks`
    position (a run never contains both b - 1 and b for a break b)."""
    idx = np.asarray(indices, dtype=np.int64)
    if len(idx) == 0:
        return []
    cut = np.diff(idx) != 1
    if breaks is not None and len(breaks):
        cut |= np.isin(idx[1:], breaks)
    starts = np.concatenate(([0], np.flatnonzero(cut) + 1))
    ends = np.concatenate((starts[1:], [len(idx)]))
    return [(int(idx[a]), int(idx[b - 1]) + 1) for a, b in zip(starts, ends)]


def spans_from_peaks(peaks: Iterable[int], sentence_starts: np.ndarray, n_positions: int, budget: int,
                     segment_bounds: np.ndarray | None = None, max_span: int | None = None,
                     covered: np.ndarray | None = None) -> list[tuple[int, int]]:
    """Grow each peak to its enclosing sentence and take them in peak order until `budget` tokens are covered.

    The sentence of peak p runs from the last boundary <= p to the next boundary > p (or n_positions), where the
    boundaries are `sentence_starts` plus `segment_bounds` (document starts/ends), so spans never cross a segment.
    `max_span` caps one peak's span (trimmed around the peak). The sentence that overflows the budget is trimmed
    around its peak to the exact remainder. Returns merged spans in source order; adjacent spans merge unless a
    segment bound lies between them. `covered` (bool, n_positions) marks tokens already kept (e.g. lead/tail):
    they are part of the result and count against the budget.
    """
    check_budget(budget)
    sentences = np.asarray(sentence_starts, dtype=np.int64)
    segments = np.asarray(segment_bounds if segment_bounds is not None else [], dtype=np.int64)
    covered = np.zeros(n_positions, dtype=bool) if covered is None else np.array(covered, dtype=bool)
    left = int(budget) - int(covered.sum())
    if left < 0:
        raise ValueError(f"{int(covered.sum())} tokens are already kept, more than the budget of {budget}")
    for p in peaks if left > 0 else ():
        if not 0 <= p < n_positions:
            raise ValueError(f"peak {p} lies outside [0, {n_positions})")
        start, end = enclosing(sentences, p, n_positions)
        seg_start, seg_end = enclosing(segments, p, n_positions)
        start, end = max(start, seg_start), min(end, seg_end)
        if max_span is not None and end - start > max_span:
            start = min(max(p - max_span // 2, start), end - max_span)
            end = start + max_span
        new = start + np.flatnonzero(~covered[start:end])
        if len(new) > left:  # trim around the peak: keep the `left` free tokens nearest to it
            new = new[np.argsort(np.abs(new - p), kind="stable")[:left]]
        covered[new] = True
        left -= len(new)
        if left <= 0:
            break
    return runs(np.flatnonzero(covered), breaks=segments)


def enclosing(bounds: np.ndarray, p: int, n_positions: int) -> tuple[int, int]:
    """[last bound <= p, first bound > p) within [0, n_positions); `bounds` is sorted."""
    i = int(np.searchsorted(bounds, p, side="right"))
    return (int(bounds[i - 1]) if i > 0 else 0), (int(bounds[i]) if i < len(bounds) else n_positions)


def sentences_in_budget(order: Sequence[int], lengths: np.ndarray, budget: int) -> np.ndarray:
    """The sentences of `order` (a ranking of sentence indices) taken whole when they go in rank order into `budget`
    tokens: the rank order up to the first sentence that does not fit."""
    order = np.asarray(order, dtype=np.int64)
    return order[np.cumsum(lengths[order]) <= budget]


def sentence_spans(corpus, order: Sequence[int], target: int, name: str, chose: dict | None = None,
                   score: np.ndarray | None = None) -> list[Span]:
    """Whole sentences of `corpus` in rank `order` into `target` tokens (`sentences_in_budget`), the first that does
    not fit cut to the tokens left. A span names the signals that `chose` (sentence -> signals) gives its sentences,
    else the method, and scores its best sentence's `score`."""
    starts, n = corpus.sentence_starts(), corpus.n_positions
    lengths = np.diff(np.append(starts, n))
    order = np.asarray(order, dtype=np.int64)
    order = order[np.sort(np.unique(order, return_index=True)[1])]  # a sentence ranked twice counts once
    whole = sentences_in_budget(order, lengths, target)
    keep = np.zeros(n, dtype=bool)
    for i in whole:
        keep[starts[i]:starts[i] + lengths[i]] = True
    left = target - int(lengths[whole].sum())
    if left > 0 and len(whole) < len(order):
        keep[starts[order[len(whole)]]:][:left] = True
    sentence_of = lambda p: int(np.searchsorted(starts, p, side="right")) - 1  # noqa: E731
    spans = []
    for a, b in runs(np.flatnonzero(keep), breaks=corpus.segment_bounds()):
        doc_id, c0, c1, text = corpus.span_text(a, b)
        ids = range(sentence_of(a), sentence_of(b - 1) + 1)
        signals = tuple(sorted({s for i in ids for s in (chose or {}).get(i, ())})) or (name,)
        best = max((float(score[i]) for i in ids), default=0.0) if score is not None else 0.0
        spans.append(Span(a, b, c0, c1, text, best, signals, doc_id))
    return spans


def select_spans(scores: np.ndarray, sentence_starts: np.ndarray, budget: int, kernel: int = QA_KERNEL,
                 n_peaks: int = TOP_CENTRES, segment_bounds: np.ndarray | None = None, fill: bool = True,
                 max_span: int | None = None) -> list[tuple[int, int, float]]:
    """Scores -> density -> NMS peaks (radius = kernel) -> sentence spans under `budget`: [(start, end, score)] in
    source order, score = the span's highest density. `fill=True` goes past the top `n_peaks` centres until the
    budget is met (our default: matched budgets across methods); `fill=False` stops at `n_peaks` as in the paper."""
    curve = density(scores, kernel, segment_bounds)
    centres = iter_peaks(curve, kernel)
    if not fill:
        centres = (p for _, p in zip(range(n_peaks), centres))
    spans = spans_from_peaks(centres, sentence_starts, len(curve), budget, segment_bounds, max_span)
    return [(a, b, float(curve[a:b].max())) for a, b in spans]
