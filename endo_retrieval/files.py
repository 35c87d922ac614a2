"""Crash-safe files: every index, corpus map, SAE and profile the project saves goes through here, and the errors a
damaged or busy one raises.

One file: `atomic_write` (a temp file beside it, fsync, rename). A folder of files (an EndoIndex): `replacing_folder`
fills a temp folder beside it and swaps it in with two renames, under `writer_lock` (one writer at a time, which
first cleans what a killed writer left); `read_folder` reads one state of such a folder even while a writer swaps
it. Every step that changes the disk first calls `step()`, where the crash tests stop the process (`crash_hook`), so
each step is tested as a crash point.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, TypeVar

T = TypeVar("T")
crash_hook: Callable[[str], None] | None = None  # tests: called with the step's name before each change to the disk
READ_ATTEMPTS = 8  # a reader retries this often when writers keep swapping the folder under it
MAX_VALUE = 1 << 48  # no stored count or position reaches this (a 2**48-token corpus is far past any index)


class IndexCorruptError(ValueError):
    """An index on disk cannot be used: a file is damaged, truncated, missing, or written by another format version
    or for another model. Every load failure of an index raises this one type (the CLI prints it as one line); the
    message names the file and says what to do, usually to rebuild the index."""


class IndexVersionError(IndexCorruptError):
    """The index file was written by an incompatible version of the format."""


class IndexBusyError(ValueError):
    """Another writer is updating the index folder; retry when it has finished."""


def step(what: str) -> None:
    """A point where the process may die: the disk must then hold the old state or the new one."""
    if crash_hook is not None:
        crash_hook(what)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` fills a temp file beside `path`; it is fsynced and renamed over `path`, then the folder is
    fsynced. A crash at any point leaves the old file or the new one under `path`, never a half-written one; the
    temp file it may leave is never read, and the next write of `path` removes it once its process is gone."""
    path = Path(path)
    _sweep_temp_files(path)
    step(f"create a temp file for {path.name}")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        step(f"write {path.name}")
        write(tmp)
        step(f"fsync {path.name}")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        step(f"rename {path.name} into place")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    step(f"fsync the folder of {path.name}")
    fsync_dir(path.parent)
    return path


def _sweep_temp_files(path: Path) -> None:
    """Remove temp files of `path` left by writers that died (the pid in their name is not running)."""
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(\d+)\..*\.tmp$")
    for stale in path.parent.glob(f".{_glob_escape(path.name)}.*.tmp"):
        m = pattern.match(stale.name)
        if m and not _running(int(m.group(1))):
            step(f"remove the stale {stale.name}")
            stale.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def link_unchanged(previous: Path | None, folder: Path, name: str, source: os.stat_result | None) -> bool:
    """Hard-link `previous/name` (a committed index folder's file) into `folder` (the next generation being filled)
    where it is still the file `source` describes (the one read from it): files are never changed in place, so
    both generations hold it whole. False where it is not, or links are not supported: the caller writes it."""
    try:
        if previous is None or source is None or not os.path.samestat(os.stat(previous / name), source):
            return False
        step(f"link {name}")
        os.link(previous / name, folder / name)
    except OSError:
        return False
    return True


# ---- a folder replaced as a whole ------------------------------------------------------------------------------


def set_aside(directory: Path) -> Path:
    """Where the folder's previous state waits during a swap: `.NAME.old` beside it."""
    return directory.with_name(f".{directory.name}.old")


def recover_folder(directory: Path) -> None:
    """Finish what a crashed swap left: a folder set aside but never replaced is put back (the old state); one set
    aside after the new folder was in place is removed; temp folders of unfinished writes are removed. Only under
    `writer_lock(directory)` (which calls it): every temp folder is then a dead writer's."""
    old = set_aside(directory)
    if old.exists():
        if directory.exists():
            step(f"remove {old.name}")
            shutil.rmtree(old, ignore_errors=True)
        else:
            step(f"put {old.name} back")
            os.replace(old, directory)
    temp = re.compile(rf"^\.{re.escape(directory.name)}\.tmp-[A-Za-z0-9_]+$")
    for stale in directory.parent.glob(f".{_glob_escape(directory.name)}.tmp-*"):
        if temp.match(stale.name):
            step(f"remove the stale {stale.name}")
            shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def replacing_folder(directory: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temp folder beside `directory` to fill; on a clean exit it replaces `directory`, on an exception
    it is removed. Call it under `writer_lock(directory)`. The swap is two renames (the old folder aside, the new one
    in); a crash between them leaves the old state at `.NAME.old`, which readers read and the next writer puts back."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    recover_folder(directory)
    step(f"create a temp folder for {directory.name}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        yield tmp
        step(f"fsync the temp folder of {directory.name}")
        fsync_dir(tmp)
        old = set_aside(directory)
        if directory.exists():
            step(f"set {directory.name} aside")
            os.replace(directory, old)
        step(f"rename the new {directory.name} into place")
        os.replace(tmp, directory)
        step(f"fsync the folder of {directory.name}")
        fsync_dir(directory.parent)
        if old.exists():
            step(f"remove the old {directory.name}")
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_folder(directory: str | os.PathLike, read: Callable[[Callable[[str], BinaryIO]], T]) -> T:
    """`read(open_file)`, where `open_file(name)` opens a file of `directory` for reading, all of one state of the
    folder: every file is opened relative to one handle on the folder, so a writer's swap midway cannot mix the old
    folder's files with the new one's; when the old folder's files vanish before they were opened, it reads again.
    Mid-swap (or after a crash there) the old state is read from `.NAME.old`. FileNotFoundError: no such folder, or
    a file really missing."""
    directory = Path(directory)
    for _ in range(READ_ATTEMPTS):
        folder = directory if directory.exists() else set_aside(directory)
        try:
            fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except FileNotFoundError:
            if not (directory.exists() or set_aside(directory).exists()):
                raise FileNotFoundError(errno.ENOENT, "no such folder", str(directory)) from None
            continue  # swapped between the look and the open
        try:
            return read(_opener(folder, fd))
        except FileNotFoundError:
            if folder == directory and _still(folder, fd):
                raise  # the folder is unchanged: the file is really missing (a set-aside one is always on its way out)
        finally:
            os.close(fd)
    raise IndexBusyError(f"{directory} was replaced {READ_ATTEMPTS} times while it was read; retry when the "
                         "writers have finished")


def _opener(folder: Path, fd: int) -> Callable[[str], BinaryIO]:
    if os.open in os.supports_dir_fd:
        return lambda name: open(name, "rb", opener=lambda p, flags: os.open(p, flags, dir_fd=fd))
    return lambda name: open(folder / name, "rb")  # no dir_fd here: files by path (a swap may still mix them)


def _still(folder: Path, fd: int) -> bool:
    """Whether `folder` still names the folder open as `fd` (a removed folder has no links: its inode number may
    already name the next one)."""
    try:
        now, pinned = os.stat(folder), os.fstat(fd)
    except FileNotFoundError:
        return False
    return pinned.st_nlink > 0 and (now.st_dev, now.st_ino) == (pinned.st_dev, pinned.st_ino)


# ---- one writer at a time --------------------------------------------------------------------------------------


class _FolderLock:
    def __init__(self) -> None:
        self.thread = threading.RLock()
        self.file = None  # the open lock file while held
        self.depth = 0


_locks: dict[str, _FolderLock] = {}
_locks_guard = threading.Lock()


@contextlib.contextmanager
def writer_lock(directory: str | os.PathLike, wait: float = 0.0) -> Iterator[None]:
    """Hold the one writer's place of an index folder (threads and processes): an flock on `.NAME.lock` beside it,
    since the folder itself is replaced on save. Re-entrant in one thread. IndexBusyError when another writer holds
    it for more than `wait` seconds; the lock dies with its process, so a crash never leaves it held. Taking it first
    finishes what a killed writer left (`recover_folder`), so every writer cleans up, even one that then writes
    nothing; releasing it removes the lock file."""
    directory = Path(os.path.abspath(directory))
    with _locks_guard:
        lock = _locks.setdefault(str(directory), _FolderLock())
    busy = IndexBusyError(f"another writer is updating the index {directory}; retry when it has finished")
    if not (lock.thread.acquire(timeout=wait) if wait > 0 else lock.thread.acquire(blocking=False)):
        raise busy
    try:
        if lock.depth == 0:
            directory.parent.mkdir(parents=True, exist_ok=True)
            lock.file = _lock_file(directory.with_name(f".{directory.name}.lock"), time.monotonic() + wait, busy)
            try:
                recover_folder(directory)
            except BaseException:
                _unlock(lock.file)
                raise
        lock.depth += 1
        try:
            yield
        finally:
            lock.depth -= 1
            if lock.depth == 0:
                _unlock(lock.file)
                lock.file = None
    finally:
        lock.thread.release()


def _lock_file(path: Path, deadline: float, busy: Exception):
    """The lock file at `path`, open and flocked. A holder removes it before it lets go, so a lock won on a file that
    no longer bears that name is stale: open the name again (else two writers could each hold a different file)."""
    try:
        import fcntl
    except ImportError:  # no flock here: threads of one process still exclude each other
        return open(path, "a+b")
    while True:
        file = open(path, "a+b")
        try:
            while True:
                try:
                    fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise busy from None
                    time.sleep(0.02)
            if _same_file(path, file):
                return file
        except BaseException:
            file.close()
            raise
        file.close()


def _same_file(path: Path, file) -> bool:
    try:
        now, held = os.stat(path), os.fstat(file.fileno())
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _unlock(file) -> None:
    """Remove the lock file while still holding it (a writer waiting on it then sees it is stale), then let go."""
    try:
        os.unlink(file.name)
    except OSError:  # gone already, or an open file cannot be removed here (Windows): it stays, harmless
        pass
    file.close()  # closing drops the flock


# ---- checksums of saved files ------------------------------------------------------------------------------------
SEAL = "header_sha256"  # the last field of a sealed JSON header: the SHA-256 of the JSON before it
_SEAL_TAIL = re.compile(rb', "header_sha256": "([0-9a-f]{64})"\}\s*$')


def sha256_of(f: BinaryIO, block: int = 1 << 23) -> str:
    """SHA-256 of an open binary file from its start, `block` bytes at a time: read through the file, not a memory
    map of it, so checking a large array maps none of its pages into the process."""
    f.seek(0)
    h, buffer = hashlib.sha256(), bytearray(block)
    view = memoryview(buffer)
    while n := f.readinto(buffer):
        h.update(view[:n])
    return h.hexdigest()


def sealed_json(fields: dict) -> bytes:
    """`fields` as a JSON object whose last field, SEAL, is the SHA-256 of the JSON of the others: a header that
    checks itself, with no re-serialisation on read (`read_sealed_json`)."""
    body = json.dumps(fields)
    return f'{body[:-1]}, "{SEAL}": "{hashlib.sha256(body.encode()).hexdigest()}"}}'.encode()


def read_sealed_json(raw: bytes) -> dict:
    """The fields `sealed_json` wrote, checked against their SHA-256; a JSON object without SEAL (written before
    headers were sealed) is returned unchecked. ValueError naming what is wrong otherwise."""
    fields = json.loads(raw.decode("utf-8"))
    if not isinstance(fields, dict):
        raise ValueError("not a JSON object")
    tail_at = max(0, len(raw) - len(SEAL) - 96)
    seal = _SEAL_TAIL.search(raw, tail_at)
    if seal is None:
        if SEAL in fields:
            raise ValueError(f"{SEAL} is {fields[SEAL]!r}, not the SHA-256 of the header")
        return fields
    if hashlib.sha256(raw[: seal.start()] + b"}").hexdigest() != seal.group(1).decode():
        raise ValueError("header checksum mismatch")
    fields.pop(SEAL, None)
    return fields


def check_json(obj, where: str) -> None:
    """Raise ValueError naming the first key path whose value JSON cannot hold."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: key {key!r} is not a string; JSON metadata needs string keys")
            check_json(value, f"{where}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            check_json(value, f"{where}[{i}]")
    elif not (obj is None or isinstance(obj, (str, int, float, bool))):
        raise ValueError(f"{where} holds a {type(obj).__name__}, which is not JSON-serialisable; "
                         f"convert it to str/int/float/bool/list/dict first")


def cache_dir() -> Path:
    """Where converted weights and other derived files live ($ENDO_CACHE, else ~/.cache/endo-retrieval)."""
    return Path(os.environ.get("ENDO_CACHE") or Path.home() / ".cache" / "endo-retrieval")
