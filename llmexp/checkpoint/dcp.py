"""Sharded checkpoints through torch.distributed.checkpoint (DCP), read without running pickle code (where DCP's
stock reader runs it, and why it must not: docs/how-to/fsdp-and-deepspeed.md): `SafeReader` reads `.metadata` with
`MetadataUnpickler`, `SafePlanner` loads the non-tensor entries with `weights_only=True`; a refusal is a
`CorruptCheckpoint` naming the file. torch is imported inside the functions: this module sits beside the config path.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

from llmexp.checkpoint.serialize import CorruptCheckpoint, loading
from llmexp.rundir.readers import open_regular

DIR_NAME = "dcp"
"""The directory in `checkpoints/step_<N>/` that holds an FSDP checkpoint (the engine writes it, resume reads it)."""
METADATA_FILE = ".metadata"

_ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout from its name: a lookup, no side effect
    "torch": frozenset({"Size"}),  # plus every torch.dtype, checked by type below
    "pathlib": frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
}
"""What a DCP `.metadata` written by torch 2.x pickles (found by unpickling one with a logging
`find_class`); everything else is refused."""


class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}: not part of DCP's metadata")


def read_metadata(directory: Path, rank: int | None = None) -> Any:
    """The checkpoint's DCP `Metadata`, unpickled safely; CorruptCheckpoint naming the file otherwise."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    file = directory / (METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
    with loading(file), open_regular(file) as f:
        metadata = MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpoint(f"{file}: holds a {type(metadata).__name__}, not DCP metadata")
    if problem := storage_problem(directory, metadata):
        raise CorruptCheckpoint(f"{file}: {problem}")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def storage_problem(directory: Path, metadata: Any) -> str | None:
    """Why the storage entries of `metadata` are not confined to `directory` (DCP's reader opens `directory /
    relative_path` for each: docs/how-to/fsdp-and-deepspeed.md, "Storage paths are confined"), or None."""
    root = os.path.realpath(directory)
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", 0), getattr(info, "length", 0)
        if not isinstance(rel, str) or not rel or "\x00" in rel:
            return f"a storage entry names no file ({rel!r})"
        real = os.path.realpath(os.path.join(root, rel))
        if os.path.isabs(rel) or ".." in Path(rel).parts or os.path.dirname(real) != root:
            return f"storage path {rel!r} lies outside the checkpoint directory {root}; refused, nothing was read"
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)):
            return f"storage entry {rel!r} has offset {offset!r} and length {length!r}, not byte counts"
    return None


def safe_reader(directory: Path) -> Any:
    """A `FileSystemReader` whose `.metadata` goes through `MetadataUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(Path(self.path), kwargs.get("rank"))
            metadata.storage_meta.load_id = self.load_id  # what the stock reader sets too
            return metadata

    return SafeReader(directory)


def safe_planner() -> Any:
    """A `DefaultLoadPlanner` that loads non-tensor entries with `torch.load(weights_only=True)`."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element  # what the stock load_bytes uses
    from torch.distributed.checkpoint.planner import ReadItem

    class SafePlanner(DefaultLoadPlanner):
        # The stock load_bytes, with weights_only=True (it has no switch for it).
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            with loading(f"DCP entry {fqn}", 200):
                obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafePlanner()


def load(state: dict[str, Any], directory: Path) -> None:
    """`dcp.load` into `state` in place (collective), through `safe_reader` and `safe_planner`. The metadata is
    read (and its storage paths checked) first: inside `dcp.load` a refusal would come back wrapped in DCP's
    CheckpointException, a traceback instead of the CorruptCheckpoint that names the file."""
    import torch.distributed.checkpoint as dcp

    read_metadata(directory)
    dcp.load(state, storage_reader=safe_reader(directory), planner=safe_planner())
