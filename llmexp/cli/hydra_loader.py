"""Hydra's config loader with llmexp's security check on every config it composes, and `pkg://` search
paths limited to trusted packages. The only module that touches Hydra's loader internals (Hydra 1.3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmexp.config import security
from llmexp.errors import UserError


class ConfigCheck:
    """Hydra's ConfigLoader with `security.check_config` on every config it composes.

    Hydra 1.3 (`hydra._internal.hydra.Hydra`) composes through `hydra.config_loader` for runs, sweeps,
    `--help` and `--cfg`, and sweep launchers (local and SLURM) compose each job through the loader in
    their `HydraContext`, so installing this there checks every config before Hydra instantiates
    callbacks, the launcher, the sweeper or logging, or creates a directory. `hand_over` gives Hydra a
    config the CLI already composed and checked, so that it is not composed twice (and Hydra then uses
    the very directories that were checked and locked). Other methods go to Hydra's loader.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._ready: dict[tuple[Any, ...], Any] = {}
        self._repos: dict[tuple[Any, ...], Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("loader", "_ready", "_repos"):  # unpickling asks before __dict__
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __getstate__(self) -> dict[str, Any]:
        return {"loader": self.loader, "_ready": self._ready, "_repos": {}}  # (repositories are rebuilt)

    def list_groups(self, parent_name: str) -> list[str]:
        """Hydra 1.3's `ConfigLoaderImpl.list_groups`, through the cached repository below."""
        from hydra.core.object_type import ObjectType

        return self.get_group_options(group_name=parent_name, results_filter=ObjectType.GROUP)

    def get_group_options(self, group_name: str, results_filter: Any = "config", config_name: str | None = None,
                          overrides: list[str] | None = None) -> list[str]:
        """Hydra 1.3's `ConfigLoaderImpl.get_group_options`, with its config repository built once per command
        line instead of once per call (`--help` asks ~90 times; each build deep-copies the repository)."""
        from hydra.core.object_type import ObjectType

        key = (config_name, tuple(overrides or []))
        if key not in self._repos:
            _, self._repos[key] = self.loader._parse_overrides_and_create_caching_repo(config_name, list(key[1]))
        wanted = ObjectType.CONFIG if results_filter == "config" else results_filter  # Hydra's default
        return self._repos[key].get_group_options(group_name, wanted)  # type: ignore[no-any-return]

    def compose(self, config_name: str | None, overrides: list[str], run_mode: Any) -> Any:
        """Compose as Hydra's `compose_config` will (from the shell, sweep overrides validated), unchecked."""
        return self.loader.load_configuration(config_name=config_name, overrides=list(overrides),
                                              run_mode=run_mode, from_shell=True)

    def check(self, cfg: Any, config_name: str | None, overrides: list[str]) -> None:
        """`security.check_config`, each problem named with the file (or command line) it came from."""
        security.check_config(cfg, origin=lambda key: key_origin(self.loader, config_name, overrides, key))

    def hand_over(self, cfg: Any, config_name: str | None, overrides: list[str], run_mode: Any) -> None:
        """The next `load_configuration` with these arguments returns `cfg` (once) instead of composing."""
        self._ready[(config_name, tuple(overrides), run_mode)] = cfg

    def load_configuration(self, config_name: str | None, overrides: list[str], run_mode: Any,
                           from_shell: bool = True, validate_sweep_overrides: bool = True) -> Any:
        ready = self._ready.pop((config_name, tuple(overrides), run_mode), None)
        if ready is not None:
            return ready
        cfg = self.loader.load_configuration(config_name=config_name, overrides=overrides, run_mode=run_mode,
                                             from_shell=from_shell, validate_sweep_overrides=validate_sweep_overrides)
        self.check(cfg, config_name, overrides)
        return cfg

    def check_sweep_jobs(self, master_config: Any) -> None:
        """Compose and check every job of a sweep before the sweeper creates the sweep directory; each config is
        handed to the sweeper's own validation (`validate_batch_is_legal`) instead of composing again. A search's
        trials are not known yet: one job with each swept key at its first value stands for them."""
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        from llmexp.sweep.space import grid_jobs, probe_job, scale_lr

        sweeper = master_config.hydra.sweeper
        params = sweeper.get("params")
        arguments = [f"{k}={v}" for k, v in (OmegaConf.to_container(params) if params else {}).items()]  # type: ignore[union-attr]
        arguments += OmegaConf.to_container(master_config.hydra.overrides.task, resolve=False)  # type: ignore[arg-type]
        parsed = OverridesParser.create(config_loader=self.loader).parse_overrides(arguments)
        if str(sweeper._target_).endswith(".SearchSweeper"):
            jobs = [probe_job(parsed)]
        else:  # Hydra's BasicSweeper or llmexp's GridSweeper (zip, lr scaling), the two SWEEPER_TARGETS allow
            jobs = grid_jobs(parsed, list(sweeper.get("zip") or []))
            jobs = scale_lr(jobs, str(sweeper.get("lr_scaling") or "none"), sweeper.get("base_batch_size"),
                            master_config.get("lr"))
        for job in jobs:
            cfg = self.load_sweep_config(master_config, list(job))
            self._ready[(id(master_config), tuple(job))] = cfg
            check_sweep_metric(cfg, job)


def check_sweep_metric(cfg: Any, job: list[str]) -> None:
    """`sweep.metric` must be one that this job records: a sweep ranking by a metric no job records would run
    every trial for nothing, so it exits 2 here, before the sweep directory exists (other mistakes of a job
    are the job's own: it fails and the sweep records it)."""
    from llmexp.config.validation import metric_errors

    errors = metric_errors(cfg)
    if errors:
        raise UserError(f"the sweep's job {' '.join(job) or '(no overrides)'}: " + "; ".join(errors))

    def load_sweep_config(self, master_config: Any, sweep_overrides: list[str]) -> Any:
        from omegaconf import OmegaConf

        ready = self._ready.pop((id(master_config), tuple(sweep_overrides)), None)
        if ready is not None:
            return ready
        cfg = self.loader.load_sweep_config(master_config, sweep_overrides)
        overrides = [*OmegaConf.to_container(master_config.hydra.overrides.hydra), *sweep_overrides]  # type: ignore[misc]
        self.check(cfg, master_config.hydra.job.config_name, overrides)
        return cfg


def key_origin(loader: Any, config_name: str | None, overrides: list[str], key: str) -> str:
    """Where the value at `key` of a composed config came from: "command line" when an override sets the key
    or a node above it, else the last config file (in Hydra's defaults order) that sets it."""
    from hydra.types import RunMode

    try:
        parsed, repo = loader._parse_overrides_and_create_caching_repo(config_name, list(overrides))  # Hydra 1.3
        for ov in reversed(parsed):
            name = ov.key_or_group
            if not ov.is_delete() and not repo.group_exists(name) and (key == name or key.startswith(f"{name}.")):
                return "command line"
        defaults = loader.compute_defaults_list(config_name, list(overrides), RunMode.RUN).defaults
        for default in reversed(defaults):
            found = _config_file_setting(repo, default, key)
            if found:
                return found
    except Exception:  # the origin is a courtesy; the refusal stands without it
        return "config"
    return "config"


def _config_file_setting(repo: Any, default: Any, key: str) -> str | None:
    """The file behind one defaults-list entry, if its content (placed at its package) sets `key`."""
    from omegaconf import OmegaConf

    if default.config_path is None:
        return None
    package = default.package or ""
    if package and key != package and not key.startswith(f"{package}."):
        return None
    relative = key[len(package) + 1:] if package and key != package else key if not package else ""
    result = repo.load_config(default.config_path)
    if result is None:
        return None
    node: Any = OmegaConf.to_container(result.config, resolve=False)
    for part in [p for p in relative.split(".") if p]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    where = str(result.path)
    if where.startswith("file://"):
        return str(Path(where[len("file://"):]) / f"{default.config_path}.yaml")
    return f"{where}/{default.config_path}"


try:  # Hydra 1.3's `pkg://` config source; Hydra is always installed, but keep this module importable without it
    from hydra._internal.core_plugins.importlib_resources_config_source import (
        ImportlibResourcesConfigSource as _PackageSource,
    )
except ImportError:  # pragma: no cover
    _PackageSource = object  # type: ignore[assignment,misc]


TRUSTED_PACKAGES: tuple[str, ...] = ("hydra", "hydra_plugins", "llmexp")
"""Packages a `pkg://` search path may name."""


class TrustedPackageSource(_PackageSource):  # type: ignore[misc,valid-type]
    """Hydra's `pkg://` config source for llmexp's and Hydra's own packages only.

    Reading `pkg://some.module` imports that module (its code runs) while Hydra composes, before any check
    of the composed config could run; so a search path (`hydra.searchpath`, from the command line or a
    primary config) may name only TRUSTED_PACKAGES. Installed by `guard_package_sources`."""

    def __init__(self, provider: str, path: str) -> None:
        package = path.split("://", 1)[-1].replace("/", ".").strip(".")
        if package.split(".")[0] not in TRUSTED_PACKAGES:
            raise UserError(f"hydra.searchpath: {path} would import the package {package!r} (its code runs); "
                            f"only {', '.join(TRUSTED_PACKAGES)} may be named, use a directory (file://DIR) instead")
        super().__init__(provider=provider, path=path)


# Hydra's registry refuses a second class for a scheme unless its __name__ matches the first one's (it then
# keeps the registered one): so a job process that restores this registry and scans plugins again keeps ours.
TrustedPackageSource.__name__ = _PackageSource.__name__


def guard_package_sources() -> None:
    """Route Hydra's `pkg://` scheme to TrustedPackageSource (after Hydra's plugin scan registered its own)."""
    from hydra._internal.sources_registry import SourcesRegistry  # Hydra 1.3

    SourcesRegistry.instance().types["pkg"] = TrustedPackageSource
