"""What llmexp does not trust, in one place: secrets, `_target_` strings, and names that become paths.

* Secrets. Values of keys named like credentials (`api_key`, `hf_token`, `*_password`, ...),
  strings shaped like well-known tokens (`hf_...`, `sk-...`, `ghp_...`, AWS key ids) and the
  values of environment variables named like credentials (`WANDB_API_KEY`, `HF_TOKEN`, `*_TOKEN`,
  `*_KEY`, `*_SECRET`, `*_PASSWORD`) are replaced by `REDACTED` wherever llmexp writes. A secret
  given on the command line never reaches Hydra: `redact_overrides` moves it into a private
  environment variable and leaves `${oc.env:LLMEXP_SECRET_<n>}` in its place, so `.hydra/`,
  Hydra's error messages and wandb's recorded argv only ever see the placeholder.
  `RedactRunFiles` (a Hydra callback, conf/config.yaml) runs when a job starts: it scrubs
  `.hydra/*.yaml` once more, filters the job log (`llmexp.log`), and rewrites the job's
  `hydra.overrides.task` / `hydra.job.override_dirname` so that reading them (summary.json, run
  names) cannot resolve a placeholder back into the secret. Writers of run files call `scrub`.
* `_target_`. Hydra instantiates whatever class a `_target_` names. llmexp only accepts targets
  under `llmexp.build.ALLOWED_TARGETS` in the job config, and only Hydra's and llmexp's own plugin
  classes under `hydra.*`; anything else (`builtins.open`, `os.system`, `subprocess.Popen`,
  `hydra.utils.instantiate`) is a user error (exit 2) before anything is imported or run.
* Paths. Names that end up in paths go through `llmexp.paths.safe_name`; a sweep job's directory
  must lie inside its sweep directory (`check_job_dir`).

Nothing here imports torch.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmexp.errors import UserError

if TYPE_CHECKING:
    from omegaconf import DictConfig

REDACTED = "***"
SECRET_ENV_PREFIX = "LLMEXP_SECRET_"
"""Where `redact_overrides` keeps a command-line secret for the run (and its child processes)."""
MIN_SECRET_LEN = 6
"""Shorter environment values (`1`, `true`) are not scrubbed: they would mangle every number."""

_SECRET_KEY = re.compile(r"(^|[_.-])(token|key|secret|password|passwd|pwd|credentials?|auth)$"
                         r"|secret|password|api_?key|access_?key|private_?key", re.IGNORECASE)
_NOT_SECRET = frozenset({"pad_token", "eos_token", "bos_token", "unk_token", "sep_token", "cls_token",
                         "mask_token", "max_new_tokens", "num_key_value_heads"})
_TOKEN_SHAPES = (r"hf_[A-Za-z0-9]{20,}", r"sk-[A-Za-z0-9_-]{20,}", r"gh[pousr]_[A-Za-z0-9]{20,}",
                 r"github_pat_[A-Za-z0-9_]{20,}", r"xox[abpr]-[A-Za-z0-9-]{10,}", r"AKIA[0-9A-Z]{16}")
_SECRET_VALUE = re.compile(r"(?<![A-Za-z0-9])(" + "|".join(_TOKEN_SHAPES) + r")")
_TARGET_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
HYDRA_ALLOWED_TARGETS: tuple[str, ...] = ("hydra._internal.core_plugins.", "hydra_plugins.", "llmexp.")
"""`_target_` prefixes allowed under `hydra.*` (launchers, sweepers, callbacks). The class that a
target names must also be defined in the module it names (no `pkg.module.os.system` detours)."""


# ---------------------------------------------------------------- secrets


def is_secret_key(key: object) -> bool:
    """Keys named like a credential: *token, *key, *secret*, *password*, api_key, ... (not pad_token,
    num_key_value_heads and other model fields that merely contain the word). Works for env names too."""
    text = str(key)
    return text.lower() not in _NOT_SECRET and bool(_SECRET_KEY.search(text))


def secret_env_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of environment variables named like credentials, longest first (so substrings go last)."""
    env = os.environ if environ is None else environ
    values = {v for k, v in env.items()
              if (is_secret_key(k) or k.startswith(SECRET_ENV_PREFIX)) and len(v) >= MIN_SECRET_LEN}
    return sorted(values, key=len, reverse=True)


def scrub_text(text: str, secrets: Iterable[str] | None = None) -> str:
    """`text` with every known secret value and every token-shaped string replaced by REDACTED."""
    for secret in secret_env_values() if secrets is None else secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return _SECRET_VALUE.sub(REDACTED, text)


def scrub(obj: Any, secrets: Iterable[str] | None = None) -> Any:
    """A copy of plain data (dicts, lists, strings) with secrets redacted: values of secret-named keys,
    env secret values inside any string, and token-shaped strings. Non-string leaves pass through."""
    known = secret_env_values() if secrets is None else list(secrets)
    if isinstance(obj, Mapping):
        return {k: REDACTED if is_secret_key(k) and obj[k] not in (None, "") else scrub(v, known)
                for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [scrub(v, known) for v in obj]
    if isinstance(obj, str):
        return scrub_text(obj, known)
    return obj


def scrub_overrides(overrides: Iterable[str], secrets: Iterable[str] | None = None) -> list[str]:
    """Override strings (`key=value`) with the values of secret-named keys and secret-looking values redacted."""
    known = secret_env_values() if secrets is None else list(secrets)
    out = []
    for item in overrides:
        key, sep, _ = item.partition("=")
        leaf = key.lstrip("+~").split("@")[0].rsplit(".", 1)[-1]
        out.append(f"{key}={REDACTED}" if sep and is_secret_key(leaf) else scrub_text(item, known))
    return out


def redact_overrides(args: list[str], environ: dict[str, str] | None = None) -> list[str]:
    """Command-line arguments with secret override values moved into `LLMEXP_SECRET_<n>` env variables.

    `+logger.api_key=abc` becomes `+logger.api_key=${oc.env:LLMEXP_SECRET_0}`: the config still
    resolves to `abc`, but Hydra's saved files, run names and wandb's recorded argv hold the
    placeholder. Child processes (sweep jobs) inherit the variable.
    """
    env = os.environ if environ is None else environ
    known = secret_env_values(env)
    out, count = [], 0
    for arg in args:
        key, sep, value = arg.partition("=")
        if arg.startswith("-") or not sep or value.startswith("${"):
            out.append(arg)
            continue
        leaf = key.lstrip("+~").split("@")[0].rsplit(".", 1)[-1]
        unquoted = value[1:-1] if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"" else value
        if is_secret_key(leaf) or _SECRET_VALUE.search(value) or unquoted in known:
            name = f"{SECRET_ENV_PREFIX}{count}"
            env[name], count = unquoted, count + 1
            arg = f"{key}=${{oc.env:{name}}}"
        out.append(arg)
    return out


class _ScrubFilter(logging.Filter):
    """Rewrites each log record's message with secrets redacted (installed on the job log's handlers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = scrub_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


def install_log_filter(logger: logging.Logger | None = None) -> None:
    """Scrub every record that reaches the root logger's handlers (the job's `llmexp.log`, the console)."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, _ScrubFilter) for f in handler.filters):
            handler.addFilter(_ScrubFilter())


def scrub_yaml_file(path: Path) -> bool:
    """Rewrite a YAML file (Hydra's config.yaml, hydra.yaml, overrides.yaml) with secrets redacted.

    Interpolations stay as written. Returns True when something was redacted. Atomic: readers see
    the old file or the new one.
    """
    from omegaconf import OmegaConf

    if not path.is_file():
        return False
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    clean = scrub_overrides(data) if isinstance(data, list) and all(isinstance(x, str) for x in data) else scrub(data)
    if clean == data:
        return False
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.create(clean)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return True


try:  # the callback base class; Hydra is always installed, but keep this module importable without it
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover
    _HydraCallback = object  # type: ignore[assignment,misc]


class RedactRunFiles(_HydraCallback):  # type: ignore[misc,valid-type]
    """Hydra callback (conf/config.yaml `hydra.callbacks`): when a job starts, after Hydra wrote
    `.hydra/`, redact secrets there and filter the job log (`llmexp.log`) from then on."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        install_log_filter()
        _sanitize_hydra_overrides()
        subdir = config.hydra.output_subdir
        if subdir is None:
            return
        hydra_dir = Path(config.hydra.runtime.output_dir) / str(subdir)
        for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
            scrub_yaml_file(hydra_dir / name)


def _sanitize_hydra_overrides() -> None:
    """Make `HydraConfig.get().overrides.task` and `job.override_dirname` safe to read and write out.

    They hold the overrides as typed, so reading them resolves `${oc.env:LLMEXP_SECRET_0}` (or any
    `${oc.env:HF_TOKEN}` a user typed) to the secret itself, e.g. into summary.json or a run name.
    Secret-named values become REDACTED and other interpolations are escaped so they read as typed.
    """
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, read_write

    hydra_cfg = HydraConfig.instance().cfg.hydra  # type: ignore[union-attr]
    typed = OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)
    clean = [item.replace("${", "\\${") for item in scrub_overrides(typed)]  # type: ignore[arg-type]
    settings = hydra_cfg.job.config.override_dirname
    excluded = set(OmegaConf.to_container(settings.exclude_keys, resolve=False))  # type: ignore[arg-type]
    kept = sorted(item for item in clean if item.partition("=")[0].lstrip("+~") not in excluded)
    with read_write(hydra_cfg):
        hydra_cfg.overrides.task = clean
        hydra_cfg.job.override_dirname = settings.item_sep.join(kept).replace("=", settings.kv_sep)


# ---------------------------------------------------------------- _target_


def target_problem(target: object, allowed: tuple[str, ...]) -> str | None:
    """Why `target` may not be instantiated, or None. Purely syntactic: nothing is imported.

    A target must be a dotted name of identifiers (no dunders such as `__builtins__`) under one of
    the `allowed` prefixes; interpolations and other strings are refused.
    """
    if not isinstance(target, str) or not _TARGET_NAME.fullmatch(target) or "__" in target:
        return f"{target!r} is not a dotted class name (module.Class, no dunders)"
    if not target.startswith(allowed):
        return f"{target!r} is not under an allowed prefix ({', '.join(allowed)})"
    return None


def find_keys(node: Any, names: tuple[str, ...] = ("_target_",), path: str = "") -> list[tuple[str, Any]]:
    """Every (`key.path.<name>`, value) in plain nested data whose last key is one of `names`."""
    found: list[tuple[str, Any]] = []
    items = node.items() if isinstance(node, Mapping) else enumerate(node) if isinstance(node, list) else []
    for key, value in items:
        key_path = f"{path}.{key}" if path else str(key)
        if key in names:
            found.append((key_path, value))
        else:
            found.extend(find_keys(value, names, key_path))
    return found


def find_targets(node: Any) -> list[tuple[str, Any]]:
    """Every (`key.path._target_`, value) in plain nested data."""
    return find_keys(node, ("_target_",))


def logging_class_problem(key: str, value: object) -> str | None:
    """Python's logging.config builds whatever a handler's `class` or `()` names, with the node's other keys
    as arguments (`subprocess.Popen` with `args`): only `logging.*` classes pass."""
    if key.rsplit(".", 1)[-1] == "()":
        return f"{key}: logging factories ('()') are not allowed; use class: logging.<Handler>"
    if not isinstance(value, str) or not value.startswith("logging.") or "__" in value:
        return f"{key}: {value!r} is not a logging.* class; use e.g. logging.FileHandler"
    return None


def target_errors(cfg: DictConfig | Mapping[str, Any]) -> list[str]:
    """Every `_target_` anywhere in a composed job config that llmexp would refuse, as error lines."""
    from omegaconf import DictConfig, OmegaConf

    from llmexp.build import ALLOWED_TARGETS

    data = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg
    errors = []
    for key, value in find_targets(data):
        problem = target_problem(value, ALLOWED_TARGETS)
        if problem is None and key != "optimizer._target_":
            problem = "llmexp instantiates only optimizer._target_; remove this key"
        if problem:
            errors.append(f"{key}: {problem}. Pick a class with its config group (e.g. optimizer=adamw); "
                          "a config is data, llmexp never runs code named in it")
    return errors


def hydra_target_problem(key: str, target: str) -> str | None:
    """Resolve a `hydra.*` target as Hydra would (it follows attributes through a module's imports, so
    `llmexp.launcher.subprocess.Popen` is `subprocess.Popen`) and check where it is really defined."""
    from hydra._internal.utils import _locate
    from hydra.experimental.callback import Callback
    from hydra.plugins.launcher import Launcher
    from hydra.plugins.sweeper import Sweeper

    try:  # a class of one of the kinds Hydra instantiates, not any callable (llmexp.paths.write_json_atomic)
        check_located(_locate(target), target, key, HYDRA_ALLOWED_TARGETS, base=(Callback, Launcher, Sweeper))
    except UserError as err:
        return str(err)
    except Exception as err:  # not importable: Hydra would fail on it too
        return f"{key}: cannot import {target!r} ({err})"
    return None


def check_located(obj: Any, target: str, key: str, allowed: tuple[str, ...],
                  base: type | tuple[type, ...] | None = None) -> None:
    """After import: the object must be defined under an allowed prefix (so `torch.optim.X.os.system`
    style detours through a module's own imports fail) and, with `base`, be a subclass of it."""
    defined_as = f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', None)}"
    if not defined_as.startswith(allowed):
        raise UserError(f"{key}: {target!r} resolves to {defined_as!r}, which is not under an allowed prefix "
                        f"({', '.join(allowed)}); pick a class with its config group (e.g. optimizer=adamw)")
    bases = base if isinstance(base, tuple) else (base,) if base is not None else ()
    if bases and not (isinstance(obj, type) and issubclass(obj, bases)):
        names = " or ".join(f"{b.__module__}.{b.__qualname__}" for b in bases)
        raise UserError(f"{key}: {target!r} is not a subclass of {names}; "
                        "pick a class with its config group (e.g. optimizer=adamw)")


def _user_config_dirs(args: list[str], flags: tuple[str, ...]) -> list[Path]:
    """Directories of YAML the user adds: --config-dir/-cd, --config-path/-cp, hydra.searchpath file://..."""
    dirs = []
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in flags:
            dirs.append(value if eq else (args[i + 1] if i + 1 < len(args) else ""))
        elif "hydra.searchpath" in flag:
            dirs += re.findall(r"file://([^,\]\s'\"]+)", value)
    return [Path(d).expanduser() for d in dirs if d and Path(d).expanduser().is_dir()]


def user_yaml_errors(args: list[str], flags: tuple[str, ...]) -> list[str]:
    """`_target_`s in YAML the user adds, checked before Hydra reads it: Hydra itself instantiates the
    `hydra:` section's callbacks and launchers before llmexp's own checks could run."""
    from omegaconf import OmegaConf

    from llmexp.build import ALLOWED_TARGETS

    allowed, errors = ALLOWED_TARGETS + HYDRA_ALLOWED_TARGETS, []
    for directory in _user_config_dirs(args, flags):
        for path in sorted(directory.rglob("*.yaml")):
            try:
                data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            except Exception:  # Hydra reports unreadable YAML itself, naming the file and line
                continue
            for key, value in find_targets(data):
                problem = target_problem(value, allowed)
                if problem is None and key.startswith("hydra."):
                    problem = hydra_target_problem(key, str(value))
                if problem:
                    errors.append(f"{path}: {problem if problem.startswith(key) else f'{key}: {problem}'}")
            logging_file = "logging" in str(path.relative_to(directory))
            for key, value in find_keys(data, ("()", "class")):
                if (key.endswith("()") or logging_file or "logging" in key) and (
                        problem := logging_class_problem(key, value)):
                    errors.append(f"{path}: {problem}")
    return errors


# ---------------------------------------------------------------- paths


def path_problem(value: str, allow_absolute: bool = False) -> str | None:
    """Why a config value used as a path component or relative path could escape its parent, or None."""
    if "\x00" in value:
        return "contains a NUL byte"
    if not allow_absolute and (value.startswith(("/", "~")) or re.match(r"^[A-Za-z]:[\\/]", value)):
        return "is an absolute path"
    if ".." in re.split(r"[\\/]", value):
        return "contains a '..' component"
    return None


def check_job_dir(output_dir: str | Path, sweep_dir: str | Path) -> None:
    """A sweep job's directory must be inside the sweep directory (subdir names come from override values)."""
    job, root = Path(output_dir).resolve(), Path(sweep_dir).resolve()
    if job != root and root not in job.parents:
        raise UserError(f"hydra.sweep.subdir puts this job in {job}, outside the sweep directory {root}; "
                        "build subdirs from safe names, e.g. "
                        "hydra.sweep.subdir='${llmexp_safe:${hydra.job.override_dirname}}'")


def check_hydra_job_dir() -> None:
    """In a sweep, refuse a job whose directory lies outside the sweep directory (no-op outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        check_job_dir(hydra_cfg.runtime.output_dir, hydra_cfg.sweep.dir)
