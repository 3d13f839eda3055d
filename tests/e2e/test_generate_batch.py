"""`weft generate --prompts FILE --out FILE`: a line per prompt in input order, -n, the draws the same
whatever the batch size or the number of ranks, chat prompts rendered with the template, and the bad
inputs that end the command in one line and leave --out as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from weft.components.data import HFTokenizer
from weft.components.hf import model_args_from_hf_folder
from weft.generate import load_model, main

from tests.support.dist_utils import free_port
from tests.support.hf_folders import tiny_hf_folder
from tests.support.hf_tokenizer import build_tokenizer_folder

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
TEXTS = ["ROMEO:", "Who's there? Nay, answer me: stand, and unfold yourself.", "O", "To be, or not to be",
         "Long live the king!"]
CHAT = [{"role": "system", "content": "Answer in verse."}, {"role": "user", "content": "Who's there?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny random Llama (the debug model's shape) with a Llama 3-style tokenizer and chat template."""
    root = tmp_path_factory.mktemp("generate_batch")
    return tiny_hf_folder(root / "hf", build_tokenizer_folder(root / "tok"))


@pytest.fixture(scope="module")
def model(folder):
    return load_model(model_args_from_hf_folder(folder), hf=str(folder), checkpoint=None,
                      device=torch.device("cpu"), dtype=torch.float32).eval()


def greedy(model, ids: list[int], tokens: int, stop_ids) -> list[int]:
    """The reference: the most likely token, the whole context recomputed for each, until a stop id."""
    new: list[int] = []
    with torch.no_grad():
        while len(new) < tokens and not (new and new[-1] in stop_ids):
            new.append(int(model(torch.tensor([ids + new]))[0, -1].argmax()))
    return new


def write_prompts(path: Path, prompts: list) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def run(folder: Path, prompts: Path, out: Path, *flags: str) -> list[dict]:
    assert main(["--hf", str(folder), "--prompts", str(prompts), "--out", str(out), *flags]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_greedy_lines_follow_the_input_order_and_equal_the_recomputed_reference(tmp_path, folder, model):
    """Text and chat prompts of different lengths, decoded in batches of 2 (longest first inside the
    engine): each line is its prompt's, in input order, with the reference's tokens, its text
    decoded without the closing stop token, and why it stopped."""
    tokenizer = HFTokenizer(folder)
    prompts = write_prompts(tmp_path / "prompts.jsonl", [*TEXTS, CHAT])
    lines = run(folder, prompts, tmp_path / "out.jsonl", "--max-completion-length", "12", "--batch-size", "2")
    assert [line["prompt"] for line in lines] == [*TEXTS, CHAT]
    for line, prompt in zip(lines, [*TEXTS, CHAT]):
        ids = (tokenizer.encode(prompt, bos=True, eos=False) if isinstance(prompt, str)
               else tokenizer.encode_chat(prompt, add_generation_prompt=True))
        expected = greedy(model, ids, 12, tokenizer.stop_ids)
        [completion] = line["completions"]
        assert completion["token_ids"] == expected
        stopped = expected[-1] in tokenizer.stop_ids
        assert completion["finish_reason"] == ("stop" if stopped else "length")
        assert completion["text"] == tokenizer.decode(expected[:-1] if stopped else expected)
    assert len({tuple(line["completions"][0]["token_ids"]) for line in lines}) > 1


def test_n_completions_drawn_the_same_at_every_batch_size(tmp_path, folder):
    """-n 3 sampled: three completions per prompt, not all alike; the file is the same to the byte
    whether 1, 4 or all 15 sequences decode together (each completion draws from its own seed)."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", TEXTS)
    flags = ["-n", "3", "--max-completion-length", "8", "--temperature", "1.0", "--top-k", "50", "--seed", "5"]
    files = []
    for size in ("1", "4", "15"):
        run(folder, prompts, tmp_path / f"out{size}.jsonl", *flags, "--batch-size", size)
        files.append((tmp_path / f"out{size}.jsonl").read_bytes())
    assert files[0] == files[1] == files[2]
    lines = [json.loads(line) for line in files[0].decode().splitlines()]
    assert all(len(line["completions"]) == 3 for line in lines)
    assert any(len({tuple(c["token_ids"]) for c in line["completions"]}) > 1 for line in lines)
    other = run(folder, prompts, tmp_path / "seed6.jsonl", *flags, "--seed", "6")
    assert other != lines


def test_a_stop_string_ends_the_completion_with_the_token_that_completes_it(tmp_path, folder, model):
    tokenizer = HFTokenizer(folder)
    ids = tokenizer.encode(TEXTS[1], bos=True, eos=False)
    reference = greedy(model, ids, 10, tokenizer.stop_ids)
    stop = next(text for t in reference if (text := tokenizer.decode([t]).strip()))  # ids past the tokenizer's: ""
    end = next(k for k in range(1, 11) if stop in tokenizer.decode(reference[:k]))
    lines = run(folder, write_prompts(tmp_path / "p.jsonl", [TEXTS[1]]), tmp_path / "out.jsonl",
                "--max-new-tokens", "10", "--stop", stop)
    assert lines[0]["completions"] == [{"text": tokenizer.decode(reference[:end]), "token_ids": reference[:end],
                                        "finish_reason": "stop"}]


BAD_LINES = [
    ('{"prompt": ""}', "2: the prompt is empty"),
    ("not json", "2: expected a line of JSON"),
    ('{"text": "ROMEO:"}', "2: expected a JSON object with a 'prompt'"),
    ("", "2: expected a line of JSON"),
    ('{"prompt": []}', "2: the prompt is an empty list"),
    ('{"prompt": [{"role": "king", "content": "x"}]}', "2: prompt[0] has unknown role 'king'"),
    ('{"prompt": [{"role": "user"}]}', "2: prompt[0] must be an object with a string 'content'"),
    (json.dumps({"prompt": "ROMEO " * 1100}), "2: the prompt's "),  # then its length, beyond max_seq_len 2048
]
BAD_FLAGS = [
    (["--max-completion-length", "0"], "--max-completion-length: must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "--max-completion-length: must be >= 1, got 0"),
    (["--max-completion-length", "2048"], "1: the prompt's 7 tokens plus max_completion_length 2048 make 2055, beyond the model's "
                                              "context (max_seq_len 2048)"),
    (["-n", "0"], "-n: must be >= 1, got 0"),
    (["--top-p", "0"], "--top-p: must be > 0, got 0.0"),
    (["--top-p", "1.5"], "--top-p: must be <= 1, got 1.5"),
    (["--min-p", "-0.1"], "--min-p: must be >= 0, got -0.1"),
    (["--min-p", "1.5"], "--min-p: must be <= 1, got 1.5"),
    (["--stop", "END", "--stop", ""], "--stop: must be a list of non-empty strings, got ['END', '']"),
    (["--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
    (["--chat"], "--chat and --system apply to --prompt"),
]


@pytest.mark.parametrize("line, message", BAD_LINES, ids=[m.split(": ")[1][:24] for _, m in BAD_LINES])
def test_a_bad_prompts_line_is_named_by_file_and_line_and_nothing_is_written(tmp_path, folder, capsys, line, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "ROMEO:"}) + "\n" + line + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text("keep\n")
    argv = ["--hf", str(folder), "--prompts", str(prompts), "--out", str(out), "--max-completion-length", "1000"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"weft: error: {prompts}:{message}") and err.count("\n") == 1
    assert out.read_text() == "keep\n" and sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "prompts.jsonl"]


@pytest.mark.parametrize("flags, message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_line_and_nothing_is_written(tmp_path, folder, capsys, flags, message):
    prompts = write_prompts(tmp_path / "prompts.jsonl", ["ROMEO:"])
    out = tmp_path / "out.jsonl"
    out.write_text("keep\n")
    try:
        status = main(["--hf", str(folder), "--prompts", str(prompts), "--out", str(out), *flags])
    except SystemExit as exit_info:
        status = exit_info.code
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("weft: error: ")
    assert message in err
    assert out.read_text() == "keep\n" and sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "prompts.jsonl"]


def test_an_empty_prompt_or_file_is_one_line(tmp_path, folder, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["--hf", str(folder), "--prompts", str(empty), "--out", str(tmp_path / "out.jsonl")]) == 2
    assert capsys.readouterr().err == f"weft: error: {empty}: no prompts; expected one JSON object with a 'prompt' a line\n"
    with pytest.raises(SystemExit) as exit_info:
        main(["--hf", str(folder), "--prompt", ""])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "weft: error: --prompt: empty; expected the text to continue\n"
    for argv in (["--out", str(tmp_path / "out.jsonl"), "--prompt", "x"], ["--prompts", str(empty)]):
        with pytest.raises(SystemExit):
            main(["--hf", str(folder), *argv])
        assert capsys.readouterr().err.startswith("weft: error: --prompts and --out go together")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]


@pytest.mark.slow
def test_two_ranks_write_the_file_one_process_writes(tmp_path, folder):
    """torchrun, 2 CPU ranks on gloo: each completes its half of 6 prompts (3 completions each,
    sampled), rank 0 writes the file; it is the one-process file to the byte. With one prompt, rank 1
    has none and steps along with rank 0."""
    logs = {}
    for name, texts in (("six", [*TEXTS, CHAT]), ("one", TEXTS[:1])):
        prompts = write_prompts(tmp_path / f"{name}.jsonl", texts)
        flags = ["-n", "3", "--max-completion-length", "6", "--temperature", "0.9", "--seed", "2"]
        run(folder, prompts, tmp_path / f"{name}_one_rank.jsonl", *flags)
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                 "--master_port", str(free_port()), "-m", "weft", "generate", "--hf", str(folder),
                                 "--prompts", str(prompts), "--out", str(tmp_path / f"{name}_two_ranks.jsonl"), *flags],
                                cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        logs[name] = result.stdout
        two = (tmp_path / f"{name}_two_ranks.jsonl").read_bytes()
        assert two == (tmp_path / f"{name}_one_rank.jsonl").read_bytes() and two.count(b"\n") == len(texts)
    assert "generate: 6 prompts x 3 completions over 2 ranks (3 prompts on rank 0)" in logs["six"]
    assert "generate: 1 prompts x 3 completions over 2 ranks (0 prompts on rank 0)" in logs["one"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{name}{end}" for name in ("six", "one") for end in (".jsonl", "_one_rank.jsonl", "_two_ranks.jsonl"))
