"""A watchdog on a question's GPU work: past its timeout the caller gets a GPUStallError naming the device and the
other processes on it, never a silent hang.

Why the work runs on another thread: a CUDA call that hangs (a synchronisation that never returns while other
processes hold the GPU) blocks its thread inside C++, where no Python exception reaches it: a signal handler or
`_thread.interrupt_main` runs only between bytecodes, and only on the main thread. So `Watchdog.run` hands the work
to a worker thread and the caller waits on an event with the timeout. In time, the work's result or exception comes
back unchanged; past it, the caller raises and the worker is left where it hangs (a daemon thread, which nothing
can cancel: the process should be restarted). The stalled work is remembered, so the next question on that device
fails at once instead of queueing behind it, until the work ends after all.

The normal path costs one hand-over to an idle worker and one wait a question, nothing per forward or token:
0.10 ms a call on an H200 host (tools/gpu_stall_check.py), against 55 ms or more for a search; a fresh thread each
time cost six times the hand-over on a busy 2-core CPU. The worker runs in a copy of the caller's context variables,
under its grad and inference mode and on its current CUDA stream: the state torch keeps per thread. The caller
must not hold a lock the work takes (the backbone's), or the worker would wait on it.
"""
from __future__ import annotations

import contextvars
import functools
import os
import queue
import shutil
import subprocess
import threading
import time
from contextlib import nullcontext

import torch

ENV = "ENDO_GPU_TIMEOUT_S"
DEFAULT_S = 120.0  # a question's reads take well under a second on a GPU; only a stall comes near this
WATCHED = frozenset({"cuda"})  # device types guarded unless forced: a CPU's work never waits on another process
LOOKUP_S = 10.0  # the look-up of the GPU's processes may itself hang with the driver
HOW_TO = "docs/usage.md, \"Several workers on one GPU\""


class GPUStallError(TimeoutError):
    """A question's GPU work did not finish within the watchdog's timeout."""


def timeout_s(given: float | None = None) -> float:
    """Seconds a question's GPU work may take: `given`, else ENDO_GPU_TIMEOUT_S, else DEFAULT_S; 0 turns it off."""
    if given is None:
        raw = os.environ.get(ENV, "").strip()
        if not raw:
            return DEFAULT_S
        try:
            given = float(raw)
        except ValueError:
            raise ValueError(f"{ENV} must be seconds >= 0 (0 turns the GPU watchdog off), got {raw!r}.") from None
    if not given >= 0 or given == float("inf"):
        raise ValueError(f"The GPU watchdog's timeout must be seconds >= 0 (0: off), got {given!r}.")
    return float(given)


class Workers:
    """Daemon threads that run guarded work, reused (a thread start per question costs more than the hand-over);
    a stalled one never comes back, so another is started in its place."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle, self._lock = 0, threading.Lock()

    def submit(self, job) -> None:
        with self._lock:
            start = self._idle == 0  # else one idle worker is taken for this job
            self._idle = max(self._idle - 1, 0)
        if start:
            threading.Thread(target=self._serve, name="endo-gpu-watched", daemon=True).start()
        self._jobs.put(job)

    def _serve(self) -> None:
        while True:
            self._jobs.get()()
            with self._lock:
                self._idle += 1


WORKERS = Workers()
_stalled: dict[str, tuple[threading.Event, float]] = {}  # device -> (the stalled work's end, when it began)


class Watchdog:
    """Runs a question's GPU work with a timeout (see the module docstring). `timeout_s`: None reads
    ENDO_GPU_TIMEOUT_S at each run, else DEFAULT_S; 0 is off. `force`: guard a device type outside WATCHED too."""

    def __init__(self, device, timeout_s: float | None = None, force: bool = False):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())  # one name per GPU: "cuda" is "cuda:0"
        self.device, self.timeout_s, self.force = device, timeout_s, force

    def run(self, work, *args, **kwargs):
        limit = timeout_s(self.timeout_s)
        if not limit or (self.device.type not in WATCHED and not self.force):
            return work(*args, **kwargs)
        key = str(self.device)
        if self.device.type == "cuda":
            gpu_uuid(self.device)  # asked now, so that the stall's look-up need not ask the driver for it
        if key in _stalled:
            ended, since = _stalled[key]
            if not ended.is_set():
                raise GPUStallError(stall_message(self.device, time.monotonic() - since, earlier=True))
            _stalled.pop(key, None)
        box, done = {}, threading.Event()
        context, grad, inference = contextvars.copy_context(), torch.is_grad_enabled(), \
            torch.is_inference_mode_enabled()
        cuda = self.device.type == "cuda"
        stream = torch.cuda.stream(torch.cuda.current_stream(self.device)) if cuda else nullcontext()

        def job():
            try:
                if cuda:  # binds the worker to the GPU's context (in a fresh thread cuBLAS warns there is none)
                    torch.cuda.set_device(self.device)
                # in this order: inference_mode sets the grad mode too
                with torch.inference_mode(inference), torch.set_grad_enabled(grad), stream:
                    box["result"] = context.run(work, *args, **kwargs)
            except BaseException as err:  # handed to the caller as it is
                box["error"] = err
            finally:
                done.set()

        began = time.monotonic()
        WORKERS.submit(job)
        if not done.wait(limit):
            _stalled[key] = (done, began)
            raise GPUStallError(stall_message(self.device, limit))
        if "error" in box:
            raise box.pop("error")
        return box["result"]


def stall_message(device: torch.device, seconds: float, earlier: bool = False) -> str:
    where = f"{device} ({gpu_uuid(device)})" if device.type == "cuda" and gpu_uuid(device) else str(device)
    what = (f"An earlier question's GPU work on {where} has been stalled for {seconds:.0f} s"
            if earlier else f"A question's GPU work on {where} stalled: not done within {seconds:g} s")
    return (f"{what} (watchdog: {ENV}). Other processes on this GPU: {bounded(other_processes, device)}. "
            f"This process (pid {os.getpid()}) cannot cancel a hung CUDA call: restart it. Then run fewer workers "
            f"on this GPU, or start CUDA MPS (nvidia-cuda-mps-control -d) so their work shares it, or set {ENV} to "
            f"a longer timeout (0: off) if the work was only slow ({HOW_TO}).")


def bounded(lookup, device) -> str:
    """`lookup(device)` in a daemon thread, at most LOOKUP_S seconds."""
    box = {}
    worker = threading.Thread(target=lambda: box.setdefault("text", lookup(device)), daemon=True)
    worker.start()
    worker.join(LOOKUP_S)
    return box.get("text", f"unknown (NVML / nvidia-smi did not answer within {LOOKUP_S:g} s)")


def other_processes(device: torch.device) -> str:
    """The GPU's other compute processes as 'pid N (name, MiB)', by NVML where nvidia-ml-py is installed, else
    by nvidia-smi; or why they cannot be named."""
    if device.type != "cuda":
        return f"not looked up ({device} is not a CUDA device)"
    uuid = gpu_uuid(device)
    try:
        rows = nvml_processes(uuid, device.index or 0)
    except ImportError:
        if not shutil.which("nvidia-smi"):
            return "cannot tell: neither nvidia-ml-py (pynvml) nor nvidia-smi is installed"
        rows = smi_processes(uuid)
    except Exception as err:  # a driver that no longer answers, a MIG instance NVML cannot open
        return f"cannot tell (NVML: {err})"
    rows = [r for r in rows if r[0] != os.getpid()]
    if not rows:
        return "none listed (inside a container the driver may hide other containers' processes)"
    return ", ".join(f"pid {pid} ({name}, {mib} MiB)" for pid, name, mib in rows)


@functools.lru_cache(maxsize=None)
def gpu_uuid(device: torch.device) -> str | None:
    """The device's UUID as NVML and nvidia-smi spell it ('GPU-...'); None where torch does not say."""
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    except Exception:
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def nvml_processes(uuid: str | None, index: int) -> list[tuple[int, str, str]]:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid else pynvml.nvmlDeviceGetHandleByIndex(index)
        rows = []
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            try:
                name = pynvml.nvmlSystemGetProcessName(p.pid)
            except pynvml.NVMLError:
                name = "?"
            name = name.decode() if isinstance(name, bytes) else name
            mib = "?" if p.usedGpuMemory is None else str(p.usedGpuMemory >> 20)
            rows.append((int(p.pid), os.path.basename(name), mib))
        return rows
    finally:
        pynvml.nvmlShutdown()


def smi_processes(uuid: str | None) -> list[tuple[int, str, str]]:
    """nvidia-smi's compute apps on the GPU `uuid` (all GPUs' where None)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory,gpu_uuid",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         timeout=LOOKUP_S).stdout
    return parse_smi(out, uuid)


def parse_smi(out: str, uuid: str | None) -> list[tuple[int, str, str]]:
    rows = []
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 4 and fields[0].isdigit() and (uuid is None or fields[3] == uuid):
            rows.append((int(fields[0]), os.path.basename(fields[1]), fields[2]))
    return rows
