"""How long the model's read will take, and what a user sees meanwhile: a read's expected seconds (from the model's
size on a CPU, then from its own last reads), a progress bar on standard error for a long read, and once per kind of
read a hint naming the settings that read less. The pipeline's searches (`pipeline_progress`, the adapters and the
CLI) and the reranker (`long_read`) use it."""
from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from endo_retrieval.methods import PIPELINE_METHODS
from endo_retrieval.methods.search import EndoIndex

log = logging.getLogger(__name__)

SLOW_S = 3.0  # a read expected (or found) to take longer shows a progress bar where asked and logs the hint once
# A read of n tokens costs about n * (1 + n / QUADRATIC_FROM) units: the layers' cost grows with n, attention's with
# n squared. CPU_UNITS_PER_S is the rate of SmolLM2-135M (REFERENCE_PARAMS) on two CPU cores: the pipeline's 12
# candidates x 128 tokens in 1.62 s p50 when idle (~1,100 units/s), rank_passages over 1k to 8k tokens at 580 to 800
# beside other work; another model scales it by its parameters, until one of its reads is timed (`_rates` keeps the
# last reads' rate per backbone).
QUADRATIC_FROM = 8192
CPU_UNITS_PER_S = 1000.0
REFERENCE_PARAMS = 135e6
_rates: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_params: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_hinted: set[str] = set()  # the kinds of read whose hint was logged in this process


def read_cost(tokens: int) -> float:
    return tokens * (1 + tokens / QUADRATIC_FROM)


def expected_seconds(backbone, tokens: int) -> float | None:
    """How long the model will take to read `tokens` tokens: from its last reads' rate, else on a CPU from its size;
    None on an accelerator not yet timed (fast, until a read there says otherwise)."""
    try:
        rate = _rates.get(backbone)
    except TypeError:  # a backbone stand-in that cannot be weakly referenced
        return None
    if rate is None:
        device = getattr(getattr(backbone, "device", None), "type", None)
        if device != "cpu":
            return None
        rate = CPU_UNITS_PER_S * REFERENCE_PARAMS / _n_params(backbone)
    return read_cost(tokens) / rate


def _n_params(backbone) -> float:
    if backbone not in _params:
        model = getattr(backbone, "model", None)
        _params[backbone] = float(sum(p.numel() for p in model.parameters())) if model is not None else \
            REFERENCE_PARAMS
    return max(_params[backbone], 1.0)


def _timed(backbone, tokens: int, seconds: float) -> None:
    """Record a read's rate, averaged with the last one (the CPU's load varies)."""
    if seconds <= 0 or tokens <= 0:
        return
    rate = read_cost(tokens) / seconds
    try:
        before = _rates.get(backbone)
        _rates[backbone] = rate if before is None else (before + rate) / 2
    except TypeError:
        pass


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


def _hint(kind: str, message: str) -> None:
    if kind not in _hinted:
        _hinted.add(kind)
        log.warning("%s (this hint is logged once)", message)


def progress_enabled(progress: bool | None) -> bool:
    """`progress` as asked; None: when standard error is a terminal."""
    if progress is None:
        isatty = getattr(sys.stderr, "isatty", None)
        return bool(isatty and isatty())
    return bool(progress)


@contextmanager
def long_read(backbone, tokens: int, what: str, faster: str, kind: str, progress: bool | None = None
              ) -> Iterator[None]:
    """Around one read of `tokens` tokens by the model: where it is expected to take more than SLOW_S seconds (on a
    CPU; `expected_seconds`), or turns out to, the hint "`what` takes about N s on this device; faster: `faster`" is
    logged once per process and `kind` (a warning of this module's logger); and where `progress` (None: standard
    error is a terminal), a progress bar on standard error (tqdm) shows after SLOW_S seconds, advancing at the
    expected rate (it stops short of the end until the read is done). The read's time updates the expected rate."""
    expected = expected_seconds(backbone, tokens)
    device = getattr(getattr(backbone, "device", None), "type", None) or "this device"
    if expected is not None and expected > SLOW_S:
        _hint(kind, f"{what} takes about {_seconds(expected)} on this {device.upper() if device == 'cpu' else device}; "
                    f"faster: {faster}")
    show = progress_enabled(progress) and (expected is None or expected > SLOW_S / 4)
    bar = _Ticker(tokens, expected, what) if show else None
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds = time.perf_counter() - start
        if bar is not None:
            bar.close()
    _timed(backbone, tokens, seconds)
    if seconds > SLOW_S and (expected is None or expected <= SLOW_S):
        _hint(kind, f"{what} took {_seconds(seconds)} on this {device.upper() if device == 'cpu' else device}; "
                    f"faster: {faster}")


class _Ticker:
    """A tqdm bar over the read's tokens on standard error, shown once SLOW_S seconds have passed, moved by a
    daemon thread at the expected rate (without one, it counts the seconds)."""

    def __init__(self, tokens: int, expected: float | None, what: str):
        from tqdm.auto import tqdm

        self.expected, self.tokens, self.start = expected, max(int(tokens), 1), time.perf_counter()
        known = expected is not None and expected > 0
        self.bar = tqdm(total=self.tokens if known else None, desc=what.split(" (")[0], unit="tok" if known else "s",
                        unit_scale=known, leave=False, file=sys.stderr, delay=SLOW_S, dynamic_ncols=True)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="endo-progress", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.25):
            elapsed = time.perf_counter() - self.start
            target = min(self.tokens - 1, int(self.tokens * elapsed / self.expected)) if self.expected else \
                int(elapsed)
            if target > self.bar.n:
                self.bar.update(target - self.bar.n)

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        if self.bar.total is not None and self.bar.n < self.bar.total:
            self.bar.update(self.bar.total - self.bar.n)
        self.bar.close()


@contextmanager
def pipeline_progress(index, method: str, depth: int | None = None, read_tokens: int | None = None,
                      progress: bool | None = None, first_stage: str | None = None) -> Iterator[None]:
    """`long_read` around a search whose `endo` pipeline reads candidates with the model (on this process); the
    hint names depth, read_tokens, the first stage where it is not BM25, and method="bm25" (no model read).
    `depth`, `read_tokens`, `first_stage`: the search's own (None: the index's pipeline as fitted)."""
    backbone = getattr(index, "backbone", None) if isinstance(index, EndoIndex) else None
    if method not in PIPELINE_METHODS or backbone is None:
        yield
        return
    pipeline = index.pipeline(method, depth, read_tokens, first_stage)
    reads = pipeline.depth
    if getattr(pipeline, "two_hop", False):
        settings = pipeline.two_hop_settings or {}
        reads += sum(settings.get(name, 0) for name in ("anchors", "refs", "depth2"))
    try:  # the passages as read: at most read_tokens of each, no more candidates than passages
        passages = index.passages()
        read = np.minimum(np.asarray(passages.ends) - np.asarray(passages.starts), pipeline.read_tokens)
        tokens = int(min(reads, len(read)) * read.mean()) if len(read) else 0
    except Exception:  # an estimate only: never the reason a search fails
        tokens = reads * pipeline.read_tokens
    ways = [f"depth={max(1, pipeline.depth // 2)} (--depth; candidates read: {pipeline.depth} now)"]
    if pipeline.read_tokens > 64:
        ways.append(f"read_tokens={max(8, pipeline.read_tokens // 2)} (--read-tokens; {pipeline.read_tokens} now)")
    first_stage = getattr(pipeline, "first_stage", None)
    if isinstance(first_stage, str) and first_stage != "bm25":
        ways.append(f'first_stage="bm25" (EndoIndex.search; {first_stage} now)')
    ways.append('or method="bm25" (--method bm25: no model read)')
    what = f"the {method} pipeline's read of {pipeline.depth} candidates x {pipeline.read_tokens} tokens"
    with long_read(backbone, tokens, what, "; ".join(ways), "retrieve", progress):
        yield
