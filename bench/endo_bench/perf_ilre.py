"""ILRe's time to its allocation at long lengths, stage by stage, for `endo bench perf --sections ilre`.

ILRe's work for one context: tokenise it (host), stream it to l_R (the forward, [ILRe Alg. 1]'s prefill), A^C at
l_R ([ILRe Eq. 4-5], `context_scores`) and the multi-kernel allocation ([ILRe Alg. 1], on the host). Each stage is
timed alone, after the accelerator has finished it. Five rows per length, side by side in one run: the streamed
chunks forwarded several to a batch as the text is tokenised (`ilre`, the library's default), the text tokenised
first (`ilre-tokenised-first`), and one chunk per forward too (`ilre-unbatched`), the sink + window frame cached
per layer instead of recomputed (`ilre-cached`, chunks batched, tokenising overlapped), and that with the layers
below l_R through torch.compile (`ilre-cached-compiled`; compiled during the warm-up).
The FLOPs are counted from the chunks the stream forwards (each with its sink + window frame): linear maps
2 * parameters * tokens, attention 4 * heads * head_dim * n(n+1)/2 per layer below l_R, and l_R's key and query
projections; `peak_share` divides their rate by
the accelerator's dense bf16 peak (--peak-tflops). `kept_overlap` is the share of the default row's kept tokens
that a variant keeps too: 1.0 where the faster path computes the same states, below where it computes others (the
cached frame: window tokens saw their own past; bf16 kernels of the compiled layers round differently).
"""
from __future__ import annotations

import numpy as np

from endo_bench.measure import clock, peak_accel_mb, reset_peak, row

# method -> how the stream runs: chunks batched (the default), one chunk per forward, the frame cached
VARIANTS = {"ilre": {}, "ilre-tokenised-first": {"tokenise_first": True},
            "ilre-unbatched": {"batch_tokens": 0, "tokenise_first": True}, "ilre-cached": {"frames": "cache"},
            "ilre-cached-compiled": {"frames": "cache", "compiled": True}}


def forward_flops(backbone, length: int, layer: int, chunk_size: int, sink: int, window: int,
                  cached: bool = False) -> float:
    """FLOPs of the streamed forward of `length` context tokens to `layer`: each chunk with its frame recomputed, or
    (cached) the chunk alone, its queries reading the frame's keys too. Layers below `layer` run whole; of `layer`
    only the key and query projections run (`backbone.Projections`)."""
    per_layer = sum(p.numel() for p in backbone.model.model.layers[0].parameters())
    attn = backbone.model.model.layers[0].self_attn
    projections = attn.k_proj.weight.numel() + attn.q_proj.weight.numel()
    flops = 0.0
    for s in range(0, length, chunk_size):
        t = min(s + chunk_size, length) - s
        frame = min(sink, s) + max(0, min(s - sink, window))  # Backbone.stream
        n = t if cached else t + frame
        pairs = t * frame + t * (t + 1) / 2  # causal query-key pairs of the chunk's queries (and the frame's)
        pairs += 0 if cached else frame * (frame + 1) / 2
        flops += layer * (2 * per_layer * n + 4 * backbone.n_heads * backbone.head_dim * pairs) + 2 * projections * n
    return flops


def time_stages(ilre, text: str, question: str, budget: int, stream: dict) -> dict[str, float]:
    """Seconds per stage. As `ILRe.compress` does, the model reads the first pieces of the text while the rest are
    tokenised, so tokenising is inside "prefill" and "encode" is only the query part's; `tokenise_first` tokenises
    the whole text before the prefill (its own "encode" stage)."""
    from endo_retrieval.methods.ilre import context_scores, prefill

    bb, device = ilre.backbone, ilre.backbone.device
    t0 = clock(device)
    query_ids = bb.encode(ilre.query_template.format(question=question)).ids
    pieces = []
    stream = dict(stream)
    context_ids = bb.encode(text).ids if stream.pop("tokenise_first", False) else bb.tokens.arriving_ids(text, pieces)
    t1 = clock(device)
    states = prefill(bb, context_ids, query_ids, [ilre.layer], sink=ilre.sink, window=ilre.window,
                     chunk_size=ilre.chunk_size, positions=ilre.positions, **stream)[ilre.layer]
    t2 = clock(device)
    scores = context_scores(bb, states)
    t3 = clock(device)
    kept = ilre.allocate(scores, budget)
    t4 = clock(device)
    return {"encode": t1 - t0, "prefill": t2 - t1, "scores": t3 - t2, "allocate": t4 - t3, "total": t4 - t0,
            "tokens": sum(map(len, pieces)) if pieces else len(context_ids), "kept": kept}


def ilre_rows(backbone, source, lengths: list[int], budget: int, layer: int | None, peak_tflops: float,
              model: str | None = None, note: str = "", bar=None) -> list[dict]:
    from endo_retrieval.methods.ilre import ILRe

    ilre = ILRe(backbone, layer=layer)
    device, dev = backbone.device, backbone.device.type
    warm = source.take(min(lengths))
    for stream in VARIANTS.values():  # warm-up, excluded: CUDA graphs are captured here
        time_stages(ilre, warm, "What is this about?", budget, stream)
    rows, extra = [], {"budget": budget, "ilre_layer": ilre.layer, "chunk_size": ilre.chunk_size,
                       **({"model": model} if model else {})}
    for n in sorted(lengths):
        text = source.take(n)
        default_kept = None
        for method, stream in VARIANTS.items():
            reset_peak(device)
            t = time_stages(ilre, text, "What is this about?", budget, stream)
            default_kept = t["kept"] if default_kept is None else default_kept
            flops = forward_flops(backbone, t["tokens"], ilre.layer, ilre.chunk_size, ilre.sink, ilre.window,
                                  cached=stream.get("frames") == "cache")
            common = dict(section="ilre", method=method, n=n, device=dev, note=" ".join(filter(None, [note,
                          source.note(n)])), tokenising="before" if "tokenise_first" in stream else "overlapped",
                          **extra)
            for stage in ("encode", "prefill", "scores", "allocate"):
                rows.append(row(metric=f"stage_{stage}_ms", value=1e3 * t[stage], unit="ms",
                                share=t[stage] / t["total"], **common))
            rows += [row(metric="total_ms", value=1e3 * t["total"], unit="ms", **common),
                     row(metric="tokens_per_s", value=t["tokens"] / t["total"], unit="tokens/s", **common),
                     row(metric="prefill_tflops", value=flops / t["prefill"] / 1e12, unit="TFLOP/s", **common),
                     row(metric="peak_share", value=flops / t["prefill"] / (peak_tflops * 1e12), unit="fraction",
                         **common),
                     row(metric="peak_accel_mb", value=peak_accel_mb(device), unit="MiB", **common),
                     # the share of the default's kept tokens this variant keeps too (1.0: the same allocation)
                     row(metric="kept_overlap", value=len(np.intersect1d(t["kept"], default_kept)) / len(default_kept),
                         unit="fraction", **common)]
        if bar is not None:
            bar.update()
    return rows

