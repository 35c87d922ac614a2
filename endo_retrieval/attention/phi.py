"""Head-wise positive feature maps phi_q, phi_k for retrieval-completion attention (RCA section 3.2, appendix J).

z(q, k) = <phi_q(q), phi_k(k)> stands in for exp(s) = exp(scaling q.k) on RoPE-applied states. Each map is
linear + exp in log space, per query head (phi_q) and per KV head (phi_k):

    log phi(x) = W x - (scaling / 2) |x|^2 + b

Initialised at W = sqrt(scaling) * omega, omega ~ N(0, I), b = -log(d_phi) / 2, this is Performer's positive random
feature map, an unbiased estimate of exp(scaling q.k) before any training; `endo train-phi` then distils W and b
(appendix B). The maps are saved as safetensors plus a JSON card (model_hash, head_dim, layers, heads, d_phi,
length) and refused for another model, head size or head count. The default model's maps ship in
endo_retrieval/assets/phi/<model slug>/ (like the SAEs), where `endo train-phi` writes another model's;
`phi="default"` loads the backbone's model's.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from endo_retrieval.attention.base import AttentionError
from endo_retrieval.files import atomic_write
from endo_retrieval.model.backbone import DEFAULT_MODEL
from endo_retrieval.model.profiles import ASSETS, model_slug

CARD, WEIGHTS = "card.json", "phi.safetensors"


def shipped_dir(model_id: str | None = None) -> Path:
    """Where a model's phi maps ship: endo_retrieval/assets/phi/<slug>/ (default: the default model's)."""
    return ASSETS / "phi" / model_slug(model_id or DEFAULT_MODEL)


class PhiMaps(torch.nn.Module):
    """phi_q and phi_k for `layers`: W_q (L, H, d_phi, d), b_q (L, H, d_phi), W_k (L, H_kv, d_phi, d), b_k."""

    def __init__(self, card: dict, seed: int = 0):
        super().__init__()
        self.card = dict(card)
        self.layers: list[int] = [int(l) for l in card["layers"]]
        self.scaling = float(card["scaling"])
        L, H, Hkv, d, f = len(self.layers), card["n_heads"], card["n_kv_heads"], card["head_dim"], card["d_phi"]
        g = torch.Generator().manual_seed(seed)
        self.w_q = torch.nn.Parameter(torch.randn(L, H, f, d, generator=g) * math.sqrt(self.scaling))
        self.w_k = torch.nn.Parameter(torch.randn(L, Hkv, f, d, generator=g) * math.sqrt(self.scaling))
        self.b_q = torch.nn.Parameter(torch.full((L, H, f), -0.5 * math.log(f)))
        self.b_k = torch.nn.Parameter(torch.full((L, Hkv, f), -0.5 * math.log(f)))

    @classmethod
    def for_backbone(cls, backbone, layers, d_phi: int = 64, length: int | None = None, seed: int = 0) -> "PhiMaps":
        """Untrained (random-feature) maps shaped for `backbone`."""
        attn = backbone.layout.attention(0)
        card = {"model": backbone.model_id, "model_hash": backbone.model_hash, "head_dim": backbone.head_dim,
                "n_heads": backbone.n_heads, "n_kv_heads": backbone.n_kv_heads, "layers": sorted(set(layers)),
                "d_phi": d_phi, "scaling": float(attn.scaling), "length": length}
        return cls(card, seed)

    def index(self, layer: int) -> int | None:
        return self.layers.index(layer) if layer in self.layers else None

    def log_phi_q(self, i: int, q: torch.Tensor) -> torch.Tensor:
        """log phi_q of map slot i: q (H, ..., d) -> (H, ..., d_phi)."""
        return _log_features(q, self.w_q[i], self.b_q[i], self.scaling)

    def log_phi_k(self, i: int, k: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        """log phi_k of map slot i: k (H_kv, ..., d) -> (H_kv, ..., d_phi); `heads` picks the KV head of each row."""
        w, b = (self.w_k[i], self.b_k[i]) if heads is None else (self.w_k[i][heads], self.b_k[i][heads])
        return _log_features(k, w, b, self.scaling)

    def check(self, backbone) -> None:
        """AttentionError unless these maps were trained for `backbone`; then put them on its device."""
        want = {"model_hash": backbone.model_hash, "head_dim": backbone.head_dim, "n_heads": backbone.n_heads,
                "n_kv_heads": backbone.n_kv_heads}
        wrong = {k: (self.card.get(k), v) for k, v in want.items() if self.card.get(k) != v}
        if wrong:
            detail = ", ".join(f"{k} {a!r} (model has {b!r})" for k, (a, b) in wrong.items())
            raise AttentionError(f"these phi maps were trained for another model: {detail}; train maps for this "
                                 "model with `endo train-phi`")
        if max(self.layers) >= backbone.n_layers:
            raise AttentionError(f"phi maps cover layers {self.layers} but the model has {backbone.n_layers}")
        self.to(backbone.device)  # loaded maps sit on the CPU; the summary and the queries live with the model

    def save(self, folder: str | Path, **extra) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        atomic_write(folder / WEIGHTS, lambda p: save_file(tensors, str(p)))
        card = {**self.card, **extra}
        atomic_write(folder / CARD, lambda p: Path(p).write_text(json.dumps(card, indent=1)))

    @classmethod
    def load(cls, folder: str | Path, model_id: str | None = None) -> "PhiMaps":
        """Maps from a folder of `endo train-phi`, or "default": the maps shipped for `model_id` (where `endo
        train-phi` writes them; None: the default model), which `check` then holds to the model's hash."""
        if str(folder) == "default":
            folder = shipped_dir(model_id)
            if not (folder / CARD).exists():
                model = f" --model {model_id}" if model_id else ""
                raise AttentionError(f"no phi maps ship in {folder}; distil them with `endo train-phi{model} --length "
                                     f"8192` (a GPU: about 3 to 5 minutes) or pass phi=<folder of your own maps>")
        folder = Path(folder)
        if not (folder / CARD).exists() or not (folder / WEIGHTS).exists():
            raise AttentionError(f"{folder} holds no phi maps ({CARD} + {WEIGHTS}); train them with `endo train-phi`")
        try:
            maps = cls(json.loads((folder / CARD).read_text()))
            maps.load_state_dict(load_file(str(folder / WEIGHTS)))
        except (KeyError, ValueError, RuntimeError) as e:
            raise AttentionError(f"the phi maps in {folder} are corrupt or incomplete ({e}); retrain them") from e
        return maps


def _log_features(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W x - (scaling/2)|x|^2 + b per head: x (H, ..., d), w (H, f, d), b (H, f)."""
    x = x.float()
    lin = torch.einsum("h...d,hfd->h...f", x, w)
    bias = b.view(b.shape[0], *([1] * (x.dim() - 2)), b.shape[1])
    return lin - 0.5 * scaling * (x * x).sum(-1, keepdim=True) + bias
