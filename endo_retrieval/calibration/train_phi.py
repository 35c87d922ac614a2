"""Distil head-wise positive feature maps phi_q, phi_k for `completion` attention (RCA section 5, appendices B and K).

`endo train-phi` = log (q, k) with full attention over windows of `length` tokens of a text folder (the teacher,
frozen; RoPE-applied states, appendix J) -> for the last `queries` positions of each window, teacher logits
s = scaling q.k over the support U = M, the mid region before them (appendix K) -> fit the maps of `PhiMaps` to the
student logits s^ = log <phi_q(q), phi_k(k)> with appendix B's loss -> OUT/card.json + OUT/phi.safetensors.
Maps are length-specific (section 5): train at the prefill length they will serve.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from endo_retrieval.attention.base import installed
from endo_retrieval.attention.dense import Dense
from endo_retrieval.attention.phi import PhiMaps, shipped_dir
from endo_retrieval.calibration.train_sae import _progress, read_corpus
from endo_retrieval.model.backbone import Backbone

DEFAULT_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "pg_essays"


@dataclass
class DistillLoss:
    """Appendix B's defaults [RCA Eq. 20-32]; the temperature is not given there, 1 keeps plain KL."""

    lambda_kl: float = 0.99
    lambda_top: float = 1.0
    lambda_fp: float = 2.0
    lambda_z: float = 4.0
    band: float = 8.0  # Delta
    huber: float = 1.0  # delta
    temperature: float = 1.0  # tau

    def __call__(self, s: torch.Tensor, s_hat: torch.Tensor) -> torch.Tensor:
        """Mean loss over queries; teacher s and student s^ logits (..., n) over the support."""
        b = s.amax(-1, keepdim=True)  # [RCA Eq. 20]
        r, r_hat = s - b, s_hat - b  # [RCA Eq. 21]
        t = self.temperature
        log_p, log_p_hat = F.log_softmax(r / t, -1), F.log_softmax(r_hat / t, -1)  # [RCA Eq. 22]
        kl = t * t * (log_p.exp() * (log_p - log_p_hat)).sum(-1)  # [RCA Eq. 23]
        top, far = r >= -self.band, r < -self.band  # [RCA Eq. 25, 27]
        rho = lambda x: F.huber_loss(x, torch.zeros_like(x), reduction="none", delta=self.huber)  # [RCA Eq. 24]
        l_top = (rho(r_hat - r) * top).sum(-1) / top.sum(-1).clamp_min(1)  # [RCA Eq. 26]
        l_fp = (rho((r_hat + self.band).clamp_min(0)) * far).sum(-1) / far.sum(-1).clamp_min(1)  # [RCA Eq. 28]
        l_z = rho((torch.logsumexp(r_hat, -1) - torch.logsumexp(r, -1)).clamp_min(0))  # [RCA Eq. 29-30]
        aux = self.lambda_top * l_top + self.lambda_fp * l_fp + self.lambda_z * l_z  # [RCA Eq. 31]
        return (self.lambda_kl * kl + (1 - self.lambda_kl) * aux).mean()  # [RCA Eq. 32]


class _Stop(Exception):
    """Raised after the deepest logged layer: later layers need not run."""


@dataclass
class _Recorder(Dense):
    """Dense attention that keeps the rotated q and k of the logged layers."""

    layers: tuple[int, ...] = ()

    def attend(self, layer, q, k, v, scaling):
        out = super().attend(layer, q, k, v, scaling)
        if layer in self.layers:
            n = self.cache.length(layer)
            self.states[layer] = (self.rope(q, n - q.shape[1], n), self.cache._k[layer][:, :n].clone())
        if layer == max(self.layers):
            raise _Stop
        return out


def log_traces(backbone, text: str, layers: list[int], length: int, queries: int, windows: int,
               sink: int = 4, tail: int = 16, progress: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """layer -> (q (H, W, queries, d), k (H_kv, W, |M|, d)): the last `queries` positions of each window and the
    mid region [sink, length - queries - tail) that all of them see."""
    if length - queries - tail <= sink:
        raise ValueError(f"--length {length} leaves no mid region after --queries {queries}, tail {tail} and "
                         f"sink {sink}; use a longer length or fewer queries")
    ids = torch.as_tensor(backbone.encode(text).ids)
    n = min(windows, len(ids) // length)
    if n == 0:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than one window of --length {length}")
    rec = _Recorder(chunk_size=length, layers=tuple(layers))
    logged: dict[int, list] = {l: [] for l in layers}
    for w in _progress(range(n), progress, "logging"):
        rec.states = {}
        with backbone.lock, torch.inference_mode(), installed(backbone, rec):
            try:
                backbone.model(input_ids=ids[w * length:(w + 1) * length].view(1, -1).to(backbone.device),
                               use_cache=False, logits_to_keep=1)
            except _Stop:
                pass
        for l, (q, k) in rec.states.items():
            logged[l].append((q[:, -queries:].clone(), k[:, sink:length - queries - tail].clone()))
    return {l: (torch.stack([q for q, _ in got], 1), torch.stack([k for _, k in got], 1)) for l, got in logged.items()}


def student_logits(maps: PhiMaps, slot: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """s^ = log <phi_q(q), phi_k(k)>, q (H, B, Q, d), k (H_kv, B, M, d) -> (H, B, Q, M), max-shifted per row."""
    lq = maps.log_phi_q(slot, q)
    lk = maps.log_phi_k(slot, k).repeat_interleave(q.shape[0] // k.shape[0], 0)
    mq, mk = lq.amax(-1, keepdim=True), lk.amax(-1, keepdim=True)
    z = torch.einsum("hbqf,hbmf->hbqm", (lq - mq).exp(), (lk - mk).exp())
    return z.clamp_min(1e-30).log() + mq + mk.transpose(-1, -2)


def train_maps(maps: PhiMaps, traces: dict, steps: int, batch: int = 4, lr: float = 1e-3,
               loss_fn: DistillLoss | None = None, seed: int = 0, progress: bool = False) -> list[float]:
    """Adam on every logged layer's maps; returns the loss per step (mean over layers)."""
    loss_fn = loss_fn or DistillLoss()
    opt = torch.optim.Adam(maps.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    losses = []
    bar = _progress(range(steps), progress, "train-phi")
    for step in bar:
        total = 0.0
        for l, (q, k) in traces.items():
            pick = torch.randint(q.shape[1], (min(batch, q.shape[1]),), generator=g)
            qb, kb = q[:, pick].float(), k[:, pick].float()
            group = qb.shape[0] // kb.shape[0]
            s = torch.einsum("hbqd,hbmd->hbqm", qb, kb.repeat_interleave(group, 0)) * maps.scaling
            total = total + loss_fn(s, student_logits(maps, maps.index(l), qb, kb))
        total = total / len(traces)
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        losses.append(float(total.detach()))
        if progress and (step + 1) % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    return losses


def run(args: argparse.Namespace) -> int:
    bb = Backbone(None if args.model == "default" else args.model, device=args.device, dtype=torch.float32)
    out = args.out or shipped_dir(bb.model_id)
    try:
        layers = list(range(bb.n_layers)) if args.layers == "all" else sorted({int(t) for t in args.layers.split(",")})
    except ValueError:
        raise ValueError(f"--layers takes 'all' or comma-separated integers like 0,7,15, got {args.layers!r}") from None
    if not layers or not all(0 <= l < bb.n_layers for l in layers):
        raise ValueError(f"--layers must name layers 0..{bb.n_layers - 1}, got {args.layers!r}")
    interactive = sys.stderr.isatty()
    t0 = time.time()
    traces = log_traces(bb, read_corpus(args.corpus), layers, args.length, args.queries, args.windows,
                        progress=interactive)
    maps = PhiMaps.for_backbone(bb, layers, d_phi=args.d_phi, length=args.length, seed=args.seed).to(bb.device)
    loss = DistillLoss(**{k: getattr(args, k) for k in asdict(DistillLoss())})
    losses = train_maps(maps, traces, args.steps, args.batch, args.lr, loss, args.seed, interactive)
    train = {"corpus": Path(args.corpus).name, "windows": int(next(iter(traces.values()))[0].shape[1]),
             "queries": args.queries, "steps": args.steps, "batch": args.batch, "lr": args.lr, "loss": asdict(loss),
             "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
             "seconds": round(time.time() - t0, 1)}
    maps.save(out, train=train)
    print(f"phi maps for layers {layers} -> {out} (loss {train['loss_first']:.4f} -> {train['loss_last']:.4f}, "
          f"{train['seconds']} s)")
    return 0
