"""A sweep checked whole before it launches: every config it can run (each job of a grid, a search's space at
its edges, `space.edge_values`) passes the checks a single run passes (docs/how-to/sweeps.md, "Checked before it
launches"), and all rank by one `sweep.metric` and `sweep.direction`. A refusal is one UserError: shared problems
once, then each job's own. The CLI composes (`llmexp.cli.compose.check_sweep`), this module judges. No torch here.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from llmexp.errors import UserError, first_line
from llmexp.sweep.space import edge_values, probe_job, search_space

Labelled = list[tuple[str, Any]]
"""(how a message names the job, its composed config)."""


def edge_configs(overrides: Sequence[Override], compose: Callable[[list[str]], Any],
                 is_group: Callable[[str], bool]) -> Labelled:
    """A search's configs to check: the probe (every swept key at its first value), then the probe with one key at
    each of its other edge values, composed again for a config group, else set on a copy of the probe (1,000 lrs
    cost milliseconds, not 1,000 compositions). A malformed space is refused before anything composes."""
    search_space(overrides)
    job = probe_job(overrides)
    base = compose(job)
    configs: Labelled = [(f"the search's first point ({' '.join(job)})", base)]
    for override in (o for o in overrides if o.is_sweep_override()):
        key = override.get_key_element()
        for value in edge_values(override)[1:]:  # the first is the probe's
            label = f"search value {key}={value}"
            if is_group(key) or key[:1] in "+~" or "@" in key:
                configs.append((label, compose([o if not o.startswith(f"{key}=") else f"{key}={value}" for o in job])))
                continue
            variant = copy.deepcopy(base)
            try:
                with open_dict(variant):
                    OmegaConf.update(variant, key, value, merge=True)
            except OmegaConfBaseException as err:  # a value of the wrong type for its key
                raise UserError(f"invalid sweep: {label}: {first_line(err.msg, None)}") from None
            configs.append((label, variant))
    return configs


def check_inputs(cfg: DictConfig) -> None:
    """What the run reads that the path checks do not judge, before anything is written: every eval task file
    parsed and checked (file, line, record), the harness and its task names (`harness.check_before_start`), and
    a `train.resume=<path>` checkpoint's files against its manifest (present, each of its size: what
    `list_checkpoints` calls complete; the hashes are checked as the run loads it)."""
    from llmexp.checkpoint.serialize import CorruptCheckpoint
    from llmexp.checkpoint.store import verify_checkpoint
    from llmexp.evals.harness import check_before_start
    from llmexp.evals.items import read_task_files

    read_task_files(cfg)
    check_before_start(cfg.eval.lm_eval)
    choice = str(cfg.train.resume)
    if choice in ("auto", "never"):  # (a path that is no checkpoint directory: `paths.checkpoint_problem`)
        return
    try:
        verify_checkpoint(Path(choice).expanduser(), full=False)
    except CorruptCheckpoint as err:
        raise UserError(f"train.resume={choice}: the checkpoint is damaged ({err}); resume from another checkpoint "
                        "(train.resume=<run>/checkpoints/step_<N>), the newest good one in the run directory "
                        "(train.resume=auto), or start over (train.resume=never)") from None


def check_configs(configs: Labelled, on_this_machine: bool) -> None:
    """`validate` and the machine's checks on every config, then the sweep's one objective; one UserError listing
    what fails, shared problems once. On SLURM (`on_this_machine` false) only the directories this process writes
    are checked here."""
    from llmexp.config.validation import validate
    from llmexp.machine.environment import check_directories, check_environment

    failures: dict[str, list[str]] = {}
    for label, cfg in configs:
        try:
            validate(cfg)
            (check_environment if on_this_machine else check_directories)(cfg)
            if on_this_machine:
                check_inputs(cfg)
        except UserError as err:
            failures[label] = _problems(err)
    if not failures:  # each job records its own metric (`validation.metric_errors`); a sweep ranks them by one
        objectives = sorted({(str(cfg.sweep.metric), str(cfg.sweep.direction)) for _, cfg in configs})
        if len(objectives) > 1:
            shown = ", ".join(f"{metric} ({direction})" for metric, direction in objectives)
            raise UserError(f"invalid sweep (nothing was launched):\n  sweep.metric: the jobs rank by different "
                            f"metrics ({shown}), and a sweep ranks its jobs by one; set sweep.metric and "
                            "sweep.direction once, not among the swept values")
        return
    shared = [p for p in next(iter(failures.values())) if len(failures) == len(configs)
              and all(p in problems for problems in failures.values())]
    lines = [f"  {p}" for p in shared]
    for label, problems in list(failures.items())[:5]:
        own = [p for p in problems if p not in shared]
        lines += [f"  {label}:", *(f"    {p}" for p in own)] if own else []
    if len(failures) > 5:
        lines.append(f"  ... and {len(failures) - 5} more jobs")
    raise UserError("invalid sweep (nothing was launched):\n" + "\n".join(lines))


def job_dir_problem(sweep_dir: Path, dirs: Sequence[tuple[str, Path]]) -> str | None:
    """Why the jobs' directories, (label, path) each, cannot hold them: the sweep directory itself, one that two
    jobs share (their metrics and checkpoints would mix: a `hydra.sweep.subdir` without `${hydra.job.num}`), or
    one this machine cannot make (`dir_out_problem`, e.g. a name too long)."""
    from llmexp.machine.paths import dir_out_problem

    fix = "keep ${hydra.job.num} in hydra.sweep.subdir, as its default does (e.g. 'lr${lr}_${hydra.job.num}')"
    seen = {os.path.normpath(sweep_dir.absolute()): "the sweep itself"}
    for label, path in dirs:
        if (where := os.path.normpath(path)) in seen:
            return f"hydra.sweep.subdir: {label} would run in {where}, as {seen[where]} does; {fix}"
        seen[where] = label
        if problem := dir_out_problem("hydra.sweep.subdir", path):
            return f"{label}: {problem}"
    return None


def search_dir_problem(probe: DictConfig, sweep_dir: Path) -> str | None:
    """A search's trials' directories (`job_dir_problem`); the study finds each by its number alone, so a
    `hydra.sweep.subdir` may not name a trial's values."""
    from llmexp.sweep.jobs import job_dir_of, subdir_names_values

    if subdir_names_values(probe):
        return ("hydra.sweep.subdir: a search names each trial's directory by its number: drop the trial's values "
                "from it (${hydra.job.override_dirname}, ${lr}, ...), e.g. hydra.sweep.subdir='trial_${hydra.job.num}'")
    return job_dir_problem(sweep_dir, [(f"trial #{n}", job_dir_of(probe, n)) for n in (0, 1)])


def _problems(err: UserError) -> list[str]:
    """The problem lines of a validation error (`invalid config:\\n  a\\n  b` -> [a, b])."""
    lines = [line.strip() for line in str(err).splitlines()]
    return lines[1:] if len(lines) > 1 and lines[0].endswith(":") else lines
