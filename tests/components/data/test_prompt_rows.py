"""components/data/prompt_rows.py: prompt rows from JSONL, Parquet and Arrow with their other columns;
a bad row named by file:line (or row); the rounds of the prompt stream: each epoch every row once, in an
order drawn from the seed, the same after a restart from the saved state."""

from __future__ import annotations

import json

import pytest

from weft.components.data import DataError, load_tokenizer
from weft.components.data.prompt_rows import PromptRounds, read_prompt_rows

from tests.support import ASSETS

TOKENIZER = load_tokenizer(str(ASSETS / "tokenizer" / "shakespeare.model"))
ROWS = [{"prompt": f"{n}+1=", "answer": str(n + 1), "level": n % 3} for n in range(10)]


def test_jsonl_parquet_and_arrow_rows_read_alike(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table, tmp_path / "rows.parquet")
    feather.write_feather(table, tmp_path / "rows.arrow", compression="uncompressed")
    read = [read_prompt_rows([tmp_path / f"rows.{kind}"], TOKENIZER) for kind in ("jsonl", "parquet", "arrow")]
    for rows in read:
        assert [r.prompt for r in rows] == [r["prompt"] for r in ROWS]
        assert [r.columns for r in rows] == [{"answer": r["answer"], "level": r["level"]} for r in ROWS]
        assert rows[3].token_ids == TOKENIZER.encode("3+1=", bos=True, eos=False)
    assert read[0][2].where.endswith("rows.jsonl:3") and read[1][2].where.endswith("rows.parquet:row 2")


@pytest.mark.parametrize("line, expected", [
    ('{"question": "1+1="}', "rows.jsonl:2: expected a JSON object with a 'prompt'"),
    ('{"prompt": ""}', "rows.jsonl:2: the prompt is empty"),
    ("not json", "rows.jsonl:2: expected a line of JSON"),
    ('{"prompt": [{"role": "user", "content": "hi"}]}', "rows.jsonl:2: a chat prompt needs a tokenizer with a chat template"),
])
def test_a_bad_row_is_named_by_its_line(tmp_path, line, expected):
    (tmp_path / "rows.jsonl").write_text(json.dumps(ROWS[0]) + "\n" + line + "\n")
    with pytest.raises(DataError, match=expected):
        read_prompt_rows([tmp_path / "rows.jsonl"], TOKENIZER)


def test_a_parquet_file_without_a_prompt_column_is_refused(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": "1+1="}]), tmp_path / "rows.parquet")
    with pytest.raises(DataError, match="no 'prompt' column"):
        read_prompt_rows([tmp_path / "rows.parquet"], TOKENIZER)


def test_rounds_deal_every_row_once_an_epoch_and_resume_from_their_state(tmp_path):
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    rows = read_prompt_rows([tmp_path / "rows.jsonl"], TOKENIZER)
    stream = PromptRounds(rows, round_prompts=5, steps_per_round=2, micro_batches=2, seed=3)
    items = [next(stream) for _ in range(16)]  # 4 rounds of 2 steps of 2 micro-steps
    assert [(i.round, i.step_in_round, i.micro) for i in items[:5]] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
                                                                        (1, 0, 0)]
    first_epoch = [row.prompt for i in (items[0], items[4]) for _, row in i.prompts]
    assert sorted(first_epoch) == sorted(r["prompt"] for r in ROWS)  # each row once in epoch 0
    assert first_epoch != [r["prompt"] for r in ROWS]  # in a drawn order
    assert [index for index, _ in items[8].prompts] == list(range(10, 15))  # places in the stream: the seeds
    restarted = PromptRounds(rows, round_prompts=5, steps_per_round=2, micro_batches=2, seed=3)
    restarted.load_state_dict(PromptRounds(rows, 5, 2, 2, 3, taken=9).state_dict())
    assert next(restarted) == items[9]
