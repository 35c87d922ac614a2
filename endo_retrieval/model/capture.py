"""A forward cut short and listened to: the decoder truncated to the deepest layer a read needs (early exit) and
the K/Q projections of the layers asked for hooked, handing out their pre-RoPE states (`Capture.run_to`); the
layers may run as int8-quantized or torch.compile'd twins."""
from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Sequence

import torch

from endo_retrieval.model.families import Family
from endo_retrieval.model.locate import BackboneError


class Projections(torch.nn.Module):
    """A decoder layer cut down to its input norm and the K and/or Q projections: the deepest layer of a forward
    that wants only those states (the hooks capture them), whose attention and MLP would feed layers that never
    run. The hidden states pass through unchanged."""

    def __init__(self, layer: torch.nn.Module, capture: Sequence[str], family: Family):
        super().__init__()
        self.layer, self.capture = layer, tuple(capture)
        self.norm, attention = family.input_norm(layer), family.attention(layer)
        self.projections = [attention.k_proj if kind == "k" else attention.q_proj for kind in self.capture]
        if hasattr(layer, "attention_type"):  # Qwen2/3 and Gemma 3 pick each layer's mask by it
            self.attention_type = layer.attention_type

    def forward(self, hidden_states, *args, **kwargs):
        x = self.norm(hidden_states)
        for projection in self.projections:
            projection(x)
        return hidden_states


class Capture:
    """`run_to` over one model (`spec`'s layout of it), keeping the int8 and compiled twins of its layers once
    made."""

    def __init__(self, spec: Family, model: torch.nn.Module, head_dim: int, dtype: torch.dtype):
        self.spec, self.model, self.head_dim, self.dtype = spec, model, head_dim, dtype
        self.int8_twins: list[torch.nn.Module] = []
        self.compiled_twins: dict[int, torch.nn.Module] = {}

    def int8_layers(self, last_layer: int) -> list[torch.nn.Module]:
        """Decoder layers 0..last_layer (at least) with dynamically int8-quantized linear maps (weights 4x smaller
        than fp32): a CPU forward of a short text reads every weight once per token batch, so it runs ~2x faster.
        Each layer is quantized once, and only as deep as a forward asks (questions stop at the deepest SAE layer)."""
        if self.dtype != torch.float32:
            raise BackboneError(f"int8 layers quantize fp32 linear maps; this backbone is {self.dtype} (already "
                                "faster on its CPU): leave int8 off, or load it with dtype=torch.float32.")
        done = self.int8_twins
        if len(done) <= last_layer:
            more = torch.nn.ModuleList(self.spec.layers(self.model)[len(done): last_layer + 1])
            with warnings.catch_warnings():  # torch.ao's dynamic quantization warns that it moves to torchao
                warnings.simplefilter("ignore")
                more = torch.ao.quantization.quantize_dynamic(copy.deepcopy(more), {torch.nn.Linear}, dtype=torch.qint8)
            self.int8_twins = done + list(more)
        return self.int8_twins

    def compiled_layers(self, last_layer: int, captured: Sequence[int]) -> list[torch.nn.Module]:
        """Decoder layers 0..last_layer, each through torch.compile except the `captured` ones (their K/Q hooks
        stay outside the compiled code): the compiled layers fuse the norms, RoPE and the MLP's gate into a few
        kernels, where eager runs a dozen elementwise passes per layer (a quarter of an 8B forward's time at 16k
        tokens a batch; docs/ilre.md). Compiled once per layer and process; they share the model's weights."""
        twins, full = self.compiled_twins, self.spec.layers(self.model)
        for l in range(last_layer + 1):
            if l not in twins and l not in captured:
                twins[l] = torch.compile(full[l])
        return [full[l] if l in captured else twins[l] for l in range(last_layer + 1)]

    @contextlib.contextmanager
    def run_to(self, last_layer: int, layers: Sequence[int], capture: Sequence[str], int8: bool = False,
               compiled: bool = False, projections_only: bool = False):
        """`Backbone.run_to` (its docstring is the contract)."""
        store: dict[str, dict[int, torch.Tensor]] = {"k": {}, "q": {}}
        full = self.spec.layers(self.model)
        run = self.int8_layers(last_layer) if int8 else \
            self.compiled_layers(last_layer, layers) if compiled else full
        hooks = [self._hook(run[l], l, kind, store) for l in layers for kind in capture]
        run = list(run)[: last_layer + 1]
        if projections_only:
            run[-1] = Projections(run[-1], capture, self.spec)
        self.spec.set_layers(self.model, torch.nn.ModuleList(run))
        try:
            yield store
        finally:
            self.spec.set_layers(self.model, full)
            for h in hooks:
                h.remove()

    def _hook(self, layer: torch.nn.Module, l: int, kind: str, store: dict):
        """A forward hook on `layer`'s K or Q projection that stores its pre-RoPE states under store[kind][l]."""
        attn = self.spec.attention(layer)
        q_norm, k_norm = self.spec.qk_norms(attn)
        proj, norm = (attn.k_proj, k_norm) if kind == "k" else (attn.q_proj, q_norm)

        def hook(_m, _i, out):
            x = out.unflatten(-1, (-1, self.head_dim))  # (B, T, heads, d)
            if norm is not None:  # Qwen3 and Gemma 3 normalise q/k per head before RoPE
                x = norm(x)
            store[kind][l] = x.transpose(1, 2).float()

        return proj.register_forward_hook(hook)
