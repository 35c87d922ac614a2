"""The GPU watchdog (endo_retrieval/model/watchdog.py) on a real GPU: a second process holds memory on it, then
guarded work stalls in a CUDA call (a kernel that spins, then a synchronisation or a copy to the host). Prints, as
JSON: how long each error took against the timeout, whether it named the other process, the next question's fast
failure, the normal path's cost per call, and the memory nvidia-smi charges each process.

    python tools/gpu_stall_check.py [--timeout 2] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from endo_retrieval.model import watchdog
from endo_retrieval.model.watchdog import GPUStallError, Watchdog

HOLDER = ("import time, torch; x = torch.empty(1 << 30, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize(); "
          "print('ready', flush=True); time.sleep(600)")


def timed_error(dog: Watchdog, work) -> tuple[float, str]:
    t0 = time.monotonic()
    try:
        dog.run(work)
    except GPUStallError as err:
        return time.monotonic() - t0, str(err)
    return time.monotonic() - t0, ""


def overhead_us(dog: Watchdog, calls: int = 2000) -> dict:
    """Per call: a small matmul read back to the host, bare and under the watchdog, in alternating blocks."""
    a = torch.randn(256, 256, device="cuda")
    work = lambda: (a @ a).sum().item()  # noqa: E731
    times = {"bare": [], "guarded": []}
    for _ in range(10):
        for name, run in (("bare", work), ("guarded", lambda: dog.run(work))):
            t0 = time.perf_counter()
            for _ in range(calls // 10):
                run()
            times[name].append((time.perf_counter() - t0) / (calls // 10) * 1e6)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"bare_us": round(med["bare"], 1), "guarded_us": round(med["guarded"], 1),
            "added_us": round(med["guarded"] - med["bare"], 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--out")
    args = p.parse_args()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "ready"
    dog = Watchdog("cuda", timeout_s=args.timeout)
    out = {"device": torch.cuda.get_device_name(), "uuid": watchdog.gpu_uuid(dog.device),
           "other_pid": holder.pid, "timeout_s": args.timeout, "overhead": overhead_us(dog)}
    try:
        import pynvml  # noqa: F401
        out["lookup"] = "nvml"
    except ImportError:
        out["lookup"] = "nvidia-smi"
    spin = int(2e9 * (args.timeout + 3))  # cycles: at least timeout + 3 s at a clock of 2 GHz or less
    x = torch.ones(8, device="cuda")
    for name, tail in (("synchronize", torch.cuda.synchronize), ("copy_to_host", lambda: x.sum().item())):
        took, message = timed_error(dog, lambda: (torch.cuda._sleep(spin), tail()))
        again, earlier = timed_error(dog, lambda: 1)
        out[name] = {"error_after_s": round(took, 2), "names_other_pid": f"pid {holder.pid} " in message,
                     "message": message, "next_question_error_after_s": round(again, 3),
                     "next_says_earlier": "earlier question" in earlier}
        ended = watchdog._stalled[str(dog.device)][0]
        out[name]["stalled_work_ended"] = ended.wait(args.timeout + 30)
        out[name]["runs_after_it_ended"] = dog.run(lambda: 7) == 7
    smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    out["nvidia_smi_mib"] = {line.split(",")[0].strip(): line.split(",")[1].strip() for line in smi.splitlines()
                             if "," in line}
    out["self_pid"], out["torch_allocated_mib"] = os.getpid(), torch.cuda.memory_allocated() >> 20
    holder.kill()
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    sys.stdout.flush()
    os._exit(0)  # no stalled worker is left, but never wait on one at exit


if __name__ == "__main__":
    main()
