"""Health detectors: pure functions of the metric history, with the seed's advice attached.

`diagnose(records, settings)` reads the records of `metrics.jsonl` (see the run-directory
contract) and returns every finding over the whole history. The trainer calls it live and
`python -m llmexp.doctor` calls it after the fact, so both see the same verdicts.
`is_spike` is the O(window) test the trainer runs before each optimizer step.

Severities are calibrated so that a healthy run yields nothing of `error` severity:
error = the run is broken (non-finite values, divergence, clear overfitting); warning = it
works but something should change; info = worth knowing. No torch and no numpy here.
The detectors themselves live in `llmexp.detectors`; this module is their public face.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from llmexp.detectors import ERROR, INFO, WARNING, Finding, is_spike, run_detectors

__all__ = ["DETECTOR_KINDS", "ERROR", "INFO", "WARNING", "Finding", "MonitorSettings", "diagnose", "is_spike",
           "settings_from_config", "worst_severity"]

_SEVERITY_RANK = {INFO: 0, WARNING: 1, ERROR: 2}
DETECTOR_KINDS = frozenset({
    "non_finite", "fp16_overflow", "loss_spike", "grad_norm_spike", "divergence", "oscillation", "plateau",
    "eval_plateau", "overfitting", "grad_norm_high", "grad_norm_low", "ppl_range", "fp16_skipped_steps"})
"""Every kind `diagnose` can report; the trainer's own findings (e.g. about rollbacks) use other kinds."""


@dataclass
class MonitorSettings:
    """Detector thresholds and the run facts that change the advice. Built by the trainer."""

    run_kind: str = "pretrain"
    """pretrain or finetune (model.name_or_path set): perplexity ranges differ."""
    max_grad_norm: float = 1.0
    """The clipping threshold; 0 means clipping is off (and the advice says to turn it on)."""
    precision: str = "bf16"
    """bf16, fp16, fp32: under fp16 the NaN advice is to switch to bf16."""
    lr: float = 3e-4
    """Peak learning rate, quoted in the advice."""
    window: int = 20
    """Trailing values the spike score and the oscillation test look at."""
    min_history: int = 5
    """Values needed before a spike can be called."""
    spike_z: float = 6.0
    """Robust z-score (median/MAD) above which a value is a spike."""
    spike_min_rel: float = 0.25
    """A spike must also exceed the trailing median by this fraction of it (ignores tiny noisy series)."""
    grad_spike_min_rel: float = 2.0
    """Grad-norm spikes must exceed the trailing median by this fraction of it (3x): grad norms are heavy-tailed."""
    diverge_min_nats: float = 0.5
    """Divergence: the recent loss sits this far (nats) above the lowest loss so far ..."""
    diverge_rel: float = 0.5
    """... and at least this fraction of the drop achieved earlier has been given back."""
    oscillation_rel_std: float = 0.1
    """Oscillation: detrended loss std above this fraction of the loss level ..."""
    oscillation_trend_ratio: float = 1.0
    """... while the trend drop over the window is below this multiple of that std."""
    plateau_min_records: int = 20
    """Train records needed before 'the loss never fell' can be said."""
    plateau_min_drop: float = 0.05
    """The loss 'never fell' when its drop (first vs last quarter) is below this fraction and within
    three standard errors of the noise."""
    plateau_evals: int = 3
    """Evals in a row without a new best that make an eval plateau."""
    min_delta: float = 0.005
    """Relative improvement of the eval loss that counts as improvement."""
    overfit_min_evals: int = 2
    """Evals after the best one, all above it, before overfitting is called."""
    overfit_warn_rise: float = 0.02
    """Relative rise of the eval loss above its best: warning."""
    overfit_error_rise: float = 0.10
    """Relative rise of the eval loss above its best: error."""
    grad_band: tuple[float, float] = (0.5, 2.0)
    """The seed's healthy grad-norm band."""
    grad_band_fraction: float = 0.8
    """Share of the second half of the run outside the band that makes it 'persistent'."""
    pretrain_ppl: tuple[float, float] = (10.0, 30.0)
    """The seed's typical pretraining perplexity range."""
    finetune_ppl_max: float = 30.0
    """Fine-tuning: lower is better; above this a pretrained model is doing badly."""
    ppl_far_factor: float = 10.0
    """How many times outside a range counts as 'far'."""
    fp16_skip_fraction: float = 0.05
    """fp16: share of steps skipped by the loss scaler above which to warn."""


def diagnose(records: list[dict], settings: MonitorSettings) -> list[Finding]:
    """Every finding over a whole metric history, ordered by step, the most severe first."""
    return sorted(run_detectors(records, settings), key=lambda f: (f.step, -_SEVERITY_RANK[f.severity], f.kind))


def worst_severity(findings: Iterable[Finding | dict]) -> str | None:
    """The most severe severity among findings (objects or dicts), None when there are none."""
    ranks = [_SEVERITY_RANK.get(f["severity"] if isinstance(f, dict) else f.severity, 0) for f in findings]
    return None if not ranks else {v: k for k, v in _SEVERITY_RANK.items()}[max(ranks)]


def settings_from_config(cfg: dict[str, Any], lr: float | None = None) -> MonitorSettings:
    """MonitorSettings from a resolved config (as plain data); `lr` overrides an `auto` lr."""
    model, train, precision = cfg.get("model") or {}, cfg.get("train") or {}, cfg.get("precision") or {}
    try:
        cfg_lr = float(cfg.get("lr"))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        cfg_lr = None  # "auto": the trainer resolved it; summary.json has the value
    return MonitorSettings(
        run_kind="finetune" if model.get("name_or_path") else "pretrain",
        max_grad_norm=float(train.get("max_grad_norm", 1.0)),
        precision=str(precision.get("name", "bf16")),
        lr=lr if lr is not None else (cfg_lr if cfg_lr is not None else MonitorSettings.lr),
    )
