"""Loading a service's config dataclass from defaults, environment and flags (flags win).

Each service keeps its defaults in one frozen dataclass with a `validate()`
method; `load_config` turns every field into a `--flag` (underscores become
dashes) and a `<PREFIX><FIELD>` environment variable, converts values to the
field's type, validates once, and on any error prints one line and exits
with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")


def write_ready_file(path: str, info: dict) -> None:
    """Atomically publish that a service is serving, with its addresses (`kvtier up` and tests poll this)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports errors as one line (no usage dump) and exits with status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _converter(kind: type, name: str):
    def convert(text: str) -> Any:
        try:
            if kind is bool:
                lowered = text.strip().lower()
                if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError
                return lowered in ("1", "true", "yes", "on")
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value for {name}: {text!r}") from None

    return convert


def load_config(cls: type[T], *, prog: str, description: str, env_prefix: str, argv: list[str] | None) -> T:
    parser = OneLineArgumentParser(prog=prog, description=description)
    defaults = cls()
    env_values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = getattr(defaults, field.name)
        kind = type(value)
        flag = "--" + field.name.replace("_", "-")
        env_name = f"{env_prefix}{field.name.upper()}"
        if env_name in os.environ:
            try:
                env_values[field.name] = _converter(kind, env_name)(os.environ[env_name])
            except argparse.ArgumentTypeError as exc:
                parser.error(str(exc))
        parser.add_argument(
            flag, type=_converter(kind, flag), default=None, help=f"env {env_name} (default: {value!r})"
        )
    opts = parser.parse_args(argv)
    values = {**env_values, **{k: v for k, v in vars(opts).items() if v is not None}}
    try:
        return cls(**values).validate()  # type: ignore[attr-defined]
    except ValueError as exc:
        parser.error(str(exc))
