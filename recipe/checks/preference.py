"""Preference training's checks: data.format = preference and [preference] go together."""

from __future__ import annotations

from weft.components.config import ConfigError, JobConfig
from weft.parallelisms.parallel_dims import ParallelDims


def check_preference(cfg: JobConfig, dims: ParallelDims) -> None:
    """data.format = preference and [preference] go together: the pairs' formats, the reference,
    and the layouts the objective supports."""
    p, default = cfg.preference, type(cfg.preference)()
    validation = cfg.validation.format or cfg.data.format
    if cfg.data.format != "preference":
        changed = [f"preference.{name}" for name in vars(default) if getattr(p, name) != getattr(default, name)]
        if changed:
            raise ConfigError(f"{changed[0]}: configures preference training, and data.format = {cfg.data.format}; "
                              "set data.format = preference (JSONL {prompt, chosen, rejected})")
        if cfg.validation.enable and validation == "preference":
            raise ConfigError(f"validation.format = preference: needs data.format = preference (it is "
                              f"{cfg.data.format})")
        return
    if cfg.validation.enable and validation != "preference":
        raise ConfigError(f"validation.format = {validation}: a preference run validates on pairs; set "
                          "validation.format = preference (or leave it empty)")
    if cfg.data.mixture:
        raise ConfigError("data.mixture: mixes windows of text or samples, and data.format = preference trains on "
                          "pairs; give one data.dataset_path")
    if p.loss in ("simpo", "orpo") and p.precompute_reference:
        raise ConfigError(f"preference.precompute_reference: preference.loss = {p.loss} uses no reference model; "
                          "leave it false or use loss = sigmoid or ipo")
    if p.precompute_reference and cfg.fault_tolerance.enable:
        raise ConfigError("preference.precompute_reference: a fault-tolerant run retries steps, which a precomputed "
                          "sequence of reference batches cannot follow; leave it false")
    if p.loss in ("simpo", "orpo") and p.reference_path:
        raise ConfigError(f"preference.reference_path: preference.loss = {p.loss} uses no reference model; "
                          "leave reference_path empty or use loss = sigmoid or ipo")
