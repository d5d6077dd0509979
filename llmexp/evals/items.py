"""Task files: JSONL of `{context, choices, answer}` (multiple_choice) or `{prompt, target}` (generate), read before
anything loads, so a bad file exits 2 with nothing written (what each mistake names: docs/how-to/evals.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from llmexp.errors import UserError
from llmexp.rundir.readers import Damaged, entry_of, parse_json, read_lines, reader

if TYPE_CHECKING:
    from omegaconf import DictConfig

T = TypeVar("T")


@dataclass(frozen=True)
class ChoiceItem:
    """One multiple-choice question: the context, the candidate continuations, the index of the right one."""

    context: str
    choices: tuple[str, ...]
    answer: int


@dataclass(frozen=True)
class GenerateItem:
    """One generation question: the prompt, and the text a right answer holds."""

    prompt: str
    target: str


@reader
def _json_lines(path: Path, key: str) -> list[tuple[int, Any]]:
    """(line number, parsed value) of every non-blank line of a JSONL file; errors name the file and line."""
    if not path.is_file():
        raise UserError(f"{key}={path}: no such file, or not a file (resolved to {path.absolute()})")
    out = []
    for lineno, line in read_lines(path, entry_of(_json_lines).max_line_bytes):
        if isinstance(line, Damaged):
            raise line
        if line.strip():
            out.append((lineno, parse_json(line, path, lineno)))
    if not out:
        raise UserError(f"{key}={path}: the file holds no records; add one JSON object per line")
    return out


def _text(rec: dict[str, Any], field: str, where: str, expected: str) -> str:
    value = rec.get(field)
    if not isinstance(value, str):
        found = "missing" if field not in rec else f"got {type(value).__name__}"
        raise UserError(f"{where}: `{field}` must be a string ({found}); expected {expected}")
    return value


def _object(value: Any, where: str, expected: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UserError(f"{where}: a record must be a JSON object {expected}; got {type(value).__name__}")
    return value


CHOICE_FIELDS = '{"context": str, "choices": [str, ...], "answer": index of the right choice}'
GENERATE_FIELDS = '{"prompt": str, "target": str}'


def choice_item(value: Any, where: str) -> ChoiceItem:
    """One `{context, choices, answer}` record, checked."""
    rec = _object(value, where, CHOICE_FIELDS)
    context = _text(rec, "context", where, CHOICE_FIELDS)
    choices = rec.get("choices")
    if not isinstance(choices, list) or not choices:
        raise UserError(f"{where}: `choices` must be a non-empty list of strings (got {choices!r:.80}); "
                        f"expected {CHOICE_FIELDS}")
    if not all(isinstance(c, str) and c for c in choices):
        raise UserError(f"{where}: every choice must be a non-empty string (got {choices!r:.80})")
    answer = rec.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise UserError(f"{where}: `answer` must be the index of the right choice, an integer in "
                        f"[0, {len(choices) - 1}] for its {len(choices)} choices; got {answer!r}")
    return ChoiceItem(context, tuple(choices), answer)


def generate_item(value: Any, where: str) -> GenerateItem:
    """One `{prompt, target}` record, checked."""
    rec = _object(value, where, GENERATE_FIELDS)
    prompt, target = _text(rec, "prompt", where, GENERATE_FIELDS), _text(rec, "target", where, GENERATE_FIELDS)
    if not target.strip():
        raise UserError(f"{where}: `target` is empty, so no answer could match it; give the expected answer")
    return GenerateItem(prompt, target)


def _read_items(item: Callable[[Any, str], T], path: str | Path, key: str, max_items: int | None = None) -> list[T]:
    """The items of a task file (the first `max_items`), every record checked by `item`."""
    path = Path(path).expanduser()
    return [item(v, f"{path}:{n}: record {i}") for i, (n, v) in enumerate(_json_lines(path, key))][:max_items]


read_choice_items = functools.partial(_read_items, choice_item)
read_generate_items = functools.partial(_read_items, generate_item)


@dataclass
class TaskFiles:
    """The items of every file-based task, read and checked before the data loads."""

    choice: dict[str, list[ChoiceItem]] = field(default_factory=dict)
    generate: dict[str, list[GenerateItem]] = field(default_factory=dict)


def read_task_files(cfg: DictConfig) -> TaskFiles:
    """Parse and check every task file (UserError naming the file, line or record)."""
    ev = cfg.eval
    return TaskFiles(
        choice={str(n): read_choice_items(t.file, f"eval.multiple_choice.{n}.file", t.max_items)
                for n, t in ev.multiple_choice.items()},
        generate={str(n): read_generate_items(t.file, f"eval.generate.{n}.file", t.max_items)
                  for n, t in ev.generate.items()})
