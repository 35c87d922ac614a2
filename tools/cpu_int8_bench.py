"""`endo bench corpus` with the default pipeline reading through int8 linear maps on the CPU, for the quality and
time of that read (docs/results.md, "Trading recall for time").

    INT8=all python tools/cpu_int8_bench.py bench corpus --data ../shared/data/hotpotqa/dev300.json --limit 100 \
        --systems endo,llamaindex-bm25 --out bench/results/perf/cpu_int8_all_dev100.json
INT8=all: every linear map of the read in int8 (`EndoPipeline(int8=True)`); INT8=mlp: only the MLP's maps (not a
product option: the attention's projections stay fp32, to see whether the loss is theirs).
"""
import copy
import os
import sys
import warnings

import torch

from endo_retrieval.cli import main
from endo_retrieval.methods import pipeline
from endo_retrieval.model import capture

mode = os.environ.get("INT8", "all")
if mode not in ("all", "mlp"):
    sys.exit(f"INT8 must be all or mlp, got {mode!r}")
post_init = pipeline.EndoPipeline.__post_init__


def int8_post_init(self):
    self.int8 = True
    post_init(self)


def mlp_int8_layers(self, last_layer: int) -> list:
    """`Capture.int8_layers` with only each layer's MLP quantized."""
    done = self.int8_twins
    if len(done) <= last_layer:
        more = [copy.deepcopy(layer) for layer in self.model.model.layers[len(done): last_layer + 1]]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for layer in more:
                layer.mlp = torch.ao.quantization.quantize_dynamic(layer.mlp, {torch.nn.Linear}, dtype=torch.qint8)
        self.int8_twins = done + more
    return self.int8_twins


pipeline.EndoPipeline.__post_init__ = int8_post_init
if mode == "mlp":
    capture.Capture.int8_layers = mlp_int8_layers
sys.exit(main())
