"""Where llmexp's Hydra config tree lives, and the resolvers its YAML files use."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from llmexp.rundir.names import run_id, safe_name


def conf_dir() -> Path:
    """The Hydra config tree, `llmexp/conf/`: package data, so a checkout, an editable install and a
    wheel all hold it at the same place."""
    here = Path(__file__).resolve().parents[1] / "conf"
    if not (here / "config.yaml").is_file():
        raise FileNotFoundError(f"llmexp's config tree is missing ({here}/config.yaml); reinstall llmexp")
    return here


def register_resolvers() -> None:
    """Register `${llmexp_run_id:}` and `${llmexp_safe:...}` once."""
    from omegaconf import OmegaConf

    for name, resolver, use_cache in (("llmexp_run_id", run_id, True), ("llmexp_safe", safe_name, False)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver, use_cache=use_cache)


@cache
def option_names(group: str) -> tuple[str, ...]:
    """The names the options of a config group give themselves: the `name:` of each `llmexp/conf/<group>/*.yaml`
    (under `<group>:` in a `# @package _global_` file), its file name when it sets none."""
    import yaml

    names = []
    for path in sorted((conf_dir() / group).glob("*.yaml")):
        text = path.read_text()
        data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}  # (C: ~10x faster)
        node = (data.get(group) or {}) if text.startswith("# @package _global_") else data
        names.append(str(node.get("name", path.stem)) if isinstance(node, dict) else path.stem)
    return tuple(dict.fromkeys(names))
