from llama_index.llms.endo.base import EndoLLM

__all__ = ["EndoLLM"]
