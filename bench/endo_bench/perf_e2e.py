"""End to end and time to first token for `endo bench perf`: the full context against S3 and ILRe.

Every method starts from the context string and the question and ends after greedy decoding with the model's own
KV cache; all share one prompt template (the quality bench's) and decode exactly `max_new_tokens` tokens
(end-of-sequence ignored), so only what precedes decoding differs:
* full      - the whole context prefilled in one forward;
* ilre      - ILRe compresses the context to the budget (streamed prefill to l_R, [ILRe Eq. 4-5], [ILRe Alg. 1]);
* s3-hybrid - the context indexed [S3 Eq. 4-5], then per question [S3 Eq. 8] selection; one-shot = index + one question,
              amortised = (index + the questions' select and generate) / questions.
An accelerator that runs out of memory gives a null row noted "out of memory"; longer lengths of that method are
then skipped with the same note.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import numpy as np
import torch

from endo_retrieval.model.chunk_graph import MIN_REPLAYS
from endo_bench.measure import clock, peak_accel_mb, questions_from, reset_peak, row
from endo_bench.runner import USER_TEMPLATE

RANDOM_8B = "random llama 8B-shape"


@dataclass
class Timing:
    ttft_s: float  # question in hand -> first generated token
    total_s: float  # question in hand -> last generated token

    def after(self, seconds: float) -> "Timing":
        return Timing(seconds + self.ttft_s, seconds + self.total_s)


def llama8b_config():
    """Llama-3-8B's shape (weights are drawn at random: timing and memory only)."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)


def greedy(backbone, context: str, question: str, max_new_tokens: int) -> tuple[Timing, list[int]]:
    """Chat-template prompt, one prefill forward, then one token a step over a static KV cache (CUDA-graph steps on
    CUDA, as `Backbone.generate` decodes)."""
    from endo_retrieval.model.decode import greedy_tokens

    device = backbone.device
    start = clock(device)
    ids = backbone.chat_ids(USER_TEMPLATE.format(context=context, question=question))
    with backbone.lock:
        steps = greedy_tokens(backbone.model, ids, max_new_tokens)
        tokens = [next(steps)]
        first = clock(device)
        tokens += list(steps)
        end = clock(device)
    return Timing(first - start, end - start), torch.cat(tokens, dim=1)[0].tolist()


def time_full(backbone, context: str, question: str, max_new_tokens: int) -> Timing:
    return greedy(backbone, context, question, max_new_tokens)[0]


def time_ilre(ilre, context: str, question: str, budget: int, max_new_tokens: int) -> Timing:
    start = clock(ilre.backbone.device)
    kept = ilre.compress(context, question, budget).text
    prepared = clock(ilre.backbone.device) - start
    return greedy(ilre.backbone, kept, question, max_new_tokens)[0].after(prepared)


def time_s3(backbone, saes, context: str, questions: list[str], budget: int, max_new_tokens: int,
            chunk_size: int) -> tuple[float, list[Timing]]:
    """(seconds to index the context, one Timing per question from the same index)."""
    from endo_retrieval.methods.search import Document, EndoIndex
    from endo_retrieval.methods.s3 import S3Hybrid

    device = backbone.device
    start = clock(device)
    index = EndoIndex(backbone, "s3-hybrid", saes=saes, chunk_size=chunk_size)
    index.add_documents([Document("context", context)])
    index_s = clock(device) - start
    hybrid, timings = S3Hybrid(backbone, saes=saes), []
    for q in questions:
        start = clock(device)
        kept = hybrid.select(index, q, budget).text
        selected = clock(device) - start  # taken before generating, or the generation would count twice
        timings.append(greedy(backbone, kept, q, max_new_tokens)[0].after(selected))
    return index_s, timings


def measured(device, method: str, n: int, fn, ran_out: dict[str, int]):
    """(fn(), peak accelerator MiB during it, None), or (None, None, note) when the accelerator ran out of memory,
    now or at a shorter length (`ran_out`: method -> that length; longer lengths are not tried again)."""
    if method in ran_out:
        return None, None, f"out of memory (ran out at {ran_out[method]} tokens; skipped)"
    reset_peak(device)
    try:
        return fn(), peak_accel_mb(device), None
    except torch.OutOfMemoryError:
        ran_out[method] = n  # leave the except block before freeing, so the traceback's tensors can go
    gc.collect()
    torch.cuda.empty_cache()
    return None, None, "out of memory"


def timing_rows(section: str, n: int, method: str, timing: Timing | None, peak, note: str, device: str,
                metrics=("e2e_ms", "ttft_ms"), **extra) -> list[dict]:
    extra = {**extra, **({"note": note} if note else {})}
    value = {"e2e_ms": timing and timing.total_s * 1000, "ttft_ms": timing and timing.ttft_s * 1000}
    out = [row(section, m, method, n, value[m], "ms", device, **extra) for m in metrics]
    if device == "cuda":
        out.append(row(section, "peak_accel_mb", method, n, peak, "MiB", device, **extra))
    return out


def _join(*notes) -> str:
    return "; ".join(n for n in notes if n)


def e2e_rows(backbone, saes, source, lengths: list[int], args, bar, ilre_layer: int | None = None,
             model: str | None = None, model_note: str = "") -> list[dict]:
    """`ilre_layer`, `model`, `model_note`: for a model other than the one `args` names (the 8B shape)."""
    from endo_retrieval.methods.ilre import ILRe

    device, dev, budget, new = backbone.device, backbone.device.type, args.budget, args.max_new_tokens
    ilre = ILRe(backbone, layer=ilre_layer if ilre_layer is not None else args.ilre_layer)
    # warm-up, excluded: every code path once, long enough for the stream to capture its chunk shapes (chunk_graph.py)
    warm = source.take(min(min(lengths), max(2 * budget, MIN_REPLAYS * args.chunk_size)))
    q = questions_from(warm, 1)
    time_full(backbone, warm, q[0], 2)
    time_ilre(ilre, warm, q[0], budget, 2)
    time_s3(backbone, saes, warm, q, budget, 2, args.chunk_size)
    rows, ran_out = [], {}
    for n in sorted(lengths):
        context = source.take(n)
        questions = questions_from(context, args.questions)
        common = {"budget": budget, "max_new_tokens": new, **({"model": model} if model else {})}
        runs = {"full": lambda: time_full(backbone, context, questions[0], new),
                "ilre": lambda: time_ilre(ilre, context, questions[0], budget, new),
                "s3-hybrid": lambda: time_s3(backbone, saes, context, questions, budget, new, args.chunk_size)}
        for method, fn in runs.items():
            result, peak, note = measured(device, method, n, fn, ran_out)
            note = _join(note, model_note, source.note(n))
            if method != "s3-hybrid":
                rows += timing_rows("e2e", n, method, result, peak, note, dev, questions=1, **common)
                continue
            index_s, timings = result if result else (None, [])
            one_shot = timings[0].after(index_s) if result else None
            amortised = Timing(index_s / len(timings) + np.mean([t.ttft_s for t in timings]),
                               (index_s + sum(t.total_s for t in timings)) / len(timings)) if result else None
            rows += timing_rows("e2e", n, method, one_shot, peak, note, dev, questions=1, **common)
            rows += timing_rows("e2e", n, method, amortised, peak, _join(
                note, f"amortised: (index + {len(questions)} x (select + generate)) / {len(questions)}"), dev,
                questions=len(questions), **common)
            rows.append(row("e2e", "index_ms", method, n, result and index_s * 1000, "ms", dev, **common,
                            **({"note": note} if note else {})))
        bar.update()
    return rows


def ttft_rows(backbone, source, lengths: list[int], budget: int, ilre_layer: int | None, saes=None,
              chunk_size: int = 2048, model: str | None = None, note: str = "", bar=None) -> list[dict]:
    """Time to first token and peak accelerator memory at each length: full context, ILRe, and with `saes` also
    s3-hybrid one-shot (index + select + prefill)."""
    from endo_retrieval.methods.ilre import ILRe

    device, dev = backbone.device, backbone.device.type
    ilre = ILRe(backbone, layer=ilre_layer)

    def runs(context: str, q: str) -> dict:
        out = {"full": lambda: time_full(backbone, context, q, 1),
               "ilre": lambda: time_ilre(ilre, context, q, budget, 1)}
        if saes is not None:
            def s3() -> Timing:
                index_s, (timing,) = time_s3(backbone, saes, context, [q], budget, 1, chunk_size)
                return timing.after(index_s)

            out["s3-hybrid"] = s3
        return out

    warm = source.take(2 * budget)
    for fn in runs(warm, questions_from(warm, 1)[0]).values():  # warm-up, excluded
        fn()
    rows, ran_out = [], {}
    extra = {"budget": budget, "ilre_layer": ilre.layer, **({"model": model} if model else {})}
    for n in sorted(lengths):
        context = source.take(n)
        for method, fn in runs(context, questions_from(context, 1)[0]).items():
            timing, peak, oom = measured(device, method, n, fn, ran_out)
            rows += timing_rows("ttft", n, method, timing, peak, _join(oom, note, source.note(n)), dev,
                                metrics=("ttft_ms",), **extra)
        if bar is not None:
            bar.update()
    return rows


def random_saes(backbone, layers: list[int], d_latent: int = 1024, k: int = 16):
    """Top-k SAEs with random weights (the shipped SAEs' size) for a random-weight model: timing only."""
    from endo_retrieval.model.sae import SAEBank, TopKSAE

    torch.manual_seed(0)
    saes = {l: TopKSAE(backbone.head_dim, d_latent, k).to(backbone.device) for l in layers}
    return SAEBank(saes, {"d_latent": d_latent, "k": k, "model_hash": backbone.model_hash, "model": backbone.model_id})


def random_8b_rows(source, sections: list[str], ttft_lengths: list[int], e2e_lengths: list[int], args
                   ) -> list[dict]:
    """ttft and/or e2e rows of a Llama-3-8B-shaped model with random weights on CUDA; ILRe at layer n_layers // 2.
    Its prefill outweighs its 64 decode steps, unlike the 135M default model's, so what precedes decoding shows."""
    from tqdm.auto import tqdm

    from endo_retrieval.model.backbone import Backbone

    backbone = Backbone.random(llama8b_config(), tokenizer_from=args.model, device="cuda")
    layer = backbone.n_layers // 2
    sae_layers = [round(l * backbone.n_layers / 30) for l in (3, 11, 19)]  # the shipped SAEs' depths on 30 layers
    saes = random_saes(backbone, sae_layers)
    note = (f"RANDOM weights ({backbone.model_id}): timing and memory only; ILRe layer {layer} = n_layers // 2, "
            f"no calibration exists for random weights; s3-hybrid with random SAEs at layers {sae_layers}")
    rows = []
    with tqdm(total=len(ttft_lengths) * ("ttft" in sections) + len(e2e_lengths) * ("e2e" in sections),
              desc="8B shape", disable=None) as bar:
        if "e2e" in sections:
            rows += e2e_rows(backbone, saes, source, e2e_lengths, args, bar, layer, RANDOM_8B, note)
        if "ttft" in sections:
            rows += ttft_rows(backbone, source, ttft_lengths, args.budget, layer, saes, args.chunk_size, RANDOM_8B,
                              note, bar)
    del backbone
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def random_8b_ilre_rows(source, args) -> list[dict]:
    """The ilre section's rows on the Llama-3-8B-shaped model with random weights, ILRe at layer n_layers // 2."""
    from endo_bench.perf_ilre import ilre_rows
    from endo_retrieval.model.backbone import Backbone

    backbone = Backbone.random(llama8b_config(), tokenizer_from=args.model, device="cuda")
    note = f"RANDOM weights ({backbone.model_id}): timing only; ILRe layer n_layers // 2"
    rows = ilre_rows(backbone, source, args.ilre_lengths, args.budget, backbone.n_layers // 2, args.peak_tflops,
                     RANDOM_8B, note)
    del backbone
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def fit_line(x, y) -> tuple[float, float, float | None]:
    """Least squares y = a + b x: (a, b, R^2); R^2 None when y does not vary."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    b, a = np.polyfit(x, y, 1)
    ss_res, ss_tot = np.sum((y - (a + b * x)) ** 2), np.sum((y - y.mean()) ** 2)
    return float(a), float(b), None if ss_tot == 0 else float(1 - ss_res / ss_tot)


def fits(rows: list[dict], model_id: str) -> list[dict]:
    """ILRe's ttft = a + b * length per model (ILRe issue: time linear in length), from two or more points;
    `model_id` names the rows that carry no "model" key."""
    out = []
    for model in dict.fromkeys(r.get("model") for r in rows):
        points = [(r["context_tokens"], r["value"]) for r in rows if r.get("model") == model and
                  r["method"] == "ilre" and r["metric"] == "ttft_ms" and r["value"] is not None]
        if len(points) >= 2:
            a, b, r2 = fit_line(*zip(*points))
            out.append({"model": model or model_id, "method": "ilre", "intercept_ms": a,
                        "ms_per_1k_tokens": 1000 * b, "r2": r2, "points": len(points),
                        "lengths": [n for n, _ in points]})
    return out
