"""How many threads a CPU read gets: the cores no other process is using right now.

torch's OpenMP threads spin while they wait for each other, so a read with as many threads as cores collapses when
another process keeps a core busy: the default pipeline took 16 to 38 s per question beside one busy process on a
2-core CPU with torch's two threads, and 7.7 s with one (4.2 s with the machine idle). Before each read the cores
that other processes used over a short window are left to them; torch's configured count stays the ceiling, so
`torch.set_num_threads(n)` and OMP_NUM_THREADS still bound it, and ENDO_THREADS=N fixes the count outright.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

WINDOW_S = 0.05  # how long the other processes' use is sampled: 5 scheduler ticks at 100 Hz, 1% of a CPU read
TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _machine_busy_s(stat: str) -> float:
    """Seconds of CPU time all cores have spent busy, from /proc/stat's first line (user nice system ... steal)."""
    fields = [int(x) for x in stat.split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return (sum(fields[:8]) - idle) * TICK_S


def _own_busy_s(stat: str) -> float:
    """Seconds of CPU time this process has used, from /proc/self/stat (utime and stime, after the command)."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def busy_elsewhere(window: float = WINDOW_S, proc: Path = Path("/proc")) -> float | None:
    """Cores' worth of CPU that other processes used over the next `window` seconds (None where /proc is absent)."""
    try:
        machine0, own0 = _machine_busy_s((proc / "stat").read_text()), _own_busy_s((proc / "self/stat").read_text())
        time.sleep(window)
        machine1, own1 = _machine_busy_s((proc / "stat").read_text()), _own_busy_s((proc / "self/stat").read_text())
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, (machine1 - machine0) - (own1 - own0)) / window


def fitted_threads(configured: int, cores: int, busy: float | None) -> int:
    """Threads for a read: the cores left idle by others (rounded), at least 1 and at most `configured`."""
    if busy is None:
        return configured
    return max(1, min(configured, round(cores - busy)))


@contextmanager
def threads_for_cpu_work(device):
    """Run a CPU read with `fitted_threads`, restoring torch's count after; on another device, or with
    ENDO_THREADS set, nothing is measured."""
    import torch

    if getattr(device, "type", str(device)) != "cpu":
        yield
        return
    configured = torch.get_num_threads()
    fixed = os.environ.get("ENDO_THREADS", "").strip()
    if fixed:
        if not fixed.isdigit() or int(fixed) < 1:
            raise ValueError(f"ENDO_THREADS must be a whole number of threads >= 1, got {fixed!r}; unset it to let "
                             "each CPU read take the cores other processes leave idle.")
        threads = int(fixed)
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = fitted_threads(configured, cores, busy_elsewhere())
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(configured)
