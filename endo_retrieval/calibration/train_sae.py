"""Train Top-k SAEs on pre-RoPE key states (S3-Attention A.3, Table 6) with the recipe of Gao et al. 2024.

Gao et al.: decoder rows at unit norm (gradient parallel to a row projected out, rows renormalised after each
step), encoder initialised as the decoder's transpose, b_dec at the data mean, AuxK loss (top-k_aux of the dead
latents reconstructs the residual, coefficient 1/32), Adam at 1e-3, 4096-vector batches.

`endo train-sae` = collect (stream the corpus through the backbone, early exit, chunk 2048, independent mode;
cached under OUT/vectors) -> train one SAE per layer (checkpointed, resumable) -> evaluate on held-out text
(key and query FVU, dead latents, chunk stability) -> OUT/card.json + OUT/layer_XX/.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from endo_retrieval.files import atomic_write
from endo_retrieval.model.profiles import sae_dir
from endo_retrieval.model.sae import AGGREGATION, SAEBank, SAEError, TopKSAE
from endo_retrieval.model.backbone import Backbone

DEFAULT_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext2"
DEFAULT_EXPANSION = 16  # head_dim 64 -> 1024 latents (docs/sae.md: fewer dead latents, stabler features)
DEFAULT_K = 16
STABILITY_CHUNKS = (512, 1024, 2048, 4096)
FITS = ("keys", "keys+queries")


@dataclass
class TrainConfig:
    d_latent: int = 64 * DEFAULT_EXPANSION
    k: int = DEFAULT_K
    steps: int = 6000
    batch_size: int = 4096
    lr: float = 1e-3
    aux_k: int | None = None  # None: d_in // 2 (Gao et al.'s d_model / 2)
    aux_coef: float = 1 / 32
    dead_window: int = 1_000_000  # a latent is dead after this many training vectors without firing
    seed: int = 0
    device: str = "cpu"
    checkpoint_every: int = 500


class TrainingInterrupted(RuntimeError):
    """Raised by `stop_after`, standing in for a crash; the last checkpoint stays."""


def _normalized_mse(target: torch.Tensor, recon: torch.Tensor) -> torch.Tensor:
    return ((target - recon) ** 2).sum() / ((target - target.mean(0)) ** 2).sum().clamp_min(1e-12)


def auxk_loss(pre: torch.Tensor, dead: torch.Tensor, residual: torch.Tensor, W_dec: torch.Tensor, aux_k: int
              ) -> torch.Tensor:
    """AuxK (Gao et al. 2024): the top-k_aux *dead* latents reconstruct the live latents' residual, which gives
    dead latents a gradient. pre: ReLU activations (N, d_latent); dead: bool (d_latent,)."""
    aux_acts, aux_ids = pre.masked_fill(~dead, -1.0).topk(min(aux_k, int(dead.sum())), dim=1)
    aux_recon = torch.einsum("nk,nkd->nd", aux_acts.clamp_min(0), W_dec[aux_ids])
    return _normalized_mse(residual, aux_recon).nan_to_num(0.0)


def train_sae(vectors: torch.Tensor, cfg: TrainConfig, checkpoint: Path | None = None,
              stop_after: int | None = None, progress: bool = False, desc: str = "sae"
              ) -> tuple[TopKSAE, dict]:
    """Fit a TopKSAE to vectors (N, d_in). Resumes from `checkpoint` when it exists; writes it atomically every
    `checkpoint_every` steps. Batches are drawn from (seed, step), so a resumed run repeats the uninterrupted one.
    Training runs on vectors / scale (unit per-coordinate variance); the scale is folded back before returning.
    """
    device = torch.device(cfg.device)
    x = vectors.float()
    mean = x.mean(0)
    scale = float(((x - mean) ** 2).mean().sqrt().clamp_min(1e-8))
    x = (x / scale).to(device)
    d_in = x.shape[1]
    aux_k = cfg.aux_k or d_in // 2
    torch.manual_seed(cfg.seed)
    sae = TopKSAE(d_in, cfg.d_latent, cfg.k).to(device)
    with torch.no_grad():
        sae.b_dec.copy_(mean.to(device) / scale)  # b_dec at the data mean
    opt = torch.optim.Adam(sae.parameters(), lr=cfg.lr)
    since_fired = torch.zeros(cfg.d_latent, dtype=torch.long, device=device)
    start = 0
    if checkpoint is not None and Path(checkpoint).exists():
        # weights_only: the checkpoint holds tensors, numbers and strings only, so no pickled code can run
        state = torch.load(checkpoint, map_location=device, weights_only=True)
        if state["config"] != asdict(cfg) or state["n_vectors"] != len(x):
            raise SAEError(f"Checkpoint {checkpoint} belongs to another run (config or data differ); "
                           "delete it or run without --resume.")
        sae.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        since_fired, start = state["since_fired"], state["step"]
    bar = _progress(range(start, cfg.steps), progress, desc, start, cfg.steps)
    g = torch.Generator()
    loss = torch.zeros(())
    t0 = time.time()
    for step in bar:
        g.manual_seed(cfg.seed * 1_000_003 + step)
        xb = x[torch.randint(len(x), (cfg.batch_size,), generator=g).to(device)]
        pre = sae.pre_acts(xb)  # [S3 Eq. 2]
        acts, ids = pre.topk(cfg.k, dim=1)  # [S3 Eq. 3]
        recon = sae.decode(ids, acts)
        loss = _normalized_mse(xb, recon)
        since_fired += len(xb)
        since_fired[ids[acts > 0]] = 0
        dead = since_fired >= cfg.dead_window
        total = loss
        if cfg.aux_coef > 0 and bool(dead.any()):
            total = total + cfg.aux_coef * auxk_loss(pre, dead, (xb - recon).detach(), sae.W_dec, aux_k)
        opt.zero_grad(set_to_none=True)
        total.backward()
        sae.project_decoder_grad()
        opt.step()
        sae.normalize_decoder()
        done = step + 1
        if progress and done % 50 == 0:
            bar.set_postfix(fvu=f"{loss.item():.4f}", dead=f"{dead.float().mean().item():.3f}")
        if checkpoint is not None and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
            state = {"config": asdict(cfg), "n_vectors": len(x), "step": done, "model": sae.state_dict(),
                     "optimizer": opt.state_dict(), "since_fired": since_fired}
            atomic_write(Path(checkpoint), lambda p: torch.save(state, p))
        if stop_after is not None and done >= stop_after and done < cfg.steps:
            raise TrainingInterrupted(f"stopped after step {done}")
    with torch.no_grad():  # fold the scale back: z_orig = scale * z, x_hat = z_orig W_dec + scale * b_dec
        sae.b_enc.mul_(scale)
        sae.b_dec.mul_(scale)
    stats = {"steps": cfg.steps, "resumed_from": start, "train_fvu": float(loss.detach()), "scale": scale,
             "dead_share_train": float((since_fired >= cfg.dead_window).float().mean()),
             "seconds": round(time.time() - t0, 1)}
    return sae.eval(), stats


def _progress(it, enabled: bool, desc: str, initial: int = 0, total: int | None = None):
    if not enabled:
        return _Quiet(it)
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, initial=initial, total=total, dynamic_ncols=True)


class _Quiet(list):
    def __init__(self, it):
        super().__init__(it)

    def set_postfix(self, **_):
        pass


# ---- corpus streaming ---------------------------------------------------------------------------------------
def read_corpus(path: str | Path) -> str:
    """A text file, or every *.txt under a folder (sorted), joined by blank lines."""
    path = Path(path)
    files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise SAEError(f"No text found at {path}; give a .txt file or a folder of .txt files.")
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def collect_states(bb, text: str, layers: list[int], max_tokens: int | None, chunk_size: int = 2048,
                   capture: tuple[str, ...] = ("k",), progress: bool = False) -> dict[str, dict[int, torch.Tensor]]:
    """Stream text through the backbone (early exit after max(layers); chunk-independent, as at index time) and
    keep each layer's pre-RoPE states: {"k": {layer: (n_kv, T, d)}, "q": {layer: (n_heads, T, d)}}, fp16 on CPU."""
    ids = bb.encode(text).ids[:max_tokens]
    parts: dict[str, dict[int, list]] = {kind: {l: [] for l in layers} for kind in capture}
    chunks = bb.stream(ids, layers, chunk_size=chunk_size, mode="independent", capture=capture)
    bar = _progress(chunks, progress, "collect", 0, math.ceil(len(ids) / chunk_size))
    for ch in bar:
        for kind, states in (("k", ch.keys), ("q", ch.queries)):
            for l in layers if kind in capture else ():
                parts[kind][l].append(states[l].to("cpu", torch.float16))
    return {kind: {l: torch.cat(v, dim=1) for l, v in per.items()} for kind, per in parts.items()}


def save_states(path: Path, states: dict[str, dict[int, torch.Tensor]], meta: dict) -> None:
    from safetensors.torch import save_file

    flat = {f"{kind}.{l}": t.contiguous() for kind, per in states.items() for l, t in per.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda p: save_file(flat, str(p), metadata={k: json.dumps(v) for k, v in meta.items()}))


def load_states(path: Path) -> tuple[dict[str, dict[int, torch.Tensor]], dict]:
    from safetensors import safe_open

    states: dict[str, dict[int, torch.Tensor]] = {}
    with safe_open(str(path), "pt") as f:
        meta = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
        for name in f.keys():
            kind, l = name.split(".")
            states.setdefault(kind, {})[int(l)] = f.get_tensor(name)
    return states, meta


# ---- held-out evaluation -------------------------------------------------------------------------------------
@torch.no_grad()
def dead_share(sae: TopKSAE, x: torch.Tensor) -> float:
    """Share of latents that never reach the top k on any of the vectors x (N, d)."""
    fired = torch.zeros(sae.d_latent, dtype=torch.bool, device=sae.W_dec.device)
    for part in x.split(65536):
        ids, acts = sae.encode(part)
        fired[ids[acts > 0]] = True
    return float(1.0 - fired.float().mean())


def jaccard(a_ids: torch.Tensor, a_acts: torch.Tensor, b_ids: torch.Tensor, b_acts: torch.Tensor) -> torch.Tensor:
    """Per-row Jaccard of the active (act > 0) feature sets, (T, k) each -> (T,)."""
    a = torch.where(a_acts > 0, a_ids, -1)
    b = torch.where(b_acts > 0, b_ids, -2)
    inter = (a.unsqueeze(2) == b.unsqueeze(1)).any(2).sum(1)
    union = (a_acts > 0).sum(1) + (b_acts > 0).sum(1) - inter
    return inter / union.clamp_min(1)


@torch.no_grad()
def chunk_stability(bb, bank: SAEBank, text: str, n_tokens: int = 8192, chunks=STABILITY_CHUNKS) -> dict:
    """S3 appendix I / Table 9: full pass vs chunk-B independent prefill over n_tokens of held-out text; per layer
    and B: mean feature Jaccard (aggregated k per token), key cosine and relative l2 error."""
    ids = bb.encode(text).ids[:n_tokens]
    layers = bank.layers

    def keys(chunk_size):
        out = {l: [] for l in layers}
        for ch in bb.stream(ids, layers, chunk_size=chunk_size, mode="independent", capture=("k",)):
            for l in layers:
                out[l].append(ch.keys[l].float().cpu())
        return {l: torch.cat(v, 1) for l, v in out.items()}

    full = keys(len(ids))
    table: dict = {"n_tokens": len(ids)}
    for B in chunks:
        part = keys(B)
        for l in layers:
            f_ids, f_acts = bank.encode_keys(l, full[l])
            c_ids, c_acts = bank.encode_keys(l, part[l])
            cos = torch.nn.functional.cosine_similarity(full[l], part[l], dim=-1)
            rel = (full[l] - part[l]).norm(dim=-1) / full[l].norm(dim=-1).clamp_min(1e-8)
            table.setdefault(str(l), {})[str(B)] = {
                "jaccard": round(float(jaccard(f_ids.cpu(), f_acts.cpu(), c_ids.cpu(), c_acts.cpu()).mean()), 4),
                "k_cosine": round(float(cos.mean()), 4), "rel_l2": round(float(rel.mean()), 4)}
    return table


def evaluate(bank: SAEBank, heldout: dict[str, dict[int, torch.Tensor]], device: str) -> dict:
    """Held-out key FVU, query FVU (the K->Q shift of A.3) and dead-latent share for each layer."""
    result = {"fvu_k": {}, "fvu_q": {}, "dead_share": {}}
    for l in bank.layers:
        sae = bank.saes[l].to(device)
        keys = heldout["k"][l].reshape(-1, sae.d_in).to(device).float()
        result["fvu_k"][str(l)] = round(sae.fvu(keys), 4)
        result["dead_share"][str(l)] = round(dead_share(sae, keys), 4)
        if "q" in heldout:
            result["fvu_q"][str(l)] = round(sae.fvu(heldout["q"][l].reshape(-1, sae.d_in).to(device).float()), 4)
    return result


# ---- the command ---------------------------------------------------------------------------------------------
AUTO_DEPTHS = (0.1, 0.37, 0.63)  # the default model's shipped layers 3, 11, 19 of 30, as shares of the depth


def _parse_layers(text: str, n_layers: int | None = None) -> list[int]:
    if text == "auto":
        return sorted({min(n_layers - 1, round(d * n_layers)) for d in AUTO_DEPTHS})
    try:
        layers = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise SAEError(f"--layers takes comma-separated integers like 0,7,15, got {text!r}.") from None
    if not layers:
        raise SAEError("--layers needs at least one layer index.")
    return layers


def run(args: argparse.Namespace) -> dict:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    interactive = sys.stderr.isatty()
    backbone = None

    def bb():
        nonlocal backbone
        if backbone is None:
            backbone = Backbone(None if args.model == "default" else args.model, device=device, dtype=torch.float32)
        return backbone

    # the default folder and the "auto" layers need the model (its hash, its depth); else it loads only if needed
    out = Path(args.out) if args.out else sae_dir(bb())
    layers = _parse_layers(args.layers, bb().n_layers if args.layers == "auto" else None)

    def states(name: str, corpus: str, max_tokens, capture) -> tuple[dict, dict]:
        path = out / "vectors" / f"{name}.safetensors"
        if path.exists():
            cached, meta = load_states(path)
            if all(l in cached.get(kind, {}) for l in layers for kind in capture):
                return cached, meta
        b = bb()
        got = collect_states(b, read_corpus(corpus), layers, max_tokens, args.chunk_size, capture, interactive)
        meta = {"model": b.model_id, "model_hash": b.model_hash, "corpus": str(corpus),
                "tokens": int(next(iter(got["k"].values())).shape[1])}
        save_states(path, got, meta)
        return got, meta

    train, meta = states("train", args.corpus, args.max_tokens, ("k", "q") if args.fit == "keys+queries" else ("k",))
    d_in = next(iter(train["k"].values())).shape[-1]
    cfg = TrainConfig(d_latent=args.expansion * d_in, k=args.k, steps=args.steps, batch_size=args.batch_size,
                      seed=args.seed, device=device)
    saes, train_stats = {}, {}
    for l in layers:
        folder, ckpt = out / f"layer_{l:02d}", out / "checkpoints" / f"layer_{l:02d}.pt"
        if (folder / "sae.safetensors").exists() and args.resume:
            saes[l] = TopKSAE.load(folder, meta["model_hash"], device)
            train_stats[l] = saes[l].card.get("train", {})
            continue
        if ckpt.exists() and not args.resume:
            ckpt.unlink()
        vectors = train["k"][l].reshape(-1, d_in)  # the layer's KV heads share one SAE
        if args.fit == "keys+queries":
            queries = train["q"][l].reshape(-1, d_in)
            pick = torch.randperm(len(queries), generator=torch.Generator().manual_seed(args.seed))[: len(vectors)]
            vectors = torch.cat([vectors, queries[pick]])
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        sae, stats = train_sae(vectors, cfg, checkpoint=ckpt, progress=interactive, desc=f"layer {l}")
        stats["vectors"] = len(vectors)
        print(f"layer {l}: {json.dumps(stats)}", file=sys.stderr, flush=True)
        saes[l], train_stats[l] = sae, stats
        sae.save(folder, model_hash=meta["model_hash"], model=meta["model"], layer=l, train=stats)
    card = {"model": meta["model"], "model_hash": meta["model_hash"], "layers": layers, "d_in": d_in,
            "d_latent": cfg.d_latent, "k": cfg.k, "expansion": args.expansion, "aggregation": AGGREGATION,
            "shared_across_kv_heads": True, "fit": args.fit, "training_corpus": Path(meta["corpus"]).name,
            "training_tokens": meta["tokens"],
            "training_vectors": {str(l): s.get("vectors") for l, s in train_stats.items()},
            "recipe": {**{k: v for k, v in asdict(cfg).items() if k not in ("device", "d_latent", "k")},
                       "aux_k": cfg.aux_k or d_in // 2},
            "dead_share_train": {str(l): s.get("dead_share_train") for l, s in train_stats.items()}}
    bank = SAEBank(saes, card)
    if args.heldout != "none":
        held, held_meta = states("heldout", args.heldout, args.heldout_tokens, ("k", "q"))
        card.update(evaluate(bank, held, device), heldout_corpus=Path(held_meta["corpus"]).name,
                    heldout_tokens=held_meta["tokens"])
        if args.stability_tokens:
            card["chunk_stability"] = chunk_stability(bb(), bank, read_corpus(args.heldout), args.stability_tokens)
    bank.save(out)
    print(json.dumps({k: card[k] for k in ("layers", "fvu_k", "fvu_q", "dead_share") if k in card}, indent=1))
    return card
