"""The sink + window frame of ILRe's streaming prefill, kept in a cache instead of recomputed with every chunk.

ILRe section 3.4: in layers below l_R, "only cache the sink and sliding part of the key states and value states with
sizes S and W". `Backbone.stream` by default recomputes that frame in front of every chunk, which makes chunks
independent (they can be batched, which a small model needs) at 1.5x the tokens for 1024-token chunks. With the
frame cached, a chunk forwards only its own tokens and attends to the cached keys and values of the S + W tokens
before it; a large model, bound by arithmetic, gains the 1.5x. The keys are cached rotated; under "frame"
positions the kept window moves down to sit right after the sink, so its keys are rotated by that shift (RoPE
rotations compose), and every query-key distance stays what the recomputed frame gives.

Consecutive chunks still go through the model together: a chunk needs, at each layer, only the keys and values
its predecessor produced at that same layer, so a forward of B chunks (a batch row each) builds row j's frame
from row j-1's last W keys inside each layer's attention: the states one chunk per forward gives, in B times
fewer and larger launches.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

FRAME_ATTENTION = "endo_frame_chunk"
_CURRENT: list["FrameCache"] = []  # the cache the registered attention function reads (one forward at a time)


@torch.compiler.disable  # compiled layers (`Backbone.stream(compiled=True)`) call it as it is, between their parts
def frame_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Hugging Face's attention-interface contract: each chunk's queries over its frame and its own keys, causal
    aligned to the last key (the mask built by transformers is not used)."""
    return _CURRENT[-1].attend(module.layer_idx, query, key, value, scaling)


class FrameCache:
    """Per layer, the rotated keys and the values of the sink (the first S stream tokens) and the window (the last
    W tokens before the next chunk); `length` tokens, the same at every layer."""

    def __init__(self, backbone, sink: int, window: int, positions: str):
        self.backbone, self.sink, self.window, self.positions = backbone, sink, window, positions
        self.keys: dict[int, torch.Tensor] = {}  # layer -> (1, n_kv, length, d)
        self.values: dict[int, torch.Tensor] = {}
        self.stream_index = torch.zeros(0, dtype=torch.long)  # the stream positions of the cached tokens
        self.fresh: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def length(self) -> int:
        return len(self.stream_index)

    def attend(self, layer: int, query, key, value, scaling):
        """query (B, heads, T, d), key and value (B, kv_heads, T, d): B consecutive chunks of T tokens each."""
        self.fresh[layer] = key[-1:], value[-1:]  # the last chunk's, for `advance`
        if layer in self.keys:
            frame_k, frame_v = self.frames(layer, key, value)
            key, value = torch.cat([frame_k, key], 2), torch.cat([frame_v, value], 2)
        # query i sees the frame and the chunk's tokens up to i; grouped-query heads share their keys unrepeated
        causal = causal_lower_right(query.shape[2], key.shape[2])
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    def frames(self, layer: int, key, value) -> tuple[torch.Tensor, torch.Tensor]:
        """Each batch row's frame at this layer: the cache for the first chunk; for chunk j > 0 the sink and the last
        W keys and values of chunk j - 1, which is what `advance` would have cached after it (`Backbone.stream`
        batches only chunks whose frame is a full sink + window, at least W tokens long)."""
        cached_k, cached_v = self.keys[layer], self.values[layer]
        rows, length = key.shape[0], key.shape[2]
        if rows == 1:
            return cached_k, cached_v
        tail_k, tail_v = key[:-1, :, length - self.window:], value[:-1, :, length - self.window:]
        if self.positions == "frame" and self.window:  # chunk j-1's token at S + W + t moves to S + t - (T - W)
            tail_k = self.rotate(tail_k, torch.full((self.window,), -length, device=key.device), layer)
        sink_k = cached_k[:, :, :self.sink].expand(rows - 1, -1, -1, -1)
        sink_v = cached_v[:, :, :self.sink].expand(rows - 1, -1, -1, -1)
        return (torch.cat([cached_k, torch.cat([sink_k, tail_k], 2)]),
                torch.cat([cached_v, torch.cat([sink_v, tail_v], 2)]))

    @contextlib.contextmanager
    def attending(self):
        """Route the model's attention through this cache for one forward."""
        from transformers import AttentionInterface

        AttentionInterface.register(FRAME_ATTENTION, frame_attention)
        config = self.backbone.model.config
        before, config._attn_implementation = config._attn_implementation, FRAME_ATTENTION
        _CURRENT.append(self)
        try:
            yield
        finally:
            _CURRENT.pop()
            config._attn_implementation = before

    def advance(self, start: int, end: int) -> None:
        """After the chunk [start, end) (the last of a batch): keep the sink and the last `window` tokens,
        [ILRe section 3.4]. The cached stream positions ascend, so the kept tokens are a head (the sink) and a tail
        (the window): slices, with nothing sent to the device."""
        index = torch.cat([self.stream_index, torch.arange(start, end)])
        head = int((index < self.sink).sum())
        tail = max(head, int(torch.searchsorted(index, max(self.sink, end - self.window))))
        for layer, (key, value) in self.fresh.items():
            if layer in self.keys:
                key, value = torch.cat([self.keys[layer], key], 2), torch.cat([self.values[layer], value], 2)
            window_k = key[:, :, tail:]
            if self.positions == "frame" and tail > head:  # "frame": the window moves down to sit after the sink
                window_k = self.rotate(window_k, torch.full((len(index) - tail,), head - tail, device=key.device),
                                       layer)
            self.keys[layer] = torch.cat([key[:, :, :head], window_k], 2)
            self.values[layer] = torch.cat([value[:, :, :head], value[:, :, tail:]], 2)
        self.stream_index, self.fresh = torch.cat([index[:head], index[tail:]]), {}

    def rotate(self, key: torch.Tensor, shift: torch.Tensor, layer: int) -> torch.Tensor:
        """RoPE(p + shift) from RoPE(p): the rotation by `shift` alone (without a rope type's attention scaling), as
        `layer` rotates."""
        _, scaling = self.backbone.spec.rotary(self.backbone.model, layer)
        return (self.backbone.apply_rope(key.float(), shift, layer) / scaling).to(key.dtype)
