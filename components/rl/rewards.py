"""Reward functions, with TRL's signature: f(prompts, completions, completion_ids, **columns) -> list[float | None].

`prompts` and `completions` are strings, or for chat prompts lists of messages (a completion: one
assistant message), one per completion; every other column of the prompt rows comes as a list of
the same length (each row's value repeated for its completions). None: the function does not apply
to that completion. `rl.reward_functions` names each as a built-in (builtin_rewards.py) or as
`module:function`, the module importable or a path to a .py file; its `__name__` names its metrics.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weft.components.config.shipped import shipped_path
from weft.components.rl.builtin_rewards import BUILTINS
from weft.errors import UserError


class RewardError(UserError):
    """A reward function that does not load, raises, or returns something other than one number (or
    None) per completion; the message names the function and, where it can, the row."""


@dataclass(frozen=True)
class RewardFunction:
    name: str  # its __name__: rewards/{name}/mean, rollouts.jsonl's rewards
    fn: Callable[..., Sequence[Any]]


def load_reward_functions(specs: Sequence[str], *, answer_tag: str) -> list[RewardFunction]:
    """The functions `specs` name (rl.reward_functions), each checked callable; built-ins take `answer_tag`."""
    functions = []
    for spec in specs:
        if spec in BUILTINS:
            fn = BUILTINS[spec](answer_tag)
        elif ":" in spec:
            fn = _import(spec)
        else:
            raise RewardError(f"rl.reward_functions: {spec!r} is neither a built-in ({', '.join(BUILTINS)}) nor "
                              "'module:function' (a module on the path, or a path to a .py file)")
        functions.append(RewardFunction(getattr(fn, "__name__", spec), fn))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise RewardError(f"rl.reward_functions: two functions are named {max(names, key=names.count)!r}; "
                          "their metrics would mix: give each its own __name__")
    return functions


def _import(spec: str) -> Callable[..., Sequence[Any]]:
    module_name, _, name = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = Path(shipped_path(module_name))  # a shipped config's assets/rewards/ file from any folder
            if not path.is_file():
                raise RewardError(f"rl.reward_functions: {spec!r}: no file {module_name}")
            loader_spec = importlib.util.spec_from_file_location(f"weft_rewards_{path.stem}", path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[loader_spec.name] = module
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except RewardError:
        raise
    except Exception as err:  # anything the user's module raises while importing
        raise RewardError(f"rl.reward_functions: {spec!r} does not import: {type(err).__name__}: {err}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"rl.reward_functions: {spec!r}: {module_name} has no function {name!r}")
    return fn


def compute_rewards(functions: Sequence[RewardFunction], prompts: list, completions: list,
                    completion_ids: list[list[int]], columns: dict[str, list], rows: Sequence[str]
                    ) -> torch.Tensor:
    """[completions, functions] float32, NaN where a function returned None. `rows` names each
    completion's prompt row (file:line) for the error of a function that returns a bad value."""
    out = torch.empty(len(completions), len(functions))
    for f, function in enumerate(functions):
        try:
            values = function.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as err:  # a user's function: named, with the rows it was scoring
            raise RewardError(f"reward function {function.name} raised {type(err).__name__}: {err} (scoring the "
                              f"completions of {_span(rows)})") from None
        sized = hasattr(values, "__len__") and not isinstance(values, (str, bytes, dict))  # a list, tuple or array
        if not sized or len(values) != len(completions):
            got = f"{len(values)} values" if sized else type(values).__name__
            raise RewardError(f"reward function {function.name} returned {got} for {len(completions)} completions "
                              f"({_span(rows)}); expected one number or None per completion")
        for i, value in enumerate(list(values)):
            if value is None:
                out[i, f] = float("nan")
            elif isinstance(value, numbers.Real) and math.isfinite(value):  # bools count as 1 and 0
                out[i, f] = float(value)
            else:
                raise RewardError(f"reward function {function.name} returned {value!r} for completion {i} of "
                                  f"{rows[i]}; expected a finite number or None")
    return out


def _span(rows: Sequence[str]) -> str:
    return rows[0] if len(set(rows)) == 1 else f"{rows[0]} .. {rows[-1]}"
