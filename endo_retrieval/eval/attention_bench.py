"""`endo bench attention`: decode-time attention backends side by side.

* Passkey grid (ReAttention section 3.3, Figure 2): for each context length and needle depth, the local model reads
  the whole haystack through each backend and answers; accuracy = the key appears in the answer. A heat-map PNG
  (length x depth per backend) is written beside the JSON.
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

from endo_retrieval.eval.perf import peak_rss_mb

SCHEMA = "endo-bench-attention/1"
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"


def _ints(text: str) -> list[int]:
    from endo_retrieval.eval.bench import _int_list

    return _int_list(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default=None, help="passkey:DIR (text files to hide the keys in), e.g. "
                   "passkey:../shared/data/pg_essays; omit to run only the kernel comparison")
    p.add_argument("--out", required=True, help="FILE.json; FILE.md and FILE.png go beside it")
    p.add_argument("--context-tokens", type=_ints, default=[8192, 16384, 32768, 65536, 131072],
                   help="haystack lengths (default 8192,16384,32768,65536,131072)")
    p.add_argument("--depths", type=int, default=5, help="needle depths per length, evenly from 0 to 1 (default 5)")
    p.add_argument("--attention", default="dense,reattention", help="backends (default dense,reattention)")
    p.add_argument("--scopes", type=_ints, default=None,
                   help="ReAttention attended scopes to compare (its `window`: local = half, k' fills the rest); "
                        "default: the model's trained window only")
    p.add_argument("--dense-max", type=int, default=None,
                   help="skip `dense` above this length (it reads every key; default: run it everywhere)")
    p.add_argument("--kernel-keys", type=_ints, default=[8192, 16384, 32768, 65536],
                   help="key counts for the kernel comparison (CUDA only)")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="a local model folder (default: the embedded SmolLM2-135M)")


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
            out.append((name, name, {}))
    return out


def passkey_rows(backbone, data: str, lengths: list[int], depths: int, runs: list[tuple[str, str, dict]], seed: int,
                 max_new_tokens: int, dense_max: int | None, progress: bool = True) -> tuple[list[dict], dict]:
    from tqdm import tqdm

    from endo_retrieval.attention import get_backend
    from endo_retrieval.attention.generate import generate_text
    from endo_retrieval.eval.data import load_examples

    rows, grid = [], {}
    jobs = [(n, run) for n in lengths for run in runs if not (run[1] == "dense" and dense_max and n > dense_max)]
    bar = tqdm(total=len(jobs) * depths, desc="passkey", disable=not progress)
    for n in lengths:
        examples = load_examples(data, count_tokens=backbone.count_tokens, context_tokens=n, limit=depths, seed=seed)
        for label, name, settings in [r for l, r in jobs if l == n]:
            hits, seconds, peak = [], 0.0, 0.0
            for ex in examples:
                backend = get_backend(name, **settings)
                if backbone.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                t = time.perf_counter()
                answer = generate_text(backbone, passkey_prompt(backbone, ex.context), backend, max_new_tokens)
                seconds += time.perf_counter() - t
                peak = max(peak, _peak_mb(backbone.device))
                hits.append(ex.answers[0] in answer)
                grid.setdefault(label, {}).setdefault(str(n), {})[f"{ex.meta['depth']:.2f}"] = hits[-1]
                bar.update()
            rows.append({"attention": name, "context_tokens": n, "budget": backend.scope, "n": len(hits),
                         "accuracy": sum(hits) / len(hits), "attn_rel_l1": None,
                         "latency_ms": 1000 * seconds / len(hits), "peak_mem_mb": peak,
                         "device": backbone.device.type})
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
                result[impl] = (sorted(times)[len(times) // 2] * 1000, (torch.cuda.max_memory_allocated() - base) / 2**20)
            rows.append({"shape": shape_name, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "queries": queries,
                         "keys": m, "triton_ms": result["triton"][0], "torch_ms": result["torch"][0],
                         "triton_mem_mb": result["triton"][1], "torch_mem_mb": result["torch"][1],
                         "speedup": result["torch"][0] / result["triton"][0],
                         "memory_ratio": result["torch"][1] / max(result["triton"][1], 1e-6)})
    return rows


def length_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def markdown(result: dict) -> str:
    lines = []
    rows = result["rows"]
    if rows:
        lengths = sorted({r["context_tokens"] for r in rows})
        lines += ["| attention | scope | " + " | ".join(length_label(n) for n in lengths) + " |",
                  "|---|---|" + "---|" * len(lengths)]
        for name, scope in dict.fromkeys((r["attention"], r["budget"]) for r in rows):
            acc = {r["context_tokens"]: r for r in rows if (r["attention"], r["budget"]) == (name, scope)}
            lines.append(f"| {name} | {scope or 'all'} | " + " | ".join(
                f"{acc[n]['accuracy']:.2f}" if n in acc else "-" for n in lengths) + " |")
        lines += ["", "Mean seconds per example (prefill + answer): " + "; ".join(
            f"{r['attention']} {length_label(r['context_tokens'])} {r['latency_ms'] / 1000:.1f}" for r in rows)]
    if result.get("kernel"):
        lines += ["", "| shape (heads/kv/dim) | queries | keys | triton ms | torch ms | speed-up | triton MB | "
                  "torch MB | memory ratio |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['shape']} ({r['heads']}/{r['kv_heads']}/{r['head_dim']}) | {r['queries']} | {r['keys']} | "
                  f"{r['triton_ms']:.2f} | {r['torch_ms']:.2f} | {r['speedup']:.0f}x | {r['triton_mem_mb']:.1f} | "
                  f"{r['torch_mem_mb']:.0f} | {r['memory_ratio']:.0f}x |" for r in result["kernel"]]
    return "\n".join(lines) + "\n"


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


def run(args) -> int:
    from endo_retrieval.backbone import Backbone
    from endo_retrieval.files import atomic_write

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    backends = [b.strip() for b in args.attention.split(",") if b.strip()]
    from endo_retrieval.attention import BACKENDS, AttentionError

    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise AttentionError(f"Unknown attention backend {unknown[0]!r}; known: {', '.join(BACKENDS)}.")
    result = {"schema": SCHEMA, "config": {"data": args.data, "context_tokens": args.context_tokens,
                                           "depths": args.depths, "attention": backends, "scopes": args.scopes,
                                           "seed": args.seed,
                                           "max_new_tokens": args.max_new_tokens}, "rows": [], "grid": {}}
    if args.data:
        backbone = Backbone(args.model) if args.model else Backbone.default()
        result["config"]["model"] = backbone.model_id
        result["rows"], result["grid"] = passkey_rows(
            backbone, args.data, args.context_tokens, args.depths, variants(backends, args.scopes), args.seed,
            args.max_new_tokens, args.dense_max)
        heatmap(result["grid"], out.with_suffix(".png"))
    from endo_retrieval.kernels.sae_topk import triton_available

    if triton_available():
        result["kernel"] = kernel_rows(args.kernel_keys, {"SmolLM2-135M": (9, 3, 64), "Llama-8B": (32, 8, 128)})
    else:
        result["kernel_note"] = "kernel comparison skipped: needs a CUDA GPU with Triton"
    atomic_write(out, lambda p: p.write_text(json.dumps(result, indent=2), encoding="utf-8"))
    atomic_write(out.with_suffix(".md"), lambda p: p.write_text(markdown(result), encoding="utf-8"))
    print(markdown(result))
    print(f"wrote {out} and {out.with_suffix('.md').name}" + (f", {out.with_suffix('.png').name}" if args.data else ""))
    return 0
