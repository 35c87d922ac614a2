"""How a CPU read runs: in which number format (`cpu_dtype`), and with how many threads (the cores no other
process is using right now).

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
# a read's own measure of the others' use (over its length) stands for the next read that starts within this long
# after it; back-to-back questions then skip the WINDOW_S sample (3% of a 1.5 s question)
FRESH_S = 2.0
_last: dict = {}  # "ended": when the last read ended (monotonic s), "busy": the others' cores during it
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


def _cpu_times(proc: Path) -> tuple[float, float, float] | None:
    """(monotonic s, the machine's busy CPU s, this process's CPU s), None where /proc is absent."""
    try:
        return (time.monotonic(), _machine_busy_s((proc / "stat").read_text()),
                _own_busy_s((proc / "self/stat").read_text()))
    except (OSError, ValueError, IndexError):
        return None


def _others(before, after, seconds: float | None = None) -> float | None:
    """Cores' worth of CPU that other processes used between two `_cpu_times` (over `seconds`, default the time
    between them)."""
    if before is None or after is None:
        return None
    seconds = seconds or after[0] - before[0]
    if seconds <= 0:
        return None
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / seconds


def busy_elsewhere(window: float = WINDOW_S, proc: Path = Path("/proc")) -> float | None:
    """Cores' worth of CPU that other processes used over the next `window` seconds (None where /proc is absent)."""
    before = _cpu_times(proc)
    if before is None:
        return None
    time.sleep(window)
    return _others(before, _cpu_times(proc), window)


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
        fresh = _last and time.monotonic() - _last["ended"] < FRESH_S
        threads = fitted_threads(configured, cores, _last["busy"] if fresh else busy_elsewhere())
    torch.set_num_threads(threads)
    start = _cpu_times(Path("/proc"))
    try:
        yield
    finally:
        torch.set_num_threads(configured)
        end = _cpu_times(Path("/proc"))
        if end is not None and start is not None and end[0] - start[0] >= WINDOW_S:  # long enough to count ticks
            _last.update(ended=end[0], busy=_others(start, end))


# CPU flags of units that multiply bf16 natively (x86: AVX-512 BF16, AMX); elsewhere torch emulates bf16 in fp32
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU's flags name a bf16 unit (False where /proc/cpuinfo is absent)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return any(f in flags for f in BF16_FLAGS)


def cpu_dtype(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The name of the CPU backbone's default torch dtype: bfloat16 where the CPU has bf16 units (the linear maps
    2.3x faster, the default pipeline 1.39x, recall@5 -0.2 [-0.5, 0.0] on dev300: docs/results.md), else float32.
    ENDO_CPU_DTYPE=float32 or bfloat16 fixes it."""
    fixed = os.environ.get("ENDO_CPU_DTYPE", "").strip().lower()
    if fixed:
        if fixed not in ("float32", "bfloat16"):
            raise ValueError(f"ENDO_CPU_DTYPE must be float32 or bfloat16, got {fixed!r}; unset it to use bf16 "
                             "where the CPU has bf16 units and fp32 elsewhere.")
        return fixed
    return "bfloat16" if cpu_has_bf16(cpuinfo) else "float32"
