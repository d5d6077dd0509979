"""`python -m llmexp.fit`: `llmexp.report.fit`'s command, handed the seed's lr-by-size table (`lr=auto`'s, in the
train layer, which the report layer may not import) to draw beside the fitted law."""

from __future__ import annotations

from llmexp.report.fit import main as fit_main
from llmexp.train.schedule import auto_lr


def main(argv: list[str] | None = None) -> int:
    return fit_main(argv, seed_lr=lambda num_params: auto_lr(int(num_params), finetune=False))
