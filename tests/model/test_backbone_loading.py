"""Naming a model: a Hugging Face hub id loads from the hub's own cache (offline here: no test touches the network)
and fails at once, saying what to do, when the model is not there; a GGUF file says once that it is converted."""
import shutil
import time

import httpx
import pytest
import torch
from huggingface_hub import HfApi

from endo_retrieval.model.backbone import Backbone, ModelNotFoundError, default_gguf, is_hub_id

from conftest import make_tiny_model
from gguf_writer import write_gguf

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("tiny") / "model", layers=2)


@pytest.fixture
def no_network(monkeypatch):
    """Any question to the hub fails the test: with HF_HUB_OFFLINE set, none may be asked."""
    def asked(*args, **kwargs):
        raise AssertionError("the hub was asked although HF_HUB_OFFLINE is set")

    monkeypatch.setattr(HfApi, "repo_info", asked)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def lay_out_hub_cache(cache, repo: str, folder, ref: str = "main", sha: str = SHA):
    """What a download by transformers leaves in the hub cache: refs/<ref> naming a snapshot folder of the files."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = shutil.copytree(folder, root / "snapshots" / sha)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(sha)
    return snapshot


def test_a_hub_id_loads_from_the_hub_cache(tiny_folder, tmp_path, monkeypatch, no_network):
    cache = tmp_path / "hub"
    snapshot = lay_out_hub_cache(cache, "owner/tiny", tiny_folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))  # set after huggingface_hub read it at import
    bb = Backbone("owner/tiny", device="cpu")
    assert bb.folder == snapshot and bb.model_id == "owner/tiny" and bb.source == "owner/tiny"
    ids = torch.randint(10, 1000, (1, 16))
    with torch.inference_mode():
        torch.testing.assert_close(bb.model(ids).logits, Backbone(tiny_folder, device="cpu").model(ids).logits)

    # another revision with the same config and weights (and another stray file) is the same model, found through
    # HF_HOME when HF_HUB_CACHE is unset
    other = lay_out_hub_cache(cache, "owner/tiny", tiny_folder, ref="v2", sha="f" * 40)
    (other / "vocab.json").write_text("{}")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    again = Backbone("owner/tiny@v2", device="cpu")
    assert again.folder == other and again.model_hash == bb.model_hash
    assert Backbone.of("owner/tiny@v2", "cpu") is Backbone.of("owner/tiny@v2", "cpu")


def test_an_uncached_hub_id_fails_at_once_offline(tmp_path, monkeypatch, no_network):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    start = time.perf_counter()
    with pytest.raises(ModelNotFoundError) as e:
        Backbone("owner/absent")
    assert time.perf_counter() - start < 5
    message = str(e.value)
    assert "owner/absent" in message and str(cache / "models--owner--absent") in message
    assert "HF_HUB_OFFLINE" in message and "Backbone('path/to/model.gguf')" in message


def test_an_unreachable_hub_falls_back_to_the_cache(tiny_folder, tmp_path, monkeypatch):
    timeouts = []

    def unreachable(*args, timeout=None, **kwargs):
        timeouts.append(timeout)
        raise httpx.ConnectTimeout("no answer")

    monkeypatch.setattr(HfApi, "repo_info", unreachable)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=r"the hub could not be reached \(ConnectTimeout\)"):
        Backbone("owner/absent")
    assert len(timeouts) == 1 and timeouts[0] > 0  # asked once, with a timeout; not again without one
    snapshot = lay_out_hub_cache(tmp_path, "owner/tiny", tiny_folder)
    assert Backbone("owner/tiny", device="cpu").folder == snapshot


def test_which_names_are_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("Qwen/Qwen2.5-1.5B-Instruct") and is_hub_id("Qwen/Qwen2.5-1.5B-Instruct@refs/pr/1")
    for name in ("a/b/c", "name", "owner/name@", "models/model.gguf", "owner/bad name"):
        assert not is_hub_id(name), name
    (tmp_path / "owner" / "name").mkdir(parents=True)
    assert not is_hub_id("owner/name")  # a local path wins over the hub
    with pytest.raises(ModelNotFoundError, match="neither a model folder"):
        Backbone("a/b/c")


def test_a_gguf_says_once_that_it_is_converted(tiny_folder, tmp_path, monkeypatch, caplog):
    gguf = write_gguf(tiny_folder, tmp_path / "tiny.gguf", default_gguf())
    monkeypatch.setenv("ENDO_CACHE", str(tmp_path / "cache"))
    said = lambda: [r.getMessage() for r in caplog.records if "Converting" in r.getMessage()]
    with caplog.at_level("WARNING", logger="endo_retrieval.model.backbone"):
        Backbone(gguf, device="cpu")
        assert len(said()) == 1
        assert "tiny.gguf" in said()[0] and str(tmp_path / "cache" / "models") in said()[0]
        assert "only the first time" in said()[0]
        caplog.clear()
        Backbone(gguf, device="cpu")
        assert said() == []
