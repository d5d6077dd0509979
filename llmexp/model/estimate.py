"""`python -m llmexp.estimate [overrides]`: the memory a run needs, before you start it.

Per device, for the composed model, precision, optimizer, ZeRO stage or FSDP strategy and world size: weights,
gradients and optimizer state by their bytes per parameter, plus FSDP's gathered units (both explained in
docs/how-to/fsdp-and-deepspeed.md), and the activations: what backward keeps per token and layer (Llama block,
saved tensors counted from autograd's graph), plus the loss head's fp32 logits chunk; 1 layer's worth and the
layer inputs under gradient checkpointing; plus backward's working set (one layer's activation gradients).

With adapters (`peft=lora` / `qlora`) only the adapters have gradients and optimizer state (4 B each for the fp32
adapter weights, plus the optimizer's bytes). The frozen base is in the autocast dtype under lora (2 B/param in
bf16/fp16, 4 B in fp32); under qlora every linear layer but the head is 4-bit NF4: 0.5 B/param plus 0.127 bits/param
of constants with double quantisation (QLoRA paper, section 3), while embeddings, norms and the head stay fp32.
LoRA's dropout keeps a copy of each adapted layer's input for backward. The parameter count is the meta model's:
exact for `model=llama2-7b` too. The figures are the ZeRO paper's accounting (Rajbhandari et al. 2020) with our
trainer's specifics; `benchmarks/memory.py` measures the real peak (`benchmarks/memory_fsdp.py` the per-rank peak
under FSDP) and `tests/test_estimate.py` holds the estimate to both.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from llmexp.config.derived import parse_batch_size
from llmexp.errors import UserError
from llmexp.model.build import count_params, field_kwargs

MiB = 2**20
NF4_BYTES_PER_PARAM = 0.5 + 0.127 / 8  # 4-bit NF4 with double quantisation (module docstring)
STATE_BYTES_PER_PARAM = {"adamw": 8.0, "adamw8bit": 2.0, "paged_adamw8bit": 2.0, "lion": 4.0, "lion8bit": 1.0}
"""Optimizer state per parameter; 8-bit states are one byte per moment (+ <1% block scales)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device (and CPU bytes under offload)."""

    num_params: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    cpu_offloaded: float
    trainable_params: int | None = None
    """With adapters: the adapters' parameters (None: every parameter trains)."""
    gathered: float = 0.0
    """FSDP: full parameters and unsharded gradients of the units in flight, on top of the shards."""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.gathered


@dataclass(frozen=True)
class FsdpUnits:
    """The parameters FSDP gathers at once, read off the meta model: the root's and one decoder layer's."""

    root: int
    """Parameters outside the decoder layers (embeddings, head, final norm; tied weights once)."""
    layer: int
    num_layers: int


@dataclass(frozen=True)
class AdapterFacts:
    """What the memory of an adapter run depends on, read off the meta model."""

    trainable: int
    """LoRA parameters: r * (in + out) per adapted linear layer."""
    quantized: int
    """Weights stored in 4 bits under qlora: every linear layer but the output head."""
    dropout_elems_per_token: int
    """Elements of the adapted layers' inputs per token (all layers), which LoRA's dropout copies."""


def model_config(cfg: DictConfig) -> Any:
    """The configured model's transformers config: a local model's (its GGUF metadata's, or its config.json), else
    one built from the `model.*` fields (model=llama2-7b lists the hub model's fields for exactly this)."""
    from transformers import AutoConfig, LlamaConfig

    from llmexp.data.tokenizer import hub_error, is_local_name
    from llmexp.machine.gguf import local_gguf

    m = cfg.model
    gguf = local_gguf(str(m.name_or_path), str(m.gguf_file)) if m.name_or_path and m.gguf_file else None
    if gguf is not None and gguf.is_file():  # the GGUF metadata's config (its tensors are not read)
        return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if m.name_or_path and (Path(m.name_or_path).expanduser() / "config.json").is_file():
        try:
            return AutoConfig.from_pretrained(m.name_or_path, trust_remote_code=m.trust_remote_code)
        except (OSError, ValueError) as err:  # no or an unknown model_type, custom code not trusted
            raise hub_error(m.name_or_path, err) from err
    if m.name_or_path and is_local_name(str(m.name_or_path)):  # a directory without config.json: estimated
        raise hub_error(m.name_or_path)  # from the fields, it would be another model
    if m.name_or_path and (config := hub_config(str(m.name_or_path), m.revision, m.trust_remote_code)):
        return config
    return LlamaConfig(**field_kwargs(m, m.vocab_size))  # (a hub model out of reach: `cli.estimate` says so)


@functools.lru_cache(maxsize=8)
def hub_config(name: str, revision: str | None, trust_remote_code: bool) -> Any | None:
    """A hub model's config.json, from the hub or, offline, the local HF cache; None where neither has it."""
    from transformers import AutoConfig

    from llmexp.data.tokenizer import hub_load_kwargs

    try:
        return AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code,
                                          **hub_load_kwargs(name))
    except (OSError, ValueError, UserError):  # not cached, no such repo, custom code not trusted, a malformed id
        return None


def meta_model(cfg: DictConfig) -> Any:
    """The configured model built on the meta device: shapes without memory."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config(cfg))


def count_params_meta(cfg: DictConfig) -> int:
    """Parameters of the configured model, built on the meta device: nothing is allocated."""
    return count_params(meta_model(cfg), trainable_only=False)


def meta_facts(cfg: DictConfig, precision: str, world: int) -> dict[str, Any]:
    """`estimate`'s and `largest_fitting`'s keyword arguments: what one meta model says, `precision` and `world`."""
    model = meta_model(cfg)
    return {"num_params": count_params(model, trainable_only=False), "precision": precision, "world": world,
            "adapters": adapter_facts(cfg, model), "units": fsdp_units(cfg, model) if cfg.fsdp.name != "none" else None}


def adapter_facts(cfg: DictConfig, model: Any = None) -> AdapterFacts | None:
    """The adapters' size and the 4-bit share of the base for `peft=lora/qlora`; None for peft=none.
    `target_modules` is matched as peft matches it: all-linear is every linear layer but the head,
    a list matches module names or their last components. `model`: the meta model, when built already."""
    from torch import nn

    pe = cfg.peft
    if pe.name == "none":
        return None
    model = meta_model(cfg) if model is None else model
    head = model.get_output_embeddings()
    linears = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear) and mod is not head]
    targets = list(pe.target_modules) if not isinstance(pe.target_modules, str) else None
    adapted = [mod for name, mod in linears
               if targets is None or any(name == t or name.endswith("." + t) for t in targets)]
    trainable = sum(pe.r * (mod.in_features + mod.out_features) for mod in adapted)
    quantized = sum(mod.weight.numel() for _, mod in linears) if pe.load_in_4bit else 0
    dropout = sum(mod.in_features for mod in adapted) if pe.lora_dropout > 0 else 0
    return AdapterFacts(trainable=trainable, quantized=quantized, dropout_elems_per_token=dropout)


def fsdp_units(cfg: DictConfig, model: Any = None) -> FsdpUnits:
    """The sizes of the units `fully_shard` wraps: each decoder layer, and the root with what is left. `model`: the
    meta model, when built already."""
    model = meta_model(cfg) if model is None else model
    layers = list(model.model.layers)
    unique = {id(p): p for p in model.parameters()}
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = sum(p.numel() for key, p in unique.items() if key not in in_layers)
    return FsdpUnits(root=root, layer=sum(p.numel() for p in layers[0].parameters()), num_layers=len(layers))


def activation_bytes(cfg: DictConfig, precision: str, micro_batch: int, model: Any = None) -> float:
    """What autograd keeps for one micro-batch (per device).

    Per token and Llama layer (elements): the block input and its RMSNorm output (2d), q and k after
    RoPE, v (d + 2 kv_dim), the attention output and o_proj's input (2d), the second residual
    input and norm output (2d), and in the SwiGLU MLP gate, silu(gate), up and their product (4i).
    Matmul outputs are 16-bit under autocast, norms and residuals stay fp32. `model`: the model's transformers
    config (default: `model_config(cfg)`, which reads a local model's config.json or GGUF header).
    """
    from llmexp.model.loss import CHUNK_TOKENS

    tokens = micro_batch * cfg.data.max_length
    # a pretrained model's own sizes, not the `model.*` fields' (those describe a new one)
    c = model if model is not None else model_config(cfg)
    d, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
    i = getattr(c, "intermediate_size", None) or 4 * d  # GPT-2-style configs leave it to the 4x default
    heads = c.num_attention_heads
    kv_dim = (getattr(c, "head_dim", None) or d // heads) * (getattr(c, "num_key_value_heads", None) or heads)
    half = 2 if precision in ("bf16", "fp16") else 4
    fp32_elems = 4 * d  # residual inputs and norm outputs
    mm_elems = 3 * d + 2 * kv_dim + 4 * i  # q, k, v, attention out, o_proj in, the MLP's four
    per_layer_token = 4 * fp32_elems + half * mm_elems
    # gradient checkpointing keeps each layer's input and recomputes one layer at a time in backward
    layer_bytes = tokens * (layers * 4 * d + per_layer_token if cfg.model.gradient_checkpointing
                            else layers * per_layer_token)
    logits_bytes = 3 * min(tokens, CHUNK_TOKENS) * vocab * 4  # fp32 logits, softmax and its gradient, one chunk
    # Backward's working set on top of what is saved: one layer's activation gradients (MLP-sized).
    working_bytes = tokens * (4 * i + 2 * d) * 4
    return float(layer_bytes + tokens * 4 * 2 * d + logits_bytes + working_bytes)  # + final norm in/out


def _state_bytes_per_param(opt: DictConfig) -> float:
    return STATE_BYTES_PER_PARAM.get(opt.name, 4.0 if (opt.name == "sgd" and opt.momentum) else 0.0)


def estimate(cfg: DictConfig, *, num_params: int, precision: str, world: int,
             adapters: AdapterFacts | None = None, micro_batch: int | None = None,
             units: FsdpUnits | None = None, model: Any = None) -> MemoryEstimate:
    """The per-device memory of one configuration (see the module docstring for the accounting).

    `micro_batch` replaces `batch_size` (which may be `auto`: 1 then); under FSDP `units` (default: read off the
    meta model) may be given; so may `model`, the model's transformers config (default: `model_config(cfg)`)."""
    micro = micro_batch or parse_batch_size(cfg.batch_size) or 1
    activations = activation_bytes(cfg, precision, micro, model)
    if adapters is not None:
        return _estimate_adapters(cfg, num_params, precision, adapters, micro, activations)
    if cfg.fsdp.name != "none":
        return _estimate_fsdp(cfg, num_params, precision, units or fsdp_units(cfg), world, activations)
    ds = cfg.deepspeed
    zero = max(ds.stage, 0)
    half_module = zero > 0 and precision in ("bf16", "fp16")  # DeepSpeed keeps 16-bit module weights
    weight_b = 2.0 if half_module else 4.0
    # with 16-bit module weights the fp32 master copy lives with the optimizer state
    state_b = _state_bytes_per_param(cfg.optimizer) + (4.0 if half_module else 0.0)
    n = float(num_params)
    weights = n * weight_b / (world if zero >= 3 else 1)
    if not half_module and precision in ("bf16", "fp16"):
        weights += n * 2.0  # autocast's 16-bit copies of the fp32 weights, kept for backward
    gradients = n * weight_b / (world if zero >= 2 else 1)
    optimizer = n * state_b / (world if zero >= 1 else 1)
    cpu = 0.0
    if ds.offload_optimizer != "none":
        cpu, optimizer = optimizer + (n * 4.0 / world if zero >= 2 else 0.0), 0.0  # + the fp32 grad partition
    if ds.offload_param != "none" and zero >= 3:
        cpu, weights = cpu + weights, 0.0
    return MemoryEstimate(num_params, weights, gradients, optimizer, activations, cpu)


def _estimate_fsdp(cfg: DictConfig, num_params: int, precision: str, units: FsdpUnits, world: int,
                   activations: float) -> MemoryEstimate:
    """FSDP2: fp32 shards of parameters, gradients and optimizer state, plus the gathered units."""
    # a parameter is split over every rank, or under hybrid_shard over those of one node
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if cfg.fsdp.name == "hybrid_shard" else world
    shards = max(1, min(world, local))
    n = float(num_params)
    compute_b = 2.0 if precision in ("bf16", "fp16") else 4.0  # FSDP's param_dtype: the autocast dtype
    weights, gradients = n * 4.0 / shards, n * 4.0 / shards
    optimizer = n * _state_bytes_per_param(cfg.optimizer) / shards
    in_flight = units.root + 2 * units.layer  # the root stays gathered; a layer runs while the next is prefetched
    kept = num_params if cfg.fsdp.name == "shard_grad_op" else in_flight  # shard_grad_op: whole until backward
    gathered = (kept + in_flight) * compute_b  # + unsharded grads awaiting their reduce-scatter
    cpu = 0.0
    if cfg.fsdp.cpu_offload:
        cpu, weights, gradients, optimizer = weights + gradients + optimizer, 0.0, 0.0, 0.0
    return MemoryEstimate(num_params, weights, gradients, optimizer, activations, cpu, gathered=gathered)


def _estimate_adapters(cfg: DictConfig, num_params: int, precision: str, adapters: AdapterFacts, micro: int,
                       activations: float) -> MemoryEstimate:
    """LoRA / QLoRA on one process (DeepSpeed is refused with adapters): frozen base, trained adapters."""
    n_a = float(adapters.trainable)
    autocast = precision in ("bf16", "fp16")
    # lora holds the frozen base in the autocast dtype; qlora keeps its embeddings, norms and head in fp32
    base_b = 2.0 if autocast and not cfg.peft.load_in_4bit else 4.0
    weights = float(num_params - adapters.quantized) * base_b + adapters.quantized * NF4_BYTES_PER_PARAM + n_a * 4.0
    if autocast:  # 16-bit copies of the fp32 adapters that matmuls keep for backward
        weights += n_a * 2.0
    dropout_copies = micro * cfg.data.max_length * adapters.dropout_elems_per_token * (2 if autocast else 4)
    return MemoryEstimate(num_params, weights, n_a * 4.0, n_a * _state_bytes_per_param(cfg.optimizer),
                          activations + dropout_copies, 0.0, trainable_params=adapters.trainable)


def resolved_precision(name: str) -> str:
    """The precision a run would use on this machine (`machine.precision.resolve_precision`: `auto` is bf16 where it
    is native, else fp32; bf16 stays bf16, emulated or not)."""
    if name != "auto":
        return name
    import torch

    from llmexp.machine.precision import resolve_precision

    return resolve_precision(name, "cuda" if torch.cuda.is_available() else "cpu")


def format_estimate(est: MemoryEstimate, *, label: str) -> str:
    rows = [("weights", est.weights), ("gradients", est.gradients), ("optimizer state", est.optimizer),
            *([("FSDP gathered", est.gathered)] if est.gathered else []),
            ("activations", est.activations), ("total per device", est.total),
            *([("CPU (offloaded)", est.cpu_offloaded)] if est.cpu_offloaded else [])]
    lines = [label, f"  parameters        {est.num_params / 1e6:,.1f} M"]
    if est.trainable_params is not None:
        share = est.trainable_params / max(1, est.num_params)
        lines.append(f"  trainable         {est.trainable_params / 1e6:,.2f} M ({share:.2%}: the adapters)")
    lines += [f"  {name:<17} {value / MiB:>12,.1f} MiB" for name, value in rows]
    return "\n".join(lines)


CPU_RAM_SHARE = 0.8
"""Of the RAM available now, what batch_size=auto may plan with on CPU: the OS, the page cache and other
programs need the rest, and there is no out-of-memory exception to recover from (the kernel kills)."""
CUDA_FREE_SHARE = 0.9
"""Of the GPU's free memory, what the estimate may plan with: the allocator's fragmentation and the CUDA
context are not in the accounting (the probe then finds out for sure)."""


def memory_budget(device_type: str, world: int) -> float:
    """Bytes one process of a `world`-process run may plan with: a share of this GPU's free memory, or on CPU a
    share of the available RAM split between the processes of this host (they share it: `LOCAL_WORLD_SIZE` of them,
    else the whole world)."""
    if device_type == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0] * CUDA_FREE_SHARE
    import psutil

    processes = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return psutil.virtual_memory().available * CPU_RAM_SHARE / max(1, processes)


def largest_fitting(cfg: DictConfig, candidates: list[int], budget: float, on_cpu: bool = True, **kwargs: Any) -> int:
    """The largest candidate micro-batch whose estimate fits `budget`, offloaded host memory included when `on_cpu`
    (device and host are one); the smallest when none does (the probe decides then). `kwargs` go to `estimate`."""
    kwargs.setdefault("model", model_config(cfg))  # read once (a GGUF's header), not once per candidate
    for micro in sorted(candidates, reverse=True):
        est = estimate(cfg, micro_batch=micro, **kwargs)
        if est.total + (est.cpu_offloaded if on_cpu else 0.0) <= budget:
            return micro
    return min(candidates)


def summary(est: MemoryEstimate) -> dict[str, Any]:
    """The estimate as MiB figures (for benchmarks and reports)."""
    parts = ("weights", "gradients", "optimizer", "activations", "total", "cpu_offloaded")
    return {f"{part}_mb": getattr(est, part) / MiB for part in parts}

