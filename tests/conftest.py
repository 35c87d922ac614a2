"""Shared fixtures: the real default backbone (loaded once), tiny random models of each family, data paths."""
from __future__ import annotations

from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def shared_data(*parts: str) -> Path:
    """A path under ../shared/data, or skip the test with the reason when that folder is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is absent: this test reads the project's shared data folder (../shared/data beside "
                    "the repository), which CI provides")
    return path


@pytest.fixture(scope="session")
def backbone():
    from endo_retrieval import Backbone

    return Backbone.default()


def make_tiny_model(family: str, folder: Path, layers: int = 4) -> Path:
    """A random-weight model of `family` with the default model's tokenizer (for shapes and plumbing only)."""
    import torch
    import transformers

    from endo_retrieval.backbone import Backbone

    configs = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    tok_source = Backbone.default().folder
    tok = transformers.AutoTokenizer.from_pretrained(tok_source)
    cfg = configs[family](vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", params=["llama", "mistral", "qwen2", "qwen3"])
def tiny_backbone(request, tmp_path_factory):
    from endo_retrieval import Backbone

    folder = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return Backbone(folder, device="cpu")
