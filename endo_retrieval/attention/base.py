"""The one protocol every decode-time attention backend follows (the kvpress idea: one small class per paper).

A backend is installed on the model's own attention modules for the length of one generation. Each module then
hands it the *pre-RoPE* query, key and value states of the new tokens; the backend keeps its own cache and returns
the attention output. Where the rotation goes (at caching, as Hugging Face does, or after selection, as ReAttention
does) is the backend's choice, which is why the hand-over happens before RoPE.

Models whose layers attend through windows of different lengths (Gemma 3: a 512-token sliding window in five
layers of six, the whole past in the sixth): a backend whose paper holds there (`windows_hold`) attends each layer
that has a window exactly within it, as the model does (`attend_window`), and the others its own way (`attend`);
the others are refused at `setup` with the reason (`windows_fail`), as is whatever the model's family refuses by
name (`Family.refused`). Each layer rotates by its own rotary embedding (`rope(..., layer)`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar, Iterator

import torch
import torch.nn.functional as F

from endo_retrieval.model.backbone import Backbone, BackboneError


class AttentionError(BackboneError):
    """An attention backend was configured wrongly or cannot run on this model."""


class KVCache:
    """Per-layer key/value states of one sequence, (H_kv, N, d) each, grown by doubling (amortised appends)."""

    def __init__(self, n_layers: int):
        self._k: list[torch.Tensor | None] = [None] * n_layers
        self._v: list[torch.Tensor | None] = [None] * n_layers
        self._n = [0] * n_layers

    def __len__(self) -> int:
        return self._n[0]

    def length(self, layer: int) -> int:
        return self._n[layer]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the T new (H_kv, T, d) states; return views of all N cached so far."""
        n, t = self._n[layer], k.shape[1]
        buf_k, buf_v = self._k[layer], self._v[layer]
        if buf_k is None or n + t > buf_k.shape[1]:
            cap = max(2 * (n + t), 1024)
            new_k, new_v = k.new_empty(k.shape[0], cap, k.shape[2]), v.new_empty(v.shape[0], cap, v.shape[2])
            if n:
                new_k[:, :n], new_v[:, :n] = buf_k[:, :n], buf_v[:, :n]
            self._k[layer], self._v[layer] = buf_k, buf_v = new_k, new_v
        buf_k[:, n:n + t], buf_v[:, n:n + t] = k, v
        self._n[layer] = n + t
        return buf_k[:, :n + t], buf_v[:, :n + t]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, window: int | None = None
                     ) -> torch.Tensor:
    """Softmax attention of T queries (H, T, d) over N keys (H_kv, N, d) whose last T are the queries' own tokens:
    query i sees keys 0 .. N-T+i (causal, bottom-right aligned); with a `window`, only the last `window` of them
    (keys N-T+i-window+1 .. N-T+i), as a sliding-window layer does."""
    T, N = q.shape[1], k.shape[1]
    if window is not None and N - T + 1 > window:  # the window binds: older keys are never seen
        drop = N - T + 1 - window
        if T == 1:
            k, v, N = k[:, drop:], v[:, drop:], N - drop
        else:
            at = torch.arange(N, device=q.device)
            pos = torch.arange(N - T, N, device=q.device)[:, None]
            mask = (at[None, :] <= pos) & (pos - at[None, :] < window)
            return F.scaled_dot_product_attention(q[None], k[None].to(q.dtype), v[None].to(q.dtype), attn_mask=mask,
                                                  scale=scaling, enable_gqa=True)[0]
    k, v = k.to(q.dtype), v.to(q.dtype)
    if T > 1 and q.is_cuda:
        # A boolean mask with enable_gqa takes SDPA's math path on CUDA, which writes out every (T, N) score: a
        # 64k-token prefill in 512-token steps then takes minutes. The bottom-right causal bias runs the fused
        # kernels instead; they take as many key heads as query heads, hence the repeat.
        from torch.nn.attention.bias import causal_lower_right

        k, v = (x.repeat_interleave(q.shape[0] // x.shape[0], 0) for x in (k, v))
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=causal_lower_right(T, N),
                                              scale=scaling)[0]
    mask = None
    if T > 1:  # on a CPU every SDPA path costs the same here (a 512-token step over 4k keys: 37-39 ms)
        mask = torch.arange(N, device=q.device)[None, :] <= torch.arange(N - T, N, device=q.device)[:, None]
    # cuDNN's SDPA, which builds a plan per key length, is switched off by `Backbone` on CUDA
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scaling,
                                          enable_gqa=True)[0]


@dataclass
class AttentionBackend:
    """Base class: subclasses set `name` and implement `attend`; `setup` checks the model and resets the cache."""

    name: ClassVar[str] = "base"
    # whether the paper's assumptions hold where layers attend through windows of different lengths (its windowed
    # layers attended exactly within their windows); if not, why (the refusal's message)
    windows_hold: ClassVar[bool] = True
    windows_fail: ClassVar[str] = ""
    chunk_size: int = 512  # prefill is fed this many tokens at a time

    def setup(self, backbone: Backbone) -> None:
        spec = getattr(backbone, "spec", None)
        decoder = spec.decoder(backbone.model) if spec is not None else backbone.model.model
        if getattr(decoder, "rotary_emb", None) is None:
            raise AttentionError(f"{backbone.model_id} has no rotary position embedding; attention backends "
                                 "re-apply RoPE themselves and need a RoPE model.")
        if self.chunk_size < 1:
            raise AttentionError(f"chunk_size must be >= 1, got {self.chunk_size}")
        self.windows = tuple(getattr(backbone, "windows", None) or (None,) * backbone.n_layers)
        self.interleaved = len(set(self.windows)) > 1  # some layers have a window, others another or none
        why = spec.refused.get(self.name) if spec is not None else None
        if why is None and self.interleaved and not self.windows_hold:
            shown = sorted({w for w in self.windows if w is not None})
            why = (f"its layers attend through windows of different lengths ({shown} tokens in some layers, the "
                   f"whole past in others), and {self.windows_fail}")
        if why:
            raise AttentionError(f"the {self.name!r} attention backend cannot run on {backbone.model_id} "
                                 f"({getattr(backbone, 'family', 'this family')}): {why}. Generate with "
                                 "attention=None (the model's own attention) or get_backend('dense').")
        self.backbone = backbone
        self.cache = KVCache(backbone.n_layers)

    @property
    def scope(self) -> int | None:
        """The most cached keys one query reads after `setup` (None: all of them)."""
        return None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """q (H, T, d), k and v (H_kv, T, d): pre-RoPE states of the T new tokens at `layer` -> output (H, T, d)."""
        raise NotImplementedError

    def attend_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
                     ) -> torch.Tensor:
        """What the model's attention module hands over: where layers' windows differ, a layer with a window of its
        own goes to `attend_window` (`windows_hold`; the others are refused at setup), every other to `attend`. One
        window in every layer (Mistral v0.1) leaves every layer to `attend`, which `dense` keeps to that window."""
        if self.interleaved and self.windows[layer] is not None:
            return self.attend_window(layer, q, k, v, scaling)
        return self.attend(layer, q, k, v, scaling)

    def attend_window(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
                      ) -> torch.Tensor:
        """A layer that attends through a window of its own, exactly as the model does: keys rotated at their
        absolute positions when cached, each query over the last `window` of them."""
        start = self.cache.length(layer)
        stop = start + q.shape[1]
        keys, values = self.cache.append(layer, self.rope(k, start, stop, layer), v)
        return causal_attention(self.rope(q, start, stop, layer), keys, values, scaling, self.windows[layer])

    def rope(self, x: torch.Tensor, start: int, stop: int, layer: int | None = None) -> torch.Tensor:
        """x rotated at positions start..stop-1, as `layer` rotates (None: the full-attention layers' rotation)."""
        positions = torch.arange(start, stop, device=x.device)
        if layer is None or getattr(self.backbone, "spec", None) is None:
            return self.backbone.apply_rope(x, positions)
        return self.backbone.apply_rope(x, positions, layer)

    def generate_ids(self, backbone: Backbone, ids, max_new_tokens: int = 64) -> Iterator[int]:
        """Greedy token ids after the prompt `ids` (1-D) with this backend installed, stopping at end-of-sequence:
        chunked prefill (`chunk_size` tokens at a time), then one token per step. Hugging Face's `generate` keeps
        its own rotated cache, so backends need this loop of their own."""
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if len(ids) == 0:
            raise ValueError("the prompt is empty")
        eos, model = backbone.eos_ids(), backbone.model

        def logits_after(x: torch.Tensor) -> torch.Tensor:
            out = model(input_ids=x.view(1, -1).to(backbone.device), use_cache=False, logits_to_keep=1)
            return out.logits[0, -1]

        with backbone.lock, torch.inference_mode(), installed(backbone, self):
            for chunk in ids.split(self.chunk_size):  # [ReAttention Alg. 1]: chunked prefill
                logits = logits_after(chunk)
            for step in range(max_new_tokens):  # [ReAttention Alg. 2]: one token per step
                token = int(logits.argmax())
                if token in eos:
                    return
                yield token
                if step + 1 < max_new_tokens:
                    logits = logits_after(torch.tensor([token]))

    def generate(self, backbone: Backbone, ids, max_new_tokens: int = 64, stream: bool = False):
        """Decoded text of `generate_ids`, or with stream=True an iterator of text pieces as they form
        (what `Backbone.generate(..., attention=backend)` returns)."""
        tokens = self.generate_ids(backbone, ids, max_new_tokens)
        if not stream:
            return backbone.tokenizer.decode(list(tokens), skip_special_tokens=True).strip()
        return text_pieces(backbone.tokenizer, tokens)


def text_pieces(tokenizer, tokens: Iterator[int]) -> Iterator[str]:
    """The text of `tokens` piece by piece, each piece yielded once no multi-token character is left half-done."""
    seen, emitted = [], ""
    for token in tokens:
        seen.append(token)
        text = tokenizer.decode(seen, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            yield text[len(emitted):]
            emitted = text


def _attention_forward(module, backend: AttentionBackend, norms: tuple, hidden_states: torch.Tensor, *args,
                       **kwargs):
    """Replaces `self_attn.forward` while a backend is installed: projections (and the family's q/k norms, Qwen3's
    and Gemma 3's) as the model does them, then the backend instead of RoPE + cache + attention."""
    if hidden_states.shape[0] != 1:
        raise AttentionError("attention backends run one sequence at a time (batch size 1)")
    T, d = hidden_states.shape[1], module.head_dim
    q = module.q_proj(hidden_states).view(T, -1, d)
    k = module.k_proj(hidden_states).view(T, -1, d)
    v = module.v_proj(hidden_states).view(T, -1, d)
    q_norm, k_norm = norms
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    out = backend.attend_layer(module.layer_idx, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                               module.scaling)
    return module.o_proj(out.transpose(0, 1).reshape(1, T, -1)), None


@contextlib.contextmanager
def installed(backbone: Backbone, backend: AttentionBackend):
    """Route every layer's attention through `backend` (fresh cache) until the block ends."""
    backend.setup(backbone)
    modules = [backbone.layout.attention(l) for l in range(backbone.n_layers)]
    for m in modules:
        norms = backbone.spec.qk_norms(m)
        m.forward = lambda hidden_states, *a, _m=m, _n=norms, **kw: _attention_forward(_m, backend, _n, hidden_states,
                                                                                        *a, **kw)
    try:
        yield backend
    finally:
        for m in modules:
            del m.forward
