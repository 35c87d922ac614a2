"""Attention-output error versus a token-equivalent read budget (RCA section 6.3, appendices D and H).

Decode-time queries of a real text: a window of N + Q tokens runs once through the model with dense attention,
keeping every layer's pre-RoPE q, k, v. For each backend the cache of every layer is primed with the N prefill
keys/values (all compared backends prefill densely and cache keys rotated at their absolute positions; PrHS's ETF
changes prefill *outputs*, not the cache), then the Q following positions are replayed one token at a time through
the backend's own `attend`, teacher-forced, so every backend sees the same states and its error does not compound.

Per (layer, query head, query): the relative l1 error of the output against dense [RCA Eq. 53] and the dense
mid-normalised entropy H_mid [RCA Eq. 51-52]. Heads (layer, query head) are split into entropy terciles to test
Figure 2's finding (gain = e_sel - e_hyb, [RCA Eq. 54], largest in high-entropy heads).

Read accounting (per decode step, per head; [RCA Eq. 11-16]): one exact token = its key and value, B_tok = 2 d_h b.
- Top-K: sink + tail + generated tokens + K, K = n - sink - tail [RCA Eq. 14].
- Top-K+phi: the same exact reads with K = n - sink - tail - n_off, plus the phi cache's one-time fetch
  ceil(R_phi) = ceil(d_phi/2 + d_phi/d_h) charged every step (worst case L_gen = 1, [RCA Eq. 12, 15-16]).
- PrHS: the keys each head attends (sink + local + its retrieved or CIS-shared set, less what PSAW masks),
  measured. Its scoring cost (a retrieving head reads every visible middle *key*: half a token each) is reported
  apart as `scoring_tokens` beside rho-hat; Top-K's exhaustive scoring (all of M, every step) likewise. RCA
  counts exact reads only (its selector is an oracle), so `read_tokens` leaves scoring out for every method.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from endo_retrieval.attention.base import AttentionBackend, AttentionError
from endo_retrieval.attention.completion import Completion
from endo_retrieval.attention.dense import Dense
from endo_retrieval.attention.prhs import PrHS
from endo_bench.measure import length_label
from endo_retrieval.kernels.prhs_step import attend_reads, prhs_reads

EPS = 1e-6  # [RCA Eq. 53]'s epsilon
SINK, TAIL = 4, 16  # RCA's anchors (section 6.3); also the mid region M of the entropy [RCA Eq. 51]
METHODS = ("dense", "topk", "topk+phi", "prhs")
ENTROPY_BINS = ("low", "mid", "high")


# ---------------------------------------------------------------- read accounting [RCA Eq. 12-16]


def phi_cache_tokens(d_phi: int, head_dim: int) -> float:
    """R_phi,once = d_phi/2 + d_phi/d_h: the stable cache (m, u, T) in token equivalents [RCA Eq. 12, 47]."""
    return d_phi / 2 + d_phi / head_dim


def budget_tokens(fraction: float, n_prefill: int) -> int:
    """n(f) = ceil(f N): exact reads per decode step, layer and head [RCA Eq. 13]."""
    return math.ceil(fraction * n_prefill)


def retrieved(n: int, sink: int = SINK, tail: int = TAIL, offset: int = 0) -> int:
    """k = max(0, n - sink - tail - n_off): Top-K ([RCA Eq. 14], offset 0) or the hybrid [RCA Eq. 16]."""
    return max(0, n - sink - tail - offset)


def completion_reads(n: int, n_prefill: int, generated: float, d_phi: int | None, head_dim: int,
                     sink: int = SINK, tail: int = TAIL) -> float | None:
    """Token-equivalent reads of one decode step of `completion` at budget n after `generated` new tokens:
    sink + tail + generated + min(K, |M|), plus ceil(R_phi) when a phi remainder exists (L_gen = 1).
    None when the budget does not cover the anchors (and the phi fetch): the paper's infeasible '-'."""
    offset = math.ceil(phi_cache_tokens(d_phi, head_dim)) if d_phi else 0
    if n < sink + tail + offset:
        return None
    mid = max(n_prefill - sink - tail, 0)
    k = min(retrieved(n, sink, tail, offset), mid)
    return sink + tail + generated + k + (offset if k < mid else 0)


# ---------------------------------------------------------------- error and entropy (appendix H)


def relative_l1(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """||o - o_ref||_1 / (||o_ref||_1 + eps) over the last axis [RCA Eq. 53]."""
    return (out.double() - ref.double()).abs().sum(-1) / (ref.double().abs().sum(-1) + EPS)


def mid_entropy(scores: torch.Tensor) -> torch.Tensor:
    """Normalised entropy of softmax(scores) over the last axis (the mid region's logits), in [0, 1] [RCA Eq. 51-52]."""
    log_p = torch.log_softmax(scores.double(), -1)
    n = scores.shape[-1]
    return -(log_p.exp() * log_p).sum(-1) / math.log(n) if n > 1 else torch.zeros(scores.shape[:-1])


def entropy_terciles(entropy: torch.Tensor) -> torch.Tensor:
    """Bin index 0 (low) / 1 (mid) / 2 (high) per head by rank of its entropy: three equal groups."""
    order = entropy.flatten().argsort(stable=True)
    bins = torch.empty_like(order)
    bins[order] = torch.arange(order.numel()) * 3 // order.numel()
    return bins.view(entropy.shape)


# ---------------------------------------------------------------- capture and replay


@dataclass
class Window:
    """Pre-RoPE states of one text window: per layer q (H, Q, d) of the Q decode queries and k, v (H_kv, N+Q, d)."""

    q: dict[int, torch.Tensor]
    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]
    n_prefill: int
    scaling: float


@dataclass
class _Recorder(Dense):
    """Dense attention that keeps the pre-RoPE states of every layer (float32); q only from `keep_q_from` on."""

    keep_q_from: int = 0

    def attend(self, layer, q, k, v, scaling):
        start = self.cache.length(layer)
        got = self.states.setdefault(layer, ([], [], []))
        got[0].append(q[:, max(self.keep_q_from - start, 0):].float())
        got[1].append(k.float())
        got[2].append(v.float())
        self.scaling = scaling
        return super().attend(layer, q, k, v, scaling)


def capture_window(backbone, ids: torch.Tensor, n_prefill: int, chunk_size: int = 2048) -> Window:
    """Run `ids` (N + Q tokens) densely and keep every layer's states; the last Q positions are the queries."""
    if not 0 < n_prefill < len(ids):
        raise ValueError(f"the window has {len(ids)} tokens; it needs more than the {n_prefill} prefill tokens")
    from endo_retrieval.attention.base import installed

    rec = _Recorder(chunk_size=chunk_size, keep_q_from=n_prefill)
    rec.states = {}
    with backbone.lock, torch.inference_mode(), installed(backbone, rec):
        for chunk in ids.split(chunk_size):
            backbone.model(input_ids=chunk.view(1, -1).to(backbone.device), use_cache=False, logits_to_keep=1)
    cat = {l: [torch.cat(part, 1) for part in parts] for l, parts in rec.states.items()}
    return Window(q={l: c[0] for l, c in cat.items()}, k={l: c[1] for l, c in cat.items()},
                  v={l: c[2] for l, c in cat.items()}, n_prefill=n_prefill, scaling=rec.scaling)


@dataclass
class _CountingPrHS(PrHS):
    """PrHS that also counts, per decode step and head, the keys it attends (its exact reads) and the middle keys
    its retrieving heads score."""

    def setup(self, backbone) -> None:
        super().setup(backbone)
        self.attended, self.scored, self.head_steps = 0.0, 0.0, 0

    def _sparse_step(self, q, qr, keys, values, state, scaling, **selection):  # the twin, whose mask is counted
        before = int(self._retrieved)
        reads = prhs_reads(q, qr, keys, *state, self._retrieved, **selection)
        self.attended += float(reads.sum())
        middle = keys.shape[1] - self.local - max(self.sink, selection["window"])
        self.scored += (int(self._retrieved) - before) * middle
        self.head_steps += q.shape[0]
        return attend_reads(qr, keys, values, reads, scaling)


def replay(backbone, backend: AttentionBackend, window: Window) -> torch.Tensor:
    """The backend's decode outputs (L, H, Q, d) for the window's queries, every layer primed with the prefill."""
    backend.setup(backbone)
    n = window.n_prefill
    outs = []
    with torch.inference_mode():
        for layer in sorted(window.q):
            k, v, q = window.k[layer].to(backbone.device), window.v[layer].to(backbone.device), window.q[layer]
            backend.cache.append(layer, backend.rope(k[:, :n], 0, n), v[:, :n])  # dense prefill's cache
            steps = [backend.attend(layer, q[:, t:t + 1].to(backbone.device), k[:, n + t:n + t + 1],
                                    v[:, n + t:n + t + 1], window.scaling) for t in range(q.shape[1])]
            outs.append(torch.cat(steps, 1).float().cpu())
    return torch.stack(outs)


def dense_mid_entropy(backbone, window: Window, sink: int = SINK, tail: int = TAIL) -> torch.Tensor:
    """H_mid (L, H, Q) of dense attention restricted to M = [sink, N - tail) [RCA Eq. 51-52]."""
    n, group = window.n_prefill, backbone.n_heads // backbone.n_kv_heads
    if n - tail - sink < 2:
        raise ValueError(f"prefill {n} leaves no mid region after sink {sink} and tail {tail}")
    out = []
    for layer in sorted(window.q):
        q, k = window.q[layer], window.k[layer][:, :n]
        Q = q.shape[1]
        qr = backbone.apply_rope(q.to(backbone.device), torch.arange(n, n + Q)).double()
        kr = backbone.apply_rope(k.to(backbone.device), torch.arange(n)).double()[:, sink:n - tail]
        scores = torch.einsum("hqd,hnd->hqn", qr, kr.repeat_interleave(group, 0)) * window.scaling
        out.append(mid_entropy(scores).cpu())
    return torch.stack(out)


# ---------------------------------------------------------------- one method at one budget


@dataclass
class Measured:
    """Errors (L, H, Q) of one method at one budget on one window, and its per-step per-head reads."""

    error: torch.Tensor | None
    read_tokens: float | None
    scoring_tokens: float | None = None
    rho_hat: float | None = None
    completion_mass_share: float | None = None
    note: str | None = None


def make_backend(method: str, n: int, phi=None) -> AttentionBackend:
    """dense; topk = completion with phi off; topk+phi = completion charged for the phi fetch (L_gen = 1); prhs with
    top_k filling the budget after its own anchors (sink 8, local 32)."""
    if method == "dense":
        return Dense()
    if method == "topk":
        return Completion(budget=n, sink=SINK, tail=TAIL, phi=None)
    if method == "topk+phi":
        if phi is None:
            raise AttentionError("topk+phi needs phi maps: pass --phi DIR or ship the default model's maps")
        return Completion(budget=n, sink=SINK, tail=TAIL, phi=phi, charge_phi_cache=True)
    if method == "prhs":
        return _CountingPrHS(top_k=max(1, n - PrHS.sink - PrHS.local))
    raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")


def measure(backbone, window: Window, reference: torch.Tensor, method: str, n: int, phi=None) -> Measured:
    """Run `method` at budget n (exact reads per step) and account for its reads."""
    try:
        backend = make_backend(method, n, phi)
        out = replay(backbone, backend, window)
    except AttentionError as err:  # budget below the anchors, maps for another model or length: the '-' cells
        return Measured(None, None, note=str(err))
    Q, N = out.shape[2], window.n_prefill
    generated = (Q + 1) / 2  # mean keys after the prefill at a step (the query's own included), all read exactly
    error = relative_l1(out, reference)
    if method == "dense":
        return Measured(error, N + generated, scoring_tokens=0.0)
    if method == "prhs":
        rho = backend.stats["retrievals"] / max(backend.head_steps, 1)
        return Measured(error, backend.attended / backend.head_steps, backend.scored / 2 / backend.head_steps, rho)
    d_phi = backend.maps.card["d_phi"] if backend.maps is not None else None
    reads = completion_reads(n, N, generated, d_phi, backbone.head_dim)
    share = backend.stats["completion_mass_share"] if d_phi else None
    return Measured(error, reads, scoring_tokens=max(N - SINK - TAIL, 0) / 2, completion_mass_share=share)


# ---------------------------------------------------------------- the sweep: rows, tables, plot


def error_rows(backbone, text: str, lengths: list[int], fractions: list[float], methods: list[str],
               windows: int = 2, queries: int = 16, phi=None, progress: bool = False) -> list[dict]:
    """One row per (context length, method, budget fraction): mean relative l1 over layers, heads, queries and
    windows, the same split by dense entropy tercile of the heads, and the per-step reads."""
    import time

    from tqdm import tqdm

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown error method {unknown[0]!r}; known: {', '.join(METHODS)}")
    ids = torch.as_tensor(backbone.encode(text).ids)
    rows = []
    for N in lengths:
        n_windows = min(windows, len(ids) // (N + queries))
        if n_windows == 0:
            raise ValueError(f"the error text has {len(ids)} tokens, fewer than one window of {N} + {queries}")
        runs = [("dense", None)] * ("dense" in methods) + [(m, f) for m in methods if m != "dense" for f in fractions]
        got: dict[tuple, list] = {run: [] for run in runs}
        entropy = []
        for w in tqdm(range(n_windows), desc=f"attention error {N}", disable=not progress):
            window = capture_window(backbone, ids[w * (N + queries):(w + 1) * (N + queries)], N)
            reference = replay(backbone, Dense(), window)
            entropy.append(dense_mid_entropy(backbone, window))
            for method, f in runs:
                t = time.perf_counter()
                result = measure(backbone, window, reference, method, budget_tokens(f, N) if f else N, phi)
                got[(method, f)].append((result, (time.perf_counter() - t) * 1000 / queries))
            del window
        head_entropy = torch.stack(entropy).mean(dim=(0, 3))  # (L, H): mean over windows and queries
        bins = entropy_terciles(head_entropy)
        for (method, f), results in got.items():
            rows.append(_row(method, f, N, results, bins, n_windows * queries, backbone.device.type))
    return rows


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _row(method: str, fraction: float | None, N: int, results: list, bins: torch.Tensor, n: int,
         device: str) -> dict:
    measured = [m for m, _ in results]
    feasible = all(m.error is not None for m in measured)
    by_head = torch.stack([m.error for m in measured]).mean(dim=(0, 3)) if feasible else None  # (L, H)
    return {"attention": "completion" if method.startswith("topk") else method, "variant": method,
            "task": "attn_error", "context_tokens": N, "budget": budget_tokens(fraction, N) if fraction else None,
            "budget_fraction": fraction, "n": n, "accuracy": None,
            "attn_rel_l1": float(by_head.mean()) if feasible else None,
            "attn_rel_l1_by_entropy": {name: float(by_head[bins == i].mean()) for i, name in enumerate(ENTROPY_BINS)}
            if feasible else None,
            "read_tokens": _mean(m.read_tokens for m in measured),
            "scoring_tokens": _mean(m.scoring_tokens for m in measured),
            "rho_hat": _mean(m.rho_hat for m in measured),
            "completion_mass_share": _mean(m.completion_mass_share for m in measured),
            "latency_ms": _mean(ms for _, ms in results), "peak_mem_mb": None, "device": device,
            "note": next((m.note for m in measured if m.note), None)}


def _fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def error_markdown(rows: list[dict]) -> str:
    """Two tables: relative l1 (and reads) per method and budget at each length; completion gain by entropy."""
    rows = [r for r in rows if r.get("task") == "attn_error"]
    if not rows:
        return ""
    lengths = sorted({r["context_tokens"] for r in rows})
    fractions = sorted({r["budget_fraction"] for r in rows if r["budget_fraction"]})
    lines = ["Mean relative l1 error of the attention output against dense [RCA Eq. 53], all layers and heads; in "
             "brackets the token-equivalent reads per step and head ([RCA Eq. 12-16], L_gen = 1). '-': the budget does "
             "not cover the anchors (and the phi fetch).", ""]
    head = "| method | " + " | ".join(f"{length_label(N)} f={f:.0%}" for N in lengths for f in fractions) + " |"
    lines += [head, "|---|" + "---|" * (len(lengths) * len(fractions))]
    cell = {(r["variant"], r["context_tokens"], r["budget_fraction"]): r for r in rows}
    for method in dict.fromkeys(r["variant"] for r in rows if r["variant"] != "dense"):
        cells = [cell.get((method, N, f)) for N in lengths for f in fractions]
        lines.append(f"| {method} | " + " | ".join(
            "-" if c is None or c["attn_rel_l1"] is None else f"{c['attn_rel_l1']:.3f} ({c['read_tokens']:.0f})"
            for c in cells) + " |")
    prhs = [r for r in rows if r["variant"] == "prhs" and r["rho_hat"] is not None]
    if prhs:
        lines += ["", "PrHS rho-hat (share of head-steps that retrieve) and keys scored per step and head (half a "
                  "token each): " + "; ".join(f"{length_label(r['context_tokens'])} f={r['budget_fraction']:.0%} "
                                              f"{r['rho_hat']:.2f} / {r['scoring_tokens']:.0f}" for r in prhs)]
    lines += ["", "Error by dense mid-normalised entropy tercile of the heads ([RCA Eq. 52]; low / mid / high), and "
              "the completion gain e(topk) - e(topk+phi) [RCA Eq. 54] per tercile:", "",
              "| length | f | topk low/mid/high | topk+phi low/mid/high | prhs low/mid/high | gain low/mid/high |",
              "|---|---|---|---|---|---|"]
    for N in lengths:
        for f in fractions:
            split = {m: (cell.get((m, N, f)) or {}).get("attn_rel_l1_by_entropy") for m in ("topk", "topk+phi", "prhs")}
            gain = ({b: split["topk"][b] - split["topk+phi"][b] for b in ENTROPY_BINS}
                    if split["topk"] and split["topk+phi"] else None)
            fmt = lambda d: "-" if not d else " / ".join(_fmt(d[b]) for b in ENTROPY_BINS)
            lines.append(f"| {length_label(N)} | {f:.0%} | {fmt(split['topk'])} | {fmt(split['topk+phi'])} | "
                         f"{fmt(split['prhs'])} | {fmt(gain)} |")
    return "\n".join(lines) + "\n"


def error_plot(rows: list[dict], path) -> None:
    """Error vs token-equivalent reads per method, one panel per length (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("task") == "attn_error" and r["variant"] != "dense" and r["attn_rel_l1"]]
    lengths = sorted({r["context_tokens"] for r in rows})
    if not lengths:
        return
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.6), squeeze=False)
    for ax, N in zip(axes[0], lengths):
        for method in dict.fromkeys(r["variant"] for r in rows):
            pts = sorted((r["read_tokens"], r["attn_rel_l1"]) for r in rows
                         if r["variant"] == method and r["context_tokens"] == N)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=method)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("token-equivalent reads per step and head")
        ax.set_ylabel("mean relative l1 vs dense")
        ax.set_title(f"{length_label(N)} context")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
