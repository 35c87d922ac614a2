"""`dense`: ordinary causal attention over the whole cache, keys rotated at their absolute positions when cached
(what Hugging Face does). The reference every other backend is held against. A layer with a window of its own
attends within it, as the model does."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from endo_retrieval.attention.base import AttentionBackend, causal_attention


@dataclass
class Dense(AttentionBackend):
    name = "dense"

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        start = self.cache.length(layer)
        stop = start + q.shape[1]
        keys, values = self.cache.append(layer, self.rope(k, start, stop, layer), v)
        return causal_attention(self.rope(q, start, stop, layer), keys, values, scaling, self.windows[layer])
