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

__all__ = ["DETECTOR_KINDS", "ERROR", "INFO", "WARNING", "Finding", "MonitorSettings", "diagnose", "is_open",
           "is_spike", "reconcile", "settings_from_config", "worst_severity"]

_SEVERITY_RANK = {INFO: 0, WARNING: 1, ERROR: 2}
DETECTOR_KINDS = frozenset({
    "non_finite", "fp16_overflow", "loss_spike", "grad_norm_spike", "divergence", "oscillation", "plateau",
    "eval_plateau", "overfitting", "grad_norm_high", "grad_norm_low", "ppl_range", "fp16_skipped_steps",
    "bf16_emulated", "mfu_unavailable", "mfu_implausible"})
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


def _key(f: Finding | dict) -> tuple[str, int, str]:
    """A finding's identity, as the trainer keys the findings it prints (kind, step, severity)."""
    if isinstance(f, Finding):
        return f.kind, f.step, f.severity
    return str(f.get("kind")), int(f.get("step", 0)), str(f.get("severity"))


def _logged(records: list[dict]) -> list[tuple[int, dict]]:
    """The findings the run printed (`finding` records), first occurrence of each, with their record index."""
    seen: set[tuple[str, int, str]] = set()
    out = []
    for i, rec in enumerate(records):
        if rec.get("event") == "finding" and _key(rec) not in seen:
            seen.add(_key(rec))
            out.append((i, rec))
    return out


def _stopped_at(records: list[dict], start: int, key: tuple[str, int, str], settings: MonitorSettings,
                memo: dict[int, set[tuple[str, int, str]]]) -> int:
    """The step of the first eval after record `start` whose diagnosis (what the trainer ran live) no
    longer held the finding `key`; the last step when only the final diagnosis dropped it.
    `memo` keeps each eval's diagnosis for the other findings."""
    for i in range(start + 1, len(records)):
        if records[i].get("event") != "eval":
            continue
        if i not in memo:
            memo[i] = {_key(f) for f in diagnose(records[:i + 1], settings)}
        if key not in memo[i]:
            return int(records[i]["step"])
    return max((int(r.get("step", 0)) for r in records), default=0)


def reconcile(records: list[dict], settings: MonitorSettings) -> list[dict]:
    """The run's findings as summary.json, report.md and the doctor show them: one truth with the console.

    Every finding of the final diagnosis (`status: open`), and every finding the run printed that the
    final diagnosis no longer holds: `resolved` (e.g. the perplexity came down) or `superseded` (the
    same kind at the same step changed severity), with `resolved_at`, the step where it stopped holding.
    """
    final = diagnose(records, settings)
    keys = {_key(f) for f in final}
    out = [{**f.to_dict(), "status": "open", "resolved_at": None} for f in final]
    memo: dict[int, set[tuple[str, int, str]]] = {}
    for index, rec in _logged(records):
        key = _key(rec)
        if key in keys:
            continue
        kind, step, _ = key
        superseded = any(f.kind == kind and f.step == step for f in final)
        out.append({"kind": kind, "step": step, "severity": key[2], "message": str(rec.get("message", "")),
                    "advice": str(rec.get("advice", "")), "status": "superseded" if superseded else "resolved",
                    "resolved_at": _stopped_at(records, index, key, settings, memo)})
    return sorted(out, key=lambda f: (f["step"], -_SEVERITY_RANK.get(f["severity"], 0), f["kind"]))


def is_open(f: Finding | dict) -> bool:
    """Whether a finding still holds at the end of the run (objects and older summaries: always)."""
    return isinstance(f, Finding) or f.get("status", "open") == "open"


def worst_severity(findings: Iterable[Finding | dict]) -> str | None:
    """The most severe severity among the open findings (objects or dicts), None when there are none."""
    ranks = [_SEVERITY_RANK.get(f["severity"] if isinstance(f, dict) else f.severity, 0) for f in findings
             if is_open(f)]
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
