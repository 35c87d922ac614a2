"""The sink + window frame of ILRe's streaming prefill, kept in a cache instead of recomputed with every chunk.

ILRe section 3.4: in layers below l_R, "only cache the sink and sliding part of the key states and value states with
sizes S and W". `Backbone.stream` by default recomputes that frame in front of every chunk, which makes chunks
independent (they can be batched, which a small model needs) at 1.5x the tokens for 1024-token chunks. With the
frame cached, a chunk forwards only its own tokens and attends to the cached keys and values of the S + W tokens
before it; a large model, bound by arithmetic, gains the 1.5x. The keys are cached rotated; under "frame"
positions the kept window moves down to sit right after the sink, so its keys are rotated by that shift (RoPE
rotations compose), and every query-key distance stays what the recomputed frame gives.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

FRAME_ATTENTION = "endo_frame_chunk"
_CURRENT: list["FrameCache"] = []  # the cache the registered attention function reads (one forward at a time)


def frame_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Hugging Face's attention-interface contract: the chunk's queries over the cached frame and the chunk's own
    keys, causal aligned to the last key (the mask built by transformers is not used)."""
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
        self.fresh[layer] = key, value
        if layer in self.keys:
            key, value = torch.cat([self.keys[layer], key], 2), torch.cat([self.values[layer], value], 2)
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        causal = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device)
        causal = causal.tril(key.shape[2] - query.shape[2])  # query i sees the frame and chunk tokens up to i
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

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
        """After the chunk [start, end): keep the sink and the last `window` tokens, [ILRe section 3.4]."""
        index = torch.cat([self.stream_index, torch.arange(start, end)])
        keep = torch.nonzero((index < self.sink) | (index >= max(self.sink, end - self.window))).squeeze(1)
        shift = torch.arange(len(keep)) - keep  # "frame": every kept token moves down to its new place
        device = self.backbone.device
        keep_d, shift_d = keep.to(device), shift.to(device)
        for layer, (key, value) in self.fresh.items():
            if layer in self.keys:
                key, value = torch.cat([self.keys[layer], key], 2), torch.cat([self.values[layer], value], 2)
            key, value = key[:, :, keep_d], value[:, :, keep_d]
            if self.positions == "frame" and bool(shift.any()):
                key = self.rotate(key, shift_d)
            self.keys[layer], self.values[layer] = key, value
        self.stream_index, self.fresh = index[keep], {}

    def rotate(self, key: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """RoPE(p + shift) from RoPE(p): the rotation by `shift` alone (without a rope type's attention scaling)."""
        scaling = getattr(self.backbone.model.model.rotary_emb, "attention_scaling", 1.0)
        return (self.backbone.apply_rope(key.float(), shift) / scaling).to(key.dtype)
