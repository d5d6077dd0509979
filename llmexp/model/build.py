"""Build the model, the optimizer and the precision setting from the config.

This is the one place that instantiates classes named in the config. Optimizer classes come
from `_target_`, but only those `llmexp.config.security` allows there: a config is data, never code to run.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import TYPE_CHECKING, Any

from llmexp.config.derived import model_sizes
from llmexp.errors import UserError, first_line
from llmexp.model.mup import granite_multipliers, lr_mult, mup_groups, rescale_init

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig
    from transformers import PreTrainedModel


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a resolved precision; None for fp32."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def _from_pretrained(cls: Any, cfg: DictConfig, converted: str | None = None, **extra: Any) -> Any:
    from safetensors import SafetensorError

    from llmexp.data.tokenizer import hub_error, hub_load_kwargs

    m = cfg.model
    if converted is not None:  # model.gguf_file's cached dequantised conversion (llmexp.model.gguf)
        return cls.from_pretrained(converted, **extra)
    kwargs = hub_load_kwargs(m.name_or_path)  # offline fast path when the hub is unreachable
    try:
        return cls.from_pretrained(m.name_or_path, revision=m.revision, trust_remote_code=m.trust_remote_code,
                                   **kwargs, **extra)
    # ValueError: custom code without trust_remote_code, an unknown model_type; RuntimeError, KeyError and
    # SafetensorError: weights cut short, shaped unlike config.json, an index without its weight_map (a damaged dir)
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as err:
        raise hub_error(m.name_or_path, err) from err


def build_model(cfg: DictConfig, vocab_size: int, precision: str = "fp32") -> PreTrainedModel:
    """A fresh Llama-style model from the config fields, or a pretrained one from `name_or_path`,
    with LoRA adapters when `peft` asks for them (then only the adapters train).

    Trained weights stay in fp32 (the master copy); autocast runs the matmuls in bf16/fp16. With
    adapters the frozen base is held in the precision's dtype (lora) or, for its linear layers, in
    4-bit NF4 computing in that dtype (qlora); peft keeps the adapters themselves in fp32.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    m = cfg.model
    four_bit = cfg.peft.name != "none" and cfg.peft.load_in_4bit
    if m.name_or_path:
        converted = gguf_source(cfg, precision) if m.gguf_file else None
        config = _from_pretrained(AutoConfig, cfg, converted)
        extra = quantization_kwargs(cfg, precision) if four_bit else {}
        model = _from_pretrained(AutoModelForCausalLM, cfg, converted, **extra)
        if four_bit:  # a 4-bit model keeps its own config: it carries the quantization_config
            keep_4bit_layers_on_their_training_kernel(model)
        else:
            model.config = config
            model.float()
    elif m.parametrization == "mup":
        model = _mup_model(m, vocab_size)
    else:
        model = LlamaForCausalLM(LlamaConfig(**field_kwargs(m, vocab_size)))
    if cfg.peft.name != "none":
        if not four_bit and (dtype := autocast_dtype(precision)) is not None:
            model.to(dtype)  # a frozen base needs no fp32 master copy: half the memory; the adapters stay fp32
        return add_adapters(cfg, model, four_bit)
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def keep_4bit_layers_on_their_training_kernel(model: PreTrainedModel) -> None:
    """Works around bitsandbytes 0.50: on a CPU with AVX512-BF16 a 4-bit layer's first forward in eval mode without
    grad repacks its weight for an inference kernel, which every later forward then takes, in training too. That
    kernel passes no gradient to the layer's input (the adapters below it learned from the residual stream alone),
    raised "a view of a leaf Variable that requires grad is being used in an in-place operation" on a layer with a
    bias (Qwen2's q/k/v_proj, GPT-2's), and "shape '[256, 10]' is invalid" on widths not multiples of 32 and 64 (the
    default model's down_proj, 688). So no layer is repacked: evals run the training kernel."""
    from bitsandbytes.nn import Linear4bit

    for mod in (m for m in model.modules() if isinstance(m, Linear4bit)):
        mod.support_avx512bf16_for_cpu = False


def field_kwargs(m: DictConfig, vocab_size: int) -> dict[str, Any]:
    """The config of a model built from `model.*`, its sizes times `model.width_mult` (`derived.model_sizes`)."""
    sizes = model_sizes(m)
    return dict(vocab_size=vocab_size, hidden_size=sizes.hidden_size, intermediate_size=sizes.intermediate_size,
                num_hidden_layers=m.num_hidden_layers, num_attention_heads=sizes.num_attention_heads,
                num_key_value_heads=sizes.num_key_value_heads, max_position_embeddings=m.max_position_embeddings,
                rope_theta=m.rope_theta, tie_word_embeddings=m.tie_word_embeddings,
                attention_dropout=m.attention_dropout, attn_implementation="sdpa")


def _mup_model(m: DictConfig, vocab_size: int) -> PreTrainedModel:
    """model.parametrization=mup: Granite (Llama's layout with muP's multipliers), its init rescaled
    (`llmexp.model.mup`). At model.mup_base_width it is the standard Llama, weight for weight."""
    from transformers import GraniteConfig, GraniteForCausalLM

    sizes = model_sizes(m)
    model = GraniteForCausalLM(GraniteConfig(**field_kwargs(m, vocab_size), **granite_multipliers(sizes, m)))
    rescale_init(model, sizes.mup_width_mult(m.mup_base_width))
    return model


def gguf_source(cfg: DictConfig, precision: str) -> str:
    """`model.gguf_file` dequantised to the dtype this run holds the base in (fp32: trained weights are the fp32
    master copy; a LoRA base in the precision's dtype), as a cached safetensors directory."""
    import torch

    from llmexp.model.gguf import gguf_model_dir

    dtype = (autocast_dtype(precision) if cfg.peft.name != "none" else None) or torch.float32
    return str(gguf_model_dir(cfg, dtype))


def quantization_kwargs(cfg: DictConfig, precision: str) -> dict[str, Any]:
    """from_pretrained arguments for a 4-bit NF4 base (QLoRA: Dettmers et al. 2023), after checking that
    bitsandbytes can run 4-bit here at all: a failure would otherwise surface mid-load as a traceback."""
    import torch
    from transformers import BitsAndBytesConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if problem := four_bit_problem(device):
        raise UserError(f"peft={cfg.peft.name}: bitsandbytes cannot run 4-bit weights on this {device} ({problem}); "
                        "use peft=lora (16/32-bit base) or a CUDA GPU")
    pe = cfg.peft
    compute = autocast_dtype(precision) or torch.float32
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=pe.bnb_4bit_quant_type,
                               bnb_4bit_use_double_quant=pe.bnb_4bit_use_double_quant, bnb_4bit_compute_dtype=compute)
    # the whole model on this process's device: 4-bit weights cannot be moved after loading
    return {"quantization_config": quant, "dtype": torch.float32,
            "device_map": {"": int(os.environ.get("LOCAL_RANK", "0")) if device == "cuda" else "cpu"}}


def four_bit_problem(device: str) -> str | None:
    """Why bitsandbytes cannot quantise to 4-bit NF4 and multiply on `device` (None: it can). A real
    probe, not a table: bitsandbytes' backends change by version (0.50 runs 4-bit on CPU too)."""
    try:
        import bitsandbytes.functional as bnbf
        import torch
    except ImportError as err:
        return f"bitsandbytes is not installed: {err}"
    try:
        weight = torch.randn(64, 64, device=device, dtype=torch.float32)
        packed, state = bnbf.quantize_4bit(weight, quant_type="nf4", compress_statistics=True)
        x = torch.randn(2, 64, device=device, dtype=torch.float32)
        out = x @ bnbf.dequantize_4bit(packed, state).t()
        if not bool(torch.isfinite(out).all()):
            return "its 4-bit round trip gave non-finite values"
    except Exception as err:  # bitsandbytes raises RuntimeError, NotImplementedError, ... by backend
        return f"{type(err).__name__}: {first_line(err)}"
    return None


def add_adapters(cfg: DictConfig, model: Any, four_bit: bool) -> Any:
    """Wrap `model` in a peft LoRA model: the base is frozen, the adapters train. Gradient
    checkpointing is non-reentrant, so it needs no input that requires grad and works under DDP."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    pe = cfg.peft
    ckpt_kwargs = {"use_reentrant": False}
    if four_bit:  # fp32 norms and embeddings, frozen base, checkpointing set up for 4-bit layers
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.model.gradient_checkpointing,
                                                gradient_checkpointing_kwargs=ckpt_kwargs)
    elif cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
    target = pe.target_modules if isinstance(pe.target_modules, str) else list(pe.target_modules)
    names = sorted({name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
                    if mod.__class__.__name__ in ("Linear", "Linear4bit", "Conv1D")})
    # peft refuses a list only when no name matches: one typo among several would silently adapt fewer layers
    missing = [] if isinstance(target, str) else [t for t in target if t not in names and not any(
        name == t or name.endswith("." + t) for name, _ in model.named_modules())]
    if missing:
        raise UserError(f"peft.target_modules={target}: {', '.join(map(str, missing))} names no module of this "
                        f"model; its linear layers are {names}, or use peft.target_modules=all-linear")
    lora = LoraConfig(r=pe.r, lora_alpha=pe.lora_alpha, lora_dropout=pe.lora_dropout, target_modules=target,
                      bias="none", task_type="CAUSAL_LM")
    try:
        peft_model = get_peft_model(model, lora)
    except ValueError as err:  # peft: "Target modules {...} not found in the base model"
        raise UserError(f"peft.target_modules={target}: {first_line(err)}; this model's linear "
                        f"layers are {names}, or use peft.target_modules=all-linear") from err
    from llmexp.model.lora_dropout import use_mask_dropout

    use_mask_dropout(peft_model)  # the same dropout, its CPU mask ~3x cheaper (~8% of a LoRA step before)
    return peft_model


def param_groups(model: torch.nn.Module, weight_decay: float, decay_all: bool) -> list[dict[str, Any]]:
    """Decay matrices only: biases, norms and embeddings keep their scale (the usual LLM recipe)."""
    embeddings = {id(p) for mod in model.modules() if mod.__class__.__name__ == "Embedding" for p in mod.parameters()}
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        matrix = param.ndim >= 2 and id(param) not in embeddings
        (decay if matrix or decay_all else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def optimizer_groups(cfg: DictConfig, model: torch.nn.Module) -> list[dict[str, Any]]:
    """The param groups: muP's per-part groups (each with its `lr_mult`), or the standard two."""
    if cfg.model.parametrization == "mup" and not cfg.model.name_or_path:
        return mup_groups(cfg, model, model_sizes(cfg.model).mup_width_mult(cfg.model.mup_base_width))
    return param_groups(model, cfg.train.weight_decay, cfg.optimizer.decay_norms_and_biases)


def build_optimizer(cfg: DictConfig, model: torch.nn.Module, lr: float, device_type: str) -> torch.optim.Optimizer:
    """The allow-listed optimizer class with only the arguments its constructor accepts."""
    import torch

    from llmexp.config.security import import_target

    o = cfg.optimizer
    target = o._target_
    if device_type == "cpu" and str(target).startswith("bitsandbytes."):
        # bitsandbytes' CPU backend warns at import that its 4-bit matmul kernels are missing: optimizers never use them
        logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    cls = import_target("optimizer._target_", target, base=torch.optim.Optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    candidates: dict[str, Any] = {"betas": tuple(o.betas), "eps": o.eps, "momentum": o.momentum}
    kwargs = {k: v for k, v in candidates.items() if k in accepted}
    if "fused" in accepted and o.name == "adamw":
        kwargs["fused"] = True  # one kernel per step instead of a loop over tensors; CPU and CUDA both have it
    kwargs.update(dict(o.kwargs))
    try:
        optimizer = cls(optimizer_groups(cfg, model), lr=lr, **kwargs)
    except (ValueError, TypeError) as err:  # torch and bitsandbytes check their arguments: e.g. eps < 0
        raise UserError(f"optimizer: {target} rejected its arguments {kwargs} ({err}); "
                        "fix optimizer.* or optimizer.kwargs.*") from err
    for group in optimizer.param_groups:  # muP's per-part lrs from the start (the trainer sets them each step)
        group["lr"] = lr * lr_mult(group)
    return optimizer


def decoder_blocks(lm: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder blocks: the modules of the classes transformers names as never to be split
    (`_no_split_modules`), the units FSDP shards and compile compiles; [] for a model that names none."""
    kinds = set(getattr(lm, "_no_split_modules", None) or ())
    return [m for m in lm.modules() if type(m).__name__ in kinds]


def count_params(model: torch.nn.Module, trainable_only: bool = True) -> int:
    """Parameters (shared tensors counted once): trainable ones, or all of them. A 4-bit weight counts
    its values, not its packed bytes (bitsandbytes stores two per uint8 element)."""
    unique = {id(p): p for p in model.parameters() if p.requires_grad or not trainable_only}.values()
    return sum(p.numel() * (2 if getattr(p, "quant_state", None) is not None else 1) for p in unique)
