"""How far chunked prefill moves the key states from a full pass (S3-Attention appendix I, Table 9)."""
from __future__ import annotations

import torch


def stream_keys(backbone, ids, layers, **stream_kwargs) -> dict[int, torch.Tensor]:
    """All pre-RoPE keys of a stream, concatenated: layer -> (n_kv_heads, L, head_dim)."""
    parts: dict[int, list[torch.Tensor]] = {l: [] for l in layers}
    for chunk in backbone.stream(ids, layers, **stream_kwargs):
        for l in layers:
            parts[l].append(chunk.keys[l])
    return {l: torch.cat(p, dim=1) for l, p in parts.items()}


def key_consistency(backbone, ids, layers, chunk_sizes=(512, 1024, 2048, 4096), modes=("independent",),
                    sink: int = 4, window: int = 512) -> list[dict]:
    """Rows {mode, chunk, layer, cosine, rel_l2} of chunked keys against one full causal pass over `ids`."""
    full = stream_keys(backbone, ids, layers, chunk_size=len(ids))
    rows = []
    for mode in modes:
        for size in chunk_sizes:
            got = stream_keys(backbone, ids, layers, chunk_size=size, mode=mode, sink=sink, window=window)
            for l in layers:
                ref, k = full[l], got[l]
                cos = torch.nn.functional.cosine_similarity(k, ref, dim=-1).mean().item()
                rel = ((k - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)).mean().item()
                rows.append({"mode": mode, "chunk": size, "layer": l, "cosine": cos, "rel_l2": rel})
    return rows
