"""`python -m llmexp.coord_check [--widths 1,2,4,8] [--steps 5] [--out DIR] [overrides]`: muP's coordinate
check (`llmexp.train.coord_check`). The config composes as `python -m llmexp OVERRIDES` would, on top of a small
model (`SMALL_MODEL`: seconds on a CPU; your overrides win); each width is that model at `model.width_mult=W`. It
checks the parametrization the overrides name (`model.parametrization=mup`), else both, writes coord_check.json
and coord_check.png to DIR and prints each layer group's growth from the narrowest width to the widest: about 1
under mup, growing with the width under standard."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from llmexp.config.derived import WIDTH_KEYS
from llmexp.errors import UserError
from llmexp.machine.paths import dir_out_problem
from llmexp.rundir.redact import print_user_error

SMALL_MODEL = ("model.hidden_size=64", "model.num_attention_heads=2", "model.num_key_value_heads=2",
               "model.intermediate_size=172", "model.num_hidden_layers=2", "model.vocab_size=1024",
               "model.mup_base_width=64", "model.max_position_embeddings=64", "data.max_length=64", "batch_size=8")
"""The check's base model (width_mult 1), 64 wide with heads of 32; at width 8 it is 512 wide (~7M parameters)."""
CHECK_LR = 1e-2
"""The lr when the config's is not a number (lr=auto, lr=find): a few Adam steps at it move the coordinates
visibly, so a parametrization that lets them grow with the width shows it (the mup package's examples use ~1e-2)."""
PARAMETRIZATIONS = ("standard", "mup")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m llmexp.coord_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="1,2,4,8", help="width multipliers, comma-separated (default 1,2,4,8)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per width (default 5)")
    parser.add_argument("--out", default="outputs/coord_check", help="output directory")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m llmexp")
    return parser


def _widths(text: str, model: Any) -> tuple[float, ...]:
    try:
        widths = tuple(sorted({float(w) for w in text.split(",") if w.strip()}))
    except ValueError:
        widths = ()
    if len(widths) < 2 or widths[0] <= 0:
        raise UserError(f"--widths {text}: give two or more positive width multipliers, e.g. --widths 1,2,4,8")
    for width in widths:  # here, or `validate` would name model.width_mult, which the user never wrote
        if broken := [f"{k}={model[k]} x {width:g} = {model[k] * width:g}" for k in WIDTH_KEYS
                      if isinstance(model[k], int) and not float(model[k] * width).is_integer()]:
            raise UserError(f"--widths {text}: {width:g} gives sizes that are not whole numbers "
                            f"({'; '.join(broken)}); whole multipliers always do, e.g. --widths 1,2,4,8")
    return widths


def _settings(cfg: Any, args: argparse.Namespace) -> Any:
    from llmexp.config.validation import is_lr_find, parse_lr
    from llmexp.train.coord_check import CheckSettings

    if args.steps < 1:
        raise UserError(f"--steps {args.steps}: must be >= 1, e.g. --steps 5")
    lr = CHECK_LR if is_lr_find(cfg.lr) else parse_lr(cfg.lr) or CHECK_LR  # (the check has no range test of its own)
    batch = cfg.batch_size if isinstance(cfg.batch_size, int) else 8
    return CheckSettings(widths=_widths(args.widths, cfg.model), steps=args.steps, lr=float(lr), batch=batch,
                         seq_len=int(cfg.data.max_length), seed=int(cfg.seed))


def _table(result: dict[str, Any]) -> str:
    groups = result["groups"]
    lines = [f"{'':<10}" + "".join(f"{g:>11}" for g in groups) + "   (coordinate size, widest / narrowest width, "
             "last step)"]
    for name, run in result["runs"].items():
        lines.append(f"{name:<10}" + "".join(f"{run['growth'][g]:>11.2f}" for g in groups))
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    args = _parser().parse_intermixed_args(argv)  # --help before torch is imported; flags among overrides
    if problem := dir_out_problem("--out", args.out):  # a writable directory, before the check's minutes are spent
        raise UserError(problem)
    out = Path(args.out)
    import torch
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from llmexp.cli.estimate import compose
    from llmexp.config.validation import validate
    from llmexp.report.plots import plot_coord_check
    from llmexp.rundir.files import write_json_atomic
    from llmexp.train.coord_check import at_width, coord_check

    named = [str(ov.value()) for ov in OverridesParser.create().parse_overrides(args.overrides)
             if ov.key_or_group == "model.parametrization"]  # (`++model...`, a quoted value: as Hydra reads them)
    parametrizations = tuple(named[-1:]) or PARAMETRIZATIONS
    cfg = compose([*SMALL_MODEL, *args.overrides])
    if cfg.model.width_mult != 1:  # `at_width` sets it for each width
        raise UserError(f"model.width_mult={cfg.model.width_mult}: the check sets the width itself; give the widths "
                        "with --widths, e.g. --widths 1,2,4,8")
    settings = _settings(cfg, args)
    for name in parametrizations:  # every config the check builds passes `validate` (whole sizes, mup's refusals)
        for width in settings.widths:
            validate(at_width(cfg, width, name))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hidden = [round(cfg.model.hidden_size * w) for w in settings.widths]
    print(f"coord check: {', '.join(parametrizations)} at hidden sizes {hidden}, {settings.steps} steps of "
          f"{cfg.optimizer.name} at lr {settings.lr:g} on {device.type}", file=sys.stderr, flush=True)
    result = coord_check(cfg, settings, parametrizations, device)
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / "coord_check.json", result)
        plot_coord_check(result, out / "coord_check.png")
    except OSError as err:  # e.g. a read-only directory
        raise UserError(f"--out {args.out}: cannot write there ({err}); name a writable directory") from None
    print(_table(result))
    print(f"wrote {out / 'coord_check.json'}\nwrote {out / 'coord_check.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command: exit 0 done, 2 a user's mistake (a bad override, width or refused combination)."""
    try:
        return run(list(sys.argv[1:] if argv is None else argv))
    except Exception as err:  # a UserError, or Hydra's override and compose errors
        if not isinstance(err, UserError) and type(err).__module__.split(".")[0] not in ("hydra", "omegaconf"):
            raise
        return print_user_error("llmexp.coord_check", err)
