"""Damaged index files and hostile documents, from a seeded generator: every damaged index is refused with an
IndexCorruptError that says what to do, answers exactly as the undamaged one, or (a dense-stage file) answers as the
undamaged one with BM25's candidates when they are asked for, with a warning naming the file; every document is
indexed or refused with a ValueError; nothing else escapes.

The index is the full one: S3 feature postings and the dense stage (all-MiniLM-L6-v2, with cells), and the files
damaged are whatever its folder holds, so a file a new stage adds is fuzzed without a change here (a file type no
damage below knows how to edit fails `change_field`, saying so). The default run tries every file with each of the
five kinds of damage (EVERY_FILE_CASES copies), then INDEX_CASES random ones (FUZZ_CASES documents); more with
`ENDO_FUZZ_CASES=N` or `pytest -m fuzz` (20x, another seed each run of the nightly job: ENDO_FUZZ_SEED).
"""
import io
import json
import math
import os
import random
import resource
import shutil
import warnings

import numpy as np
import pytest

from endo_retrieval import Document
from endo_retrieval.array_file import ArrayFile, write_arrays
from endo_retrieval.files import SEAL, read_sealed_json, sealed_json, sha256_of
from endo_retrieval.index.inverted import MAGIC, IndexCorruptError

from old_layout import to_old_layout
from tiny import QUESTIONS, answers, docs, load, new_index, tiny_engine

FUZZ_CASES = int(os.environ.get("ENDO_FUZZ_CASES", 1500))
INDEX_CASES = FUZZ_CASES // 5  # random damaged copies of the index (each opened and asked: ~70 ms on a 2-core CPU)
EVERY_FILE_CASES = 120  # every file of the index x KINDS, spread evenly
SEED = int(os.environ.get("ENDO_FUZZ_SEED", 22))
KINDS = ["flip", "truncate", "empty", "missing", "field"]
BAD = [None, "x", "", -1, 0, 1.5, math.nan, 2**64, 10**30, True, [], {}, [1, "a"], {"a": 1}, "\x00\udc80"[0]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder, the answers of the index saved there, its answers with BM25's candidates): an s3-hybrid index
    with the dense stage, cells included (from one passage on, here), searched by s3-hybrid and by `endo` (a heads
    profile made for the tiny model)."""
    from endo_retrieval import EndoIndex

    bb, bank = tiny_engine()
    folder = tmp_path_factory.mktemp("clean") / "ix"
    profile = folder.parent / "heads.json"
    profile.write_text(json.dumps({"model_hash": bb.model_hash, "heads": [[1, 0]], "fusion": {"weights": {}}}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ENDO_HEADS_PROFILE", str(profile))
        with pytest.MonkeyPatch.context() as cells:  # from one passage on: the folder holds dense_cells.npz
            cells.setattr("endo_retrieval.index.dense.ANN_MIN", 1)
            idx = EndoIndex(bb, method="s3-hybrid", saes=bank, chunk_size=64, first_stage="hybrid")
            idx.add_documents(docs("mill", "vault", "ship"))
            idx.save(folder)
        clean = load(folder)
        yield folder, both_answers(clean), endo_answers(clean, "bm25")


@pytest.fixture(scope="module")
def saved_before_arrays(saved, tmp_path_factory):
    """`saved` turned into the layout saved before array files (corpus.npz, passages.npz with its SHA-256 in the
    header): it answers as `saved` does."""
    folder = tmp_path_factory.mktemp("old") / "ix"
    shutil.copytree(saved[0], folder)
    to_old_layout(folder)
    return (folder, *saved[1:])


def files_of(folder) -> list[str]:
    """Every file the index folder holds, at any depth."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_the_fuzzed_index_holds_every_stage(saved):
    held = files_of(saved[0])
    assert {"endo-index.json", "corpus.arrays", "passages.arrays", "dense.npy", "dense.json", "dense_cells.npz",
            "dense_rows.arrays"} <= set(held)
    assert any(name.startswith("features/") for name in held)


# ---- answers -----------------------------------------------------------------------------------------------------
_EMBEDDED = {}


def endo_answers(index, first_stage=None) -> tuple:
    """The `endo` pipeline's two best passages for the first question (its MiniLM forward computed once per
    embedder: it does not depend on the index)."""
    if index.dense is not None:
        dense, query = index.dense, index.dense.query
        dense.query = lambda q: _EMBEDDED.setdefault((dense.embedder, q), query(q))
    return tuple((s.doc_id, s.start, s.end, round(s.score, 6))
                 for s in index.search(QUESTIONS[0], k=2, method="endo", first_stage=first_stage))


def both_answers(index) -> tuple:
    return answers(index, QUESTIONS[:1]), endo_answers(index)


# ---- damage ------------------------------------------------------------------------------------------------------


def flip(data: bytes, rng) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        if data:
            data[rng.randrange(len(data))] ^= rng.randint(1, 255)
    return bytes(data)


def mutate(obj, rng, depth=0, types_only=False):
    """A JSON value with one field replaced by a value of the wrong type or range (`types_only`: of another type),
    or removed."""
    def bad(value):
        return rng.choice([v for v in BAD if type(v) is not type(value) or not types_only and v != value])

    if isinstance(obj, dict) and obj and depth < 4:
        key = rng.choice(sorted(obj))
        if isinstance(obj[key], (dict, list)) and obj[key] and rng.random() < 0.5:
            return {**obj, key: mutate(obj[key], rng, depth + 1, types_only)}
        if rng.random() < 0.2:
            return {k: v for k, v in obj.items() if k != key}
        return {**obj, key: bad(obj[key])}
    if isinstance(obj, list) and obj and depth < 4:
        i = rng.randrange(len(obj))
        out = list(obj)
        out[i] = mutate(obj[i], rng, depth + 1, types_only) if isinstance(obj[i], (dict, list)) else bad(obj[i])
        return out
    return bad(obj)


def json_field(data: bytes, rng) -> bytes:
    """A JSON header with a field of the wrong type or range. One sealed by its own checksum is sealed again, so
    its field checks answer, not the seal; its field gets another type only, as a value of the right type under a
    matching seal is a header written so (an embedder named "x" is an index embedded by a model of that name)."""
    if rng.random() < 0.1:
        return b"\xff" + data
    if SEAL.encode() in data:
        return sealed_json(mutate(read_sealed_json(data), rng, types_only=True))
    return json.dumps(mutate(json.loads(data), rng)).encode()


def feature_header(data: bytes, rng) -> bytes:
    """The feature index with its JSON header mutated and both checksums made to match again."""
    import hashlib

    n = int.from_bytes(data[8:16], "little")
    header = mutate(json.loads(data[48:48 + n]), rng)
    new = json.dumps(header).encode()
    return MAGIC + len(new).to_bytes(8, "little") + hashlib.sha256(new).digest() + new + data[48 + n:]


def npz_field(data: bytes, rng) -> bytes:
    """An .npz with one array's header changed (its dtype or shape) or, for a JSON header kept as bytes (the
    corpus map's `header`), a field of it; written as a valid .npz again."""
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        arrays = dict(z)
    name = rng.choice(sorted(arrays))
    if name == "header" and rng.random() < 0.7:
        header = mutate(json.loads(arrays["header"].tobytes()), rng)
        arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    else:
        a = arrays[name]
        numeric = a.dtype.kind in "iufb"
        changes = [lambda: a[:-1], lambda: a.reshape(-1, 1), lambda: np.zeros((3, 3), np.int64),
                   lambda: a.astype(np.float32 if a.dtype != np.float32 else np.float64) if numeric else a[::-1],
                   lambda: a.astype(np.int64) + 10**6 if numeric else a[:0]]
        arrays[name] = rng.choice(changes)()
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def npy_field(data: bytes, rng) -> bytes:
    """An .npy with a field of its array header changed (the shape, the dtype or the order), the data as it was."""
    f = io.BytesIO(data)
    major, _ = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read(f)
    payload = data[f.tell():]
    header = {"shape": shape, "fortran_order": fortran, "descr": np.lib.format.dtype_to_descr(dtype)}
    field = rng.choice(["shape", "fortran_order", "descr"])
    header[field] = {"shape": rng.choice([(shape[0] - 1, *shape[1:]), (shape[0], shape[1] + 1), shape[::-1],
                                          (shape[0] * 2, shape[1] // 2), (max(1, shape[0]),)]),
                     "fortran_order": not fortran,
                     "descr": rng.choice(["<f8", "<f2", ">f4", "<i4", "|u1"])}[field]
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, header)
    return out.getvalue() + payload


def array_file_field(data: bytes, rng) -> bytes:
    """An array file (array_file.py) with a field of its sealed header of another type, sealed again and kept at
    its length where it is no longer (so the arrays stay where they were): the field checks answer, not the seal."""
    n = int.from_bytes(data[8:16], "little")
    new = sealed_json(mutate(read_sealed_json(data[16:16 + n]), rng, types_only=True))
    new = new + b" " * (n - len(new)) if len(new) <= n else new
    return data[:8] + len(new).to_bytes(8, "little") + new + data[16 + n:]


def change_field(name: str, data: bytes, rng) -> bytes:
    """A header field of the file changed, as its format has them. A file type not known here fails: teach it."""
    if name.endswith(".arrays"):
        return array_file_field(data, rng)
    if name.endswith(".json"):
        return json_field(data, rng)
    if name.endswith(".npz"):
        return npz_field(data, rng)
    if name.endswith(".npy"):
        return npy_field(data, rng)
    if data.startswith(MAGIC):
        return feature_header(data, rng)
    raise AssertionError(f"{name}: the fuzz test knows no header field of this file type; add one to change_field")


def reseal(folder) -> None:
    """Sealed JSON headers that record files' SHA-256 (dense.json) record them as they are now: a changed array
    header then meets the checks of its shape and type, not the checksum. passages.npz's SHA-256 is in the index
    header, not sealed, and stays: its changed arrays meet the checksum here, their checks without one in
    `test_passages_arrays_swapped_are_refused_by_the_checksum_or_by_their_checks`."""
    for path in folder.rglob("*.json"):
        try:
            fields = read_sealed_json(path.read_bytes())
        except ValueError:
            continue
        if path.read_bytes().rstrip().endswith(b'"}') and isinstance(fields.get("sha256"), dict):
            for name in fields["sha256"]:
                if (path.parent / name).exists():
                    with open(path.parent / name, "rb") as f:
                        fields["sha256"][name] = sha256_of(f)
            path.write_bytes(sealed_json(fields))


def damage(folder, name: str, kind: str, rng) -> None:
    path = folder / name
    data = path.read_bytes()
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
    else:
        path.write_bytes(change_field(name, data, rng))
        if not name.endswith(".json"):
            reseal(folder)


def outcome(copy, name: str, expected: tuple, bm25: tuple) -> str:
    """What a damaged copy does: refused on open or at the question (an IndexCorruptError naming the file or the
    index and saying what to do), answered as before, or, for a dense-stage file, refused unless BM25's candidates
    are asked for, which answer as before with a warning naming the file."""
    try:
        index = load(copy)
    except IndexCorruptError as err:
        return refused(err, copy, name)
    try:
        got = both_answers(index)
    except IndexCorruptError as err:
        refused(err, copy, name)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with_bm25 = endo_answers(index, "bm25")
            except IndexCorruptError as again:
                return refused(again, copy, name)
        assert with_bm25 == bm25, f"{err}; with BM25's candidates asked for, other answers"
        assert any(name in str(w.message) and "dense first stage is off" in str(w.message) for w in caught), \
            f"{err}; with BM25's candidates asked for, no warning naming {name}"
        return "refused, warned with bm25"
    assert got == expected, "loaded but answers differently"
    return "same answers"


def refused(err: IndexCorruptError, copy, name: str) -> str:
    """The refusal is one line that names the file (or the index folder) and says what to do."""
    message = str(err)
    assert "\n" not in message and ("rebuild" in message.lower() or "build one" in message), message
    assert name.split("/")[-1] in message or str(copy) in message, message
    return "refused"


def check_damaged_copies(saved, tmp_path, cases) -> dict:
    """`cases`: (file, kind, rng) to damage a fresh copy of the saved index with; the count of each outcome."""
    folder, expected, bm25 = saved
    outcomes = {}
    for case, (name, kind, rng) in enumerate(cases):
        copy = tmp_path / f"c{case % 4}"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(folder, copy)
        damage(copy, name, kind, rng)
        try:
            got = outcome(copy, name, expected, bm25)
        except Exception as err:  # noqa: BLE001 - the point: nothing but IndexCorruptError may escape
            pytest.fail(f"case {case} ({kind} {name}): {type(err).__name__}: {err}")
        outcomes[got] = outcomes.get(got, 0) + 1
        if got == "same answers":
            outcomes.setdefault("answered as before after", []).append(f"{kind} {name}")
    return outcomes


def test_every_file_of_the_index_with_every_kind_of_damage(saved, tmp_path):
    """EVERY_FILE_CASES copies, each file of the folder damaged each of the five ways, evenly: none answers
    differently without an error or a warning, none escapes with another exception."""
    folder = saved[0]
    rng = random.Random(SEED)
    pairs = [(name, kind) for name in files_of(folder) for kind in KINDS]
    cases = [(*pairs[i % len(pairs)], rng) for i in range(max(EVERY_FILE_CASES, len(pairs)))]
    outcomes = check_damaged_copies(saved, tmp_path, cases)
    print(f"{len(cases)} damaged copies over {len(files_of(folder))} files: {outcomes}")
    assert outcomes.get("refused, warned with bm25")  # the dense stage's files were among them
    assert outcomes.get("same answers", 0) < len(cases) // 10


# ---- passages.npz: the header's checksum, and behind it the checks of its arrays -----------------------------
SWAPS = {"one shorter": lambda a: a[:-1], "a column": lambda a: a.reshape(-1, 1),
         "a 3x3 matrix": lambda a: np.zeros((3, 3), np.int64),
         "another float type": lambda a: a.astype(np.float32 if a.dtype != np.float32 else np.float64),
         "int64 plus 10**6": lambda a: a.astype(np.int64) + 10**6}


def swapped(folder, copy, array: str, swap: str, checksum: bool) -> None:
    """`copy`: the index in `folder` with `array` of its passages.npz swapped for another valid array (a valid zip,
    its CRCs matching); `checksum=False`: its header without its record of the file's SHA-256, as an index saved
    before it had one."""
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(folder, copy)
    path = copy / "passages.npz"
    with np.load(path, allow_pickle=False) as z:
        arrays = dict(z)
    arrays[array] = SWAPS[swap](arrays[array])
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    if not checksum:
        header = json.loads((copy / "endo-index.json").read_text())
        del header["sha256"]
        (copy / "endo-index.json").write_text(json.dumps(header))


def test_passages_arrays_swapped_are_refused_by_the_checksum_or_by_their_checks(saved_before_arrays, tmp_path):
    """Every array of passages.npz swapped each of SWAPS' ways: refused by the header's SHA-256 of the file; in an
    index saved before it had one, refused by the checks of the arrays' types, shapes and ranges, or answered as
    before. A change that keeps an array's type and shape (a value, or the terms' text) only the checksum can tell:
    such a copy may answer otherwise without one, but nothing may escape as another exception."""
    folder, expected, bm25 = saved_before_arrays
    with np.load(folder / "passages.npz") as z:
        arrays = {name: (z[name].dtype, z[name].shape) for name in z.files}
    outcomes, copy = {}, tmp_path / "ix"
    for array, (dtype, shape) in arrays.items():
        for swap in SWAPS:
            swapped(folder, copy, array, swap, checksum=True)
            with pytest.raises(IndexCorruptError, match=r"passages.npz is damaged \(checksum mismatch\).*rebuild"):
                load(copy)
            swapped(folder, copy, array, swap, checksum=False)
            with np.load(copy / "passages.npz") as z:
                kept = (z[array].dtype, z[array].shape) == (dtype, shape) or array == "terms"
            try:
                got = outcome(copy, "passages.npz", expected, bm25)
            except AssertionError:  # answered otherwise
                got = "answered otherwise"
            except Exception as err:  # noqa: BLE001
                pytest.fail(f"{array} {swap}, no checksum: {type(err).__name__}: {err}")
            assert kept or got == "refused", f"{array} {swap}: another type or shape, {got} without the checksum"
            outcomes[got] = outcomes.get(got, 0) + 1
            if got != "refused":
                outcomes.setdefault("not refused", []).append(f"{array} {swap}")
    print(f"{len(arrays) * len(SWAPS)} arrays swapped, without the checksum: {outcomes}")


ARRAY_FILES = {"corpus.arrays": "corpus-map", "passages.arrays": "passages", "dense_rows.arrays": "dense-rows"}


def test_array_files_with_an_array_swapped_under_matching_checksums_are_refused_or_answer_as_before(saved, tmp_path):
    """Every array of the index's array files swapped each of SWAPS' ways, the file written whole again (its CRC-32s
    and seal matching, as a faulty writer would): a change of an array's type or shape is always refused by the
    checks of the columns' types, shapes, bounds and order; one that keeps both may answer otherwise (only the
    checksums could tell, and they match), but nothing escapes as another exception."""
    folder, expected, bm25 = saved
    outcomes, copy = {}, tmp_path / "ix"
    for name, kind in ARRAY_FILES.items():
        with open(folder / name, "rb") as f:
            original = ArrayFile.read(f, folder / name, kind)
        arrays = {k: np.array(v) for k, v in original.arrays.items()}
        for array, a in arrays.items():
            for swap, change in SWAPS.items():
                shutil.rmtree(copy, ignore_errors=True)
                shutil.copytree(folder, copy)
                new = change(a)
                write_arrays(copy / name, kind, {**arrays, array: new}, original.meta)
                try:
                    got = outcome(copy, name, expected, bm25)
                except AssertionError:  # answered otherwise
                    got = "answered otherwise"
                except Exception as err:  # noqa: BLE001
                    pytest.fail(f"{name} {array} {swap}: {type(err).__name__}: {err}")
                kept = (new.dtype, new.shape) == (a.dtype, a.shape) or array == "terms"  # its text, one string
                assert kept or got.startswith("refused"), f"{name} {array} {swap}: another type or shape, {got}"
                outcomes[got] = outcomes.get(got, 0) + 1
    print(f"arrays swapped under matching checksums: {outcomes}")
    assert outcomes.get("refused", 0) > sum(outcomes.values()) // 2


@pytest.mark.parametrize("name, checksum", [("corpus.npz", True), ("passages.npz", True), ("passages.npz", False)])
def test_a_changed_zip_compression_method_is_refused(saved_before_arrays, tmp_path, name, checksum):
    """zipfile's NotImplementedError for a compression method it does not know is the IndexCorruptError, with or
    without passages.npz's checksum (which refuses it first)."""
    shutil.copytree(saved_before_arrays[0], tmp_path / "ix")
    data = bytearray((tmp_path / "ix" / name).read_bytes())
    data[data.index(b"PK\x01\x02") + 10] = 99  # the first member's compression method, in the central directory
    (tmp_path / "ix" / name).write_bytes(bytes(data))
    if not checksum:
        header = json.loads((tmp_path / "ix" / "endo-index.json").read_text())
        del header["sha256"]
        (tmp_path / "ix" / "endo-index.json").write_text(json.dumps(header))
    with pytest.raises(IndexCorruptError, match=rf"{name} is damaged.*(checksum|compression).*rebuild"):
        both_answers(load(tmp_path / "ix"))


def random_cases(folder, n: int, seed: int):
    rng, names = random.Random(seed), files_of(folder)
    for _ in range(n):
        yield rng.choice(names), rng.choice(KINDS + ["flip", "garbage", "field"]), rng


def test_damaged_index_files_are_refused_or_answer_as_before(saved, tmp_path):
    outcomes = check_damaged_copies(saved, tmp_path, random_cases(saved[0], INDEX_CASES, SEED))
    print(f"{INDEX_CASES} damaged copies: {outcomes}")
    assert outcomes.get("same answers", 0) < INDEX_CASES // 3  # the generator damages, mostly


def test_the_known_bad_headers_are_one_clean_error(saved, tmp_path):
    """A header value of the wrong type and a flipped byte in endo-index.json: an IndexCorruptError, not a
    TypeError or a UnicodeDecodeError."""
    folder = saved[0]
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
    n = INDEX_CASES * 20
    print(f"{n} damaged copies (seed {SEED + 1}): "
          f"{check_damaged_copies(saved, tmp_path, random_cases(saved[0], n, SEED + 1))}")


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
