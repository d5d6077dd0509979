"""`python -m llmexp`: check the command line (cli/argv.py) and every config it will run (cli/compose.py), then
hand over to `@hydra.main`, whose task is `run_job` (docs/explanation/security-model.md, "One check, on the
composed config"): so nothing a config names runs, and no directory is created, for a refused or invalid config.
Nothing heavy is imported here: `--help` and `--cfg job` never import torch. Exit codes: docs/reference/commands.md.
Hydra's private API is used in one place only: `cli/hydra_internals.py`.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import hydra
from hydra import version
from hydra.core.hydra_config import HydraConfig
from hydra.errors import OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig

from llmexp.cli import compose
from llmexp.cli.argv import check_args
from llmexp.cli.hydra_internals import args_parser, compose_api_as_hydra_main, guard_package_sources
from llmexp.cli.relaunch import maybe_relaunch
from llmexp.config.keys import unknown_key
from llmexp.config.schema import register_configs
from llmexp.config.tree import conf_dir, register_resolvers
from llmexp.errors import EXIT_USER, UserError, first_line
from llmexp.process import run_entry
from llmexp.rundir.redact import print_user_error, scrub_text

if TYPE_CHECKING:
    import argparse

_task_started = False


def run_job(cfg: DictConfig) -> int:
    """Hydra's task function: validate, then train. In a sweep it returns the exit code."""
    global _task_started
    _task_started = True
    from llmexp.rundir.lock import lock_run_dir
    from llmexp.train.guarded import run_guarded, user_error_exit  # (light: the trainer is imported later)

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return run_guarded(cfg)  # (llmexp's launchers locked the job's directory)
    try:  # the directory the CLI locked, unless the run's own composition resolved another (a ${now:} in it)
        lock_run_dir(HydraConfig.get().runtime.output_dir)
    except UserError as err:
        sys.exit(user_error_exit(err))
    sys.exit(run_guarded(cfg))


def _runs(args: argparse.Namespace) -> bool:
    """The command runs the task (a run or a sweep), as `@hydra.main` will decide; the other commands
    (--cfg, --info, --shell-completion) instantiate nothing. Contradictory flags are Hydra's to report."""
    shows = args.cfg is not None or args.info is not None or args.shell_completion
    return not shows and not args.resolve and not (args.run and args.multirun)


def _preflight(args: argparse.Namespace, args_parser: argparse.ArgumentParser) -> None:
    """Everything checked before `@hydra.main` runs (see the module's docstring); --help is answered here. A
    composition error is printed as Hydra prints it (no traceback unless HYDRA_FULL_ERROR=1) and exits 1, which
    `cli` maps to 2; a UserError goes to `cli` (exit 2 with its own message)."""
    config_name = args.config_name if args.config_name is not None else "config"
    config_path = args.config_path if args.config_path is not None else str(conf_dir())
    try:
        with compose_api_as_hydra_main(run_job, config_path, args.config_dir):  # as `@hydra.main` will initialize
            if args.help or args.hydra_help:  # (--hydra-help composes Hydra's node alone, as Hydra does)
                name = None if args.hydra_help and not args.help else config_name
                cfg = compose.compose_checked(name, args.overrides)
                print(compose.help_text(cfg, args_parser, hydra_help=not args.help, resolve=args.resolve))
                sys.exit(0)
            # Hydra reads the run mode from the config (one more composition); llmexp takes it from --multirun.
            sys.argv.append(f"hydra.mode={'MULTIRUN' if args.multirun else 'RUN'}")
            check = compose.check_sweep if args.multirun else compose.check_run
            check(config_name, [*args.overrides, sys.argv[-1]])
    except (UserError, SystemExit, BrokenPipeError):
        raise
    except Exception as err:  # Hydra's and OmegaConf's composition errors
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(scrub_text(str(err)), file=sys.stderr)
        # Hydra's "Could not override 'data.mix'" keeps the reason (a key the schema lacks, a value of the wrong
        # type) in its cause, shown only with HYDRA_FULL_ERROR=1
        if err.__cause__ is not None and (why := first_line(err.__cause__)) and why not in str(err):
            print(f"Because: {scrub_text(why)}", file=sys.stderr)
        if isinstance(err, OverrideParseException):  # a path with a space or an accent, unquoted
            print("A value with spaces or characters such as é must be quoted, inside the shell's quotes: "
                  "'data.train_file=\"my file.jsonl\"'", file=sys.stderr)
        key = str(getattr(err.__cause__ or err.__context__, "full_key", ""))  # a key a YAML file sets: its typo
        if "." in key and (hint := unknown_key(key)):  # (inside a list's entry, e.g. data.mix, the key is the entry's)
            print(scrub_text(hint), file=sys.stderr)
        print("\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.", file=sys.stderr)
        sys.exit(1)


def cli() -> None:
    """Entry point. Hydra exits 1 on a compose error; that is a user's mistake, so exit 2."""
    maybe_relaunch()  # `accelerate launch --cpu --num_processes N`: start the N ranks before Hydra runs
    from llmexp.sweep.jobs import jobs_launched

    version.setbase("1.3")
    register_configs()
    register_resolvers()
    guard_package_sources()  # pkg:// search paths import only llmexp's and Hydra's packages
    parser = args_parser()
    try:
        sys.argv[1:] = check_args(sys.argv[1:])  # typos first; secrets become ${oc.env:LLMEXP_SECRET_<n>}
        args = parser.parse_args()
        if args.experimental_rerun is not None:
            raise UserError(f"--experimental-rerun {args.experimental_rerun}: refused, it unpickles that file (code "
                            "could run); rerun with the overrides in RUN_DIR/.hydra/overrides.yaml instead")
        if args.help or args.hydra_help or _runs(args):
            _preflight(args, parser)
        hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(run_job)()  # reads sys.argv
    except UserError as err:
        sys.exit(print_user_error("llmexp", err))
    except BrokenPipeError:  # `python -m llmexp --help | head`: the reader left; no traceback (Python's own recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except SystemExit as exit_:
        if exit_.code == 1 and not _task_started and not jobs_launched():  # a sweep's failed job is not exit 2
            print("Fix the override or config key named above (python -m llmexp --help lists them).", file=sys.stderr)
            sys.exit(EXIT_USER)
        raise


def main() -> None:
    """The process's entry point (`python -m llmexp`, the `llmexp` script, `python -m llmexp.lr_find`). Tests call
    `cli` in their own process, which goes on."""
    run_entry(cli)
