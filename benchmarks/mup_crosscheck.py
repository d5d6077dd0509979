"""llmexp's muP against the reference implementation: the `mup` package (microsoft/mup) on the same models.

    pip install mup --no-deps        # the package alone: its own deps (torchvision, seaborn, pandas) are not needed
    python benchmarks/mup_crosscheck.py                  # widths 64 (base) .. 1024, AdamW and SGD
    python benchmarks/mup_crosscheck.py --out ''

llmexp writes muP's rules out itself (`llmexp/model/mup.py` says why). This script builds llmexp's muP model
(`model.parametrization=mup`, the transfer benchmark's base: width 64, head size 64) at each width, hands the same
model to `mup.set_base_shapes` against the base-width model, and compares, parameter by parameter:
- the lr factor: llmexp's param group `lr_mult` against the lr `mup.MuAdamW` / `mup.MuSGD` give that parameter
  (over their base lr), and the weight decay likewise (mup is given llmexp's convention of what decays);
- the init: each parameter's std over its std at the base width, against muP's rule for its `infshape`
  (matrix-like: 1/sqrt(width_mult); vector-like and the readout, whose logits llmexp divides by width_mult
  as `MuReadout` does: unchanged);
- the readout's output multiplier (Granite's `logits_scaling` against `MuReadout`'s width_mult) and the attention
  multiplier (the head size is fixed, so the base's).
Any difference is listed; the table counts the parameters that agree.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, markdown_table, publish, utc_now
from transfer import BASE_WIDTH, MODEL

from llmexp.config.schema import compose_config

BASE = [*MODEL, "model.parametrization=mup", "train.weight_decay=0.1"]
OPTIMIZERS = {"adamw": "MuAdamW", "sgd": "MuSGD"}


def built(width_mult: int, optimizer: str) -> tuple[Any, list[dict[str, Any]]]:
    """llmexp's muP model at `width_mult` times the base width, seeded, and its optimizer groups."""
    import torch

    from llmexp.model.build import build_model, optimizer_groups

    cfg = compose_config([*BASE, f"model.width_mult={width_mult}", f"optimizer={optimizer}"])
    torch.manual_seed(0)
    model = build_model(cfg, vocab_size=8192)
    return model, optimizer_groups(cfg, model)


def compare(width_mult: int, optimizer: str) -> tuple[int, int, list[str]]:
    """(parameters, agreeing, differences) at one width for one optimizer."""
    import mup

    base, _ = built(1, optimizer)
    model, groups = built(width_mult, optimizer)
    # llmexp's readout is a plain Linear whose logits Granite's `logits_scaling` divides by width_mult: MuReadout's
    # own output scaling, which mup's assertion (is the readout a MuReadout?) cannot see
    mup.set_base_shapes(model, base, rescale_params=False, do_assert=False)
    ours = {id(p): (g.get("lr_mult", 1.0), g["weight_decay"]) for g in groups for p in g["params"]}
    lr, wd = 1.0, 0.1
    # mup gets llmexp's convention on what decays (optimizer.decay_norms_and_biases=false: not the norms nor the
    # embeddings) as its groups; the muP rules then scale what decays
    params = [p for g in groups for p in g["params"]]
    split = [{"params": [p for p in params if ours[id(p)][1] > 0], "weight_decay": wd},
             {"params": [p for p in params if ours[id(p)][1] == 0], "weight_decay": 0.0}]
    reference = getattr(mup, OPTIMIZERS[optimizer])(split, lr=lr)
    theirs = {id(p): (g["lr"] / lr, g["weight_decay"]) for g in reference.param_groups for p in g["params"]}
    base_std = {name: p.detach().float().std().item() for name, p in base.named_parameters()}
    diffs, agree, total = [], 0, 0
    readout = dict(model.named_parameters())["lm_head.weight"].infshape.width_mult()
    if not math.isclose(model.config.logits_scaling, readout):  # MuReadout divides its output by width_mult
        diffs.append(f"width x{width_mult}: logits divided by {model.config.logits_scaling:g} (MuReadout: {readout:g})")
    if model.config.attention_multiplier != base.config.attention_multiplier:  # head size fixed: 1/d_head fixed too
        diffs.append(f"width x{width_mult}: attention multiplier {model.config.attention_multiplier:g} "
                     f"(base {base.config.attention_multiplier:g})")
    for name, p in model.named_parameters():
        total += 1
        shape = p.infshape
        want_init = 1 / math.sqrt(shape.width_mult()) if shape.ninf() == 2 else 1.0
        got_init = p.detach().float().std().item() / base_std[name] if base_std[name] > 0 else 1.0
        problems = []
        if not math.isclose(ours[id(p)][0], theirs[id(p)][0], rel_tol=1e-9):
            problems.append(f"lr x{ours[id(p)][0]:g} (mup: x{theirs[id(p)][0]:g})")
        if not math.isclose(ours[id(p)][1], theirs[id(p)][1], rel_tol=1e-9, abs_tol=1e-12):
            problems.append(f"weight decay {ours[id(p)][1]:g} (mup: {theirs[id(p)][1]:g})")
        if base_std[name] > 0 and not math.isclose(got_init, want_init, rel_tol=0.05):  # sampled stds: 5%
            problems.append(f"init std x{got_init:.3f} (muP: x{want_init:.3f})")
        if problems:
            diffs.append(f"width x{width_mult}, {optimizer}, {name} ({shape.ninf()} infinite dims): "
                         + "; ".join(problems))
        else:
            agree += 1
    return total, agree, diffs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width-mults", default="2,4,8,16")
    parser.add_argument("--out", default="mup_crosscheck.md", help="file under benchmarks/results ('' for none)")
    args = parser.parse_args()
    try:
        import mup  # noqa: F401
    except ImportError:
        raise SystemExit("benchmarks/mup_crosscheck.py needs the mup package: pip install mup --no-deps") from None
    started, rows, all_diffs = utc_now(), [], []
    for optimizer in OPTIMIZERS:
        for width_mult in map(int, args.width_mults.split(",")):
            total, agree, diffs = compare(width_mult, optimizer)
            rows.append([optimizer, f"{BASE_WIDTH * width_mult} (x{width_mult})", str(total), str(agree)])
            all_diffs += diffs
    text = "\n".join([
        "# llmexp's muP against the mup package", "",
        f"Measured {started} on {machine()}; mup 1.0.0 (`set_base_shapes` against the width-64 model, "
        "`MuAdamW` / `MuSGD`), llmexp's muP model of benchmarks/transfer.py (2 layers, head size 64). Each "
        "parameter's lr factor, weight decay and init scale are compared, and the readout's and attention's "
        "multipliers.", "",
        markdown_table(["optimizer", "width", "parameters", "agree (lr, weight decay, init)"], rows), "",
        *(["Differences:", *[f"- {d}" for d in all_diffs]] if all_diffs else ["No differences."])])
    publish(text, args.out)
    if all_diffs:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
