"""Training objectives: what a step computes from a batch, and what else a run needs for it.

An objective is a class registered by its name (training.objective). weft's own are next_token.py
(pretraining, SFT), preference.py (DPO, IPO, SimPO, ORPO), grpo.py (online RL) and distillation.py
(on-policy distillation), the last two sharing online.py; frozen.py is what an objective may ask for,
a frozen model (a reference, a teacher). `objective_class(cfg)` is the one place that chooses: `auto`
takes the objective that declares the run's data format its own. A new objective is one module:
subclass Objective, decorate it with `@register`, import the module before planning.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from weft.components.config import ConfigError, JobConfig

OBJECTIVES: dict[str, type[Objective]] = {}


def register(cls: type[Objective]) -> type[Objective]:
    """Make `cls` the objective `training.objective = cls.name` trains."""
    OBJECTIVES[cls.name] = cls
    return cls


class Objective:
    """One way of training: the plan asks the class (its checks, rows per sample, the frozen model
    it holds, for the dry run), build.py makes the instance (`build`), and train.py and train_step ask
    the instance (`prepare` after the weights are loaded, `step`, `log_note`, `validate`)."""

    name: ClassVar[str] = ""
    formats: ClassVar[tuple[str, ...]] = ()  # the data.format values it trains on
    default_for: ClassVar[tuple[str, ...]] = ()  # those that training.objective = auto trains with it
    section: ClassVar[str] = ""  # its own config section: refused when another objective trains
    rows_per_sample: ClassVar[int] = 1  # rows of a batch one sample is (a preference pair: 2)

    @classmethod
    def check(cls, cfg: JobConfig, dims) -> None:
        """Refuse, in one line naming the key, what this objective cannot train (plan time): here,
        validation data of a format it does not read."""
        validation = cfg.validation.format or cfg.data.format
        if cfg.validation.enable and validation not in cls.formats:
            raise ConfigError(f"validation.format = {validation}: training.objective = {cls.name} validates on "
                              f"{' or '.join(cls.formats)}")

    @classmethod
    def frozen(cls, cfg: JobConfig):
        """The frozen model this objective holds beside the trained one (frozen.Frozen), or None."""
        return None

    @classmethod
    def loaders(cls, plan, meshes) -> tuple[object, dict[str, Any]] | None:
        """Its own training loader and validation loader factories, for data the token loaders do not
        read (online RL's prompts); None: the run's (recipe/build.py build_data)."""
        return None

    # the dry run's KV cache line: what generating means for a run of this objective
    generation_note: ClassVar[str] = "generation only, not in the training peak"

    @classmethod
    def generation_rows(cls, cfg: JobConfig, dims) -> int:
        """Sequences one device decodes together (the dry run's KV cache): a local batch, as `weft generate` would."""
        return cfg.training.local_batch_size

    @classmethod
    def describe_rows(cls, rows: int) -> str:
        return f"{rows} samples"

    @classmethod
    def build(cls, plan, setup, meshes, device: torch.device) -> Objective:
        """The objective of a run, its extra models built (the step's setup is built already)."""
        return cls()

    def prepare(self, plan, run, start_step: int) -> None:
        """After the weights are loaded, before the first step (a frozen model's precompute pass)."""

    def step(self, setup, micro_batches: list, on_phase) -> tuple[torch.Tensor, dict[str, float]]:
        """Forward and backward over the placed micro-batches: this rank's share of the step's loss,
        and the metrics logged with it."""
        raise NotImplementedError

    def log_note(self, metrics: dict[str, float]) -> str:
        """What the step's (and validation's) log line shows of the metrics `step` returns (all of them
        go to TensorBoard, metrics.jsonl and wandb under their names)."""
        return ""

    def validate(self, run, cfg: JobConfig) -> tuple[dict[str, float], dict[str, Any] | None]:
        """One validation: the loss of each source ('' for validation.dataset_path) and the metrics
        logged with them (None: perplexities instead)."""
        raise NotImplementedError


def objective_class(cfg: JobConfig) -> type[Objective]:
    """The objective training.objective names (auto: the one whose `default_for` holds data.format),
    refused in one line where the data or another objective's config section does not fit it; its
    own `check` follows, once the layout is known."""
    name, data_format = cfg.training.objective, cfg.data.format
    if name == "auto":
        name = next(n for n, cls in OBJECTIVES.items() if data_format in cls.default_for)
    if name not in OBJECTIVES:
        raise ConfigError(f"training.objective = {name}: expected auto or one of {', '.join(OBJECTIVES)}")
    cls = OBJECTIVES[name]
    if data_format not in cls.formats:
        raise ConfigError(f"data.format = {data_format}: training.objective = {name} trains on "
                          f"data.format {' or '.join(cls.formats)}")
    for other in OBJECTIVES.values():
        if other is cls or not other.section:
            continue
        section = getattr(cfg, other.section)
        changed = [key for key, value in vars(type(section)()).items() if getattr(section, key) != value]
        if changed:
            raise ConfigError(f"{other.section}.{changed[0]}: configures {other.name} training, and the run trains "
                              f"{name} (data.format = {data_format}); set data.format = "
                              f"{' or '.join(other.default_for or other.formats)}")
    return cls
