"""Catch a user's mistake before anything loads, and say which key is wrong and how to fix it.

Three passes, none of which imports torch:

* `check_args(argv)` runs in the CLI before Hydra composes, so a typo never creates a run
  directory: unknown keys (with a did-you-mean), unknown group options, wrong types, group
  options that are paths. It returns the arguments with secret values moved out of sight
  (`redact.redact_overrides`).
* `ConfigCheck` wraps Hydra's config loader: every config Hydra composes (the run's, each sweep
  job's, `--help`'s and `--cfg`'s) goes through `security.check_config` before Hydra uses it, and the
  CLI's own composition is handed to Hydra instead of composing again.
* `structure_errors(cfg)` and `remote_code_errors(cfg.model)` run inside `validation.validate` on
  the composed config: `???` left unset, interpolations that do not resolve, keys added with `+`
  that no schema knows, NUL bytes, disallowed `_target_`s, remote code without a pinned commit.
* `check_environment(cfg)` runs after `validate` (in the CLI before Hydra runs, and again in
  `train.task.run_guarded` for sweep jobs), before anything loads: what depends on this machine
  and launch: the world size, files that must exist. (bf16 runs on every CPU, emulated where it is
  not native; only a GPU on which torch cannot compute in bf16 is refused, at set-up.)
  `validate` stays a pure function of the config, so a config validates on any machine.

Environment: `LLMEXP_ASSUME_NO_BF16=1` makes llmexp treat this CPU as one without native bf16
(for tests that simulate older hardware).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import glob
import io
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

from llmexp import redact
from llmexp.config import security
from llmexp.config.derived import world_size_from_env
from llmexp.errors import UserError

_COMMIT = re.compile(r"[0-9a-f]{40}")


# ---------------------------------------------------------------- the schema


def _unwrap(tp: Any) -> Any:
    """`X | None` -> X."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else Any
    return tp


def _fields(cls: Any) -> dict[str, Any] | None:
    """A schema node's fields and their types, or None below a free-form node (dict, list, Any)."""
    return {k: _unwrap(v) for k, v in typing.get_type_hints(cls).items()} if dataclasses.is_dataclass(cls) else None


def all_keys(cls: Any = None, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (`train.max_steps`, ...)."""
    from llmexp.config.schema import Config

    fields = _fields(Config if cls is None else cls) or {}
    keys = []
    for name, tp in fields.items():
        keys.append(prefix + name)
        if dataclasses.is_dataclass(tp):
            keys.extend(all_keys(tp, f"{prefix}{name}."))
    return keys


def unknown_key(key: str) -> str | None:
    """None if the schema knows `key` (or it lies under a free-form dict); else a message with a suggestion."""
    from llmexp.config.schema import Config

    node: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = _fields(node)
        if fields is None:
            return None
        if part not in fields:
            return f"{key}: no such key; {_suggest(parts, i, fields)}"
        node = fields[part]
    return None


def _leaf(key: str) -> tuple[Any, Any] | None:
    """(type, default) of a schema leaf (`train.max_steps` -> (int, 300)); None for nodes and unknown keys."""
    from llmexp.config.schema import Config

    *parents, name = key.split(".")
    node: Any = Config
    for part in parents:
        node = (_fields(node) or {}).get(part)
    if not dataclasses.is_dataclass(node):
        return None
    field = {f.name: f for f in dataclasses.fields(node)}.get(name)
    if field is None or field.default is dataclasses.MISSING:
        return None
    return (_fields(node) or {})[name], field.default


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false"}


def _type_problem(key: str, value: Any) -> str | None:
    """A value of the wrong type for an int, float or bool field (Hydra would say it less plainly)."""
    leaf = _leaf(key)
    if leaf is None or value is None or leaf[0] not in _TYPE_WORDS:
        return None
    from omegaconf import nodes
    from omegaconf.errors import ValidationError

    tp, default = leaf
    node_class = {int: nodes.IntegerNode, float: nodes.FloatNode, bool: nodes.BooleanNode}[tp]
    try:
        node_class(value)  # exactly what OmegaConf will accept at compose time
        return None
    except ValidationError:
        pass
    example = str(default).lower() if isinstance(default, bool) else default
    return f"{key}={value}: must be {_TYPE_WORDS[tp]}, e.g. {key}={example}"


def _suggest(parts: list[str], i: int, fields: dict[str, Any]) -> str:
    prefix = ".".join(parts[:i])
    close = difflib.get_close_matches(parts[i], list(fields), n=1, cutoff=0.6)
    if close:
        return f"did you mean {prefix + '.' if prefix else ''}{close[0]}?"
    elsewhere = [k for k in all_keys() if k.rsplit(".", 1)[-1] == parts[i]]
    if elsewhere:
        return f"did you mean {elsewhere[0]}?"
    return f"{prefix or 'the top level'} has {', '.join(fields)} (python -m llmexp --cfg job shows every key)"


def group_options(group: str) -> list[str] | None:
    """The options of a config group (`llmexp/conf/<group>/*.yaml`), or None if `group` is not a group."""
    from llmexp.paths import conf_dir

    directory = conf_dir() / group
    return sorted(p.stem for p in directory.glob("*.yaml")) if directory.is_dir() else None


# ---------------------------------------------------------------- the command line


def _parse_overrides(args: list[str]) -> tuple[Any, list[Any]]:
    """Hydra's own parse of the command line (its flags, then each override); anything it cannot parse is left
    to Hydra. Returns (argparse namespace or None, parsed overrides)."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            namespace, _ = get_args_parser().parse_known_args(args)
    except SystemExit:
        return None, []
    parser, parsed = OverridesParser.create(), []
    for text in namespace.overrides or []:
        with contextlib.suppress(Exception):  # Hydra reports grammar errors itself, with the position
            parsed.extend(parser.parse_overrides([text]))
    return namespace, parsed


def _values(override: Any) -> list[Any]:
    if override.is_sweep_override():
        with contextlib.suppress(Exception):
            return list(override.sweep_string_iterator())
        return []
    return [override.value()]


def _override_errors(ov: Any, custom_tree: bool) -> list[str]:
    """Problems of one parsed override (see `check_args`)."""
    key, values = ov.key_or_group, _values(ov)
    if ov.is_delete():
        return []
    if key == "_target_" or key.endswith("._target_") or key.startswith("hydra."):
        return []  # judged on the composed config, after interpolation (`security.config_problems`)
    if "/" in key or key.startswith("hydra.") or ov.package:
        return []
    options = group_options(key)
    if options is not None and not (ov.is_add() or ov.is_force_add()):
        return [e for e in (_option_error(key, v, options, custom_tree) for v in values if v is not None) if e]
    problem = unknown_key(key)
    if problem and (ov.is_add() or ov.is_force_add()):
        problem += " (`+` adds keys to free-form dicts only, e.g. +optimizer.kwargs.foo=1)"
    if problem is None and not ov.is_sweep_override():
        problem = _type_problem(key, ov.value())
    return [problem] if problem else []


def _option_error(group: str, value: Any, options: list[str], custom_tree: bool) -> str:
    """"" if `value` is fine, else the message."""
    text = str(value)
    if problem := security.path_problem(text):
        return f"{group}={text}: {problem}; pick one of {', '.join(options)}"
    if text in options or custom_tree:
        return ""  # --config-dir or a search path may add options that llmexp/conf/ does not list
    close = difflib.get_close_matches(text, options, n=1, cutoff=0.5)
    hint = f"did you mean {group}={close[0]}? " if close else ""
    return f"{group}={text}: no such option; {hint}the options are {', '.join(options)}"


def check_args(args: list[str]) -> list[str]:
    """Check the command line before Hydra composes; return it with secrets redacted.

    Raises UserError that lists every problem found. A fast pass over argv for typos (no composition);
    what it cannot judge (grammar errors, options added through --config-dir, `_target_`s, `hydra.*`,
    anything a YAML file sets) is judged on the composed config (`ConfigCheck`) or by Hydra itself.
    """
    namespace, overrides = _parse_overrides(args)
    custom_tree = namespace is None or any(getattr(namespace, flag) is not None
                                           for flag in ("config_dir", "config_path", "config_name"))
    custom_tree = custom_tree or any(ov.key_or_group.startswith("hydra.searchpath") for ov in overrides)
    errors = [e for ov in overrides for e in _override_errors(ov, custom_tree) if e]
    if errors:
        raise UserError("invalid command line:\n  " + "\n  ".join(errors))
    return redact.redact_overrides(list(args))


# ---------------------------------------------------------------- the composed config


def structure_errors(cfg: Any) -> list[str]:
    """Problems that make the config's values unreadable or untrusted; checked before any value is.

    A `hydra` node (configs composed with `return_hydra_config=True`) is Hydra's and is skipped."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    data = OmegaConf.to_container(cfg, resolve=False)
    data.pop("hydra", None)  # type: ignore[union-attr]
    missing = [key for key, value in _strings(data) if value == "???"]
    errors = [f"{key}: is required but left unset (??? in the config); set {key}=..." for key in missing]
    errors += _unknown_keys(data)
    errors += [f"{key}: contains a NUL byte; remove it" for key, value in _strings(data) if "\x00" in value]
    errors += security.target_errors(data)  # type: ignore[arg-type]
    return errors if errors or missing else _interpolation_errors(cfg)


def _interpolation_errors(cfg: Any) -> list[str]:
    """Resolve every value now (env variables, `${...}` references), not halfway through a run."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    errors = []
    for key in cfg:
        if key == "hydra":
            continue
        try:
            node = cfg[key]
            if isinstance(node, DictConfig):
                OmegaConf.to_container(node, resolve=True)
        except OmegaConfBaseException as err:
            reason = str(err.msg).splitlines()[0]
            errors.append(f"{err.full_key or key}: cannot resolve an interpolation ({reason}); "
                          "fix the ${...} reference or set the environment variable it reads")
    return errors


def _unknown_keys(data: Any, prefix: str = "") -> list[str]:
    errors = []
    for key, value in data.items() if isinstance(data, dict) else []:
        dotted = f"{prefix}{key}"
        problem = unknown_key(dotted)
        if problem:
            errors.append(problem + " (added with +? remove it)")
        elif isinstance(value, dict):
            errors.extend(_unknown_keys(value, dotted + "."))
    return errors


def _strings(data: Any, prefix: str = "") -> list[tuple[str, str]]:
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else []
    out = []
    for key, value in items:
        dotted = f"{prefix}{key}"
        if isinstance(value, str):
            out.append((dotted, value))
        else:
            out.extend(_strings(value, dotted + "."))
    return out


def check_environment(cfg: Any) -> None:
    """After `validate`, before anything loads: what depends on this machine and launch (bf16 support,
    the world size, files that must exist). Raises one UserError listing every problem."""
    errors = [*_precision_errors(cfg), *_batch_errors(cfg), *_file_errors(cfg)]
    if errors:
        raise UserError("cannot run this config here:\n  " + "\n  ".join(errors))


def gpu_visible() -> bool:
    """A cheap guess, without importing torch, whether CUDA devices are visible to this process."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/gpus").is_dir()


def _precision_errors(cfg: Any) -> list[str]:
    """None any more: bf16 runs wherever torch can compute in it (every CPU, natively or emulated; emulated
    bf16 warns, see `config.derived.bf16_emulation_warning`). A GPU on which torch cannot compute in bf16 at all is
    refused at setup (`config.derived.resolve_precision`, exit 2): asking CUDA here, before each rank has picked its
    device, would open a CUDA context on GPU 0 for every rank."""
    del cfg
    return []


def _batch_errors(cfg: Any) -> list[str]:
    """`train.global_batch_size` must split into batch_size x processes x accumulation steps."""
    global_batch, micro = cfg.train.global_batch_size, cfg.batch_size
    try:
        world = max(1, world_size_from_env())
    except ValueError:
        world = 1
    if global_batch is None or global_batch <= 0 or micro <= 0 or global_batch % (micro * world) == 0:
        return []
    per_step = micro * world
    nearest = per_step * max(1, round(global_batch / per_step))
    return [f"train.global_batch_size={global_batch} is not a multiple of batch_size x processes = "
            f"{micro} x {world} = {per_step}; pick a multiple of {per_step} (e.g. {nearest})"]


def _file_errors(cfg: Any) -> list[str]:
    d, errors = cfg.data, []
    for key in ("train_file", "eval_file"):
        spec = d.get(key) if hasattr(d, "get") else getattr(d, key)
        if d.name in ("json", "text") and spec and not _matches(str(spec), allow_dir_or_glob=d.name == "text"):
            what = "file" if d.name == "json" else "file, directory or glob match"
            errors.append(f"data.{key}={spec}: no such {what} (looked at {Path(str(spec)).expanduser().resolve()}); "
                          f"fix the path or set data.{key}=path/to/{'train' if key == 'train_file' else 'eval'}.jsonl")
    for key, value in (("model.name_or_path", cfg.model.name_or_path), ("data.tokenizer", d.tokenizer)):
        if value and str(value).startswith((".", "/", "~")) and not Path(str(value)).expanduser().is_dir():
            errors.append(f"{key}={value}: no such directory; point it at a save_pretrained directory or a hub id")
    resume = str(cfg.train.resume)
    if resume not in ("auto", "never") and resume and not Path(resume).expanduser().is_dir():
        errors.append(f"train.resume={resume}: no such checkpoint directory; use train.resume=auto, never, "
                      "or a checkpoints/step_<N> directory")
    return errors


def _matches(spec: str, allow_dir_or_glob: bool) -> bool:
    path = Path(spec).expanduser()
    if path.is_file():
        return True
    if not allow_dir_or_glob:
        return False
    return path.is_dir() or any(Path(p).is_file() for p in glob.iglob(os.path.expanduser(spec), recursive=True))


def remote_code_errors(m: Any) -> list[str]:
    """Remote code runs only when asked for, and then only at a pinned commit of a hub model.

    Syntactic (no file system access): names starting with `/`, `.` or `~` are local directories,
    the user's own files, which a revision cannot pin."""
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


# ---------------------------------------------------------------- Hydra's compositions, checked


class ConfigCheck:
    """Hydra's ConfigLoader with `security.check_config` on every config it composes.

    Hydra 1.3 (`hydra._internal.hydra.Hydra`) composes through `hydra.config_loader` for runs, sweeps,
    `--help` and `--cfg`, and sweep launchers (local and SLURM) compose each job through the loader in
    their `HydraContext`, so installing this there checks every config before Hydra instantiates
    callbacks, the launcher, the sweeper or logging, or creates a directory. `hand_over` gives Hydra a
    config the CLI already composed and checked, so that it is not composed twice (and Hydra then uses
    the very directories that were checked and locked). Other methods go to Hydra's loader.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._ready: dict[tuple[Any, ...], Any] = {}
        self._repos: dict[tuple[Any, ...], Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("loader", "_ready", "_repos"):  # unpickling asks before __dict__
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __getstate__(self) -> dict[str, Any]:
        return {"loader": self.loader, "_ready": self._ready, "_repos": {}}  # (repositories are rebuilt)

    def list_groups(self, parent_name: str) -> list[str]:
        """Hydra 1.3's `ConfigLoaderImpl.list_groups`, through the cached repository below."""
        from hydra.core.object_type import ObjectType

        return self.get_group_options(group_name=parent_name, results_filter=ObjectType.GROUP)

    def get_group_options(self, group_name: str, results_filter: Any = "config", config_name: str | None = None,
                          overrides: list[str] | None = None) -> list[str]:
        """Hydra 1.3's `ConfigLoaderImpl.get_group_options`, with its config repository built once per command
        line instead of once per call (`--help` asks ~90 times; each build deep-copies the repository)."""
        from hydra.core.object_type import ObjectType

        key = (config_name, tuple(overrides or []))
        if key not in self._repos:
            _, self._repos[key] = self.loader._parse_overrides_and_create_caching_repo(config_name, list(key[1]))
        wanted = ObjectType.CONFIG if results_filter == "config" else results_filter  # Hydra's default
        return self._repos[key].get_group_options(group_name, wanted)  # type: ignore[no-any-return]

    def compose(self, config_name: str | None, overrides: list[str], run_mode: Any) -> Any:
        """Compose as Hydra's `compose_config` will (from the shell, sweep overrides validated), unchecked."""
        return self.loader.load_configuration(config_name=config_name, overrides=list(overrides),
                                              run_mode=run_mode, from_shell=True)

    def check(self, cfg: Any, config_name: str | None, overrides: list[str]) -> None:
        """`security.check_config`, each problem named with the file (or command line) it came from."""
        security.check_config(cfg, origin=lambda key: key_origin(self.loader, config_name, overrides, key))

    def hand_over(self, cfg: Any, config_name: str | None, overrides: list[str], run_mode: Any) -> None:
        """The next `load_configuration` with these arguments returns `cfg` (once) instead of composing."""
        self._ready[(config_name, tuple(overrides), run_mode)] = cfg

    def load_configuration(self, config_name: str | None, overrides: list[str], run_mode: Any,
                           from_shell: bool = True, validate_sweep_overrides: bool = True) -> Any:
        ready = self._ready.pop((config_name, tuple(overrides), run_mode), None)
        if ready is not None:
            return ready
        cfg = self.loader.load_configuration(config_name=config_name, overrides=overrides, run_mode=run_mode,
                                             from_shell=from_shell, validate_sweep_overrides=validate_sweep_overrides)
        self.check(cfg, config_name, overrides)
        return cfg

    def check_sweep_jobs(self, master_config: Any) -> None:
        """Compose and check every job of a sweep before the sweeper creates the sweep directory; each config is
        handed to the sweeper's own validation (`validate_batch_is_legal`) instead of composing again. A search's
        trials are not known yet: one job with each swept key at its first value stands for them."""
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        from llmexp.config.space import grid_jobs, probe_job, scale_lr

        sweeper = master_config.hydra.sweeper
        params = sweeper.get("params")
        arguments = [f"{k}={v}" for k, v in (OmegaConf.to_container(params) if params else {}).items()]  # type: ignore[union-attr]
        arguments += OmegaConf.to_container(master_config.hydra.overrides.task, resolve=False)  # type: ignore[arg-type]
        parsed = OverridesParser.create(config_loader=self.loader).parse_overrides(arguments)
        if str(sweeper._target_).endswith(".SearchSweeper"):
            jobs = [probe_job(parsed)]
        else:  # Hydra's BasicSweeper or llmexp's GridSweeper (zip, lr scaling), the two SWEEPER_TARGETS allow
            jobs = grid_jobs(parsed, list(sweeper.get("zip") or []))
            jobs = scale_lr(jobs, str(sweeper.get("lr_scaling") or "none"), sweeper.get("base_batch_size"),
                            master_config.get("lr"))
        for job in jobs:
            cfg = self.load_sweep_config(master_config, list(job))
            self._ready[(id(master_config), tuple(job))] = cfg

    def load_sweep_config(self, master_config: Any, sweep_overrides: list[str]) -> Any:
        from omegaconf import OmegaConf

        ready = self._ready.pop((id(master_config), tuple(sweep_overrides)), None)
        if ready is not None:
            return ready
        cfg = self.loader.load_sweep_config(master_config, sweep_overrides)
        overrides = [*OmegaConf.to_container(master_config.hydra.overrides.hydra), *sweep_overrides]  # type: ignore[misc]
        self.check(cfg, master_config.hydra.job.config_name, overrides)
        return cfg


def key_origin(loader: Any, config_name: str | None, overrides: list[str], key: str) -> str:
    """Where the value at `key` of a composed config came from: "command line" when an override sets the key
    or a node above it, else the last config file (in Hydra's defaults order) that sets it."""
    from hydra.types import RunMode

    try:
        parsed, repo = loader._parse_overrides_and_create_caching_repo(config_name, list(overrides))  # Hydra 1.3
        for ov in reversed(parsed):
            name = ov.key_or_group
            if not ov.is_delete() and not repo.group_exists(name) and (key == name or key.startswith(f"{name}.")):
                return "command line"
        defaults = loader.compute_defaults_list(config_name, list(overrides), RunMode.RUN).defaults
        for default in reversed(defaults):
            found = _config_file_setting(repo, default, key)
            if found:
                return found
    except Exception:  # the origin is a courtesy; the refusal stands without it
        return "config"
    return "config"


def _config_file_setting(repo: Any, default: Any, key: str) -> str | None:
    """The file behind one defaults-list entry, if its content (placed at its package) sets `key`."""
    from omegaconf import OmegaConf

    if default.config_path is None:
        return None
    package = default.package or ""
    if package and key != package and not key.startswith(f"{package}."):
        return None
    relative = key[len(package) + 1:] if package and key != package else key if not package else ""
    result = repo.load_config(default.config_path)
    if result is None:
        return None
    node: Any = OmegaConf.to_container(result.config, resolve=False)
    for part in [p for p in relative.split(".") if p]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    where = str(result.path)
    if where.startswith("file://"):
        return str(Path(where[len("file://"):]) / f"{default.config_path}.yaml")
    return f"{where}/{default.config_path}"


# ---------------------------------------------------------------- pkg:// search paths

try:  # Hydra 1.3's `pkg://` config source; Hydra is always installed, but keep this module importable without it
    from hydra._internal.core_plugins.importlib_resources_config_source import (
        ImportlibResourcesConfigSource as _PackageSource,
    )
except ImportError:  # pragma: no cover
    _PackageSource = object  # type: ignore[assignment,misc]

TRUSTED_PACKAGES: tuple[str, ...] = ("hydra", "hydra_plugins", "llmexp")
"""Packages a `pkg://` search path may name."""


class TrustedPackageSource(_PackageSource):  # type: ignore[misc,valid-type]
    """Hydra's `pkg://` config source for llmexp's and Hydra's own packages only.

    Reading `pkg://some.module` imports that module (its code runs) while Hydra composes, before any check
    of the composed config could run; so a search path (`hydra.searchpath`, from the command line or a
    primary config) may name only TRUSTED_PACKAGES. Installed by `guard_package_sources`."""

    def __init__(self, provider: str, path: str) -> None:
        package = path.split("://", 1)[-1].replace("/", ".").strip(".")
        if package.split(".")[0] not in TRUSTED_PACKAGES:
            raise UserError(f"hydra.searchpath: {path} would import the package {package!r} (its code runs); "
                            f"only {', '.join(TRUSTED_PACKAGES)} may be named, use a directory (file://DIR) instead")
        super().__init__(provider=provider, path=path)


# Hydra's registry refuses a second class for a scheme unless its __name__ matches the first one's (it then
# keeps the registered one): so a job process that restores this registry and scans plugins again keeps ours.
TrustedPackageSource.__name__ = _PackageSource.__name__


def guard_package_sources() -> None:
    """Route Hydra's `pkg://` scheme to TrustedPackageSource (after Hydra's plugin scan registered its own)."""
    from hydra._internal.sources_registry import SourcesRegistry  # Hydra 1.3

    SourcesRegistry.instance().types["pkg"] = TrustedPackageSource
