"""How documents reach the index: tokenised ahead in a thread, cut into whole chunks as they arrive, and on CUDA
the index work (SAE encode, the postings' sort and copies) on a stream of its own beside the forward, handed to the
host in pieces that need no wait (`EndoIndex.add_documents`)."""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch

from endo_retrieval.model.backbone import Encoding
from endo_retrieval.model.chunk_graph import side_stream


def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="char", unit_scale=True, disable=not enabled, leave=False)


def whole_chunks(pieces: Iterable[Encoding], chunk_size: int, group: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first position, ids) of `group` or more whole chunks as the pieces arrive, then the rest: the chunks of
    one stream over the whole document. The next piece is asked for only once these chunks are queued."""
    ids, first = np.zeros(0, np.int64), 0
    for piece in pieces:
        ids = np.concatenate([ids, piece.ids])
        whole = len(ids) // chunk_size * chunk_size
        if whole >= group * chunk_size:
            yield first, ids[:whole]
            ids, first = ids[whole:], first + whole
    if len(ids):
        yield first, ids


def ahead(items: Iterator, depth: int) -> Iterator:
    """`items`, produced up to `depth` ahead in a daemon thread. An exception there is raised here, and closing
    this generator (the consumer failed or stopped) stops the thread at its next item."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop, end = threading.Event(), object()

    def put(entry) -> bool:
        while not stop.is_set():
            try:
                ready.put(entry, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((end, None))
        except BaseException as e:  # handed to the consumer, which raises it
            put((end, e))

    worker = threading.Thread(target=produce, name="endo-tokenise", daemon=True)
    worker.start()
    try:
        while True:
            item, error = ready.get()
            if item is end:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stop.set()
        worker.join()


def index_streams(device: torch.device) -> tuple[torch.cuda.Stream | None, torch.cuda.Stream | None]:
    """(the stream the forward runs on, the one the index work runs on) on CUDA, else (None, None). The SAE encode,
    the postings' sort and their copies run beside the forward: the SAE kernel fills 32 programs of a 2048-token
    chunk, and the forward's small kernels leave most of the accelerator free."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.current_stream(device), side_stream("index", device)


def recorded_event() -> torch.cuda.Event:
    """An event on the current stream, after the work queued on it so far."""
    event = torch.cuda.Event()
    event.record()
    return event


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy on the host that does not wait for the accelerator (pinned memory; read it after `HandOff.arrived`)."""
    return t.to("cpu", non_blocking=True) if t.is_cuda else t


@dataclass
class HandOff:
    """One hand-off's postings per layer (`sorted_postings`: counts, rows, keep) on their way to the host, with the
    NaN flag so far."""
    start: int
    end: int
    positions: np.ndarray
    postings: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    finite_flag: torch.Tensor
    event: torch.cuda.Event | None  # recorded after the copies on an accelerator; None on the CPU

    def arrived(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    @property
    def finite(self) -> bool:
        return bool(self.finite_flag)
