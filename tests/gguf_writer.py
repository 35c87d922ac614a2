"""Write a small Hugging Face model as a GGUF file with the `gguf` package, laid out as llama.cpp's converter lays
it out, so tests can hand the library the kind of file local-LLM tools keep on disk (float32 tensors, no
quantisation: the file holds the folder's weights exactly)."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
import transformers


def copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> None:
    """Every tokenizer.* field of the GGUF file `source` (the default model's: the tiny models share its tokenizer)."""
    for name, field in gguf.GGUFReader(source).fields.items():
        if name.startswith("tokenizer."):
            kind = field.types[0]
            sub = {"sub_type": field.types[-1]} if kind == gguf.GGUFValueType.ARRAY else {}
            writer.add_key_value(name, field.contents(), kind, **sub)


def write_gguf(folder: Path, path: Path, tokenizer_gguf: Path, architecture: str | None = None) -> Path:
    """The model in `folder` as the GGUF file `path`. Mistral is written as llama.cpp writes it (architecture
    llama); llama's q/k rows are permuted as llama.cpp permutes them (transformers undoes it on load)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cfg = model.config
    arch = architecture or ("llama" if cfg.model_type == "mistral" else cfg.model_type)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{cfg.model_type}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "llama":
        w.add_rope_dimension_count(cfg.head_dim)
    copy_tokenizer(w, tokenizer_gguf)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        base, _, suffix = hf_name.rpartition(".")
        a = tensor.numpy().astype(np.float32)
        if arch == "llama" and (".q_proj" in hf_name or ".k_proj" in hf_name):
            n = cfg.num_attention_heads if ".q_proj" in hf_name else cfg.num_key_value_heads
            a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_header_only(path: Path, architecture: str) -> Path:
    """A GGUF file that declares `architecture` and holds no tensors (enough for the family check)."""
    w = gguf.GGUFWriter(str(path), architecture)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
