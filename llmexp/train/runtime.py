"""A run's set-up, in order: the process (`Runtime`: Accelerate's devices, ranks and collectives, with the
precision resolved), then, once the data is known, `describe`: the batch plan (batch_size=auto settled by
`autobatch` before any engine exists), the step engine (`llmexp.train.engines`), the model and optimizer, the
lr, the matmul ceiling and the monitor settings, frozen into the `RunDescription` the loop reads.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from llmexp.config.derived import (
    BF16_EMULATION_ADVICE,
    BatchPlan,
    make_plan,
    parse_batch_size,
    precision_on,
    use_shared_compile_cache,
)
from llmexp.config.derived import world_size_from_env as world_size
from llmexp.model import build
from llmexp.monitor.console import quiet_console
from llmexp.monitor.detectors import MonitorSettings
from llmexp.monitor.logger import MetricsLogger
from llmexp.monitor.sinks import make_sinks
from llmexp.monitor.throughput import flops_per_token, load_ceilings, measure_ceiling, save_ceilings
from llmexp.train.state import RunDescription

if TYPE_CHECKING:
    from llmexp.model.cpu_matmul import MatmulPath
    from llmexp.train.engines.base import Engine


class Runtime:
    """One process of a run: Accelerate's devices, ranks and collectives, the precision resolved for this device
    and the context it opens around forward and backward. Built once; nothing writes it afterwards."""

    def __init__(self, cfg: DictConfig, run_dir: Path) -> None:
        from accelerate import Accelerator
        from transformers.utils import logging as hf_logging

        from llmexp.train.distributed import accelerator_kwargs

        hf_logging.disable_progress_bar()  # our own bar and lines are the console output
        quiet_console()  # third-party INFO lines go to llmexp.log only

        self.started = time.perf_counter()
        self.cfg = cfg
        self.run_dir = run_dir
        use_shared_compile_cache(cfg)  # (run_guarded sets it earlier; this is for callers of train(cfg))
        device_type = "cuda" if torch.cuda.is_available() else "cpu"  # Accelerate's choice (accelerator_kwargs)
        precision = precision_on(cfg.precision.name, device_type)
        if device_type == "cpu":  # bf16 without native support: measured, and emulated where that is faster
            from llmexp.model.bf16_emulation import settle_on_cpu

            precision = settle_on_cpu(precision)
        self.precision = precision
        """Resolved once, here: the loop, the engines and the DeepSpeed config all take this one."""
        self.world = world_size()
        # DeepSpeed's config fixes the batch plan inside Accelerate (batch_size=auto is refused there).
        deepspeed_plan = make_plan(cfg, self.world) if cfg.deepspeed.stage > 0 else None
        self.accelerator = Accelerator(**accelerator_kwargs(cfg, deepspeed_plan, self.precision.name))
        if cfg.deepspeed.stage > 0:  # before anything reads the process layout (see check_engine)
            from llmexp.train.distributed import check_engine

            check_engine(self.accelerator)
        if self.accelerator.num_processes != self.world:
            raise RuntimeError(f"Accelerate runs {self.accelerator.num_processes} processes, but WORLD_SIZE says "
                               f"{self.world}: start multi-process runs with torchrun or accelerate launch")
        self.device = self.accelerator.device
        self.rank, self.is_main = self.accelerator.process_index, self.accelerator.is_main_process

    def measure_peak(self) -> tuple[float | None, str | None]:
        """(a matmul ceiling in the training dtype, None), cached per device so later runs start fast; or
        (None, why) when it was measured on shared cores: a guessed ceiling would make every MFU a guess."""
        known = self._ceilings()
        if self.ceiling_key() in known:
            return float(known[self.ceiling_key()]), None
        value, cores_were_ours = measure_ceiling(self.device, self._ceiling_dtype())
        if not cores_were_ours:  # too low to use or keep: measured again next run
            return None, (f"the matmul ceiling ({value:.3g} TFLOPS) was measured while other processes "
                          "shared the CPU cores, so it is too low and any MFU divided by it too high")
        self._keep_ceiling(value)
        return value, None

    def remeasure_peak(self) -> float | None:
        """The ceiling measured now, when an MFU came out implausibly high (`monitor.throughput.Mfu`): the cached
        one was probably measured on busy cores (nothing told). A higher one replaces it in the cache; None when
        the cores are shared now too."""
        value, cores_were_ours = measure_ceiling(self.device, self._ceiling_dtype())
        if not cores_were_ours:
            return None
        self._keep_ceiling(value)
        return value

    @property
    def compiles(self) -> bool:
        """train.compile applies: torch.compile traces nothing under emulated bf16's dispatch mode, so it is not
        applied there (the header says so), and no step or eval is then set aside as compile time."""
        return bool(self.cfg.train.compile) and not self.precision.emulate_bf16

    def _ceiling_dtype(self) -> torch.dtype:
        # Emulated bf16 runs its matmuls in fp32: the bf16 ceiling of such a CPU (~0.001 TFLOPS) would measure
        # the path it does not take.
        return (None if self.precision.emulate_bf16 else build.autocast_dtype(self.precision.name)) or torch.float32

    def ceiling_key(self) -> str:
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return f"v2|{name}|{self._ceiling_dtype()}|{torch.get_num_threads()}"  # v2: v1's could come from busy cores

    def _ceilings(self) -> dict[str, float]:
        """The cached ceilings, verified on read: a damaged entry is measured again, with a warning."""
        return load_ceilings(Path(self.cfg.data.cache_dir) / "peak_tflops.json") or {}

    def _keep_ceiling(self, value: float) -> None:
        """The highest ceiling measured on idle cores is the one kept: busy cores only ever lower it."""
        known = self._ceilings()
        key = self.ceiling_key()
        known[key] = max(value, known.get(key, 0.0))
        save_ceilings(Path(self.cfg.data.cache_dir) / "peak_tflops.json", known)

    def logger(self, max_steps: int) -> MetricsLogger:
        sinks = make_sinks(self.cfg, self.run_dir) if self.is_main else []
        return MetricsLogger(self.run_dir, max_steps, enabled=self.is_main, sinks=sinks)

    # ------------------------------------------------------------------ what the loop asks of the process
    def autocast(self) -> AbstractContextManager[Any]:
        """The compute precision around every forward: the one place that opens it."""
        dtype = build.autocast_dtype(self.precision.name)
        return torch.autocast(self.device.type, dtype=dtype) if dtype is not None else nullcontext()

    def emulation(self) -> AbstractContextManager[Any]:
        """bf16 emulated on fp32 kernels where this CPU's own bf16 matmuls are slower (`precision.emulate_bf16`),
        around forward *and* backward: the backward's matmuls are bf16 too, and gradient checkpointing recomputes
        the forward inside backward. A no-op elsewhere."""
        if not self.precision.emulate_bf16:
            return nullcontext()
        from llmexp.model.bf16_emulation import Bf16Emulation

        return Bf16Emulation()

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when it is true on any (one tiny all-reduce; free on one process)."""
        if self.world == 1:
            return flag
        return bool(self.reduce_sum(torch.tensor([float(flag)], device=self.device)).item() > 0)

    def reduce_max(self, value: float) -> float:
        return float(self._all_reduce(value, torch.distributed.ReduceOp.MAX))

    def reduce_min(self, value: int) -> int:
        return int(self._all_reduce(value, torch.distributed.ReduceOp.MIN))

    def _all_reduce(self, value: float, op: Any) -> float:
        """One number reduced over the ranks with `op` (itself when there is one rank)."""
        if self.world == 1:
            return value
        tensor = torch.tensor(value, device=self.device)
        torch.distributed.all_reduce(tensor, op=op)
        return tensor.item()

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum") if self.world > 1 else tensor


def setup_runtime(cfg: DictConfig) -> Runtime:
    """The runtime of this Hydra job; its output directory (the same on every rank) is the run directory."""
    from hydra.core.hydra_config import HydraConfig

    return Runtime(cfg, Path(HydraConfig.get().runtime.output_dir))


# ----------------------------------------------------------------------------- the run description


def describe(cfg: DictConfig, rt: Runtime, vocab_size: int, train_data: Any, data_fingerprint: str,
             lr_found: bool = False) -> tuple[RunDescription, Engine, torch.nn.Module, Any]:
    """Resolve everything the loop reads, once, in the order it depends on: the batch plan (batch_size=auto
    probes here, before any engine exists), the engine, the model and optimizer (whose size sets lr=auto and
    the FLOPs per token), the matmul ceiling, the monitor settings. Returns the frozen description with the
    engine, the prepared model and the optimizer. `lr_found`: `cfg.lr` is lr=find's pick (`lr_source: find`)."""
    from llmexp.train.schedule import warmup_steps_for

    plan, auto_batch = _batch_plan(cfg, rt, vocab_size, train_data)
    engine = _engine(cfg, rt, plan)
    model, optimizer, built = _build(cfg, rt, engine, vocab_size, plan.micro * cfg.data.max_length)
    max_steps = plan.max_steps(len(train_data))
    monitor = MonitorSettings.for_run(finetune=bool(cfg.model.name_or_path), max_grad_norm=cfg.train.max_grad_norm,
                                      precision=rt.precision.name, lr=built.lr)
    desc = RunDescription(
        precision=rt.precision, plan=plan, auto_batch=auto_batch, lr=built.lr,
        lr_source="find" if lr_found else built.lr_source,
        monitor=monitor, max_steps=max_steps,
        warmup_steps=warmup_steps_for(max_steps, cfg.train.warmup_ratio, cfg.train.warmup_steps),
        num_params=built.num_params, total_params=built.total_params, flops_per_token=built.flops_per_token,
        peak_tflops=built.peak_tflops, mfu_note=built.mfu_note, data_fingerprint=data_fingerprint,
        data_seed=cfg.train.seed_data if cfg.train.seed_data is not None else cfg.seed, started=rt.started,
        model_facts=built.model_facts)
    return desc, engine, model, optimizer


def _batch_plan(cfg: DictConfig, rt: Runtime, vocab_size: int, train_data: Any) -> tuple[BatchPlan, Any]:
    """The batch plan; batch_size=auto settles its micro-batch first (the choice a checkpoint holds, else the
    estimate's upper bound and a probe step: `autobatch.choose_batch_size`)."""
    if parse_batch_size(cfg.batch_size) is not None:
        return make_plan(cfg, rt.world), None
    from llmexp.train.autobatch import choose_batch_size
    from llmexp.train.resume import saved_auto_batch

    choice = choose_batch_size(cfg, rt, vocab_size, len(train_data), saved_auto_batch(cfg, rt.run_dir))
    return make_plan(cfg, rt.world, micro=choice.chosen), choice


def _engine(cfg: DictConfig, rt: Runtime, plan: BatchPlan) -> Engine:
    from llmexp.train.engines.plain import PlainEngine

    if cfg.deepspeed.stage > 0:
        from llmexp.train.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(rt.accelerator, rt.precision.name, plan, cfg.deepspeed.stage)
    if cfg.fsdp.name != "none":
        from llmexp.train.engines.fsdp import FsdpEngine

        return FsdpEngine(rt.accelerator, rt.precision.name, plan, cfg.fsdp.name, cfg.fsdp.cpu_offload)
    return PlainEngine(rt.accelerator, rt.precision.name, cfg.precision.init_scale, cfg.precision.growth_interval,
                       trainable_only=cfg.peft.name != "none")  # adapters: checkpoints hold only the trainable


@dataclass(frozen=True)
class _Built:
    """What building the model decides: its size, and through it lr=auto and MFU's FLOPs and ceiling."""

    num_params: int
    total_params: int
    flops_per_token: float
    peak_tflops: float | None
    mfu_note: str | None
    lr: float
    lr_source: str
    model_facts: dict[str, Any]


def _build(cfg: DictConfig, rt: Runtime, engine: Engine, vocab_size: int,
           micro_tokens: int) -> tuple[torch.nn.Module, Any, _Built]:
    """Model (wrapped with its loss) and optimizer, prepared for this device, and what their size decides."""
    from llmexp.model.facts import model_facts
    from llmexp.model.loss import CausalLMLoss
    from llmexp.train.schedule import resolve_lr

    torch.manual_seed(cfg.seed)  # same init on every rank
    lm = build.build_model(cfg, vocab_size, rt.precision.name)
    matmul = cpu_matmul_path(cfg, rt, lm, micro_tokens)
    facts = model_facts(cfg, lm) | ({"cpu_matmul": matmul.record()} if matmul else {})
    total, c = build.count_params(lm, trainable_only=False), lm.config
    peak_tflops, mfu_note = (cfg.train.peak_tflops, None) if cfg.train.peak_tflops else rt.measure_peak()
    lr, lr_source = resolve_lr(cfg, total)
    # Every weight takes part in forward and backward (6N); with adapters the frozen weights need no
    # weight gradient (4N), which this count leaves in: MFU is then a slight overestimate.
    built = _Built(num_params=build.count_params(lm), total_params=total,
                   flops_per_token=flops_per_token(total, c.num_hidden_layers, c.hidden_size, cfg.data.max_length),
                   peak_tflops=peak_tflops, mfu_note=mfu_note, lr=lr, lr_source=lr_source, model_facts=facts)
    loss_model = CausalLMLoss(lm)
    if matmul is not None and matmul.onednn:
        from llmexp.model.cpu_matmul import route

        route(lm)
        loss_model.head_mm_t = matmul.matmul_t()
    model = engine.shard(loss_model)  # FSDP: before the optimizer sees the parameters
    optimizer = build.build_optimizer(cfg, model, lr, rt.device.type)
    model, optimizer = engine.prepare(model, optimizer)
    if rt.compiles:
        model = torch.compile(model)
    return model, optimizer, built


def cpu_matmul_path(cfg: DictConfig, rt: Runtime, lm: torch.nn.Module, micro_tokens: int) -> MatmulPath | None:
    """Where this run's fp32 matmuls go on a CPU (`llmexp.model.cpu_matmul`); None off the CPU or outside fp32
    (bf16 autocast runs on oneDNN already; emulated bf16 owns its matmuls)."""
    from llmexp.model.cpu_matmul import MatmulPath, probe_once, widest_linear

    if rt.device.type != "cpu" or rt.precision.name != "fp32":
        return None
    why_not = ("train.cpu_matmul=torch" if cfg.train.cpu_matmul == "torch"
               else "train.compile=true: inductor chooses the kernels" if cfg.train.compile
               else f"fsdp={cfg.fsdp.name} wraps the layers" if cfg.fsdp.name != "none"
               else f"deepspeed={cfg.deepspeed.name} wraps the layers" if cfg.deepspeed.stage > 0 else None)
    if why_not:
        return MatmulPath("torch", why_not)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    shape = widest_linear(lm, skip=head)
    if not shape:
        return MatmulPath("torch", "the model has no nn.Linear layer")
    return probe_once(Path(cfg.data.cache_dir) / "cpu_matmul.json", micro_tokens, *shape)


def start_facts(cfg: DictConfig, rt: Runtime, desc: RunDescription) -> dict[str, Any]:
    """The `start` record: the console header prints it, and the detectors turn `bf16_emulated` and `mfu_note`
    into findings."""
    facts: dict[str, Any] = {
        "lr_chosen": desc.lr, "lr_source": desc.lr_source, "num_params": desc.num_params,
        "global_batch_size": desc.plan.global_batch, "gradient_accumulation_steps": desc.plan.accum,
        "precision": desc.precision.name, "run_dir": str(rt.run_dir), "model": cfg.model.name,
        "model_path": cfg.model.name_or_path, "data": cfg.data.name, "max_length": cfg.data.max_length,
        "max_steps": desc.max_steps, "batch_size": desc.plan.micro, "world_size": desc.plan.world,
        "fsdp": cfg.fsdp.name, "optimizer": cfg.optimizer.name, "scheduler": cfg.scheduler.name,
        "precision_requested": desc.precision.requested, "device": rt.device.type, "peak_tflops": desc.peak_tflops}
    if desc.auto_batch:
        facts["batch_size_auto"] = desc.auto_batch.record()
    if desc.precision.warning:
        compile_note = ("; train.compile=true is not applied: torch.compile traces nothing under the emulation"
                        if cfg.train.compile and not rt.compiles else "")
        facts.update(bf16_emulated=desc.precision.warning + compile_note, bf16_advice=BF16_EMULATION_ADVICE)
    if desc.precision.bf16_slowdown is not None:
        facts.update(bf16_emulation=desc.precision.emulate_bf16, bf16_slowdown=desc.precision.bf16_slowdown)
    if desc.mfu_note:
        facts["mfu_note"] = desc.mfu_note
    facts.update(desc.model_facts, total_params=desc.total_params)
    return facts
