"""llmexp's Hydra launchers, usable by any Hydra app: `hydra/launcher=llmexp_local` and `hydra/launcher=llmexp_slurm`.

Hydra imports every module under `hydra_plugins` when it starts (also for `--help`), so this module
stays small and light: the launcher configs (dataclasses, registered in Hydra's ConfigStore as
hydra-submitit-launcher does) and thin classes that hand the work to `llmexp.sweep.local` (a process
per job) or `llmexp.sweep.slurm` (a submitit job array), imported on the first launch. Neither torch
nor submitit is imported here.

Settings live under `hydra.launcher.*` (`hydra.launcher.max_parallel=2`). llmexp's own `cluster=`
group selects these launchers and maps its short keys onto them (`cluster.max_parallel=2` is the same
setting; `llmexp/conf/hydra/launcher/cluster_*.yaml`). The extras that only make sense for llmexp's trainer
(resume on requeue, `job_status.json`, the sweep report) apply when the composed config is llmexp's
(`llmexp.sweep.jobs.is_llmexp_config`); any other app gets Hydra's usual job returns.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from llmexp.config.schema import SlurmJobConfig  # dataclasses only: no torch, fine on Hydra's start-up path

_HERE = "hydra_plugins.llmexp_launcher.llmexp_launcher"


@dataclass
class LocalLauncherConf:
    """`hydra/launcher=llmexp_local`: each job in its own process on this machine. Each setting is described, with
    its rule, once: on `llmexp.config.schema.ClusterConfig`'s field of the same name (`cluster.*`)."""

    _target_: str = f"{_HERE}.LocalLauncher"
    max_parallel: int = 1
    jobs_per_gpu: int = 1


@dataclass
class SlurmLauncherConf(SlurmJobConfig):
    """`hydra/launcher=llmexp_slurm`: the sweep as one SLURM job array through submitit (the job's resources and
    requeue settings: `SlurmJobConfig`, the fields `cluster=slurm` maps its keys onto; `wait`: `ClusterConfig`'s;
    `submitit_folder`: `llmexp.config.schema.LauncherSettings`'s, where each is described with its rule)."""

    _target_: str = f"{_HERE}.SlurmLauncher"
    submitit_folder: str = "${hydra.sweep.dir}/.submitit/%j"
    wait: bool = True


ConfigStore.instance().store(group="hydra/launcher", name="llmexp_local", node=LocalLauncherConf,
                             provider="llmexp_launcher")
ConfigStore.instance().store(group="hydra/launcher", name="llmexp_slurm", node=SlurmLauncherConf,
                             provider="llmexp_launcher")


class _LlmexpLauncher(Launcher):
    """Holds what Hydra hands a launcher; `launch` is implemented by the subclasses."""

    def __init__(self, **params: Any) -> None:
        self.settings: DictConfig = OmegaConf.create(params)
        """The launcher's config (`hydra.launcher.*` less `_target_`), as Hydra instantiated it."""
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None
        self.within_search = False
        """Set by llmexp's search sweeper: a batch's failed or pruned jobs are results, not a reason to exit 1."""

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function


class LocalLauncher(_LlmexpLauncher):
    """`hydra/launcher=llmexp_local` (llmexp: `cluster=local`): see `llmexp.sweep.local.launch_local`."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from llmexp.sweep.jobs import exit_2_on_user_error  # a user's mistake: one message and exit 2
        from llmexp.sweep.local import launch_local

        return exit_2_on_user_error(launch_local, self, job_overrides, initial_job_idx)


class SlurmLauncher(_LlmexpLauncher):
    """`hydra/launcher=llmexp_slurm` (llmexp: `cluster=slurm`): see `llmexp.sweep.slurm.launch_slurm`."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from llmexp.sweep.jobs import exit_2_on_user_error  # a user's mistake: one message and exit 2
        from llmexp.sweep.slurm import launch_slurm

        return exit_2_on_user_error(launch_slurm, self, job_overrides, initial_job_idx)
