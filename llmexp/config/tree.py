"""Where llmexp's Hydra config tree lives, the resolvers its YAML files use, and the tree composed in-process."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

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

    if not OmegaConf.has_resolver("llmexp_run_id"):
        OmegaConf.register_new_resolver("llmexp_run_id", run_id, use_cache=True)
    if not OmegaConf.has_resolver("llmexp_safe"):
        OmegaConf.register_new_resolver("llmexp_safe", safe_name)


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


def compose_config(overrides: list[str], run_dir: Path | None = None) -> Any:
    """The config `python -m llmexp OVERRIDES` would get, composed in this process (not validated: see
    `validation.validate`). With `run_dir`, as `hydra.run.dir=RUN_DIR`, with Hydra's config set and the directory
    made, as `@hydra.main` does before its task runs: `llmexp.train.train.train(cfg)` then runs in-process (tests,
    benchmarks, a notebook)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from llmexp.config.schema import register_configs

    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        if run_dir is None:
            return compose("config", overrides=list(overrides))
        cfg = compose("config", overrides=[*overrides, f"hydra.run.dir={run_dir}"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return cfg
