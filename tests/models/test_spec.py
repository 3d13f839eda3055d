"""The model spec (models/common/spec.py): the registry finds Llama's by flavor, model, args and config.json;
what it declares holds for the model it builds; and the packages that read specs import no model
folder and no module of theirs imports itself back."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from weft.models import (
    ALL_SPECS,
    MODEL_SPECS,
    flavors,
    spec_for_args,
    spec_for_flavor,
    spec_for_hf_config,
    spec_for_model,
)
from weft.parallelisms.pipeline import split_model
from weft.parallelisms.plans import path_matches

from tests.support.import_graph import ROOT, find_cycle, import_graph, imported_modules, module_files, module_name


def outside_models() -> dict[str, Path]:
    """weft module name -> file, for every module outside models/ and tests/: the packages, the
    entry points (train.py, generate.py), benchmarks/, assets/, and any folder added later."""
    files = (path for path in sorted(ROOT.rglob("*.py")) if not any(part.startswith(".") for part in path.parts))
    return {module_name(path): path for path in files if path.relative_to(ROOT).parts[0] not in ("models", "tests")}


def family_folders() -> set[str]:
    """The folder (package) of each registered family: where its spec's model class is defined."""
    return {spec.model_type.__module__.rpartition(".")[0] for spec in ALL_SPECS}


def test_graph_reader_sees_lazy_imports_and_cycles():
    """The reader itself: an import inside a function is an edge, and a two-module circle is found."""
    graph = import_graph()
    assert "weft.recipe.build" in graph["weft.recipe.dry_run"]  # imported inside stage_estimates
    assert "weft.models" in graph["weft.components.hf.adapters"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def family_imports(files: dict[str, Path]) -> list[str]:
    """'module imports weft.models.<family>...' for each import of a family folder by these files."""
    known, families = set(module_files()), family_folders()
    return [f"{name} imports {target}" for name, path in files.items()
            for target in sorted(imported_modules(name, path, known))
            if any(target == family or target.startswith(f"{family}.") for family in families)]


def family_questions(files: dict[str, Path]) -> list[str]:
    """'module:line ...' for each comparison with a family's name (`spec.name == "Llama 4"`) and each
    getattr/hasattr probe of an attribute some family's ModelArgs has and another's lacks
    (`getattr(args, "n_experts", 0)`) in these files: questions for the spec's fields. The names
    include the transformers backend's ("transformers": a test of `backend == "transformers"` is a
    question for its spec's `Backend`); the attributes are weft's families' (the backend's args are a
    config.json, whose fields the transforms read off transformers' model, `model.config`)."""
    names = {spec.name for spec in ALL_SPECS}
    attributes = [{a for a in dir(spec.args_type) if not a.startswith("_")}
                  | {f.name for f in dataclasses.fields(spec.args_type)} for spec in MODEL_SPECS]
    family_only = set.union(*attributes) - set.intersection(*attributes)
    found = []
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value in names for c in [node.left, *node.comparators]):
                found.append(f"{name}:{node.lineno} compares with a family's name")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in family_only):
                found.append(f"{name}:{node.lineno} probes {node.args[1].value!r}")
    return found


def test_nothing_outside_models_reaches_a_family_but_through_its_spec():
    """Every module outside models/ (and tests/) finds a model in the spec registry: it imports no
    family folder, and asks the spec what differs between families."""
    assert family_folders() == {"weft.models.llama", "weft.models.llama4", "weft.models.qwen3", "weft.models.gpt_oss",
                                "weft.models.transformers"}
    assert {"weft.train", "weft.generate", "weft.recipe.plan", "weft.benchmarks.memory_check",
            "weft.assets.make_corpus"} <= set(outside_models())
    assert not family_imports(outside_models()), "\n".join(family_imports(outside_models()))
    assert not family_questions(outside_models()), "\n".join(family_questions(outside_models()))


def test_the_guard_finds_a_family_import_a_name_check_and_a_probe(tmp_path):
    source = tmp_path / "bad.py"
    source.write_text("from weft.models.llama4.args import ModelArgs\n"
                      "from weft.models import llama\n"
                      "dense = spec.name != 'Llama 4'\n"
                      "experts = getattr(args, 'n_experts', 0) + getattr(args, 'dim', 0)\n"
                      "from weft.models.transformers.spec import TRANSFORMERS_SPEC\n"
                      "if spec.backend != 'transformers': pass\n")
    assert family_imports({"weft.bad": source}) == ["weft.bad imports weft.models.llama",
                                                    "weft.bad imports weft.models.llama4.args",
                                                    "weft.bad imports weft.models.transformers.spec"]
    assert sorted(family_questions({"weft.bad": source})) == ["weft.bad:3 compares with a family's name",
                                                              "weft.bad:4 probes 'n_experts'",
                                                              "weft.bad:6 compares with a family's name"]


def test_no_import_cycle_among_the_packages():
    assert find_cycle(import_graph()) is None


# ---------------------------------------------------------------------------------------------
# The registry and what Llama's spec declares
# ---------------------------------------------------------------------------------------------


def test_registry_finds_the_spec_by_flavor_args_model_and_config():
    spec = spec_for_flavor("debugmodel")
    args = flavors()["debugmodel"]
    assert spec_for_args(args) is spec
    with torch.device("meta"):
        model = spec.build(args)
    assert spec_for_model(model) is spec
    assert spec_for_model(torch.nn.Linear(2, 2)) is None
    assert spec_for_hf_config(spec.hf.hf_config(args, torch.float32)) is spec
    with pytest.raises(KeyError, match="unknown flavor 'nope'"):
        spec_for_flavor("nope")
    assert len(flavors()) == sum(len(s.flavors) for s in MODEL_SPECS)  # no flavor name twice


@pytest.mark.parametrize("flavor", ["debugmodel", "llama3_1b", "llama3_8b"])
def test_llama_spec_declarations_hold_for_the_model_it_builds(flavor):
    """Pipeline units hold every parameter once, in forward order; every TP plan entry names a
    module; names go to Hugging Face's and back; the config.json reads back as the same model."""
    spec = spec_for_flavor(flavor)
    args = spec.flavors[flavor]
    with torch.device("meta"):
        model = spec.build(args)
    units = spec.pipeline_units(model)
    owned = [param for unit in units for module in unit for param, _ in model.get_submodule(module).named_parameters()]
    assert len(owned) == len({id(p) for p in model.parameters()}) + args.tie_embeddings
    assert units[0] == ["tok_embeddings"] and units[-1] == ["norm", "output"]
    modules = [name for name, _ in model.named_modules() if name]
    for entry in spec.tp_plan(model):
        assert any(path_matches(name, entry) for name in modules), entry
    for name, _ in model.named_parameters():
        assert spec.hf.hf_to_weft_name(spec.hf.weft_to_hf_name(name)) == name
    back = spec.hf.args_from_hf_config(spec.hf.hf_config(args, torch.bfloat16))
    assert spec.hf.architecture_fields(spec.hf.hf_config(back, torch.bfloat16)) == spec.hf.architecture_fields(
        spec.hf.hf_config(args, torch.bfloat16))


def test_a_pipeline_stage_keeps_its_spec_and_its_units():
    spec = spec_for_flavor("debugmodel")
    with torch.device("meta"):
        model = spec.build(spec.flavors["debugmodel"])
    first, last = split_model(model, [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]])
    assert spec_for_model(last) is spec
    assert spec.pipeline_units(last)[1:-1] == [["layers.2"], ["layers.3"]]


def test_llama_flops_per_token_is_six_per_matmul_parameter_plus_attention():
    """Against a count taken from the built model: every weight a token multiplies (all but the
    embedding lookup, norms included as the formula does), 6 FLOPs each, plus 12·L·H·Q·T."""
    spec = spec_for_flavor("debugmodel")
    args = spec.flavors["debugmodel"]
    model = spec.build(args)
    in_matmuls = sum(p.numel() for n, p in model.named_parameters() if n != "tok_embeddings.weight")
    n_params = sum(p.numel() for p in model.parameters())
    seq_len = 64
    expected = 6 * in_matmuls + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    assert spec.flops_per_token(args, n_params, seq_len) == expected
    blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers."))
    assert spec.block_numel(args) * args.n_layers == blocks


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_what_a_spec_says_of_its_family_holds_for_the_model_it_builds(flavor):
    """experts() and active_parameters against the built model: its MoE layers (router
    width, top_k, expert widths), its parameters (the active ones: all but the routed experts' share
    a token skips)."""
    from weft.components.observe.metrics import active_parameters
    from weft.models.common.moe import MoE

    spec = spec_for_flavor(flavor)
    args = spec.flavors[flavor]
    with torch.device("meta"):
        model = spec.build(args)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    experts = spec.experts(args)
    total = sum(p.numel() for p in model.parameters())
    if not moes:
        assert experts is None and active_parameters(model) == total
    else:
        assert {(m.router.out_features, m.top_k) for m in moes} == {(experts.n_experts, experts.top_k)}
        assert experts.routed_slots == len(moes) * experts.top_k / args.n_layers
        widths = {m.experts.w1.shape[1] for m in moes}  # [experts, hidden, dim]
        assert experts.routed_hidden_dim == len(moes) * experts.top_k * widths.pop() // args.n_layers
        routed = sum(p.numel() for m in moes for p in m.experts.parameters())
        assert active_parameters(model) == total - routed + routed * experts.top_k // experts.n_experts
