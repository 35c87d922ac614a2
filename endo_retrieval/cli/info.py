"""`endo info`: the model, its device and cache and the artefacts made for it (loading the model), or with DIR an
index as it answers now (read from the folder alone, without the model)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from endo_retrieval.calibration.prepare import ready_methods
from endo_retrieval.cli.commands import engine, model_argument
from endo_retrieval.cli.saved import read_saved
from endo_retrieval.files import set_aside
from endo_retrieval.model.profiles import MAKERS, heads_profile, heads_profile_path, ilre_profile, sae_card


def info_add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("index", nargs="?", metavar="DIR", help="an index folder: say what it answers as now (model, "
                   "method, committed generation, documents, passages, bytes), read without loading the model")
    p.add_argument("--documents", action="store_true", help="with DIR: list its document ids, one a line")
    p.add_argument("--json", action="store_true", help="print JSON: model, model_hash, layers, device, cache_dir, "
                   "families, sae, ilre, heads and ready (with DIR: index, model, model_hash, method, generation, "
                   "documents, passages, tokens, bytes and leftovers)")
    model_argument(p)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")


def first_stage_lines(pipeline: dict) -> list[str]:
    """`endo info`'s line on the model's first stage: the hybrid's dense share and how its scores are fused."""
    name = pipeline.get("first_stage") or "bm25"
    entry = (pipeline.get("first_stages") or {}).get(name)
    if not isinstance(entry, dict):
        return [f"  stage 1    {name}"]
    weights = ", ".join(f"{k} {v:g}" for k, v in (entry.get("weights") or {}).items() if isinstance(v, (int, float)))
    rule = "adaptive per question (scoring/adaptive.py), else " if entry.get("adaptive") else ""
    return [f"  stage 1    {name}, dense share {entry.get('dense_share')}; fusion {rule}{weights}"]


def info_run(args) -> int:
    if args.index is not None:
        return info_index_run(args)
    heavy = engine()
    bb = heavy.Backbone(args.model, device=args.device)
    heads = heads_profile(bb)
    if heads:  # the chosen heads, the fused weights and the corpus pipeline's settings; the per-head scores and the
        # pipeline's fit table stay in the profile (and its plot)
        pipeline = {k: ({kk: vv for kk, vv in v.items() if kk != "fit"} if k == "cpu" else v)
                    for k, v in (heads.get("pipeline") or {}).items() if k != "fit"} or None
        heads = {k: heads[k] for k in ("heads", "fusion", "recall_by_count", "context_tokens", "budgets") if k in heads}
        heads["pipeline"] = pipeline
    data = {**bb.info(), "families": list(heavy.SUPPORTED_FAMILIES), "sae": sae_card(bb), "ilre": ilre_profile(bb),
            "heads": heads, "ready": ready_methods(bb)}
    if args.json:
        print(json.dumps(data, indent=2))
    else:  # a short summary: each artefact's headline figures (--json: all of it)
        print("\n".join(model_summary(bb.info(), data, heads_profile(bb), str(heads_profile_path(bb)))))
    return 0


def model_summary(model: dict, data: dict, heads: dict | None, heads_path: str | None = None) -> list[str]:
    """`endo info`'s lines without --json: the model and its shape, the device, the cache, the methods it is ready
    for, and each artefact's headline figures (`heads`: the whole heads profile, for its pipeline and reranker
    fits; `data`: what --json prints). A figure a profile lacks is left out, never an error."""
    def num(x, digits: int = 3) -> str:
        return f"{x:.{digits}f}" if isinstance(x, (int, float)) and not isinstance(x, bool) else "?"

    def recalls(r) -> str:
        r = r if isinstance(r, dict) else {}
        at = [k for k in ("@2", "@5", "@10") if k in r]
        return f"recall{'/'.join(at)} {'/'.join(num(r[k]) for k in at)}" if at else ""

    def none(kind: str) -> str:
        return f"none (make it with `{MAKERS[kind][0]}`, or `endo prepare`)"

    window = model.get("max_position")
    lines = [f"{model.get('model')} ({model.get('family')} family, hash {str(model.get('model_hash'))[:12]})",
             f"  shape      {model.get('layers')} layers, {model.get('heads')} heads ({model.get('kv_heads')} KV, "
             f"head_dim {model.get('head_dim')})" + (f", window {window:,} tokens" if isinstance(window, int) else ""),
             f"  device     {model.get('device')} ({model.get('dtype')})",
             f"  cache      {model.get('cache_dir')}",
             f"  families   {', '.join(data.get('families') or [])}",
             f"  ready      {', '.join(data.get('ready') or []) or 'bm25'}",
             "artefacts"]
    if heads:
        chosen = [tuple(h) for h in heads.get("heads") or []]
        layers = sorted({layer for layer, _ in chosen})
        lines.append(f"  heads      {len(chosen)} retrieval heads in layers {layers[0]}-{layers[-1]}" if layers
                     else "  heads      none listed")
        fusion = heads.get("fusion") or {}
        weights = ", ".join(f"{k} {v:g}" for k, v in (fusion.get("weights") or {}).items()
                            if isinstance(v, (int, float)) and v)
        single = {k: v for k, v in (fusion.get("single") or {}).items() if isinstance(v, (int, float))}
        if weights:
            best = max(single.items(), key=lambda kv: kv[1]) if single else None
            lines.append(f"  context    one-context fusion {weights}: recall {num(fusion.get('recall'))}"
                         + (f" ({best[0]} alone {num(best[1])})" if best else ""))
        pipeline = heads.get("pipeline") or {}
        if pipeline:
            cpu, fit = pipeline.get("cpu") or {}, pipeline.get("fit") or {}
            line = f"  pipeline   depth {pipeline.get('depth')}, read_tokens {pipeline.get('read_tokens')}"
            if cpu:
                line += f" (CPU: depth {cpu.get('depth')}, read_tokens {cpu.get('read_tokens')})"
            if recalls(fit.get("recall")):
                line += f"; {recalls(fit.get('recall'))} on {fit.get('data', 'its fit data')}"
            lines.append(line)
            lines += first_stage_lines(pipeline)
        for stage, entry in sorted((heads.get("reranker") or {}).items()):
            if isinstance(entry, dict):
                fit = entry.get("fit") or {}
                at5 = (fit.get("recall") or {}).get("@5")
                alone = (fit.get("first_stage_alone") or {}).get("@5")
                rule = "adaptive fusion, else " if entry.get("adaptive") else ""
                lines.append(f"  reranker   after {stage}: {rule}weights {entry.get('first_stage')} first stage, "
                             f"{entry.get('heads')} heads" + (f"; recall@5 {num(at5)}" if at5 is not None else "")
                             + (f" ({stage} alone {num(alone)})" if alone is not None else ""))
        if heads_path:
            lines.append(f"  profile    {heads_path}")
    else:
        lines.append(f"  heads      {none('heads')}")
    sae = data.get("sae")
    if sae:
        layers, fvu = sae.get("layers") or [], sae.get("fvu_k") or {}
        lines.append(f"  sae        layers {', '.join(map(str, layers))}: {sae.get('d_latent')} latents, "
                     f"top-{sae.get('k')}" + (f"; key FVU {', '.join(num(fvu.get(str(l), fvu.get(l))) for l in layers)}"
                                              if fvu else ""))
    else:
        lines.append(f"  sae        {none('sae')}")
    ilre = data.get("ilre")
    if ilre:
        layer = ilre.get("layer")
        recall = (ilre.get("recall") or {}).get(str(layer))
        lines.append(f"  ilre       layer {layer}" + (f" (calibration recall {num(recall, 2)})" if recall is not None
                                                       else ""))
    else:
        lines.append(f"  ilre       {none('ilre')}")
    lines.append("all of it: endo info --json")
    return lines


# ---- endo info DIR ----------------------------------------------------------------------------------------------
def index_info(folder: Path, documents: bool = False) -> dict:
    """What the index in `folder` answers as now, read without the model: its committed generation, documents,
    passages and size, and the leftovers of a killed write. ValueError saying what to do where there is no index
    or it is damaged."""
    saved = read_saved(folder, passages=True)
    meta, corpus = saved.meta, saved.corpus
    served = folder if folder.exists() else set_aside(folder)  # mid-swap, or killed there: the old state
    info = {"index": str(folder), "model": meta.get("model"), "model_hash": meta.get("model_hash"),
            "method": meta.get("method"), "generation": meta.get("generation", 0)}
    if corpus is not None:
        info |= {"documents": len(corpus),
                 "passages": len(saved.passages),
                 "tokens": corpus.n_tokens, "named_under": naming(corpus)}
        ids = [d.doc_id for d in corpus.documents()]
    else:  # a manifest of segments (`endo index --ray`)
        parts = meta["segments"] if isinstance(meta["segments"], list) else []
        ids = [i for p in parts for i in p.get("documents", [])]
        info |= {"documents": len(ids), "passages": None, "tokens": sum(p.get("tokens", 0) for p in parts)}
    info["bytes"] = sum(f.stat().st_size for f in served.rglob("*") if f.is_file())
    leftovers = [set_aside(folder)] + sorted(folder.parent.glob(f".{folder.name}.tmp-*"))
    info["leftovers"] = [p.name for p in leftovers if p.exists()]
    if documents:
        info["document_ids"] = ids
    return info


def info_index_run(args) -> int:
    """`endo info DIR`: a short summary, or --json; --documents lists the ids."""
    info = index_info(Path(args.index), args.documents)
    if args.json:
        print(json.dumps(info, indent=2, ensure_ascii=False))
        return 0
    if args.documents:
        print("\n".join(info["document_ids"]))
        return 0
    rows = {"index": info["index"], "model": f"{info['model']} ({str(info['model_hash'])[:12]})",
            "method": info["method"], "generation": f"{info['generation']} (committed)",
            "documents": f"{info['documents']:,}", "passages": f"{info['passages']:,}" if info["passages"] is not None
            else "- (an index in segments)", "tokens": f"{info['tokens']:,}", "bytes": f"{info['bytes']:,} on disk"}
    if info.get("named_under") is not None:
        rows["ids"] = naming_line(info["named_under"])
    for key, value in rows.items():
        print(f"{key:>10}: {value}")
    if info["leftovers"]:
        print(f"{'note':>10}: an unfinished write (killed, or still running) left {', '.join(info['leftovers'])}; "
              "the generation above is what is committed, and the next write removes what a killed one left")
    return 0


def naming(corpus) -> dict[str, int]:
    """How the index names its documents: folder -> how many are named by their path under it ("" for those named
    otherwise: given from Python, or absolute paths)."""
    counts: dict[str, int] = {}
    for d in corpus.documents():
        root = document_root_of(d.doc_id, d.metadata.get("path"))
        counts[str(root) if root else ""] = counts.get(str(root) if root else "", 0) + 1
    return counts


def naming_line(named: dict[str, int]) -> str:
    """`endo info DIR`'s line on how documents are named: the folders their ids are paths under."""
    if not named:
        return "- (no documents)"
    parts = [(f"paths under {root}" if root else "given ids or absolute paths") + (f" ({n:,})" if len(named) > 1
                                                                                   else "")
             for root, n in sorted(named.items(), key=lambda kv: -kv[1])]
    return "; ".join(parts)


def document_root_of(doc_id: str, path: str | None) -> Path | None:
    """The folder a file's document is named under (its path less its id), or None where the id is not a path under
    a folder (an absolute path, a name given from Python)."""
    if not isinstance(path, str) or doc_id.startswith("/") or not path.endswith("/" + doc_id):
        return None
    return Path(path[:-len(doc_id) - 1] or "/")


def summary(documents: int, passages: int, tokens: int, on_disk: int, method: str,
            postings: tuple[int, int] | None = None) -> str:
    """`index_summary`'s words: `postings` (their count, their bytes) where the index holds S3 feature postings."""
    holds = [f"{documents:,} documents", f"{passages:,} passages", f"{tokens:,} tokens"]
    if postings:
        holds.append(f"{postings[0]:,} postings ({postings[1] / max(postings[0], 1):.2f} bytes/posting)")
    return f"{', '.join(holds)}, {on_disk:,} bytes on disk (method {method})"
