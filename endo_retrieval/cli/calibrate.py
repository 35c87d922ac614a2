"""`endo train-sae`, `endo train-phi`, `endo calibrate-ilre|heads|pipeline|fusion`: each command's arguments; its
work is the calibration module's `run(args)`."""
from __future__ import annotations

import argparse
from dataclasses import asdict

from endo_retrieval.calibration import fusion_rule, heads, ilre, pipeline, train_phi, train_sae
from endo_retrieval.cli.commands import int_list, model_argument
from endo_retrieval.methods.ilre import POSITIONS

def train_sae_add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    model_argument(parser)
    parser.add_argument("--corpus", default=str(train_sae.DEFAULT_DATA / "valid.txt"),
                        help="training text file or folder")
    parser.add_argument("--heldout", default=str(train_sae.DEFAULT_DATA / "test.txt"),
                        help="held-out text for FVU and chunk stability (never trained on); 'none' to skip")
    parser.add_argument("--layers", default="auto", help="comma-separated layer indices, e.g. 0,7,15,23,29 (default "
                        "auto: the default model's 3, 11, 19 of 30 layers, scaled to the model's depth)")
    parser.add_argument("--out", default=None, help="output folder: card.json, layer_XX/, vectors/, checkpoints/ "
                        "(default: where the model's SAEs are looked for, so index and query find them)")
    parser.add_argument("--max-tokens", type=int, default=None, help="cap on training tokens (quick CPU runs)")
    parser.add_argument("--heldout-tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=train_sae.TrainConfig.steps)
    parser.add_argument("--expansion", type=int, default=train_sae.DEFAULT_EXPANSION,
                        help="d_latent = expansion * head_dim")
    parser.add_argument("--k", type=int, default=train_sae.DEFAULT_K)
    parser.add_argument("--batch-size", type=int, default=train_sae.TrainConfig.batch_size)
    parser.add_argument("--chunk-size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoints in OUT")
    parser.add_argument("--fit", choices=train_sae.FITS, default="keys",
                        help="vectors to train on: 'keys' (the paper, section 3.3) or 'keys+queries' (as many "
                             "queries as keys, drawn at random: one codebook that also reconstructs the queries of "
                             "[S3 Eq. 6]; measured on dev30 it reconstructs queries well but S3 retrieval collapses, "
                             "see the README)")
    parser.add_argument("--stability-tokens", type=int, default=8192,
                        help="held-out tokens for the chunk-stability table (S3 Table 9); 0 to skip")
    return parser


def train_phi_add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    model_argument(parser)
    parser.add_argument("--corpus", default=str(train_phi.DEFAULT_DATA), help="training text file or folder of *.txt")
    parser.add_argument("--out", default=None, help="output folder: card.json + phi.safetensors (default: where "
                        "the model's maps ship, endo_retrieval/assets/phi/<model>/, which phi='default' loads)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--layers", default="all", help="comma-separated layer indices, or 'all'")
    parser.add_argument("--length", type=int, default=1024, help="prefill length the maps will serve")
    parser.add_argument("--windows", type=int, default=16, help="text windows of --length tokens to log")
    parser.add_argument("--queries", type=int, default=32, help="logged queries at the end of each window")
    parser.add_argument("--d-phi", type=int, default=64, help="features per map")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=4, help="windows per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    for name, value in asdict(train_phi.DistillLoss()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=value, help="appendix B")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def ilre_add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default=str(ilre.DEFAULT_FILLER),
                        help="a folder of .txt filler for the passkey task (default: %(default)s), or a "
                             "HotpotQA-layout .json for the evidence task (the share of gold sentences kept)")
    parser.add_argument("--limit", type=int, default=100, help="evidence task: first N questions (default 100)")
    model_argument(parser)
    parser.add_argument("--lengths", default="8192", help="context lengths in tokens, e.g. 8192,32768")
    parser.add_argument("--layers", default="all",
                        help="candidate layers, e.g. all or 0-14 (default: all, those without a sliding window)")
    parser.add_argument("--key-lengths", default="8,32", help="passkey lengths in digits (default: %(default)s)")
    parser.add_argument("--depths", type=int, default=ilre.N_SEGMENTS,
                        help="how many of the 20 segment starts to use, evenly spread (default: all 20)")
    parser.add_argument("--budget", type=int, default=1024, help="token budget (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--positions", choices=POSITIONS, default="frame",
                        help="RoPE layout of the prefill: frame (default), dca [ILRe Eq. 6-7] or absolute (no DCA); "
                             "other than frame needs --out, so the shipped profile stays as calibrated")
    parser.add_argument("--out", default=None, help="profile JSON (default: where ILRe looks for the model's profile)")
    parser.add_argument("--plot", default=None, help="PNG of recall per layer (default: beside the profile)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def heads_add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", action="append", default=None,
                   help=f"labelled data: a HotpotQA-layout .json (default {heads.DEFAULT_DATA}); repeat to add more")
    p.add_argument("--context-tokens", type=int, nargs="+", default=[4096, 8192], help="haystack lengths")
    p.add_argument("--budgets", type=int, nargs="+", default=None,
                   help="budget per haystack length for the fusion fit (default: an eighth of each length)")
    p.add_argument("--limit", type=int, default=None, help="first N items of each file")
    p.add_argument("--distractors", default=str(heads.DEFAULT_DISTRACTORS),
                   help="a folder of WikiText-style .txt files whose paragraphs, with the other questions', are the "
                        "distractors (the most question-like first); 'none': other questions' paragraphs only, as "
                        "the quality bench builds haystacks")
    p.add_argument("--heads", type=int, default=None, help="heads to keep (default: the best of 4, 8, 12, 16)")
    p.add_argument("--top", type=int, default=10, help="a head scores the share of gold in its top N sentences")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None,
                   help="a GGUF file, a Hugging Face folder or hub id (default: the embedded model)")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="profile path (default: the model's shipped profile)")
    p.add_argument("--dump", default=None, help=argparse.SUPPRESS)  # .npz of the labelled tables (analysis)


def pipeline_add_arguments(p: argparse.ArgumentParser) -> None:

    p.add_argument("--data", required=True, action="append",
                   help="HotpotQA-layout JSON with gold supporting facts (e.g. fit300.json); with --first-stage, "
                        "repeat it for each set to fit on (a BEIR-layout PATH:SPLIT too, e.g. SciFact's train)")
    p.add_argument("--limit", type=int, default=None, help="first N questions (the corpus is every paragraph)")
    p.add_argument("--first-stage", choices=("hybrid", "dense"), default=None,
                   help="fit that first stage's entry (its dense share and fusion weights, at the model's fitted "
                        "depth and reading) on every --data set and make it the model's default")
    p.add_argument("--depths", type=int_list, default=[10, 20, 30], help="candidate depths to try (default 10,20,30)")
    p.add_argument("--read-tokens", type=int_list, default=[64, 128, 256],
                   help="tokens read per candidate to try (default 64,128,256)")
    p.add_argument("--orders", nargs="+", choices=list(pipeline.ORDERS), default=list(pipeline.ORDERS))
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="profile to update (default: the model's heads profile)")
    p.add_argument("--dump", default=None, help="also write every question's stage scores here (.npz)")
    p.add_argument("--cpu", action="store_true",
                   help="fit the profile's CPU entry (`pipeline.cpu`, what a CPU backbone reads by default) instead "
                        "of its main setting: the fusion near the best that skips the second hop where the fit "
                        "cannot tell that it pays (on a CPU its forward costs about a fifth of a question)")
    model_argument(p)


def pipeline_run(args):
    if args.first_stage:
        return pipeline.run_first_stage(args)
    if len(args.data) > 1:
        raise ValueError("One --data set fits the depth, reading and BM25 weights; several are for --first-stage.")
    args.data = args.data[0]
    return pipeline.run(args)


def fusion_add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--signals", nargs="+", default=[], metavar="FILE",
                   help="signals files to fit on, one a domain's train split (written by an earlier --data run, or "
                        "by `python -m endo_retrieval.calibration.signals`)")
    p.add_argument("--data", nargs="+", default=[], metavar="SPEC[@N]",
                   help="labelled sets to read with the model first: a HotpotQA JSON file or a BEIR-layout "
                        "PATH:SPLIT (e.g. scifact.json.gz:train), its first N questions with @N; one a domain")
    p.add_argument("--work", default="endo-fusion-signals", help="folder for the signals --data collects")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="profile to update (default: the model's heads profile)")
    model_argument(p)


def fusion_run(args):
    return fusion_rule.run(args)


train_sae_run, train_phi_run, ilre_run, heads_run = train_sae.run, train_phi.run, ilre.run, heads.run
ARGUMENTS = {"train-sae": train_sae_add_arguments, "calibrate-ilre": ilre_add_arguments}


def command_args(command: str, argv: list[str]) -> argparse.Namespace:
    """Another command's arguments, as its own parser reads them (its defaults for the rest)."""
    p = argparse.ArgumentParser()
    ARGUMENTS[command](p)
    return p.parse_args(argv)
