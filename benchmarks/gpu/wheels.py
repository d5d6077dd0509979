"""The carried wheels: trim bitsandbytes to one CUDA library, check the folder's size, list it.

    python benchmarks/gpu/wheels.py trim WHEEL --keep cuda130    # rewrite WHEEL in place
    python benchmarks/gpu/wheels.py check DIR --limit-mib 40     # list DIR's wheels; exit 1 if over the limit

bitsandbytes' manylinux wheel holds one native library per CUDA (and ROCm, XPU) version: 43 MB, of which
the CUDA 13.0 one (`libbitsandbytes_cuda130.so`) is about 1.5 MB compressed. The GPU machine's torch is
built for CUDA 13.0, so bitsandbytes loads only that one (and the CPU one for CPU tensors). `trim` writes
the wheel again without the other native libraries and drops their lines from RECORD, so that RECORD
still lists exactly the files the wheel holds, with their hashes (pip refuses a wheel whose RECORD names
a file that is missing). Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path

NATIVE = re.compile(r"(^|/)libbitsandbytes_(?P<backend>[a-z]+\d*)\.so$")
"""bitsandbytes' native libraries: libbitsandbytes_cpu.so, _cuda130.so, _rocm64.so, _xpu2025.so, ..."""
MiB = 2**20


def record_hash(data: bytes) -> str:
    """A RECORD hash: sha256, urlsafe base64 without padding (PEP 376 / the wheel spec)."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def dropped(name: str, keep: set[str]) -> bool:
    """Whether `name` (a path inside the wheel) is a native library of a backend not in `keep`."""
    match = NATIVE.search(name)
    return bool(match) and match.group("backend") not in keep


def trim_wheel(wheel: Path, keep: set[str]) -> list[str]:
    """Rewrite `wheel` without the native libraries of other backends; returns the names removed.

    The new RECORD lists every file that stays, hashed again from the bytes written (not copied from the
    old RECORD), so a trimmed wheel is consistent even if the old RECORD was not."""
    with zipfile.ZipFile(wheel) as src:
        infos = src.infolist()
        removed = [i.filename for i in infos if dropped(i.filename, keep)]
        if not removed:
            return []
        records = [i for i in infos if i.filename.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise ValueError(f"{wheel.name}: expected one .dist-info/RECORD, found {len(records)}")
        record_name = records[0].filename
        tmp = wheel.with_suffix(".trimmed")
        lines = []
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as dst:
            for info in infos:
                if info.filename in removed or info.filename == record_name:
                    continue
                data = src.read(info)
                dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
                if not info.is_dir():
                    lines.append(f"{info.filename},{record_hash(data)},{len(data)}")
            lines.append(f"{record_name},,")  # RECORD cannot hold its own hash
            dst.writestr(records[0], "\n".join(lines) + "\n", compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(wheel)
    return removed


def listing(folder: Path) -> tuple[list[tuple[str, int]], int]:
    """(name, bytes) of every wheel in `folder`, largest first, and their total."""
    sizes = sorted(((p.name, p.stat().st_size) for p in folder.glob("*.whl")), key=lambda x: (-x[1], x[0]))
    return sizes, sum(size for _, size in sizes)


def duplicates(folder: Path) -> list[str]:
    """Distributions with more than one wheel in `folder`: pip refuses to install two versions at once."""
    seen: dict[str, list[str]] = {}
    for path in folder.glob("*.whl"):
        seen.setdefault(path.name.split("-")[0].lower().replace("_", "-"), []).append(path.name)
    return sorted(name for name, files in seen.items() if len(files) > 1)


def check(folder: Path, limit_mib: float) -> int:
    """Print the list with sizes; 1 if the folder is over `limit_mib` or holds two versions of one package."""
    sizes, total = listing(folder)
    for name, size in sizes:
        print(f"  {size / MiB:8.2f} MiB  {name}")
    print(f"  {total / MiB:8.2f} MiB  total, {len(sizes)} wheels in {folder} (limit {limit_mib:g} MiB)")
    problems = []
    if total > limit_mib * MiB:
        problems.append(f"{total / MiB:.2f} MiB is over the {limit_mib:g} MiB limit (the tree travels with it, "
                        "64 MiB in all)")
    if twice := duplicates(folder):
        problems.append(f"two versions of {', '.join(twice)}: pip would refuse the install")
    if not sizes:
        problems.append("no wheels")
    for problem in problems:
        print(f"wheels: error: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    trim = sub.add_parser("trim", help="keep only the named native backends of a bitsandbytes wheel")
    trim.add_argument("wheel", type=Path)
    trim.add_argument("--keep", action="append", default=[], help="a backend to keep, e.g. cuda130 (repeatable); "
                      "cpu is always kept")
    size = sub.add_parser("check", help="list the wheels with sizes; fail over the limit")
    size.add_argument("folder", type=Path)
    size.add_argument("--limit-mib", type=float, default=40.0)
    args = parser.parse_args(argv)
    if args.command == "trim":
        before = args.wheel.stat().st_size
        removed = trim_wheel(args.wheel, {"cpu", *args.keep})
        print(f"trimmed {args.wheel.name}: {before / MiB:.1f} -> {args.wheel.stat().st_size / MiB:.1f} MiB, "
              f"removed {len(removed)} libraries ({', '.join(Path(r).name for r in removed) or 'none'})")
        return 0
    return check(args.folder, args.limit_mib)


if __name__ == "__main__":
    sys.exit(main())
