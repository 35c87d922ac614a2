"""The owner's check from outside, with the real `endo` command and the default model (minutes; not part of pytest).

1. kill -9 at random moments of `endo index --append` into an index, N times: afterwards the index must answer as
   the old state or the new one (the same question, `endo query --json`), `endo info DIR` must say which (the old
   generation or the next one), and the append run again must finish with the new state and leave nothing beside
   the index (no `.DIR.old`, temp folder or lock file).
2. M damaged copies of that index (byte flips, truncation, empty or missing files, header values of the wrong type):
   every `endo query` must exit non-zero with one clean line that says what to do, or answer exactly as the
   undamaged index did.

    .venv/bin/python tests/tools/crash_check.py [--kills 15] [--copies 120] [--seed 0] [--in-process]

--in-process runs the queries of part 2 through `endo_retrieval.cli.main` in this process (one model load instead of
one per query; the exit code is main's return, stderr is captured the same way). Prints a summary; exits 1 on any
failure.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTION = "Which mineral was found under the bridge?"
DOC_A = "The Harbour Bridge was finished in 1932. Its granite came from a quarry near Moruya. " * 40
DOC_B = "Lodzite, a rare green mineral, was found in 1981 under the old stone bridge at Kelso. " * 40
ENDO = [sys.executable, "-c", "import sys; from endo_retrieval.cli import main; sys.exit(main())"]  # `endo`


def answer(out: str) -> str:
    """`endo query --json`'s answer without its timings (stage_ms), which differ from run to run."""
    try:
        return json.dumps([{k: v for k, v in hit.items() if k != "stage_ms"} for hit in json.loads(out)])
    except ValueError:
        return out


def query(folder: Path, in_process: bool) -> tuple[int, str, str]:
    args = ["query", str(folder), QUESTION, "--json", "--k", "2"]
    if not in_process:
        run = subprocess.run(ENDO + args, capture_output=True, text=True)
        return run.returncode, answer(run.stdout), run.stderr
    from endo_retrieval.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(args)
        except SystemExit as e:
            rc = e.code
        except BaseException as e:  # noqa: BLE001 - a traceback is a failure of this check
            err.write(f"TRACEBACK {type(e).__name__}: {e}\n")
            rc = 99
    return rc, answer(out.getvalue()), err.getvalue()


def generation(folder: Path) -> int | None:
    """The committed generation `endo info DIR --json` reports (None where it fails)."""
    run = subprocess.run(ENDO + ["info", str(folder), "--json"], capture_output=True, text=True)
    return json.loads(run.stdout)["generation"] if run.returncode == 0 else None


def kills(root: Path, n: int, rng: random.Random) -> list[str]:
    docs = root / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(DOC_A)
    (docs / "b.txt").write_text(DOC_B)
    base = root / "base"
    subprocess.run(ENDO + ["index", str(docs / "a.txt"), "--out", str(base)], check=True, capture_output=True)
    old, old_generation = query(base, False)[1], generation(base)
    t0 = time.monotonic()
    done = root / "done"
    shutil.copytree(base, done)
    subprocess.run(ENDO + ["index", str(docs / "b.txt"), "--out", str(done), "--append"], check=True,
                   capture_output=True)
    append_s = time.monotonic() - t0
    new = query(done, False)[1]
    assert old != new, "the append changed nothing: the check cannot tell the states apart"
    failures = []
    for i in range(n):
        work = root / f"kill{i}"
        shutil.copytree(base, work / "ix")
        append = ENDO + ["index", str(docs / "b.txt"), "--out", str(work / "ix"), "--append"]
        proc = subprocess.Popen(append, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, append_s * 1.1))  # from the model's load to past the save
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        got, said = query(work / "ix", False)[1], generation(work / "ix")
        state = "old" if got == old else "new" if got == new else None
        left = sorted(p.name for p in work.iterdir() if p.name != "ix")
        print(f"kill {i}: {state or 'NEITHER'}, endo info: generation {said}, left {left}", flush=True)
        if state is None:
            failures.append(f"kill {i}: the index answers neither the old nor the new state")
        elif said != old_generation + (state == "new"):
            failures.append(f"kill {i}: the index answers the {state} state but `endo info` says generation {said}")
        again = subprocess.run(append, capture_output=True, text=True)  # the user's retry
        rest = sorted(p.name for p in work.iterdir())
        if again.returncode != 0 or query(work / "ix", False)[1] != new or rest != ["ix"]:
            failures.append(f"kill {i}: the append run again exited {again.returncode} ({again.stderr.strip()[-200:]})"
                            f", left {rest}, or answers other than the new state")
    return failures


def damage(folder: Path, rng: random.Random) -> str:
    name = rng.choice(["endo-index.json", "features/feature_index.bin", "corpus.arrays"])
    path = folder / name
    data = bytearray(path.read_bytes())
    kind = rng.choice(["flip", "truncate", "empty", "missing", "wrong-type"])
    if kind == "flip":
        data[rng.randrange(len(data))] ^= rng.randint(1, 255)
        path.write_bytes(bytes(data))
    elif kind == "truncate":
        path.write_bytes(bytes(data[: rng.randrange(len(data))]))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "missing":
        path.unlink()
    else:
        name = "endo-index.json"
        head = json.loads((folder / name).read_text())
        key = rng.choice(sorted(head))
        head[key] = rng.choice([1, "1", None, [], {}, 1.5, -7, True])
        (folder / name).write_text(json.dumps(head))
    return f"{kind} {name}"


def copies(root: Path, n: int, rng: random.Random, in_process: bool) -> list[str]:
    base = root / "done"
    good = query(base, in_process)
    failures, refused = [], 0
    for i in range(n):
        work = root / f"copy{i % 2}"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(base, work)
        what = damage(work, rng)
        rc, out, err = query(work, in_process)
        lines = [line for line in err.splitlines() if line.strip()]
        if rc == 0 and out == good[1]:
            continue
        refused += rc != 0
        clean = rc not in (0, 99) and len(lines) == 1 and "Traceback" not in err and \
            any(w in lines[0].lower() for w in ("rebuild", "build one", "delete"))
        if not clean:
            failures.append(f"copy {i} ({what}): exit {rc}, stderr {err.strip()[:300]!r}")
    print(f"{n} damaged copies: {refused} refused with one clean line, {n - refused - len(failures)} answered as "
          "the undamaged index", flush=True)
    return failures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=15)
    p.add_argument("--copies", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--in-process", action="store_true", help="part 2's queries in this process")
    args = p.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="endo-crash-check-"))
    try:
        failures = kills(root, args.kills, rng) + copies(root, args.copies, rng, args.in_process)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for f in failures:
        print("FAIL", f)
    print(f"{args.kills} kills, {args.copies} damaged copies: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
