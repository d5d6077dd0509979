"""The CLI's checks on composed configs, before `@hydra.main` runs (docs/explanation/security-model.md, "One
check, on the composed config"); `--help` is printed from its one checked composition. Nothing here creates a
directory (but the run directory's lock), instantiates anything a config names, or imports torch.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import string
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from hydra import compose
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf, flag_override, open_dict

from llmexp.config import security
from llmexp.config.keys import KeyDoc, reference
from llmexp.config.origin import origin_of
from llmexp.errors import UserError


def compose_checked(config_name: str | None, overrides: list[str], job_num: int | None = None) -> Any:
    """The config `@hydra.main` will compose from `overrides` (`hydra` node included), after the security check;
    a sweep job's with its number (it names the job's directory). Within `compose_api_as_hydra_main`."""
    cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
    if job_num is not None:
        with open_dict(cfg.hydra):
            cfg.hydra.job.num = job_num
    security.check_config(cfg, origin=origin_of(GlobalHydra.instance().config_loader(), cfg, overrides))
    return cfg


def check_run(config_name: str | None, overrides: list[str]) -> None:
    """A run: checked, validated, checked against this machine, and its directory locked, before Hydra starts.
    `${llmexp_run_id:}` gives the same directory in `@hydra.main`'s own composition (one id per process)."""
    from llmexp.config.validation import validate
    from llmexp.machine.environment import check_environment
    from llmexp.rundir.lock import keep_hydra_files, lock_run_dir
    from llmexp.sweep.check import check_inputs

    cfg = compose_checked(config_name, overrides)
    probe = copy.deepcopy(cfg)  # with `hydra.runtime.output_dir` as Hydra's run_job will set it, for ${hydra:...}
    with open_dict(probe.hydra):
        probe.hydra.runtime.output_dir = os.path.abspath(str(cfg.hydra.run.dir))
    HydraConfig.instance().set_config(probe)
    validate(cfg)
    if chosen := [f"{g}={cfg[g].name}" for g, default in (("cluster", "local"), ("sweep", "grid"))
                  if cfg[g].name != default]:  # without --multirun, the run would silently train here
        raise UserError(f"{' '.join(chosen)}: only --multirun acts on it (this run would train here, on this "
                        "machine); add --multirun, a single job's sweep too, or leave it out")
    check_environment(cfg)
    check_inputs(cfg)
    lock_run_dir(str(cfg.hydra.run.dir))
    keep_hydra_files(str(cfg.hydra.run.dir), cfg.hydra.output_subdir)


def check_sweep(config_name: str | None, overrides: list[str]) -> None:
    """A sweep: every config it can run composed as the sweeper and launcher will compose it (Hydra's overrides,
    then the job's), security-checked and judged (`llmexp.sweep.check`), each job's directory too; then the sweep
    directory is locked: one sweeper per sweep directory, as one run per run directory."""
    from llmexp.rundir.lock import lock_sweep_dir
    from llmexp.sweep.space import probe_job

    loader = GlobalHydra.instance().config_loader()
    parser = OverridesParser.create(config_loader=loader)
    parsed = parser.parse_overrides(list(overrides))
    hydra_overrides = [ov.input_line for ov in parsed if ov.is_hydra_override()]
    task = [ov for ov in parsed if not ov.is_hydra_override()]

    def compose_job(job: list[str], num: int = 0) -> Any:
        return compose_checked(config_name, [*hydra_overrides, *job], job_num=num)

    first = probe_job(task)
    probe = compose_job(first)
    sweeper = probe.hydra.sweeper
    params = OmegaConf.to_container(sweeper.params) if sweeper.get("params") else {}
    asked = parser.parse_overrides([*(f"{k}={v}" for k, v in params.items()), *(ov.input_line for ov in task)])  # type: ignore[union-attr]
    if str(sweeper._target_).endswith(".SearchSweeper"):
        _check_search(asked, probe, compose_job, _config_groups(loader.get_sources()))
    else:  # Hydra's BasicSweeper or llmexp's GridSweeper (zip, lr scaling), the two SWEEPER_TARGETS allow
        _check_grid(asked, probe, first, compose_job)
    lock_sweep_dir(str(probe.hydra.sweep.dir))


def _runs_here(probe: Any) -> bool:
    """The jobs run on this machine (SLURM's read their files on the node)."""
    return not str(probe.hydra.launcher.get("_target_", "")).endswith(".SlurmLauncher")


def _check_search(asked: list[Any], probe: Any, compose_job: Callable[..., Any], groups: Any) -> None:
    """A search: its space at the edges, its study journal, its trials' directories; a new search must not start
    among another sweep's jobs."""
    from llmexp.rundir.study import check_journal, study_journal
    from llmexp.sweep.check import check_configs, edge_configs, search_dir_problem
    from llmexp.sweep.jobs import job_dir_of, launched_before

    sweep_dir = Path(str(probe.hydra.sweep.dir))
    check_configs(edge_configs(asked, compose_job, lambda key: key in groups), on_this_machine=_runs_here(probe))
    check_journal(sweep_dir)  # a search that continues there must find its study journal readable
    if problem := search_dir_problem(probe, sweep_dir):
        raise UserError(f"invalid sweep (nothing was launched):\n  {problem}")
    if not study_journal(sweep_dir).exists():
        launched_before(job_dir_of(probe, 0), 0, None)


def _check_grid(asked: list[Any], probe: Any, first: list[str], compose_job: Callable[..., Any]) -> None:
    """A grid: every job composed (`probe` is job 0's when its overrides are `first`) and judged, each in a directory
    of its own, none of another sweep's."""
    from llmexp.sweep.check import check_configs, job_dir_problem
    from llmexp.sweep.jobs import job_dir_of, launched_before, swept
    from llmexp.sweep.space import grid_jobs, lr_to_scale, scale_lr

    sweeper = probe.hydra.sweeper
    jobs = grid_jobs(asked, list(sweeper.get("zip") or []))
    jobs = scale_lr(jobs, str(sweeper.get("lr_scaling") or "none"), sweeper.get("base_batch_size"), lr_to_scale(probe))
    configs = [probe if num == 0 and job == first else compose_job(job, num)
               for num, job in enumerate(jobs)]  # (job 0 is usually the probe itself)
    labels = [f"job #{num} ({swept(job, jobs)})" for num, job in enumerate(jobs)]
    check_configs(list(zip(labels, configs, strict=True)), on_this_machine=_runs_here(probe))
    dirs = [job_dir_of(cfg, num) for num, cfg in enumerate(configs)]
    if problem := job_dir_problem(Path(str(probe.hydra.sweep.dir)), list(zip(labels, dirs, strict=True))):
        raise UserError(f"invalid sweep (nothing was launched):\n  {problem}")
    for num, (job, job_dir) in enumerate(zip(jobs, dirs, strict=True)):  # before Hydra writes multirun.yaml
        launched_before(job_dir, num, job)


def help_text(cfg: Any, args_parser: argparse.ArgumentParser, hydra_help: bool, resolve: bool) -> str:
    """Hydra's `--help` (or `--hydra-help`) page for a composed config: its help template with the flags, the
    config groups and the config, as `hydra._internal.hydra.Hydra.app_help` renders it, the groups listed
    from the config sources directly (Hydra's loader copies its repository on each of ~90 questions)."""
    HydraConfig.instance().set_config(cfg)
    help_cfg = cfg.hydra.hydra_help if hydra_help else cfg.hydra.help
    shown = OmegaConf.masked_copy(cfg, ["hydra"] if hydra_help else [k for k in cfg if k != "hydra"])
    if hydra_help:  # Hydra's own node, less its help pages
        with flag_override(shown.hydra, ["struct", "readonly"], [False, False]):
            del shown.hydra["hydra_help"]
            del shown.hydra["help"]
    groups = _config_groups(GlobalHydra.instance().config_loader().get_sources())
    return string.Template(help_cfg.template).substitute(
        FLAGS_HELP=_flags_help(args_parser),
        HYDRA_CONFIG_GROUPS=_format_groups(groups, hydra=True),
        APP_CONFIG_GROUPS=_format_groups(groups, hydra=False),
        CONFIG=OmegaConf.to_yaml(shown) if hydra_help else
        "\n".join(_annotated(OmegaConf.to_container(shown, resolve=resolve), "", {d.key: d for d in reference()})),
    )


def _annotated(data: dict[str, Any], template: str, docs: dict[str, KeyDoc], indent: str = "") -> list[str]:
    """The config as YAML, each key of the schema under a comment with its doc and, in brackets, its rule
    (`keys.reference`: read from the schema's fields). `template` is the dotted key of `data` as the reference
    spells it (an entry of a dict of tasks: `eval.generate.<name>.`)."""
    lines = []
    for name, value in data.items():
        key, doc = f"{template}{name}", docs.get(f"{template}{name}")
        if doc is not None:
            lines += textwrap.wrap(f"{doc.doc} [{doc.rule}]", 120, initial_indent=f"{indent}# ",
                                   subsequent_indent=f"{indent}# ", break_on_hyphens=False)
        entries = f"{key}.<name>." if any(k.startswith(f"{key}.<name>.") for k in docs) else None
        if isinstance(value, dict) and value and (doc is None or entries):
            lines.append(f"{indent}{_inline(name)}:")
            for entry, fields in (value.items() if entries else [(None, value)]):
                if entry is not None:
                    lines.append(f"{indent}  {_inline(entry)}:")
                lines += _annotated(fields, entries or f"{key}.", docs, indent + ("    " if entries else "  "))
        else:
            lines.append(f"{indent}{_inline(name)}: {_inline(value)}")
    return lines


def _inline(value: Any) -> str:
    """A value on one line, as YAML (JSON, which YAML reads too, where a string holds a line break)."""
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # (libyaml's: ~10x faster)
    text = yaml.dump(value, Dumper=dumper, default_flow_style=True, width=10**6, allow_unicode=True)
    text = text.removesuffix("\n...\n").strip()
    return json.dumps(value, ensure_ascii=False) if "\n" in text else text


def _flags_help(args_parser: argparse.ArgumentParser) -> str:
    text, overrides = "", None
    for action in args_parser._actions:
        if action.option_strings:
            text += f"{','.join(action.option_strings)} : {action.help}\n"
        else:
            overrides = action
    return text + "Overrides : " + str(getattr(overrides, "help", ""))


def _config_groups(sources: list[Any]) -> dict[str, list[str]]:
    """Every config group with options (`hydra/launcher`, `model`, ...) -> its options, from every source."""
    def options(group: str, kind: ObjectType) -> list[str]:
        return sorted({o for s in sources if s.is_group(group) for o in s.list(group, results_filter=kind)})

    groups: dict[str, list[str]] = {}

    def walk(parent: str) -> None:
        for name in options(parent, ObjectType.GROUP):
            group = f"{parent}/{name}" if parent else name
            if configs := options(group, ObjectType.CONFIG):
                groups[group] = configs
            walk(group)

    walk("")
    return groups


def _format_groups(groups: dict[str, list[str]], hydra: bool) -> str:
    return "".join(f"{g}: {', '.join(o)}\n" for g, o in sorted(groups.items())
                   if (g == "hydra" or g.startswith("hydra/")) == hydra)
