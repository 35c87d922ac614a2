"""`endo demo`: the main job on the embedded default model."""
from __future__ import annotations

QUESTION = "What is the capital of France?"


def add_arguments(parser) -> None:
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")


def run(args) -> int:
    from endo_retrieval import Backbone

    print("endo demo (foundation stage): the retrieval pipeline has not landed yet; this only loads the local "
          "model and answers one built-in question.")
    bb = Backbone(device=args.device)
    print(f"model: {bb.model_id} ({bb.n_layers} layers) on {bb.device.type}")
    print(f"Q: {QUESTION}\nA: {bb.generate(QUESTION, max_new_tokens=24)}")
    return 0
