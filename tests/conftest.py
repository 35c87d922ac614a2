"""Shared fixtures: the real default backbone (loaded once), tiny random models of each family, data paths."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# the twins and tolerances here are fp32's: a CPU with bf16 units would otherwise load every backbone in bf16
# (threads.cpu_dtype); tests of that default clear this
os.environ.setdefault("ENDO_CPU_DTYPE", "float32")

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


class ShapeBackbone:
    """Enough of a backbone for attention backends on random states: shapes, RoPE at positions, a rotary module."""

    def __init__(self, layers=2, heads=4, kv_heads=2, head_dim=8, device="cpu"):
        import torch

        self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim = layers, heads, kv_heads, head_dim
        self.device, self.model_hash, self.model_id = torch.device(device), "shape", "shape"
        self.model = type("M", (), {"model": type("I", (), {"rotary_emb": True})()})()

    def apply_rope(self, x, positions):
        import torch

        pos = torch.as_tensor(positions, dtype=torch.float32, device=x.device)[:, None]
        freq = 1.0 / 100 ** (torch.arange(0, self.head_dim // 2, device=x.device) / (self.head_dim // 2))
        cos, sin = (pos * freq).cos().repeat(1, 2), (pos * freq).sin().repeat(1, 2)
        half = self.head_dim // 2
        return (x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin).to(x.dtype)


def make_tiny_model(family: str, folder: Path, layers: int = 4, head_dim: int = 16) -> Path:
    """A random-weight model of `family` with the default model's tokenizer (for shapes and plumbing only)."""
    import torch
    import transformers

    from endo_retrieval.model.backbone import Backbone

    configs = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    tok_source = Backbone.default().folder
    tok = transformers.AutoTokenizer.from_pretrained(tok_source)
    cfg = configs[family](vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                          max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def plain_states(bb, ids, layer: int, rotated: bool = True):
    """Keys and queries (heads, T, d) at `layer` from one forward of the whole model over `ids`: q/k-normed where
    the family norms them (Gemma 3, Qwen3), and rotated as the layer rotates (unless rotated=False). The plain
    reference the backbone's own states are held to."""
    import numpy as np
    import torch

    states = {}
    attention = bb.layout.attention(layer)
    hooks = [proj.register_forward_hook(lambda _m, _i, out, kind=kind: states.__setitem__(kind, out))
             for kind, proj in (("k", attention.k_proj), ("q", attention.q_proj))]
    try:
        with torch.inference_mode():
            bb.model(input_ids=torch.as_tensor(np.asarray(ids))[None])
    finally:
        for h in hooks:
            h.remove()

    def heads(x, norm):
        x = x.unflatten(-1, (-1, bb.head_dim))[0]
        return (norm(x) if norm is not None else x).transpose(0, 1).float()

    k = heads(states["k"], getattr(attention, "k_norm", None))
    q = heads(states["q"], getattr(attention, "q_norm", None))
    if not rotated:
        return k, q
    positions = torch.arange(len(ids))
    return bb.apply_rope(k, positions, layer), bb.apply_rope(q, positions, layer)


@pytest.fixture(scope="session", params=["llama", "mistral", "qwen2", "qwen3"])
def tiny_backbone(request, tmp_path_factory):
    from endo_retrieval import Backbone

    folder = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return Backbone(folder, device="cpu")
