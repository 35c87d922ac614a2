"""Damaged index files and hostile documents, from a seeded generator: every damaged index is refused with an
IndexCorruptError that says what to do, or answers exactly as the undamaged one; every document is indexed or refused
with a ValueError; nothing else escapes.

The default run tries FUZZ_CASES index files and documents (fixed seed, ~2,000 in all); more with
`ENDO_FUZZ_CASES=N` or `pytest -m fuzz` (20x, another seed each run of the nightly job: ENDO_FUZZ_SEED).
"""
import hashlib
import io
import json
import math
import os
import random
import resource
import shutil

import numpy as np
import pytest

from endo_retrieval import Document
from endo_retrieval.index.inverted import INDEX_FILE, MAGIC, IndexCorruptError

from tiny import QUESTIONS, answers, docs, load, new_index

FUZZ_CASES = int(os.environ.get("ENDO_FUZZ_CASES", 1500))
SEED = int(os.environ.get("ENDO_FUZZ_SEED", 22))
FILES = ["endo-index.json", f"features/{INDEX_FILE}", "corpus.npz"]
BAD = [None, "x", "", -1, 0, 1.5, math.nan, 2**64, 10**30, True, [], {}, [1, "a"], {"a": 1}, "\x00\udc80"[0]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clean") / "ix"
    idx = new_index()
    idx.add_documents(docs("mill", "vault", "ship"))
    idx.save(folder)
    return folder, answers(load(folder), QUESTIONS[:1])


# ---- damage ------------------------------------------------------------------------------------------------------


def flip(data: bytes, rng) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        if data:
            data[rng.randrange(len(data))] ^= rng.randint(1, 255)
    return bytes(data)


def mutate(obj, rng, depth=0):
    """A JSON value with one field replaced by a value of the wrong type or range, or removed."""
    if isinstance(obj, dict) and obj and depth < 4:
        key = rng.choice(sorted(obj))
        if isinstance(obj[key], (dict, list)) and obj[key] and rng.random() < 0.5:
            return {**obj, key: mutate(obj[key], rng, depth + 1)}
        if rng.random() < 0.2:
            return {k: v for k, v in obj.items() if k != key}
        return {**obj, key: rng.choice([v for v in BAD if v != obj[key] or type(v) is not type(obj[key])])}
    if isinstance(obj, list) and obj and depth < 4:
        i = rng.randrange(len(obj))
        out = list(obj)
        out[i] = mutate(obj[i], rng, depth + 1) if isinstance(obj[i], (dict, list)) else rng.choice(BAD)
        return out
    return rng.choice(BAD)


def feature_header(data: bytes, rng) -> bytes:
    """The feature index with its JSON header mutated and both checksums made to match again."""
    n = int.from_bytes(data[8:16], "little")
    header = mutate(json.loads(data[48:48 + n]), rng)
    new = json.dumps(header).encode()
    return MAGIC + len(new).to_bytes(8, "little") + hashlib.sha256(new).digest() + new + data[48 + n:]


def corpus_header(data: bytes, rng) -> bytes:
    """The corpus map with its JSON header mutated, written as a valid .npz again."""
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        arrays = dict(z)
    header = json.loads(arrays["header"].tobytes())
    if rng.random() < 0.3:  # the arrays instead of the header
        name = rng.choice(["offsets", "sentence_starts"])
        arrays[name] = rng.choice([arrays[name][:-1], arrays[name] + 10**6, arrays[name].astype(np.float32),
                                   np.zeros((3, 3), np.int64)])
    else:
        header = mutate(header, rng)
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def damage(folder, rng) -> str:
    name = rng.choice(FILES)
    path = folder / name
    data = path.read_bytes()
    kind = rng.choice(["flip", "flip", "truncate", "empty", "missing", "garbage", "structured", "structured"])
    if kind == "flip":
        path.write_bytes(flip(data, rng))
    elif kind == "truncate":
        path.write_bytes(data[: rng.randrange(len(data))])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "missing":
        path.unlink()
    elif kind == "garbage":
        path.write_bytes(data + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))))
    elif name == "endo-index.json":
        header = json.loads(data)
        path.write_bytes(json.dumps(mutate(header, rng)).encode() if rng.random() < 0.9 else b"\xff" + data)
    elif name == "corpus.npz":
        path.write_bytes(corpus_header(data, rng))
    else:
        path.write_bytes(feature_header(data, rng))
    return f"{kind} {name}"


def check_damaged_copies(saved, tmp_path, n: int, seed: int) -> dict:
    folder, expected = saved
    rng, outcomes = random.Random(seed), {"refused": 0, "same answers": 0}
    for case in range(n):
        copy = tmp_path / f"c{case % 4}"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(folder, copy)
        what = damage(copy, rng)
        try:
            got = answers(load(copy), QUESTIONS[:1])
        except IndexCorruptError as err:
            assert "rebuild" in str(err).lower() or "build one" in str(err), f"case {case} ({what}): {err}"
            outcomes["refused"] += 1
            continue
        except Exception as err:  # noqa: BLE001 - the point: nothing but IndexCorruptError may escape
            pytest.fail(f"case {case} ({what}): {type(err).__name__}: {err}")
        assert got == expected, f"case {case} ({what}) loaded but answers differently"
        outcomes["same answers"] += 1
    return outcomes


def test_damaged_index_files_are_refused_or_answer_as_before(saved, tmp_path):
    outcomes = check_damaged_copies(saved, tmp_path, FUZZ_CASES, SEED)
    print(f"{FUZZ_CASES} damaged copies: {outcomes}")
    assert outcomes["refused"] > FUZZ_CASES // 2  # the generator damages, mostly


def test_the_known_bad_headers_are_one_clean_error(saved, tmp_path):
    """A header value of the wrong type and a flipped byte in endo-index.json: an IndexCorruptError, not a
    TypeError or a UnicodeDecodeError."""
    folder, _ = saved
    head = json.loads((folder / "endo-index.json").read_text())
    for bad in [{**head, "sae_layers": [0, "1"]}, {**head, "chunk_size": "64"}, {**head, "model_hash": 5}]:
        shutil.copytree(folder, tmp_path / "ix", dirs_exist_ok=True)
        (tmp_path / "ix" / "endo-index.json").write_text(json.dumps(bad))
        with pytest.raises(IndexCorruptError, match="rebuild"):
            load(tmp_path / "ix")
    raw = bytearray((folder / "endo-index.json").read_bytes())
    raw[5] = 0xFF
    (tmp_path / "ix" / "endo-index.json").write_bytes(bytes(raw))
    with pytest.raises(IndexCorruptError, match="UnicodeDecodeError.*rebuild"):
        load(tmp_path / "ix")


@pytest.mark.fuzz
def test_nightly_many_more_damaged_copies(saved, tmp_path, request):
    if "fuzz" not in (request.config.getoption("-m") or ""):
        pytest.skip("the long run: pytest -m fuzz")
    n = FUZZ_CASES * 20
    print(f"{n} damaged copies (seed {SEED + 1}): {check_damaged_copies(saved, tmp_path, n, SEED + 1)}")


# ---- documents -----------------------------------------------------------------------------------------------------


def hostile_text(rng) -> str | bytes:
    kind = rng.randrange(9)
    n = rng.choice([0, 1, 2, 7, 64, 700])
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(n))  # binary
    if kind == 1:
        return "caf\xe9 ".encode("latin-1") * (n + 1)  # not UTF-8
    if kind == 2:
        return "text with a NUL\x00 inside. " * (n // 8 + 1)
    if kind == 3:
        return rng.choice(["", " ", "\n\n\t", "\u200b", "\ufeff"])  # empty or blank
    if kind == 4:
        return "".join(chr(rng.choice([rng.randrange(32, 0x7f), rng.randrange(0x80, 0xd7ff),
                                       rng.randrange(0xe000, 0x10ffff)])) for _ in range(n + 1))
    if kind == 5:
        return "".join(rng.choice(["\u202e", "\u0301", "\U0001f600", "\r", "\x0b", "\x1b[31m", "."]) * 3
                       for _ in range(n + 1))
    if kind == 6:
        return "a" * (n * 50 + 1)  # one long word
    if kind == 7:
        return "\ud800 lone surrogate " * (n // 16 + 1)
    return " ".join(rng.choice(["the", "mill", "vault", "4417", "Gdansk", "?!", "..."]) for _ in range(n + 1))


def test_hostile_documents_are_indexed_or_refused_with_a_value_error():
    rng = random.Random(SEED)
    n = max(FUZZ_CASES // 3, 500)
    indexes = {"bm25": new_index("bm25"), "s3-hybrid": new_index()}
    outcomes = {"indexed": 0, "refused": 0}
    for case in range(n):
        text = hostile_text(rng)
        method = "s3-hybrid" if case % 20 == 0 and len(text) < 300 else "bm25"  # the model's forward on some
        try:
            indexes[method].add_documents([Document(f"d{case}", text)])
            outcomes["indexed"] += 1
        except ValueError as err:
            assert str(err), f"case {case}: an empty message"
            outcomes["refused"] += 1
        except Exception as err:  # noqa: BLE001
            pytest.fail(f"case {case} ({text[:40]!r}): {type(err).__name__}: {err}")
    for idx in indexes.values():  # what was indexed is searchable
        for q in QUESTIONS + ["\x00", "?", "a" * 2000]:
            try:
                idx.search(q, k=2)
            except ValueError:  # an empty question or index: refused, never crashed
                pass
    print(f"{n} hostile documents: {outcomes}")
    assert outcomes["indexed"] and outcomes["refused"]


def test_one_5mb_line_without_punctuation_is_indexed_in_bounded_memory():
    words = ["word"] * (5_000_000 // 5)
    words[len(words) // 2] = "zebra"
    text = " ".join(words)  # 5 MB, no sentence end, no newline
    idx = new_index("bm25")
    idx.add_documents(docs("mill", "ship"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    idx.add_documents([Document("big", text)])
    hits = idx.search("zebra", k=2)
    grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(f"5 MB line: {idx.corpus.n_tokens} tokens, peak RSS grew {grew_mb:.0f} MB")
    assert hits and hits[0].doc_id == "big"
    assert grew_mb < 2000


# ---- SAE files ---------------------------------------------------------------------------------------------------


def test_damaged_sae_files_are_refused_with_an_sae_error(tmp_path):
    """Cards and weights of an SAE bank: byte flips (the weights are checked against the card's checksum), truncation,
    empty or missing files, card fields of the wrong type. Each load is an SAEError or a bank that encodes."""
    import torch

    from endo_retrieval.model.sae import SAEBank, SAEError, TopKSAE

    torch.manual_seed(0)
    SAEBank({l: TopKSAE(16, 64, 4) for l in (0, 1)}, {"d_latent": 64, "k": 4, "model_hash": "h"}).save(tmp_path / "b")
    rng, outcomes = random.Random(SEED), {"refused": 0, "loaded": 0}
    for case in range(max(FUZZ_CASES // 5, 200)):
        work = tmp_path / "w"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(tmp_path / "b", work)
        path = rng.choice(sorted(p for p in work.rglob("*") if p.is_file()))
        kind = rng.choice(["flip", "truncate", "empty", "missing", "field"])
        if kind == "field" and path.suffix == ".json":
            path.write_text(json.dumps(mutate(json.loads(path.read_text()), rng)))
        elif kind == "missing":
            path.unlink()
        else:
            data = path.read_bytes()
            path.write_bytes({"flip": flip(data, rng), "truncate": data[: rng.randrange(len(data))]}.get(kind, b""))
        try:
            bank = SAEBank.load(work, "h")
            bank.encode_keys(bank.layers[0], torch.randn(2, 3, 16))
            outcomes["loaded"] += 1
        except SAEError as err:
            assert any(w in str(err) for w in ("re-train", "Train", "train-sae", "aggregation")), err
            outcomes["refused"] += 1
        except Exception as err:  # noqa: BLE001
            pytest.fail(f"case {case} ({kind} {path.relative_to(work)}): {type(err).__name__}: {err}")
    print(f"damaged SAE banks: {outcomes}")
    assert outcomes["refused"] > outcomes["loaded"]


def test_damaged_profiles_are_one_clean_error(tmp_path):
    """ILRe and heads profiles, damaged (byte flips, truncation, other JSON, fields of the wrong type): each is read
    as before or refused with a ProfileError that names the command to make it again; nothing else escapes."""
    from types import SimpleNamespace

    from endo_retrieval.model.profiles import ASSETS, ProfileError, _read_profile

    rng = random.Random(7)
    sources = {"heads": (ASSETS / "heads" / "smollm2-135m-instruct.json").read_bytes(),
               "ilre": (ASSETS / "ilre" / "smollm2-135m-instruct.json").read_bytes()}
    odd = [None, True, -1, 1.5, "3", [], {}, [[1]], [["a", 2]], float("nan"), 10 ** 30]
    bb = SimpleNamespace(model_hash=json.loads(sources["heads"])["model_hash"])
    refused = read = 0
    for i in range(400):
        kind = rng.choice(sorted(sources))
        data = bytearray(sources[kind])
        how = rng.randrange(4)
        if how == 0:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif how == 1:
            data = data[: rng.randrange(len(data))]
        elif how == 2:
            data = bytearray(json.dumps(rng.choice(odd)).encode())
        else:
            profile = json.loads(data)
            key = rng.choice(["layer", "heads", "fusion", "model_hash"] if kind == "heads" else ["layer", "model_hash"])
            profile[key] = rng.choice(odd) if key != "fusion" else {"weights": {"bm25": rng.choice(odd)}}
            data = bytearray(json.dumps(profile).encode())
        path = tmp_path / f"{i}.json"
        path.write_bytes(bytes(data))
        try:
            out = _read_profile(bb, path, kind)
            assert out is None or isinstance(out, dict)
            read += 1
        except ProfileError as e:
            assert ("calibrate-heads" if kind == "heads" else "calibrate-ilre") in str(e)
            refused += 1
    assert refused > 100 and read + refused == 400
