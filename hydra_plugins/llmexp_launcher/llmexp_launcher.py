"""llmexp's Hydra launchers: `hydra/launcher=llmexp_local` and `hydra/launcher=llmexp_slurm`.

Hydra imports every module under `hydra_plugins` when it starts (also for `--help`), and only
accepts launcher classes defined here, so this module stays tiny: thin classes that hand the work
to `llmexp.sweep.local` (local processes) or `llmexp.sweep.slurm` (submitit), imported on the first launch.
Neither torch nor submitit is imported here.

The launcher configs are `conf/hydra/launcher/llmexp_{local,slurm}.yaml`, found through llmexp's
config search path: setuptools' editable installs hide this package from Hydra's plugin scan, so
configs registered here would be missing outside the checkout (see `llmexp.sweep.local.register_launchers`).

Job settings are not launcher parameters: they live in the composed config's `cluster` node
(`conf/cluster/*.yaml`, typed by `llmexp.config.schema.ClusterConfig`), so `cluster.max_parallel=2` or
`cluster.timeout_min=30` works from the command line like any other key.
"""

import sys
from collections.abc import Callable, Sequence
from typing import Any

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class _LlmexpLauncher(Launcher):
    """Holds what Hydra hands a launcher; `launch` is implemented by the subclasses."""

    def __init__(self, **params: Any) -> None:
        self.params = params
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def _guarded(self, launch: Callable[..., Sequence[JobReturn]], job_overrides: Sequence[Sequence[str]],
                 initial_job_idx: int) -> Sequence[JobReturn]:
        """A user's mistake (e.g. cluster=slurm without SLURM) is one message and exit 2, no traceback."""
        from llmexp.errors import EXIT_USER, UserError

        try:
            return launch(self, job_overrides, initial_job_idx)
        except UserError as err:
            print(f"llmexp: error: {err}", file=sys.stderr)
            raise SystemExit(EXIT_USER) from None


class LocalLauncher(_LlmexpLauncher):
    """`cluster=local`: see `llmexp.sweep.local.launch_local`."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from llmexp.sweep.local import launch_local

        return self._guarded(launch_local, job_overrides, initial_job_idx)


class SlurmLauncher(_LlmexpLauncher):
    """`cluster=slurm`: see `llmexp.sweep.slurm.launch_slurm`."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from llmexp.sweep.slurm import launch_slurm

        return self._guarded(launch_slurm, job_overrides, initial_job_idx)
