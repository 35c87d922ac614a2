"""Qwen2 / Qwen2.5: the Llama layout with biased q/k/v projections; where `use_sliding_window` is set, the layers
from `max_window_layers` on attend through a window (`Family.windows` reads `layer_types`)."""
from endo_retrieval.model.families import Family

FAMILY = Family("qwen2", model_types=("qwen2",), gguf_architectures=("qwen2",), config_class="Qwen2Config")
