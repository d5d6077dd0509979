"""Secrets never reach a run's files: what counts as one (credential-named keys and environment variables, strings
shaped like well-known tokens), and how it is hidden (`REDACTED`). A secret on the command line never reaches Hydra:
`redact_overrides` moves it into a private environment variable behind `${oc.env:LLMEXP_SECRET_<n>}`, so `.hydra/`,
Hydra's errors and wandb's argv see only the placeholder. Writers of run files call `scrub`. No torch here.
See docs/explanation/security-model.md.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, read_write

from llmexp.errors import EXIT_USER
from llmexp.rundir.files import write_text_atomic
from llmexp.rundir.lock import HYDRA_FILES
from llmexp.rundir.readers import read_yaml

REDACTED = "***"
SECRET_ENV_PREFIX = "LLMEXP_SECRET_"
"""Where `redact_overrides` keeps a command-line secret for the run (and its child processes)."""
MIN_SECRET_LEN = 6
"""Shorter environment values (`1`, `true`) are not scrubbed: they would mangle every number."""

_SECRET_KEY = re.compile(r"(^|[_.-])(token|key|secret|password|passwd|pwd|credentials?|auth)$"
                         r"|secret|password|api_?key|access_?key|private_?key", re.IGNORECASE)
_NOT_SECRET = frozenset({"pad_token", "eos_token", "bos_token", "unk_token", "sep_token", "cls_token",
                         "mask_token", "max_new_tokens", "num_key_value_heads", "pwd", "oldpwd", "data_cache_key"})
"""Names that look like credentials and are not (PWD is the shell's working directory; data_cache_key a hash)."""
_TOKEN_SHAPES = (r"hf_[A-Za-z0-9]{20,}", r"sk-[A-Za-z0-9_-]{20,}", r"gh[pousr]_[A-Za-z0-9]{20,}",
                 r"github_pat_[A-Za-z0-9_]{20,}", r"xox[abpr]-[A-Za-z0-9-]{10,}", r"AKIA[0-9A-Z]{16}")
_SECRET_VALUE = re.compile(r"(?<![A-Za-z0-9])(" + "|".join(_TOKEN_SHAPES) + r")")


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
        text = text.replace(secret, REDACTED)
    return _SECRET_VALUE.sub(REDACTED, text)


def print_user_error(prog: str, err: object) -> int:
    """Print a user's mistake as `prog: error: ...` on stderr, secrets scrubbed (a bad override may quote a token);
    EXIT_USER, for the command to return."""
    print(f"{prog}: error: {scrub_text(str(err))}", file=sys.stderr)
    return EXIT_USER


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
    """Command-line arguments with secret override values moved into `LLMEXP_SECRET_<n>` env variables (which sweep
    jobs inherit): `+logger.api_key=abc` becomes `+logger.api_key=${oc.env:LLMEXP_SECRET_0}`. Elsewhere each
    secret-looking part of a value is lifted alone, so that `train.sample_prompts=[hi,sk-...]` stays a list."""
    env = os.environ if environ is None else environ
    inside = re.compile("|".join([*map(re.escape, secret_env_values(env)), _SECRET_VALUE.pattern]))
    names = (f"{SECRET_ENV_PREFIX}{n}" for n in itertools.count())

    def lift(secret: str) -> str:
        env[name := next(names)] = secret
        return f"${{oc.env:{name}}}"

    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if arg.startswith("-") or not sep or value.startswith("${"):
            out.append(arg)
            continue
        leaf = key.lstrip("+~").split("@")[0].rsplit(".", 1)[-1]
        unquoted = value[1:-1] if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"" else value
        out.append(f"{key}={lift(unquoted)}" if is_secret_key(leaf) else
                   f"{key}={inside.sub(lambda m: lift(m.group()), value)}")
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
    """Rewrite a YAML file (Hydra's config.yaml, hydra.yaml, overrides.yaml) atomically with secrets redacted,
    interpolations as written; True when something was redacted."""
    if (data := read_yaml(path)) is None:
        return False
    clean = scrub_overrides(data) if isinstance(data, list) and all(isinstance(x, str) for x in data) else scrub(data)
    if clean == data:
        return False
    write_text_atomic(path, OmegaConf.to_yaml(OmegaConf.create(clean)))
    return True


class RedactRunFiles(Callback):
    """Hydra callback (llmexp/conf/config.yaml `hydra.callbacks`): when a job starts, after Hydra wrote
    `.hydra/`, redact secrets there and filter the job log (`llmexp.log`) from then on."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        install_log_filter()
        _sanitize_hydra_overrides()
        if (subdir := config.hydra.output_subdir) is not None:
            for name in HYDRA_FILES:
                scrub_yaml_file(Path(config.hydra.runtime.output_dir) / str(subdir) / name)


def _sanitize_hydra_overrides() -> None:
    """Make `HydraConfig.get().overrides.task` and `job.override_dirname` safe to read and write out: as typed,
    reading them would resolve `${oc.env:LLMEXP_SECRET_0}` (or a typed `${oc.env:HF_TOKEN}`) to the secret itself.
    Secret-named values become REDACTED and other interpolations are escaped so they read as typed."""
    hydra_cfg = HydraConfig.instance().cfg.hydra  # type: ignore[union-attr]
    typed = OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)
    clean = [item.replace("${", "\\${") for item in scrub_overrides(typed)]  # type: ignore[arg-type]
    settings = hydra_cfg.job.config.override_dirname
    excluded = set(OmegaConf.to_container(settings.exclude_keys, resolve=False))  # type: ignore[arg-type]
    kept = sorted(item for item in clean if item.partition("=")[0].lstrip("+~") not in excluded)
    with read_write(hydra_cfg):
        hydra_cfg.overrides.task = clean
        hydra_cfg.job.override_dirname = settings.item_sep.join(kept).replace("=", settings.kv_sep)
