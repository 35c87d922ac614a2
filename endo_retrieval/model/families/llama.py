"""Llama (and every GGUF file llama.cpp writes with the llama architecture, Mistral's among them): the default
layout of `Family`, one causal window for every layer."""
from endo_retrieval.model.families import Family

FAMILY = Family("llama", model_types=("llama",), gguf_architectures=("llama",), config_class="LlamaConfig")
