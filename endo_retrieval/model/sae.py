"""Top-k sparse autoencoders on key projections (S3-Attention section 3.3, appendix A.3; Gao et al. 2024).

One SAE per target layer is trained on the layer's pre-RoPE key states, shared by its KV heads, and reused to
encode the layer's query states (the shared K/Q codebook of A.3). Per token, the heads' features are merged to k
by `aggregate_heads`. Weights ship under `endo_retrieval/assets/sae/<model-slug>/` with a JSON card.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from endo_retrieval.files import atomic_write
from endo_retrieval.kernels.sae_topk import sae_topk
from endo_retrieval.model.profiles import missing, sae_dir

WEIGHTS_FILE = "sae.safetensors"
CARD_FILE = "card.json"
ASSETS = Path(__file__).parents[1] / "assets" / "sae"
AGGREGATION = "max"  # per token: union of the heads' top-k, a feature keeps its largest activation, top k kept


class SAEError(ValueError):
    """A problem with SAE input or files; the message says what to do."""


class SAEModelMismatch(SAEError):
    """SAE weights trained for another model."""


def _check_input(x: torch.Tensor, d_in: int, check_finite: bool = True) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if x.ndim == 0 or x.shape[-1] != d_in:
        got = tuple(x.shape)
        raise SAEError(f"SAE input must have last dimension {d_in} (the head_dim it was trained on), got shape {got}.")
    if not x.is_floating_point():
        x = x.float()
    if check_finite and not torch.isfinite(x).all():  # on an accelerator this waits for the device
        bad = int((~torch.isfinite(x)).any(-1).sum())
        raise SAEError(f"SAE input has {bad} vector(s) with NaN or inf; drop or fix them before encoding.")
    return x


class TopKSAE(nn.Module):
    """z = ReLU(W_enc (x - b_dec) + b_enc)  [S3 Eq. 2];  z_hat = TopK(z, k)  [S3 Eq. 3];  x_hat = z_hat W_dec + b_dec.

    W_enc and W_dec are both (d_latent, d_in): row i is latent i's encoder direction / unit-norm decoder atom.
    """

    def __init__(self, d_in: int, d_latent: int, k: int):
        super().__init__()
        if not 0 < k <= d_latent:
            raise SAEError(f"k must be in 1..d_latent={d_latent}, got {k}.")
        self.d_in, self.d_latent, self.k = int(d_in), int(d_latent), int(k)
        self.W_enc = nn.Parameter(torch.empty(d_latent, d_in))
        self.b_enc = nn.Parameter(torch.zeros(d_latent))
        self.W_dec = nn.Parameter(torch.randn(d_latent, d_in))
        self.b_dec = nn.Parameter(torch.zeros(d_in))
        self.card: dict = {}
        with torch.no_grad():
            self.normalize_decoder()
            self.W_enc.copy_(self.W_dec)  # encoder initialised as the decoder's transpose (Gao et al. 2024)

    # ---- [S3 Eq. 2-3] --------------------------------------------------------------------------------------------
    def pre_acts(self, x: torch.Tensor) -> torch.Tensor:
        """Dense ReLU activations z [S3 Eq. 2], (N, d_latent): training and tests only."""
        return torch.relu((x - self.b_dec) @ self.W_enc.T + self.b_enc)

    @torch.no_grad()
    def encode(self, x: torch.Tensor, use_kernel: bool = True, check_finite: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (..., d_in) -> (ids int64 (..., k), acts float32 (..., k)), largest activation first.

        Fewer than k positive activations leave zero-activation entries whose ids carry no meaning: consumers
        that index features keep only acts > 0. On CUDA the fused Triton kernel runs when available.
        """
        x = _check_input(x, self.d_in, check_finite)
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.d_in).to(self.W_enc.device, self.W_enc.dtype)
        ids, acts = sae_topk(flat, self.W_enc, self.b_enc, self.b_dec, self.k, use_kernel=use_kernel)
        return ids.reshape(*lead, self.k), acts.float().reshape(*lead, self.k)

    @torch.no_grad()
    def encode_heads(self, x: torch.Tensor, use_kernel: bool = True, check_finite: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The heads of T tokens (heads, T, d_in) -> (ids (T, k), acts (T, k)): `aggregate_heads(..., "max")` of
        the heads' `encode` in one pass, as the top-k of each latent's largest activation over the heads (the same
        set: endo_retrieval/kernels/sae_topk.py). One fused kernel call instead of ~15 launches per layer and chunk,
        which the host could not issue as fast as an accelerator runs them."""
        x = _check_input(x, self.d_in, check_finite).to(self.W_enc.device, self.W_enc.dtype)
        ids, acts = sae_topk(x, self.W_enc, self.b_enc, self.b_dec, self.k, use_kernel=use_kernel)
        return ids, acts.float()

    def decode(self, ids: torch.Tensor, acts: torch.Tensor) -> torch.Tensor:
        """(ids, acts) (..., k) -> x_hat (..., d_in) = sum_i acts_i W_dec[ids_i] + b_dec."""
        return torch.einsum("...k,...kd->...d", acts.to(self.W_dec.dtype), self.W_dec[ids]) + self.b_dec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Differentiable reconstruction through the Top-k code (training)."""
        acts, ids = self.pre_acts(x).topk(self.k, dim=-1)
        return self.decode(ids, acts)

    @torch.no_grad()
    def fvu(self, x: torch.Tensor, batch: int = 65536) -> float:
        """Fraction of variance unexplained: sum ||x - x_hat||^2 / sum ||x - mean(x)||^2."""
        x = _check_input(x, self.d_in).reshape(-1, self.d_in).float()
        err = 0.0
        for part in x.split(batch):
            ids, acts = self.encode(part)
            err += float(((part.to(acts.device) - self.decode(ids, acts)) ** 2).sum())
        return err / float(((x - x.mean(0)) ** 2).sum())

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        self.W_dec.div_(self.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-8))

    @torch.no_grad()
    def project_decoder_grad(self) -> None:
        """Drop the gradient component parallel to each decoder row, so unit-norm rows only rotate (Gao et al.)."""
        if self.W_dec.grad is not None:
            g, w = self.W_dec.grad, self.W_dec
            g.sub_((g * w).sum(1, keepdim=True) * w)

    # ---- files ----------------------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike, dtype: torch.dtype = torch.float16, **card) -> Path:
        """Write sae.safetensors (+ card.json: d_in, d_latent, k and whatever `card` adds), each atomically."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {n: p.detach().to("cpu", dtype).contiguous() for n, p in self.named_parameters()}
        self.card = {**self.card, **card, "d_in": self.d_in, "d_latent": self.d_latent, "k": self.k}
        atomic_write(directory / WEIGHTS_FILE, lambda p: save_file(tensors, str(p), metadata={"k": str(self.k)}))
        # safetensors has no checksum: the card's lets a load refuse a flipped bit in the weights
        self.card["weights_sha256"] = hashlib.sha256((directory / WEIGHTS_FILE).read_bytes()).hexdigest()
        return _write_card(directory, self.card)

    @classmethod
    def load(cls, directory: str | os.PathLike, expect_model_hash: str | None = None,
             device: str | torch.device = "cpu") -> "TopKSAE":
        directory, card = _open_card(directory, expect_model_hash)
        tensors = _read_weights(directory / WEIGHTS_FILE, card.get("weights_sha256"))
        shapes = {"W_enc": (card["d_latent"], card["d_in"]), "W_dec": (card["d_latent"], card["d_in"]),
                  "b_enc": (card["d_latent"],), "b_dec": (card["d_in"],)}
        for name, shape in shapes.items():
            if name not in tensors or tuple(tensors[name].shape) != shape:
                raise SAEError(f"{directory / WEIGHTS_FILE}: tensor {name} is missing or not of shape {shape}; "
                               "the file does not match its card.json. Re-train or re-download the SAE.")
        sae = cls(card["d_in"], card["d_latent"], card["k"])
        sae.load_state_dict({n: t.float() for n, t in tensors.items()})
        sae.card = card
        return sae.to(device).eval()


def _write_card(directory: Path, card: dict) -> Path:
    atomic_write(directory / CARD_FILE, lambda p: p.write_text(json.dumps(card, indent=1)))
    return directory


def _open_card(directory: str | os.PathLike, expect_model_hash: str | None) -> tuple[Path, dict]:
    """The folder and its card, checked (and checked to belong to the expected model)."""
    directory = Path(directory)
    card = _read_card(directory / CARD_FILE)
    _check_model(card, expect_model_hash, directory)
    return directory, card


def _read_card(path: Path) -> dict:
    if not path.exists():
        raise SAEError(f"No SAE card at {path}; point to a folder written by TopKSAE.save or `endo train-sae`.")
    try:
        card = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SAEError(f"{path} is corrupt ({e}); re-train or re-download the SAE.") from None
    if not isinstance(card, dict):
        raise SAEError(f"{path} is corrupt (not a JSON object); re-train or re-download the SAE.")
    missing = [key for key in ("d_in", "d_latent", "k") if key not in card]
    if missing:
        raise SAEError(f"{path} lacks {missing}; re-train or re-download the SAE.")
    bad = [key for key in ("d_in", "d_latent", "k") if type(card[key]) is not int or not 0 < card[key] < 1 << 24]
    layers = card.get("layers", [])
    if bad or not (isinstance(layers, list) and all(type(l) is int and 0 <= l < 1 << 16 for l in layers)) or \
            not isinstance(card.get("model_hash", ""), (str, type(None))):
        raise SAEError(f"{path} is corrupt ({', '.join(bad) or 'layers or model_hash'} of the wrong type or range); "
                       "re-train or re-download the SAE.")
    return card


def _read_weights(path: Path, sha256: str | None = None) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    if not path.exists():
        raise SAEError(f"No SAE weights at {path}; re-train or re-download the SAE.")
    data = path.read_bytes()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise SAEError(f"{path} is truncated or corrupt (it does not match the checksum in its card.json); "
                       "re-train or re-download the SAE.")
    try:
        return load(data)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise SAEError(f"{path} is truncated or corrupt ({e}); re-train or re-download the SAE.") from None


def _check_model(card: dict, expect: str | None, where: Path) -> None:
    if expect is not None and card.get("model_hash") not in (None, expect):
        raise SAEModelMismatch(
            f"SAE weights in {where} were trained for model {card.get('model', '?')} (hash "
            f"{str(card['model_hash'])[:16]}), not for the loaded model (hash {expect[:16]}). Train SAEs for this "
            "model with `endo train-sae --model PATH ...`, or load the model they were trained for.")


def aggregate_heads(ids: torch.Tensor, acts: torch.Tensor, k: int, rule: str = AGGREGATION
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-head features (H, T, k_h) into k per token (T, k), largest first.

    rule "max": union of the heads' features, a feature shared by heads keeps its largest activation;
    rule "sum": a feature's activations are summed over the heads. Then the k largest are kept.
    Zero-activation candidates never beat positive ones; if fewer than k are positive the rest are padding
    (act 0, id meaningless), as in `TopKSAE.encode`.
    """
    if ids.shape != acts.shape or ids.ndim != 3:
        raise SAEError(f"aggregate_heads takes ids and acts of one shape (heads, T, k), got {tuple(ids.shape)} "
                       f"and {tuple(acts.shape)}.")
    if rule not in ("max", "sum"):
        raise SAEError(f"Unknown aggregation rule {rule!r}; use 'max' or 'sum'.")
    T = ids.shape[1]
    cand_ids = ids.permute(1, 0, 2).reshape(T, -1)  # (T, H*k_h)
    cand_acts = acts.permute(1, 0, 2).reshape(T, -1).float()
    # Sort candidates by feature id; within one id, the largest activation first (two stable sorts).
    by_act = cand_acts.argsort(dim=1, descending=True, stable=True)
    cand_ids, cand_acts = cand_ids.gather(1, by_act), cand_acts.gather(1, by_act)
    by_id = cand_ids.argsort(dim=1, stable=True)
    cand_ids, cand_acts = cand_ids.gather(1, by_id), cand_acts.gather(1, by_id)
    first = torch.ones_like(cand_ids, dtype=torch.bool)
    first[:, 1:] = cand_ids[:, 1:] != cand_ids[:, :-1]
    if rule == "sum":  # segment sums over runs of equal ids, read at each run's first entry
        csum = cand_acts.cumsum(1)
        run = first.long().cumsum(1) - 1  # run index of each entry
        last_of_run = torch.zeros_like(csum).scatter_reduce(1, run, csum, "amax")  # csum is non-decreasing
        before = torch.cat([torch.zeros_like(csum[:, :1]), last_of_run[:, :-1]], 1)
        cand_acts = (last_of_run - before).gather(1, run)
    score = torch.where(first, cand_acts, torch.full_like(cand_acts, -1.0))  # duplicates lose to everything
    top, pos = score.topk(min(k, score.shape[1]), dim=1)
    return cand_ids.gather(1, pos), top.clamp_min(0.0)


@dataclass
class SAEBank:
    """One SAE per target layer of one model: `<dir>/card.json` + `<dir>/layer_XX/` (TopKSAE.save folders)."""

    saes: dict[int, TopKSAE]
    card: dict

    @property
    def layers(self) -> list[int]:
        return sorted(self.saes)

    @property
    def k(self) -> int:
        return self.card["k"]

    def save(self, directory: str | os.PathLike, dtype: torch.dtype = torch.float16) -> Path:
        directory = Path(directory)
        for layer, sae in self.saes.items():
            sae.save(directory / f"layer_{layer:02d}", dtype=dtype, model_hash=self.card.get("model_hash"),
                     model=self.card.get("model"), layer=layer)
        first = self.saes[self.layers[0]]
        self.card.update(layers=self.layers, d_in=first.d_in, d_latent=first.d_latent, k=first.k)
        directory.mkdir(parents=True, exist_ok=True)
        return _write_card(directory, self.card)

    @classmethod
    def load(cls, directory: str | os.PathLike, expect_model_hash: str | None = None,
             device: str | torch.device = "cpu") -> "SAEBank":
        directory, card = _open_card(directory, expect_model_hash)
        saes = {int(l): TopKSAE.load(directory / f"layer_{int(l):02d}", expect_model_hash, device)
                for l in card.get("layers", [])}
        if not saes:
            raise SAEError(f"{directory / CARD_FILE} lists no layers; re-train with `endo train-sae`.")
        return cls(saes, card)

    @classmethod
    def for_backbone(cls, backbone, device: str | torch.device | None = None) -> "SAEBank":
        """The SAEs of the backbone's model, shipped or made by `endo train-sae` (checked by model hash)."""
        folder = sae_dir(backbone)
        if not (folder / CARD_FILE).exists():
            raise SAEError(missing(backbone, "sae", folder) + " Method 'bm25' needs no SAEs.")
        return cls.load(folder, backbone.model_hash, device or backbone.device)

    def _sae(self, layer: int) -> TopKSAE:
        if layer not in self.saes:
            raise SAEError(f"No SAE for layer {layer}; this bank has layers {self.layers}.")
        return self.saes[layer]

    def encode_keys(self, layer: int, keys: torch.Tensor, check_finite: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE keys (n_kv, T, d) -> per-token features (ids (T, k), acts (T, k)) [S3 Eq. 4].
        check_finite=False skips the NaN/inf check, which waits for an accelerator (the indexer checks at hand-off)."""
        return self._encode_heads(layer, keys, check_finite)

    def encode_queries(self, layer: int, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE queries (n_heads, T, d) -> (ids (T, k), acts (T, k)) with the keys' codebook [S3 Eq. 6]."""
        return self._encode_heads(layer, queries)

    def _encode_heads(self, layer: int, x: torch.Tensor, check_finite: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        sae = self._sae(layer)
        if x.ndim != 3:
            raise SAEError(f"Expected (heads, T, {sae.d_in}) states, got shape {tuple(x.shape)}.")
        rule = self.card.get("aggregation", AGGREGATION)
        if rule == "max":
            return sae.encode_heads(x, check_finite=check_finite)
        ids, acts = sae.encode(x, check_finite=check_finite)
        return aggregate_heads(ids, acts, sae.k, rule)
