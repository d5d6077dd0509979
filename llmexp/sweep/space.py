"""What a `--multirun` command line asks to explore: the grid's jobs (with paired axes and lr scaling)
and an optuna search space, both read from Hydra's parsed overrides.

    lr=1e-4,3e-4 batch_size=4,8                       grid: 4 jobs (the product)
    ... sweep.zip=[lr,batch_size]                     grid: 2 jobs, the i-th values paired
    ... sweep.lr_scaling=sqrt                         grid: lr x (batch_size / base) ** 0.5 in each job
    lr='tag(log,interval(1e-5,1e-1))' batch_size=choice(4,8)   search (sweep=random|tpe)

The search syntax is that of Hydra's Optuna sweeper: `choice(...)` and `a,b,c` are categorical,
`range(...)` is categorical over its values, `interval(a,b)` is uniform (integers with
`tag(int, interval(a,b))`), and `tag(log, interval(a,b))` is log-uniform. Nothing here imports torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llmexp.errors import UserError

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override
    from optuna.distributions import BaseDistribution

LR_SCALING_POWER = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}
"""sweep.lr_scaling -> the power of batch_size / base_batch_size that multiplies the lr (square-root
scaling for Adam-type optimizers, linear as in Goyal et al. for SGD)."""


def _axes(overrides: Sequence[Override]) -> dict[str, list[str]]:
    """key -> its `key=value` strings, in command-line order (as Hydra's basic sweeper reads them)."""
    axes: dict[str, list[str]] = {}
    for override in overrides:
        key = override.get_key_element()
        if not override.is_sweep_override():
            axes[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            axes[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            raise UserError(f"{key}: an interval sweep needs a search (sweep=random or sweep=tpe); the grid "
                            f"takes lists, e.g. {key}=1e-4,3e-4 or {key}='range(1,4)'")
    return axes


def grid_jobs(overrides: Sequence[Override], zip_keys: Sequence[str]) -> list[list[str]]:
    """Every job's overrides: the product of the swept axes, the `zip_keys` axes paired value by value."""
    axes = _axes(overrides)
    zip_keys = [str(k) for k in zip_keys]
    for key in zip_keys:
        if key not in axes or len(axes[key]) < 2:
            raise UserError(f"sweep.zip names {key}, which this sweep does not vary; sweep it "
                            f"({key}=a,b,...) or drop it from sweep.zip")
    lengths = {key: len(axes[key]) for key in zip_keys}
    if len(set(lengths.values())) > 1:
        raise UserError(f"sweep.zip pairs values one by one, so its keys need as many values each; got "
                        f"{', '.join(f'{k}: {n}' for k, n in lengths.items())}")
    columns: list[list[tuple[str, ...]]] = []
    for key, values in axes.items():
        if key in zip_keys[1:]:
            continue  # joined to the first zipped key's column
        if zip_keys and key == zip_keys[0]:
            columns.append(list(zip(*(axes[k] for k in zip_keys), strict=True)))
        else:
            columns.append([(v,) for v in values])
    return [[item for group in combo for item in group] for combo in itertools.product(*columns)]


def scale_lr(jobs: list[list[str]], scaling: str, base_batch_size: int | None, config_lr: Any) -> list[list[str]]:
    """Each job's lr multiplied by (batch_size / base) ** power (`LR_SCALING_POWER`); the lr given (on the
    command line or in the config) is the lr for `base_batch_size`, by default the smallest batch swept."""
    power = LR_SCALING_POWER[scaling]
    if not power:
        return jobs
    sizes = [_value(job, "batch_size") for job in jobs]
    if len({s for s in sizes if s is not None}) < 2:
        raise UserError(f"sweep.lr_scaling={scaling} scales the lr with batch_size, which this sweep does not "
                        "vary; sweep it (batch_size=4,8,16) or set sweep.lr_scaling=none")
    base = base_batch_size or min(_number(s, "batch_size") for s in sizes if s is not None)
    scaled = []
    for job, size in zip(jobs, sizes, strict=True):
        lr = _number(_value(job, "lr") or str(config_lr), "lr")
        factor = (_number(size, "batch_size") / base) ** power if size is not None else 1.0
        scaled.append([o for o in job if not o.startswith("lr=")] + [f"lr={lr * factor:.6g}"])
    return scaled


def _value(job: Sequence[str], key: str) -> str | None:
    return next((o.split("=", 1)[1] for o in job if o.split("=", 1)[0] == key), None)


def _number(text: str | None, key: str) -> float:
    try:
        return float(str(text))
    except ValueError:
        raise UserError(f"sweep.lr_scaling needs a number for {key}, got {text!r}; e.g. {key}=3e-4 "
                        "(lr=auto cannot be scaled)") from None


# ----------------------------------------------------------------------------- the search space


def search_space(overrides: Sequence[Override]) -> tuple[dict[str, BaseDistribution], list[str]]:
    """(key -> optuna distribution for each swept key, the fixed `key=value` overrides)."""
    space: dict[str, BaseDistribution] = {}
    fixed: list[str] = []
    for override in overrides:
        key = override.get_key_element()
        if override.is_sweep_override():
            space[key] = _distribution(override)
        else:
            fixed.append(f"{key}={override.get_value_element_as_str()}")
    if not space:
        raise UserError("a search (sweep=random or sweep=tpe) needs at least one swept key, e.g. "
                        "'lr=tag(log,interval(1e-5,1e-2))' or batch_size=choice(4,8,16)")
    return space, fixed


def _distribution(override: Override) -> BaseDistribution:
    """The optuna distribution of one swept override (the rules in this module's docstring)."""
    from hydra.core.override_parser.types import IntervalSweep, Transformer
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if override.is_choice_sweep() or override.is_range_sweep():
        return CategoricalDistribution(list(override.sweep_iterator(transformer=Transformer.encode)))
    value = override.value()
    assert isinstance(value, IntervalSweep)
    log = "log" in value.tags
    if "int" in value.tags:
        return IntDistribution(int(value.start), int(value.end), log=log)
    if log and not (value.start > 0):
        raise UserError(f"{override.get_key_element()}: a log interval needs a start > 0, got {value.start}")
    return FloatDistribution(float(value.start), float(value.end), log=log)


def probe_job(overrides: Sequence[Override]) -> list[str]:
    """One job of a search with every swept key at its first value (a choice's first, an interval's start):
    composed before the search starts, so that a typo fails before any trial runs."""
    from hydra.core.override_parser.types import IntervalSweep, Transformer

    job = []
    for override in overrides:
        key = override.get_key_element()
        if not override.is_sweep_override():
            job.append(f"{key}={override.get_value_element_as_str()}")
        elif isinstance(value := override.value(), IntervalSweep):
            job.append(f"{key}={value.start}")
        else:
            job.append(f"{key}={next(iter(override.sweep_iterator(transformer=Transformer.encode)))}")
    return job


def trial_overrides(params: dict[str, Any], overrides: Sequence[Override]) -> list[str]:
    """A trial's overrides: the command line's, in its order (Hydra applies them in that order, and a job's
    `.hydra/overrides.yaml` shows them so, as the grid's jobs do), each swept key at its sampled value."""
    job = []
    for override in overrides:
        key = override.get_key_element()
        job.append(f"{key}={params[key]}" if override.is_sweep_override() else
                   f"{key}={override.get_value_element_as_str()}")
    return job


def finite_grid(space: dict[str, BaseDistribution], limit: int) -> list[dict[str, Any]] | None:
    """Every point of a space of categorical keys only (choices, lists, ranges), in the grid's order (the
    first key varies slowest, as Hydra's basic sweeper orders its jobs); None if any key is an interval
    or there are more than `limit` points (counted first: a space of many keys can have billions)."""
    from optuna.distributions import CategoricalDistribution

    axes = [d.choices for d in space.values() if isinstance(d, CategoricalDistribution)]
    if len(axes) < len(space) or math.prod(len(choices) for choices in axes) > limit:
        return None
    return [dict(zip(space, point, strict=True)) for point in itertools.product(*axes)]
