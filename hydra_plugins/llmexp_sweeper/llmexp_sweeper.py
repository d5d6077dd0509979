"""llmexp's Hydra sweepers: `hydra/sweeper=llmexp_grid` (Hydra's grid, plus paired axes and lr scaling)
and `hydra/sweeper=llmexp_search` (optuna: random or TPE, with pruning from live eval losses).

As with the launchers beside it, Hydra imports this module on every start (also for `--help`), so it
holds only the sweeper configs (dataclasses in Hydra's ConfigStore) and thin classes; the work is in
`llmexp.sweep.space` (what the command line asks to explore) and `llmexp.sweep.search` (the study),
imported when a sweep starts. llmexp's `sweep=` group selects these sweepers and maps its keys onto
them (`sweep.n_trials=20` is `hydra.sweeper.n_trials=20`; `llmexp/conf/hydra/sweeper/sweep_*.yaml`).
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.types import Override
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from llmexp.config.schema import GridSweepConfig, SearchSweepConfig  # dataclasses only: no torch

_HERE = "hydra_plugins.llmexp_sweeper.llmexp_sweeper"


@dataclass
class GridSweeperConf(GridSweepConfig):
    """`hydra/sweeper=llmexp_grid` (llmexp's `sweep=grid`, the default): every combination, as Hydra's basic
    sweeper, except for the keys of `zip`, whose values pair up (the options: `GridSweepConfig`; `max_batch_size`
    and `params`: `llmexp.config.schema.SweeperSettings`, where each is described with its rule)."""

    _target_: str = f"{_HERE}.GridSweeper"
    max_batch_size: int | None = None
    params: dict[str, str] | None = None


@dataclass
class SearchSweeperConf(SearchSweepConfig):
    """`hydra/sweeper=llmexp_search` (llmexp's `sweep=random|tpe`): an optuna study over the swept keys (the
    options: `SearchSweepConfig`; `sampler` and `params`: `llmexp.config.schema.SweeperSettings`; each trial reads
    `sweep.pruner` from its own config, so set it there)."""

    _target_: str = f"{_HERE}.SearchSweeper"
    sampler: str = "tpe"
    params: dict[str, str] | None = None


ConfigStore.instance().store(group="hydra/sweeper", name="llmexp_grid", node=GridSweeperConf,
                             provider="llmexp_sweeper")
ConfigStore.instance().store(group="hydra/sweeper", name="llmexp_search", node=SearchSweeperConf,
                             provider="llmexp_sweeper")


class _LaunchingSweeper(Sweeper):
    """What both sweepers keep from `setup`: the composed config, and the launcher Hydra's config names."""

    def __init__(self) -> None:
        self.config: DictConfig | None = None
        self.launcher: Any = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context,
                                                                task_function=task_function, config=config)

    def _parse(self, params: dict[str, str], arguments: list[str]) -> list[Override]:
        """The overrides to sweep: the config's `params`, then the command line's."""
        from hydra.core.override_parser.overrides_parser import OverridesParser

        assert self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        return parser.parse_overrides([*(f"{k}={v}" for k, v in params.items()), *arguments])

    def _save_config(self) -> None:
        """The sweep's config in its directory, `multirun.yaml`, as Hydra's sweepers save it."""
        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")


class GridSweeper(_LaunchingSweeper):
    """Hydra's grid (its basic sweeper's flow, on the public `Sweeper` plugin API), its product replaced by
    `llmexp.sweep.space.grid_jobs` (zip, lr scaling): jobs in batches of `max_batch_size`, each batch composed
    once (`validate_batch_is_legal`) before the launcher runs it, the sweep config saved as `multirun.yaml`."""

    def __init__(self, max_batch_size: int | None, params: dict[str, str] | None = None,
                 zip: Sequence[str] = (), lr_scaling: str = "none", base_batch_size: int | None = None) -> None:
        self.max_batch_size, self.params = max_batch_size, dict(params or {})
        self.zip_keys, self.lr_scaling, self.base_batch_size = list(zip), lr_scaling, base_batch_size
        super().__init__()

    def sweep(self, arguments: list[str]) -> Any:
        """Hydra's grid, then the sweep's exit code from how every job ended (`jobs.sweep_exit_code`): a
        launcher exits 1 for a batch with a job that did not end by itself, as a Ctrl-C does; 3 needs every
        batch's jobs."""
        from hydra_plugins.llmexp_launcher.llmexp_launcher import LocalLauncher, SlurmLauncher
        from llmexp.rundir.read import TrialResult, read_result
        from llmexp.sweep.jobs import exit_for_results, job_dir_of, objective

        try:
            returns = self._grid(arguments)
        except KeyboardInterrupt:  # the launcher stopped and recorded its jobs; no later batch starts
            logging.getLogger(__name__).error("interrupted; the same command continues the sweep (exit 1)")
            raise SystemExit(1) from None
        metric = objective(self.config)[0] if self.config is not None else None
        if self.config is None or metric is None:  # another app gets Hydra's returns only
            return returns
        results = []
        ours = isinstance(self.launcher, LocalLauncher | SlurmLauncher)  # (hydra/launcher=basic runs them too)
        if ours and any(ret.return_value is None for batch in returns for ret in batch):
            return returns  # cluster.wait=false: submitted, not waited for; each job records its own end
        for num, ret in enumerate(r for batch in returns for r in batch):  # numbered from 0, batch after batch
            # llmexp's launchers return each job's own directory (`jobs.job_returns`): a subdir may name its values
            job_dir = Path(str(ret.working_dir)) if ours else job_dir_of(self.config, num)
            result = read_result(job_dir, metric)  # completed: ended with a finite `sweep.metric`
            if ret.return_value == 0 and not (job_dir / "summary.json").exists():  # ended well, writes no summary
                result = TrialResult("completed")
            results.append(result)
        exit_for_results(results, "job", Path(str(self.config.hydra.sweep.dir)))
        return returns

    def split_arguments(self, overrides: list[Override], max_batch_size: int | None) -> list[list[list[str]]]:
        """The jobs, in batches of `max_batch_size`."""
        from llmexp.sweep.jobs import exit_2_on_user_error
        from llmexp.sweep.space import grid_jobs, lr_to_scale, scale_lr

        jobs = exit_2_on_user_error(grid_jobs, overrides, self.zip_keys)
        config_lr = lr_to_scale(self.config) if self.config is not None and "lr" in self.config else None
        jobs = exit_2_on_user_error(scale_lr, jobs, self.lr_scaling, self.base_batch_size, config_lr)
        size = max_batch_size or len(jobs)
        return [jobs[i:i + size] for i in range(0, len(jobs), size)]

    def _grid(self, arguments: list[str]) -> Any:
        """Hydra's basic sweeper's flow: the batches, each composed and checked, then launched."""
        batches = self.split_arguments(self._parse(self.params, arguments), self.max_batch_size)
        self._save_config()
        returns, initial_job_idx = [], 0
        for batch in batches:
            self.validate_batch_is_legal(batch)  # composition errors before anything of the batch runs
            results = self.launcher.launch(batch, initial_job_idx=initial_job_idx)
            for result in results:
                _ = result.return_value  # a failed job's exception is raised here, as Hydra's sweeper raises it
            initial_job_idx += len(batch)
            returns.append(results)
        return returns


class SearchSweeper(_LaunchingSweeper):
    """The optuna search: see `llmexp.sweep.search.run_search`."""

    def __init__(self, **settings: Any) -> None:
        self.params: dict[str, str] = dict(settings.pop("params") or {})
        self.settings = settings
        super().__init__()

    def sweep(self, arguments: list[str]) -> Any:
        from llmexp.sweep.jobs import exit_2_on_user_error

        return exit_2_on_user_error(self._sweep, arguments)

    def _sweep(self, arguments: list[str]) -> Any:
        from llmexp.sweep.search import run_search

        overrides = self._parse(self.params, arguments)
        options = dict(self.settings)
        sampler, search = options.pop("sampler"), SearchSweepConfig(**options)
        self._prepare_launcher(search)
        self._save_config()
        return run_search(self, overrides, sampler, search)

    def _prepare_launcher(self, search: SearchSweepConfig) -> None:
        """The search needs one of llmexp's launchers, waiting for each batch, `parallel` trials at once."""
        from hydra_plugins.llmexp_launcher.llmexp_launcher import LocalLauncher, SlurmLauncher
        from llmexp.errors import UserError

        if not isinstance(self.launcher, LocalLauncher | SlurmLauncher):
            raise UserError("a search (sweep=random or sweep=tpe) runs its trials through cluster=local or "
                            f"cluster=slurm, not {type(self.launcher).__name__}")
        if isinstance(self.launcher, SlurmLauncher) and not self.launcher.settings.wait:
            raise UserError("cluster.wait=false: a search must watch its trials to prune them and to ask for "
                            "the next ones; use cluster.wait=true (the default)")
        self.launcher.within_search = True
        if isinstance(self.launcher, LocalLauncher):  # CPU slots; with GPUs the launcher uses one per GPU
            self.launcher.settings.max_parallel = max(int(self.launcher.settings.max_parallel), search.parallel)
