"""Loading a service's config dataclass from defaults, a TOML file, environment and flags.

Each service keeps its defaults in one frozen dataclass with a `validate()`
method. `load_config` turns every field into a `--flag` (underscores become
dashes) and a `<PREFIX><FIELD>` environment variable, reads an optional TOML
file (`--config PATH` or `<PREFIX>CONFIG`) whose top-level keys are the field
names, and merges them: defaults < file < environment < flags. Values are
converted to the field's type and validated once; any error prints one line
naming the key and its source, and exits with status 2. `--print-config`
prints the effective config as TOML and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import stat
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def write_ready_file(path: str, info: dict) -> None:
    """Atomically publish that a service is serving, with its addresses (`kvtier up` and tests poll this)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def check_log_level(level: str) -> None:
    if level.upper() not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)} (any case), got {level!r}")


def read_pem(path: str, option: str) -> bytes:
    """A PEM file's bytes; ValueError with one line naming the option when it is unreadable or not PEM."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"{option}: cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{option}: {path} is not a PEM file")
    return data


def read_credentials(path: str) -> tuple[str, str]:
    """(user, password) from a file holding `user:password` (one line; the password may hold ':').

    Never from argv or the environment: a file its owner (and group) may read, others not, like the
    cluster secret. ValueError with one line naming the problem."""
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError as exc:
        raise ValueError(f"etcd_credentials_file: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"etcd_credentials_file: {path} is not UTF-8 text") from None
    if mode & stat.S_IROTH:
        raise ValueError(f"etcd_credentials_file: {path} is readable by others: chmod o-rwx {path}")
    user, sep, password = text.partition(":")
    if not sep or not user or not password or "\n" in text:
        raise ValueError(f"etcd_credentials_file: {path} must hold one line USER:PASSWORD")
    return user, password


@dataclass(frozen=True, slots=True)
class EtcdSecurity:
    """How a service reaches a secured etcd (docs/security.md, "etcd"): TLS checked against ca_file;
    cert_file + key_file for etcd's --client-cert-auth; credentials_file (`user:password`) for etcd
    users. Empty fields are off; all empty is plaintext without auth."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    credentials_file: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.ca_file or self.cert_file)


def check_etcd_security(etcd: str, security: EtcdSecurity) -> None:
    """The etcd_* security options of a service (master: `etcd`; segment: an etcd:// `master`): only
    with etcd, and every file readable now (ValueError, one line naming the option)."""
    if "https://" in etcd and not security.tls:
        raise ValueError("an https:// etcd endpoint needs etcd_ca_file (the CA of etcd's server certificate)")
    if security == EtcdSecurity():
        return
    if not etcd:
        raise ValueError("etcd_ca_file, etcd_cert_file, etcd_key_file and etcd_credentials_file need etcd")
    if bool(security.cert_file) != bool(security.key_file):
        raise ValueError("etcd_cert_file and etcd_key_file go together (a client certificate and its key)")
    if security.cert_file and not security.ca_file:
        raise ValueError("etcd_cert_file needs etcd_ca_file, the CA that signed etcd's server certificate")
    for path, option in (
        (security.ca_file, "etcd_ca_file"),
        (security.cert_file, "etcd_cert_file"),
        (security.key_file, "etcd_key_file"),
    ):
        if path:
            read_pem(path, option)
    if security.credentials_file:
        read_credentials(security.credentials_file)


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports errors as one line (no usage dump) and exits with status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _from_text(kind: type, text: str) -> Any:
    """A flag's or environment variable's text as the field's type; ValueError when it is not one."""
    if kind is bool:
        lowered = text.strip().lower()
        if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            raise ValueError
        return lowered in ("1", "true", "yes", "on")
    return kind(text)


def _from_toml(kind: type, value: Any) -> Any:
    """A TOML value as the field's type. Numbers are accepted for size strings ("dram = 1073741824"),
    integers for floats; nothing else is converted (a quoted number for a number is a mistake)."""
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, str):
        return value
    if kind is str and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise ValueError


_TYPE_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}


def _converter(kind: type, name: str):
    def convert(text: str) -> Any:
        try:
            return _from_text(kind, text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value for {name}: {text!r}") from None

    return convert


def read_toml(path: str, what: str) -> dict[str, Any]:
    """A TOML document (`what`: "config file", "tenants file", ...); ValueError with one line when it
    cannot be read or parsed."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid TOML: {exc}") from None


def _read_file(path: str, kinds: dict[str, type]) -> dict[str, Any]:
    """The config file's values by field name; ValueError with one line naming the problem."""
    document = read_toml(path, "config file")
    values: dict[str, Any] = {}
    for key, value in document.items():
        if key not in kinds:
            hint = f" (did you mean {key.replace('-', '_')!r}?)" if key.replace("-", "_") in kinds else ""
            raise ValueError(f"config file {path}: unknown key {key!r}{hint}")
        try:
            values[key] = _from_toml(kinds[key], value)
        except ValueError:
            raise ValueError(f"config file {path}: {key} must be {_TYPE_NAMES[kinds[key]]}, got {value!r}") from None
    return values


def to_toml(config: Any) -> str:
    """The config as TOML, one `key = value` per field (the input `--config` takes)."""
    lines = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = json.dumps(value)  # a JSON string is a valid TOML basic string
        else:
            text = repr(value)
        lines.append(f"{field.name} = {text}")
    return "\n".join(lines) + "\n"


def load_config(
    cls: type[T],
    *,
    prog: str,
    description: str,
    env_prefix: str,
    argv: list[str] | None,
    resolve: Callable[[T], T] | None = None,
) -> T:
    """The validated config; `resolve` fills in values that depend on the machine (a default
    directory) before `--print-config` shows them."""
    parser = OneLineArgumentParser(prog=prog, description=description)
    defaults = cls()
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    kinds = {field.name: type(getattr(defaults, field.name)) for field in fields}
    config_env = f"{env_prefix}CONFIG"
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=os.environ.get(config_env, ""),
        help=f"TOML file whose keys are the options below with underscores (env {config_env})",
    )
    parser.add_argument("--print-config", action="store_true", help="print the effective config as TOML and exit")
    for field in fields:
        flag = "--" + field.name.replace("_", "-")
        env_name = f"{env_prefix}{field.name.upper()}"
        parser.add_argument(
            flag,
            type=_converter(kinds[field.name], flag),
            default=None,
            help=f"env {env_name} (default: {getattr(defaults, field.name)!r})",
        )
    opts = parser.parse_args(argv)
    try:
        file_values = _read_file(opts.config, kinds) if opts.config else {}
    except ValueError as exc:
        parser.error(str(exc))
    env_values: dict[str, Any] = {}
    known = {f"{env_prefix}{name.upper()}" for name in kinds} | {config_env}
    for env_name in sorted(os.environ):
        # A misspelt variable was ignored without a word, while a misspelt TOML key is an error.
        if env_name.startswith(env_prefix) and env_name not in known:
            close = difflib.get_close_matches(env_name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            parser.error(f"unknown environment variable {env_name}: no such option{hint}")
    for name, kind in kinds.items():
        env_name = f"{env_prefix}{name.upper()}"
        if env_name in os.environ:
            try:
                env_values[name] = _from_text(kind, os.environ[env_name])
            except ValueError:
                parser.error(f"invalid {kind.__name__} value for {env_name}: {os.environ[env_name]!r}")
    flag_values = {k: v for k, v in vars(opts).items() if k in kinds and v is not None}
    values = {**file_values, **env_values, **flag_values}
    try:
        config = cls(**values).validate()  # type: ignore[attr-defined]
        if resolve is not None:
            config = resolve(config)
    except ValueError as exc:
        parser.error(str(exc))
    if opts.print_config:
        source = f" from {opts.config}" if opts.config else ""
        sys.stdout.write(f"# {prog}: effective config{source}, environment and flags\n{to_toml(config)}")
        sys.stdout.flush()
        parser.exit(0)
    return config
