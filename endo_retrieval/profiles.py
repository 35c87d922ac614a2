"""Shipped per-model artefacts (trained SAEs, the calibrated ILRe layer), found by the model's hash."""
from __future__ import annotations

import json
from pathlib import Path

ASSETS = Path(__file__).parent / "assets"


def model_slug(model_id: str) -> str:
    """Folder/file name of a model's shipped artefacts (its id, lowercased); the files themselves carry the
    model's hash and are checked against it on load."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in model_id).lower()


def sae_dir(backbone) -> Path:
    return ASSETS / "sae" / model_slug(backbone.model_id)


def ilre_profile_path(backbone) -> Path:
    return ASSETS / "ilre" / f"{model_slug(backbone.model_id)}.json"


def sae_card(backbone) -> dict | None:
    """The shipped SAE card in the `endo info --json` shape, or None when this model has no shipped SAEs."""
    path = sae_dir(backbone) / "card.json"
    if not path.exists():
        return None
    card = json.loads(path.read_text())
    if card.get("model_hash") not in (None, backbone.model_hash):
        return None
    keys = ("layers", "d_latent", "k", "fvu_k", "fvu_q", "dead_share")
    return {k: card.get(k) for k in keys} | {k: v for k, v in card.items() if k not in keys}


def ilre_profile(backbone) -> dict | None:
    """The calibrated ILRe profile ({"layer": l_R, "recall": {...}, ...}) or None."""
    path = ilre_profile_path(backbone)
    if not path.exists():
        return None
    profile = json.loads(path.read_text())
    return profile if profile.get("model_hash") in (None, backbone.model_hash) else None
