"""Shipped per-model artefacts (trained SAEs, the calibrated ILRe layer, the retrieval heads), found by the model's
hash."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from endo_retrieval.files import cache_dir

ASSETS = Path(__file__).parents[1] / "assets"


def model_slug(model_id: str) -> str:
    """Folder/file name of a model's shipped artefacts (its id, lowercased); the files themselves carry the
    model's hash and are checked against it on load."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in model_id).lower()


# artefact -> the command that makes it for a model, and what it is
MAKERS = {"sae": ("endo train-sae", "SAEs (for s3 and s3-hybrid)"), "ilre": ("endo calibrate-ilre", "ILRe layer"),
          "heads": ("endo calibrate-heads", "retrieval-heads profile")}


def user_artefacts(backbone) -> Path:
    """Where a model's artefacts live when the package ships none for it: the cache, in a folder named after the
    model and its hash, found again by the hash alone (a renamed or moved model keeps its files). `endo
    train-sae`, `endo calibrate-ilre` and `endo calibrate-heads` write there by default."""
    root, tag = cache_dir() / "artefacts", backbone.model_hash[:12]
    return next(iter(sorted(root.glob(f"*-{tag}"))), root / f"{model_slug(backbone.model_id)}-{tag}")


def _shipped_or_user(backbone, kind: str, name: str) -> Path:
    """The shipped artefact made for this model, found by the model hash it records (so a model passed by another
    name or path, e.g. the default GGUF file itself, still finds it; by name where none is recorded), else the
    cache's."""
    for path in sorted((ASSETS / kind).glob("*")):
        card = path / "card.json" if path.is_dir() else path
        if card.suffix == ".json" and card.exists():
            recorded = json.loads(card.read_text()).get("model_hash")
            if recorded == backbone.model_hash or (recorded is None and path.stem == model_slug(backbone.model_id)):
                return path
    return user_artefacts(backbone) / name


def missing(backbone, kind: str, where: Path) -> str:
    """The message for a model without one of its artefacts: what, where it was looked for, the command that
    makes it (which writes it there)."""
    command, what = MAKERS[kind]
    source = getattr(backbone, "source", None)
    model = f" --model {source}" if source else ""
    return (f"No {what} for model {backbone.model_id} (hash {backbone.model_hash[:12]}) at {where}. Make it once "
            f"with `{command}{model}`, which writes it there.")


def sae_dir(backbone) -> Path:
    return _shipped_or_user(backbone, "sae", "sae")


def ilre_profile_path(backbone) -> Path:
    return _shipped_or_user(backbone, "ilre", "ilre.json")


def sae_card(backbone) -> dict | None:
    """The SAE card (shipped, or made by `endo train-sae`) in the `endo info --json` shape, or None."""
    path = sae_dir(backbone) / "card.json"
    if not path.exists():
        return None
    card = json.loads(path.read_text())
    if card.get("model_hash") not in (None, backbone.model_hash):
        return None
    keys = ("layers", "d_latent", "k", "fvu_k", "fvu_q", "dead_share")
    return {k: card.get(k) for k in keys} | {k: v for k, v in card.items() if k not in keys}


class ProfileError(ValueError):
    """A per-model profile (ILRe layer, retrieval heads) that cannot be used; the message names the file and the
    command that makes it again."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _valid(kind: str, profile: dict) -> bool:
    if kind == "ilre":
        return _is_int(profile.get("layer")) and profile["layer"] >= 0
    heads, fusion = profile.get("heads"), profile.get("fusion", {})
    weights = fusion.get("weights", {}) if isinstance(fusion, dict) else None
    return (isinstance(heads, list) and bool(heads)
            and all(isinstance(h, list) and len(h) == 2 and all(_is_int(v) and v >= 0 for v in h) for h in heads)
            and isinstance(weights, dict) and all(isinstance(k, str) and isinstance(w, (int, float))
                                                  and not isinstance(w, bool) and math.isfinite(w) and w >= 0
                                                  for k, w in weights.items()))


def _read_profile(backbone, path: Path, kind: str) -> dict | None:
    """The JSON profile at `path` when it exists and was made for this model (the hash it records), else None; a
    damaged one is a ProfileError that says how to make it again."""
    if not path.exists():
        return None
    command = MAKERS[kind][0]
    try:
        profile = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"{path} cannot be read ({type(e).__name__}); make it again with `{command}`.") from None
    if not isinstance(profile, dict) or not _valid(kind, profile):
        raise ProfileError(f"{path} is damaged (a field is missing or of the wrong type); make it again with "
                           f"`{command}`.")
    return profile if profile.get("model_hash") in (None, backbone.model_hash) else None


def ilre_profile(backbone) -> dict | None:
    """The calibrated ILRe profile ({"layer": l_R, "recall": {...}, ...}) or None."""
    return _read_profile(backbone, ilre_profile_path(backbone), "ilre")


def heads_profile_path(backbone) -> Path:
    """$ENDO_HEADS_PROFILE when set (another profile to try, e.g. one `endo prepare --profile` made; it is used only
    for the model whose hash it records), else the shipped profile made for this model, else the cache's."""
    override = os.environ.get("ENDO_HEADS_PROFILE")
    if override and _recorded_hash(Path(override)) in (None, backbone.model_hash):
        return Path(override)
    return _shipped_or_user(backbone, "heads", "heads.json")


def _recorded_hash(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("model_hash")
    except (OSError, ValueError, AttributeError):
        return None


def heads_profile(backbone) -> dict | None:
    """The calibrated retrieval-heads profile ({"heads": [[layer, head], ...], "fusion": {...}, ...}) or None."""
    return _read_profile(backbone, heads_profile_path(backbone), "heads")
