"""ILRe: [ILRe Alg. 1] against a naive twin, [ILRe Eq. 4-5] against dense attention, early exit, the
compressed text as a subsequence of the source, bad input, and the appendix A.1 passkey task."""
from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

from endo_retrieval.calibration.ilre import (DEFAULT_FILLER, N_SEGMENTS, calibrate, calibrate_evidence, load_filler,
                                           make_sample, parse_ints, segments_for, summarise, tokens_in)
from endo_retrieval.methods.ilre import (ILRe, ILReError, allocate, allocate_reference, attention_scores,
                                        combination_budgets, context_scores, dca_key_positions, prefill)
from endo_retrieval.model.backbone import BackboneError
from endo_retrieval.model.profiles import ilre_profile
from endo_retrieval.scoring.select import runs

FILLER = ("The river ran past the old mill and the children counted stones on the bank. "
          "In the evening the lamp in the window was lit and a cat slept on the warm chair. ") * 40


# ---------------------------------------------------------------- [ILRe Alg. 1]


@pytest.mark.parametrize("seed", range(40))
def test_allocate_matches_naive_reference(seed, monkeypatch):
    if seed % 4 == 0:  # the threaded ranking of long contexts, on short ones
        monkeypatch.setattr("endo_retrieval.methods.ilre.PARALLEL_FROM", 1)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    budget = int(rng.integers(1, 150))
    sink = int(rng.integers(0, min(budget, 6) + 1))
    # integer scores make many ties (tie order is part of the contract); floats test the ordinary case
    scores = rng.integers(0, 4, n).astype(float) if seed % 2 else rng.random(n)
    max_kernels = tuple(sorted(set(rng.integers(1, 9, int(rng.integers(1, 4))).tolist())))
    avg_kernels = tuple(range(1, int(rng.integers(1, 17)) + 1))
    got = allocate(scores, budget, sink, max_kernels, avg_kernels)
    assert np.array_equal(got, allocate_reference(scores, budget, sink, max_kernels, avg_kernels))
    assert len(got) == min(n, budget)  # budget met exactly
    assert len(np.unique(got)) == len(got) and np.all(np.diff(got) > 0)  # no duplicates, sorted
    assert set(range(min(sink, n))) <= set(got.tolist())  # sink kept


def test_allocate_default_kernels_on_a_long_array():
    scores = torch.rand(5000, generator=torch.Generator().manual_seed(1))
    got = allocate(scores, 1024)
    assert np.array_equal(got, allocate_reference(scores.numpy(), 1024))
    assert len(got) == 1024 and np.array_equal(got[:4], np.arange(4))


def test_allocate_hand_computed():
    # sink 2, one max kernel 2, one avg kernel 1: max windows over scores[2:] are (2,3), (4,5), ...;
    # the window holding token 10 ranks first, then the one holding token 15, so 4 tokens go to them.
    scores = np.zeros(20)
    scores[10], scores[15] = 1.0, 0.5
    assert allocate(scores, 6, sink=2, max_kernels=(2,), avg_kernels=(1,)).tolist() == [0, 1, 10, 11, 14, 15]
    # budget 5: one token left after the first window; ties inside a window go to the lower index
    assert allocate(scores, 5, sink=2, max_kernels=(2,), avg_kernels=(1,)).tolist() == [0, 1, 10, 11, 14]


def test_combination_budgets_split_evenly_with_remainder_first():
    shares = combination_budgets(1024, 4, 48)
    assert sum(shares) == 1020 and shares[:12] == [22] * 12 and shares[12:] == [21] * 36


def test_allocate_short_and_bad_input():
    assert allocate(np.ones(10), 16).tolist() == list(range(10))  # shorter than the budget: all of it
    with pytest.raises(ValueError, match="budget"):
        allocate(np.ones(10), 0)
    with pytest.raises(ValueError, match="NaN"):
        allocate(np.array([1.0, np.nan, 2.0]), 2, sink=0)
    with pytest.raises(ValueError, match="1-D"):
        allocate(np.ones((3, 3)), 2)
    with pytest.raises(ValueError, match="sink"):
        allocate(np.ones(10), 3, sink=4)


def test_kept_tokens_become_runs():
    assert runs(np.array([0, 1, 2, 5, 7, 8])) == [(0, 3), (5, 6), (7, 9)]
    assert runs(np.array([], dtype=np.int64)) == []


# ---------------------------------------------------------------- [ILRe Eq. 4-5] and [ILRe Eq. 7]


def toy_rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A position-dependent rotation (not the model's), enough to check positions reach the right tokens."""
    angle = positions.float().view(-1, 1) * 0.01
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], dim=-1)


def test_attention_scores_match_dense_softmax():
    g = torch.Generator().manual_seed(0)
    n_kv, n_heads, length, n_q, d = 2, 6, 300, 7, 8
    keys, queries = torch.randn(n_kv, length, d, generator=g), torch.randn(n_heads, n_q, d, generator=g)
    k_pos, q_pos = torch.arange(length), torch.arange(length, length + n_q)
    got = attention_scores(keys, queries, k_pos, q_pos, toy_rope, block=64)  # blocks do not divide L
    k = toy_rope(keys, k_pos).repeat_interleave(n_heads // n_kv, dim=0)  # query head h reads kv head h // 3
    q = toy_rope(queries, q_pos)
    dense = torch.softmax(q @ k.transpose(1, 2) / d ** 0.5, dim=-1).amax(dim=(0, 1))
    assert np.allclose(got, dense.numpy(), atol=1e-6)


def test_dca_key_positions_hand_computed():
    # chunks start at 0, 4, 8, 12 (last one short): chunks 0 and 1 move onto chunk 2 (the one before the last)
    pos = torch.arange(14)
    assert dca_key_positions(pos, [0, 4, 8, 12]).tolist() == [8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 12, 13]
    assert dca_key_positions(pos, [0, 8]).tolist() == pos.tolist()


# ---------------------------------------------------------------- a tiny random Llama for the plumbing


@pytest.fixture(scope="module")
def tiny_backbone(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from endo_retrieval.model.backbone import Backbone

    folder = tmp_path_factory.mktemp("tiny-llama")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([FILLER, "Question: what is the passkey? Answer: 0123456789"],
                            trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                special_tokens=["<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(folder)
    return Backbone(folder, device="cpu")


def test_prefill_exits_early_and_keeps_full_keys(tiny_backbone):
    bb = tiny_backbone
    ids = bb.encode(FILLER).ids[:600]
    query = bb.encode("Question: where did the cat sleep?\nAnswer:").ids
    fired = []
    layers = bb.model.model.layers
    hooks = [module.register_forward_hook(lambda *_, name=name: fired.append(name)) for name, module in
             [(l, layers[l]) for l in range(4)] + [("k1", layers[1].self_attn.k_proj), ("mlp1", layers[1].mlp)]]
    try:
        states = prefill(bb, ids, query, [1], sink=4, window=64, chunk_size=128)[1]
    finally:
        for h in hooks:
            h.remove()
    # layers after l_R = 1 never run, and of l_R only what its keys and queries need (no attention, no MLP)
    assert set(fired) == {0, "k1"}
    assert states.keys.shape == (2, 600, 16) and states.queries.shape == (4, len(query), 16)
    def framed(s, e):  # each chunk sits behind its sink + window frame (Backbone.stream, mode sink_window)
        n = min(4, s) + max(0, s - max(4, s - 64))
        return list(range(n, n + e - s))
    assert states.key_positions.tolist() == sum((framed(s, min(s + 128, 600)) for s in range(0, 600, 128)), [])
    assert states.query_positions.tolist() == framed(600, 600 + len(query))
    assert states.chunk_starts == list(range(0, 600, 128))
    # the cache holds exactly what the stream hands out, chunk by chunk
    ids_all = np.concatenate([ids, query])
    streamed = [ch.keys[1] for ch in bb.stream(ids_all, [1], chunk_size=128, mode="sink_window", sink=4,
                                               window=64, split_at=600) if ch.start < 600]
    assert torch.equal(states.keys, torch.cat(streamed, dim=1))


def assert_same_chunks(got, expected, layers) -> None:
    """Two streams handed out the same chunks: bounds, positions, keys and queries."""
    assert [(c.start, c.end) for c in got] == [(c.start, c.end) for c in expected]
    for a, b in zip(expected, got):
        assert torch.equal(a.rope_positions, b.rope_positions)
        for l in layers:
            torch.testing.assert_close(b.keys[l], a.keys[l], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(b.queries[l], a.queries[l], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("positions", ["frame", "absolute", "dca"])
def test_batched_chunks_give_each_chunk_its_own_states(tiny_backbone, positions):
    """The faster path (sink + window chunks forwarded several to a batch) against one chunk per forward: the same
    keys, queries, positions, scores and allocation, for each RoPE layout."""
    bb = tiny_backbone
    ids = bb.encode(FILLER[:4000]).ids
    query = bb.encode("Question: where did the cat sleep?\nAnswer:").ids
    kw = dict(layers=[1, 2], sink=4, window=64, chunk_size=128, capture=("k", "q"), split_at=len(ids),
              mode="sink_window", positions=positions)
    whole = np.concatenate([ids, query])
    alone = list(bb.stream(whole, batch_tokens=0, **kw))
    batched = list(bb.stream(whole, batch_tokens=4 * (4 + 64 + 128), **kw))
    assert_same_chunks(batched, alone, layers=(1, 2))
    ilre = ILRe(bb, layer=2, window=64, chunk_size=128, positions=positions)
    states = prefill(bb, ids, query, [2], sink=4, window=64, chunk_size=128, positions=positions)[2]
    keys = torch.cat([c.keys[2] for c in alone if c.start < len(ids)], dim=1)
    torch.testing.assert_close(states.keys, keys, rtol=1e-4, atol=1e-5)
    scores = ilre.scores(ids, query)
    one_by_one = ILRe(bb, layer=2, window=64, chunk_size=len(ids) + 1, positions=positions)  # a single chunk
    assert not np.allclose(scores, one_by_one.scores(ids, query))  # the comparison can fail: chunking matters
    alone_states = prefill(bb, ids, query, [2], sink=4, window=64, chunk_size=128, positions=positions, batch_tokens=0)
    reference = context_scores(bb, alone_states[2], dca=positions == "dca")
    np.testing.assert_allclose(scores, reference, rtol=1e-4, atol=1e-7)
    assert np.array_equal(allocate(scores, 200), allocate(reference, 200))


@pytest.mark.parametrize("positions,window", [("frame", 64), ("absolute", 64), ("frame", 0)])
def test_cached_frames_batched_give_each_chunk_its_own_states(tiny_backbone, positions, window):
    """frames="cache" with consecutive chunks in one forward (each builds its frame from the row before it, inside
    every layer) against one chunk per forward: the same keys, queries and positions, chunk by chunk."""
    bb = tiny_backbone
    ids = bb.encode(FILLER[:6000]).ids[:1200]
    query = bb.encode("Question: where did the cat sleep?\nAnswer:").ids
    whole = np.concatenate([ids, query])
    kw = dict(layers=[1, 2], sink=4, window=window, chunk_size=128, capture=("k", "q"), split_at=len(ids),
              mode="sink_window", positions=positions, frames="cache")
    forwards = []
    hook = bb.model.model.register_forward_pre_hook(lambda _m, args, kwargs: forwards.append(1), with_kwargs=True)
    try:
        alone = list(bb.stream(whole, batch_tokens=0, **kw))
        n_alone = len(forwards)
        batched = list(bb.stream(whole, batch_tokens=4 * 128, **kw))
    finally:
        hook.remove()
    # 10 chunks (9 of 128 tokens, one of 48) and the query part; batched: chunk 0 (its frame is filling), 1-4, 5-8,
    # the short one, the query part
    assert (n_alone, len(forwards) - n_alone) == (11, 5)
    assert_same_chunks(batched, alone, layers=(1, 2))
    states = {bt: prefill(bb, ids, query, [2], sink=4, window=window, chunk_size=128, frames="cache",
                          batch_tokens=bt)[2] for bt in (0, 4 * 128)}
    scores = {bt: context_scores(bb, st) for bt, st in states.items()}
    np.testing.assert_allclose(scores[4 * 128], scores[0], rtol=1e-4, atol=1e-7)
    assert np.array_equal(allocate(scores[4 * 128], 200), allocate(scores[0], 200))


@pytest.mark.parametrize("tiny_backbone", ["llama"], indirect=True)
def test_compiled_layers_give_the_eager_states(tiny_backbone):
    """compiled=True (the layers below the captured one through torch.compile) against eager layers, with the frame
    cached and batched and with it recomputed: the same keys and queries, and the same allocation."""
    bb = tiny_backbone
    ids = bb.encode(FILLER[:6000]).ids[:1200]
    query = bb.encode("Question: where did the cat sleep?\nAnswer:").ids
    for frames in ("cache", "recompute"):
        kw = dict(sink=4, window=64, chunk_size=128, frames=frames, batch_tokens=4 * 128)
        eager, fused = (prefill(bb, ids, query, [2], compiled=c, **kw)[2] for c in (False, True))
        torch.testing.assert_close(fused.keys, eager.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fused.queries, eager.queries, rtol=1e-4, atol=1e-4)
        assert np.array_equal(allocate(context_scores(bb, fused), 200), allocate(context_scores(bb, eager), 200))
    assert set(bb.capture.compiled_twins) == {0, 1}  # the captured layer ran eager, with its hooks
    with pytest.raises(BackboneError, match="int8"):
        next(bb.stream(ids, [2], compiled=True, int8=True))


@pytest.mark.parametrize("frames", ["cache", "recompute"])
def test_ids_arriving_in_pieces_give_what_the_whole_array_gives(tiny_backbone, frames, monkeypatch):
    """The stream reads the ids as they arrive (tokenising overlaps the forwards): pieces cut anywhere give the
    states, positions and chunks of the whole array, and `compress` (which reads a long text as it tokenises) the
    allocation of the scores of the whole encoding."""
    import endo_retrieval.methods.ilre as ilre_module
    import endo_retrieval.model.backbone as backbone_module

    bb = tiny_backbone
    text = FILLER[:6000]
    ids, query = bb.encode(text).ids, bb.encode("Question: where did the cat sleep?\nAnswer:").ids
    kw = dict(sink=4, window=64, chunk_size=128, frames=frames, batch_tokens=4 * 128)
    whole = prefill(bb, ids, query, [2], **kw)[2]
    arriving = prefill(bb, iter(np.split(ids, [100, 700, 701])), query, [2], **kw)[2]
    torch.testing.assert_close(arriving.keys, whole.keys, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(arriving.queries, whole.queries, rtol=1e-4, atol=1e-5)
    assert torch.equal(arriving.key_positions, whole.key_positions)
    assert torch.equal(arriving.query_positions, whole.query_positions)
    assert arriving.chunk_starts == whole.chunk_starts == list(range(0, len(ids), 128))
    for module in (ilre_module, backbone_module):  # several pieces of this short text
        monkeypatch.setattr(module, "PIECE_CHARS", 1000)
    ilre = ILRe(bb, layer=2, window=64, chunk_size=128, frames=frames)
    out = ilre.compress(text, "where did the cat sleep?", 200)
    query_part = bb.encode(ilre.query_template.format(question="where did the cat sleep?")).ids
    expected = ilre._fit(text, bb.encode(text), ilre.scores(ids, query_part), 200)
    assert out.n_tokens <= 200 and len(out.spans) > 1
    assert [(s.start, s.end) for s in out.spans] == [(s.start, s.end) for s in expected.spans]
    with pytest.raises(BackboneError, match="negative"):
        next(bb.stream(iter([ids]), [2], mode="sink_window", frames=frames, split_at=10))
    with pytest.raises(BackboneError, match="non-empty"):
        next(bb.stream(iter([]), [2], mode="sink_window", frames=frames))


def test_cached_frames_hold_against_recomputed_ones(tiny_backbone):
    """frames="cache" ([ILRe section 3.4]: the sink + window keys and values kept per layer) against the recomputed
    frame: identical when the window holds everything before a chunk; with no sink, "frame" positions (the window
    rotated down by its shift) give what "absolute" ones give (RoPE sees only distances); with the paper's window,
    near today's scores and allocation, and a different computation (window tokens saw their own past)."""
    bb = tiny_backbone
    ids = bb.encode(FILLER[:6000]).ids[:1500]
    query = bb.encode("Question: where did the cat sleep?\nAnswer:").ids
    whole = np.concatenate([ids, query])
    kw = dict(layers=[2], chunk_size=128, mode="sink_window", capture=("k", "q"), split_at=len(ids))

    def stream(**more):
        return list(bb.stream(whole, **kw, **more))

    for positions in ("frame", "absolute"):
        for a, b in zip(stream(sink=4, window=10**6, positions=positions),
                        stream(sink=4, window=10**6, positions=positions, frames="cache")):
            assert torch.equal(a.rope_positions, b.rope_positions)
            torch.testing.assert_close(b.keys[2], a.keys[2], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(b.queries[2], a.queries[2], rtol=1e-4, atol=1e-5)
    for a, b in zip(stream(sink=0, window=100, positions="frame", frames="cache"),
                    stream(sink=0, window=100, positions="absolute", frames="cache")):
        torch.testing.assert_close(a.keys[2], b.keys[2], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.queries[2], b.queries[2], rtol=1e-4, atol=1e-5)
    recomputed = ILRe(bb, layer=2, chunk_size=128).scores(ids, query)
    cached = ILRe(bb, layer=2, chunk_size=128, frames="cache").scores(ids, query)
    assert not np.allclose(recomputed, cached)
    assert np.corrcoef(recomputed, cached)[0, 1] > 0.95
    assert len(np.intersect1d(allocate(recomputed, 200), allocate(cached, 200))) >= 0.7 * 200
    with pytest.raises(BackboneError, match="frames"):
        next(bb.stream(whole, [2], mode="sink_window", positions="dca", frames="cache"))


def test_compressed_text_is_a_subsequence_of_the_source(tiny_backbone):
    bb = tiny_backbone
    ilre = ILRe(bb, layer=1, window=64, chunk_size=128)
    context = FILLER[:3000]
    enc = bb.encode(context)
    out = ilre.compress(context, "where did the cat sleep?", 100)
    assert out.method == "ilre" and out.budget == 100 and 0 < out.n_tokens <= 100
    assert out.n_tokens == bb.count_tokens(out.text)
    assert out.text == "\n".join(s.text for s in out.spans)
    kept = np.concatenate([np.arange(s.start, s.end) for s in out.spans])
    assert np.all(np.diff(kept) > 0) and kept[-1] < len(enc)  # token positions strictly increasing
    assert np.all(np.diff([s.start for s in out.spans]) > 0)
    for s in out.spans:  # each span is the source text of its tokens
        assert s.text == context[s.char_start:s.char_end]
        assert (s.char_start, s.char_end) == (enc.offsets[s.start, 0], enc.offsets[s.end - 1, 1])
    # the kept text reads the source in order: each piece is found after the previous one
    at = 0
    for s in out.spans:
        at = context.index(s.text, at) + len(s.text)
    assert set(range(4)) <= set(kept.tolist())  # the sink is part of the budget


def test_compress_short_context_bad_budget_long_question(tiny_backbone):
    bb = tiny_backbone
    ilre = ILRe(bb, layer=0, window=16, chunk_size=64)
    short = "The cat slept on the warm chair."
    out = ilre.compress(short, "where?", 1024)
    assert out.text == short and len(out.spans) == 1
    with pytest.raises(ValueError, match="budget"):
        ilre.compress(FILLER, "where?", 0)
    for context in (FILLER, short):  # checked before the short-context shortcut too
        with pytest.raises(ValueError, match="window"):
            ilre.compress(context, "where did the cat sleep " * 10, 32)
    with pytest.raises(ValueError, match="empty"):
        ilre.compress(FILLER, "  ", 32)


def test_compress_prompt_keeps_the_last_query_tokens(tiny_backbone):
    bb = tiny_backbone
    ilre = ILRe(bb, layer=1, window=64, chunk_size=128, query_tokens=8)
    prompt = FILLER[:2000] + "Question: where did the cat sleep? Answer:"
    enc = bb.encode(prompt)
    out = ilre.compress_prompt(prompt, 60)
    assert out.n_tokens <= 60 and out.spans[-1].end == len(enc)
    assert out.spans[-1].start <= len(enc) - 8 and out.text.endswith("Answer:")


def test_positions_change_the_scores_only_as_described(tiny_backbone):
    """"dca" = absolute positions + the [ILRe Eq. 6] sink shift in the stream + [ILRe Eq. 7] at l_R; the prefill's key
    positions are absolute for both "absolute" and "dca", and each layout ranks the context differently."""
    bb = tiny_backbone
    ids = bb.encode(FILLER[:3000]).ids
    query = bb.encode("Question: where did the cat sleep?\nAnswer:").ids
    kw = dict(sink=4, window=64, chunk_size=128)
    absolute = prefill(bb, ids, query, [1], positions="absolute", **kw)[1]
    dca = prefill(bb, ids, query, [1], positions="dca", **kw)[1]
    assert absolute.key_positions.tolist() == list(range(len(ids)))
    assert torch.equal(dca.key_positions, absolute.key_positions)
    assert absolute.query_positions.tolist() == list(range(len(ids), len(ids) + len(query)))
    scores = {p: ILRe(bb, layer=1, positions=p, **kw).scores(ids, query) for p in ("frame", "absolute", "dca")}
    assert not np.allclose(scores["dca"], scores["absolute"]) and not np.allclose(scores["frame"], scores["absolute"])
    out = ILRe(bb, layer=1, positions="dca", **kw).compress(FILLER[:3000], "where did the cat sleep?", 100)
    assert 0 < out.n_tokens <= 100
    with pytest.raises(ILReError, match="positions"):
        ILRe(bb, layer=1, positions="relative")


def test_missing_calibration_says_what_to_run(tiny_backbone):
    assert ilre_profile(tiny_backbone) is None
    with pytest.raises(ILReError, match="calibrate-ilre"):
        ILRe(tiny_backbone)
    with pytest.raises(ILReError, match="layer"):
        ILRe(tiny_backbone, layer=9)


# ---------------------------------------------------------------- appendix A.1: the passkey task


def test_passkey_sample_layout(tiny_backbone):
    bb = tiny_backbone
    enc = bb.encode(FILLER)
    for segment in (0, 7, 19):
        s = make_sample(bb, enc.ids, enc.offsets, FILLER, 400, 12, segment, random.Random(segment))
        assert re.fullmatch(r"[a-z]+-[a-z]+-[a-z]+-\d\d", s.key_id)
        assert len(s.passkey) == 12 and s.passkey.isdigit()
        assert s.context[s.value_chars[0]:s.value_chars[1]] == s.passkey
        assert f"\n\nThe {s.key_id} magic passkey is {s.passkey}.\n" in s.context
        assert s.query == f"\n\n# What's the {s.key_id} magic passkey?\n\nThe {s.key_id} magic passkey is "
        needle_at = s.context.index(f"\n\nThe {s.key_id}")
        needle_tokens = bb.count_tokens(f"\n\nThe {s.key_id} magic passkey is {s.passkey}.\n")
        depth = bb.count_tokens(s.context[:needle_at]) / (bb.count_tokens(s.context) - needle_tokens)
        assert abs(depth - segment / N_SEGMENTS) < 0.01  # the key opens its segment of the filler
        ctx = bb.encode(s.context)
        assert abs(len(ctx) - 400) <= 3
        got = "".join(s.context[a:b] for a, b in ctx.offsets[tokens_in(ctx.offsets, s.value_chars)])
        assert s.passkey in got


def test_parse_ints_and_segments():
    assert parse_ints("8192,32768") == [8192, 32768]
    assert parse_ints("0-3,7") == [0, 1, 2, 3, 7]
    assert parse_ints("all", 3) == [0, 1, 2]
    assert segments_for(20) == list(range(20)) and segments_for(4) == [0, 5, 10, 15]


def test_summarise_picks_the_smallest_best_layer(tiny_backbone):
    rows = {0: [("800/8", 0.0), ("800/8", 1.0)], 2: [("800/8", 1.0)] * 2, 5: [("800/8", 1.0)] * 2}
    hits = {"default": rows, "one-max-avg": {l: [("800/8", 0.0)] * 2 for l in rows}}
    profile = summarise(tiny_backbone, hits, {"kind": "passkey"})
    assert profile["layer"] == 2 and profile["recall"] == {"0": 0.5, "2": 1.0, "5": 1.0}
    assert profile["recall_by_setting"]["one-max-avg"]["800/8"]["2"] == 0.0


def test_calibrate_end_to_end_on_the_tiny_model(tiny_backbone):
    profile = calibrate(tiny_backbone, FILLER, [300], [0, 1], [6], n_depths=2, budget=64, progress=False)
    assert profile["layer"] in (0, 1) and set(profile["recall"]) == {"0", "1"}
    assert profile["task"]["samples"] == 2 and profile["model_hash"] == tiny_backbone.model_hash


def test_calibrate_on_evidence_scores_the_gold_sentences_kept(tiny_backbone, tmp_path):
    items = [{"_id": f"q{k}", "question": f"What does item {k} say?", "answer": "x", "type": "bridge",
              "supporting_facts": [[f"T{k}-0", 1], [f"T{k}-1", 0]],
              "context": [[f"T{k}-{j}", [f" Item {k} part {j} line {i} says {'word ' * (i + 1)}." for i in range(3)]]
                          for j in range(4)]} for k in range(6)]
    data = tmp_path / "toy.json"
    data.write_text(json.dumps(items))
    profile = calibrate_evidence(tiny_backbone, str(data), [300], [0, 1], limit=3, budget=64, progress=False)
    assert profile["task"]["kind"] == "evidence" and profile["task"]["samples"] == 3
    assert set(profile["recall_by_setting"]["default"]) == {"300/evidence"}
    assert all(0.0 <= r <= 1.0 for r in profile["recall"].values()) and profile["layer"] in (0, 1)
    # a budget that keeps the whole haystack keeps every gold sentence, at every layer
    whole = calibrate_evidence(tiny_backbone, str(data), [300], [0, 1], limit=3, budget=299, progress=False)
    assert whole["recall"] == {"0": 1.0, "1": 1.0}


# ---------------------------------------------------------------- the real default model


@pytest.mark.slow
def test_ilre_keeps_a_passkey_in_8k_filler():
    if not DEFAULT_FILLER.is_dir():
        pytest.skip(f"needs the filler essays at {DEFAULT_FILLER} (../shared/data beside the repo)")
    from endo_retrieval.model.backbone import Backbone

    bb = Backbone.default()
    if ilre_profile(bb) is None:
        pytest.skip("no shipped ILRe profile for this model file; run `endo calibrate-ilre`")
    filler = load_filler(DEFAULT_FILLER)
    enc = bb.encode(filler[:200_000])
    s = make_sample(bb, enc.ids, enc.offsets, filler[:200_000], 8192, 8, 9, random.Random(3))
    ilre = ILRe(bb)
    question = f"What's the {s.key_id} magic passkey?"
    out = ilre.compress(s.context, question, 1024)
    assert out.n_tokens <= 1024 and s.passkey in out.text
