"""The one config error type, the checks that turn user values into canonical ones, and
the YAML/JSON reader.

Shared by ``config.py`` (our own keys) and ``_config/deepspeed.py`` (DeepSpeed's).
See [Note: one error type] in config.py.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ._state_kinds import TRAINING_ONLY, parse_kinds


# --------------------------------------------------------------------------- errors


class ZeroConfigError(ValueError):
    """A configuration problem: which key, what is wrong with it, how to fix it.

    ``str(err)`` reads ``"<key>: <problem>. <fix>"``. ``key`` is a dotted path
    (``"offload_optimizer.buffer_size"``) or ``None`` for whole-config problems.
    ``ZeroConfigError("message")`` also works, as for any ``ValueError``.
    """

    def __init__(self, key: str | None, problem: str | None = None, fix: str | None = None,
                 source: str | None = None):
        if problem is None:  # ZeroConfigError("plain message"), like any ValueError
            key, problem = None, str(key)
        self.key = key
        self.problem = problem
        self.fix = fix
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        msg = f"{self.key}: {self.problem}" if self.key else self.problem
        if self.fix:
            msg = f"{msg}{' ' if msg.endswith('.') else '. '}{self.fix}"
        if self.source:
            msg = f"{self.source}: {msg}"
        return msg

    def __reduce__(self):  # keep the error picklable across processes
        return (type(self), (self.key, self.problem, self.fix, self.source))

    def within(self, prefix: str) -> ZeroConfigError:
        """The same error with ``prefix.`` in front of the key (for nested sections)."""
        key = f"{prefix}.{self.key}" if self.key else prefix
        return ZeroConfigError(key, self.problem, self.fix, self.source)

    def from_source(self, source: str) -> ZeroConfigError:
        return ZeroConfigError(self.key, self.problem, self.fix, source)


def _suggest(word: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'stage'?)"`` for the close matches of ``word``, else ``""``."""
    matches = difflib.get_close_matches(str(word), list(choices), n=3, cutoff=0.6)
    if matches:  # keep only the matches about as close as the best one
        ratio = lambda m: difflib.SequenceMatcher(None, str(word), m).ratio()  # noqa: E731
        best = ratio(matches[0])
        matches = [m for m in matches if ratio(m) >= best - 0.05]
    if not matches:
        return ""
    if len(matches) == 1:
        return f" (did you mean {matches[0]!r}?)"
    return " (did you mean one of " + ", ".join(repr(m) for m in matches) + "?)"


def _check_keys(given: Iterable[str], allowed: Iterable[str], where: str | None, what: str = "key") -> None:
    """Raise for the first key of ``given`` that is not in ``allowed``, with a suggestion."""
    allowed = list(allowed)
    for key in given:
        if key not in allowed:
            path = f"{where}.{key}" if where else str(key)
            hint = _suggest(key, allowed)
            fix = None
            if not hint or len(allowed) <= 20:  # long lists only when there is no suggestion
                fix = "Valid " + what + "s: " + ", ".join(sorted(allowed)) + "."
            raise ZeroConfigError(path, f"unknown {what}{hint}", fix)


# ------------------------------------------------------------------ value checking


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_int(key: str, value: Any, minimum: int | None = None, maximum: int | None = None,
            why: str = "") -> int:
    """An int (an integral float such as ``1e5`` from YAML/JSON is accepted); ``why`` explains ``maximum``."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ZeroConfigError(key, f"expected an integer, got {value!r} ({type(value).__name__})",
                              "Write a whole number such as 4.")
    if minimum is not None and value < minimum:
        raise ZeroConfigError(key, f"must be >= {minimum}, got {value}", f"Use a value of at least {minimum}.")
    if maximum is not None and value > maximum:
        raise ZeroConfigError(key, f"must be <= {maximum}, got {value}{': ' + why if why else ''}",
                              f"Use a value of at most {maximum}.")
    return value


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond float range (10**400 in YAML/JSON)
        return False


def _as_float(key: str, value: Any) -> float:
    if not _is_number(value) or not _finite(value):
        raise ZeroConfigError(key, f"expected a finite number, got {value!r}", "Write a number such as 1.0.")
    return float(value)


def _as_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ZeroConfigError(key, f"expected true or false, got {value!r}", "Write true or false (no quotes).")
    return value


_DTYPE_ALIASES: dict[Any, str] = {
    "fp32": "fp32", "float32": "fp32", "32": "fp32", "float": "fp32", "32-true": "fp32",
    "torch.float32": "fp32", "f32": "fp32",
    "bf16": "bf16", "bfloat16": "bf16", "bf16-mixed": "bf16", "bf16-true": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "16": "fp16", "half": "fp16", "16-mixed": "fp16", "16-true": "fp16",
    "torch.float16": "fp16", "f16": "fp16",
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _as_dtype_name(key: str, value: Any) -> str:
    probe = str(value).lower() if isinstance(value, (str, int)) and not isinstance(value, bool) else value
    try:
        name = _DTYPE_ALIASES.get(probe)
    except TypeError:  # unhashable
        name = None
    if name is None:
        hint = _suggest(str(value).lower(), [k for k in _DTYPE_ALIASES if isinstance(k, str)])
        raise ZeroConfigError(key, f"unknown dtype {value!r}{hint}", 'Use "fp32", "bf16" or "fp16".')
    return name


# ------------------------------------------------------------------ files

FILE_SUFFIXES = (".yaml", ".yml", ".json")


def _as_generation_offload(value: Any) -> tuple[str, ...]:
    """``offload_states_during_generation``: False/True/kinds -> the tuple of kinds (empty: off)."""
    key = "offload_states_during_generation"
    if isinstance(value, bool):
        return TRAINING_ONLY if value else ()
    if value is None:
        return ()
    try:
        kinds = parse_kinds(value, key)
    except (TypeError, ValueError) as err:
        raise ZeroConfigError(key, str(err).split(": ", 1)[-1],
                              "Write true, false, or a list such as [optim_states, hp_params].") from None
    if "lp_params" in kinds:
        raise ZeroConfigError(key, "lp_params (the parameters) cannot be offloaded during generation: "
                              "generation runs the model's forward on them",
                              "Drop lp_params/params; call zero_strategy.offload_states(model, include=[...]) "
                              "yourself around a phase that does not use the model (a separate vLLM engine).")
    return kinds


def _as_unit_classes(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, (str, type)) else value
    if not isinstance(items, Iterable) or isinstance(items, Mapping):
        raise ZeroConfigError("unit_classes", f"expected a class name or a list of them, got {value!r}",
                              'Write e.g. unit_classes: ["LlamaDecoderLayer"].')
    names = []
    for item in items:
        name = item.__name__ if isinstance(item, type) else item
        if not isinstance(name, str) or not name.strip():
            raise ZeroConfigError("unit_classes", f"expected class names, got {item!r}",
                                  'Write e.g. unit_classes: ["LlamaDecoderLayer"].')
        names.append(name.strip())
    return tuple(names)


def looks_like_deepspeed(data: Mapping) -> bool:
    return "zero_optimization" in data


def read_mapping_file(path: Path) -> Mapping:
    """Parse a YAML/JSON file into a mapping, with the line of a syntax error."""
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise ZeroConfigError(None, f"unsupported config file type {suffix or '(none)'!r} for {path}",
                              "Use a .yaml, .yml or .json file.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ZeroConfigError(None, f"config file {path} is not UTF-8 text (byte {err.start}: {err.reason})",
                              "Save it as UTF-8.") from None
    except FileNotFoundError:
        raise ZeroConfigError(None, f"config file {path} does not exist",
                              "Check the path (relative paths are resolved from the working directory "
                              f"{os.getcwd()}).") from None
    except OSError as err:
        raise ZeroConfigError(None, f"cannot read config file {path}: {err.strerror or err}",
                              "Check that it is a readable file.") from None
    try:
        data = _parse(path, suffix, text)
    except RecursionError:
        raise ZeroConfigError(None, f"{path} is nested too deeply to be a config",
                              "A ZeRO config is a mapping a few levels deep.") from None
    if not isinstance(data, Mapping):
        raise ZeroConfigError(None, f"the top level of {path} must be a mapping, got "
                              f"{'an empty file' if data is None else type(data).__name__}",
                              "Write key: value pairs such as 'stage: 3'.")
    return data


def _parse(path: Path, suffix: str, text: str) -> Any:
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ZeroConfigError(None, f"invalid JSON in {path} at line {err.lineno}, column {err.colno}: "
                                  f"{err.msg}", "Fix the syntax there.") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err)
            raise ZeroConfigError(None, f"invalid YAML in {path}{where}: {problem}",
                                  "Fix the syntax there.") from None
    return data
