"""`python -m llmexp.estimate [overrides]`: the memory a run needs, before you start it."""

from __future__ import annotations

import sys
from typing import Any

from omegaconf import DictConfig

from llmexp.config.derived import auto_batch_candidates, parse_batch_size, world_size_from_env
from llmexp.errors import UserError
from llmexp.model.estimate import (
    MiB,
    estimate,
    format_estimate,
    hub_config,
    largest_fitting,
    memory_budget,
    meta_facts,
    resolved_precision,
)
from llmexp.rundir.redact import print_user_error


def compose(overrides: list[str]) -> DictConfig:
    """The config `python -m llmexp OVERRIDES` would train with (validated), without a run dir; a typo'd key or a
    value of the wrong type is refused as `python -m llmexp` refuses it (`check_args`), naming the fix."""
    from llmexp.cli.argv import check_args
    from llmexp.config.schema import compose_config
    from llmexp.config.validation import validate

    cfg = compose_config(check_args(overrides))
    validate(cfg)
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Print the estimate; `world_size=N` (default: WORLD_SIZE or 1) sets the number of processes."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__.split("\n\n")[0] + "\n\nusage: python -m llmexp.estimate [world_size=N] [overrides ...]")
        return 0
    world = world_size_from_env()
    for arg in [a for a in args if a.startswith("world_size=")]:
        value = arg.split("=", 1)[1]
        if not (value.isdigit() and int(value) >= 1):
            return print_user_error("llmexp.estimate", f"world_size: {value!r} is not a number of processes; "
                                    "give a whole number >= 1, e.g. world_size=8")
        world = int(value)
        args.remove(arg)
    try:
        cfg = compose(args)
    except Exception as err:  # a UserError, or Hydra's override and compose errors
        return print_user_error("llmexp.estimate", err)
    precision = resolved_precision(cfg.precision.name)
    try:
        facts = meta_facts(cfg, precision, world)
    except UserError as err:  # a model directory whose config.json transformers cannot read
        return print_user_error("llmexp.estimate", err)
    auto_line, micro = "", None
    if parse_batch_size(cfg.batch_size) is None:
        micro, auto_line = _auto_upper_bound(cfg, world, facts)
    source = f" ({cfg.model.name_or_path})" if cfg.model.name_or_path else ""  # (the fields' name stays tiny)
    label = (f"model={cfg.model.name}{source} peft={cfg.peft.name} precision={precision} "
             f"optimizer={cfg.optimizer.name} deepspeed={cfg.deepspeed.name} fsdp={cfg.fsdp.name}"
             f"{' cpu_offload' if cfg.fsdp.cpu_offload else ''} "
             f"world_size={world} batch_size={micro or cfg.batch_size} max_length={cfg.data.max_length}")
    print(format_estimate(estimate(cfg, micro_batch=micro, **facts), label=label) + auto_line + _stand_in(cfg, facts))
    return 0


def _stand_in(cfg: DictConfig, facts: dict[str, Any]) -> str:
    """The line that says a hub model out of reach was estimated from the `model.*` fields, or ""."""
    from llmexp.data.tokenizer import is_local_name

    m = cfg.model
    if not m.name_or_path or is_local_name(str(m.name_or_path)) or hub_config(str(m.name_or_path), m.revision,
                                                                               m.trust_remote_code):
        return ""
    return (f"\nnote: model.name_or_path={m.name_or_path}: its config.json is neither reachable on the hub nor in "
            f"the local HF cache, so this is the model.* fields' model (model={m.name}: "
            f"{facts['num_params'] / 1e6:,.1f}M parameters); if that is not its size, download its config.json "
            f"(huggingface-cli download {m.name_or_path} config.json) or set model.* to its sizes")


def _auto_upper_bound(cfg: DictConfig, world: int, facts: dict[str, Any]) -> tuple[int, str]:
    """What batch_size=auto would start its probe at on this machine, and the line that says so."""
    import torch

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    budget = memory_budget(device_type, world)
    upper = largest_fitting(cfg, auto_batch_candidates(cfg, world, 0), budget, on_cpu=device_type == "cpu", **facts)
    return upper, (f"\nbatch_size=auto: up to {upper} per device by this estimate ({budget / MiB:,.0f} MiB to plan "
                   f"with on this {device_type}); the run's probe step confirms it")
