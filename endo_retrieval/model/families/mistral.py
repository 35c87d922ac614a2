"""Mistral: the Llama layout; v0.1's sliding window (4096 tokens) is the same for every layer (`Family.windows`)."""
from endo_retrieval.model.families import Family

FAMILY = Family("mistral", model_types=("mistral",), gguf_architectures=("mistral",), config_class="MistralConfig")
