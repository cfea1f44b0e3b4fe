"""The run log's schema, declared once: its columns, their types and meanings, and the event kinds.

Why one module: the plain pipeline, ResPipe and Stannis write the same file format and
`mpipipe report` reads all three. With the names spelled out in each writer, adding a
column or an event kind touched about eight files and nothing caught a misspelt one: a
row with an unknown key lost it without a word, and a report looking for ``"takeover"``
found nothing when a writer wrote ``"take_over"``. Now the writer
(:class:`mpipipe.core.logs.runlog.RunLog`) checks every record against these tables and
refuses an unknown column or event kind with an error naming it, and
``docs/hdf5-log.md`` is checked against them (tests/test_report.py).

The on-disk format is the one FORMAT_VERSION 1 has always had: :class:`EventKind` is a
``str`` enum whose values are the strings in existing files (``EventKind.TAKEOVER ==
"takeover"``), so a writer may pass either, and a reader compares either.

The ``recipe`` root attribute (what trained: model, optimizer, schedule, loss) is declared
here too (:data:`RECIPE`): :func:`mpipipe.core.run.recipe.describe` writes it and checks it
with :func:`check_recipe`, and ``mpipipe report`` reads it by these names.

Adding a column: add it to the group's tuple here (name, dtype, unit, meaning, who
writes it), describe it in docs/hdf5-log.md, and write it. Adding an event kind: add a
member to :class:`EventKind` and a row to the events table of docs/hdf5-log.md.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

__all__ = ["Column", "EventKind", "SchemaError", "STEP_COLUMNS", "EVAL_COLUMNS", "RANK_COLUMNS",
           "EVENT_COLUMNS", "GROUPS", "STR", "dtypes", "event_kind", "check_columns", "required", "markdown",
           "Field", "RECIPE", "check_recipe"]

#: The dtype of a variable-length UTF-8 string column.
STR = h5py.string_dtype("utf-8")


class SchemaError(ValueError):
    """A record does not fit the run log's schema (an unknown column or event kind).

    A programming error in a writer, raised where the record is made, before anything
    reaches the file: a log that quietly drops what it was given is worse than none.
    """


@dataclass(frozen=True)
class Column:
    """One column (an extendable 1-D dataset) of a group of the run log."""

    name: str
    dtype: Any  # a numpy scalar type, or STR
    unit: str  # "s", "bytes", "samples", "J", "" (a count or a number without unit), ...
    meaning: str
    written_by: str = "all"  # "all", or the system that adds it: "ResPipe", "Stannis"
    required: bool = True  # in every file whose group has rows (the report checks it); False: a
    # system's own column, or one that logs of older writers may lack


STEP_COLUMNS: tuple[Column, ...] = (
    Column("step", np.int64, "", "the optimizer step, 1-based"),
    Column("time", np.float64, "s", "seconds since the log was opened, when the step ended"),
    Column("loss", np.float64, "", "training loss, mean over the mini-batch"),
    Column("samples", np.int64, "samples", "samples applied in this step"),
    Column("samples_per_s", np.float64, "samples/s",
           "this step alone: its samples over the wall time since the previous row"),
)

EVAL_COLUMNS: tuple[Column, ...] = (
    Column("step", np.int64, "", "the step after which the model was evaluated"),
    Column("time", np.float64, "s", "seconds since the log was opened"),
    Column("accuracy", np.float64, "", "fraction of the held-out split classified right (0..1)"),
    Column("loss", np.float64, "", "mean loss on the held-out split (NaN if not measured)",
           required=False),
)

RANK_COLUMNS: tuple[Column, ...] = (
    Column("step", np.int64, "", "the step this row of the rank's figures belongs to"),
    Column("compute_s", np.float64, "s", "forward, backward and optimizer time"),
    Column("wait_s", np.float64, "s", "time blocked on messages"),
    Column("bytes_sent", np.int64, "bytes", "payload bytes sent in this step"),
    Column("bytes_recv", np.int64, "bytes", "payload bytes received in this step"),
    Column("ctrl_bytes_sent", np.int64, "bytes",
           "control-plane bytes sent, not in bytes_sent (docs/respipe.md)", "ResPipe", False),
    Column("batch_size", np.int64, "samples", "the rank's share of the global batch",
           "Stannis", False),
    Column("joules", np.float64, "J", "energy the rank used in this step (measured or modelled)",
           "Stannis", False),
    Column("busy_s", np.float64, "s", "from the end of the last gradient exchange to the start of "
           "this one: compute_s plus the optimizer, logging and evaluation", "Stannis", False),
    Column("mpi_bytes", np.int64, "bytes", "what MPI's own counters saw (-1: no counters)",
           "Stannis", False),
    Column("unaudited_bytes", np.int64, "bytes",
           "what MPI counted beyond the audited door's prediction", "Stannis", False),
)

EVENT_COLUMNS: tuple[Column, ...] = (
    Column("step", np.int64, "", "the step the event belongs to (0: before the first)"),
    Column("time", np.float64, "s", "seconds since the log was opened, when it happened"),
    Column("kind", STR, "", "what happened: one of EventKind"),
    Column("rank", np.int64, "", "the world rank it concerns, -1 when no single rank"),
    Column("detail", STR, "", "a JSON object of the kind's own figures"),
)

#: The groups of the file and their columns (``/ranks`` holds one group per rank).
GROUPS: dict[str, tuple[Column, ...]] = {
    "steps": STEP_COLUMNS, "eval": EVAL_COLUMNS, "ranks": RANK_COLUMNS, "events": EVENT_COLUMNS,
}


class EventKind(enum.StrEnum):
    """Every kind of event a run log holds; the value is the string in the file.

    The docstring after each member says who writes it; the detail keys of each are in
    docs/hdf5-log.md.
    """

    COST_MODEL = "cost_model"
    """ResPipe, step 0: the cost model's prediction for the run."""
    RESILIENCE_CHOSEN = "resilience_chosen"
    """ResPipe: ``"auto"`` chose the mode and R (step 0), or R again at a round."""
    FAULT_INJECTED = "fault_injected"
    """All: an injected fault fired."""
    LATE = "late"
    """Plain pipeline, ResPipe: a rank missed its deadline."""
    FAILURE_DETECTED = "failure_detected"
    """Plain pipeline, ResPipe: a rank died."""
    TAKEOVER = "takeover"
    """ResPipe: a backup took a stage over."""
    TAKEOVER_RECOVERED = "takeover_recovered"
    """ResPipe: the first step completed after a takeover."""
    STAGE_LOST = "stage_lost"
    """ResPipe: a stage failed with no backup left."""
    REJOINED = "rejoined"
    """ResPipe: a replaced rank came back as a backup."""
    LOG_WRITER_MOVED = "log_writer_moved"
    """ResPipe: another rank writes the log now."""
    CHECKPOINT = "checkpoint"
    """Plain pipeline, ResPipe: a checkpoint was written."""
    RESUME = "resume"
    """Plain pipeline, ResPipe: the run resumed from a checkpoint."""
    ROWS_DROPPED = "rows_dropped"
    """The run log, on --resume: rows of steps that run again were dropped."""
    RETUNE = "retune"
    """Stannis: the batch sizes were re-tuned."""
    CSD_DROPPED = "csd_dropped"
    """Stannis: a CSD was lost and dropped from the job."""
    MPI_ERROR_RECOVERED = "mpi_error_recovered"
    """Stannis: an MPI error was survived."""
    UNAUDITED_TRAFFIC = "unaudited_traffic"
    """Stannis: MPI counted bytes the audited door did not forward."""
    BENCHMARK = "benchmark"
    """Stannis, step 0: each rank's fitted speed."""
    ENERGY_SOURCE = "energy_source"
    """Stannis, step 0: where a rank's joules come from."""
    CPU_BINDING = "cpu_binding"
    """Stannis, step 0: the cores each rank is bound to."""


def event_kind(kind: str) -> EventKind:
    """``kind`` as an :class:`EventKind`.

    Raises:
        SchemaError: it is not one; the message lists the kinds there are.
    """
    try:
        return EventKind(kind)
    except ValueError:
        raise SchemaError(
            f"unknown event kind {kind!r}: a run log records only "
            f"{', '.join(k.value for k in EventKind)} (add a new kind to EventKind in "
            f"mpipipe/core/logs/logschema.py and to docs/hdf5-log.md)") from None


def dtypes(columns: Iterable[Column]) -> dict[str, Any]:
    """``name -> dtype`` of ``columns``, in order."""
    return {c.name: c.dtype for c in columns}


def required(group: str) -> tuple[str, ...]:
    """The columns a file must hold in ``group`` once the group has rows."""
    return tuple(c.name for c in GROUPS[group] if c.required)


def check_columns(group: str, names: Iterable[str], where: str = "") -> None:
    """Refuse a record with a column ``group`` does not declare.

    Raises:
        SchemaError: naming the unknown columns, where they were given, and the known ones.
    """
    known = {c.name for c in GROUPS[group]}
    unknown = sorted(set(names) - known)
    if unknown:
        raise SchemaError(
            f"unknown column{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
            f"for /{group}{' ' + where if where else ''}: the schema has "
            f"{', '.join(c.name for c in GROUPS[group])} (add a column to mpipipe/core/logs/logschema.py "
            f"and docs/hdf5-log.md)")


@dataclass(frozen=True)
class Field:
    """One key of a part of the ``recipe`` root attribute (a JSON object of objects)."""

    name: str
    meaning: str


#: The ``recipe`` root attribute: what trained, read from the objects that ran (the model,
#: the optimizer, the schedule, the loss), whether they came from the configuration or
#: were given to ``mpipipe.train`` / ``stannis.train``. Why beside ``config``: a script's
#: objects replace configuration keys, and the configuration alone then names defaults
#: that never ran (issue 37). :func:`mpipipe.core.run.recipe.describe` writes it, and checks
#: it here; ``mpipipe report`` reads it by these names. A part holds only the keys that
#: apply to it (a shipped model has a ``name``, a factory model a ``factory``).
RECIPE: dict[str, tuple[Field, ...]] = {
    "model": (
        Field("source", "`object` (an nn.Module given to train()), `builder` (a function given to "
                        "train() that returns one), `factory` (model.factory) or `shipped` (model.name)"),
        Field("class", "the class of the module that was built (before it was cut into a chain)"),
        Field("module", "where that class is defined: its import path, or the file it was loaded from"),
        Field("name", "`shipped` only: the model's name (lenet, vgg, resnet)"),
        Field("factory", "`factory` only: model.factory as the run resolved it"),
        Field("kwargs", "`factory` only: model.kwargs, the factory's keyword arguments"),
        Field("parameters", "the number of parameters (elements of the distinct parameter tensors)"),
        Field("digest", "`crc32:` and 8 hex digits: mpipipe.core.run.recipe.checksum of the model's "
                        "state_dict as built (parameters and buffers, in the model's own order), "
                        "before training or any checkpoint"),
    ),
    "optimizer": (
        Field("source", "`object` (a function given to train()) or `config` (optim.name)"),
        Field("class", "the optimizer's class"),
        Field("module", "where that class is defined"),
        Field("groups", "each param group's hyper-parameters as built: everything but `params` "
                        "(lr, betas, momentum, weight_decay, ...)"),
        Field("error", "why the optimizer could not be described (the run itself reports any failure)"),
    ),
    "schedule": (
        Field("source", "`object` (a scheduler function given to train()), `config` "
                        "(optim.scheduler, or optim.schedule when no scheduler is set)"),
        Field("class", "the scheduler's class (absent without a scheduler)"),
        Field("module", "where that class is defined"),
        Field("arguments", "the scheduler's own settings, read from the object as built: its "
                           "attributes less the optimizer and the step counters"),
        Field("group", "what the scheduler put in the optimizer's first param group "
                       "(OneCycleLR: max_lr, min_lr, initial_lr, ...)"),
        Field("first_step", "the hyper-parameters the scheduler sets for the first step"),
        Field("rule", "without a scheduler: optim.schedule (`constant` or `cosine`) on each "
                      "group's base rate"),
        Field("base", "without a scheduler: where the base rate comes from, `optim.lr` or "
                      "`optimizer` (the rate the given optimizer was built with)"),
        Field("lr", "without a scheduler, with base `optim.lr`: that rate"),
        Field("base_batch", "Stannis without a scheduler: the rate is scaled by global batch / base_batch"),
        Field("warmup_steps", "Stannis without a scheduler: the steps of linear warm-up to the scaled rate"),
    ),
    "loss": (
        Field("source", "`object` (given to train()) or `config` (model.loss)"),
        Field("class", "the loss's class, or the function's qualified name"),
        Field("module", "where it is defined"),
        Field("arguments", "a loss module's settings (reduction, label_smoothing, ...), or the "
                           "keywords a function is called with"),
    ),
}


def check_recipe(record: Mapping[str, Any]) -> None:
    """Refuse a ``recipe`` with a part or key :data:`RECIPE` does not declare.

    Raises:
        SchemaError: naming the unknown part or key and the declared ones.
    """
    for part, fields in record.items():
        if part not in RECIPE:
            raise SchemaError(f"unknown recipe part {part!r}: the schema has {', '.join(RECIPE)} "
                              f"(add it to RECIPE in mpipipe/core/logs/logschema.py and docs/hdf5-log.md)")
        known = {f.name for f in RECIPE[part]}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise SchemaError(f"unknown key(s) {', '.join(map(repr, unknown))} in recipe part "
                              f"{part!r}: the schema has {', '.join(sorted(known))} (add them to "
                              f"RECIPE in mpipipe/core/logs/logschema.py and docs/hdf5-log.md)")


def _type_name(dtype: Any) -> str:
    return "str" if dtype is STR else np.dtype(dtype).name


def markdown() -> str:
    """The column tables of docs/hdf5-log.md, made from the tables above.

    Why generated: the file must say what the writer writes; tests/test_report.py checks
    that docs/hdf5-log.md holds this text exactly. After changing a column, paste the
    output of ``python -m mpipipe.core.logs.logschema`` over the tables there.
    """
    out = []
    for group, columns in GROUPS.items():
        where = "/ranks/<r>" if group == "ranks" else f"/{group}"
        out += [f"`{where}/`:", "", "| column | type | unit | meaning | written by |", "|---|---|---|---|---|"]
        out += [f"| `{c.name}` | {_type_name(c.dtype)} | {c.unit or '-'} | {c.meaning} | "
                f"{c.written_by} |" for c in columns]
        out.append("")
    out += ["`recipe` (root attribute, JSON):", "", "| part | key | meaning |", "|---|---|---|"]
    out += [f"| {part} | `{f.name}` | {f.meaning} |" for part, fields in RECIPE.items() for f in fields]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
