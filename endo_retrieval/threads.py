"""Threads for work that releases the GIL (numpy's products, ufuncs and gathers over large arrays): a pool per kind
of work and per process, made when first asked (a forked child makes its own). A task on one pool may wait on
another's, never on its own, so no pool waits on itself."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

T, R = TypeVar("T"), TypeVar("R")
CORES = os.cpu_count() or 1
_POOLS: dict[str, tuple[int, ThreadPoolExecutor]] = {}


def pool(kind: str, workers: int = CORES) -> ThreadPoolExecutor:
    """The process's pool for `kind` of work."""
    held = _POOLS.get(kind)
    if held is None or held[0] != os.getpid():
        held = _POOLS[kind] = (os.getpid(), ThreadPoolExecutor(workers, thread_name_prefix=f"endo-{kind}"))
    return held[1]


def each(kind: str, fn: Callable[[T], R], items: Iterable[T], parallel: bool = True) -> list[R]:
    """[fn(x) for x in items], on `kind`'s pool where `parallel` and there is more than one item and one core."""
    items = list(items)
    if not parallel or len(items) < 2 or CORES < 2:
        return [fn(x) for x in items]
    return list(pool(kind).map(fn, items))
