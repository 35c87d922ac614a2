"""Model families: everything that differs between the decoder families the library reads, one module each.

A family module defines `FAMILY`, a `Family` (or a subclass that overrides what its models do differently), and is
named in MODULES below. The rest of the library asks the backbone's family, never a model's class: where the
decoder's layers, attention projections and input norm are (`decoder`, `layers`, `attention`, `input_norm`,
`qk_norms`), how far each layer attends (`windows`: None for the whole causal past), which rotary embedding a layer
rotates by (`rotary`, `rope_group`), how per-layer masks are handed to the model (`mask_argument`), which ids every
sequence must begin with (`prefix_ids`), which names its GGUF files and transformers configs carry
(`gguf_architectures`, `model_types`, `config_class`), what a GGUF conversion must repair (`repair`), and which
methods it refuses, and why (`refused`). The defaults are the Llama layout, which llama, mistral, qwen2 and qwen3
share. Importing this package imports neither torch nor transformers (the command line lists the families fast).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Mapping

MODULES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")  # a new family: its module here, and a test


@dataclass(frozen=True)
class Family:
    """One decoder family; the defaults are the Llama layout (Hugging Face's `LlamaForCausalLM` and kin)."""

    name: str  # what users see: `endo info`, errors, docs
    model_types: tuple[str, ...]  # transformers' config.model_type values of its models
    gguf_architectures: tuple[str, ...] = ()  # GGUF general.architecture values of its files
    config_class: str = ""  # transformers' config class, for tiny random models (`tiny_config`)
    # what this family cannot run, by name (an attention backend, "frames=cache"), and why: the refusal's message
    refused: Mapping[str, str] = field(default_factory=dict)

    # ---- where things are in the model
    def decoder(self, model):
        """The decoder stack under the LM head: has the layers, the embedding and the rotary embedding."""
        return model.model

    def layers(self, model):
        return self.decoder(model).layers

    def set_layers(self, model, layers) -> None:
        """Replace the decoder's layers (early exit runs a truncated list)."""
        self.decoder(model).layers = layers

    def attention(self, layer):
        """A decoder layer's attention module: q_proj, k_proj, v_proj, o_proj, head_dim, scaling, layer_idx."""
        return layer.self_attn

    def input_norm(self, layer):
        """The norm a decoder layer applies before its attention's projections."""
        return layer.input_layernorm

    def qk_norms(self, attention) -> tuple:
        """Norms applied per head to the projected queries and keys before RoPE (Qwen3, Gemma 3), or None."""
        return getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)

    # ---- how each layer attends
    def windows(self, config) -> tuple[int | None, ...]:
        """Per layer, how many of the latest positions a query attends to (itself included), or None: the whole
        causal past. From transformers' `layer_types` and `sliding_window` where the config has them."""
        n, window = config.num_hidden_layers, getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if types:
            return tuple(window if t == "sliding_attention" else None for t in types)
        return (window,) * n

    def rope_group(self, config, layer: int | None) -> str:
        """Layers of one group rotate alike (one rotary embedding); None: the full-attention layers' group."""
        return "rope"

    def rotary(self, model, layer: int | None) -> tuple[Callable, float]:
        """(rotary, attention scaling) of a layer: rotary(x, position_ids) -> (cos, sin), as the model computes
        them (cos, sin scaled by the rope type's attention scaling); layer None: the full-attention layers'."""
        emb = self.decoder(model).rotary_emb
        return emb, float(getattr(emb, "attention_scaling", 1.0))

    def mask_argument(self, config, mask_for: Callable[[int | None], object]):
        """The `attention_mask` to hand the decoder so that each layer gets `mask_for(its window)`: a mapping by
        layer type where the model picks masks by `layer_types`, else the one mask every layer shares."""
        windows = self.windows(config)
        types = getattr(config, "layer_types", None)
        if types and len(set(windows)) > 1:
            return {t: mask_for(w) for t, w in dict(zip(types, windows)).items()}
        return mask_for(windows[0])

    def prefix_ids(self, tokenizer) -> list[int]:
        """Ids every sequence the model reads must begin with (reads, chunks, query parts behind nothing)."""
        return []

    # ---- files
    def repair(self, folder: Path, gguf: Path) -> None:
        """After a GGUF file of this family was converted into `folder`: fix what the conversion got wrong."""

    def tiny_config(self, vocab_size: int, layers: int = 4, head_dim: int = 16, **overrides):
        """A small random-weight configuration (tests): 4 heads over 2 KV heads, 64 hidden units."""
        import transformers

        settings = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4096)
        return getattr(transformers, self.config_class)(**{**settings, **overrides})


@lru_cache(maxsize=None)
def registered() -> tuple[Family, ...]:
    """The families of MODULES, in that order."""
    return tuple(importlib.import_module(f"{__name__}.{m}").FAMILY for m in MODULES)


def names() -> tuple[str, ...]:
    return tuple(f.name for f in registered())


def by_model_type(model_type: str) -> Family | None:
    """The family whose models carry this transformers `config.model_type`, if one is registered."""
    return next((f for f in registered() if model_type in f.model_types), None)


def by_gguf_architecture(architecture: str) -> Family | None:
    """The family whose GGUF files declare this `general.architecture`, if one is registered."""
    return next((f for f in registered() if architecture in f.gguf_architectures), None)


def by_name(name: str) -> Family:
    found = next((f for f in registered() if f.name == name), None)
    if found is None:
        raise KeyError(f"no family {name!r}; registered: {', '.join(names())}")
    return found
