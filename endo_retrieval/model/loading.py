"""Loading a located model (locate.py) onto its device: which family it is (families/), the device and number
format it runs in, whether it fits there (memory.py), and its weights, memory-mapped from the converted
safetensors, and tokenizer; or a model of a config's shape with random weights."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from endo_retrieval.model.families import Family
from endo_retrieval.model.locate import UnsupportedModelError, family_of_config, quiet_transformers
from endo_retrieval.model.memory import check_fits, safetensors_parameters
from endo_retrieval.model.threads import cpu_dtype


@dataclass(frozen=True)
class Placement:
    """Where and how a model runs: its family, device and number format."""

    spec: Family
    device: torch.device
    dtype: torch.dtype


def place(config, device: str | None = None, dtype=None) -> Placement:
    """The family of `config` (UnsupportedModelError where none is registered) and its device and dtype: None picks
    CUDA when available, else the CPU; bfloat16 on CUDA, on a CPU `threads.cpu_dtype`."""
    spec = family_of_config(config.model_type, getattr(config, "_name_or_path", None) or "this model")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else getattr(torch, cpu_dtype()))
    if device.type == "cuda":
        # cuDNN's SDPA builds a new plan for every key length, i.e. at every decode step and chunk, which made
        # ReAttention's decoding an order of magnitude slower (docs/papers.md); flash / mem-efficient SDPA remain.
        torch.backends.cuda.enable_cudnn_sdp(False)
    return Placement(spec, device, dtype)


def load_folder(folder: Path, model_id: str, device: str | None, dtype):
    """(config, placement, tokenizer, model in eval mode) of a Hugging Face folder, once it is known to fit. The
    safetensors weights are memory-mapped (transformers' loader), so a converted model loads at the speed of its
    page cache, with no conversion repeated."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    config = AutoConfig.from_pretrained(folder)
    placed = place(config, device, dtype)
    check_fits(model_id, safetensors_parameters(folder), placed.dtype, placed.device)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=placed.dtype).to(placed.device).eval()
    return config, placed, tokenizer, model


def build_random(config, tokenizer, device: str | None, dtype):
    """(placement, model) of `config`'s shape with random weights, built on the device; `tokenizer`'s ids must fit
    its vocabulary."""
    from transformers import AutoModelForCausalLM

    placed = place(config, device, dtype)
    vocab = config.get_text_config().vocab_size
    if len(tokenizer) > vocab:
        raise UnsupportedModelError(f"The tokenizer has {len(tokenizer)} ids; the config's vocabulary "
                                    f"holds {vocab}. Raise vocab_size.")
    with torch.device(placed.device):
        model = AutoModelForCausalLM.from_config(config, dtype=placed.dtype).eval()
    return placed, model


def tokenizer_of(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
