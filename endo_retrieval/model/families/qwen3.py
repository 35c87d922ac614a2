"""Qwen3: the Llama layout with per-head RMS norms on the queries and keys before RoPE (`Family.qk_norms`)."""
from endo_retrieval.model.families import Family

FAMILY = Family("qwen3", model_types=("qwen3",), gguf_architectures=("qwen3",), config_class="Qwen3Config")
