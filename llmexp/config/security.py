"""What llmexp does not trust in a config: `_target_` strings, logging configs, and names that become paths.

`check_config` runs on every config a command runs, `hydra` node included, interpolations resolved, before Hydra
instantiates or creates anything; docs/explanation/security-model.md says what passes and where it is called.
Secrets: `llmexp.rundir.redact`; names that end up in paths: `llmexp.rundir.names.safe_name`. No torch here.
"""

from __future__ import annotations

import copy
import importlib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from llmexp.config.rules import SECRET_IN_NAME, holds_secret
from llmexp.errors import UserError, first_line

_TARGET_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")


# ---------------------------------------------------------------- _target_ and logging classes

OPTIMIZER_TARGETS: tuple[str, ...] = (
    *(f"torch.optim.{name}" for name in ("AdamW", "Adam", "SGD", "Adagrad", "Adadelta", "Adamax", "Adafactor",
                                         "NAdam", "RAdam", "RMSprop", "Rprop", "ASGD")),
    *(f"bitsandbytes.optim.{name}" for name in ("AdamW8bit", "PagedAdamW8bit", "AdamW", "PagedAdamW", "Adam8bit",
                                                "PagedAdam8bit", "Lion", "Lion8bit", "PagedLion", "PagedLion8bit",
                                                "SGD8bit", "RMSprop8bit", "Adagrad8bit")),
)
"""The only objects `optimizer._target_` may name (llmexp.model.build instantiates it, and checks the imported class
against these objects by identity)."""
CALLBACK_TARGETS: tuple[str, ...] = ("llmexp.rundir.redact.RedactRunFiles",
                                     "hydra.experimental.callbacks.LogJobReturnCallback")
LAUNCHER_TARGETS: tuple[str, ...] = ("hydra_plugins.llmexp_launcher.llmexp_launcher.LocalLauncher",
                                     "hydra_plugins.llmexp_launcher.llmexp_launcher.SlurmLauncher",
                                     "hydra._internal.core_plugins.basic_launcher.BasicLauncher")
SWEEPER_TARGETS: tuple[str, ...] = ("hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                                     "hydra_plugins.llmexp_sweeper.llmexp_sweeper.GridSweeper",
                                     "hydra_plugins.llmexp_sweeper.llmexp_sweeper.SearchSweeper")
LOGGING_CLASSES: tuple[str, ...] = ("logging.StreamHandler", "logging.FileHandler", "logging.NullHandler",
                                    "logging.handlers.RotatingFileHandler", "logging.handlers.TimedRotatingFileHandler",
                                    "logging.handlers.WatchedFileHandler", "logging.Formatter")
"""The classes a `class:` in `hydra.job_logging` / `hydra.hydra_logging` may name (Python's logging.config
builds whatever a `class` or `()` names, with the node's other keys as arguments)."""
LOGGING_STREAMS: tuple[str, ...] = ("ext://sys.stdout", "ext://sys.stderr")
ENV_SET_ALLOWED: tuple[str, ...] = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TOKENIZERS_PARALLELISM", "CUDA_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING", "NCCL_DEBUG", "TORCH_DISTRIBUTED_DEBUG", "PYTHONHASHSEED", "WANDB_MODE", "WANDB_PROJECT",
    "WANDB_ENTITY", "WANDB_RUN_GROUP", "WANDB_TAGS", "WANDB_NOTES", "WANDB_SILENT", "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "LLMEXP_ASSUME_NO_BF16", "LLMEXP_BF16_EMULATION", "LLMEXP_NO_BAR")
"""Variables `hydra.job.env_set` may set. Not PATH, CC, CXX, LD_PRELOAD, PYTHONPATH, TORCH_EXTENSIONS_DIR or
anything else a build step or the interpreter executes or loads code from: an allow-list, not a block-list."""
HYDRA_ALLOWED_TARGETS: tuple[str, ...] = ("hydra._internal.core_plugins.", "hydra_plugins.", "llmexp.")
"""Packages whose modules the check may import to resolve a `hydra.*` target (nothing else is imported)."""


def allowed_targets(key: str) -> tuple[str, ...]:
    """The objects a `_target_` at `key` may name; () where llmexp and Hydra instantiate nothing."""
    if re.fullmatch(r"hydra\.callbacks\.[^.]+\._target_", key):
        return CALLBACK_TARGETS
    return {"optimizer._target_": OPTIMIZER_TARGETS, "hydra.launcher._target_": LAUNCHER_TARGETS,
            "hydra.sweeper._target_": SWEEPER_TARGETS}.get(key, ())


def _identity_problem(obj: object, target: str, key: str) -> str | None:
    """Why the object `target` resolved to is none of the objects allowed at `key`, or None: compared by identity,
    so no attribute walk through a module's own imports (`llmexp.sweep.local.subprocess.Popen`) can pass."""
    allowed = allowed_targets(key)
    if any(getattr(importlib.import_module(n.rpartition(".")[0]), n.rpartition(".")[2], None) is obj for n in allowed):
        return None
    defined_as = f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', None)}"
    return f"{target!r} resolves to {defined_as!r}, which is not one of the allowed classes"


def target_problem(target: object) -> str | None:
    """Why `target` is no dotted class name (module.Class, no dunders such as `__builtins__`), or None; syntactic."""
    if not isinstance(target, str) or not _TARGET_NAME.fullmatch(target) or "__" in target:
        return f"{target!r} is not a dotted class name (module.Class, no dunders)"
    return None


def find_values(node: Any, path: str = "",
                pick: Callable[[Any, Any], bool] = lambda key, value: key == "_target_") -> list[tuple[str, Any]]:
    """Every (`key.path`, value) in plain nested data whose key and value `pick` takes (default: every `_target_`);
    what it takes is not walked into."""
    found: list[tuple[str, Any]] = []
    items = node.items() if isinstance(node, Mapping) else enumerate(node) if isinstance(node, list) else []
    for key, value in items:
        key_path = f"{path}.{key}" if path else str(key)
        found.extend([(key_path, value)] if pick(key, value) else find_values(value, key_path, pick))
    return found


def target_errors(data: Mapping[str, Any]) -> list[str]:
    """Every `_target_` in a job config's plain data (`hydra` node skipped) that llmexp would refuse, as error lines
    (syntactic: `validate` runs this on any config; the CLI's `check_config` has resolved and checked them before)."""
    return [f"{key}: {problem}" for key, value in find_values(data)
            if not key.startswith("hydra.") and (problem := _job_target_problem(key, value))]


def _job_target_problem(key: str, value: object) -> str | None:
    allowed = allowed_targets(key)
    if problem := target_problem(value):
        return f"{problem}; pick a class with its config group (e.g. optimizer=adamw)"
    if not allowed:
        return (f"{value!r} is not allowed here: llmexp instantiates _target_ only at optimizer._target_ (and Hydra at "
                "hydra.callbacks.<name>, "
                "hydra.launcher, hydra.sweeper); remove this key. A config is data, llmexp never runs code named in it")
    if value not in allowed:
        return (f"{value!r} is not one of the allowed optimizer classes (torch.optim's and bitsandbytes.optim's "
                "optimizers, listed in llmexp.config.security.OPTIMIZER_TARGETS); pick one with its config group, "
                "e.g. optimizer=adamw")
    return None


def _hydra_target_problem(key: str, value: object) -> str | None:
    """Resolve a `hydra.*` target as Hydra will (`_locate` follows attributes through a module's own imports)
    and compare the object itself with the allowed ones. Only modules of llmexp and Hydra are imported."""
    from hydra.utils import get_object  # what hydra.utils.instantiate uses to find a target

    allowed = allowed_targets(key)
    if problem := target_problem(value):
        return problem
    if not allowed:
        return f"{value!r}: Hydra instantiates nothing at this key; remove it"
    names = ", ".join(allowed)
    if not str(value).startswith(HYDRA_ALLOWED_TARGETS):
        return f"{value!r} is not one of the allowed classes here ({names})"
    try:
        obj = get_object(str(value))
    except Exception as err:  # not importable: refused, whatever the reason
        return f"cannot import {value!r} ({err}); allowed here: {names}"
    problem = _identity_problem(obj, str(value), key)
    return problem and f"{problem} here ({names})"


def import_target(key: str, target: Any, base: type | None = None) -> Any:
    """The class `target` names at `key`, imported only once the name is one allowed there, then `check_located`."""
    if problem := _job_target_problem(key, target):
        raise UserError(f"{key}: {problem}")
    module_name, _, attr = target.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise UserError(f"{key}: cannot import {target!r} ({err}); is its package installed?") from err
    check_located(obj, target, key, base)
    return obj


def check_located(obj: Any, target: str, key: str, base: type | None = None) -> None:
    """After import: the object `target` resolved to must be one of the objects allowed at `key` (by identity:
    `_identity_problem`) and, with `base`, a subclass of it."""
    fix = "pick a class with its config group (e.g. optimizer=adamw)"
    if problem := _identity_problem(obj, target, key):
        raise UserError(f"{key}: {problem}; {fix}")
    if base is not None and not (isinstance(obj, type) and issubclass(obj, base)):
        raise UserError(f"{key}: {target!r} is not a subclass of {base.__module__}.{base.__qualname__}; {fix}")


def _logging_problems(node: Any, key: str, base_dir: str, relative_to: str) -> list[tuple[str, str]]:
    """A resolved `hydra.job_logging` / `hydra.hydra_logging` tree; files only inside `base_dir` (relative names
    taken from `relative_to`, the directory the job runs in)."""
    problems: list[tuple[str, str]] = []
    items = node.items() if isinstance(node, Mapping) else enumerate(node) if isinstance(node, list) else []
    for name, value in items:
        where = f"{key}.{name}"
        if name in ("()", "."):
            problems.append((where, "logging factories ('()') and attribute setters ('.') are not allowed; "
                                    "use class: logging.<Handler>"))
        elif name == "class":  # (logging.config imports exactly the name it is given)
            if value not in LOGGING_CLASSES:
                allowed = ", ".join(LOGGING_CLASSES)
                problems.append((where, f"{value!r} is not one of logging's own classes ({allowed})"))
        elif isinstance(value, str) and value.startswith(("ext://", "cfg://")) and value not in LOGGING_STREAMS:
            problems.append((where, f"{value!r}: only {' and '.join(LOGGING_STREAMS)} may be referenced"))
        elif name == "filename" and isinstance(value, str):
            if problem := outside_problem(value, base_dir, relative_to):
                problems.append((where, problem))
        else:
            problems.extend(_logging_problems(value, where, base_dir, relative_to))
    return problems


# ---------------------------------------------------------------- paths


def path_problem(value: str) -> str | None:
    """Why a config value used as a path component or relative path could escape its parent, or None."""
    if "\x00" in value:
        return "contains a NUL byte"
    if value.startswith(("/", "~")) or re.match(r"^[A-Za-z]:[\\/]", value):
        return "is an absolute path"
    if ".." in re.split(r"[\\/]", value):
        return "contains a '..' component"
    return None


def outside_problem(path: str, base_dir: str | Path, relative_to: str | Path | None = None) -> str | None:
    """Why `path` (relative ones taken from `relative_to`, default `base_dir`) is not inside `base_dir`, or None.
    Symlinks are followed as far as they exist, so a link inside the directory cannot lead out."""
    if "\x00" in path:
        return "contains a NUL byte"
    root = os.path.realpath(base_dir)
    target = os.path.realpath(os.path.join(relative_to if relative_to is not None else base_dir, path))
    if target != root and not target.startswith(root.rstrip(os.sep) + os.sep):
        return f"{path!r} lies outside {root}; keep names below the run or sweep directory plain and relative"
    return None


# ---------------------------------------------------------------- the composed config


def config_problems(cfg: DictConfig) -> list[tuple[str, str]]:
    """Every (key, problem) of a config composed by Hydra (its `hydra` node included) that llmexp refuses.
    `cfg` is not changed (a copy is resolved), except that resolving `hydra.run.dir` /
    `hydra.sweep.dir` caches their values (their `${llmexp_run_id:}`) in it, so Hydra later uses exactly the
    directories checked here."""
    from hydra.types import RunMode

    problems: list[tuple[str, str]] = []
    dirs = {key: _resolve(cfg, key, problems) for key in ("hydra.run.dir", "hydra.sweep.dir")}
    if None in dirs.values():
        return problems
    problems += [(key, "contains a NUL byte") for key, value in dirs.items() if "\x00" in str(value)]
    if problems:
        return problems
    run_dir, sweep_dir = (os.path.realpath(str(value)) for value in dirs.values())
    probe = copy.deepcopy(cfg)
    multirun = probe.hydra.mode == RunMode.MULTIRUN
    with read_write(probe.hydra), open_dict(probe.hydra):
        if OmegaConf.is_missing(probe.hydra.job, "num"):
            probe.hydra.job.num = 0
        job_dir = run_dir
        if multirun:
            subdir = _resolve(probe, "hydra.sweep.subdir", problems)
            if subdir is None:
                return problems
            job_dir = os.path.realpath(os.path.join(sweep_dir, str(subdir)))
            if holds_secret(str(subdir)):  # it names the job's directory, and with it every record of the job
                problems.append(("hydra.sweep.subdir", SECRET_IN_NAME))
            elif outside_problem(job_dir, sweep_dir):
                problems.append(("hydra.sweep.subdir", f"puts a job in {job_dir}, outside the sweep directory "
                                 f"{sweep_dir}; build subdirs from safe names, e.g. "
                                 "hydra.sweep.subdir='${llmexp_safe:${hydra.job.override_dirname}}'"))
        probe.hydra.runtime.output_dir = job_dir
    hydra = _resolve_tree(probe.hydra, "hydra", problems)
    problems += [(key, p) for key, value in find_values({"hydra": hydra}) if (p := _hydra_target_problem(key, value))]
    problems += _job_target_problems(probe)
    relative_to = job_dir if (hydra.get("job") or {}).get("chdir") else os.getcwd()
    for node, base in (("job_logging", job_dir), ("hydra_logging", sweep_dir if multirun else run_dir)):
        problems += _logging_problems(hydra.get(node) or {}, f"hydra.{node}", base, relative_to)
    problems += _derived_path_problems(hydra, job_dir)
    problems += _env_set_problems(hydra.get("job") or {})
    folder = (hydra.get("launcher") or {}).get("submitit_folder") if multirun else None
    if folder and (problem := outside_problem(str(folder), sweep_dir, os.getcwd())):
        problems.append(("hydra.launcher.submitit_folder", problem))
    return problems


def _resolve(cfg: DictConfig, key: str, problems: list[tuple[str, str]]) -> Any:
    """The value at `key` with interpolations resolved; None (and a problem) when they cannot be."""
    try:
        value = OmegaConf.select(cfg, key, throw_on_missing=False)
        if OmegaConf.is_config(value):
            OmegaConf.to_container(value, resolve=True)
        return value
    except OmegaConfBaseException as err:
        problems.append((str(getattr(err, "full_key", None) or key), unresolved(err)))
        return None


def unresolved(err: Exception) -> str:
    reason = first_line(getattr(err, "msg", err), None)
    return (f"cannot resolve an interpolation ({reason}); fix the ${{...}} reference or set the environment "
            "variable it reads")


_TEXT_ONLY = ("hydra.overrides", "hydra.job.override_dirname", "hydra.runtime")
"""Hydra nodes that hold the command line as typed (and Hydra's own runtime facts): text, never resolved by
Hydra for a path or a class, so they are read as written (resolving them would resolve a secret's placeholder)."""


def _resolve_tree(node: Any, key: str, problems: list[tuple[str, str]]) -> Any:
    """Plain data of a config node, every interpolation resolved (except `_TEXT_ONLY`); a value that does not
    resolve is None, with a problem naming its key. `???` (unset) is None."""
    if not isinstance(node, DictConfig | ListConfig) or node._is_none() or node._is_missing():
        return None if OmegaConf.is_config(node) else node
    out: dict[Any, Any] = {}
    for child in (node.keys() if isinstance(node, DictConfig) else range(len(node))):
        where = f"{key}.{child}"
        if where in _TEXT_ONLY:
            raw = node._get_node(child)
            out[child] = OmegaConf.to_container(raw, resolve=False) if OmegaConf.is_config(raw) else raw._value()
            continue
        try:
            value = node[child]
        except MissingMandatoryValue:
            value = None
        except OmegaConfBaseException as err:
            problems.append((where, unresolved(err)))
            value = None
        out[child] = _resolve_tree(value, where, problems)
    return out if isinstance(node, DictConfig) else list(out.values())


def _job_target_problems(cfg: DictConfig) -> list[tuple[str, str]]:
    """`_target_`s outside `hydra`: resolved where they resolve (interpolations that do not are refused by the
    dotted-name rule, and `validate` names the failing reference)."""
    problems = []
    for key in [k for k in cfg if k != "hydra"]:
        node = cfg._get_node(key)  # type: ignore[union-attr]
        if not OmegaConf.is_config(node) or node._is_missing() or node._is_none():  # (validate reports ???)
            continue
        try:
            data = OmegaConf.to_container(node, resolve=True)
        except OmegaConfBaseException:
            data = OmegaConf.to_container(node, resolve=False)
        problems += [(k, p) for k, v in find_values({key: data}) if (p := _job_target_problem(k, v))]
    return problems


def _env_set_problems(job: dict[str, Any]) -> list[tuple[str, str]]:
    """`hydra.job.env_set` sets only ENV_SET_ALLOWED; a variable `hydra.job.env_copy` copied from this
    environment unchanged (Hydra puts it in env_set) changes nothing and passes."""
    copied = set(job.get("env_copy") or [])
    return [(f"hydra.job.env_set.{name}", f"setting {name} is not allowed (a build step or the interpreter may "
             f"execute or load code through it); allowed: {', '.join(ENV_SET_ALLOWED)}")
            for name, value in (job.get("env_set") or {}).items()
            if name not in ENV_SET_ALLOWED and not (name in copied and value == os.environ.get(name))]


def _derived_path_problems(hydra: dict[str, Any], job_dir: str) -> list[tuple[str, str]]:
    """Names Hydra places below the job's directory: `.hydra` (output_subdir) and the job name (its log file)."""
    problems = []
    subdir = hydra.get("output_subdir")
    if subdir is not None and (problem := path_problem(str(subdir)) or outside_problem(str(subdir), job_dir)):
        problems.append(("hydra.output_subdir", f"{subdir!r} {problem}" if problem[0] != "'" else problem))
    name = str((hydra.get("job") or {}).get("name"))
    if holds_secret(name):  # it names the job's log file
        problems.append(("hydra.job.name", SECRET_IN_NAME))
    elif problem := path_problem(name) or outside_problem(f"{name}.log", job_dir):
        problems.append(("hydra.job.name", f"{name!r} {problem}" if problem[0] != "'" else problem))
    return problems


def check_config(cfg: DictConfig, origin: Any = None) -> None:
    """Raise one UserError naming, for each problem of `config_problems`, the key and where it came from
    (`origin(key)`: a YAML file or "command line")."""
    if not (problems := config_problems(cfg)):
        return
    lines = [f"{origin(key) if origin else 'config'}: {key}: {problem}" for key, problem in problems]
    raise UserError("refused config (llmexp runs no code named in a config and writes only inside the run or "
                    "sweep directory; README, Security):\n  " + "\n  ".join(lines))


_COMMIT = re.compile(r"[0-9a-f]{40}")


def remote_code_errors(m: Any) -> list[str]:
    """Remote code runs only when asked for, and then only at a pinned commit of a hub model. Names starting with
    `/`, `.` or `~` are local directories, the user's own files, which a revision cannot pin."""
    if not m.trust_remote_code:
        return []
    name = str(m.name_or_path or "")
    if not name:
        return ["model.trust_remote_code=true: there is no model.name_or_path whose code could run; remove it"]
    if name.startswith(("/", ".", "~")) or _COMMIT.fullmatch(str(m.revision or "")):
        return []
    return [f"model.revision={m.revision}: model.trust_remote_code=true runs code from the hub, so pin "
            f"{name} to a full 40-character commit hash (a branch or tag can change under you), "
            "e.g. from the model page's Files and versions > History"]
