"""`Backbone.stream`'s chunk forward, captured once per chunk shape as a CUDA graph and replayed.

Eager, the default model's forward to layer 19 launches ~740 kernels per 2048-token chunk, and the host cannot
launch them as fast as a GPU runs them: replayed, a long stream runs several times faster (docs/papers.md), with
the same keys to the bit. Every chunk `stream` forwards is causal attention over the tokens it is given
(independent: the chunk; sink_window: sink + window + chunk), so the captured forward calls SDPA's causal kernel
directly: no mask is built, and nothing in the graph reads a host value. The eager forward is the twin the device
test holds the replay against.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

CAUSAL_ATTENTION = "endo_causal_chunk"
MIN_REPLAYS = 4  # a chunk length seen fewer times in one stream runs eagerly: a capture costs about 3 forwards
KEEP = 4  # captured shapes kept per backbone; each holds the memory of one chunk's activations


def causal_chunk_attention(module, query, key, value, attention_mask, **kwargs):
    """Hugging Face's attention-interface contract. The mask is dropped, so SDPA takes its causal kernel: the mask
    a stream chunk has is the causal one (given the explicit mask, SDPA takes a slower kernel)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


_STREAMS: dict[tuple[str, torch.device], torch.cuda.Stream] = {}


def side_stream(role: str, device: torch.device) -> torch.cuda.Stream:
    """One CUDA stream per role and device, made once and kept: cuBLAS keeps a workspace for every stream it has
    run on (32 MiB on Hopper), so a new stream per call would add up."""
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if (role, device) not in _STREAMS:
        _STREAMS[role, device] = torch.cuda.Stream(device)
    return _STREAMS[role, device]


def capture_graph(fn, device: torch.device, warmups: int = 1, pool=None):
    """(graph, fn's output) of `fn` captured after `warmups` eager runs, all on the one capture stream per device;
    `pool`: a memory pool shared with other graphs (`torch.cuda.graph_pool_handle`)."""
    stream = side_stream("capture", device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up outside the capture (cuBLAS and SDPA pick their kernels)
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = fn()
    return graph, out


class ChunkGraph:
    """One captured forward of a batch of chunks to max(layers): ids and positions of `shape` (batch, length) in,
    the hooked pre-RoPE states out, as `Backbone.run_to` stores them."""

    def __init__(self, backbone, shape: tuple[int, int], layers: Sequence[int], capture: Sequence[str]):
        from transformers import AttentionInterface

        AttentionInterface.register(CAUSAL_ATTENTION, causal_chunk_attention)
        device = backbone.device
        length = shape[1]
        self.ids = torch.zeros(shape, dtype=torch.long, device=device)
        self.pos = torch.arange(length, device=device).expand(shape).contiguous()
        # 4-D, so Hugging Face builds no mask of its own (its packed-sequence check reads a host value)
        mask = torch.ones(1, 1, length, length, dtype=torch.bool, device=device).tril()

        def forward() -> dict[str, dict[int, torch.Tensor]]:
            with torch.inference_mode(), backbone.run_to(layers[-1], layers, capture, projections_only=True) as store:
                backbone.decoder(input_ids=self.ids, position_ids=self.pos, attention_mask=mask, use_cache=False)
            return {kind: dict(states) for kind, states in store.items()}

        config = backbone.model.config
        before, config._attn_implementation = config._attn_implementation, CAUSAL_ATTENTION
        try:
            self.graph, self.out = capture_graph(forward, device, warmups=2)
        finally:
            config._attn_implementation = before

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor) -> dict[str, dict[int, torch.Tensor]]:
        self.ids.copy_(ids)
        self.pos.copy_(pos)
        self.graph.replay()
        # copies: the next replay rewrites the outputs, and a consumer may keep a chunk's states (ILRe does)
        return {kind: {l: t.clone() for l, t in states.items()} for kind, states in self.out.items()}


class ChunkGraphs:
    """A backbone's captured chunk forwards, by shape, layers and capture; the least recently used of more than KEEP
    is dropped. `enabled = False`: `stream` runs every chunk eagerly."""

    def __init__(self, backbone):
        self.backbone, self.enabled = backbone, True
        self.graphs: OrderedDict[tuple, ChunkGraph] = OrderedDict()

    @staticmethod
    def key(shape: tuple[int, int], layers: Sequence[int], capture: Sequence[str]) -> tuple:
        return shape, tuple(layers), tuple(sorted(capture))

    def has(self, shape: tuple[int, int], layers: Sequence[int], capture: Sequence[str]) -> bool:
        """Whether a forward of this shape was captured and is kept."""
        return self.key(shape, layers, capture) in self.graphs

    def get(self, shape: tuple[int, int], layers: Sequence[int], capture: Sequence[str]) -> ChunkGraph:
        """The CUDA graph of a forward of this shape, captured on first use (hold the backbone's `lock`)."""
        key = self.key(shape, layers, capture)
        if key not in self.graphs:
            if len(self.graphs) >= KEEP:
                self.graphs.popitem(last=False)
            self.graphs[key] = ChunkGraph(self.backbone, shape, list(layers), key[2])
        self.graphs.move_to_end(key)
        return self.graphs[key]
