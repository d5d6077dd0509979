"""The anomaly policy (`train.on_anomaly`: stop, skip or rollback; docs/how-to/accumulation-and-clipping.md): what
to do with a step whose loss or grad norm is non-finite or a spike. It runs after backward and clipping, before the
optimizer step, so a bad batch never reaches the weights unless the policy lets it.
"""

from __future__ import annotations

import math

from llmexp.monitor.detectors import diagnose, is_spike
from llmexp.train.state import Run

BLOWUP_FACTOR = 3.0
"""A loss above this multiple of the lowest recent loss is a blow-up even before the spike
detector has enough history (an absurd lr wrecks the weights in one or two steps)."""


def judge_step(run: Run, loss: float, grad_norm: float) -> str:
    """ok (take the step), skipped, rollback or diverged, by `train.on_anomaly`. `stepped`: the engine steps first and
    has already applied or skipped the step (DeepSpeed computes the norm inside its step). A non-finite step was then
    skipped by the engine and is judged as usual; a finite spike cannot be undone and is left to the detectors."""
    train, state, settings, stepped = run.cfg.train, run.state, run.desc.monitor, run.engine.steps_first
    if run.desc.precision.name == "fp16" and math.isfinite(loss) and not math.isfinite(grad_norm):
        state.skipped_steps += stepped  # DeepSpeed's scaler skipped it (GradScaler's skips are counted where it steps)
        return "ok"  # an fp16 overflow: the loss scaler skips this step and lowers the scale itself
    finite, recent = math.isfinite(loss) and math.isfinite(grad_norm), state.recent_losses
    if finite and (stepped or not (is_spike(recent, loss, settings)
                                   or (bool(recent) and loss > BLOWUP_FACTOR * min(recent)))):
        state.recent_losses = [*state.recent_losses, loss][-settings.window:]
        state.consecutive_anomalies = 0
        return "ok"
    state.consecutive_anomalies += 1
    policy = train.on_anomaly
    if policy == "stop":
        verdict = "diverged"
    elif policy == "skip":
        state.skipped_steps += 1
        verdict = "diverged" if state.consecutive_anomalies > train.max_consecutive_anomalies else "skipped"
    else:
        verdict = "diverged" if state.rollbacks >= train.max_rollbacks else "rollback"
    run.log.log({"event": "anomaly", "step": state.step, "loss": loss, "grad_norm": grad_norm,
                 "policy": policy, "action": verdict})
    return verdict


def report_findings(run: Run) -> None:
    """Run the detectors over the history so far and log each finding once."""
    if not run.rt.is_main:
        return
    state, log = run.state, run.log
    for finding in diagnose(log.history, run.desc.monitor):
        key = f"{finding.kind}@{finding.step}@{finding.severity}"  # a warning that turns error is news
        if key not in state.seen_findings:
            state.seen_findings.append(key)
            log.log({"event": "finding", **finding.to_dict()})
