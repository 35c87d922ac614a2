"""The feature index's file (`feature_index.bin`, inverted.py's FeatureIndex saved): its layout, LEB128 codec, and
every check made reading it back.

On disk, one file per index (`feature_index.bin` in the index folder) so a save is one atomic `os.replace`:

    MAGIC (8 bytes) | header length (uint64 LE) | sha256 of header (32 bytes) | JSON header | payload

The payload holds, per layer, three LEB128 varint streams: postings per feature, the positions delta-encoded within
each feature, and the indexed token positions delta-encoded. The header names the format and version, the layers,
d_latent, stop_freq, meta, the offset and length of every stream and the payload's sha256. Nothing is unpickled.
`load()` memory-maps the payload and decodes it into in-memory CSR arrays.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from endo_retrieval.files import MAX_VALUE, IndexCorruptError, IndexVersionError

FORMAT_NAME = "endo-feature-index"
FORMAT_VERSION = 1
INDEX_FILE = "feature_index.bin"
MAGIC = b"ENDOIDX\x00"


# --- LEB128 varints, vectorised --------------------------------------------------------------------------------


def varint_encode(values: np.ndarray) -> np.ndarray:
    """Unsigned LEB128: 7 bits per byte, high bit set on every byte but a value's last. Returns uint8."""
    v = np.asarray(values).astype(np.uint64, copy=False).ravel()
    n_bytes = np.ones(len(v), dtype=np.int64)
    for i in range(1, 10):  # a uint64 needs at most 10 groups of 7 bits
        n_bytes += v >= np.uint64(1 << (7 * i))
    first = np.cumsum(n_bytes) - n_bytes
    out = np.empty(int(n_bytes.sum()), dtype=np.uint8)
    for j in range(int(n_bytes.max(initial=0))):  # scatter byte j of every value that has one
        has = n_bytes > j
        group = ((v[has] >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8)
        more = (n_bytes[has] - 1 > j).astype(np.uint8) << 7
        out[first[has] + j] = group | more
    return out


def varint_decode(data: np.ndarray, count: int | None = None) -> np.ndarray:
    """Inverse of `varint_encode`; raises IndexCorruptError on a truncated or malformed stream. Returns uint64."""
    b = np.asarray(data, dtype=np.uint8).ravel()
    if len(b) == 0:
        values = np.zeros(0, dtype=np.uint64)
    else:
        if b[-1] & 0x80:
            raise IndexCorruptError("varint stream is truncated (last byte has its continuation bit set)")
        is_last = (b & 0x80) == 0
        starts = np.concatenate(([0], np.flatnonzero(is_last)[:-1] + 1))
        value_of_byte = np.cumsum(is_last) - is_last
        shift = np.arange(len(b), dtype=np.int64) - starts[value_of_byte]
        if shift.max() > 9:
            raise IndexCorruptError("varint stream holds a value longer than 10 bytes")
        groups = (b & 0x7F).astype(np.uint64) << (7 * shift).astype(np.uint64)
        values = np.add.reduceat(groups, starts)  # groups occupy disjoint bits, so add == or
    if count is not None and len(values) != count:
        raise IndexCorruptError(f"varint stream holds {len(values)} values, header says {count}")
    return values


def _delta_encode(indptr: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Gaps between sorted positions of the same feature; each feature's first position is kept absolute."""
    deltas = np.diff(positions.astype(np.int64), prepend=0)
    starts = indptr[:-1][np.diff(indptr) > 0]
    deltas[starts] = positions[starts]
    return deltas


def _delta_decode(indptr: np.ndarray, deltas: np.ndarray) -> np.ndarray:
    running = np.cumsum(deltas.astype(np.int64))
    before = np.concatenate(([0], running))[indptr[:-1]]  # running sum before each feature's first posting
    return running - np.repeat(before, np.diff(indptr))


def serialise(header: dict, layers: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]) -> bytes:
    """The file of `layers`, each (layer, indptr, positions, tokens) as one CSR, under `header`'s fields (layers,
    d_latent, stop_freq, meta), the streams' places and both checksums added."""
    streams, arrays, offset = [], [], 0
    for layer, indptr, positions, tokens in layers:
        entry = {"layer": layer}
        for name, values in (("counts", np.diff(indptr)), ("positions", _delta_encode(indptr, positions)),
                             ("tokens", np.diff(tokens, prepend=0))):
            encoded = varint_encode(values)
            entry[name] = {"offset": offset, "nbytes": len(encoded), "count": len(values)}
            streams.append(encoded)
            offset += len(encoded)
        arrays.append(entry)
    payload = np.concatenate(streams).tobytes() if streams else b""
    header = json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION, **header, "arrays": arrays,
                         "payload_nbytes": len(payload), "payload_sha256": hashlib.sha256(payload).hexdigest(),
                         }).encode()
    prefix = MAGIC + len(header).to_bytes(8, "little") + hashlib.sha256(header).digest()
    return prefix + header + payload


def read_verified(f, path: Path, mmap: bool) -> tuple[dict, np.ndarray]:
    """Header and payload of an open index file, after checking magic, version, sizes and both checksums."""
    rebuild = f"index file {path} is damaged; delete it and rebuild the index"
    size = os.fstat(f.fileno()).st_size
    prefix = f.read(48)
    if len(prefix) < 48 or prefix[:8] != MAGIC:
        raise IndexCorruptError(f"{rebuild} (missing or wrong magic bytes / truncated header)")
    header_len = int.from_bytes(prefix[8:16], "little")
    if 48 + header_len > size:
        raise IndexCorruptError(f"{rebuild} (truncated header)")
    header_bytes = f.read(header_len)
    if hashlib.sha256(header_bytes).digest() != prefix[16:48]:
        raise IndexCorruptError(f"{rebuild} (header checksum mismatch)")
    header = json.loads(header_bytes)
    if not isinstance(header, dict):
        raise IndexCorruptError(f"{rebuild} (the header is not a JSON object)")
    if header.get("format") != FORMAT_NAME:
        raise IndexCorruptError(f"{rebuild} (format {header.get('format')!r}, expected {FORMAT_NAME!r})")
    if header.get("version") != FORMAT_VERSION:
        raise IndexVersionError(f"index file {path} has format version {header.get('version')}; this library "
                                f"reads version {FORMAT_VERSION}. Rebuild the index with this version.")
    start, n_payload = 48 + header_len, header["payload_nbytes"]
    if not _is_int(n_payload) or size != start + n_payload:
        raise IndexCorruptError(f"{rebuild} (file is {size} bytes, header says {start + n_payload}; truncated?)")
    if mmap and n_payload:
        payload = np.memmap(f, dtype=np.uint8, mode="r", offset=start, shape=(n_payload,))
    else:
        payload = np.frombuffer(f.read(n_payload), dtype=np.uint8)
    if hashlib.sha256(memoryview(payload)).hexdigest() != header["payload_sha256"]:
        raise IndexCorruptError(f"{rebuild} (payload checksum mismatch)")
    return header, payload


def decode_layer(payload: np.ndarray, entry: dict, d_latent: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, indptr, positions) of one layer's three streams, each checked."""
    def stream(name: str) -> np.ndarray:
        s = entry[name]
        if not all(_is_int(s[key]) and s[key] >= 0 for key in ("offset", "nbytes", "count")) or \
                s["offset"] + s["nbytes"] > len(payload):
            raise IndexCorruptError(f"layer {entry['layer']}: stream {name} lies outside the payload")
        values = varint_decode(payload[s["offset"]: s["offset"] + s["nbytes"]], s["count"])
        if len(values) and values.max() >= MAX_VALUE:  # a position past any corpus: damage, not data
            raise IndexCorruptError(f"layer {entry['layer']}: stream {name} holds a value >= 2**48")
        return values.astype(np.int64)

    counts = stream("counts")
    if len(counts) != d_latent:
        raise IndexCorruptError(f"layer {entry['layer']}: {len(counts)} posting lists, expected {d_latent}")
    indptr = np.concatenate(([0], np.cumsum(counts)))
    deltas = stream("positions")
    if len(deltas) != indptr[-1]:
        raise IndexCorruptError(f"layer {entry['layer']}: {len(deltas)} postings, counts say {indptr[-1]}")
    positions = _delta_decode(indptr, deltas)
    token_deltas = stream("tokens")
    tokens = np.cumsum(token_deltas)
    max_pos = int(tokens[-1]) if len(tokens) else 0
    firsts = indptr[:-1][np.diff(indptr) > 0]  # each feature's first posting is absolute, the others are gaps
    if np.any(token_deltas[1:] == 0) or np.count_nonzero(deltas == 0) > np.count_nonzero(deltas[firsts] == 0) or \
            (len(positions) and positions.max() > max_pos):
        raise IndexCorruptError(f"layer {entry['layer']}: positions are not ascending or not among the tokens")
    return tokens, indptr, positions


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
