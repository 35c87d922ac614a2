"""Whether a model fits the machine, asked before it is loaded: its parameters (from a GGUF header or the
safetensors headers, without reading weights) times the bytes per parameter it is loaded in, against the memory
free on the device it goes to. A model too large fails at once with the size it needs, instead of the process being
killed part-way through a conversion or a load. ENDO_SKIP_MEMORY_CHECK=1 skips the check."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

GIB = 1 << 30
# a loaded model also holds buffers, the tokenizer and the allocator's slack: ask for this much more than its weights
OVERHEAD = 1.1


class InsufficientMemoryError(ValueError):
    """The model does not fit the memory free on its device; the message says how much it needs."""


def safetensors_parameters(folder: Path) -> int | None:
    """Parameters in a folder's *.safetensors files, from their JSON headers (None: no such files)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for d in entry["shape"]:
                    count *= int(d)
                total += count
    return total


def _cgroup_free() -> int | None:
    """What the process's cgroup (v2, else v1) still lets it allocate, where it sets a limit."""
    v1 = "/sys/fs/cgroup/memory/memory."
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         (v1 + "limit_in_bytes", v1 + "usage_in_bytes")):
        try:
            cap = Path(limit).read_text().strip()
            if cap == "max" or int(cap) >= 1 << 60:
                return None
            return int(cap) - int(Path(usage).read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def available_bytes(device) -> int | None:
    """Free memory on `device` (a torch.device): the GPU's free memory, or the host's MemAvailable (bounded by the
    cgroup's limit); None where it cannot be told."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        pass
    cgroup = _cgroup_free()
    if cgroup is not None:
        free = cgroup if free is None else min(free, cgroup)
    return free


def check_fits(what: str, n_parameters: int | None, dtype, device, doing: str = "load") -> None:
    """InsufficientMemoryError unless `n_parameters` in `dtype` fit the memory free on `device`."""
    import torch

    if not n_parameters or os.environ.get("ENDO_SKIP_MEMORY_CHECK", "") not in ("", "0"):
        return
    free = available_bytes(device)
    if free is None:
        return
    size = torch.empty(0, dtype=dtype).element_size()
    need = int(n_parameters * size * OVERHEAD)
    if need > free:
        where = "GPU" if torch.device(device).type == "cuda" else "host"
        smaller = " or dtype=torch.bfloat16 (half the bytes)," if size > 2 else ""
        raise InsufficientMemoryError(
            f"{what} needs about {need / GIB:.1f} GiB of {where} memory to {doing} ({n_parameters / 1e6:,.0f}M "
            f"parameters x {size} bytes in {str(dtype).removeprefix('torch.')}, plus {OVERHEAD - 1:.0%}), but "
            f"{free / GIB:.1f} GiB is free. Free memory, use a machine with more,{smaller} or a smaller model "
            "(ENDO_SKIP_MEMORY_CHECK=1 skips this check).")
