"""`python -m llmexp`: compose the config with Hydra and hand it to `llmexp.train.run`.

Nothing heavy is imported here: `--help` and `--cfg job` never import torch.
Exit codes: 0 finished, 2 a user's mistake, 3 diverged, 1 anything else.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from llmexp.errors import EXIT_USER
from llmexp.paths import conf_dir, register_resolvers

_task_started = False


def task(cfg: DictConfig) -> int:
    """Hydra's task function: validate, then train. In a sweep it returns the exit code."""
    global _task_started
    _task_started = True
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from llmexp.errors import run_guarded

    code = run_guarded(cfg)
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return code
    sys.exit(code)


def cli() -> None:
    """Entry point. Hydra exits 1 on a compose error; that is a user's mistake, so exit 2."""
    from llmexp.distributed import maybe_relaunch
    from llmexp.errors import UserError
    from llmexp.preflight import check_args

    maybe_relaunch()  # `accelerate launch --cpu --num_processes N`: start the N ranks before Hydra runs

    try:  # typos, unknown options, disallowed _target_s, path escapes: before Hydra creates a run dir
        sys.argv[1:] = check_args(sys.argv[1:])  # secrets become ${oc.env:LLMEXP_SECRET_<n>}
    except UserError as err:
        print(f"llmexp: error: {err}", file=sys.stderr)
        sys.exit(EXIT_USER)
    import hydra

    from llmexp.config import register_configs
    from llmexp.jobs import jobs_launched
    from llmexp.launcher import register_launchers

    register_configs()
    register_resolvers()
    register_launchers()  # a strict editable install hides hydra_plugins/ from Hydra's scan
    main = hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")(task)
    try:
        main()
    except SystemExit as exit_:
        if exit_.code == 1 and not _task_started and not jobs_launched():  # a sweep's failed job is not exit 2
            print("Fix the override or config key named above (python -m llmexp --help lists them).",
                  file=sys.stderr)
            sys.exit(EXIT_USER)
        raise


if __name__ == "__main__":
    cli()
