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

from mpipipe.core.lr import SCHEDULES

__all__ = ["ConfigError", "PIPELINE_DEFAULTS", "PIPELINE_CHOICES", "dump_toml", "load_config", "parse_override"]


class ConfigError(ValueError):
    """A configuration file or override is wrong; the message names the key."""


PIPELINE_DEFAULTS: dict[str, dict[str, Any]] = {
    "run": {
        "seed": 0,  # seeds torch, the sampler and fault injection
        "steps": 300,  # optimizer steps to train (0: use epochs)
        "epochs": 0,  # if > 0 and steps == 0: train this many epochs (batches counted with data.drop_last)
        "eval_every": 50,  # evaluate on the test split every N steps (0: only at the end)
        "log_every": 10,  # plain progress line every N steps when not on a terminal
        "checkpoint_every": 0,  # save every N steps (0: never)
        "checkpoint_dir": "",  # where checkpoints go (default: beside the log)
        "threads": 1,  # torch compute threads per rank
    },
    "data": {
        "path": "data/digits",  # directory with train/ and test/ shard data sets
        "batch_size": 64,  # mini-batch size (samples per optimizer step)
        "shuffle": True,  # reshuffle the train split every epoch (seeded)
        "drop_last": True,  # drop a last short batch (false: pad it by repeating records)
    },
    "model": {
        "name": "lenet",  # lenet | vgg | resnet
        "num_classes": 10,  # output classes of the model
    },
    "optim": {
        "name": "sgd",  # sgd | adam
        "lr": 0.05,  # learning rate (at the first step)
        "schedule": "constant",  # constant | cosine (towards 0 over the run's steps)
        "momentum": 0.9,  # SGD momentum
        "weight_decay": 0.0,  # L2 penalty
    },
    "pipeline": {
        "stages": 3,  # K: number of pipeline stages (one rank each)
        "balance": [],  # layers per stage; [] = automatic
        "balance_by": "time",  # time | params (automatic balancing)
        "chunks": 4,  # m: micro-batches per mini-batch
        "schedule": "1f1b",  # gpipe | 1f1b
    },
    "plan": {},  # explicit launch plan: role name -> rank, e.g. "stage 0" = 0
    "resilience": {
        "backups": {},  # stage -> number of backup ranks, e.g. {1 = 1}; "all": one per stage
        "replicate_every": 1,  # R: refresh replicas every R steps
        "mode": "cold",  # cold | hot | neighbour
        "deadline_s": 30.0,  # a wait longer than this marks the sender late
        "deadline_factor": 0.0,  # if > 0: deadline = factor x running median of that wait
        "allow_same_node": False,  # true: a backup may share its stage's node (multi-node worlds)
        "inject": [],  # fault specs, as with --inject
    },
}

PIPELINE_CHOICES: dict[str, tuple[str, ...]] = {
    "model.name": ("lenet", "vgg", "resnet"),
    "optim.name": ("sgd", "adam"),
    "optim.schedule": SCHEDULES,
    "pipeline.balance_by": ("time", "params"),
    "pipeline.schedule": ("gpipe", "1f1b"),
    "resilience.mode": ("cold", "hot", "neighbour"),
}


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
    """Suggest the nearest key of the same section, else the same key name in another
    section (``run.batch_size`` -> ``data.batch_size``), else the nearest anywhere."""
    near = _nearest(key, defaults[section])
    if near is not None:
        near = f"{section}.{near}"
    else:
        elsewhere = {k: f"{s}.{k}" for s, body in reversed(defaults.items()) if isinstance(body, dict) for k in body}
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
    path: str | Path | None,
    overrides: Iterable[str] = (),
    defaults: Mapping[str, Mapping[str, Any]] = PIPELINE_DEFAULTS,
    choices: Mapping[str, tuple[str, ...]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Return the defaults, updated by the TOML file at ``path``, then by each override.

    Raises:
        ConfigError: the file is missing or not TOML, a key is unknown, a value
            has the wrong type or is not one of the allowed choices.
    """
    cfg: dict[str, dict[str, Any]] = copy.deepcopy({k: dict(v) for k, v in defaults.items()})
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
