"""`endo bench attention`: decode-time attention backends side by side (`--measure accuracy,error,latency`).

* Accuracy. Passkey grid (ReAttention section 3.3, Figure 2): for each context length and needle depth, the local
  model reads the whole haystack through each backend and answers; accuracy = the key appears in the answer. A
  heat-map PNG (length x depth per backend) is written beside the JSON. HotpotQA (`--data PATH.json`): greedy
  answers scored with SQuAD F1 / exact match; accuracy = F1.
* Error (`eval/attention_error.py`): mean relative l1 of the attention output against dense versus the
  token-equivalent read budget, split by head entropy (RCA Table 2's accounting, Figure 2); FILE_error.png.
* Latency (CUDA only): the attention operator of each backend against bare SDPA, and decode tokens/s.
* Kernel (section 3.4, Figure 5): the fused Triton top-k scores against the plain torch version at growing key
  counts, time and peak accelerator memory (CUDA only).
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from endo_retrieval.cli.commands import model_argument
from endo_retrieval.cli.commands import int_list
from endo_bench.measure import length_label, peak_rss_mb

SCHEMA = "endo-bench-attention/1"
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"


def _fractions(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions like 0.02,0.05; got {text!r}") from None
    if not values or not all(0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"budget fractions must lie in (0, 1], got {text!r}")
    return values


MEASURES = ("accuracy", "error", "latency", "kernel")
# label -> (backend, settings): RCA's selection-only Top-K and its hybrid are `completion` with phi off / on
VARIANTS = {"topk": ("completion", {"phi": None}), "topk+phi": ("completion", {"charge_phi_cache": True})}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", action="append", default=None,
                   help="passkey:DIR (text files to hide the keys in), e.g. passkey:../shared/data/pg_essays, and/or "
                        "a HotpotQA PATH.json (F1-scored generation); repeat for both; omit to skip accuracy")
    p.add_argument("--measure", default="accuracy,kernel",
                   help=f"comma-separated, any of {', '.join(MEASURES)} (default accuracy,kernel; kernel and "
                        "latency need CUDA)")
    p.add_argument("--out", required=True, help="FILE.json; FILE.md and FILE.png go beside it")
    p.add_argument("--context-tokens", type=int_list, default=[8192, 16384, 32768, 65536, 131072],
                   help="haystack lengths (default 8192,16384,32768,65536,131072)")
    p.add_argument("--depths", type=int, default=5, help="needle depths per length, evenly from 0 to 1 (default 5)")
    p.add_argument("--attention", default="dense,reattention",
                   help="backends (default dense,reattention): dense, reattention, completion, prhs, and the variants "
                        "topk (completion, phi off) and topk+phi (completion with --phi maps, fetch charged)")
    p.add_argument("--budgets", type=_fractions, default=[0.01, 0.02, 0.03, 0.05],
                   help="error sweep: token-equivalent budgets per step as fractions f of the context, n = ceil(fN) "
                        "([RCA Eq. 13]; default 0.01,0.02,0.03,0.05)")
    p.add_argument("--accuracy-budget", type=float, default=None,
                   help="accuracy runs: budget fraction for topk, topk+phi and prhs (default: each backend's own)")
    p.add_argument("--phi", default="default",
                   help="phi maps for topk+phi: a folder from `endo train-phi`, or 'default' (the maps shipped for the "
                        "model, where `endo train-phi` writes them)")
    p.add_argument("--phi-tolerance", type=float, default=2.0,
                   help="accuracy runs: refuse phi maps distilled for a prefill length further than this factor "
                        "(default 2.0; a 16k haystack plus its question is just over 2 x 8192)")
    p.add_argument("--limit", type=int, default=10, help="HotpotQA questions per length (default 10)")
    p.add_argument("--error-text", default=None, help="text file or folder for the error sweep (default: the "
                   "pg_essays folder of the shared data)")
    p.add_argument("--error-windows", type=int, default=2, help="text windows per length in the error sweep")
    p.add_argument("--error-queries", type=int, default=16, help="decode queries per window in the error sweep")
    p.add_argument("--latency-keys", type=int, default=4096, help="cached keys per sequence (default 4096)")
    p.add_argument("--latency-batch", type=int, default=16, help="sequences decoded together (default 16)")
    p.add_argument("--latency-steps", type=int, default=32, help="decode steps timed per backend (default 32)")
    p.add_argument("--throughput-context", type=int, default=None,
                   help="prompt tokens before the decode-throughput run (default: --latency-keys; 0 leaves it out: "
                        "a long prompt through the sparse backends' own prefill takes minutes)")
    p.add_argument("--scopes", type=int_list, default=None,
                   help="ReAttention attended scopes to compare (its `window`: local = half, k' fills the rest); "
                        "default: the model's trained window only")
    p.add_argument("--dense-max", type=int, default=None,
                   help="skip `dense` above this length (it reads every key; default: run it everywhere)")
    p.add_argument("--kernel-keys", type=int_list, default=[8192, 16384, 32768, 65536],
                   help="key counts for the kernel comparison (CUDA only)")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    model_argument(p)


def passkey_prompt(backbone, context: str) -> torch.Tensor:
    """Chat template around the haystack and the question, the answer begun (LongBench's answer prefix)."""
    ids = backbone.chat_ids(f"{context}\n\n{QUESTION}")[0]
    prefix = backbone.tokenizer(" " + ANSWER_PREFIX, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    return torch.cat([ids, prefix.to(ids.device)])


def _peak_mb(device) -> float:
    return torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else peak_rss_mb()


def variants(backends: list[str], scopes: list[int] | None) -> list[tuple[str, str, dict]]:
    """(label, backend name, settings): one per backend, and one ReAttention per scope when scopes are given."""
    out = []
    for name in backends:
        if name == "reattention" and scopes:
            out += [(f"reattention@{s}", name, {"window": s}) for s in scopes]
        else:
            out.append((name, *VARIANTS.get(name, (name, {}))))
    return out


def budget_settings(label: str, fraction: float | None, n_context: int, phi, phi_tolerance: float = 2.0) -> dict:
    """The settings that put a backend at n = ceil(f N) exact reads per step [RCA Eq. 13]: Top-K and Top-K+phi take it
    as their budget, PrHS fills it after its sink and local tokens; phi maps go to topk+phi."""
    from endo_retrieval.attention.prhs import PrHS
    from endo_bench.attention_error import budget_tokens

    settings = {"phi": phi, "length_tolerance": phi_tolerance} if label == "topk+phi" else {}
    if fraction is None:
        return settings
    n = budget_tokens(fraction, n_context)
    if label in VARIANTS or label == "completion":
        settings["budget"] = n
    elif label == "prhs":
        settings["top_k"] = max(1, n - PrHS.sink - PrHS.local)
    return settings


def accuracy_rows(backbone, data: str, lengths: list[int], depths: int, limit: int,
                  runs: list[tuple[str, str, dict]], seed: int, max_new_tokens: int, dense_max: int | None,
                  fraction: float | None = None, phi=None, progress: bool = True, phi_tolerance: float = 2.0,
                  store=None) -> tuple[list[dict], dict]:
    """Passkey (`passkey:DIR`, `depths` needles per length, accuracy = key found) or HotpotQA / JSONL (the first
    `limit` questions, accuracy = SQuAD F1, plus em). `store` (a `runner.RecordStore`) keeps each finished example,
    so that a run stopped midway and started again with the same settings computes only what is missing."""
    from tqdm import tqdm

    from endo_retrieval.attention import AttentionError, get_backend
    from endo_retrieval.calibration.datasets import load_examples
    from endo_bench.metrics import bootstrap_ci, exact_match, f1_score
    from endo_bench.runner import Prompter

    passkey = data.startswith("passkey:")
    task = "passkey" if passkey else "hotpotqa"
    prompter = Prompter(backbone)

    def prompt(ex) -> torch.Tensor:
        if passkey:
            return passkey_prompt(backbone, ex.context)
        p = prompter(ex.context, ex.question, ex.answers[0])
        return torch.cat([p.prefill, p.suffix])

    rows, grid = [], {}
    jobs = [(n, run) for n in lengths for run in runs if not (run[1] == "dense" and dense_max and n > dense_max)]
    count = depths if passkey else limit
    bar = tqdm(total=len(jobs) * count, desc=task, disable=not progress)
    for n in lengths:
        examples = load_examples(data, count_tokens=backbone.count_tokens, context_tokens=n, limit=count, seed=seed)
        for label, name, settings in [r for l, r in jobs if l == n]:
            scores, ems, seconds, peak, note, scope = [], [], 0.0, 0.0, None, None
            settings = {**settings, **budget_settings(label, fraction, n, phi, phi_tolerance)}
            for ex in examples:
                key = (f"{task}:{ex.id}", label, fraction, n)
                record = store.records.get(key) if store is not None else None
                if record is None:
                    backend = get_backend(name, **settings)
                    if backbone.device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    t = time.perf_counter()
                    try:
                        answer = backend.generate(backbone, prompt(ex), max_new_tokens)
                    except AttentionError as err:  # budget below the anchors, phi maps absent or for another model
                        note = str(err)
                        bar.update()
                        continue
                    record = {"example": key[0], "method": label, "budget": fraction, "context_tokens": n,
                              "seconds": time.perf_counter() - t, "peak_mb": _peak_mb(backbone.device),
                              "answer": answer, "scope": backend.scope,
                              "score": float(ex.answers[0] in answer) if passkey else f1_score(answer, ex.answers),
                              "em": None if passkey else exact_match(answer, ex.answers)}
                    if store is not None:
                        store.add(record)
                seconds += record["seconds"]
                peak = max(peak, record["peak_mb"])
                scope = record["scope"]
                scores.append(record["score"])
                ems.append(record["em"])
                if passkey:
                    grid.setdefault(label, {}).setdefault(str(n), {})[f"{ex.meta['depth']:.2f}"] = bool(scores[-1])
                bar.update()
            done = len(scores)
            _, lo, hi = bootstrap_ci(scores, seed)
            rows.append({"attention": name, "variant": label, "task": task, "context_tokens": n,
                         "budget": scope, "budget_fraction": fraction
                         if label in ("topk", "topk+phi", "completion", "prhs") else None, "n": done,
                         "accuracy": sum(scores) / done if done else None, "attn_rel_l1": None,
                         "f1": None if passkey or not done else sum(scores) / done,
                         "em": None if passkey or not done else sum(ems) / done,
                         # per example, in the examples' order (the same for every backend at one length): paired
                         # intervals between backends come from these
                         "accuracy_ci": [lo, hi], "scores": [round(x, 4) for x in scores],
                         "latency_ms": 1000 * seconds / done if done else None, "peak_mem_mb": peak,
                         "device": backbone.device.type, "note": note})
    bar.close()
    return rows, grid


def kernel_rows(key_counts: list[int], shapes: dict[str, tuple[int, int, int]], query_counts=(1, 512, 4096),
                top_k: int = 4, repeats: int = 5) -> list[dict]:
    """Fused Triton top-k scores vs the plain torch version: median time and peak memory above the inputs."""
    from endo_retrieval.kernels.topk_attention import topk_scores_reference, topk_scores_triton

    rows = []
    for (shape_name, (heads, kv_heads, dim)), queries in itertools.product(shapes.items(), query_counts):
        for m in key_counts:
            q = torch.randn(heads, queries, dim, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(kv_heads, m, dim, device="cuda", dtype=torch.bfloat16)
            result = {}
            for impl, fn in (("triton", topk_scores_triton), ("torch", topk_scores_reference)):
                fn(q, k, top_k)  # warm-up / compile
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                times = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    fn(q, k, top_k)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
                result[impl] = (sorted(times)[len(times) // 2] * 1000,
                                (torch.cuda.max_memory_allocated() - base) / 2**20)
            rows.append({"shape": shape_name, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "queries": queries,
                         "keys": m, "triton_ms": result["triton"][0], "torch_ms": result["torch"][0],
                         "triton_mem_mb": result["triton"][1], "torch_mem_mb": result["torch"][1],
                         "speedup": result["torch"][0] / result["triton"][0],
                         "memory_ratio": result["torch"][1] / max(result["triton"][1], 1e-6)})
    return rows


class _Folded:
    """The backbone seen by a backend that decodes `batch` sequences at once: the sequences' heads side by side
    (B*H query heads over B*H_kv KV heads; query head b*H + h maps to KV head b*H_kv + h // group, as GQA needs)."""

    def __init__(self, backbone, batch: int):
        self.model, self.apply_rope, self.n_layers = backbone.model, backbone.apply_rope, backbone.n_layers
        self.n_heads, self.n_kv_heads = batch * backbone.n_heads, batch * backbone.n_kv_heads
        self.head_dim, self.model_hash, self.model_id = backbone.head_dim, backbone.model_hash, backbone.model_id


def _cuda_ms(fn, repeats: int) -> float:
    """Median milliseconds of `fn()` over `repeats` calls, each synchronised."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 1000 * sorted(times)[len(times) // 2]


def _graph_ms(steps, n_steps: int, repeats: int = 20) -> float:
    """Milliseconds per operator call when `steps()` (n_steps calls) is replayed as one CUDA graph: no launch or
    Python overhead, for the baseline and the backend alike (how a serving engine runs decode)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        steps()  # compiles the kernels and makes any lazily created state outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steps()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (repeats * n_steps)


def operator_rows(backbone, text: str, runs: list[tuple[str, str, dict]], keys: int = 4096, batch: int = 16,
                  steps: int = 32, layer: int | None = None) -> tuple[list[dict], str]:
    """Attention-operator latency at one decode step (PrHS section V-D): `batch` sequences of `keys` cached
    tokens each (real text windows of the model, their own queries), one new query per sequence; one layer.
    Bare SDPA over the whole cache (bf16, flash) is the dense baseline; each backend's `attend` (append + RoPE +
    selection + attention) is timed per step over `steps` consecutive decode steps of real queries, so CIS shares
    as it would. Returns rows and a torch.profiler table of PrHS's steps (where its time goes)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from endo_retrieval.attention import get_backend
    from endo_bench.attention_error import capture_window

    layer = backbone.n_layers // 2 if layer is None else layer
    ids = torch.as_tensor(backbone.encode(text).ids)
    if len(ids) < batch * (keys + steps):
        raise ValueError(f"the latency text has {len(ids)} tokens; {batch} windows of {keys} + {steps} need more")
    windows = [capture_window(backbone, ids[b * (keys + steps):(b + 1) * (keys + steps)], keys) for b in range(batch)]
    dtype = backbone.dtype
    fold = lambda part: torch.cat([getattr(w, part)[layer] for w in windows]).to(dtype)  # (B*H, T, d)
    q, k, v = fold("q"), fold("k"), fold("v")
    folded, scaling = _Folded(backbone, batch), windows[0].scaling
    H, Hkv, d = backbone.n_heads, backbone.n_kv_heads, backbone.head_dim
    qs = backbone.apply_rope(q[:, :1], torch.arange(keys, keys + 1)).view(batch, H, 1, d)
    ks = backbone.apply_rope(k[:, :keys], torch.arange(keys)).view(batch, Hkv, keys, d)
    vs = v[:, :keys].reshape(batch, Hkv, keys, d)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, scale=scaling, enable_gqa=True)
        sdpa()
        sdpa_ms = _cuda_ms(sdpa, 50)
    base = {"context_tokens": keys, "batch": batch, "layer": layer, "n": steps, "accuracy": None,
            "attn_rel_l1": None, "device": "cuda", "task": "latency_operator"}
    rows = [{**base, "attention": "sdpa", "variant": "sdpa", "budget": None, "latency_ms": sdpa_ms,
             "speedup_vs_sdpa": 1.0, "peak_mem_mb": None}]
    rows += graph_operator_rows(backbone, q, k, v, scaling, runs, base, batch, keys, steps, layer)
    profile = ""
    for label, name, settings in runs:
        backend = get_backend(name, **settings)

        def decode(profiler=None):
            backend.setup(folded)
            backend.cache.append(layer, backend.rope(k[:, :keys], 0, keys), v[:, :keys])
            times = []
            for t in range(steps):
                torch.cuda.synchronize()
                start = time.perf_counter()
                backend.attend(layer, q[:, t:t + 1], k[:, keys + t:keys + t + 1], v[:, keys + t:keys + t + 1], scaling)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                if profiler is not None:
                    profiler.step()
            return 1000 * sorted(times)[len(times) // 2]

        with torch.inference_mode():
            decode()  # warm-up
            ms = decode()
            if name == "prhs":
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
                    decode(prof)
                profile = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
        stats = getattr(backend, "stats", {}) or {}
        rows.append({**base, "attention": name, "variant": label, "budget": backend.scope, "latency_ms": ms,
                     "speedup_vs_sdpa": sdpa_ms / ms, "peak_mem_mb": None, "rho_hat": stats.get("rho_hat")})
    return rows, profile


def graph_operator_rows(backbone, q, k, v, scaling, runs, base: dict, batch: int, keys: int, steps: int,
                        layer: int) -> list[dict]:
    """The operator alone, graph-replayed: bare SDPA against PrHS's decode step (`_decode`: gate, scoring, top-k,
    dilation and attention; the fused kernels on CUDA) over the same growing cache of real states; query t sees
    keys + t + 1 keys."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from endo_retrieval.attention import get_backend

    H, Hkv, d = backbone.n_heads, backbone.n_kv_heads, backbone.head_dim
    kr = backbone.apply_rope(k[:, :keys + steps], torch.arange(keys + steps))  # (B*H_kv, keys + steps, d)
    vr = v[:, :keys + steps].contiguous()
    qr = backbone.apply_rope(q[:, :steps], torch.arange(keys, keys + steps))
    view = lambda x, n, heads: x[:, :n].reshape(batch, heads, n, d)

    def sdpa_steps():
        for t in range(steps):
            F.scaled_dot_product_attention(view(qr[:, t:t + 1], 1, H), view(kr, keys + t + 1, Hkv),
                                           view(vr, keys + t + 1, Hkv), scale=scaling, enable_gqa=True)

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        sdpa_ms = _graph_ms(sdpa_steps, steps)
    base = {**base, "timing": "cuda graph"}
    rows = [{**base, "attention": "sdpa", "variant": "sdpa", "budget": None, "latency_ms": sdpa_ms,
             "speedup_vs_sdpa": 1.0}]
    for label, name, settings in runs:
        if name != "prhs":
            continue
        backend = get_backend(name, **settings)
        backend.setup(_Folded(backbone, batch))

        def prhs_steps():
            for t in range(steps):
                backend._decode(layer, q[:, t:t + 1], qr[:, t:t + 1], kr[:, :keys + t + 1], vr[:, :keys + t + 1],
                                scaling)

        with torch.inference_mode():
            ms = _graph_ms(prhs_steps, steps)
        rows.append({**base, "attention": name, "variant": label, "budget": backend.scope, "latency_ms": ms,
                     "speedup_vs_sdpa": sdpa_ms / ms})
    return rows


def throughput_rows(backbone, text: str, runs: list[tuple[str, str, dict]], context: int = 4096,
                    new_tokens: int = 64) -> list[dict]:
    """Decode tokens/s of `AttentionBackend.generate_ids` with each backend after a `context`-token prompt of real
    text (the time from the first generated token to the last; prefill excluded). Batch 1, as the backends decode."""
    from endo_retrieval.attention import get_backend

    ids = torch.as_tensor(backbone.encode(text).ids[:context])
    rows = []
    for label, name, settings in runs:
        backend = get_backend(name, **settings)
        stamps = [time.perf_counter() for _ in backend.generate_ids(backbone, ids, new_tokens)]
        tokens_per_s = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else None
        rows.append({"attention": name, "variant": label, "task": "throughput", "context_tokens": context,
                     "budget": backend.scope, "n": len(stamps), "accuracy": None, "attn_rel_l1": None,
                     "tokens_per_s": tokens_per_s, "latency_ms": 1000 / tokens_per_s if tokens_per_s else None,
                     "peak_mem_mb": _peak_mb(backbone.device), "device": backbone.device.type})
    return rows


def markdown(result: dict) -> str:
    from endo_bench.attention_error import error_markdown

    lines = []
    rows = [r for r in result["rows"] if r.get("task", "passkey") in ("passkey", "hotpotqa")]
    if rows:
        lengths = sorted({r["context_tokens"] for r in rows})
        lines += ["Accuracy (passkey: key found; hotpotqa: SQuAD F1) and, where measured, the attention-output error "
                  "at the same budget.", "",
                  "| task | attention | scope | " + " | ".join(length_label(n) for n in lengths) + " |",
                  "|---|---|---|" + "---|" * len(lengths)]
        for task, name, scope in dict.fromkeys((r["task"], r["variant"], r["budget"]) for r in rows):
            acc = {r["context_tokens"]: r for r in rows
                   if (r["task"], r["variant"], r["budget"]) == (task, name, scope)}
            lines.append(f"| {task} | {name} | {scope or 'all'} | " + " | ".join(_accuracy_cell(acc.get(n))
                                                                             for n in lengths) + " |")
        lines += ["", "Mean seconds per example (prefill + answer): " + "; ".join(
            f"{r['task']} {r['variant']} {length_label(r['context_tokens'])} {r['latency_ms'] / 1000:.1f}"
            for r in rows if r["latency_ms"] is not None)]
        notes = dict.fromkeys(r["note"] for r in rows if r.get("note"))
        lines += [f"Not run: {n}" for n in notes]
    error = error_markdown(result["rows"])
    if error:
        lines += ["", error]
    timing = [r for r in result["rows"] if r.get("task") in ("latency_operator", "throughput")]
    if timing:
        lines += ["", "| attention | what | keys | batch | ms | speed-up vs SDPA | tokens/s | rho-hat |",
                  "|---|---|---|---|---|---|---|---|"]
        what = lambda r: ("operator, " + r.get("timing", "eager") if r["task"] == "latency_operator" else "decode")
        lines += [f"| {r['variant']} | {what(r)} | "
                  f"{r['context_tokens']} | {r.get('batch', 1)} | {_num(r['latency_ms'], 3)} | "
                  f"{_num(r.get('speedup_vs_sdpa'), 2)} | {_num(r.get('tokens_per_s'), 1)} | "
                  f"{_num(r.get('rho_hat'), 2)} |" for r in timing]
    for note in ("latency_note", "kernel_note"):
        if result.get(note):
            lines += ["", result[note]]
    if result.get("kernel"):
        lines += ["", "| shape (heads/kv/dim) | queries | keys | triton ms | torch ms | speed-up | triton MB | "
                  "torch MB | memory ratio |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['shape']} ({r['heads']}/{r['kv_heads']}/{r['head_dim']}) | {r['queries']} | {r['keys']} | "
                  f"{r['triton_ms']:.2f} | {r['torch_ms']:.2f} | {r['speedup']:.0f}x | {r['triton_mem_mb']:.1f} | "
                  f"{r['torch_mem_mb']:.0f} | {r['memory_ratio']:.0f}x |" for r in result["kernel"]]
    return "\n".join(lines) + "\n"


def _num(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _accuracy_cell(row: dict | None) -> str:
    if row is None or row["accuracy"] is None:
        return "-"
    return f"{row['accuracy']:.2f}" + (f" (err {row['attn_rel_l1']:.3f})" if row.get("attn_rel_l1") is not None else "")


def heatmap(grid: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(grid)
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        lengths = sorted(grid[name], key=int)
        depths = sorted({d for n in lengths for d in grid[name][n]}, key=float)
        cells = np.array([[float(grid[name][n].get(d, np.nan)) for n in lengths] for d in depths])
        ax.imshow(cells, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(lengths)), [length_label(int(n)) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{float(d):.0%}" for d in depths])
        ax.set_xlabel("context length")
        ax.set_ylabel("needle depth")
        ax.set_title(name)
    fig.suptitle("Passkey retrieval (green: found)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _measures(text: str) -> set[str]:
    chosen = {m.strip() for m in text.split(",") if m.strip()}
    if not chosen or chosen - set(MEASURES):
        raise ValueError(f"--measure takes a comma-separated subset of {', '.join(MEASURES)}, got {text!r}")
    return chosen


def run(args) -> int:
    from endo_retrieval.attention import BACKENDS, AttentionError
    from endo_retrieval.model.backbone import Backbone
    from endo_bench import attention_error
    from endo_retrieval.files import atomic_write
    from endo_retrieval.calibration.train_phi import DEFAULT_DATA
    from endo_retrieval.calibration.train_sae import read_corpus

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    measures = _measures(args.measure)
    backends = [b.strip() for b in args.attention.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS and b not in VARIANTS]
    if unknown:
        raise AttentionError(f"Unknown attention backend {unknown[0]!r}; known: {', '.join([*BACKENDS, *VARIANTS])}.")
    result = {"schema": SCHEMA, "config": {"data": args.data, "context_tokens": args.context_tokens,
                                           "depths": args.depths, "attention": backends, "scopes": args.scopes,
                                           "seed": args.seed, "measure": sorted(measures), "budgets": args.budgets,
                                           "accuracy_budget": args.accuracy_budget, "phi": args.phi,
                                           "phi_tolerance": args.phi_tolerance,
                                           "limit": args.limit,
                                           "max_new_tokens": args.max_new_tokens}, "rows": [], "grid": {}}
    runs = variants(backends, args.scopes)
    backbone = None
    if args.data or measures - {"accuracy"}:
        backbone = Backbone(args.model) if args.model else Backbone.default()
        result["config"]["model"] = backbone.model_id
    text = lambda: read_corpus(args.error_text or DEFAULT_DATA)
    if "error" in measures:
        methods = [m for m in attention_error.METHODS if m in backends]
        result["config"].update(error_windows=args.error_windows, error_queries=args.error_queries,
                                entropy_bins="terciles of (layer, head) by dense mid-normalised entropy [RCA Eq. 52]")
        result["rows"] += attention_error.error_rows(
            backbone, text(), args.context_tokens, args.budgets, methods, args.error_windows, args.error_queries,
            args.phi if "topk+phi" in methods else None, progress=True)
        attention_error.error_plot(result["rows"], out.with_name(out.stem + "_error.png"))
    if "accuracy" in measures and args.data:
        errors = {(r["variant"], r["context_tokens"], r["budget_fraction"]): r["attn_rel_l1"]
                  for r in result["rows"] if r["task"] == "attn_error"}
        from endo_bench.runner import RecordStore

        # every finished example, one JSON line each: a run stopped midway and started again with the same --out
        # and settings computes only what is missing
        store = RecordStore(out.with_suffix(".records.jsonl"), {
            "model_hash": backbone.model_hash, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
            "phi": args.phi, "phi_tolerance": args.phi_tolerance})
        for data in args.data:
            rows, grid = accuracy_rows(backbone, data, args.context_tokens, args.depths, args.limit, runs, args.seed,
                                       args.max_new_tokens, args.dense_max, args.accuracy_budget, args.phi,
                                       phi_tolerance=args.phi_tolerance, store=store)
            for row in rows:  # the error measured at the same method, length and budget
                row["attn_rel_l1"] = errors.get((row["variant"], row["context_tokens"], row["budget_fraction"]))
            result["rows"] += rows
            result["grid"].update(grid)
        if result["grid"]:
            heatmap(result["grid"], out.with_suffix(".png"))
    if "latency" in measures:
        if backbone.device.type != "cuda":
            result["latency_note"] = "latency skipped: the operator and throughput timings need a CUDA GPU"
        else:
            timed = [r for r in runs if r[0] != "topk+phi"]  # phi maps are per head: not foldable into a batch
            timed = [(l, n, {**s, **budget_settings(l, args.accuracy_budget, args.latency_keys, None)})
                     for l, n, s in timed]
            rows, profile = operator_rows(backbone, text(), timed,
                                          args.latency_keys, args.latency_batch, args.latency_steps)
            context = args.latency_keys if args.throughput_context is None else args.throughput_context
            result["rows"] += rows + (throughput_rows(backbone, text(), timed, context) if context else [])
            result["latency_profile"] = profile
            result["config"]["latency"] = {"keys": args.latency_keys, "batch": args.latency_batch,
                                           "batch_means": "sequences decoded together, one new query each "
                                                          "(PrHS section V-D), folded into the head axis"}
    from endo_retrieval.kernels.sae_topk import triton_available

    if "kernel" not in measures:
        pass
    elif triton_available():
        result["kernel"] = kernel_rows(args.kernel_keys, {"SmolLM2-135M": (9, 3, 64), "Llama-8B": (32, 8, 128)})
    else:
        result["kernel_note"] = "kernel comparison skipped: needs a CUDA GPU with Triton"
    atomic_write(out, lambda p: p.write_text(json.dumps(result, indent=2), encoding="utf-8"))
    atomic_write(out.with_suffix(".md"), lambda p: p.write_text(markdown(result), encoding="utf-8"))
    print(markdown(result))
    print(f"wrote {out} and {out.with_suffix('.md').name} (and the plots beside them)")
    return 0
