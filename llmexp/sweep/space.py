"""What a `--multirun` command line asks to explore: the grid's jobs (with paired axes and lr scaling)
and an optuna search space (Hydra's Optuna sweeper's syntax), both read from Hydra's parsed overrides, as
docs/how-to/sweeps.md ("Paired axes and lr scaling", "Search") writes them. Nothing here imports torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hydra.core.override_parser.types import IntervalSweep, Override, RangeSweep, Transformer

from llmexp.config.rules import Choice
from llmexp.config.validation import configured_lr
from llmexp.errors import UserError
from llmexp.rundir.read import MAX_GRID_JOBS, grid_product, override_axes

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution


SEARCH_TAGS = ("log", "int")
"""The tags of a search interval: `tag(log, interval(a,b))` is log-uniform, `tag(int, ...)` integers."""

LR_SCALING_POWER = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}
"""sweep.lr_scaling -> the power of batch_size / base_batch_size that multiplies the lr (square-root
scaling for Adam-type optimizers, linear as in Goyal et al. for SGD)."""


def discrete_size(override: Override) -> int:
    """How many values a swept override holds, counted without listing them; a UserError for an interval (a
    search's), a range of step 0, or an empty sweep."""
    key, value = override.get_key_element(), override.value()
    if override.is_interval_sweep():
        raise UserError(f"{key}: an interval sweep needs a search (sweep=random or sweep=tpe); the grid "
                        f"takes lists, e.g. {key}=1e-4,3e-4 or {key}='range(1,4)'")
    if isinstance(value, RangeSweep):
        start, stop, step = value.start, value.stop, value.step
        if not step or not all(math.isfinite(v) for v in (start, stop, step)):  # type: ignore[arg-type]
            raise UserError(f"{key}=range({start}, {stop}, {step}): needs finite bounds and a step other than 0")
        size = max(0, math.ceil((stop - start) / step))  # type: ignore[operator]
    else:
        size = len(list(override.sweep_string_iterator()))  # a choice or a glob: listed on the command line
    if size == 0:
        raise UserError(f"{key}: this sweep holds no value (an empty range?); e.g. {key}='range(1,4)' or {key}=1,2,3")
    return size


def grid_jobs(overrides: Sequence[Override], zip_keys: Sequence[str]) -> list[list[str]]:
    """Every job's overrides: the product of the swept axes (refused beyond MAX_GRID_JOBS jobs, counted without
    listing them), the `zip_keys` axes paired value by value."""
    sizes = {o.get_key_element(): discrete_size(o) if o.is_sweep_override() else 1 for o in overrides}
    paired = {str(k) for k in zip_keys[1:]}  # (the first zip key's axis carries them: no axis of their own)
    if (jobs := math.prod(n for key, n in sizes.items() if key not in paired)) > MAX_GRID_JOBS:
        shown = " x ".join(f"{k}: {n}" for k, n in sizes.items() if n > 1)
        raise UserError(f"this grid has {jobs} jobs ({shown}); a grid takes at most {MAX_GRID_JOBS}: sweep fewer "
                        "values, or search the space with sweep=tpe sweep.n_trials=N")
    axes = override_axes(overrides)
    zip_keys = [str(k) for k in zip_keys]
    for key in zip_keys:
        if key not in axes or len(axes[key]) < 2:
            raise UserError(f"sweep.zip names {key}, which this sweep does not vary; sweep it "
                            f"({key}=a,b,...) or drop it from sweep.zip")
    lengths = {key: len(axes[key]) for key in zip_keys}
    if len(set(lengths.values())) > 1:
        raise UserError(f"sweep.zip pairs values one by one, so its keys need as many values each; got "
                        f"{', '.join(f'{k}: {n}' for k, n in lengths.items())}")
    return grid_product(axes, zip_keys)


def scale_lr(jobs: list[list[str]], scaling: str, base_batch_size: int | None, config_lr: Any) -> list[list[str]]:
    """Each job's lr multiplied by (batch_size / base) ** power (`LR_SCALING_POWER`); the lr given (on the
    command line or in the config) is the lr for `base_batch_size`, by default the smallest batch swept."""
    if scaling not in LR_SCALING_POWER:  # before any job is composed: the rule's own message
        raise UserError(Choice(tuple(LR_SCALING_POWER)).problem("sweep.lr_scaling", scaling) or "")
    if not (power := LR_SCALING_POWER[scaling]):
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


def lr_to_scale(cfg: Any) -> Any:
    """The lr a grid's `sweep.lr_scaling` scales: `lr`, or the data's pretraining lr where a from-scratch run takes
    it (`validation.configured_lr`); a bad value is handed on as it is, for `scale_lr` to name."""
    try:
        configured = configured_lr(cfg)
    except (ValueError, TypeError):
        return cfg.lr
    return configured[0] if configured else cfg.lr


def _value(job: Sequence[str], key: str) -> str | None:
    return next((o.split("=", 1)[1] for o in job if o.split("=", 1)[0] == key), None)


def _number(text: str | None, key: str) -> float:
    try:
        return float(str(text))
    except ValueError:
        example = "lr=3e-4 (lr=auto cannot be scaled)" if key == "lr" else f"{key}=4,8,16"
        raise UserError(f"sweep.lr_scaling needs a number for {key}, got {text!r}; e.g. {example}") from None


def search_space(overrides: Sequence[Override]) -> tuple[dict[str, BaseDistribution], list[str]]:
    """(key -> optuna distribution for each swept key, the fixed `key=value` overrides)."""
    space = {o.get_key_element(): _distribution(o) for o in overrides if o.is_sweep_override()}
    if not space:
        raise UserError("a search (sweep=random or sweep=tpe) needs at least one swept key, e.g. "
                        "'lr=tag(log,interval(1e-5,1e-2))' or batch_size=choice(4,8,16)")
    fixed = [f"{o.get_key_element()}={o.get_value_element_as_str()}" for o in overrides if not o.is_sweep_override()]
    return space, fixed


def _distribution(override: Override) -> BaseDistribution:
    """The optuna distribution of one swept override (docs/how-to/sweeps.md, "Search space"); a UserError for
    an unknown tag, a tag on a list of values, too many values, or interval bounds that are not a range."""
    from optuna.distributions import CategoricalDistribution

    key, value = override.get_key_element(), override.value()
    tags = sorted(getattr(value, "tags", None) or ())
    if unknown := [t for t in tags if t not in SEARCH_TAGS]:
        raise UserError(f"{key}: unknown tag {unknown[0]!r}; a search interval takes the tags "
                        f"{', '.join(SEARCH_TAGS)}, e.g. {key}='tag(log,interval(1e-5,1e-2))'")
    if isinstance(value, IntervalSweep):
        return _interval(key, value.start, value.end, tags)
    if tags:
        raise UserError(f"{key}: tag({tags[0]}, ...) applies to an interval, not to a list of values; e.g. "
                        f"{key}='tag(log,interval(1e-5,1e-2))'")
    if (size := discrete_size(override)) > MAX_GRID_JOBS:
        raise UserError(f"{key}: {size} values; a search's categorical takes at most {MAX_GRID_JOBS}: use an "
                        f"interval, e.g. {key}='tag(int,interval(a,b))'")
    return CategoricalDistribution(list(override.sweep_iterator(transformer=Transformer.encode)))


def _interval(key: str, start: Any, end: Any, tags: list[str]) -> BaseDistribution:
    """`interval(start, end)` with its tags: finite bounds, start below end, > 0 for log, integers for int."""
    from optuna.distributions import FloatDistribution, IntDistribution

    shown = f"interval({start}, {end})"
    if not all(isinstance(v, int | float) and math.isfinite(v) for v in (start, end)):
        raise UserError(f"{key}={shown}: its bounds must be finite numbers")
    if start == end:
        value = int(start) if "int" in tags and float(start).is_integer() else start
        wider = value * 10 if value > 0 else value + 1
        raise UserError(f"{key}={shown}: its start and end are equal; widen it, e.g. {key}=interval({value}, "
                        f"{wider}), or set {key}={value} (a fixed value is no search axis)")
    if not start < end:
        raise UserError(f"{key}={shown}: its start must be below its end, e.g. {key}=interval({end}, {start})")
    log = "log" in tags
    if log and not start > 0:
        raise UserError(f"{key}: a log interval needs a start > 0, got {start}")
    if "int" not in tags:
        return FloatDistribution(float(start), float(end), log=log)
    if not (float(start).is_integer() and float(end).is_integer()):
        raise UserError(f"{key}: tag(int, {shown}) needs integer bounds, e.g. "
                        f"tag(int, interval({math.ceil(start)}, {math.floor(end)}))")
    return IntDistribution(int(start), int(end), log=log)


def probe_job(overrides: Sequence[Override]) -> list[str]:
    """One job of a search with every swept key at its first value (a choice's first, an interval's start):
    composed before the search starts, so that a typo fails before any trial runs."""
    first = {o.get_key_element(): _first_value(o) for o in overrides if o.is_sweep_override()}
    return trial_overrides(first, overrides)


def _first_value(override: Override) -> Any:
    if override.is_interval_sweep():
        return edge_values(override)[0]
    discrete_size(override)  # an empty range has no first value: its UserError names the key and the fix
    return next(iter(override.sweep_iterator(transformer=Transformer.encode)))


def edge_values(override: Override) -> list[Any]:
    """The values a search can give a swept key at the edges of its space (`llmexp.sweep.check` says why they
    stand for all): every value of a categorical, both ends of an interval (integers for `tag(int, ...)`)."""
    value = override.value()
    if isinstance(value, IntervalSweep):
        ends = [value.start, value.end]
        return [int(v) for v in ends] if "int" in (value.tags or ()) else ends  # type: ignore[arg-type]
    return list(override.sweep_iterator())


def trial_overrides(params: dict[str, Any], overrides: Sequence[Override]) -> list[str]:
    """A trial's overrides: the command line's, in its order (Hydra applies them in that order, and a job's
    `.hydra/overrides.yaml` shows them so, as the grid's jobs do), each swept key at its sampled value."""
    return [f"{o.get_key_element()}="
            f"{params[o.get_key_element()] if o.is_sweep_override() else o.get_value_element_as_str()}"
            for o in overrides]


def finite_grid(space: dict[str, BaseDistribution], limit: int) -> list[dict[str, Any]] | None:
    """Every point of a space of categorical keys only (choices, lists, ranges), in the grid's order (the
    first key varies slowest, as Hydra's basic sweeper orders its jobs); None if any key is an interval
    or there are more than `limit` points (counted first: a space of many keys can have billions)."""
    from optuna.distributions import CategoricalDistribution

    axes = [d.choices for d in space.values() if isinstance(d, CategoricalDistribution)]
    if len(axes) < len(space) or math.prod(len(choices) for choices in axes) > limit:
        return None
    return [dict(zip(space, point, strict=True)) for point in itertools.product(*axes)]
