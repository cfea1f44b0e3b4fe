"""One configuration loader for both systems: TOML file + `--set key=value` overrides.

A schema is a nested dict of sections whose values are the defaults. The type
of each default is the type a value must have (an int is accepted where a
float is expected; a default of ``None`` accepts anything, a dict default is a
free-form table checked by its consumer). Every unknown key or wrong type is a
:class:`ConfigError` that names the key, so a typo never silently trains with
a default.
"""

from __future__ import annotations

import copy
import difflib
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["ConfigError", "IntOrAuto", "dump_toml", "load_config", "parse_override"]


class IntOrAuto(int):
    """A schema default for a key that takes an integer or ``"auto"`` (the run chooses it,
    e.g. ``resilience.replicate_every``)."""


class ConfigError(ValueError):
    """A configuration file or override is wrong; the message names the key."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``section.key=value``; the value is read as TOML, else taken as a string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    path = [p.strip() for p in key.strip().split(".")]
    if len(path) < 2 or not all(path):
        raise ConfigError(f"--set {text!r}: the key must look like section.key")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return path, value


def _type_ok(default: Any, value: Any) -> bool:
    if default is None:
        return True
    if isinstance(default, IntOrAuto):
        return value == "auto" or (isinstance(value, int) and not isinstance(value, bool))
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, int | float) and not isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, dict):
        # a table, or a keyword its consumer understands (resilience.backups = "all")
        return isinstance(value, dict | str)
    return isinstance(value, type(default))


def _type_name(default: Any) -> str:
    if isinstance(default, IntOrAuto):
        return 'an integer or "auto"'
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(default), type(default).__name__)


def _nearest(word: str, known: Iterable[str]) -> str | None:
    """The known name closest to a misspelt one, if any is close (difflib's ratio >= 0.6)."""
    close = difflib.get_close_matches(word, list(known), n=1)
    return close[0] if close else None


def _unknown_section(section: str, defaults: Mapping, origin: str) -> ConfigError:
    near = _nearest(section, defaults)
    hint = f": did you mean [{near}]?" if near else ""
    return ConfigError(f"{origin}: unknown section [{section}]{hint} (known: {', '.join(defaults)})")


def _unknown_key(section: str, key: str, defaults: Mapping, origin: str) -> ConfigError:
    """Suggest the same key name in another section (``run.batch_size`` ->
    ``data.batch_size``), else the nearest key of the same section, else the nearest
    anywhere."""
    elsewhere = {k: f"{s}.{k}" for s, body in reversed(defaults.items()) if isinstance(body, dict) for k in body}
    near = elsewhere.get(key)
    if near is None:
        near = _nearest(key, defaults[section])
        near = f"{section}.{near}" if near is not None else None
    if near is None:
        other = _nearest(key, elsewhere)
        near = elsewhere[other] if other else None
    hint = f": did you mean '{near}'?" if near else ""
    return ConfigError(
        f"{origin}: unknown key '{section}.{key}'{hint} (known in [{section}]: {', '.join(defaults[section])})"
    )


def _assign(cfg: dict, defaults: Mapping, path: list[str], value: Any, origin: str) -> None:
    dotted = ".".join(path)
    section = path[0]
    if section not in defaults:
        raise _unknown_section(section, defaults, origin)
    schema = defaults[section]
    if isinstance(schema, dict) and not schema and len(path) >= 2:
        # free-form table (e.g. [plan]): keep as given
        node = cfg[section]
        for part in path[1:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
        return
    key = path[1]
    if key not in schema:
        raise _unknown_key(section, key, defaults, origin)
    default = schema[key]
    if len(path) > 2:
        if not isinstance(default, dict):
            raise ConfigError(f"{origin}: '{section}.{key}' is not a table, cannot set {dotted}")
        node = cfg[section][key]
        for part in path[2:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
        return
    if not _type_ok(default, value):
        raise ConfigError(
            f"{origin}: '{dotted}' must be {_type_name(default)}, got {value!r}"
        )
    cfg[section][key] = float(value) if isinstance(default, float) else value


def _merge_file(cfg: dict, defaults: Mapping, data: Mapping, origin: str) -> None:
    for section, body in data.items():
        if section not in defaults:
            raise _unknown_section(section, defaults, origin)
        if not isinstance(body, dict):
            raise ConfigError(f"{origin}: '{section}' must be a table [{section}]")
        if isinstance(defaults[section], dict) and not defaults[section]:
            cfg[section].update(copy.deepcopy(body))
            continue
        for key, value in body.items():
            _assign(cfg, defaults, [section, key], value, origin)


def _check_choices(cfg: Mapping, choices: Mapping[str, tuple[str, ...]]) -> None:
    for dotted, allowed in choices.items():
        section, key = dotted.split(".", 1)
        value = cfg.get(section, {}).get(key)
        if value not in allowed:
            raise ConfigError(f"'{dotted}' = {value!r}: choose one of {', '.join(allowed)}")


def load_config(
    path: str | Path | Mapping[str, Any] | None,
    overrides: Iterable[str] = (),
    defaults: Mapping[str, Mapping[str, Any]] | None = None,
    choices: Mapping[str, tuple[str, ...]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Return the defaults, updated by the TOML file at ``path``, then by each override.

    ``defaults`` is the system's schema (mpipipe.pipeline.config.PIPELINE_DEFAULTS,
    stannis.config.STANNIS_DEFAULTS): the core knows no system's keys.

    Raises:
        ConfigError: the file is missing or not TOML, a key is unknown, a value
            has the wrong type or is not one of the allowed choices.
    """
    if defaults is None:
        raise TypeError("load_config needs the system's defaults, e.g. "
                        "mpipipe.pipeline.config.PIPELINE_DEFAULTS")
    cfg: dict[str, dict[str, Any]] = copy.deepcopy({k: dict(v) for k, v in defaults.items()})
    if isinstance(path, Mapping):  # a configuration given as a dict (the Python API)
        _merge_file(cfg, defaults, path, "config")
        path = None
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        _merge_file(cfg, defaults, data, f"config file {p}")
    for text in overrides:
        keys, value = parse_override(text)
        _assign(cfg, defaults, keys, value, f"--set {text}")
    if choices:
        _check_choices(cfg, choices)
    from mpipipe.core.run.recipe import anchor

    anchor(cfg, path)  # a user's file.py:name beside the config file
    return cfg


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f'"{k}" = {_toml_value(v)}' for k, v in value.items()) + "}"
    return repr(value)


def dump_toml(cfg: Mapping[str, Mapping[str, Any]]) -> str:
    """A configuration (e.g. a schema's defaults) as TOML that :func:`load_config` reads back."""
    lines: list[str] = []
    for section, body in cfg.items():
        lines.append(f"[{section}]")
        lines += [f"{key if key.isidentifier() else repr(key)} = {_toml_value(v)}" for key, v in body.items()]
        lines.append("")
    return "\n".join(lines)
