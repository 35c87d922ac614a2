"""The inverted feature index of S3-Attention (S3 section 3.4, [S3 Eq. 4-5]; scoring [S3 Eq. 7/9], IDF [S3 Eq. 10]).

Per target layer, feature id -> sorted token positions, held as CSR arrays (`indptr`, `positions`) instead of the
paper's Python dict/list postings. Each `add()` appends one such segment. While every segment starts after the ones
before it (a streamed build), queries read the segments as they are, so a build ends without a merge;
what needs one CSR per layer (saving, removing a range, `postings()`) merges them first, once.

On disk, one file per index (`feature_index.bin`; its layout and codec: feature_file.py), so a save is one
atomic `os.replace`.

Stop features (appendix E: "freq > 5000: continue"): `stop_freq` is an int (absolute postings count, the paper's
5000 by default) or a float in (0, 1] (a share of the layer's indexed tokens). The paper's contexts hold at most
~128k tokens, where 5000 is ~4% of tokens; for a large corpus index pass a share (e.g. 0.04), because an absolute
5000 would stop most features once the corpus passes a few hundred thousand tokens. None disables stop features.
Stop features stay stored; they are only skipped when scoring, so changing the setting needs no rebuild.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from endo_retrieval.files import IndexCorruptError, IndexVersionError, atomic_write, check_json
from endo_retrieval.index.feature_file import (FORMAT_NAME, FORMAT_VERSION, INDEX_FILE, MAGIC,  # noqa: F401
                                               decode_layer, read_verified, serialise, varint_decode,
                                               varint_encode)

PAPER_STOP_FREQ = 5000  # appendix E
SEGMENT_TOKENS = 32768  # a streamed segment this large is queried as it is; smaller neighbours are merged first


def _position_dtype(max_position: int) -> type:
    return np.uint32 if max_position < 2**32 else np.int64


# --- the index ---------------------------------------------------------------------------------------------------


@dataclass
class _PostingBlock:
    """[S3 Eq. 5]'s postings of a run of tokens, grouped by feature (CSR): one add(), or the merge of several."""
    tokens: np.ndarray  # int64, the positions indexed (in any order; the merge sorts what is not streamed)
    indptr: np.ndarray  # int64 (d_latent + 1,)
    positions: np.ndarray  # uint32 / int64 (_position_dtype), feature-major, ascending within each feature

    def gather(self, feats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The postings of features `feats` laid end to end, and how many each has: one index range per feature,
        built with np.repeat (no Python loop over features)."""
        starts = self.indptr[feats]
        counts = self.indptr[feats + 1] - starts
        within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        return self.positions[np.repeat(starts, counts) + within], counts


@dataclass
class _LayerPostings:
    segments: list[_PostingBlock] = field(default_factory=list)
    streamed: bool = True  # each segment's tokens ascend and start after the segment before: queries need no merge

    @property
    def last_token(self) -> int:
        """The largest indexed position (-1 when none); only meaningful while `streamed`."""
        return next((int(s.tokens[-1]) for s in reversed(self.segments) if len(s.tokens)), -1)


def sorted_postings(features: torch.Tensor, d_latent: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[S3 Eq. 5] for a block of tokens (T, k), without a synchronisation: (counts (d_latent,), rows, keep), where
    rows[keep] (int32) names the token row of every posting, grouped by feature and ascending within it; -1 slots
    and a feature repeated in a row are not kept. It runs where the features are, so an accelerator sorts while the
    host only appends; the host drops the unkept rows (their number is not known without waiting)."""
    k = features.shape[1]
    keys = features.reshape(-1).to(torch.int32)
    keys = torch.where(keys < 0, d_latent, keys)  # empty slots sort after every feature
    keys, order = torch.sort(keys, stable=True)  # stable: rows stay ascending within a feature
    rows = torch.div(order, k, rounding_mode="floor").to(torch.int32)
    keep = keys < d_latent
    keep[1:] &= (keys[1:] != keys[:-1]) | (rows[1:] != rows[:-1])
    counts = torch.zeros(d_latent + 1, dtype=torch.int64, device=keys.device)
    counts.scatter_add_(0, keys.long(), keep.long())  # a bincount would wait to learn its size
    return counts[:d_latent], rows, keep


def feature_postings(features: torch.Tensor, d_latent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`sorted_postings` with the unkept rows dropped: (counts (d_latent,), rows)."""
    counts, rows, keep = sorted_postings(features, d_latent)
    return counts, rows[keep]


def scatter_scores(total: torch.Tensor, positions: np.ndarray, run_mass: np.ndarray, runs: np.ndarray) -> None:
    """[S3 Eq. 9]'s sum on the accelerator, the twin of `np.bincount(positions, np.repeat(run_mass, runs))`: add
    run_mass[i] at each of the runs[i] next positions into `total` (float64, so the sum matches the host's). Only
    the positions (4 bytes each below 2**31) and one mass per run go over; nothing waits for the device."""
    device = total.device
    index = positions.view(np.int32) if positions.dtype == np.uint32 and len(total) < 2**31 else positions
    index = torch.from_numpy(np.ascontiguousarray(index)).to(device)
    weights = torch.repeat_interleave(torch.from_numpy(run_mass).to(device), torch.from_numpy(runs).to(device),
                                      output_size=len(positions))
    total.index_add_(0, index, weights)


def idf(freq: np.ndarray) -> np.ndarray:
    """IDF(f) = 1 / (log(1 + freq(f)) + 1) [S3 Eq. 10]."""
    return 1.0 / (np.log1p(freq) + 1.0)


class FeatureIndex:
    """Per-layer inverted index: feature id -> sorted token positions [S3 Eq. 5], scored by [S3 Eq. 7/9] with
    [S3 Eq. 10] IDF."""

    def __init__(self, layers: list[int], d_latent: int, stop_freq: int | float | None = PAPER_STOP_FREQ,
                 meta: dict | None = None):
        if not layers or len(set(layers)) != len(layers):
            raise ValueError(f"layers must be a non-empty list of distinct layer numbers, got {layers!r}")
        if d_latent <= 0:
            raise ValueError(f"d_latent must be positive, got {d_latent}")
        _check_stop_freq(stop_freq)
        self.layers = [int(layer) for layer in layers]
        self.d_latent = int(d_latent)
        self.stop_freq = stop_freq
        self.meta = dict(meta or {})
        check_json(self.meta, "meta")
        self._layers = {layer: _LayerPostings() for layer in self.layers}

    # building ---------------------------------------------------------------------------------------------------

    def add(self, layer: int, positions: np.ndarray, features: np.ndarray) -> None:
        """Append the active features (T, k) of token positions (T,) at `layer` [S3 Eq. 5]; -1 marks an empty slot."""
        self._layer(layer)
        positions = np.asarray(positions)
        features = np.asarray(features)
        if positions.ndim != 1 or features.ndim != 2 or len(positions) != len(features):
            raise ValueError(f"add() wants positions (T,) and features (T, k); "
                             f"got {positions.shape} and {features.shape}")
        if not (np.issubdtype(positions.dtype, np.integer) and np.issubdtype(features.dtype, np.integer)):
            raise ValueError("positions and features must be integer arrays")
        if len(positions) == 0:
            return
        if features.min() < -1 or features.max() >= self.d_latent:
            raise ValueError(f"feature ids must lie in [0, {self.d_latent}) (or -1 for an empty slot)")
        counts, rows = feature_postings(torch.from_numpy(features.astype(np.int32)), self.d_latent)
        self.add_postings(layer, positions, counts.numpy(), rows.numpy())

    def add_postings(self, layer: int, positions: np.ndarray, counts: np.ndarray, rows: np.ndarray) -> None:
        """Append a block sorted by `feature_postings`: the tokens at `positions` (T,) hold `counts[f]` postings of
        each feature f, naming rows into `positions` (feature-major, rows ascending within a feature): one segment.
        Positions may come in any order; ascending ones after every indexed position keep the layer streamed
        (queried without a merge, and merged without a sort when it comes to that)."""
        store = self._layer(layer)
        positions, counts, rows = (np.asarray(a) for a in (positions, counts, rows))
        if counts.shape != (self.d_latent,) or len(rows) != counts.sum():
            raise ValueError(f"add_postings wants counts ({self.d_latent},) summing to len(rows); "
                             f"got {counts.shape} summing to {counts.sum()} for {len(rows)} rows")
        if len(positions) == 0:
            return
        if positions.min() < 0:
            raise ValueError("token positions must be >= 0")
        positions = positions.astype(np.int64, copy=False)
        store.streamed &= bool(positions[0] > store.last_token and np.all(positions[1:] > positions[:-1]))
        # stored as the merged layer will hold them (uint32 below 2**32): half the bytes for a merge to move
        indptr = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
        store.segments.append(_PostingBlock(positions, indptr,
                                       positions.astype(_position_dtype(int(positions.max())))[rows]))

    def extend(self, other: "FeatureIndex", offset: int) -> None:
        """Append `other`'s postings, every position moved up by `offset` (at or past this index's positions): one
        segment per layer, as a streamed hand-off is (an index built in parts by several workers, `segments.py`)."""
        if other.layers != self.layers or other.d_latent != self.d_latent:
            raise ValueError(f"cannot join an index of layers {other.layers} x {other.d_latent} features to one of "
                             f"{self.layers} x {self.d_latent}")
        for layer in self.layers:
            part, store = other._merged(other._layers[layer]), self._layers[layer]
            if not len(part.tokens):
                continue
            tokens = part.tokens + offset
            store.streamed &= bool(tokens[0] > store.last_token)
            dtype = _position_dtype(int(tokens[-1]))
            store.segments.append(_PostingBlock(tokens, part.indptr, part.positions.astype(dtype) + dtype(offset)))

    def _merge(self, blocks: list[_PostingBlock], streamed: bool) -> _PostingBlock:
        """Segments merged into one CSR (sorted within each feature, duplicates dropped)."""
        if not blocks:
            merged = _PostingBlock(np.zeros(0, np.int64), np.zeros(self.d_latent + 1, np.int64), np.zeros(0, np.uint32))
        elif streamed:
            # every segment lies after the ones before it, so each feature's postings are its runs in the segments,
            # segment after segment; one gather lays them out (no sort)
            counts = np.stack([np.diff(b.indptr) for b in blocks])  # (B, d_latent)
            ends = np.cumsum(counts, axis=1)
            block_start = np.concatenate(([0], np.cumsum(ends[:, -1])[:-1]))
            read = block_start[:, None] + ends - counts  # where run (b, f) starts in the concatenated segments
            indptr = np.concatenate(([0], np.cumsum(counts.sum(axis=0))))
            write = indptr[None, :-1] + np.cumsum(counts, axis=0) - counts  # where it goes in the merged layer
            shift = (read - write).T.ravel()  # feature-major, like the output
            source = np.repeat(shift, counts.T.ravel())
            source += np.arange(indptr[-1])  # in place: one temporary fewer
            tokens = np.concatenate([b.tokens for b in blocks])
            merged = _PostingBlock(tokens, indptr, np.concatenate([b.positions for b in blocks])[source])
        else:  # general case: sort (feature, position) keys, dropping duplicates
            tokens = np.unique(np.concatenate([b.tokens for b in blocks]))
            span = int(tokens[-1]) + 1
            if self.d_latent * span >= 2**63:
                raise ValueError(f"positions up to {span} are too large for an index of {self.d_latent} features")
            feat = np.concatenate([np.repeat(np.arange(self.d_latent, dtype=np.int64), np.diff(b.indptr))
                                   for b in blocks])
            keys = np.unique(feat * span + np.concatenate([b.positions.astype(np.int64) for b in blocks]))
            feat, positions = np.divmod(keys, span)
            indptr = np.concatenate(([0], np.cumsum(np.bincount(feat, minlength=self.d_latent))))
            merged = _PostingBlock(tokens, indptr, positions)
        last = int(merged.tokens[-1]) if len(merged.tokens) else 0
        merged.positions = merged.positions.astype(_position_dtype(last), copy=False)
        return merged

    def _merged(self, store: _LayerPostings) -> _PostingBlock:
        """The layer as one CSR segment, merged once and kept."""
        if not (len(store.segments) == 1 and store.streamed):
            store.segments, store.streamed = [self._merge(store.segments, store.streamed)], True
        return store.segments[0]

    def _segments(self, layer: int) -> list[_PostingBlock]:
        """The layer's segments as queries read them. Streamed, each run of segments smaller than SEGMENT_TOKENS
        is merged until it reaches that size (many small documents would otherwise mean many small gathers per
        query), and larger ones, like a long document's hand-offs, stay as they are; not streamed, all are merged."""
        store = self._layer(layer)
        if not store.streamed:
            return [self._merged(store)]
        groups, size = [[]], 0
        for segment in store.segments:
            groups[-1].append(segment)
            size += len(segment.tokens)
            if size >= SEGMENT_TOKENS:
                groups, size = groups + [[]], 0
        store.segments = [g[0] if len(g) == 1 else self._merge(g, streamed=True) for g in groups if g]
        return store.segments

    def _layer(self, layer: int) -> _LayerPostings:
        if layer not in self._layers:
            raise ValueError(f"layer {layer} is not indexed; this index holds layers {self.layers}")
        return self._layers[layer]

    def postings(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The merged CSR arrays (indptr, positions) of one layer."""
        merged = self._merged(self._layer(layer))
        return merged.indptr, merged.positions

    def remove_range(self, start: int, end: int) -> int:
        """Drop every posting (and indexed token) with position in [start, end); other positions keep their numbers.
        Returns the number of postings removed."""
        if start > end:
            raise ValueError(f"remove_range wants start <= end, got [{start}, {end})")
        removed = 0
        for layer in self.layers:
            merged = self._merged(self._layers[layer])
            keep = (merged.positions < start) | (merged.positions >= end)
            feat = np.repeat(np.arange(self.d_latent), np.diff(merged.indptr))
            merged.indptr = np.concatenate(([0], np.cumsum(np.bincount(feat[keep], minlength=self.d_latent))))
            removed += int(len(keep) - keep.sum())
            merged.positions = merged.positions[keep]
            merged.tokens = merged.tokens[(merged.tokens < start) | (merged.tokens >= end)]
        return removed

    # statistics -------------------------------------------------------------------------------------------------

    def tokens(self, layer: int) -> np.ndarray:
        """Sorted token positions indexed at `layer` (also those whose features were all absent)."""
        return self._merged(self._layer(layer)).tokens

    def freq(self, layer: int) -> np.ndarray:
        """freq(f): postings of each feature at `layer` (appendix D notation), int64 (d_latent,)."""
        return sum((np.diff(s.indptr) for s in self._segments(layer)), np.zeros(self.d_latent, np.int64))

    def idf(self, layer: int) -> np.ndarray:
        """IDF(f) of every feature at `layer` [S3 Eq. 10]."""
        return idf(self.freq(layer))

    def n_tokens(self, layer: int) -> int:
        """Token positions indexed at `layer` (also those whose features were all absent)."""
        return sum(len(s.tokens) for s in self._segments(layer))

    def stop_threshold(self, layer: int) -> float:
        """Features with freq above this are skipped when scoring (appendix E); inf when stop features are off."""
        if self.stop_freq is None:
            return np.inf
        if isinstance(self.stop_freq, float):
            return self.stop_freq * self.n_tokens(layer)
        return float(self.stop_freq)

    @property
    def n_postings(self) -> int:
        return sum(int(s.indptr[-1]) for layer in self.layers for s in self._segments(layer))

    @property
    def positions_span(self) -> int:
        """Largest indexed position + 1 (0 when empty)."""
        for layer in self.layers:
            self._segments(layer)  # merged unless streamed, so the last token is the largest
        return max(store.last_token for store in self._layers.values()) + 1

    def bytes_per_posting(self) -> float:
        """Size of the saved file divided by the number of postings."""
        return len(self._serialise()) / max(self.n_postings, 1)

    # scoring ----------------------------------------------------------------------------------------------------

    def score(self, query: dict[int, tuple[np.ndarray, np.ndarray]], n_positions: int | None = None,
              prune: float | None = None, device: str | torch.device | None = None) -> np.ndarray:
        """S[t] = sum_l sum_f w_{q,f} * IDF(f) * 1[t in I_l[f]] [S3 Eq. 7/9] over positions [0, n_positions).

        `query` maps layer -> (feature ids, weights), any matching shapes (e.g. (tokens, k)); -1 ids are ignored and
        repeated ids (several query tokens or heads) have their weights summed. Stop features are skipped.
        `prune` in (0, 1]: per layer, keep only the heaviest query features whose w * IDF mass reaches that share of
        the layer's total. A query that activates no indexed feature scores all zeros. Returns float32.
        `device`: a CUDA device sums the postings there (`scatter_scores`) instead of with np.bincount; the postings
        stay on the host, and only the gathered positions go over (large queries score faster on the
        accelerator).
        """
        if prune is not None and not 0 < prune <= 1:
            raise ValueError(f"prune must be a share in (0, 1] or None, got {prune}")
        n = self.positions_span if n_positions is None else int(n_positions)
        on_device = device is not None and torch.device(device).type == "cuda"
        # on the accelerator, positions >= n land past n and are cut off at the end (a filter would wait for it)
        total = torch.zeros(max(n, self.positions_span), dtype=torch.float64, device=device) if on_device \
            else np.zeros(n, dtype=np.float64)
        for layer, (ids, weights) in query.items():
            segments = self._segments(layer)
            ids, weights = np.asarray(ids).ravel(), np.asarray(weights, dtype=np.float64).ravel()
            if ids.shape != weights.shape:
                raise ValueError(f"layer {layer}: query ids {ids.shape} and weights {weights.shape} differ in shape")
            if len(ids) and (ids.max() >= self.d_latent or ids.min() < -1):
                raise ValueError(f"layer {layer}: query feature ids must lie in [0, {self.d_latent}) or be -1")
            valid = ids >= 0
            w = np.bincount(ids[valid], weights=weights[valid], minlength=self.d_latent)  # sum repeated features
            freq = self.freq(layer)
            mass = w * idf(freq)
            feats = np.flatnonzero((mass != 0) & (freq > 0) & (freq <= self.stop_threshold(layer)))
            if prune is not None and len(feats):
                feats = feats[np.argsort(-np.abs(mass[feats]), kind="stable")]
                cum = np.cumsum(np.abs(mass[feats]))
                feats = feats[: int(np.searchsorted(cum, prune * cum[-1] * (1 - 1e-12))) + 1]
            gathered = [s.gather(feats) for s in segments] or [(np.zeros(0, np.int64), np.zeros(len(feats), int))]
            pos = np.concatenate([p for p, _ in gathered])
            run_mass, runs = np.tile(mass[feats], len(gathered)), np.concatenate([c for _, c in gathered])
            if on_device:
                scatter_scores(total, pos, run_mass, runs)
            else:
                total += np.bincount(pos, weights=np.repeat(run_mass, runs), minlength=n)[:n]  # positions >= n dropped
        return total[:n].float().cpu().numpy() if on_device else total.astype(np.float32)

    # persistence ------------------------------------------------------------------------------------------------

    def _serialise(self) -> bytes:
        header = {"layers": self.layers, "d_latent": self.d_latent, "stop_freq": self.stop_freq, "meta": self.meta}
        merged = [(layer, *(lambda m: (m.indptr, m.positions, m.tokens))(self._merged(self._layers[layer])))
                  for layer in self.layers]
        return serialise(header, merged)

    def save(self, directory: str | os.PathLike) -> Path:
        """Write `directory/feature_index.bin` atomically: a temp file beside it, fsync, then `os.replace`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / INDEX_FILE
        data = self._serialise()
        atomic_write(target, lambda tmp: tmp.write_bytes(data))
        return target

    @classmethod
    def load(cls, directory: str | os.PathLike, mmap: bool = True) -> FeatureIndex:
        """Read an index saved by `save()`. With mmap the raw payload is memory-mapped; the decoded CSR arrays live
        in memory. Raises IndexCorruptError for a damaged file, IndexVersionError for another format version."""
        path = Path(directory) / INDEX_FILE
        if not path.is_file():
            raise FileNotFoundError(f"no feature index at {path}; build one and save() it there first")
        with open(path, "rb") as f:  # one open file throughout: a concurrent save() replaces the name, not it
            return cls.read(f, path, mmap)

    @classmethod
    def read(cls, f, path: Path, mmap: bool = True) -> FeatureIndex:
        """`load()` from an open file (`path` names it in messages)."""
        try:
            header, payload = read_verified(f, path, mmap)
            index = cls(header["layers"], header["d_latent"], header["stop_freq"], header["meta"])
            entries = {entry["layer"]: entry for entry in header["arrays"]}
            if sorted(entries) != sorted(index.layers) or len(entries) != len(header["arrays"]):
                raise IndexCorruptError(f"arrays for layers {sorted(entries)}, header lists {index.layers}")
            for layer, entry in entries.items():
                tokens, indptr, positions = decode_layer(payload, entry, index.d_latent)
                dtype = _position_dtype(int(tokens[-1]) if len(tokens) else 0)
                index._layers[layer] = _LayerPostings([_PostingBlock(tokens, indptr, positions.astype(dtype))])
        except IndexVersionError:
            raise
        except (IndexCorruptError, ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
                MemoryError) as err:  # a header of the wrong shape as much as a damaged stream
            raise IndexCorruptError(f"index file {path} is damaged; delete it and rebuild the index "
                                    f"({type(err).__name__}: {err})") from None
        return index


def _check_stop_freq(stop_freq) -> None:
    if stop_freq is None:
        return
    if isinstance(stop_freq, bool) or not isinstance(stop_freq, (int, float)):
        raise ValueError(f"stop_freq must be an int (postings), a float share in (0, 1], or None; got {stop_freq!r}")
    if isinstance(stop_freq, float) and not 0 < stop_freq <= 1:
        raise ValueError(f"a float stop_freq is a share of indexed tokens and must lie in (0, 1], got {stop_freq}")
    if isinstance(stop_freq, int) and stop_freq < 1:
        raise ValueError(f"an int stop_freq counts postings and must be >= 1, got {stop_freq}")
