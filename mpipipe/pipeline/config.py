"""The pipeline system's configuration: its sections, defaults and choices.

Why here and not in :mod:`mpipipe.core.run.configfile`: the core keeps the generic loader and
knows no system; each system declares its own schema (Stannis's is in stannis/config.py).
The choices of ``pipeline.schedule`` are read from the schedule registry
(:data:`mpipipe.pipeline.schedule.REGISTRY`), so a new schedule is a valid choice as soon
as it is registered. Importing this module imports neither torch nor MPI.
"""

from __future__ import annotations

from typing import Any

from mpipipe.core.run.configfile import IntOrAuto
from mpipipe.core.run.lr import SCHEDULES as LR_SCHEDULES
from mpipipe.core.run.recipe import MODEL_DEFAULTS, OPTIM_DEFAULTS
from mpipipe.pipeline.schedule import SCHEDULES, get, virtual_stages

__all__ = ["PIPELINE_DEFAULTS", "PIPELINE_CHOICES", "chunks_per_stage"]

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
        "watchdog_s": 0.0,  # no progress for this long ends the job, stacks dumped (0: max(60 s, 20 steps))
    },
    "data": {
        "path": "data/digits",  # directory with train/ and test/ shard data sets
        "batch_size": 64,  # mini-batch size (samples per optimizer step)
        "shuffle": True,  # reshuffle the train split every epoch (seeded)
        "drop_last": True,  # drop a last short batch (false: pad it by repeating records)
        # random ops on each training batch, in order: "random_crop:P" (zero-pad P pixels,
        # random crop back), "hflip", "vflip"; [] = none. Each sample's draws depend only on
        # (run.seed, epoch, record), so replays and resumed runs see the same samples.
        "augment": [],
        "mean": [],  # per-channel normalization (x/255 - mean) / std, train and test; [] = none
        "std": [],  # one value per channel each, or both []
    },
    "model": dict(MODEL_DEFAULTS),
    "optim": dict(OPTIM_DEFAULTS),
    "pipeline": {
        "stages": 3,  # K: number of pipeline stages (one rank each)
        "balance": [],  # layers per chunk (K entries; v x K for interleaved-1f1b); [] = automatic
        "balance_by": "time",  # time | params (automatic balancing)
        "chunks": 4,  # m: micro-batches per mini-batch
        "schedule": "1f1b",  # gpipe | 1f1b | interleaved-1f1b (mpipipe.pipeline.schedule.REGISTRY)
        # true: BatchNorm's running statistics move once per mini-batch, from all of it
        # (torchgpipe's DeferredBatchNorm); false: once per micro-batch, in order
        "deferred_batch_norm": False,
    },
    "plan": {},  # explicit launch plan: role name -> rank, e.g. "stage 0" = 0
    "resilience": {
        "backups": {},  # stage -> number of backup ranks, e.g. {1 = 1}; "all": one per stage
        "replicate_every": IntOrAuto(1),  # R: refresh replicas every R steps; "auto": chosen
        "mode": "cold",  # cold | hot | neighbour | auto (chosen at start-up, docs/goodput.md)
        "failure_rate": "",  # failures per rank you expect, e.g. "1/30min": what "auto" weighs
        "link_rate": "auto",  # for "auto": each node's link, e.g. "100mbit"; "auto": measured
        "deadline_s": 30.0,  # a wait longer than this marks the sender late
        "deadline_factor": 0.0,  # if > 0: deadline = factor x running median of that wait
        "allow_same_node": False,  # true: a backup may share its stage's node (multi-node worlds)
        "inject": [],  # fault specs, as with --inject
    },
}

PIPELINE_CHOICES: dict[str, tuple[str, ...]] = {
    "model.name": ("lenet", "vgg", "resnet"),
    "optim.schedule": LR_SCHEDULES,
    "pipeline.balance_by": ("time", "params"),
    "pipeline.schedule": SCHEDULES,
    "resilience.mode": ("cold", "hot", "neighbour", "auto"),
}


def chunks_per_stage(cfg: dict[str, Any]) -> int:
    """v, the model chunks each stage runs: len(balance) / stages for a schedule of several
    chunks per rank (2 when the balance is automatic: [] cuts the model into 2K chunks),
    else 1.

    Raises:
        ValueError: a balance whose length does not fit the schedule and stage count.
    """
    p = cfg["pipeline"]
    k, name = p["stages"], p["schedule"]
    if not p["balance"]:
        return 2 if get(name).virtual else 1
    try:
        return virtual_stages(name, len(p["balance"]), k)
    except ValueError as e:
        raise ValueError(f"pipeline.balance = {p['balance']} with pipeline.stages = {k}: {e}") from None
