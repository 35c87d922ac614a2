"""Data loaders: HotpotQA long haystacks, LongBench JSONL, passkey haystacks, and malformed input."""
import json
from pathlib import Path

import pytest

from endo_retrieval.calibration.datasets import DataError, load_examples, make_passkey, passkey_needle, render_paragraph
from endo_bench.metrics import answer_recall, sp_recall

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
DEV30 = SHARED_DATA / "hotpotqa" / "dev30.json"
needs_dev30 = pytest.mark.skipif(not DEV30.is_file(), reason=f"shared data not found at {DEV30}")


def count_words(text: str) -> int:
    return len(text.split())


def toy_hotpotqa_item(k: int) -> dict:
    """Four paragraphs of 3-5 sentences with item- and paragraph-specific words; gold facts in paragraphs 0 and 2."""
    context = [[f"Topic {k}-{j}", [f" Item {k} part {j} line {s} says {'word ' * (s + j)}." for s in range(3 + j % 3)]]
               for j in range(4)]
    return {"_id": f"id{k}", "question": f"What is item {k}?", "answer": f"answer {k}", "type": "bridge",
            "level": "hard", "supporting_facts": [[f"Topic {k}-0", 1], [f"Topic {k}-2", 0]], "context": context}


@pytest.fixture
def toy_json(tmp_path: Path) -> Path:
    path = tmp_path / "toy.json"
    path.write_text(json.dumps([toy_hotpotqa_item(k) for k in range(8)]))
    return path


def smallest_paragraph(path: Path, count_tokens=count_words) -> int:
    """Tokens of the shortest paragraph in the file: a haystack falls short of its budget by less than this."""
    return min(count_tokens(render_paragraph(title, sentences))
               for item in json.loads(path.read_text()) for title, sentences in item["context"])


def paragraph_titles(context: str) -> list[str]:
    return [paragraph.split(":", 1)[0] for paragraph in context.split("\n\n")]


def test_haystack_fills_to_budget_without_passing_it(toy_json):
    margin = smallest_paragraph(toy_json)
    for example in load_examples(str(toy_json), count_tokens=count_words, context_tokens=300):
        n = count_words(example.context)
        assert example.meta["n_tokens"] == n
        assert 300 - margin < n <= 300
        assert all(sentence in example.context for sentence in example.supporting) and len(example.supporting) == 2
        titles = paragraph_titles(example.context)
        assert len(titles) == len(set(titles)), "a paragraph came twice"
        k = example.id[2:]
        assert {f"Topic {k}-{j}" for j in range(4)} <= set(titles)  # the question's own paragraphs
        assert example.meta["n_distractors"] == len(titles) - 4 > 0


def test_lengths_fit_a_counter_that_is_not_additive(toy_json):
    # Like subword tokenizers, len // 4 of a joined text is not the sum over its pieces: the builders must
    # count the joined text and still land just under the budget.
    def quarter_chars(text: str) -> int:
        return len(text) // 4
    margin = smallest_paragraph(toy_json, quarter_chars)
    for example in load_examples(str(toy_json), count_tokens=quarter_chars, context_tokens=500):
        assert 500 - margin < quarter_chars(example.context) == example.meta["n_tokens"] <= 500
    for depth in (0.0, 0.5, 1.0):
        example = make_passkey(FILLER, 500, depth, "12345", quarter_chars)
        assert 500 - 10 <= quarter_chars(example.context) == example.meta["n_tokens"] <= 500


def test_haystack_is_deterministic_for_a_seed(toy_json):
    def contexts(seed):
        return [e.context for e in load_examples(str(toy_json), count_tokens=count_words, context_tokens=200,
                                                 limit=3, seed=seed)]
    assert contexts(0) == contexts(0)
    assert contexts(0) != contexts(1)


def test_haystack_keeps_gold_paragraphs_first_when_over_budget(toy_json):
    example = load_examples(str(toy_json), count_tokens=count_words, context_tokens=30, limit=1)[0]
    assert sorted(paragraph_titles(example.context)) == ["Topic 0-0", "Topic 0-2"]
    assert example.meta["own_paragraphs_dropped"] == 2 and example.meta["over_budget"]


def test_without_context_tokens_only_own_paragraphs(toy_json):
    example = load_examples(str(toy_json), count_tokens=count_words, context_tokens=None, limit=1)[0]
    assert sorted(paragraph_titles(example.context)) == [f"Topic 0-{j}" for j in range(4)]


def test_malformed_hotpotqa_item_names_its_index(tmp_path):
    items = [toy_hotpotqa_item(0), toy_hotpotqa_item(1), toy_hotpotqa_item(2)]
    items[1]["supporting_facts"] = [["Topic 1-0", 99]]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(items))
    with pytest.raises(DataError, match=r"item 1: supporting fact .*99"):
        load_examples(str(path), count_tokens=count_words, context_tokens=100)
    loaded = load_examples(str(path), count_tokens=count_words, context_tokens=100, skip_bad=True)
    assert [e.id for e in loaded] == ["id0", "id2"] and len(loaded.skipped) == 1


def test_jsonl_rows_and_malformed_line_numbers(tmp_path):
    path = tmp_path / "lb.jsonl"
    path.write_text("\n".join([
        json.dumps({"context": "c1", "question": "q1", "answers": ["a1", "b1"], "dataset": "hotpotqa"}),
        '{"context": "c2", "question": ',                                 # line 2: not JSON
        json.dumps({"context": "c3", "answers": ["a3"]}),                  # line 3: no question
        "",
        json.dumps({"context": "c5", "question": "q5", "answers": "a5"}),  # answers as a plain string
    ]))
    with pytest.raises(DataError, match=r"lb\.jsonl: line 2:.*skip"):
        load_examples(str(path), count_tokens=count_words, context_tokens=None)
    loaded = load_examples(str(path), count_tokens=count_words, context_tokens=None, skip_bad=True)
    assert [(e.context, e.question, e.answers) for e in loaded] == [("c1", "q1", ["a1", "b1"]), ("c5", "q5", ["a5"])]
    assert loaded[0].meta["dataset"] == "hotpotqa" and loaded[1].meta["line"] == 5
    assert [m.split(": ")[1] for m in loaded.skipped] == ["line 2", "line 3"]
    assert "'question'" in loaded.skipped[1]
    assert len(load_examples(str(path), count_tokens=count_words, context_tokens=None, limit=1)) == 1


def test_unknown_spec_lists_accepted_forms(tmp_path):
    for spec in [str(tmp_path / "missing.json"), str(tmp_path)]:
        with pytest.raises(DataError, match=r"PATH\.json.*PATH\.jsonl.*passkey:DIR"):
            load_examples(spec, count_tokens=count_words, context_tokens=100)
    with pytest.raises(DataError, match="no .txt filler"):
        load_examples(f"passkey:{tmp_path}", count_tokens=count_words, context_tokens=100)


FILLER = " ".join(f"Sentence number {i} is here." for i in range(40))  # 200 words, 5 a sentence


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 0.8, 1.0])
def test_passkey_needle_sits_at_requested_depth(depth):
    example = make_passkey(FILLER, 500, depth, "48213", count_words)
    needle = passkey_needle("48213")
    before, after = example.context.split(needle)
    n_filler = count_words(before) + count_words(after)
    assert 500 - 5 <= count_words(example.context) <= 500  # filled to within one sentence
    assert n_filler > count_words(FILLER)  # the filler was repeated to reach the length
    assert abs(count_words(before) / n_filler - depth) <= 5 / n_filler  # within one sentence of the depth
    assert example.answers == ["48213"] and example.meta["depth"] == depth
    assert example.question == "What is the pass key? The pass key is"


def test_passkey_spec_spreads_depths_and_is_seeded(tmp_path):
    (tmp_path / "a.txt").write_text(FILLER)
    (tmp_path / "b.txt").write_text("Another essay starts. It has sentences too.")
    def load(seed):
        return load_examples(f"passkey:{tmp_path}", count_tokens=count_words, context_tokens=120, limit=5, seed=seed)
    examples = load(0)
    assert [e.meta["depth"] for e in examples] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert all(len(e.answers[0]) == 5 and e.answers[0].isdigit() and e.answers[0] in e.context for e in examples)
    assert [e.context for e in load(0)] == [e.context for e in examples]
    assert [e.answers for e in load(1)] != [e.answers for e in examples]
    with pytest.raises(DataError, match="context_tokens"):
        load_examples(f"passkey:{tmp_path}", count_tokens=count_words, context_tokens=None)


@needs_dev30
def test_whole_context_has_full_recall_on_dev30():
    examples = load_examples(str(DEV30), count_tokens=count_words, context_tokens=2048, limit=10)
    assert len(examples) == 10
    margin = smallest_paragraph(DEV30)
    for example in examples:
        assert 2048 - margin < example.meta["n_tokens"] <= 2048
        assert sp_recall(example.context, example.supporting) == 1.0  # a method returning everything
        assert answer_recall(example.context, example.answers) in (1.0, None)
        assert not sp_recall(example.context[: len(example.context) // 20], example.supporting) == 1.0
