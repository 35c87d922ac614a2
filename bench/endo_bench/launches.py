"""Model forwards and CUDA launches per question (`endo bench corpus`, `endo bench perf`). A small model's question
is bound by how much work the host launches, not by its arithmetic (on an H200 the 135M and the 1.5B model took
the same time per question), so these counts are where a regression shows first."""
from __future__ import annotations

from contextlib import contextmanager

import torch

LAUNCH_QUESTIONS = 3  # warm questions profiled for the CUDA counts (the profiler slows what it watches)
# host calls that start device work: a kernel each, or a whole captured graph
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


@contextmanager
def counting_forwards(backbone):
    """Yields a one-item list that counts the decoder's forwards (calls of `backbone.model.model`) while open; a
    replayed CUDA graph is not a forward (`cuda_launches` counts it)."""
    count = [0]

    def hook(*_):
        count[0] += 1

    handle = backbone.model.model.register_forward_pre_hook(hook)
    try:
        yield count
    finally:
        handle.remove()


def cuda_launches(fn, device) -> dict | None:
    """What one call of `fn` starts on a CUDA device, from torch.profiler's trace: "launches" (host calls that
    start device work, LAUNCH_CALLS: one per kernel, one per replayed graph), "kernels" (kernels the device ran,
    those inside graphs too) and "copies" (memory copies and sets). None off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    counts = {"launches": 0, "kernels": 0, "copies": 0}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            counts["copies" if event.name.startswith(("Memcpy", "Memset")) else "kernels"] += 1
        elif event.name in LAUNCH_CALLS:
            counts["launches"] += 1
    return counts


def launches_per_question(ask, questions, device) -> dict | None:
    """`cuda_launches` of `ask(question)` averaged over the first LAUNCH_QUESTIONS of `questions`, each asked once
    more unprofiled first, so the profile counts the steady state (its shapes' CUDA graphs replayed, not
    captured): {"launches", "kernels", "copies", "questions"}. None off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    profiled = []
    for question in questions[:LAUNCH_QUESTIONS]:
        ask(question)
        profiled.append(cuda_launches(lambda: ask(question), device))
    if not profiled or profiled[0] is None:
        return None
    return {key: round(float(sum(p[key] for p in profiled) / len(profiled)), 1) for key in profiled[0]} | \
        {"questions": len(profiled)}
