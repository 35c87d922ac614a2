"""Streaming-prefill performance: key-capture throughput with early exit versus a full forward, and peak memory
as the streamed length grows (memory must stay flat: nothing is kept per token)."""
from __future__ import annotations

import resource
import time

import torch


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def stream_throughput(backbone, ids, layer: int, chunk_size: int = 1024, mode: str = "independent") -> float:
    """Tokens per second of streaming `ids` and capturing the keys of `layer` (layers after it never run)."""
    list(backbone.stream(ids[:chunk_size], [layer], chunk_size=chunk_size, mode=mode))  # warm-up
    _sync(backbone.device)
    t = time.perf_counter()
    for chunk in backbone.stream(ids, [layer], chunk_size=chunk_size, mode=mode):
        chunk.keys[layer].sum().item()  # the consumer touches what it gets, as the indexer does
    _sync(backbone.device)
    return len(ids) / (time.perf_counter() - t)


def memory_rows(backbone, ids, lengths, layer: int, chunk_size: int = 1024, mode: str = "independent") -> list[dict]:
    """Peak host RSS (max so far: lengths run in increasing order, so a flat curve means no growth) and peak
    accelerator memory for streaming the first n tokens of `ids`, for each n in `lengths`."""
    rows = []
    for n in sorted(lengths):
        if n > len(ids):
            raise ValueError(f"need {n} tokens of text, have {len(ids)}")
        if backbone.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for chunk in backbone.stream(ids[:n], [layer], chunk_size=chunk_size, mode=mode):
            chunk.keys[layer].sum().item()
        rows.append({"tokens": n, "seconds": time.perf_counter() - t, "peak_rss_mb": peak_rss_mb(),
                     "peak_accel_mb": torch.cuda.max_memory_allocated() / 2**20 if backbone.device.type == "cuda"
                     else None})
    return rows
