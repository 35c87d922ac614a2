"""`endo bench perf --sections scale`: one Ray worker against two, side by side in one run (`distributed/`).

* indexing: the same documents (the bench text, --scale-tokens of it, cut at paragraphs into --scale-docs
  documents) built into an index folder by `RayIndexer` with 1 worker, then with 2 (a GPU each, else a CPU slot);
  tokens/s from the committed manifest's token count over the wall time (segments sent back and written included);
* ILRe: A^C of one context of --scale-tokens ([ILRe Eq. 4-5] at l_R) with its chunks on 1 worker, then on 2
  (`ilre_scores`), the two compared (largest difference, same [ILRe Alg. 1] allocation), and one worker's share of
  its compute bound: FLOPs of the layers that run (frames recomputed included) over seconds x --peak-tflops.
With --random-llama-8b the ILRe model is the Llama-3-8B shape with RANDOM weights (timing only), on CUDA.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from endo_bench.measure import questions_from, row

H100_BF16_TFLOPS = 989.0  # dense bf16 peak of an H100 SXM (NVIDIA's data sheet; the H200's is the same)


@dataclass
class Random8B:
    """A worker's model for the ILRe rows: the 8B shape, the same random weights on every worker (seeded)."""

    def __call__(self):
        from endo_retrieval.model.backbone import Backbone
        from endo_bench.perf_e2e import llama8b_config

        torch.manual_seed(0)
        return Backbone.random(llama8b_config(), device="cuda"), None


def documents(text: str, count: int) -> list:
    """`text` cut after paragraph breaks into about `count` documents of about equal length."""
    from endo_retrieval.index.engine import Document

    paragraphs = text.split("\n\n")
    ends = np.cumsum([len(p) + 2 for p in paragraphs])
    cuts = np.unique(np.searchsorted(ends, ends[-1] * np.arange(1, count) / count) + 1)
    parts = ["\n\n".join(paragraphs[a:b]).strip() for a, b in zip([0, *cuts], [*cuts, len(paragraphs)])]
    return [Document(f"scale-{i}", p) for i, p in enumerate(p for p in parts if p)]


def layer_flops(config, tokens: int, keys: float) -> float:
    """Forward FLOPs of one decoder layer for `tokens` tokens that each attend to `keys` keys on average: 2 per
    weight per token (projections and MLP), plus q.k and p.v (4 x heads x head_dim per key)."""
    h, heads = config.hidden_size, config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    weights = h * heads * d * 2 + h * kv * d * 2 + 3 * h * config.intermediate_size
    return tokens * (2.0 * weights + 4.0 * heads * d * keys)


def ilre_flops(config, layer: int, length: int, query: int, chunk: int, sink: int, window: int) -> float:
    """What ILRe's streaming prefill runs: layers 0..l_R over every chunk behind its sink + window frame (the
    frame recomputed with each chunk), and the query part; plus [ILRe Eq. 4]'s logits twice (logsumexp, then A^C)."""
    total, heads = 0.0, config.num_attention_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    starts = list(range(0, length, chunk)) + [length]
    for s, e in zip(starts[:-1] + [length], starts[1:] + [length + query]):
        frame = min(s, sink) + (s - max(sink, s - window) if s > sink else 0)
        n = frame + e - s
        total += (layer + 1) * layer_flops(config, n, (n + 1) / 2)
    return total + 2 * 2.0 * heads * query * length * d


def scale_rows(source, n: int, args, workers: int = 2) -> list[dict]:
    from endo_retrieval import distributed
    from endo_retrieval.index import segments
    from endo_retrieval.model.backbone import Backbone
    from endo_retrieval.methods.ilre import ILRe

    ray = distributed.connect(args.ray or None)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    dev = "cuda" if gpus else "cpu"
    per = "GPU" if gpus else "CPU slot"
    rows, text = [], source.take(n)
    recipe = distributed.ModelRecipe(args.model, args.sae)
    pool = distributed.start_workers(workers, recipe)
    docs = documents(text, args.scale_docs)
    warm = documents(source.take(min(n, 4 * args.chunk_size * workers)), 2 * workers)
    speed = {}
    with tempfile.TemporaryDirectory() as tmp:
        for w in (1, workers):
            indexer = distributed.RayIndexer(pool[:w], chunk_size=args.chunk_size)
            indexer.build(Path(tmp) / f"warm{w}", warm)  # model loads, chunk graphs captured, excluded
            t = time.perf_counter()
            indexer.build(Path(tmp) / f"index{w}", docs)
            seconds = time.perf_counter() - t
            tokens = sum(p["tokens"] for p in segments.listed_committed(Path(tmp) / f"index{w}"))
            speed[w] = tokens / seconds
            rows.append(row("scale", "index_tokens_per_s", f"ray-{w}-worker{'s' * (w > 1)}", n, speed[w], "tok/s",
                            dev, workers=w, documents=len(docs), tokens=tokens, seconds=seconds,
                            note=f"RayIndexer, one {per} per worker, default model; wall time of build() "
                                 "(segments sent back, written and committed)"))
    rows.append(row("scale", "index_speedup", "ray", n, speed[workers] / speed[1], "ratio", dev, workers=workers,
                    note=f"index tokens/s with {workers} workers / with 1, same documents, one run"))
    for w in pool:  # their GPUs (or CPU slots) go to the ILRe workers
        ray.kill(w)

    bb = Backbone.default() if args.model is None else Backbone(args.model)  # the driver tokenises only
    if args.random_llama_8b:
        from endo_bench.perf_e2e import llama8b_config

        config, setup = llama8b_config(), Random8B()
        layer, label = config.num_hidden_layers // 2, "random llama 8B-shape"
        shape = type("Shape", (), {"n_layers": config.num_hidden_layers})()  # ILRe's checks need only the depth
        ilre = ILRe(shape, layer=layer)
    else:
        config, setup, label = bb.config, recipe, bb.model_id
        ilre = ILRe(bb, layer=args.ilre_layer)
    pool = distributed.start_workers(workers, setup)
    context = bb.encode(text).ids
    query = bb.encode(ilre.query_template.format(question=questions_from(text, 1)[0])).ids
    warm = context[: 4 * ilre.chunk_size]
    result, seconds = {}, {}
    for w in (1, workers):
        distributed.ilre_scores(ilre, warm, query, pool[:w])
        t = time.perf_counter()
        result[w] = distributed.ilre_scores(ilre, context, query, pool[:w])
        seconds[w] = time.perf_counter() - t
        rows.append(row("scale", "ilre_ms", f"ilre-{w}-worker{'s' * (w > 1)}", len(context), seconds[w] * 1000, "ms",
                        dev, workers=w, model=label, layer=ilre.layer,
                        note=f"A^C at l_R over the whole context, chunks split over {w} {per}(s)"
                             + ("; RANDOM weights: timing only" if args.random_llama_8b else "")))
    rows.append(row("scale", "ilre_speedup", "ilre", len(context), seconds[1] / seconds[workers], "ratio", dev,
                    workers=workers, model=label))
    same = np.array_equal(ilre.allocate(result[1], args.budget), ilre.allocate(result[workers], args.budget))
    rows.append(row("scale", "ilre_max_abs_diff", "ilre", len(context),
                    float(np.abs(result[1] - result[workers]).max()), "abs", dev, model=label,
                    same_allocation=bool(same), note=f"A^C on {workers} workers vs on 1; same_allocation: "
                    f"[ILRe Alg. 1] at budget {args.budget} picks the same tokens"))
    for w in pool:
        ray.kill(w)
    flops = ilre_flops(config, ilre.layer, len(context), len(query), ilre.chunk_size, ilre.sink, ilre.window)
    useful = ilre_flops(config, ilre.layer, len(context), len(query), ilre.chunk_size, 0, 0)
    rows.append(row("scale", "ilre_compute_share", "ilre-1-worker", len(context),
                    flops / (seconds[1] * args.peak_tflops * 1e12), "ratio", dev, model=label, flops=flops,
                    flops_without_frames=useful, peak_tflops=args.peak_tflops,
                    note="FLOPs of layers 0..l_R (frames recomputed included) / (seconds x peak); "
                         f"the frames are {1 - useful / flops:.0%} of them"))
    return rows
