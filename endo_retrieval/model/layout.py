"""The model's layers as its family lays them out (families/): where the decoder and its layers are, which layers
see how far back (sliding windows), the masks a read hands them, and the rotary embedding each layer rotates by."""
from __future__ import annotations

from typing import Sequence

import torch

from endo_retrieval.model.families import Family
from endo_retrieval.model.locate import BackboneError


class Layout:
    """`spec`'s view of `model`: `decoder` (the stack under the LM head, what the reads run), `layers` (all of
    them, as loaded), each layer's attention `windows` (None: the whole past)."""

    def __init__(self, spec: Family, model: torch.nn.Module, config, dtype: torch.dtype):
        self.spec, self.model, self.dtype = spec, model, dtype
        self.text_config = config.get_text_config()  # a multimodal model's language model
        self.decoder: torch.nn.Module = spec.decoder(model)
        self.layers: torch.nn.ModuleList = spec.layers(model)
        self.n_layers = self.text_config.num_hidden_layers
        self.windows: tuple[int | None, ...] = tuple(spec.windows(self.text_config))
        self.rope_groups = [spec.rope_group(self.text_config, l) for l in range(self.n_layers)]

    def attention(self, layer: int) -> torch.nn.Module:
        """Layer `layer`'s attention module (q_proj, k_proj, v_proj, o_proj, scaling)."""
        return self.spec.attention(self.layers[layer])

    def check_layers(self, layers: Sequence[int]) -> list[int]:
        """`layers` sorted and each once; BackboneError for none or one out of range."""
        layers = sorted({int(l) for l in layers})
        if not layers:
            raise BackboneError("Ask for at least one layer.")
        bad = [l for l in layers if not 0 <= l < self.n_layers]
        if bad:
            raise BackboneError(f"Layer index {bad[0]} is out of range: this model has layers 0..{self.n_layers - 1}.")
        return layers

    # ---- windows -----------------------------------------------------------------------------------------------
    def layers_seeing(self, n_tokens: int) -> list[int]:
        """The layers whose queries see all of a read of `n_tokens` (no window, or one at least that long)."""
        return [l for l, w in enumerate(self.windows) if w is None or w >= n_tokens]

    def window_binds(self, n_keys: int) -> bool:
        """Whether a query that could see `n_keys` keys sees fewer at some layer, its window being shorter."""
        return any(w is not None and w < n_keys for w in self.windows)

    def window_masks(self, query_positions: torch.Tensor, key_positions: torch.Tensor, visible: torch.Tensor):
        """The decoder's `attention_mask` when some layer's window binds: each layer's is `visible` (bool,
        (..., queries, keys)) and, in a windowed layer, keys fewer than its window positions behind the query
        (`query_positions` (..., queries), `key_positions` (..., keys): the tokens' places in the stream). Handed
        to the model as its family takes per-layer masks (`spec.mask_argument`)."""
        behind = query_positions[..., :, None] - key_positions[..., None, :]
        visible = visible.expand(torch.broadcast_shapes(visible.shape, behind.shape))

        def mask_for(window):
            return visible if window is None else visible & (behind < window)

        return self.spec.mask_argument(self.text_config, mask_for)

    # ---- rotary embeddings [ILRe Eq. 1, 3] -------------------------------------------------------------------
    def apply_rope(self, x: torch.Tensor, positions: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Rotate x (..., T, head_dim) by the model's own rotary embedding at `positions` (T,), the one layer
        `layer` rotates by (None: the full-attention layers'; they differ where the family gives sliding layers a
        rotary embedding of their own, as Gemma 3 does)."""
        pos = torch.as_tensor(positions, device=x.device).view(1, -1)
        rotary, _ = self.spec.rotary(self.model, layer)
        # the rotary module reads only its input's dtype and device: an empty tensor says both without a copy of x
        cos, sin = rotary(torch.empty(0, dtype=self.dtype, device=x.device), pos)
        cos, sin = cos[0].to(x.dtype), sin[0].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def apply_rope_layers(self, x: torch.Tensor, layers: Sequence[int], positions: torch.Tensor) -> torch.Tensor:
        """`apply_rope` of x (len(layers), ..., T, head_dim), row i rotated as layer layers[i] rotates: one call
        where all of them rotate alike, one per group of layers that do otherwise."""
        groups: dict[str, list[int]] = {}
        for i, l in enumerate(layers):
            groups.setdefault(self.rope_groups[l], []).append(i)
        if len(groups) == 1:
            return self.apply_rope(x, positions, layers[0])
        out = torch.empty_like(x)
        for rows in groups.values():
            index = torch.tensor(rows, device=x.device)
            out[index] = self.apply_rope(x[index], positions, layers[rows[0]])
        return out
