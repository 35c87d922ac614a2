"""Where one long generation's time goes with a decode-time attention backend: one dev300 haystack at N tokens,
its chunked prefill and the whole generation (prefill and a 32-token answer) timed, then the prefill of its first
32k tokens under torch.profiler (the ops with the most device and host time, and how often the host waited).

    python tools/attention_profile.py MODEL DATA.json BACKEND TOKENS [OUT.json]
    e.g. python tools/attention_profile.py qwen2.5-coder-1.5b-instruct.gguf dev300.json reattention 65536
"""
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from endo_bench.runner import Prompter
from endo_retrieval.attention import get_backend
from endo_retrieval.attention.base import installed
from endo_retrieval.calibration.datasets import load_examples
from endo_retrieval.model.backbone import Backbone

model, data, name, tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
bb = Backbone(model)
ex = load_examples(data, count_tokens=bb.count_tokens, context_tokens=tokens, limit=1, seed=0)[0]
p = Prompter(bb)(ex.context, ex.question, ex.answers[0])
ids = torch.cat([p.prefill, p.suffix])


def sync():
    if bb.device.type == "cuda":
        torch.cuda.synchronize()


def prefill(backend, n: int | None = None) -> float:
    """The chunked prefill of the first n ids (what `generate_ids` runs before its first token), in seconds."""
    sync()
    start = time.perf_counter()
    with bb.lock, torch.inference_mode(), installed(bb, backend):
        for chunk in ids[:n].split(backend.chunk_size):
            bb.model(input_ids=chunk.view(1, -1).to(bb.device), use_cache=False, logits_to_keep=1)
    sync()
    return time.perf_counter() - start


backend = get_backend(name)
prefill(backend, 20000)  # warm: kernels compiled past the point where a middle exists
seconds = prefill(backend)
sync()
start = time.perf_counter()
answer = backend.generate(bb, ids, 32)
sync()
total = time.perf_counter() - start
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bb.device.type == "cuda" else [])
with profile(activities=activities) as prof:
    prefill(backend, 32768)
events = prof.key_averages()
device_key = "self_device_time_total" if bb.device.type == "cuda" else "self_cpu_time_total"
top = sorted(events, key=lambda e: getattr(e, device_key, 0), reverse=True)[:25]
report = {"model": bb.model_id, "backend": name, "tokens": len(ids), "chunks": -(-len(ids) // backend.chunk_size),
          "layers": bb.n_layers, "prefill_s": round(seconds, 2), "generate_s": round(total, 2),
          "profiled": "the prefill of the first 32768 ids",
          "answer": answer, "gold": ex.answers[0],
          "host_syncs": sum(e.count for e in events if "synchronize" in e.key.lower() or e.key in
                            ("aten::item", "aten::_local_scalar_dense", "aten::nonzero")),
          "top_ops": [{"op": e.key, "calls": e.count, "self_device_ms": round(getattr(e, device_key, 0) / 1000, 1),
                       "self_cpu_ms": round(e.self_cpu_time_total / 1000, 1)} for e in top]}
print(json.dumps(report, indent=1))
if len(sys.argv) > 5:
    open(sys.argv[5], "w").write(json.dumps(report, indent=1))
