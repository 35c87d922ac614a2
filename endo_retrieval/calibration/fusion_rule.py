"""The adaptive fusion fitted across domains (`scoring.adaptive.AdaptiveWeights`), from the signals `signals.collect`
wrote, without the model: each domain weighs the same, whatever its number of questions.

The fit maximises the listwise likelihood of the gold candidates, log sum_{i gold} softmax_i(tau * sum_s w_s(q) z_s,i),
over the rule's linear map and a temperature tau, with an L2 penalty on the map (the rule starts from, and is pulled
towards, one fixed fusion: the bias alone). Rules are judged by nDCG@10 over the candidates' distinct documents.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from endo_retrieval.calibration.pipeline import write_json
from endo_retrieval.calibration.signals import CPU_DEPTH, DEPTH, SHARE, collect_specs, load
from endo_retrieval.index.dense import available
from endo_retrieval.methods.endo import simplex
from endo_retrieval.model.backbone import Backbone
from endo_retrieval.model.profiles import ASSETS, heads_profile_path
from endo_retrieval.scoring.adaptive import AdaptiveWeights, question_features
from endo_retrieval.scoring.fusion import fuse, merge_reads, standardise

TOP = 10
PARTS = {"pipe": ("bm25", "dense", "heads", "hop2"), "cpu": ("bm25", "dense", "heads"),
         "minilm": ("first_stage", "heads"), "bm25": ("first_stage", "heads")}
# reads merged (`merged`): the hybrid pool's and the dense pool's candidates, each read as its own context
POOLED = {"union": ("pipe", "dense"), "cpu_union": ("cpu", "cpu_dense")}
PARTS |= {"dense": PARTS["pipe"], "cpu_dense": PARTS["cpu"], "union": PARTS["pipe"], "cpu_union": PARTS["cpu"]}
L2 = 0.3  # the penalty on the rule's map, chosen by leaving each domain out of the fit (docs/results.md)
# how hard `fit_balanced` leans towards the domains the rule trails (per nDCG point of regret): one value tried, not
# tuned; whether the rule ships at all is decided by leaving each domain out (`held_out`)
BALANCE = 1.0
# each profile entry -> the part its fit reads where the records hold both pools' reads (else the entry's own)
POOLED_PART = {"pipe": "union", "cpu": "cpu_union", "minilm": "minilm", "bm25": "bm25"}


def items(records: list[dict], part: str) -> list[tuple[dict, list[str], set[str]]]:
    """(stage scores, candidate documents, gold documents) of each record, for one of PARTS: "cpu" ("cpu_dense") is
    the first candidates of "pipe" ("dense") as a CPU reads them (its own heads' read, no second read); "union" and
    "cpu_union" merge two pools' reads (`merged`)."""
    if part in POOLED:
        pools = [items(records, name) for name in POOLED[part]]
        return [merged(list(both)) for both in zip(*pools)]
    out = []
    for r in records:
        gold = set(r["gold"])
        if part in ("cpu", "cpu_dense"):
            pool = r["pipe" if part == "cpu" else "dense"]
            n = len(r[part]["heads"])
            scores = {"bm25": pool["bm25"][:n], "dense": pool["dense"][:n], "heads": r[part]["heads"]}
            docs = pool["docs"][:n]
        elif part in ("pipe", "dense"):
            scores, docs = {s: r[part][s] for s in PARTS[part]}, r[part]["docs"]
        else:
            scores, docs = {"first_stage": r[part]["first"], "heads": r[part]["heads"]}, r[part]["docs"]
        out.append((scores, list(docs), gold))
    return out


def merged(pools: list[tuple[dict, list[str], set[str]]]) -> tuple[dict, list[str], set[str]]:
    """One item from the same question's reads of several pools, merged as `EndoPipeline` merges them
    (`fusion.merge_reads`). The records name documents, not passages, so here a document's k-th candidate in one read
    is matched with its k-th in another (the pipeline matches passages)."""
    reads = []
    for scores, docs, _ in pools:
        seen: dict[str, int] = {}
        keys = []
        for d in docs:
            seen[d] = seen.get(d, 0) + 1
            keys.append((d, seen[d]))
        reads.append((keys, scores))
    keys, scores = merge_reads(reads)
    return scores, [d for d, _ in keys], pools[0][2]


def ndcg(ranked_docs: list[str], gold: set[str], k: int = TOP) -> float:
    """nDCG@k with binary gains over the first k distinct documents (BEIR's)."""
    seen = list(dict.fromkeys(ranked_docs))[:k]
    dcg = sum(1 / np.log2(i + 2) for i, d in enumerate(seen) if d in gold)
    ideal = sum(1 / np.log2(i + 2) for i in range(min(len(gold), k)))
    return dcg / ideal if ideal else 0.0


class Judged:
    """One item made ready to judge many fusions at once: its standardised scores (stages x candidates), the
    candidates grouped by document (a document scores its best passage, as the first distinct documents of a
    ranking do), each document's gain and the ideal DCG@10."""

    def __init__(self, scores: dict, docs: list[str], gold: set[str], stages: tuple[str, ...]):
        names = list(dict.fromkeys(docs))
        of = np.array([names.index(d) for d in docs])
        self.order = np.argsort(of, kind="stable")
        self.bounds = np.flatnonzero(np.r_[True, np.diff(of[self.order]) > 0])
        self.z = np.stack([standardise(scores[s]) for s in stages])
        self.gain = np.array([d in gold for d in names], np.float64)
        self.ideal = sum(1 / np.log2(i + 2) for i in range(min(len(gold), TOP)))

    def ndcg(self, fused: np.ndarray) -> np.ndarray:
        """nDCG@10 of each row of `fused` (fusions x candidates)."""
        per_doc = np.maximum.reduceat(fused[:, self.order], self.bounds, axis=1)
        top = np.argsort(-per_doc, axis=1, kind="stable")[:, :TOP]
        discount = 1 / np.log2(np.arange(2, top.shape[1] + 2))
        return (self.gain[top] * discount).sum(1) / self.ideal if self.ideal else np.zeros(len(fused))


def per_question(its, score) -> np.ndarray:
    """nDCG@10 of each item when `score(stage scores)` ranks its candidates."""
    return np.array([ndcg(ranked(docs, score(s)), gold) for s, docs, gold in its])


def ranked(docs: list[str], fused: np.ndarray) -> list[str]:
    return [docs[i] for i in np.lexsort((np.arange(len(docs)), -fused))]


# the fixed fusion's objective, a soft minimum over the domains of each one's gain over its better first stage alone:
# -t log mean_d exp(-gain_d / t) (nDCG points; t -> 0 the worst domain's gain, t -> inf the mean gain; None: the mean
# of the domains' nDCG). Which t is chosen by leaving each domain out of the fit (`GridTables.temperature`).
TEMPERATURES = (0.25, 0.5, 1.0, 2.0, 4.0, None)
FIRST_STAGES = ("bm25", "dense", "first_stage")  # the stages a fusion must not fall below, each alone
# the promise a fusion keeps on every domain it is fitted on: at most FLOOR nDCG@10 points below the better first
# stage alone; the objective chooses among the fusions that keep it (all of them where none does)
FLOOR = 0.5


def soft_minimum(gains: np.ndarray, temperature: float | None) -> np.ndarray:
    """The soft minimum over the first axis (domains) of `gains` (nDCG points), or their mean (None)."""
    if temperature is None:
        return gains.mean(0)
    low = gains.min(0)
    return low - temperature * np.log(np.exp(-(gains - low) / temperature).mean(0))


class GridTables:
    """Each domain's mean nDCG@10 (points) under every fixed fusion of the simplex grid (`step` apart), computed once,
    beside its better first stage alone (the grid's corners): the fixed fits, and their choices made by leaving each
    domain out, read these. Ties keep the first of the grid (the corners, the simpler fusion)."""

    def __init__(self, domains: dict[str, list], stages: tuple[str, ...], step: float = 0.1):
        self.grid = sorted(simplex(list(stages), step), key=lambda w: -max(w.values()))
        w = np.array([[g[s] for s in stages] for g in self.grid])
        self.means = {d: 100 * np.mean([j.ndcg(w @ j.z) for j in (Judged(s, docs, g, stages) for s, docs, g in its)],
                                       axis=0) for d, its in domains.items()}
        corners = [i for i, g in enumerate(self.grid) if any(g.get(s) == 1.0 for s in FIRST_STAGES)]
        self.alone = {d: float(m[corners].max()) if corners else 0.0 for d, m in self.means.items()}

    def gains(self, names) -> np.ndarray:
        return np.stack([self.means[d] - self.alone[d] for d in names])

    def best(self, names, temperature: float | None, floor: float | None = FLOOR) -> int:
        """The grid's index of the fusion the objective (TEMPERATURES) prefers over the domains `names`, among those
        that keep every one of them within `floor` of its better first stage alone (None: among all)."""
        gains = self.gains(names)
        value = (np.mean([self.means[d] for d in names], axis=0) if temperature is None
                 else soft_minimum(gains, temperature))
        kept = (gains >= -floor).all(0) if floor is not None else np.ones(len(value), bool)
        return int(np.argmax(np.where(kept, value, -np.inf) if kept.any() else value))

    def held_out_gains(self, names, temperature: float | None) -> np.ndarray:
        """Each domain's gain under the fusion fitted on the others."""
        return np.array([self.gains([d])[0, self.best([x for x in names if x != d], temperature)] for d in names])

    def temperature(self, names) -> float | None:
        """The objective whose fits, each made without one domain, serve the worst-served domain left out best, then
        those left out best on the mean: the fit a corpus no fit has seen gets."""
        names = list(names)
        if len(names) < 3:
            return TEMPERATURES[-1]
        scored = [(round(float(held.min()), 6), float(held.mean()), -i)
                  for i, held in enumerate(self.held_out_gains(names, t) for t in TEMPERATURES)]
        return TEMPERATURES[-max(scored)[2]]

    def fit(self, names=None) -> tuple[dict[str, float], float | None]:
        """(the fixed fusion fitted on the domains `names` (default all), its objective's temperature)."""
        names = list(self.means if names is None else names)
        t = self.temperature(names)
        return self.grid[self.best(names, t)], t


def fit_fixed(domains: dict[str, list], stages: tuple[str, ...], step: float = 0.1) -> dict[str, float]:
    """The one fixed fusion (weights on the simplex, `step` apart) that serves the domains best by the objective
    `GridTables.temperature` chooses: no kind of corpus is given up for the mean of the others."""
    return GridTables(domains, stages, step).fit()[0]


def _arrays(its, stages):
    """Per item: (standardised scores, stages x candidates), the gold mask, the features."""
    out = []
    for scores, docs, gold in its:
        mask = np.array([d in gold for d in docs])
        if not mask.any() or mask.all():
            continue  # nothing to learn from: no gold among the candidates, or nothing else
        z = np.stack([standardise(scores[s]) for s in stages])
        out.append((z, mask, np.array(list(question_features(scores, stages).values()))))
    return out


def fit_rule(domains: dict[str, list], stages: tuple[str, ...], l2: float = L2, start: dict | None = None,
             steps: int = 300, seed: int = 0, weigh: dict[str, float] | None = None) -> AdaptiveWeights:
    """An `AdaptiveWeights` over `stages` fitted on {domain: items} (module docstring); `start`: the fixed weights
    the bias starts from (None: even)."""
    import torch

    torch.manual_seed(seed)
    data = {name: _arrays(its, stages) for name, its in domains.items()}
    data = {name: a for name, a in data.items() if a}
    feats = np.concatenate([[f for _, _, f in a] for a in data.values()])
    mean, scale = feats.mean(0), feats.std(0)
    scale = np.where(scale > 1e-9, scale, 1.0)
    batches, share = [], []
    for name, a in data.items():
        share.append((weigh or {}).get(name, 1.0))
        n = max(len(z[0]) for z, _, _ in a)
        z = np.zeros((len(a), len(stages), n))
        m = np.zeros((len(a), n), bool)
        valid = np.zeros((len(a), n), bool)
        for i, (zi, mi, _) in enumerate(a):
            z[i, :, :zi.shape[1]], m[i, :len(mi)], valid[i, :len(mi)] = zi, mi, True
        f = (np.stack([fi for _, _, fi in a]) - mean) / scale
        batches.append(tuple(torch.tensor(x) for x in (z, m, valid, f)))
    k = len(stages)
    w0 = np.array([max((start or {}).get(s, 1.0 / k), 1e-3) for s in stages])
    coef = torch.zeros(k, len(mean), dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(np.log(w0 / w0.sum()), requires_grad=True)
    log_tau = torch.tensor(np.log(3.0), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([coef, bias, log_tau], max_iter=steps, line_search_fn="strong_wolfe")

    def loss():
        opt.zero_grad()
        total = 0.0
        for (z, m, valid, f), part in zip(batches, share):
            w = torch.softmax(f @ coef.T + bias, dim=1)  # questions x stages
            fused = torch.einsum("qs,qsn->qn", w, z) * log_tau.exp()
            fused = fused.masked_fill(~valid, -1e9)
            gold = torch.logsumexp(fused.masked_fill(~m, -1e9), 1)
            total = total + part * (torch.logsumexp(fused, 1) - gold).mean()
        value = total / sum(share) + l2 * (coef ** 2).sum()
        value.backward()
        return value

    opt.step(loss)
    return AdaptiveWeights(tuple(stages), coef.detach().numpy(), bias.detach().numpy(), mean, scale)


def fit_balanced(domains: dict[str, list], stages: tuple[str, ...], start: dict | None = None, eta: float = BALANCE,
                 rounds: int = 4) -> AdaptiveWeights:
    """`fit_rule` with the domains weighed by how far the rule trails each one's own best fixed fusion (its regret,
    in nDCG@10 points): after each fit, a domain's weight is multiplied by exp(eta * regret) (the multiplicative
    weights of group-robust fitting), so no kind of corpus is given up for the mean of the others."""
    best = {d: float(per_question(its, lambda s, w=fit_fixed({d: its}, stages): fuse(s, w)).mean())
            for d, its in domains.items()}
    weigh = dict.fromkeys(domains, 1.0)
    for i in range(rounds):
        rule = fit_rule(domains, stages, start=start, weigh=weigh)
        if i == rounds - 1:
            return rule
        regret = {d: max(best[d] - float(per_question(its, rule.fuse).mean()), 0.0) for d, its in domains.items()}
        weigh = {d: w * np.exp(eta * 100 * regret[d]) for d, w in weigh.items()}
        total = sum(weigh.values())
        weigh = {d: len(weigh) * w / total for d, w in weigh.items()}
    raise ValueError(f"rounds must be at least 1, got {rounds}")


# ------------------------------------------------------------------------- `endo calibrate-fusion`: into the profile

def domain_name(path: Path) -> str:
    """A signals file's domain: its name less the split (fit300 is HotpotQA's train split)."""
    stem = Path(path).name.split(".")[0]
    return {"fit300": "hotpotqa"}.get(stem, stem.removesuffix("_train"))


def fitted_entries(records: dict[str, list[dict]], share: float) -> dict:
    """The profile's entries fitted on {domain: records}: the hybrid first stage's (GPU and CPU) and each
    reranker's, each with its fixed weights (the rule's start, and what a caller who turns the rule off gets) and
    its adaptive rule. Where the records hold the dense pool's reads, the first stage's entries are fitted on both
    pools' reads merged ("union", "cpu_union"), as the pipeline then reads."""
    pooled = all("dense" in r and "cpu_dense" in r for rs in records.values() for r in rs)
    out = {}
    for entry, part in POOLED_PART.items():
        part = part if pooled else entry
        stages = PARTS[part]
        domains = {d: items(r, part) for d, r in records.items()}
        tables = GridTables(domains, stages)
        fixed, temperature = tables.fit()
        rule = fit_balanced(domains, stages, start=fixed)
        held = held_out(domains, stages, tables)
        keep = carried(held)
        fit = {"data": sorted(records), "n_questions": {d: len(r) for d, r in records.items()},
               "ndcg10": {d: {"fixed": round(100 * float(per_question(its, lambda s: fuse(s, fixed)).mean()), 1),
                              "adaptive": round(100 * float(per_question(its, rule.fuse).mean()), 1)}
                          for d, its in domains.items()},
               "objective": {"temperature": temperature, "of": "soft minimum over the domains of the gain over "
                             "the better first stage alone (nDCG@10 points); null: the mean nDCG@10"},
               "held_out": held, "rule": "adaptive" if keep else "fixed (the adaptive rule did not carry to a "
                                                                  "domain held out of its fit)"}
        out[entry] = {"fixed": fixed, "rule": rule if keep else None, "fit": fit,
                      "pools": ["hybrid", "dense"] if pooled else None}
    return out


def held_out(domains: dict[str, list], stages: tuple[str, ...], tables: GridTables | None = None
             ) -> dict[str, dict[str, float]]:
    """Each domain's nDCG@10 under the fixed fusion and the rule both fitted without it (the fixed fusion's
    objective chosen without it too), beside its better first stage alone: how each carries to a corpus no fit has
    seen, which is what decides whether the rule is shipped (`carried`)."""
    tables = tables or GridTables(domains, stages)
    out = {}
    for d, its in domains.items() if len(domains) > 1 else ():
        rest = {k: v for k, v in domains.items() if k != d}
        fixed = tables.fit(list(rest))[0]
        rule = fit_balanced(rest, stages, start=fixed)
        out[d] = {"fixed": round(100 * float(per_question(its, lambda s: fuse(s, fixed)).mean()), 1),
                  "adaptive": round(100 * float(per_question(its, rule.fuse).mean()), 1),
                  "first_stage_alone": round(tables.alone[d], 1)}
    return out


def carried(held: dict[str, dict[str, float]]) -> bool:
    """Whether the rule, fitted without each domain, served those domains better than the fixed fusion did: the
    worst-served of them no worse (its gain over the first stage alone) and their mean better."""
    if len(held) < 2:
        return False
    gains = {k: np.array([h[k] - h["first_stage_alone"] for h in held.values()]) for k in ("adaptive", "fixed")}
    return bool(gains["adaptive"].min() >= gains["fixed"].min() and gains["adaptive"].mean() > gains["fixed"].mean())


def write_entries(profile: dict, entries: dict, share: float, depths: dict[str, int]) -> dict:
    """`profile` with the fitted entries in place: `pipeline.first_stages.hybrid` (its `cpu` entry inside) made the
    model's first stage, and `reranker.minilm` / `reranker.bm25`."""
    pipeline = profile.setdefault("pipeline", {})
    hybrid = {"dense_share": share, "weights": entries["pipe"]["fixed"],
              "fit": entries["pipe"]["fit"] | {"depth": depths["pipe"]}}
    hybrid["cpu"] = {"dense_share": share, "weights": entries["cpu"]["fixed"],
                     "fit": entries["cpu"]["fit"] | {"depth": depths["cpu"]}}
    for name, entry in (("pipe", hybrid), ("cpu", hybrid["cpu"])):
        if entries[name].get("pools"):
            entry["pools"] = entries[name]["pools"]
        if entries[name]["rule"] is not None:
            entry["adaptive"] = entries[name]["rule"].to_json()
    pipeline.setdefault("first_stages", {})["hybrid"] = hybrid
    pipeline["first_stage"] = "hybrid"
    for part in ("minilm", "bm25"):
        fixed, rule = entries[part]["fixed"], entries[part]["rule"]
        profile.setdefault("reranker", {})[part] = {"first_stage": fixed["first_stage"], "heads": fixed["heads"],
                                                    "fit": entries[part]["fit"]} | (
            {"adaptive": rule.to_json()} if rule is not None else {})
    return profile


def run(args) -> dict:
    """Fit on the signals files given (`--signals`, one a domain's train split), or collect them first from
    labelled sets (`--data`, with the model), and write the entries into the model's profile."""
    start = time.perf_counter()
    files = [Path(f) for f in args.signals or []]
    if args.data:
        files += collect_specs(Backbone.of(args.model, device=args.device), args.data, Path(args.work))
    if not files:
        raise ValueError("Nothing to fit on: pass --signals FILE... (from a collection) or --data SPEC... (labelled "
                         "sets' train splits, read with the model).")
    records = {domain_name(f): load(f) for f in files}
    out = Path(args.out) if args.out else heads_profile_path(_backbone(args))
    profile = json.loads(out.read_text()) if out.exists() else {}
    entries = fitted_entries(records, SHARE)
    write_entries(profile, entries, SHARE, {"pipe": DEPTH, "cpu": CPU_DEPTH})
    profile["pipeline"]["first_stages"]["hybrid"]["fit"]["wall_s"] = round(time.perf_counter() - start, 1)
    write_json(profile, out)
    print(json.dumps({part: {"fixed": e["fixed"], "ndcg10": e["fit"]["ndcg10"]} for part, e in entries.items()}))
    return profile


def _backbone(args):
    return Backbone.of(args.model, device=args.device)


DEFAULT_PROFILE = "smollm2-135m-instruct.json"  # the default model's, fitted across labelled domains


def transferred(profile: dict) -> dict:
    """`profile` (a model's, prepared without labels) with the hybrid first stage and the rerankers' adaptive fusion
    fitted across labelled domains for the default model, where it has none of its own: the rule reads each stage's
    scores standardised over the candidates, not the model's raw attention, so it carries to another reader as a
    starting point; `endo calibrate-fusion` with the model fits its own. Needs the embedder (the dense stage)."""
    source = ASSETS / "heads" / DEFAULT_PROFILE
    shipped = json.loads(source.read_text())
    hybrid = ((shipped.get("pipeline") or {}).get("first_stages") or {}).get("hybrid")
    if not available() or not hybrid:
        return profile
    pipeline = profile.setdefault("pipeline", {})
    if "hybrid" not in (pipeline.get("first_stages") or {}):
        note = {"from": f"{source.name}: fitted across labelled domains for the default model (no labels here)"}
        entry = {k: v for k, v in hybrid.items() if k != "fit"} | {"fit": note}
        if "cpu" in entry:
            entry["cpu"] = {k: v for k, v in entry["cpu"].items() if k != "fit"} | {"fit": note}
        pipeline.setdefault("first_stages", {})["hybrid"] = entry
        pipeline["first_stage"] = "hybrid"
    for name, rerank in (shipped.get("reranker") or {}).items():
        profile.setdefault("reranker", {}).setdefault(name, {k: v for k, v in rerank.items() if k != "fit"})
    return profile
