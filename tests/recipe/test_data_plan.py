"""recipe/data_plan.py: the files of data.dataset_path or of each data.mixture source, checked before
anything starts; a bad mixture entry is one line naming it, exit 2, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weft import train
from weft.components.config import parse_args
from weft.components.data import DataError, Tokenizer
from weft.components.data.fingerprint import DataChangedError
from weft.recipe.data_plan import plan_data
from weft.recipe.plan import tokenizer_path

from tests.support import REPO
from tests.support.failure_checks import assert_clean_failure, run_in_process


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Two sources (folders of text files) and a validation folder for each."""
    root = tmp_path_factory.mktemp("corpus")
    for name in ("web", "code", "web_val", "code_val"):
        (root / name).mkdir()
        for i in range(2):
            (root / name / f"{i}.txt").write_text(f"{name} text {i}\n" * 30)
    return root


def config(corpus: Path, *overrides: str):
    return parse_args(["--job.config_file", "debug_model", "--job.dump_folder", str(corpus / "out"),
                       "--data.mixture", f"{corpus / 'web'}:3,{corpus / 'code'}:1", *overrides])


def test_a_mixture_plans_each_source_and_fingerprints_its_files_by_source(corpus, tmp_path):
    cfg = config(corpus, "--validation.enable", "--validation.mixture", f"{corpus / 'web_val'},{corpus / 'code_val'}")
    tokenizer = Tokenizer(REPO / "assets/tokenizer/shakespeare.model")
    data = plan_data(cfg, tokenizer, tokenizer_path(cfg), None)
    assert [(s.name, s.weight, [p.name for p in s.files]) for s in data.sources] == [
        ("web", 3.0, ["0.txt", "1.txt"]), ("code", 1.0, ["0.txt", "1.txt"])]
    assert [s.validation_files[0].parent.name for s in data.sources] == ["web_val", "code_val"]
    assert data.files == data.sources[0].files + data.sources[1].files
    assert sorted(json.loads(data.fingerprint)) == ["code/0.txt", "code/1.txt", "web/0.txt", "web/1.txt"]

    saved = tmp_path / "step-2"
    saved.mkdir()
    (saved / "data_fingerprint.json").write_text(data.fingerprint)
    edited = tmp_path / "code"
    edited.mkdir()
    for i in range(2):
        (edited / f"{i}.txt").write_text((corpus / "code" / f"{i}.txt").read_text() + ("more\n" if i else ""))
    changed = parse_args(["--job.config_file", "debug_model", "--data.mixture", f"{corpus / 'web'}:3,{edited}:1"])
    with pytest.raises(DataChangedError, match=r"data.mixture = .*: file code/1.txt changed"):
        plan_data(changed, tokenizer, tokenizer_path(cfg), saved)


@pytest.mark.parametrize("entries, expected", [
    (["{web}:3", "{code}:0"], "data.mixture: entry '{code}:0': weight 0; expected a finite number > 0"),
    (["{web}:3", "{code}:-1"], "data.mixture: entry '{code}:-1': weight -1; expected a finite number > 0"),
    (["{web}:3", "{root}/missing:1"], "data.mixture entry '{root}/missing:1': no file or folder at '{root}/missing'"),
    (["{web}", "{code}:1"], "data.mixture: entry '{web}': expected PATH:WEIGHT"),
])
def test_a_bad_mixture_entry_is_one_line_naming_it(corpus, capsys, entries, expected):
    dump = corpus / "out"
    fill = {"web": corpus / "web", "code": corpus / "code", "root": corpus}
    mixture = ",".join(entry.format(**fill) for entry in entries)
    outcome = run_in_process(train.main, ["--job.config_file", "debug_model", "--job.dump_folder", str(dump),
                                          "--data.mixture", mixture, "--training.steps", "1"], capsys)
    assert_clean_failure(outcome, expected.format(**fill))
    assert not dump.exists()


@pytest.mark.parametrize("overrides, expected", [
    (["--validation.enable", "--validation.mixture", "{web_val}"],
     "validation.mixture: 1 paths for the 2 sources of data.mixture; expected one per source"),
    (["--validation.enable"], "validation.dataset_path: required when validation.enable is set (or validation.mixture"),
])
def test_validation_of_a_mixture_needs_one_path_per_source(corpus, capsys, overrides, expected):
    fill = {"web_val": corpus / "web_val"}
    outcome = run_in_process(train.main, ["--job.config_file", "debug_model", "--job.dump_folder", str(corpus / "out"),
                                          "--data.mixture", f"{corpus / 'web'}:3,{corpus / 'code'}:1",
                                          *(o.format(**fill) for o in overrides)], capsys)
    assert_clean_failure(outcome, expected)


def test_validation_mixture_without_a_data_mixture_is_refused(corpus, capsys):
    outcome = run_in_process(train.main, ["--job.config_file", "debug_model", "--job.dump_folder", str(corpus / "out"),
                                          "--validation.enable", "--validation.mixture", str(corpus / "web_val")],
                             capsys)
    assert_clean_failure(outcome, "validation.mixture: one validation path per source of data.mixture, which is "
                                  "not set")


def test_the_dry_run_checks_the_entries_as_written_without_their_files():
    """A plan without the environment (the dry run's) refuses a bad weight or count, but not a path
    that exists only on the cluster."""
    from weft.components.data import DataError
    from weft.recipe.plan import RunPlan

    def plan(*overrides: str) -> RunPlan:
        cfg = parse_args(["--job.config_file", "debug_model", *overrides])
        return RunPlan.from_config(cfg, 1, device_type="cpu", check_environment=False)

    assert plan("--data.mixture", "/cluster/web:3,/cluster/code:1").data_sources == []
    with pytest.raises(DataError, match="entry '/cluster/code:-2': weight -2"):
        plan("--data.mixture", "/cluster/web:3,/cluster/code:-2")
    with pytest.raises(Exception, match="validation.mixture: 1 paths for the 2 sources"):
        plan("--data.mixture", "/cluster/web:3,/cluster/code:1", "--validation.enable", "--validation.mixture", "/v")


def test_compressed_text_sources_and_validation_are_planned_and_a_cut_one_refused(tmp_path):
    """Folders of .txt.gz and .txt.zst files, as mixture sources and validation folders, are
    planned and fingerprinted as .txt folders are; a cut one among them is refused, naming it,
    before anything starts; a changed one is noticed on resume."""
    import gzip

    zstandard = pytest.importorskip("zstandard")
    compress = {"gz": gzip.compress, "zst": zstandard.ZstdCompressor(write_checksum=True).compress}
    for name, suffix in (("web", "gz"), ("code", "zst"), ("web_val", "zst"), ("code_val", "gz")):
        (tmp_path / name).mkdir()
        for i in range(2):
            (tmp_path / name / f"{i}.txt.{suffix}").write_bytes(compress[suffix](f"{name} text {i}\n".encode() * 30))
    cfg = config(tmp_path, "--validation.enable", "--validation.mixture",
                 f"{tmp_path / 'web_val'},{tmp_path / 'code_val'}")
    tokenizer = Tokenizer(REPO / "assets/tokenizer/shakespeare.model")
    data = plan_data(cfg, tokenizer, tokenizer_path(cfg), None)
    assert [(s.name, [p.name for p in s.files], [p.name for p in s.validation_files]) for s in data.sources] == [
        ("web", ["0.txt.gz", "1.txt.gz"], ["0.txt.zst", "1.txt.zst"]),
        ("code", ["0.txt.zst", "1.txt.zst"], ["0.txt.gz", "1.txt.gz"])]
    assert sorted(json.loads(data.fingerprint)) == ["code/0.txt.zst", "code/1.txt.zst", "web/0.txt.gz", "web/1.txt.gz"]

    saved = tmp_path / "step-2"
    saved.mkdir()
    (saved / "data_fingerprint.json").write_text(data.fingerprint)
    (tmp_path / "code" / "1.txt.zst").write_bytes(compress["zst"](b"other text\n" * 30))
    with pytest.raises(DataChangedError, match=r"data.mixture = .*: file code/1.txt.zst changed"):
        plan_data(cfg, tokenizer, tokenizer_path(cfg), saved)

    cut = tmp_path / "code_val" / "1.txt.gz"
    cut.write_bytes(cut.read_bytes()[:-12])
    with pytest.raises(DataError, match=rf"^{cut}: cannot decompress \(Compressed file ended before"):
        plan_data(cfg, tokenizer, tokenizer_path(cfg), None)
