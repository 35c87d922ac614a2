"""The GPU watchdog (model/watchdog.py), forced onto the CPU: a stalled question's work becomes a GPUStallError
within its timeout, naming the device and what to do; work in time comes back unchanged, errors included."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from endo_retrieval.model import watchdog
from endo_retrieval.model.watchdog import GPUStallError, Watchdog

SLACK_S = 1.0  # thread hand-over and the error's message, on a busy 2-core CPU


def settle() -> None:
    """Wait until every stalled work released has ended (the next run on its device would fail at once)."""
    for ended, _ in list(watchdog._stalled.values()):
        assert ended.wait(10)


@pytest.fixture
def stall():
    """An event the stalled work waits on, set after the test so its worker ends."""
    release = threading.Event()
    yield release
    release.set()
    settle()


def test_a_stall_raises_within_the_timeout_naming_the_device_and_what_to_do(stall):
    dog = Watchdog("cpu", timeout_s=0.3, force=True)
    t0 = time.monotonic()
    with pytest.raises(GPUStallError) as caught:
        dog.run(stall.wait, 30)
    waited = time.monotonic() - t0
    assert 0.3 <= waited < 0.3 + SLACK_S
    message = str(caught.value)
    assert "on cpu stalled" in message and "0.3 s" in message and "ENDO_GPU_TIMEOUT_S" in message
    assert "not looked up (cpu is not a CUDA device)" in message
    assert "fewer workers" in message and "CUDA MPS" in message and "Several workers on one GPU" in message
    assert isinstance(caught.value, TimeoutError)
    # the stalled work still holds the device: the next question fails at once, then runs once it ended
    t0 = time.monotonic()
    with pytest.raises(GPUStallError, match="earlier question's GPU work on cpu has been stalled"):
        dog.run(lambda: 1)
    assert time.monotonic() - t0 < SLACK_S
    stall.set()
    settle()
    assert dog.run(lambda: 2) == 2


def test_work_in_time_returns_unchanged_with_the_callers_torch_mode():
    dog = Watchdog("cpu", timeout_s=5, force=True)
    payload = {"a": [1, 2]}
    assert dog.run(lambda x, key: (x, key), payload, key=3)[0] is payload
    with torch.inference_mode():
        assert dog.run(torch.is_inference_mode_enabled) is True
    with torch.no_grad():
        assert dog.run(torch.is_grad_enabled) is False
    assert dog.run(torch.is_grad_enabled) is True
    with pytest.raises(KeyError, match="missing"):  # the work's own error, as it is
        dog.run({}.__getitem__, "missing")


def test_off_where_not_forced_or_zero(monkeypatch, stall):
    here = threading.get_ident()
    assert Watchdog("cpu", timeout_s=0.1).run(threading.get_ident) == here  # a CPU: the caller's own thread
    monkeypatch.setenv("ENDO_GPU_TIMEOUT_S", "0")
    assert Watchdog("cpu", force=True).run(threading.get_ident) == here
    monkeypatch.setenv("ENDO_GPU_TIMEOUT_S", "0.2")
    with pytest.raises(GPUStallError, match="within 0.2 s"):
        Watchdog("cpu", force=True).run(stall.wait, 30)
    monkeypatch.setenv("ENDO_GPU_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="ENDO_GPU_TIMEOUT_S must be seconds"):
        Watchdog("cpu", force=True).run(lambda: 1)
    with pytest.raises(ValueError, match="seconds >= 0"):
        Watchdog("cpu", timeout_s=-1, force=True).run(lambda: 1)


def test_nvidia_smi_lines_name_the_other_processes_on_that_gpu():
    out = ("4242, /usr/bin/python3, 1234, GPU-aaa\n"
           "4243, python3, 980, GPU-bbb\n"
           "No running processes found\n")
    assert watchdog.parse_smi(out, "GPU-aaa") == [(4242, "python3", "1234")]
    assert len(watchdog.parse_smi(out, None)) == 2


def test_without_nvml_or_nvidia_smi_the_message_says_so(monkeypatch):
    def no_nvml(*_):
        raise ImportError("pynvml")

    monkeypatch.setattr(watchdog, "nvml_processes", no_nvml)
    monkeypatch.setattr(watchdog.shutil, "which", lambda _: None)
    monkeypatch.setattr(watchdog, "gpu_uuid", lambda _: None)
    assert "neither nvidia-ml-py (pynvml) nor nvidia-smi" in watchdog.other_processes(torch.device("cuda:0"))
    monkeypatch.setattr(watchdog.shutil, "which", lambda _: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(watchdog, "smi_processes", lambda _: [(4242, "python3", "1234"), (1, "me", "?")])
    monkeypatch.setattr(watchdog.os, "getpid", lambda: 1)
    assert watchdog.other_processes(torch.device("cuda:0")) == "pid 4242 (python3, 1234 MiB)"


def test_a_lookup_that_hangs_does_not_hold_the_error_back(monkeypatch):
    monkeypatch.setattr(watchdog, "LOOKUP_S", 0.1)
    hang = threading.Event()
    assert "did not answer within 0.1 s" in watchdog.bounded(lambda _: hang.wait(5), None)
    hang.set()


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    from conftest import make_tiny_model

    from endo_retrieval import Backbone
    from endo_retrieval.corpus import CorpusMap
    from endo_retrieval.index.passages import Passages

    bb = Backbone(make_tiny_model("llama", tmp_path_factory.mktemp("watchdog"), layers=2), device="cpu")
    corpus = CorpusMap()
    for i, text in enumerate(["The Varna bridge was built in 1871. Workers found quartz under its piers.",
                              "Quartz is a hard mineral made of silicon and oxygen.",
                              "A mill on the river grinds wheat. The miller sells flour in Varna."]):
        corpus.add_document(f"d{i}", text, bb.encode(text).offsets)
    return bb, corpus, Passages.build(corpus)


def test_a_pipeline_question_runs_under_the_watchdog_and_its_stall_raises(tiny_corpus, monkeypatch, stall):
    from endo_retrieval.methods import pipeline as pipeline_module
    from endo_retrieval.methods.pipeline import EndoPipeline

    bb, corpus, passages = tiny_corpus
    settings = dict(heads=[(0, 0), (1, 3)], weights={"bm25": 0.5, "heads": 0.5}, first_stage="bm25")
    question = "Which mineral was found under the Varna bridge?"
    plain = EndoPipeline(bb, **settings, watchdog=Watchdog("cpu", timeout_s=0))
    guarded = EndoPipeline(bb, **settings, watchdog=Watchdog("cpu", timeout_s=30, force=True))
    hits = [p.passage_hits(corpus, passages, question, k=3) for p in (plain, guarded)]
    assert [(h.doc_id, h.score) for h in hits[0]] == [(h.doc_id, h.score) for h in hits[1]] and len(hits[0]) == 3

    read = pipeline_module.read_passages
    monkeypatch.setattr(pipeline_module, "read_passages", lambda *a, **kw: (stall.wait(30), read(*a, **kw))[1])
    guarded.watchdog.timeout_s = 0.3
    t0 = time.monotonic()
    with pytest.raises(GPUStallError, match="on cpu stalled"):
        guarded.passage_hits(corpus, passages, question, k=3)
    assert time.monotonic() - t0 < 0.3 + SLACK_S
