"""The batched reads' forwards (`model.reading._forward_parts`) replayed from CUDA graphs over bucketed shapes.

A question to the default pipeline runs two forwards: the candidates with the question and the content-free
question behind them, then the second hop's two parts behind the candidates' cache. Eager, each launches about
1,500 kernels from the host, and on a GPU the launches cost more than the arithmetic (docs/perf/launches.md).
Captured once per shape and replayed, a forward is one launch. Shapes differ per question, so a forward's rows are
padded up to a multiple of BUCKET and the cache it reads behind is copied into a buffer of a bucketed length; which
keys a row sees is computed inside the graph from one group label per key (`group_mask`: the context's causal
mask and the parts' rule, which the eager reads' `parts_mask` takes from it too), so nothing that differs between
questions is a host value. Padded rows see what comes before them and themselves; no real row sees a padded key.
A forward that reads the context too pads the context's rows and the parts' rows each to its own bucket, so the
context's rows attend through SDPA's causal kernel as an eager read's do (`context_then_parts_attention`): one
mask over every row takes the memory-efficient kernel, several times slower over a few thousand rows. The parts'
rows, replayed or eager, attend on a GPU through two matmuls (`parts_attention`), not that kernel.

The same padded forward run eagerly (a `PartsGraph` on a CPU runs it so) is the twin the tests hold against the
plain batched read, and the replay against it on the device. Every output of a replay is consumed (copied or
computed from) before the next replay, under the backbone's lock: the graphs share one memory pool.
"""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from contextlib import contextmanager
from typing import Sequence

import numpy as np
import torch

from endo_retrieval.model.chunk_graph import capture_graph

log = logging.getLogger(__name__)

PAD, CONTEXT, LEAD = -2, -1, 0  # key groups; part i's own rows are group i + 1
BUCKET = 256  # rows and cached keys are padded up to a multiple of this: a handful of shapes per workload
MAX_KEYS = 16384  # cached keys + rows above this run eagerly (such a forward is bound by arithmetic, not launches)
MIN_REPLAYS = 2  # a shape seen fewer times runs eagerly: a capture costs about three forwards
# captured shapes kept per backbone, least recently used dropped; each keeps its outputs' memory. A question's
# read (a shape per context bucket) and second hop (cache bucket x rows bucket) meet a dozen shapes or more over
# a corpus: fewer kept would drop and capture them again in turn
KEEP = 32
MEMORY_SHARE = 8  # ... and at most this share of the GPU's memory (1/8) in their buffers and outputs


def bucket(n: int) -> int:
    return -(-n // BUCKET) * BUCKET


def group_mask(groups: torch.Tensor, cached: int) -> torch.Tensor:
    """(1, 1, rows, cached + rows) bool: which keys each row attends to, for keys labelled `groups` (cached keys,
    then the rows' own). A row sees the keys up to itself that are context, the parts' shared lead, or its own
    group, never a padded one; and itself (a padded row so attends to at least one key)."""
    col = torch.arange(len(groups), device=groups.device)
    at = col[cached:, None]  # each row's own column
    own = groups[cached:, None]
    sees = (groups == CONTEXT) | (groups == LEAD) | (groups == own)
    return ((sees & (groups != PAD) & (col <= at)) | (col == at))[None, None]


PARTS_ATTENTION = "endo_context_then_parts"
# a masked attention bigger than this (query heads x rows x keys) goes to SDPA's kernel instead of materialising its
# logits (`parts_attention`): 1 GiB of float32
MATERIALISED_LOGITS = 2 ** 28


def parts_attention(query, key, value, mask, scaling: float) -> torch.Tensor:
    """softmax(q k^T * scaling over the keys `mask` allows) v for a few query rows over many keys, (B, rows, H, d) as
    SDPA's attention returns it. Two batched matmuls: SDPA's kernel for an arbitrary mask (memory-efficient)
    parallelises over query rows only, so a question's few dozen rows over thousands of cached keys kept most of a
    GPU idle (an H200 spent 8.9 ms a 1.5B question and 18.6 ms a `compress()` of 8k tokens in it). The query heads
    that share a key/value head are multiplied as one (no copy of the keys per head); the logits are taken in float32
    from the bf16 states, as the fused kernels accumulate them, and softmax-ed in float32."""
    B, H, R, d = query.shape
    kv, K = key.shape[1], key.shape[2]
    g = H // kv
    q = query.reshape(B * kv, g * R, d)
    k = key.reshape(B * kv, K, d).transpose(1, 2)
    if q.is_cuda and q.dtype != torch.float32:
        logits = torch.bmm(q, k, out_dtype=torch.float32)
    else:
        logits = torch.bmm(q.float(), k.float())
    logits = logits.view(B, kv, g, R, K).mul_(scaling)
    mask = mask[:, :, None]  # (B or 1, 1, 1, R, K): the same for every head
    logits = logits.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else logits.add_(mask)
    probs = logits.softmax(-1).to(value.dtype).view(B * kv, g * R, K)
    out = torch.bmm(probs, value.reshape(B * kv, K, d))
    return out.view(B, H, R, d).transpose(1, 2).contiguous()


def context_then_parts_attention(module, query, key, value, attention_mask, **kwargs):
    """Hugging Face's attention-interface contract, for a forward over a context and the query parts behind it.
    `attention_mask` (`group_mask` from the parts' first row) holds the parts' rows only; the rows in front of them
    are the context's, read without a cache in front, causally, through SDPA's causal kernel as a plain read is
    (one mask over every row takes a slower kernel: on a CPU, 1.8x the attention time of a 2,560-token read), or
    in a layer whose window is shorter than the context, causally within that window. The parts' rows attend
    through `parts_attention`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    context = query.shape[2] - attention_mask.shape[-2]
    rows = query[:, :, context:]
    # on a GPU only: a CPU's SDPA is 1.3-3x faster than these matmuls over the same rows (bf16 and float32, 64 to
    # 512 rows over 2,700 to 8,700 keys)
    if rows.is_cuda and rows.shape[0] * rows.shape[1] * rows.shape[2] * key.shape[2] <= MATERIALISED_LOGITS:
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        parts = parts_attention(rows, key, value, attention_mask, scaling)
    else:
        parts, _ = sdpa_attention_forward(module, rows, key, value, attention_mask, **kwargs)
    if not context:
        return parts, None
    window = _WINDOWS[-1][module.layer_idx] if _WINDOWS else None
    causal = None
    if window is not None and window < context:  # the context's rows, each within its layer's window
        i = torch.arange(context, device=query.device)
        causal = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    read, _ = sdpa_attention_forward(module, query[:, :, :context], key[:, :, :context], value[:, :, :context],
                                     causal, **kwargs)
    return torch.cat([read, parts], dim=1), None


_WINDOWS: list[tuple] = []  # the windows of the model `context_then_parts` runs (one forward at a time)


@contextmanager
def context_then_parts(backbone):
    """The model's forwards in here attend through `context_then_parts_attention`."""
    from transformers import AttentionInterface

    AttentionInterface.register(PARTS_ATTENTION, context_then_parts_attention)
    config = backbone.model.config
    before, config._attn_implementation = config._attn_implementation, PARTS_ATTENTION
    _WINDOWS.append(backbone.windows)
    try:
        yield
    finally:
        _WINDOWS.pop()
        config._attn_implementation = before


class GraphKV:
    """The KV cache a captured forward writes: per layer, the `prefix` buffers' keys and values (the cache read
    behind, as static inputs) followed by the forward's own. Only what Hugging Face's attention layers call."""

    def __init__(self, prefix: dict[int, tuple[torch.Tensor, torch.Tensor]], cached: int):
        self.prefix, self.cached, self.kv = prefix, cached, {}

    def get_seq_length(self, layer_idx: int = 0) -> int:  # where the forward's positions start, if not given
        return self.cached

    def update(self, keys, values, layer_idx, cache_kwargs=None):
        if layer_idx in self.prefix:
            before_k, before_v = self.prefix[layer_idx]
            keys, values = torch.cat([before_k, keys], dim=2), torch.cat([before_v, values], dim=2)
        self.kv[layer_idx] = keys, values
        return keys, values


class PartsGraph:
    """One forward of `rows` rows behind `cached` cached keys (both bucketed) up to max(layers): ids, positions and
    key groups in, the hooked pre-RoPE states and each cached layer's keys and values out. `context` (no cache
    behind): the first `context` rows are the context's, padded at its end, read causally; the parts' rows follow.
    On CUDA captured at construction and replayed per call; elsewhere run eagerly per call (the twin)."""

    def __init__(self, backbone, cached: int, rows: int, layers: Sequence[int], capture: Sequence[str], pool=None,
                 context: int = 0):
        if context and cached:
            raise ValueError("a forward reads its context or continues a cache, not both")
        self.backbone, self.cached, self.rows, self.context = backbone, cached, rows, context
        self.layers, self.capture = list(layers), tuple(capture)
        device, n_kv, d = backbone.device, backbone.n_kv_heads, backbone.head_dim
        # ids, positions and key groups in one buffer, so a call's inputs cross to the device in one copy from
        # pinned memory, without the host waiting for it (three copies from pageable memory waited three times)
        self.inputs = torch.zeros(3 * rows + cached, dtype=torch.long, device=device)
        self.ids, self.pos = self.inputs[:rows].view(1, rows), self.inputs[rows:2 * rows].view(1, rows)
        self.groups = self.inputs[2 * rows:]
        self.staged = torch.zeros(len(self.inputs), dtype=torch.long, pin_memory=device.type == "cuda")
        self.copied = None  # on CUDA, the event after the last copy out of `staged`
        # the last layer runs its projections only (`run_to`), so layers 0..max(layers) - 1 hold a cache
        self.prefix = {l: tuple(torch.zeros(1, n_kv, cached, d, dtype=backbone.dtype, device=device)
                                for _ in range(2)) for l in range(self.layers[-1])} if cached else {}
        self.graph = None
        if device.type == "cuda":
            self.graph, self.out = capture_graph(self._forward, device, warmups=2, pool=pool)

    @property
    def nbytes(self) -> int:
        """Memory this graph keeps for itself: its input buffers and (captured) its outputs."""
        kept = [self.inputs, *(t for pair in self.prefix.values() for t in pair)]
        if self.graph is not None:
            store, kv = self.out
            kept += [t for states in store.values() for t in states.values()] + [t for kv_ in kv.values() for t in kv_]
        return sum(t.numel() * t.element_size() for t in kept)

    def _forward(self):
        bb, kv = self.backbone, GraphKV(self.prefix, self.cached)
        # the parts' rows (all rows without a context in front) by their groups; the context's rows causally
        mask = group_mask(self.groups, self.cached + self.context)
        with torch.inference_mode(), context_then_parts(bb), \
                bb.run_to(self.layers[-1], self.layers, self.capture, projections_only=True) as store:
            bb.decoder(input_ids=self.ids, position_ids=self.pos, attention_mask=mask, past_key_values=kv,
                           use_cache=True)
        # a forward behind a cache keeps no cache of its own (the keys it made are temporaries the pool reuses)
        return {kind: dict(states) for kind, states in store.items()}, {} if self.cached else kv.kv

    def runs(self, T: int, context: int = 0) -> list[tuple[int, int]]:
        """(first row, rows) of the graph where a call's T rows lie, the first `context` of them the context's."""
        if not self.context:
            return [(0, T)]
        return [(0, context), (self.context, T - context)]

    def _laid_out(self, values: np.ndarray, fill: int, context: int) -> np.ndarray:
        """`values` of a call's rows at the graph's rows (`runs`), `fill` elsewhere."""
        out, taken = np.full(self.rows, fill, np.int64), 0
        for first, n in self.runs(len(values), context):
            out[first:first + n] = values[taken:taken + n]
            taken += n
        return out

    def __call__(self, ids: np.ndarray, pos: np.ndarray, groups: np.ndarray, cache=None, n_cached: int = 0,
                 context: int = 0):
        """(store, kv) of the rows `ids` at positions `pos`, labelled `groups`, behind the first `n_cached` tokens
        of `cache` (a Hugging Face cache; none for a forward of the context itself), the first `context` rows the
        context's. Views of the graph's outputs, the rows laid out as `runs` says: use them before the next call."""
        with torch.no_grad():
            labels = np.full(self.cached + self.rows, PAD, np.int64)
            labels[:n_cached] = CONTEXT
            labels[self.cached:] = self._laid_out(groups, PAD, context)
            if self.copied is not None:
                self.copied.synchronize()  # long done: the host waited on the last call's outputs
            self.staged.numpy()[:] = np.concatenate([self._laid_out(ids, 0, context), self._laid_out(pos, 0, context),
                                                     labels])
            self.inputs.copy_(self.staged, non_blocking=True)
            if self.inputs.is_cuda:
                self.copied = torch.cuda.Event()
                self.copied.record()
            if n_cached:  # the cache read behind, into the static buffers (what lies past it is never seen)
                dst = [b[:, :, :n_cached] for l in sorted(self.prefix) for b in self.prefix[l]]
                src = [t for l in sorted(self.prefix) for t in (cache.layers[l].keys, cache.layers[l].values)]
                torch._foreach_copy_(dst, src)
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        return self.out


class PartsGraphs:
    """A backbone's captured `PartsGraph`s, by bucketed shape: `get` gives the graph a forward should replay, or
    None where it should run eagerly (not CUDA, turned off, too long, or a shape not seen MIN_REPLAYS times)."""

    def __init__(self):
        self.enabled = True
        self.twin = False  # True: off CUDA too, the padded forwards run eagerly (the tests' twin of the replay)
        self.graphs: OrderedDict[tuple, PartsGraph] = OrderedDict()
        self.seen: Counter = Counter()
        self.pool = None
        self.max_bytes: int | None = None  # None: the GPU's memory / MEMORY_SHARE (no bound off CUDA)

    def get(self, backbone, cached: int, rows: int, layers: Sequence[int], capture: Sequence[str],
            context: int = 0) -> PartsGraph | None:
        """The graph for `rows` rows behind `cached` cached keys, the first `context` rows the context's."""
        if not self.enabled or not (backbone.device.type == "cuda" or self.twin):
            return None
        if backbone.layout.window_binds(cached + rows):  # the graphs' masks know no layer's window: run it eagerly
            return None
        # a read pads its context's rows and its parts' rows apart, each to BUCKET (finer buckets for the parts, tens
        # of rows, made more shapes to capture and cost more than the padded rows they saved)
        padded = bucket(context) + bucket(rows - context) if context else bucket(rows)
        key = (bucket(cached) if cached else 0, padded, tuple(layers), tuple(sorted(capture)),
               bucket(context) if context else 0)
        if key[0] + key[1] > MAX_KEYS:
            return None
        self.seen[key] += 1
        if key not in self.graphs:
            if self.seen[key] < MIN_REPLAYS:
                return None
            if self.pool is None and backbone.device.type == "cuda":
                self.pool = torch.cuda.graph_pool_handle()
                self.max_bytes = self.max_bytes or \
                    torch.cuda.get_device_properties(backbone.device).total_memory // MEMORY_SHARE
            try:
                self.graphs[key] = PartsGraph(backbone, *key[:4], pool=self.pool, context=key[4])
            except Exception as err:  # noqa: BLE001 - a speed-up that cannot be had must not fail the read
                self.enabled = False
                log.warning("CUDA graphs of the batched reads are off for this model (a capture failed: %s: %s); "
                            "the reads run eagerly, with the same results", type(err).__name__, err)
                return None
            # the least recently used go while more than KEEP are kept or they hold more than max_bytes
            while len(self.graphs) > 1 and (len(self.graphs) > KEEP or self.max_bytes is not None and
                                            sum(g.nbytes for g in self.graphs.values()) > self.max_bytes):
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        return self.graphs[key]
