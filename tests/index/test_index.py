import hashlib
import json
import math
import os
import threading
from collections import defaultdict

import numpy as np
import pytest
import torch

from endo_retrieval.index import inverted as index_module
from endo_retrieval.index.inverted import (FeatureIndex, IndexCorruptError, IndexVersionError, INDEX_FILE,
                                           feature_postings, varint_decode, varint_encode)

D = 64


def random_adds(rng, layers, n_tokens=300, k=5, chunk=50, shuffle_chunks=False):
    """Random (layer, positions, features) add() calls with -1 slots and repeated features in a token."""
    calls = []
    starts = list(range(0, n_tokens, chunk))
    if shuffle_chunks:
        rng.shuffle(starts)
    for s in starts:
        pos = np.arange(s, min(s + chunk, n_tokens))
        for layer in layers:
            feats = rng.integers(-1, D, size=(len(pos), k))
            calls.append((layer, pos, feats))
    return calls


def naive_postings(calls):
    post = defaultdict(lambda: defaultdict(set))
    for layer, pos, feats in calls:
        for t, row in zip(pos, feats):
            for f in row:
                if f >= 0:
                    post[layer][int(f)].add(int(t))
    return post


def build(calls, layers, **kw):
    idx = FeatureIndex(layers, D, **kw)
    for c in calls:
        idx.add(*c)
    return idx


def assert_matches(idx, post, layers):
    for layer in layers:
        indptr, positions = idx.postings(layer)
        for f in range(D):
            assert positions[indptr[f]:indptr[f + 1]].tolist() == sorted(post[layer][f]), (layer, f)


def naive_score(post, query, n, stop=math.inf):
    """[S3 Eq. 9] written out: S[t] += w_f * IDF(f) for every query feature f and every t in I_l[f]."""
    scores = [0.0] * n
    for layer, (ids, weights) in query.items():
        summed = defaultdict(float)
        for f, w in zip(np.ravel(ids).tolist(), np.ravel(weights).tolist()):
            if f >= 0:
                summed[f] += w
        for f, w in summed.items():
            freq = len(post[layer][f])
            if freq > stop:
                continue
            idf = 1.0 / (math.log(1 + freq) + 1)
            for t in post[layer][f]:
                if t < n:
                    scores[t] += w * idf
    return np.array(scores)


@pytest.mark.parametrize("edge", [0, 1, 127, 128, 16383, 16384, 2**32 - 1, 2**32, 2**63, 2**64 - 1])
def test_varint_round_trip_edge_values(edge):
    values = np.array([edge, 0, edge], dtype=np.uint64)
    encoded = varint_encode(values)
    assert len(encoded) == 1 + 2 * max(1, math.ceil(edge.bit_length() / 7))
    assert varint_decode(encoded).tolist() == values.tolist()


def test_varint_known_bytes_and_truncation():
    assert varint_encode(np.array([0, 127, 128, 300])).tolist() == [0, 127, 0x80, 1, 0xAC, 2]
    random = np.random.default_rng(0).integers(0, 2**40, size=1000, dtype=np.uint64)
    assert np.array_equal(varint_decode(varint_encode(random)), random)
    with pytest.raises(IndexCorruptError):
        varint_decode(varint_encode(np.array([300]))[:1])


@pytest.mark.parametrize("shuffle", [False, True])  # in-order streaming merge and the general sort path
def test_postings_match_naive_and_round_trip(tmp_path, shuffle):
    rng = np.random.default_rng(1)
    calls = random_adds(rng, [3, 7], shuffle_chunks=shuffle)
    idx = build(calls, [3, 7], meta={"model": "x", "k": 5})
    post = naive_postings(calls)
    assert_matches(idx, post, [3, 7])
    assert idx.n_postings == sum(len(p) for layer in post.values() for p in layer.values())
    idx.save(tmp_path)
    for mmap in (True, False):
        loaded = FeatureIndex.load(tmp_path, mmap=mmap)
        assert_matches(loaded, post, [3, 7])
        assert loaded.meta == {"model": "x", "k": 5} and loaded.layers == [3, 7] and loaded.stop_freq == 5000
        assert loaded.n_tokens(3) == 300 and loaded.positions_span == 300


def test_adding_after_load_keeps_merging(tmp_path):
    rng = np.random.default_rng(2)
    calls = random_adds(rng, [0], n_tokens=200)
    build(calls[:2], [0]).save(tmp_path)
    idx = FeatureIndex.load(tmp_path)
    for c in calls[2:]:
        idx.add(*c)
    assert_matches(idx, naive_postings(calls), [0])


def test_repeated_and_unordered_positions_in_one_add_merge_like_sets():
    rng = np.random.default_rng(3)
    streamed = (0, np.arange(40, 80), rng.integers(-1, D, size=(40, 4)))
    jumbled = (0, rng.integers(0, 50, size=120), rng.integers(-1, D, size=(120, 4)))  # repeats, no order, overlap
    idx = build([streamed], [0])
    idx.postings(0)  # compacted before the jumbled block arrives
    idx.add(*jumbled)
    assert_matches(idx, naive_postings([streamed, jumbled]), [0])
    assert idx.tokens(0).tolist() == sorted(set(jumbled[1].tolist()) | set(range(40, 80)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_feature_postings_group_rows_by_feature(device):
    rng = np.random.default_rng(4)
    feats = rng.integers(-1, D, size=(500, 6))
    counts, rows = feature_postings(torch.as_tensor(feats, device=device), D)
    counts, rows = counts.cpu().numpy(), rows.cpu().numpy()
    indptr = np.concatenate(([0], np.cumsum(counts)))
    for f in range(D):
        assert rows[indptr[f]:indptr[f + 1]].tolist() == sorted({t for t, row in enumerate(feats) if f in row}), f


def test_idf_by_hand():
    idx = FeatureIndex([0], 4)
    idx.add(0, np.arange(3), np.array([[1, 2], [2, -1], [2, -1]]))  # freq = [0, 1, 3, 0]
    assert idx.freq(0).tolist() == [0, 1, 3, 0]
    np.testing.assert_allclose(idx.idf(0), [1.0, 1 / (math.log(2) + 1), 1 / (math.log(4) + 1), 1.0])


@pytest.mark.parametrize("stop_freq", [None, 23, 0.075])  # freq is ~23 on average: thresholds stop some features
def test_score_equals_naive_eq9(stop_freq):
    rng = np.random.default_rng(3)
    calls = random_adds(rng, [3, 7])
    idx = build(calls, [3, 7], stop_freq=stop_freq)
    post = naive_postings(calls)
    query = {3: (rng.integers(-1, D, size=(4, 6)), rng.random((4, 6))),  # repeated ids across query tokens
             7: (rng.integers(0, D, size=10), rng.random(10))}
    stop = math.inf if stop_freq is None else stop_freq if isinstance(stop_freq, int) else stop_freq * 300
    expected = naive_score(post, query, 300, stop)
    got = idx.score(query)
    assert got.dtype == np.float32 and got.shape == (300,)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(idx.score(query, n_positions=120), expected[:120], rtol=1e-5, atol=1e-6)
    assert got.any()
    if stop_freq is not None:
        assert not np.allclose(got, naive_score(post, query, 300))  # the stop threshold really removed features


@pytest.mark.parametrize("segment_tokens, segments", [(1, 6), (120, 2), (10**9, 1)])
def test_streamed_segments_are_queried_without_a_full_merge(monkeypatch, segment_tokens, segments):
    """Six streamed adds of 50 tokens: queries read segments of SEGMENT_TOKENS or more as they are and merge runs of
    smaller ones first; scores equal [S3 Eq. 9] either way, and postings() still gives one merged CSR."""
    monkeypatch.setattr(index_module, "SEGMENT_TOKENS", segment_tokens)
    rng = np.random.default_rng(5)
    calls = random_adds(rng, [3, 7])
    idx, post = build(calls, [3, 7], stop_freq=0.075), naive_postings(calls)
    query = {3: (rng.integers(-1, D, size=(4, 6)), rng.random((4, 6))), 7: (rng.integers(0, D, 10), rng.random(10))}
    np.testing.assert_allclose(idx.score(query), naive_score(post, query, 300, 0.075 * 300), rtol=1e-5, atol=1e-6)
    assert [len(idx._layers[layer].segments) for layer in (3, 7)] == [segments, segments]
    assert idx.n_tokens(3) == 300 and idx.positions_span == 300
    assert idx.freq(7).tolist() == [len(post[7][f]) for f in range(D)]
    assert_matches(idx, post, [3, 7])
    assert [len(idx._layers[layer].segments) for layer in (3, 7)] == [1, 1]


def test_score_no_active_feature_is_zero():
    idx = FeatureIndex([0], 8)
    idx.add(0, np.arange(4), np.array([[1], [1], [2], [2]]))
    assert idx.score({0: (np.array([5, -1]), np.array([1.0, 2.0]))}).tolist() == [0, 0, 0, 0]


def test_prune_keeps_top_mass_share():
    idx = FeatureIndex([0], 4, stop_freq=None)
    idx.add(0, np.arange(4), np.array([[0], [1], [2], [3]]))  # every freq = 1, IDF equal
    query = {0: (np.array([0, 1, 2, 3]), np.array([5.0, 3.0, 1.5, 0.5]))}  # shares 0.5, 0.3, 0.15, 0.05
    idf = 1 / (math.log(2) + 1)
    assert np.allclose(idx.score(query, prune=1.0), np.array([5, 3, 1.5, 0.5]) * idf)
    assert np.allclose(idx.score(query, prune=0.8), np.array([5, 3, 0, 0]) * idf)
    assert np.allclose(idx.score(query, prune=0.81), np.array([5, 3, 1.5, 0]) * idf)
    with pytest.raises(ValueError):
        idx.score(query, prune=0)


def test_remove_range_removes_exactly_those_postings(tmp_path):
    rng = np.random.default_rng(4)
    calls = random_adds(rng, [1, 2])
    idx = build(calls, [1, 2])
    before = idx.n_postings
    removed = idx.remove_range(100, 180)
    post = naive_postings(calls)
    kept = {l: {f: {t for t in ts if not 100 <= t < 180} for f, ts in p.items()} for l, p in post.items()}
    kept = {l: defaultdict(set, p) for l, p in kept.items()}
    assert_matches(idx, kept, [1, 2])
    assert removed == before - idx.n_postings > 0
    assert idx.n_tokens(1) == 220 and idx.positions_span == 300
    idx.save(tmp_path)
    assert_matches(FeatureIndex.load(tmp_path), kept, [1, 2])
    idx.remove_range(180, 300)
    assert idx.positions_span == 100


def saved_pair(tmp_path):
    rng = np.random.default_rng(5)
    calls = random_adds(rng, [0], n_tokens=100)
    idx = build(calls, [0])
    idx.save(tmp_path)
    return idx, naive_postings(calls)


@pytest.mark.parametrize("where", [3, 20, 60, -1, -40])  # magic, header hash, header, payload
def test_corrupted_byte_is_refused(tmp_path, where):
    saved_pair(tmp_path)
    path = tmp_path / INDEX_FILE
    data = bytearray(path.read_bytes())
    data[where] ^= 0x41
    path.write_bytes(bytes(data))
    with pytest.raises(IndexCorruptError, match="rebuild"):
        FeatureIndex.load(tmp_path)


@pytest.mark.parametrize("keep", [0, 10, 47, 100, -1])
def test_truncated_file_is_refused(tmp_path, keep):
    saved_pair(tmp_path)
    path = tmp_path / INDEX_FILE
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    with pytest.raises(IndexCorruptError, match=str(path)):
        FeatureIndex.load(tmp_path)


def test_wrong_version_is_refused(tmp_path):
    saved_pair(tmp_path)
    path = tmp_path / INDEX_FILE
    data = path.read_bytes()
    n = int.from_bytes(data[8:16], "little")
    header = json.loads(data[48:48 + n])
    header["version"] = 99
    new = json.dumps(header).encode()
    path.write_bytes(data[:8] + len(new).to_bytes(8, "little") + hashlib.sha256(new).digest() + new + data[48 + n:])
    with pytest.raises(IndexVersionError, match="version 99"):
        FeatureIndex.load(tmp_path)


@pytest.mark.parametrize("crash_at", ["fsync", "replace"])
def test_crash_mid_save_keeps_previous_index(tmp_path, monkeypatch, crash_at):
    old, post = saved_pair(tmp_path)
    bigger = build(random_adds(np.random.default_rng(6), [0], n_tokens=400), [0])

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr(index_module.os, crash_at, crash)
    with pytest.raises(KeyboardInterrupt):
        bigger.save(tmp_path)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == [INDEX_FILE]  # no temp file left behind
    assert_matches(FeatureIndex.load(tmp_path), post, [0])


def test_readers_never_see_a_partial_file(tmp_path):
    rng = np.random.default_rng(7)
    versions = [build(random_adds(rng, [0], n_tokens=n), [0]) for n in (100, 2000)]
    expected = {v.n_postings for v in versions}
    versions[0].save(tmp_path)
    errors, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            try:
                assert FeatureIndex.load(tmp_path).n_postings in expected
            except Exception as err:  # noqa: BLE001 - collected and reported below
                errors.append(err)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for r in readers:
        r.start()
    for i in range(20):
        versions[i % 2].save(tmp_path)
    stop.set()
    for r in readers:
        r.join()
    assert errors == []


def test_bytes_per_posting_on_realistic_data():
    """40k positions x 32 features from a Zipf-like law over 4096 features: at most 1.5 bytes per posting."""
    rng = np.random.default_rng(8)
    d, k, n = 4096, 32, 40_000
    law = 1.0 / np.arange(1, d + 1)
    relabel = rng.permutation(d)  # frequent features are not the low ids
    idx = FeatureIndex([0], d)
    for s in range(0, n, 4000):
        idx.add(0, np.arange(s, s + 4000), relabel[rng.choice(d, size=(4000, k), p=law / law.sum())])
    assert idx.n_postings > 0.7 * n * k
    assert idx.bytes_per_posting() <= 1.5


def test_bad_input_errors():
    idx = FeatureIndex([0], 8)
    with pytest.raises(ValueError, match="layer 5"):
        idx.add(5, np.arange(2), np.zeros((2, 1), int))
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        idx.add(0, np.arange(2), np.full((2, 1), 8))
    with pytest.raises(ValueError, match="shape|\\(T"):
        idx.add(0, np.arange(3), np.zeros((2, 1), int))
    with pytest.raises(ValueError, match="share"):
        FeatureIndex([0], 8, stop_freq=1.5)
    with pytest.raises(ValueError, match="'sae'"):
        FeatureIndex([0], 8, meta={"sae": {"path": object()}})
    with pytest.raises(FileNotFoundError):
        FeatureIndex.load("/nonexistent/index")


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the device tool)")
@pytest.mark.parametrize("n_positions", [None, 170])  # 170: positions past n are dropped on both sides
def test_scores_summed_on_the_accelerator_equal_the_hosts(monkeypatch, n_positions):
    """`score(device="cuda")` (scatter_scores: index_add_ on the accelerator) against the np.bincount twin, over
    several segments, with stop features and pruning."""
    monkeypatch.setattr(index_module, "SEGMENT_TOKENS", 1)
    rng = np.random.default_rng(11)
    idx = build(random_adds(rng, [3, 7]), [3, 7], stop_freq=0.075)
    for prune in (None, 0.8):
        query = {3: (rng.integers(-1, D, size=(5, 6)), rng.random((5, 6))), 7: (rng.integers(0, D, 12), rng.random(12))}
        host = idx.score(query, n_positions=n_positions, prune=prune)
        accel = idx.score(query, n_positions=n_positions, prune=prune, device="cuda")
        assert accel.dtype == np.float32 and accel.shape == host.shape and host.any()
        np.testing.assert_allclose(accel, host, rtol=1e-6, atol=1e-7)
