"""The end of a run: the final checkpoint, `model/` (save_pretrained, published atomically),
summary.json with every finding, and the report. A full disk on the way ends the run as `failed`
with summary.json still written if there is room for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from llmexp.errors import EXIT_USER, STATUS_EXIT
from llmexp.model.save import save_model_dir
from llmexp.monitor.detectors import reconcile
from llmexp.monitor.throughput import peak_memory_mb
from llmexp.report.run import write_run_report
from llmexp.rundir.files import DiskFull, staged_dir, write_json_atomic
from llmexp.rundir.read import last_value
from llmexp.rundir.redact import scrub
from llmexp.rundir.task_metrics import final_tasks
from llmexp.train.resume import save_state_checkpoint
from llmexp.train.state import Run


def save_merged(cfg: DictConfig, lm: Any, model_dir: Path, tokenizer: Any) -> None:
    """`model/merged/`: the base with the adapters added into its weights, a plain transformers model (in its own
    directory: next to adapter_config.json, transformers would load the adapter instead). A 4-bit base would be
    rounded to 4 bits again, so the base is loaded again in fp32 and the saved adapter merged into that (the usual
    QLoRA recipe); a 16/32-bit base is merged in place: the run is over, and this needs no second copy."""
    if cfg.peft.load_in_4bit:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        m = cfg.model
        base = AutoModelForCausalLM.from_pretrained(m.name_or_path, revision=m.revision, dtype=torch.float32,
                                                    trust_remote_code=m.trust_remote_code)
        merged = PeftModel.from_pretrained(base, model_dir).merge_and_unload()
    else:
        merged = lm.merge_and_unload()
    save_model_dir(merged, model_dir / "merged")
    tokenizer.save_pretrained(model_dir / "merged")


def finish_run(run: Run, status: str, user_error: str | None = None) -> dict[str, Any]:
    """Final checkpoint and model, summary.json, report; returns the summary. `user_error`: the mistake that
    stopped the run mid-way (`failed`, exit 2), kept in summary.json as its `error`."""
    rt, log = run.rt, run.log
    if status in ("completed", "early_stopped") and run.cfg.train.save_final:
        status = _save_final(run, status)
    summary = build_summary(run, status)
    if user_error is not None:
        summary.update(exit_code=EXIT_USER, error=user_error)
    if rt.is_main:
        try:
            write_json_atomic(rt.run_dir / "summary.json", scrub(summary))
        except OSError as err:
            log.write(f"error: could not write {rt.run_dir / 'summary.json'}: {err}")
        try:
            write_run_report(rt.run_dir)  # report.md and curves.png
        except Exception as err:  # a plotting problem is worth a warning, not a lost run
            log.write(f"warning: could not write the report: {err!r}")
        log.write(f"\n{status}: {rt.run_dir}\n" + _final_line(run, summary))
    log.close()
    rt.accelerator.wait_for_everyone()
    return summary


def _final_line(run: Run, summary: dict[str, Any]) -> str:
    """The run's figures; a resume that found the run at its last step trained nothing, and says so instead of
    a throughput of 0."""
    resumes = [r for r in run.log.history if r.get("event") == "resume"]
    idle = summary["status"] == "completed" and bool(resumes) and int(resumes[-1]["step"]) == run.state.step
    shown = ("step", "train_loss", "eval_loss", "eval_ppl", *(() if idle else ("tokens_per_sec",)))
    figures = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in summary.items() if k in shown and v is not None)  # (diverged: no loss)
    key = "train.max_steps" if run.cfg.train.max_steps != -1 else "train.num_train_epochs"
    return figures + (f"\nnothing to train: the run was already at its last step ({run.state.step}); "
                      f"raise {key} to train on" if idle else "")


def _save_final(run: Run, status: str) -> str:
    """The final checkpoint and `model/`: save_pretrained of the model (with adapters: for PeftModel.from_pretrained)
    and tokenizer, published by one atomic swap. Returns the status, `failed` if the disk was full."""
    if not save_state_checkpoint(run):
        return "failed"
    rt, cfg = run.rt, run.cfg
    weights = run.engine.final_weights(run.model)  # ZeRO-3 and FSDP: collective, so every rank gathers; else None
    full: DiskFull | None = None
    if rt.is_main:
        try:
            with staged_dir(rt.run_dir / "model", staging=rt.run_dir / ".model.tmp") as tmp:  # never half-written
                # weights: the gathered ones, else None (the model's own). With adapters always None, as they run on
                # the plain engine only (validation): peft writes adapter_config.json + adapter_model.safetensors
                lm = run.engine.lm(run.model)
                save_model_dir(lm, tmp, state_dict=weights)
                if cfg.peft.name != "none" and cfg.train.merge_adapter:
                    save_merged(cfg, lm, tmp, run.tokenizer)
                run.tokenizer.save_pretrained(tmp)
        except DiskFull as err:
            full = err
            run.log.write(f"error: {err}; model/ was not written (status failed). The final checkpoint "
                          f"step_{run.state.step} is complete: free some space and run the same command to export it.")
    return "failed" if rt.any_rank(full is not None) else status


def build_summary(run: Run, status: str) -> dict[str, Any]:
    """summary.json: the final status and metrics, and every finding with its advice."""
    rt, desc, state, history = run.rt, run.desc, run.state, run.log.history
    findings = reconcile(history, desc.monitor) if rt.is_main else []  # also what the console printed
    tokens_per_sec = run.window.overall()
    peak_mb = rt.reduce(peak_memory_mb(rt.device), "max")  # the busiest rank's peak
    return {
        "status": status, "exit_code": STATUS_EXIT[status], "step": state.step,
        "train_loss": last_value(history, "train", "loss"), "eval_loss": last_value(history, "eval", "eval_loss"),
        "eval_ppl": last_value(history, "eval", "eval_ppl"), "best_eval_loss": state.best_eval_loss,
        "best_eval_step": state.best_eval_step, "tokens_per_sec": tokens_per_sec, "mfu": run.mfu(tokens_per_sec),
        "lr": desc.lr, "lr_source": desc.lr_source, "num_params": desc.num_params,
        "total_params": desc.total_params, "precision": desc.precision.name,
        "global_batch_size": desc.plan.global_batch, "gradient_accumulation_steps": desc.plan.accum,
        "world_size": desc.plan.world, "resumed_from_world_size": run.resumed_from_world_size,
        "fsdp": run.cfg.fsdp.name, "peak_mem_mb": peak_mb, "skipped_steps": state.skipped_steps,
        "rollbacks": state.rollbacks, "compile_time_s": sum(run.window.compile_s.values()),
        "compile_time_by_graph_s": run.window.compile_s, "time_s": desc.elapsed(),
        "overrides": list(HydraConfig.get().overrides.task), "findings": findings,
        "tasks": final_tasks(history),  # each task's metrics at its last eval (eval=loss: none)
        **{k: v for r in history if r.get("event") == "start" for k, v in r.items() if k.startswith("data_")},
    }
