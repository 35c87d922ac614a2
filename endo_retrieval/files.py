"""Atomic file writes: every index, corpus map, SAE and profile the project saves goes through here."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` fills a temp file beside `path`; it is fsynced and renamed over `path`, then the folder is
    fsynced. A crash at any point leaves the old file or the new one under `path`, never a half-written one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return path


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
