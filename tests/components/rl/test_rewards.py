"""components/rl/rewards.py and builtin_rewards.py: reward functions named as built-ins, importable
modules or .py files, called with TRL's signature (columns by name, None for rows a function does not
apply to); each way a user's function can fail is one line naming it; the built-ins against answers
worked out by hand (math-verify compares values, not strings)."""

from __future__ import annotations

import math

import pytest

from weft.components.rl.rewards import RewardError, compute_rewards, load_reward_functions


def test_functions_load_from_built_ins_modules_and_files(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def short(prompts, completions, completion_ids, **kw):\n"
                                            "    return [1.0 / len(ids) for ids in completion_ids]\n")
    (tmp_path / "other.py").write_text("def exact(prompts, completions, completion_ids, answer, **kw):\n"
                                       "    return [None if a is None else float(c == a) for c, a in zip(completions, answer)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    functions = load_reward_functions(["format", "my_rewards:short", f"{tmp_path / 'other.py'}:exact"], answer_tag="ans")
    assert [f.name for f in functions] == ["format", "short", "exact"]
    values = compute_rewards(functions, ["1+1=", "1+1="], ["<ans>2</ans>", "2"], [[5, 6], [7]],
                             {"answer": ["2", None]}, ["train.jsonl:1", "train.jsonl:1"])
    assert values[:, 0].tolist() == [1.0, 0.0]
    assert values[:, 1].tolist() == [0.5, 1.0]
    assert values[0, 2].item() == 0.0 and math.isnan(values[1, 2].item())  # None: does not apply


@pytest.mark.parametrize("spec, expected", [
    ("nothing", "is neither a built-in"),
    ("not_a_module_anywhere:f", "does not import: ModuleNotFoundError"),
    ("missing.py:f", "no file missing.py"),
    ("math:not_there", "math has no function 'not_there'"),
    ("math:pi", "math has no function 'pi'"),
])
def test_a_function_that_does_not_load_is_named(spec, expected):
    with pytest.raises(RewardError, match=expected):
        load_reward_functions([spec], answer_tag="answer")


def test_two_functions_of_one_name_are_refused():
    with pytest.raises(RewardError, match="two functions are named 'format'"):
        load_reward_functions(["format", "format"], answer_tag="answer")


def _load(tmp_path, body: str):
    (tmp_path / "bad.py").write_text(f"def f(prompts, completions, completion_ids, **kw):\n    {body}\n")
    return load_reward_functions([f"{tmp_path / 'bad.py'}:f"], answer_tag="answer")


@pytest.mark.parametrize("body, expected", [
    ("raise ValueError('no solution column')", "reward function f raised ValueError: no solution column (scoring the "
                                               "completions of a.jsonl:3 .. a.jsonl:4)"),
    ("return [1.0]", "returned 1 values for 2 completions"),
    ("return 1.0", "returned float for 2 completions"),
    ("return [1.0, 'x']", "returned 'x' for completion 1 of a.jsonl:4"),
    ("return [1.0, float('nan')]", "returned nan for completion 1 of a.jsonl:4"),
    ("return {'a': 1.0, 'b': 2.0}", "returned dict for 2 completions"),
])
def test_a_bad_return_or_error_is_named_with_its_row(tmp_path, body, expected):
    functions = _load(tmp_path, body)
    with pytest.raises(RewardError) as caught:
        compute_rewards(functions, ["p", "q"], ["a", "b"], [[1], [2]], {}, ["a.jsonl:3", "a.jsonl:4"])
    assert expected in str(caught.value)


def test_arrays_and_tuples_of_numbers_count_as_lists(tmp_path):
    pytest.importorskip("numpy")
    (tmp_path / "arrays.py").write_text("import numpy\n"
                                        "def a(prompts, completions, completion_ids, **kw):\n"
                                        "    return numpy.array([0.5, 1.0], dtype=numpy.float32)\n"
                                        "def t(prompts, completions, completion_ids, **kw):\n"
                                        "    return (True, None)\n")
    functions = load_reward_functions([f"{tmp_path / 'arrays.py'}:a", f"{tmp_path / 'arrays.py'}:t"], answer_tag="x")
    values = compute_rewards(functions, ["p", "q"], ["a", "b"], [[1], [2]], {}, ["r", "r"])
    assert values[:, 0].tolist() == [0.5, 1.0] and values[0, 1].item() == 1.0 and math.isnan(values[1, 1].item())


def test_math_answer_compares_values_inside_the_tag():
    pytest.importorskip("math_verify")
    (math_answer,) = load_reward_functions(["math_answer"], answer_tag="answer")
    completions = ["So <answer>19</answer>", "<answer>20</answer>", "I think 0.5", "<answer>\\frac{1}{2}</answer>",
                   "no answer", "<answer>7</answer>"]
    answers = ["19", "19", "1/2", "0.5", "3", None]
    values = compute_rewards([math_answer], [""] * 6, completions, [[1]] * 6, {"answer": answers}, ["r"] * 6)
    assert values[:5, 0].tolist() == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert math.isnan(values[5, 0].item())
    chat = [[{"role": "assistant", "content": "<answer>4</answer>"}]]
    assert compute_rewards([math_answer], [[]], chat, [[1]], {"answer": ["4"]}, ["r"])[0, 0].item() == 1.0


def test_format_needs_a_non_empty_answer_inside_the_tag():
    (fmt,) = load_reward_functions(["format"], answer_tag="final")
    values = compute_rewards([fmt], [""] * 4, ["<final>4</final>", "<final> </final>", "4", "<final>4"],
                             [[1]] * 4, {}, ["r"] * 4)
    assert values[:, 0].tolist() == [1.0, 0.0, 0.0, 0.0]
