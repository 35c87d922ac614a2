"""Bringing your own model, end to end, as a user does: a tiny random model of each supported family, saved as a
Hugging Face folder and written as a GGUF file, is loaded, given its artefacts, indexed and queried from the
command line, from LlamaIndex and through compress(); a model without artefacts, or of an unsupported family,
gets an error that says what to do. (Random weights: plumbing, not quality.)"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from endo_retrieval import Backbone, SAEBank, TopKSAE, compress
from endo_retrieval.model.backbone import (ModelNotFoundError, UnsupportedModelError, cache_dir, default_gguf,
                                     file_sha256)
from endo_retrieval.cli import main
from endo_retrieval.model.profiles import ilre_profile_path, sae_dir

from conftest import make_tiny_model
from gguf_writer import write_gguf, write_header_only

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
FILLER = ("The river bends twice before the old mill. Farmers sell apples at the market on Sundays. "
          "A quiet road leads up the hill to the chapel. ") * 6
DOCS = {"mill.txt": FILLER, "vault.txt": FILLER[:200] + "The vault combination is 4417, said the caretaker. "}
QUESTION = "What is the vault combination?"
CASES = [(family, kind) for family in FAMILIES for kind in ("folder", "gguf")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(family, "folder" | "gguf") -> path, and an empty cache of its own for conversions and artefacts."""
    root = tmp_path_factory.mktemp("own-models")
    paths = {}
    for family in FAMILIES:
        # transformers reads no head_dim from a qwen3 GGUF and assumes 128, as every released Qwen3 has
        folder = make_tiny_model(family, root / family, layers=2, head_dim=128 if family == "qwen3" else 16)
        paths[family, "folder"] = folder
        paths[family, "gguf"] = write_gguf(folder, root / f"tiny-{family}.F32.gguf", default_gguf())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ENDO_CACHE", str(root / "cache"))  # after the default model (the tokenizer's source) is loaded
        yield paths


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs")
    for name, text in DOCS.items():
        (folder / name).write_text(text)
    return folder


def give_random_saes(bb) -> SAEBank:
    """What `endo train-sae` leaves (test_train_sae_then_index_from_the_command_line runs it): SAEs where the
    engine looks for this model's, here random ones on both layers."""
    torch.manual_seed(0)
    bank = SAEBank({l: TopKSAE(bb.head_dim, 256, 8) for l in (0, 1)},
                   {"d_latent": 256, "k": 8, "model_hash": bb.model_hash, "model": bb.model_id})
    bank.save(sae_dir(bb))
    return bank


@pytest.mark.parametrize("family,kind", CASES)
def test_a_folder_or_a_gguf_loads_as_the_same_model(models, family, kind):
    path = models[family, kind]
    bb = Backbone.of(str(path))
    assert Backbone.of(path) is bb  # one copy per model and process, whoever asks for it
    assert bb.source == str(path.resolve()) and bb.model_id == path.name.removesuffix(".gguf")
    ids = torch.randint(10, 1000, (1, 24))
    with torch.inference_mode():
        logits = bb.model(ids).logits
        reference = Backbone.of(str(models[family, "folder"])).model(ids).logits
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)  # float32 GGUF: the same weights, exactly
    if kind == "gguf":
        assert bb.model_hash == file_sha256(path)  # the conversion is cached under the file's hash
        assert (bb.folder / "endo_model_hash").read_text() == bb.model_hash
        # llama.cpp writes Mistral as the llama architecture (the same computation); the others keep their family
        assert bb.family == ("llama" if family == "mistral" else family)
    else:
        assert bb.family == family


@pytest.mark.parametrize("family,kind", CASES)
def test_index_query_retrieve_and_compress(models, docs_dir, tmp_path, capsys, family, kind):
    path = str(models[family, kind])
    bb = Backbone.of(path)
    index = tmp_path / "index"
    if not (sae_dir(bb) / "card.json").exists():  # a model without SAEs: an index for S3 says what makes them
        assert main(["index", str(docs_dir), "--out", str(index), "--model", path, "--method", "s3-hybrid"]) == 2
        assert f"`endo train-sae --model {bb.source}`" in capsys.readouterr().err
        give_random_saes(bb)
    assert sae_dir(bb).is_relative_to(cache_dir())  # a model's own artefacts live in the cache, not the package

    assert main(["index", str(docs_dir), "--out", str(index), "--model", path, "--method", "s3-hybrid"]) == 0
    capsys.readouterr()
    assert main(["query", str(index), QUESTION, "--model", path, "--k", "2", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert 1 <= len(hits) <= 2
    for h in hits:
        assert DOCS[Path(h["doc_id"]).name][h["char_start"]:h["char_end"]] == h["text"]
    from endo_retrieval.cli.mcp_server import IndexHolder  # what `endo mcp --index DIR --model PATH` serves

    assert [s.text for s in IndexHolder(str(index), "s3-hybrid", path).search_evidence(QUESTION, 2, None)] == \
        [h["text"] for h in hits]

    context = FILLER + DOCS["vault.txt"]
    with pytest.raises(ValueError, match="endo calibrate-heads --model"):  # the default method needs the heads
        compress(context, QUESTION, budget=48, backbone=path)
    out = compress(context, QUESTION, budget=48, method="s3-hybrid", backbone=path)
    assert 0 < bb.count_tokens(out.text) <= 48
    assert all(context[s.char_start:s.char_end] == s.text for s in out.spans)
    assert "4417" in out.text  # s3-hybrid's lexical half always finds the needle's sentence

    pytest.importorskip("llama_index.core")
    from llama_index.core import Document
    from llama_index.retrievers.endo import EndoRetriever

    documents = [Document(id_=k, text=v) for k, v in DOCS.items()]
    with pytest.raises(ValueError, match="endo calibrate-heads --model"):  # the default pipeline needs the heads
        EndoRetriever.from_defaults(documents=documents, backbone=path)
    retriever = EndoRetriever.from_defaults(documents=documents, backbone=path, similarity_top_k=2,
                                            method="s3-hybrid")
    assert retriever.index.backbone is bb  # the path names the model; the loaded copy is shared
    nodes = retriever.retrieve(QUESTION)
    assert 1 <= len(nodes) <= 2
    assert all(n.node.text in DOCS[n.node.metadata["doc_id"]] for n in nodes)

    pytest.importorskip("langchain_core")
    from langchain_endo import EndoRetriever as LCRetriever

    lc = LCRetriever(texts=list(DOCS.values()), backbone=path, k=2, method="s3-hybrid")
    assert lc.index.backbone is bb
    assert [d.page_content for d in lc.invoke(QUESTION)] == [n.node.text for n in nodes]  # same index, same spans


def test_ilre_and_heads_without_their_profile_name_the_command(models):
    from endo_retrieval.methods import REGISTRY, get_method
    from endo_retrieval.methods.ilre import ILRe, ILReError

    path = str(models["qwen2", "gguf"])
    bb = Backbone.of(path)
    with pytest.raises(ILReError, match=f"`endo calibrate-ilre --model {bb.source}`"):
        ILRe(backbone=path)
    profile = ilre_profile_path(bb)  # what `endo calibrate-ilre` writes, by default, for this model
    profile.parent.mkdir(parents=True, exist_ok=True)
    profile.write_text(json.dumps({"layer": 1, "model_hash": bb.model_hash}))
    assert ILRe(backbone=path).layer == 1
    context = FILLER + DOCS["vault.txt"]
    assert 0 < bb.count_tokens(compress(context, QUESTION, budget=80, method="ilre", backbone=path).text) <= 80
    if "heads" not in REGISTRY:
        pytest.skip("this build has no heads method")
    with pytest.raises(ValueError, match="endo calibrate-heads"):
        get_method("heads", backbone=bb)


def test_train_sae_then_index_from_the_command_line(models, docs_dir, tmp_path, capsys):
    """The user's path: `endo train-sae --model M` writes the SAEs where `endo index --model M` finds them."""
    folder = make_tiny_model("llama", tmp_path / "own", layers=3)  # a model of its own: no SAEs yet
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(FILLER * 4)
    assert main(["index", str(docs_dir), "--out", str(tmp_path / "ix"), "--model", str(folder),
                 "--method", "s3-hybrid"]) == 2  # no SAEs yet (an index for bm25 or endo needs none)
    assert "endo train-sae" in capsys.readouterr().err
    assert main(["train-sae", "--model", str(folder), "--corpus", str(corpus), "--heldout", "none", "--steps", "20",
                 "--batch-size", "128", "--expansion", "4", "--k", "4", "--chunk-size", "256"]) == 0
    bank = SAEBank.for_backbone(Backbone.of(str(folder)))
    assert bank.layers == [0, 1, 2] and bank.card["d_latent"] == 4 * 16  # auto layers: 10%, 37%, 63% of depth
    capsys.readouterr()
    assert main(["index", str(docs_dir), "--out", str(tmp_path / "ix"), "--model", str(folder),
                 "--method", "s3-hybrid"]) == 0
    assert main(["query", str(tmp_path / "ix"), QUESTION, "--model", str(folder), "--json"]) == 0
    renamed = shutil.copytree(folder, tmp_path / "renamed")  # the files are found by the weights' hash, not the name
    assert SAEBank.for_backbone(Backbone.of(str(renamed))).layers == [0, 1, 2]


def test_unsupported_family_is_refused_with_the_reason(tmp_path, monkeypatch):
    import transformers

    monkeypatch.setenv("ENDO_CACHE", str(tmp_path / "cache"))

    cfg = transformers.Gemma2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "gemma")
    with pytest.raises(UnsupportedModelError, match="'gemma2' is not supported: its attention caps its logits.*"
                                                    "Supported families: llama, mistral, qwen2, qwen3"):
        Backbone(tmp_path / "gemma")
    gguf = write_header_only(tmp_path / "gemma-2-2b.gguf", "gemma2")
    with pytest.raises(UnsupportedModelError, match="'gemma2' is not supported: its attention caps its logits"):
        Backbone(gguf)
    assert not (tmp_path / "cache" / "models").exists()  # refused from the file's header, before any conversion


def test_a_path_that_is_no_model_says_what_to_pass(tmp_path):
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.Q4_K_M.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="pass one of them, e.g. .*model.Q4_K_M.gguf"):
        Backbone(tmp_path / "weights")
    with pytest.raises(ModelNotFoundError, match="neither a model folder .* nor a .gguf file"):
        Backbone(tmp_path / "missing")
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ModelNotFoundError, match="not a readable GGUF"):
        Backbone(tmp_path / "broken.gguf")
