"""What goes inside a checkpoint, saved and loaded without ever running pickle code: tensors (the model) through
safetensors; everything else (optimizer state, scaler, RNG states encoded as tensors and ints) through `torch.save`,
back only through `torch.load(weights_only=True)`, whose unpickler builds tensors and plain containers and refuses
anything else. torch, numpy and safetensors are imported inside the functions: no heavy import at import time.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmexp.errors import UserError, first_line
from llmexp.rundir.readers import open_regular

if TYPE_CHECKING:
    import torch


class CorruptCheckpoint(UserError):
    """A checkpoint file is missing, truncated, altered, or holds something unsafe to load; the message names the
    file. A UserError: an explicit `train.resume=<path>` exits 2 with it; `train.resume=auto` falls back instead."""


class UnsafeState(TypeError):
    """`save_state` was given something `torch.load(weights_only=True)` could not load back."""


def rng_filename(rank: int) -> str:
    """The file holding one process's RNG states inside a checkpoint."""
    return f"rng_rank{rank}.pt"


@contextmanager
def loading(path: Path | str, quoted: int = 300) -> Iterator[None]:
    """Whatever a library raises while it loads `path` (SafetensorError, an unsafe pickle, a bad zip, EOFError,
    OSError ...) means "this file is bad": a CorruptCheckpoint naming it, quoting the error (`quoted` characters)."""
    try:
        yield
    except Exception as err:
        raise CorruptCheckpoint(f"{path}: cannot be loaded safely ({type(err).__name__}: {first_line(err, quoted)})"
                                ) from None


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Save a flat dict of tensors as safetensors (CPU, contiguous; shared storage is copied)."""
    from safetensors.torch import save_file

    seen: set[tuple[int, int]] = set()
    out = {}
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.numel() and key in seen:  # tied weights: safetensors refuses aliases, so store a copy
            t = t.clone()
        seen.add(key)
        out[name] = t
    save_file(out, str(path), metadata={"format": "pt"})


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Load a safetensors file; CorruptCheckpoint naming the file if it is damaged."""
    from safetensors.torch import load_file

    with loading(path), open_regular(path):  # (a FIFO would block the reader)
        return load_file(str(path))


_PLAIN = (str, bytes, int, float, bool, complex, type(None))


def _check_loadable(obj: Any, where: str, leaves: tuple[type, ...]) -> None:
    # Exact types for plain values: numpy.float64 is a float subclass the safe unpickler refuses.
    if type(obj) in _PLAIN or isinstance(obj, leaves):
        return
    if type(obj) in (dict, list, tuple) or (isinstance(obj, dict) and type(obj).__module__ == "collections"):
        items: Iterable[tuple[Any, Any]] = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, value in items:
            if isinstance(obj, dict):
                _check_loadable(key, f"{where} (a key)", leaves)
            _check_loadable(value, f"{where}[{key!r}]", leaves)
        return
    raise UnsafeState(f"state{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which "
                      "torch.load(weights_only=True) refuses; convert it to a tensor, number, str, list or dict")


def save_state(path: Path, obj: Any) -> None:
    """torch.save a state that `load_state` can load back: plain containers, numbers, tensors. Checked up front, so
    that a value the safe unpickler refuses (a numpy scalar in the metric history, say) fails now, not at resume."""
    import torch

    _check_loadable(obj, "", (torch.Tensor, torch.dtype, torch.device, torch.Size))
    torch.save(obj, str(path))


def load_state(path: Path) -> Any:
    """torch.load with weights_only=True: never runs pickle code. CorruptCheckpoint naming the
    file if it is damaged or holds anything but tensors and plain data."""
    import torch

    with loading(path), open_regular(path) as f:
        return torch.load(f, map_location="cpu", weights_only=True)


def capture_rng() -> dict[str, Any]:
    """The RNG states of python, numpy, torch and CUDA, as tensors and ints (loadable with weights_only=True)."""
    import numpy as np
    import torch

    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the states `capture_rng` took. CUDA states are restored for the devices both
    runs have (a different device count changes the data layout anyway)."""
    import numpy as np
    import torch

    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    for device, cuda_state in enumerate((state.get("cuda") or [])[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(cuda_state, device)
