"""Greedy decoding over a static cache: the eager steps against Hugging Face's generate (CPU), and the CUDA-graph
replay against the eager steps (device)."""
import pytest
import torch

from endo_retrieval.decode import greedy_tokens, supports_graph_decode

from conftest import make_tiny_model


def hf_greedy(model, ids, n):
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids),
                         pad_token_id=0, temperature=None, top_p=None, top_k=None)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_static_cache_steps_match_generate(family, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(family, tmp_path)).eval()
    assert supports_graph_decode(model)
    ids = torch.randint(5, 1000, (1, 37), generator=torch.Generator().manual_seed(1))
    got = [int(t) for t in greedy_tokens(model, ids, 20, graph=False)]
    assert got == hf_greedy(model, ids, 20)
    assert len(set(got)) > 1  # a random model that repeats one token would prove little


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the device tool)")
def test_graph_replay_equals_the_eager_steps(backbone):
    ids = backbone.chat_ids("Write three sentences about the harbour at dawn.")
    eager = [int(t) for t in greedy_tokens(backbone.model, ids, 48, graph=False)]
    graphed = [int(t) for t in greedy_tokens(backbone.model, ids, 48, graph=True)]
    assert graphed == eager
    reference = hf_greedy(backbone.model, ids, 48)  # dynamic cache, no mask: other kernels, bf16 may drift late
    assert graphed[:16] == reference[:16]
