"""Many readers or one writer, for an index shared by threads (queries beside an append)."""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Iterator


class ReadWriteLock:
    """Readers share it, a writer holds it alone. A waiting writer holds back new readers, so a stream of queries
    cannot starve an append; a thread re-enters its own read or write (a writer may read), but a reader cannot
    become a writer."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers: dict[int, int] = {}  # thread id -> depth
        self._writer: int | None = None
        self._depth = 0
        self._waiting = 0

    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if self._writer != me and me not in self._readers:
                self._cond.wait_for(lambda: self._writer is None and not self._waiting)
            self._readers[me] = self._readers.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._readers[me] -= 1
                if not self._readers[me]:
                    del self._readers[me]
                    self._cond.notify_all()

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if self._writer != me:
                if me in self._readers:
                    raise RuntimeError("a thread holding the read lock cannot take the write lock")
                self._waiting += 1
                self._cond.wait_for(lambda: self._writer is None and not self._readers)
                self._waiting -= 1
                self._writer = me
            self._depth += 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if not self._depth:
                    self._writer = None
                    self._cond.notify_all()


def locked(mode: str):
    """Method decorator: run under the instance's `_rw` lock in `mode` ("read" or "write")."""
    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            with getattr(self._rw, mode)():
                return method(self, *args, **kwargs)
        return run
    return wrap
