"""The only module of llmexp that imports Hydra's private API (`hydra._internal`), for three things Hydra 1.3's
public API lacks (docs/explanation/security-model.md says how `tests/test_security.py` pins each name and the
source of `_run_hydra`, whose steps `compose_api_as_hydra_main` repeats). Why no public API will do:

* `args_parser`: Hydra has no public accessor for its parser, and llmexp must read argv before `@hydra.main`
  exactly as it will, each abbreviation argparse accepts (`--config-d`) included.
* `compose_api_as_hydra_main`: the public initializers take one directory or one module; `--config-dir` adds a
  second, ahead of the structured schemas, which may hold the primary config. `hydra.searchpath` cannot stand in
  for it: its entries are added only after the primary config has been looked up.
* `guard_package_sources`: reading `pkg://X` imports X (its code runs) while Hydra composes, before any check can
  run; Hydra's registry of config sources by scheme is private, and a plugin cannot replace the `pkg` source.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hydra._internal.core_plugins.importlib_resources_config_source import (
    ImportlibResourcesConfigSource as _PackageSource,  # Hydra 1.3's `pkg://` config source
)
from hydra._internal.hydra import Hydra
from hydra._internal.sources_registry import SourcesRegistry
from hydra._internal.utils import (
    create_automatic_config_search_path,
    detect_calling_file_or_module_from_task_function,
    detect_task_name,
)
from hydra._internal.utils import get_args_parser as args_parser  # noqa: F401 (the parser `@hydra.main` uses)
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import SearchPathException

from llmexp.errors import UserError


@contextmanager
def compose_api_as_hydra_main(task_function: Callable[..., Any], config_path: str,
                              config_dir: str | None) -> Iterator[None]:
    """Within the block `hydra.compose` composes from the search path `@hydra.main(config_path=...)` on
    `task_function` builds, with `--config-dir` added as `hydra._internal.utils._run_hydra` adds it."""
    calling_file, calling_module = detect_calling_file_or_module_from_task_function(task_function)
    search_path = create_automatic_config_search_path(calling_file, calling_module, config_path)
    if config_dir is not None:
        abs_config_dir = os.path.abspath(config_dir)
        if not os.path.isdir(abs_config_dir):
            raise SearchPathException(f"Additional config directory '{abs_config_dir}' not found")
        search_path.prepend(provider="command-line", path=f"file://{abs_config_dir}",
                            anchor=SearchPathQuery(provider="schema"))
    Hydra.create_main_hydra2(task_name=detect_task_name(calling_file, calling_module), config_search_path=search_path)
    try:
        yield
    finally:
        GlobalHydra.instance().clear()  # `@hydra.main` initializes its own


TRUSTED_PACKAGES: tuple[str, ...] = ("hydra", "hydra_plugins", "llmexp")
"""Packages a `pkg://` search path may name."""


class TrustedPackageSource(_PackageSource):
    """Hydra's `pkg://` config source for TRUSTED_PACKAGES only, wherever a search path names it (`hydra.searchpath`,
    from the command line or a primary config). Installed by `guard_package_sources`."""

    def __init__(self, provider: str, path: str) -> None:
        package = path.split("://", 1)[-1].replace("/", ".").strip(".")
        if package.split(".")[0] not in TRUSTED_PACKAGES:
            raise UserError(f"hydra.searchpath: {path} would import the package {package!r} (its code runs); "
                            f"only {', '.join(TRUSTED_PACKAGES)} may be named, use a directory (file://DIR) instead")
        super().__init__(provider=provider, path=path)


# Hydra's registry refuses a second class for a scheme unless its __name__ matches the first one's (it then
# keeps the registered one): so Hydra's plugin scan, in this process or a job's, keeps ours.
TrustedPackageSource.__name__ = _PackageSource.__name__


def guard_package_sources() -> None:
    """Route Hydra's `pkg://` scheme to TrustedPackageSource, before or after Hydra's plugin scan."""
    SourcesRegistry.instance().types["pkg"] = TrustedPackageSource
