"""`python -m llmexp`: compose the config with Hydra, check it, and hand it to `llmexp.train.task.run_guarded`.

Nothing heavy is imported here: `--help` and `--cfg job` never import torch.
Exit codes: 0 finished, 2 a user's mistake, 3 diverged, 1 anything else.

The command line is Hydra's (`hydra.main`'s parser and flow), with one difference: the config is
composed once, by llmexp, and checked before Hydra sees it (`_compose_and_check`), so nothing a config
names runs and no directory is created for a refused or invalid config. `_run_hydra` follows
`hydra._internal.utils._run_hydra` of Hydra 1.3 step by step (tests/test_security.py pins that source).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from llmexp.config.tree import conf_dir, register_resolvers
from llmexp.errors import EXIT_USER, UserError

if TYPE_CHECKING:
    import argparse

_task_started = False


def task(cfg: DictConfig) -> int:
    """Hydra's task function: validate, then train. In a sweep it returns the exit code."""
    global _task_started
    _task_started = True
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from llmexp.train.task import run_guarded  # (light: the trainer is imported inside its preemption guard)

    code = run_guarded(cfg)
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return code
    sys.exit(code)


def _refuse_rerun(args: argparse.Namespace) -> None:
    if args.experimental_rerun is not None:
        raise UserError(f"--experimental-rerun {args.experimental_rerun}: refused, it unpickles that file (code "
                        "could run); rerun with the overrides in RUN_DIR/.hydra/overrides.yaml instead")


def _compose_and_check(loader: Any, config_name: str, overrides: list[str], run_mode: Any, full: bool) -> Any:
    """Compose once, as Hydra is about to, check, and hand the config over to Hydra.

    `full`, a single run: also validate the config (`validation.validate`, `check_environment`) and lock
    its directory. `full`, a sweep: also compose and validate every config it can run (`llmexp.sweep.check`;
    the sweeper's own validation then reuses a grid's) and lock the sweep directory. All before Hydra
    creates anything.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    cfg = _reported(lambda: loader.compose(config_name, overrides, run_mode))
    loader.check(cfg, config_name, overrides)
    if full and run_mode == RunMode.RUN:
        from llmexp.config.environment import check_environment
        from llmexp.config.validation import validate
        from llmexp.rundir.lock import lock_run_dir

        HydraConfig.instance().set_config(_with_output_dir(cfg))  # for ${hydra:...} in the job's values
        validate(cfg)
        check_environment(cfg)
        lock_run_dir(str(cfg.hydra.run.dir))
    elif full:
        from llmexp.rundir.lock import lock_sweep_dir

        _reported(lambda: loader.check_sweep_jobs(cfg))
        lock_sweep_dir(str(cfg.hydra.sweep.dir))  # one sweeper per sweep directory, as one run per run directory
    loader.hand_over(cfg, config_name, overrides, run_mode)
    return cfg


def _with_output_dir(cfg: Any) -> Any:
    """A copy of a run's config with `hydra.runtime.output_dir` set as Hydra's run_job will set it."""
    import copy
    import os

    from omegaconf import open_dict

    probe = copy.deepcopy(cfg)
    with open_dict(probe.hydra):
        probe.hydra.runtime.output_dir = os.path.abspath(str(cfg.hydra.run.dir))
    return probe


def _reported(step: Any) -> Any:
    """Run `step`; a composition error is reported as Hydra reports it (exit 1, mapped to 2), a UserError
    goes to the CLI (exit 2 with its own message)."""
    from hydra._internal.utils import run_and_report

    try:
        return step()
    except UserError:
        raise
    except Exception as err:  # Hydra's composition errors: its own message, no traceback
        failure = err

        def again() -> None:
            raise failure

        return run_and_report(again)


def _run_hydra(args_parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`hydra._internal.utils._run_hydra` (Hydra 1.3) for llmexp's task, every composition checked."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import (
        create_automatic_config_search_path,
        detect_calling_file_or_module_from_task_function,
        detect_task_name,
        run_and_report,
        validate_config_path,
    )
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from llmexp.cli.hydra_loader import ConfigCheck

    config_name = args.config_name if args.config_name is not None else "config"
    config_path = args.config_path if args.config_path is not None else str(conf_dir())
    calling_file, calling_module = detect_calling_file_or_module_from_task_function(task)
    task_name = detect_task_name(calling_file, calling_module)
    validate_config_path(config_path)
    search_path = create_automatic_config_search_path(calling_file, calling_module, config_path)
    if args.config_dir is not None:
        run_and_report(lambda: _add_config_dir(search_path, args.config_dir))
    hydra = run_and_report(lambda: Hydra.create_main_hydra2(task_name=task_name, config_search_path=search_path))
    loader = ConfigCheck(hydra.config_loader)
    hydra.config_loader = loader
    try:
        _dispatch(hydra, loader, args_parser, args, config_name, RunMode)
    finally:
        GlobalHydra.instance().clear()


def _add_config_dir(search_path: Any, config_dir: str) -> None:
    import os

    from hydra.core.config_search_path import SearchPathQuery
    from hydra.errors import SearchPathException

    abs_config_dir = os.path.abspath(config_dir)
    if not os.path.isdir(abs_config_dir):
        raise SearchPathException(f"Additional config directory '{abs_config_dir}' not found")
    search_path.prepend(provider="command-line", path=f"file://{abs_config_dir}",
                        anchor=SearchPathQuery(provider="schema"))


def _dispatch(hydra: Any, loader: Any, args_parser: argparse.ArgumentParser, args: argparse.Namespace,
              config_name: str, run_mode_type: Any) -> None:
    """Hydra's command dispatch: --help, --hydra-help, --cfg, --info, --shell-completion, run or multirun."""
    from hydra._internal.utils import run_and_report

    overrides: list[str] = args.overrides
    if args.help or args.hydra_help:  # both configure logging from the config: check it first
        _compose_and_check(loader, config_name, overrides, run_mode_type.RUN, full=False)
        show = hydra.app_help if args.help else hydra.hydra_help
        show(config_name=config_name, args_parser=args_parser, args=args)
        sys.exit(0)
    has_show_cfg = args.cfg is not None
    if args.resolve and not has_show_cfg:
        raise ValueError("The --resolve flag can only be used in conjunction with --cfg or --help")
    num_commands = args.run + has_show_cfg + args.multirun + args.shell_completion + (args.info is not None)
    if num_commands > 1:
        raise ValueError("Only one of --run, --multirun, --cfg, --info and --shell_completion can be specified")
    if num_commands == 0:
        args.run = True
    if args.run or args.multirun:
        # Hydra asks the config for hydra.mode (one more composition); llmexp takes it from --multirun.
        mode = run_mode_type.MULTIRUN if args.multirun else run_mode_type.RUN
        overrides = [*overrides, f"hydra.mode={mode.name}"]
        _compose_and_check(loader, config_name, overrides, mode, full=True)
        launch = hydra.multirun if args.multirun else hydra.run
        run_and_report(lambda: launch(config_name=config_name, task_function=task, overrides=overrides))
    elif has_show_cfg:
        _compose_and_check(loader, config_name, overrides, run_mode_type.RUN, full=False)
        run_and_report(lambda: hydra.show_cfg(config_name=config_name, overrides=overrides, cfg_type=args.cfg,
                                              package=args.package, resolve=args.resolve))
    elif args.shell_completion:
        run_and_report(lambda: hydra.shell_completion(config_name=config_name, overrides=overrides))
    elif args.info:
        hydra.show_info(args.info, config_name=config_name, overrides=overrides)


def cli() -> None:
    """Entry point. Hydra exits 1 on a compose error; that is a user's mistake, so exit 2."""
    from llmexp.cli.argv import check_args
    from llmexp.train.distributed import maybe_relaunch

    maybe_relaunch()  # `accelerate launch --cpu --num_processes N`: start the N ranks before Hydra runs

    try:  # typos, unknown options, wrong types: before anything is composed
        sys.argv[1:] = check_args(sys.argv[1:])  # secrets become ${oc.env:LLMEXP_SECRET_<n>}
    except UserError as err:
        _exit_user(err)
    from hydra import version
    from hydra._internal.utils import get_args_parser
    from hydra.core.plugins import Plugins

    from llmexp.cli.hydra_loader import guard_package_sources
    from llmexp.config.schema import register_configs
    from llmexp.sweep.jobs import jobs_launched

    version.setbase("1.3")
    register_configs()
    register_resolvers()
    Plugins.instance()  # Hydra's plugin scan (llmexp's launchers included), which registers the config sources
    guard_package_sources()  # after the plugin scan: pkg:// search paths import only llmexp's and Hydra's packages
    args_parser = get_args_parser()  # Hydra's own parser: every flag spelling argparse accepts
    try:
        args = args_parser.parse_args()
        _refuse_rerun(args)
        _run_hydra(args_parser, args)
    except UserError as err:
        _exit_user(err)
    except BrokenPipeError:  # `python -m llmexp --help | head`: the reader left; no traceback (Python's own recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except SystemExit as exit_:
        if exit_.code == 1 and not _task_started and not jobs_launched():  # a sweep's failed job is not exit 2
            print("Fix the override or config key named above (python -m llmexp --help lists them).",
                  file=sys.stderr)
            sys.exit(EXIT_USER)
        raise


def _exit_user(err: UserError) -> None:
    from llmexp.rundir.redact import scrub_text

    print(f"llmexp: error: {scrub_text(str(err))}", file=sys.stderr)
    sys.exit(EXIT_USER)

