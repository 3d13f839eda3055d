"""Online RL runs (training.objective = grpo) through train.py: the shipped debug_grpo raises the reward
of held-out prompts; rollouts.jsonl holds every trained completion with advantages that a plain
computation of TRL's formula gives from its rewards; the metrics carry TRL's names; a stopped run
resumes bit for bit; GRPO starts from a weft checkpoint and from a Hugging Face folder with chat
prompts (then exported); and every bad input is refused in one line with exit 2, nothing written."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from weft import train

from tests.support import REPO
from tests.support.chat_data import write_jsonl
from tests.support.failure_checks import assert_clean_failure, run_in_process, snapshot
from tests.support.train_runs import run

STEPS = 40


def grpo_args(dump: Path, *extra: str, steps: int = 4) -> list[str]:
    return ["--job.config_file", "debug_grpo", "--job.dump_folder", str(dump), "--training.steps", str(steps),
            "--no-metrics.enable_tensorboard", *extra]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def debug_run(tmp_path_factory) -> Path:
    """The shipped debug_grpo, whole (40 steps, about 10 s)."""
    dump = tmp_path_factory.mktemp("grpo") / "run"
    run(grpo_args(dump, steps=STEPS))
    return dump


def test_debug_grpo_raises_the_reward_of_held_out_prompts(debug_run):
    records = read_jsonl(debug_run / "metrics.jsonl")
    first = next(r for r in records if r["step"] == 1 and "reward" in r)
    validations = [r for r in records if "validation/reward" in r]
    assert [r["step"] for r in validations] == [10, 20, 30, 40]
    assert first["reward"] < 0.1  # a model from scratch writes almost no digits
    assert validations[-1]["validation/reward"] > 0.8, validations  # held-out sums, answered in digits


def test_metrics_carry_trl_s_names(debug_run):
    record = next(r for r in read_jsonl(debug_run / "metrics.jsonl") if r["step"] == 5 and "reward" in r)
    for name in ("reward", "reward_std", "frac_reward_zero_std", "rewards/digits/mean", "rewards/digits/std",
                 "rewards/exact/mean", "completions/mean_length", "completions/min_length",
                 "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length",
                 "entropy", "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean",
                 "clip_ratio/high_max", "clip_ratio/region_mean", "num_tokens", "generation_share",
                 "train/grad_norm", "train/loss"):
        assert name in record, name
    assert "kl" not in record  # beta 0: no reference
    assert 0 < record["generation_share"] < 1
    assert record["entropy"] > 0


def test_rollouts_hold_every_completion_and_advantages_from_their_rewards(debug_run):
    lines = read_jsonl(debug_run / "rollouts.jsonl")
    assert len(lines) == STEPS * 16
    assert sorted({line["step"] for line in lines}) == list(range(1, STEPS + 1))
    prompts = {json.loads(row)["prompt"] for row in (REPO / "assets/data/arithmetic/train.jsonl").read_text().splitlines()}
    for start in range(0, len(lines), 4):  # a prompt's 4 completions together
        group = lines[start:start + 4]
        assert len({line["prompt"] for line in group}) == 1 and group[0]["prompt"] in prompts
        rewards = [line["reward"] for line in group]
        for line in group:
            assert line["reward"] == pytest.approx(line["rewards"]["digits"] + line["rewards"]["exact"], abs=1e-6)
            assert 1 <= len(line["completion_ids"]) <= 6
            assert line["finish_reason"] in ("stop", "length")
            assert (len(line["completion_ids"]) == 6) == (line["finish_reason"] == "length") or \
                line["finish_reason"] == "stop"
            expected = (line["reward"] - statistics.fmean(rewards)) / (statistics.stdev(rewards) + 1e-4)
            assert line["advantage"] == pytest.approx(expected, abs=1e-4)


def test_a_stopped_run_resumes_bit_for_bit(tmp_path):
    args = ("--checkpoint.enable", "--checkpoint.interval", "2", "--validation.enable", "false")
    whole = run(grpo_args(tmp_path / "whole", *args))
    run(grpo_args(tmp_path / "stopped", *args), stop_after=2)
    assert len(read_jsonl(tmp_path / "stopped" / "rollouts.jsonl")) == 2 * 16
    resumed = run(grpo_args(tmp_path / "stopped", *args))
    assert resumed == whole[2:]
    assert (tmp_path / "stopped" / "rollouts.jsonl").read_text() == (tmp_path / "whole" / "rollouts.jsonl").read_text()
    norms = [[r["train/grad_norm"] for r in read_jsonl(tmp_path / name / "metrics.jsonl") if "train/grad_norm" in r]
             for name in ("whole", "stopped")]
    assert norms[1][-2:] == norms[0][-2:]


def test_grpo_starts_from_a_weft_checkpoint(tmp_path):
    run(["--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path / "pretrain"), "--training.steps", "2",
         "--training.seq_len", "32", "--training.local_batch_size", "2", "--checkpoint.enable",
         "--checkpoint.interval", "2", "--no-metrics.enable_tensorboard"])
    losses = run(grpo_args(tmp_path / "rl", "--checkpoint.initial_load_path",
                           str(tmp_path / "pretrain" / "checkpoint" / "step-2"), "--validation.enable", "false", steps=2))
    assert len(losses) == 2
    assert len(read_jsonl(tmp_path / "rl" / "rollouts.jsonl")) == 2 * 16


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory) -> Path:
    """A tokenizer folder with a chat template, a tiny Llama folder, chat prompts and a reward of their own."""
    pytest.importorskip("transformers")
    from tests.support.hf_folders import tiny_hf_folder
    from tests.support.hf_tokenizer import build_tokenizer_folder

    root = tmp_path_factory.mktemp("grpo_hf")
    tiny_hf_folder(root / "policy", build_tokenizer_folder(root / "tok"))
    write_jsonl(root / "prompts.jsonl", [{"prompt": [{"role": "user", "content": f"Say {n}."}], "answer": str(n)}
                                         for n in range(8)])
    (root / "says.py").write_text(
        "def says(prompts, completions, completion_ids, answer, **kw):\n"
        "    assert isinstance(completions[0], list) and completions[0][0]['role'] == 'assistant'\n"
        "    return [float(a in c[0]['content']) + sum(i % 5 for i in ids) / len(ids) for c, a, ids in "
        "zip(completions, answer, completion_ids)]\n")
    return root


def hf_args(root: Path, dump: Path, *extra: str, start: str = "policy", steps: int = 2) -> list[str]:
    return grpo_args(dump, "--model.flavor", "from_hf_config", "--checkpoint.initial_load_path", str(root / start),
                     "--model.tokenizer_path", str(root / "tok"), "--data.dataset_path", str(root / "prompts.jsonl"),
                     "--rl.reward_functions", f"{root / 'says.py'}:says", "--rl.reward_weights", "1",
                     "--training.seq_len", "64", "--validation.enable", "false", *extra, steps=steps)


def test_chat_prompts_from_a_hugging_face_folder_train_and_export(hf_root, tmp_path):
    transformers = pytest.importorskip("transformers")
    run(hf_args(hf_root, tmp_path / "rl", "--export.hf_folder", "hf"))
    lines = read_jsonl(tmp_path / "rl" / "rollouts.jsonl")
    assert lines[0]["completion"][0]["role"] == "assistant" and isinstance(lines[0]["prompt"], list)
    assert set(lines[0]["rewards"]) == {"says"}
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "rl" / "hf")
    assert model.config.model_type == "llama"


def test_the_transformers_backend_trains_the_folder_as_weft_s_llama_does(hf_root, tmp_path):
    """The same folder through transformers' modeling code: the same completions (rewards), loss within
    1e-5 and gradient norm within its fp32 rounding (tests/parallelisms/test_grpo_parity.py), at each step."""
    run(hf_args(hf_root, tmp_path / "weft"))
    run(hf_args(hf_root, tmp_path / "transformers", "--model.backend", "transformers"))
    ours, theirs = (read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("weft", "transformers"))
    assert len(ours) == len(theirs) == 2
    for a, b in zip(ours, theirs):
        assert a["reward"] == pytest.approx(b["reward"], abs=1e-6) and a["reward_std"] > 0
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-5)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=2e-4)


def test_grpo_starts_from_an_sft_run_s_export(hf_root, tmp_path):
    """train -> export -> online RL from the export: the folder an SFT run wrote is a valid start."""
    write_jsonl(tmp_path / "sft.jsonl", [{"prompt": f"Say {n}.", "completion": f" {n}"} for n in range(16)])
    run(["--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path / "sft"), "--model.flavor",
         "from_hf_config", "--checkpoint.initial_load_path", str(hf_root / "policy"), "--model.tokenizer_path",
         str(hf_root / "tok"), "--data.format", "prompt_completion", "--data.dataset_path", str(tmp_path / "sft.jsonl"),
         "--training.steps", "2", "--training.seq_len", "32", "--training.local_batch_size", "2",
         "--export.hf_folder", "hf", "--no-metrics.enable_tensorboard"])
    root = tmp_path / "root"
    root.mkdir()
    for name in ("tok", "prompts.jsonl", "says.py"):
        (root / name).symlink_to(hf_root / name)
    (root / "policy").symlink_to(tmp_path / "sft" / "hf")
    assert len(run(hf_args(root, tmp_path / "rl", steps=1))) == 1
    assert len(read_jsonl(tmp_path / "rl" / "rollouts.jsonl")) == 16


BAD_REWARDS = {
    "raises": ("def f(prompts, completions, completion_ids, **kw):\n    raise KeyError('solution')\n",
               ["reward function f raised KeyError", "train.jsonl:"]),
    "counts": ("def f(prompts, completions, completion_ids, **kw):\n    return [1.0]\n",
               ["reward function f returned 1 values for", "expected one number or None per completion"]),
    "text": ("def f(prompts, completions, completion_ids, **kw):\n    return ['high'] * len(completions)\n",
             ["reward function f returned 'high' for completion 0 of", "train.jsonl:"]),
    "import": ("import not_a_module_anywhere\n", ["does not import: ModuleNotFoundError"]),
}


@pytest.mark.parametrize("case", BAD_REWARDS)
def test_a_bad_reward_function_stops_the_run_in_one_line(tmp_path, capsys, case):
    source, expected = BAD_REWARDS[case]
    (tmp_path / "bad.py").write_text(source)
    dump = tmp_path / "run"
    before = snapshot(tmp_path)
    outcome = run_in_process(train.main, grpo_args(dump, "--rl.reward_functions", f"{tmp_path / 'bad.py'}:f",
                                                   "--rl.reward_weights", ""), capsys)
    assert_clean_failure(outcome, expected, before=before, root=tmp_path)


def test_bad_configs_and_prompts_are_refused_in_one_line(tmp_path, capsys):
    write_jsonl(tmp_path / "no_prompt.jsonl", [{"question": "1+1="}])
    write_jsonl(tmp_path / "long.jsonl", [{"prompt": "1+1=" * 20}])
    cases = [
        (["--data.dataset_path", str(tmp_path / "no_prompt.jsonl")], ["no_prompt.jsonl:1", "'prompt'"]),
        (["--data.dataset_path", str(tmp_path / "long.jsonl")], ["long.jsonl:1", "training.seq_len - max_completion_length"]),
        (["--rl.num_generations", "1"], ["rl.num_generations = 1", "at least 2"]),
        (["--rl.num_generations", "3"], ["rl.num_generations = 3", "multiple of num_generations"]),
        (["--rl.loss_type", "ppo"], ["rl.loss_type", "ppo"]),
        (["--rl.reward_functions", "nothing", "--rl.reward_weights", ""], ["rl.reward_functions", "'nothing'"]),
        (["--rl.reward_weights", "1,2,3"], ["rl.reward_weights", "3 weights for 2"]),
        (["--parallelism.pp", "2"], ["parallelism.pp"]),
        (["--data.format", "text"], ["data.format = text", "grpo"]),
    ]
    for extra, expected in cases:
        before = snapshot(tmp_path)
        outcome = run_in_process(train.main, grpo_args(tmp_path / "run", *extra), capsys)
        assert_clean_failure(outcome, expected, before=before, root=tmp_path)


@pytest.mark.parametrize("lora", [False, True], ids=["copy", "lora_adapters_off"])
def test_beta_adds_the_k3_kl_to_the_starting_weights(tmp_path, lora):
    """β > 0: the reference is the seeded start (a frozen copy; under LoRA the policy with its adapters off),
    so the policy's KL to it is 0 at step 1, where the two are one model, and grows once the policy moves."""
    extra = ["--lora.enable", "--lora.rank", "4", "--optimizer.lr", "0.02"] if lora else []
    run(grpo_args(tmp_path / "kl", "--rl.beta", "0.04", "--validation.enable", "false", *extra, steps=3))
    kl = [r["kl"] for r in read_jsonl(tmp_path / "kl" / "metrics.jsonl") if "kl" in r]
    assert kl[0] == 0.0 and kl[2] > 1e-5, kl


def test_accumulation_trains_the_step_one_micro_batch_does(tmp_path):
    """dapo's step over 2 micro-batches of 8 completions is the step over one of 16: the same completions,
    loss and gradient."""
    dense = ["--rl.reward_functions", f"{REPO / 'assets/rewards/arithmetic.py'}:digits", "--rl.reward_weights", "",
             "--validation.enable", "false", "--sampling.temperature", "1.5"]
    run(grpo_args(tmp_path / "one", *dense, steps=3))
    run(grpo_args(tmp_path / "two", *dense, "--training.local_batch_size", "8",
                  "--training.gradient_accumulation_steps", "2", steps=3))
    one, two = (read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("one", "two"))
    assert any(r["train/grad_norm"] > 0.01 for r in one)
    for a, b in zip(one, two):
        assert a["reward"] == b["reward"]
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=2e-4)


def test_a_round_serves_steps_per_generation_x_num_iterations_steps(tmp_path):
    """steps_per_generation 2, num_iterations 2: one round of 2 steps' prompts is sampled every 4 steps,
    its halves trained in turn twice; the ratio's denominator is then the engine's log-probabilities,
    equal to the policy's at the round's first step (nothing clipped there)."""
    reward = tmp_path / "spread.py"
    reward.write_text("def spread(prompts, completions, completion_ids, **kw):\n"
                      "    return [sum(i % 7 for i in ids) / len(ids) for ids in completion_ids]\n")
    run(grpo_args(tmp_path / "run", "--rl.steps_per_generation", "2", "--rl.num_iterations", "2",
                  "--rl.reward_functions", f"{reward}:spread", "--rl.reward_weights", "", "--validation.enable",
                  "false", "--optimizer.lr", "0.02", steps=8))
    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "generation_seconds" in r]
    assert [r["generation_seconds"] > 0 for r in records] == [True, False, False, False] * 2
    assert records[0]["reward"] == records[3]["reward"] and records[4]["reward"] != records[0]["reward"]
    assert records[0]["clip_ratio/region_mean"] == 0.0
    assert max(r["clip_ratio/region_mean"] for r in records) > 0  # later passes move past the clip
    lines = read_jsonl(tmp_path / "run" / "rollouts.jsonl")
    assert [line["step"] for line in lines] == [1] * 32 + [5] * 32  # a round's 2 steps of 16 completions
