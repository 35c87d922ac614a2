"""What every bench shares, below all of them: number lists on the command line, clocks that wait for the
accelerator, memory peaks, result rows of the GUIDE contract, length labels, and questions to time with."""
from __future__ import annotations

import re
import resource
import time

import numpy as np
import torch


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def clock(device) -> float:
    """Seconds, read after the accelerator has finished what was queued (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_accel_mb(device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None


def accel_mb(device) -> float | None:
    """Accelerator memory allocated now (MiB); None on a CPU."""
    return torch.cuda.memory_allocated() / 2**20 if device.type == "cuda" else None


def row(section: str, metric: str, method: str | None, n: int | None, value, unit: str, device: str,
        **extra) -> dict:
    """One result row of the GUIDE contract; `value` None means not measured (the note says why)."""
    return {"section": section, "metric": metric, "method": method, "context_tokens": n,
            "value": None if value is None else float(value), "unit": unit, "device": device, **extra}


def length_label(n: int | None) -> str:
    if n is None:
        return "-"
    for size, suffix in ((2**20, "M"), (2**10, "k")):
        if n >= size and n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)


def questions_from(text: str, count: int) -> list[str]:
    """`count` questions about sentences spread evenly through `text`: timing needs questions of realistic length
    and vocabulary, not answers."""
    sentences = [s.split() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) >= 8]
    if not sentences:
        raise ValueError("the text has no sentence of 8 words or more to ask about; give --text real prose.")
    picks = np.linspace(0, len(sentences) - 1, count).round().astype(int)
    return [f"What does the text say about {' '.join(sentences[i][1:7]).strip(',;:')}?" for i in picks]
