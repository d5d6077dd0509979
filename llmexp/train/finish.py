"""The end of a run: the final checkpoint, `model/` (save_pretrained, published atomically),
summary.json with every finding, and the report. A full disk on the way ends the run as `failed`
with summary.json still written if there is room for it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmexp.checkpoint import store as ckpt
from llmexp.errors import STATUS_EXIT
from llmexp.monitor.detectors import reconcile
from llmexp.monitor.logger import MetricsLogger
from llmexp.monitor.throughput import peak_memory_mb
from llmexp.report.run import write_run_report
from llmexp.rundir.files import write_json_atomic
from llmexp.rundir.read import last_value
from llmexp.rundir.redact import scrub
from llmexp.rundir.tasks import final_tasks
from llmexp.train.resume import save_state_checkpoint
from llmexp.train.state import Run

if TYPE_CHECKING:
    import torch

    from llmexp.train.runtime import Runtime


def save_final_model(rt: Runtime, model: torch.nn.Module, tokenizer: Any,
                     weights: dict[str, torch.Tensor] | None = None) -> None:
    """`model/`: save_pretrained of the model and tokenizer, published by one atomic swap."""
    final = rt.run_dir / "model"
    tmp = rt.run_dir / ".model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        lm = rt.engine.lm(model)
        if rt.cfg.peft.name != "none":  # adapter_config.json + adapter_model.safetensors (PeftModel.from_pretrained)
            lm.save_pretrained(tmp, safe_serialization=True)
            if rt.cfg.train.merge_adapter:
                save_merged(rt, lm, tmp, tokenizer)
        else:  # weights: the ZeRO-3 gathered ones, else None (the model's own)
            lm.save_pretrained(tmp, safe_serialization=True, state_dict=weights)
        tokenizer.save_pretrained(tmp)
        ckpt.publish_dir(tmp, final)  # fsyncs, then swaps atomically: model/ is never missing or half-written
    except Exception as err:
        full = ckpt.disk_full_error(err, final)
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from None
        raise


def save_merged(rt: Runtime, lm: Any, model_dir: Path, tokenizer: Any) -> None:
    """`model/merged/`: the base with the adapters added into its weights, a plain transformers model
    (in its own directory: next to adapter_config.json, transformers would load the adapter instead).

    A 4-bit base is not merged into: its weights would be rounded to 4 bits again. The base is loaded
    again in fp32 from `model.name_or_path` and the saved adapter merged into that (the usual QLoRA
    recipe). A 16/32-bit base is merged in place: the run is over, and this needs no second copy."""
    import torch

    if rt.cfg.peft.load_in_4bit:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        m = rt.cfg.model
        base = AutoModelForCausalLM.from_pretrained(m.name_or_path, revision=m.revision, dtype=torch.float32,
                                                    trust_remote_code=m.trust_remote_code)
        merged = PeftModel.from_pretrained(base, model_dir).merge_and_unload()
    else:
        merged = lm.merge_and_unload()
    merged.save_pretrained(model_dir / "merged", safe_serialization=True)
    tokenizer.save_pretrained(model_dir / "merged")


def finish_run(run: Run, tokenizer: Any, status: str) -> dict[str, Any]:
    """Final checkpoint and model, summary.json, report; returns the summary.

    A full disk on the way turns the status into `failed` (exit 1); summary.json is still
    written if there is room for it."""
    rt, log = run.rt, run.log
    if status in ("completed", "early_stopped"):
        status = _save_final(run, tokenizer, status)
    summary = build_summary(run, status)
    if rt.is_main:
        try:
            write_json_atomic(rt.run_dir / "summary.json", scrub(summary))
        except OSError as err:
            log.write(f"error: could not write {rt.run_dir / 'summary.json'}: {err}")
        _write_report(rt.run_dir, log)
        log.write(f"\n{status}: {rt.run_dir}\n" + ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in summary.items() if k in ("step", "train_loss", "eval_loss", "eval_ppl", "tokens_per_sec")))
    log.close()
    rt.accelerator.wait_for_everyone()
    return summary


def _save_final(run: Run, tokenizer: Any, status: str) -> str:
    """The final checkpoint and `model/`; returns the status, `failed` if the disk was full."""
    if not save_state_checkpoint(run):
        return "failed"
    rt = run.rt
    weights = rt.engine.final_weights(run.model)  # ZeRO-3 and FSDP: collective, so every rank gathers; else None
    full: ckpt.DiskFull | None = None
    if rt.is_main:
        try:
            save_final_model(rt, run.model, tokenizer, weights)
        except ckpt.DiskFull as err:
            full = err
            run.log.write(f"error: {err}; model/ was not written (status failed). The final checkpoint "
                          f"step_{run.state.step} is complete: free some space and run the same command to export it.")
    return "failed" if rt.any_rank(full is not None) else status


def build_summary(run: Run, status: str) -> dict[str, Any]:
    """summary.json: the final status and metrics, and every finding with its advice."""
    from hydra.core.hydra_config import HydraConfig

    rt, state, history = run.rt, run.state, run.log.history
    findings = reconcile(history, rt.monitor_settings) if rt.is_main else []  # also what the console printed
    tokens_per_sec = rt.window.total_tokens / rt.window.total_seconds if rt.window.total_seconds else 0.0
    peak_mb = rt.reduce_max(peak_memory_mb(rt.device))  # the busiest rank's peak
    return {
        "status": status, "exit_code": STATUS_EXIT[status], "step": state.step,
        "train_loss": last_value(history, "train", "loss"), "eval_loss": last_value(history, "eval", "eval_loss"),
        "eval_ppl": last_value(history, "eval", "eval_ppl"), "best_eval_loss": state.best_eval_loss,
        "best_eval_step": state.best_eval_step, "tokens_per_sec": tokens_per_sec, "mfu": rt.mfu(tokens_per_sec),
        "lr": run.peak_lr, "lr_source": run.lr_source, "num_params": rt.num_params,
        "total_params": rt.total_params, "precision": rt.precision,
        "global_batch_size": rt.plan.global_batch, "gradient_accumulation_steps": rt.plan.accum,
        "world_size": rt.plan.world, "resumed_from_world_size": run.resumed_from_world_size,
        "fsdp": rt.cfg.fsdp.name, "peak_mem_mb": peak_mb, "skipped_steps": state.skipped_steps,
        "rollbacks": state.rollbacks, "compile_time_s": rt.compile_time_s, "time_s": rt.elapsed(),
        "overrides": list(HydraConfig.get().overrides.task), "findings": findings,
        "tasks": final_tasks(history),  # each task's metrics at its last eval (eval=loss: none)
    }


def _write_report(run_dir: Path, log: MetricsLogger) -> None:
    """report.md and curves.png; a failure here must not fail a finished run."""
    try:
        write_run_report(run_dir)
    except Exception as err:  # a plotting problem is worth a warning, not a lost run
        log.write(f"warning: could not write the report: {err!r}")
