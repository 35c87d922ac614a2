"""The CPU backbone's number format: bf16 where the CPU's flags name a bf16 unit, fp32 elsewhere, ENDO_CPU_DTYPE
over both; a bf16 backbone never takes the int8 path (it quantizes fp32 maps) and still reads with the default
pipeline."""
from __future__ import annotations

import pytest
import torch

from endo_retrieval.model.threads import cpu_dtype, cpu_has_bf16


def cpuinfo(tmp_path, flags: str):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\n")
    return path


def test_bf16_only_where_the_cpu_has_bf16_units(tmp_path, monkeypatch):
    monkeypatch.delenv("ENDO_CPU_DTYPE")
    assert cpu_has_bf16(cpuinfo(tmp_path, "avx512f avx512_bf16")) and cpu_dtype(cpuinfo(tmp_path, "amx_bf16")) == \
        "bfloat16"
    assert cpu_dtype(cpuinfo(tmp_path, "avx2 avx512f")) == "float32"  # bf16 emulated: slower than fp32
    assert cpu_dtype(tmp_path / "absent") == "float32"
    monkeypatch.setenv("ENDO_CPU_DTYPE", "float32")
    assert cpu_dtype(cpuinfo(tmp_path, "avx512_bf16")) == "float32"
    monkeypatch.setenv("ENDO_CPU_DTYPE", "half")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_dtype()


def test_a_bf16_cpu_backbone_skips_int8_and_reads(monkeypatch):
    """The default model as a CPU with bf16 units loads it: the default pipeline ranks the passage that answers
    first, and the question forwards of S3 go bf16, not int8."""
    from endo_retrieval import Backbone
    from endo_retrieval.model.locate import BackboneError
    from endo_retrieval.methods.search import Document, EndoIndex

    monkeypatch.setenv("ENDO_CPU_DTYPE", "bfloat16")
    bb = Backbone(device="cpu")
    assert bb.dtype == torch.bfloat16 and bb.info()["dtype"] == "bfloat16"
    with pytest.raises(BackboneError, match="int8 layers quantize fp32"):
        bb.query_states("Who drew the quay?", [0], int8=True)
    index = EndoIndex(bb, method="endo")
    assert index.int8_queries is False
    towns = ["Saltmarsh", "Greywater", "Brightmoor", "Ravensholt", "Whitcombe", "Linden"]
    index.add_documents([Document(t, f"{t} is a market town. Its harbour was rebuilt in {1900 + 7 * i} by the "
                                     f"engineer {n}.") for i, (t, n) in enumerate(zip(towns, ["Merrow", "Calder",
                                     "Thornbury", "Penhallow", "Wrenfield", "Marlow"]))])
    hits = index.search("Which engineer rebuilt the harbour of Ravensholt?", k=2)
    assert "Ravensholt" in index.corpus.span_text(hits[0].start, hits[0].end)[0]
