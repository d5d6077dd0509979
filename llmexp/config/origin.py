"""Where a value of a composed config came from: the command line, or the YAML file (or structured config)
that set it. A refusal names it (`security.check_config(cfg, origin=...)`), so that a user can find the
key among the files a composition read. Read through Hydra's public API: the config loader's defaults list,
and the sources the composed config lists (`hydra.runtime.config_sources`). No torch here."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import OmegaConf

from llmexp.rundir.readers import load_yaml, reader


def origin_of(loader: Any, cfg: Any, overrides: list[str]) -> Any:
    """`key -> origin` for a config composed by `loader` (a Hydra ConfigLoader) from `overrides`: "command line"
    when an override sets the key or a node above it, else the last config (in Hydra's defaults order) that sets
    it; "config" when that cannot be told."""
    def key_origin(key: str) -> str:
        try:
            groups = {str(choice).split("@")[0] for choice in cfg.hydra.runtime.choices}
            for ov in reversed(OverridesParser.create().parse_overrides(list(overrides))):
                name = ov.key_or_group
                if not ov.is_delete() and name not in groups and (key == name or key.startswith(f"{name}.")):
                    return "command line"
            defaults = loader.compute_defaults_list(cfg.hydra.job.config_name, list(overrides), RunMode.RUN).defaults
            sources = [(str(s.schema), str(s.path)) for s in cfg.hydra.runtime.config_sources]
            for default in reversed(defaults):
                if found := _setting_source(sources, default, key):
                    return found
        except Exception:  # the origin is a courtesy; the refusal stands without it
            pass
        return "config"

    return key_origin


def _setting_source(sources: list[tuple[str, str]], default: Any, key: str) -> str | None:
    """The config behind one defaults-list entry, if its content (placed at its package) sets `key`."""
    if default.config_path is None:
        return None
    package = default.package or ""
    if package and key != package and not key.startswith(f"{package}."):
        return None
    found = next((hit for schema, path in sources if (hit := _read(schema, path, default.config_path))), None)
    if found is None:  # Hydra takes a config from the first source in the search path that has it
        return None
    where, node = found
    for part in [p for p in key.removeprefix(package).split(".") if p]:  # the key below the package
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return where


@reader
def read_config_yaml(path: Path) -> Any:
    """A config YAML file as plain data (Hydra composed it already: read again to say where a value came from)."""
    return load_yaml(path, read_config_yaml)


def _read(schema: str, path: str, config_path: str) -> tuple[str, Any] | None:
    """(where, plain content) of `config_path` in one config source, or None when it does not hold it."""
    location = path.split("://", 1)[-1]
    if schema == "file":
        file = Path(location) / f"{config_path}.yaml"
        return (str(file), read_config_yaml(file)) if file.is_file() else None
    if schema == "pkg":  # (only trusted packages get here: `cli.hydra_internals.guard_package_sources`)
        module, _, below = location.partition("/")
        entry = resources.files(module).joinpath(*[p for p in below.split("/") if p], f"{config_path}.yaml")
        return (f"pkg://{location}/{config_path}", read_config_yaml(Path(str(entry)))) if entry.is_file() else None
    if schema == "structured":
        try:
            node = ConfigStore.instance().load(f"{config_path}.yaml").node
        except Exception:  # not in the ConfigStore
            return None
        return f"structured://{config_path}", OmegaConf.to_container(OmegaConf.create(node), resolve=False)
    return None
