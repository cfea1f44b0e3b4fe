"""What one rank of a Stannis job brings: its speed, power meter, data and cores.

Opened once at start-up, collectively (:func:`open_device`): each rank opens only its
own data, and the verdicts are shared so that every rank stops together on any rank's
error. Every rank learns the others' record counts (the tuner's caps), energy sources
(the summary's) and CPU bindings (which cores take turns).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from mpipipe.core.mpi.roles import Role
from mpipipe.core.run.batches import label_range_ok, transforms
from mpipipe.core.run.cli import Run

from .audit import AuditedComm
from .config import csd_dir, csd_profile
from .csd import CoreTurns, Stretch, cpu_binding
from .data import BatchStream, DataError, open_split
from .energy import EnergyError, PowerModel, make_meter


@dataclass
class Device:
    """This rank's device (the host's CPU or an emulated CSD) and what the ranks shared at start."""

    stretch: Stretch  # the emulated slow-down of this rank's compute
    max_batch: int  # the memory cap of this rank's batch
    meter: Any  # this rank's energy meter (energy.make_meter)
    stream: BatchStream  # this rank's training samples
    test: Any  # host: the public test split (checked at start; read by test_batches)
    records: dict[int, int]  # world rank -> its training records
    sources: dict[int, str]  # world rank -> its energy source
    bindings: dict[int, list[int] | None]  # world rank -> the CPUs it is bound to
    turns: CoreTurns  # the compute lock of this rank's core, if shared

    def in_shape(self, fail: Callable[[str], Any]) -> tuple[int, ...]:
        """The shape of one image; ``fail`` (which raises) when the records lack a field."""
        reader = self.stream.parts[0][0]
        fields = {f.name: f for f in reader.schema}
        if "image" not in fields or "label" not in fields:
            fail(f"{reader}: records need fields 'image' and 'label'")
        return tuple(fields["image"].shape)


def open_device(run: Run, comm: AuditedComm, role: Role) -> Device:
    """Set this rank's threads and priority, open its meter and data, bind its cores (collective)."""
    cfg, is_host = run.cfg, role.kind == "host"
    seed = cfg["run"]["seed"]
    if is_host:
        threads = cfg["run"]["threads"]
        power = PowerModel(cfg["host"]["idle_w"], cfg["host"]["active_w"])
        stretch, max_batch = Stretch(1.0), cfg["host"]["max_batch"]
        energy_source, emulated = cfg["host"]["energy"], False
    else:
        profile = csd_profile(cfg, role.index)
        threads, power = profile.threads, profile.power
        stretch, max_batch = Stretch(profile.slowdown), cfg["csd"]["max_batch"]
        energy_source, emulated = "auto", profile.emulated
        if emulated and cfg["csd"]["nice"] > 0:
            # A real CSD computes on the drive's own cores. Here its compute shares
            # the machine with the host, so it runs at low priority: it uses the
            # cores the host leaves idle instead of taking the host's.
            os.nice(cfg["csd"]["nice"])
    torch.set_num_threads(threads)

    # Each rank opens only its own data; the verdicts are shared so that every
    # rank stops together on any rank's error.
    error = meter = stream = test = None
    try:
        meter = make_meter(power, energy_source, emulated=emulated)
        stream, test = _open_data(cfg, role, run.rank, seed)
    except (DataError, EnergyError) as e:
        error = f"rank {run.rank} ({role}): {e}"
    verdicts = comm.allgather((error, len(stream) if error is None else 0,
                               meter.source if error is None else "",
                               MPI.Get_processor_name(), os.getpid()))
    errors = [v[0] for v in verdicts if v[0]]
    if errors:
        run.fail(errors[0])
    one_machine = len({v[3] for v in verdicts}) == 1
    bindings = dict(enumerate(comm.allgather(_bind_cpus(cfg, run.size, role, one_machine))))
    turns = _core_turns(comm, bindings, run.rank, job=f"{verdicts[0][4]}")  # the host's pid names the job
    comm.take()  # start-up traffic is not a training step's
    return Device(stretch, max_batch, meter, stream, test,
                  records={r: v[1] for r, v in enumerate(verdicts)},
                  sources={r: v[2] for r, v in enumerate(verdicts)},
                  bindings=bindings, turns=turns)


def _bind_cpus(cfg: dict, size: int, role: Role, one_machine: bool) -> list[int] | None:
    """Bind this rank's compute to its own cores when emulated CSDs share the host's machine.

    Only the calling (main) thread and the threads it starts later are bound:
    the host's log writer, already running, keeps every core. Returns the CPUs,
    or None if nothing was bound.
    """
    c = cfg["csd"]
    if not (c["bind_cpus"] and c["emulated"] and one_machine
            and hasattr(os, "sched_setaffinity")):
        return None
    profiles = [csd_profile(cfg, k) for k in range(1, size)]
    available = sorted(os.sched_getaffinity(0))
    cpus = cpu_binding(0 if role.kind == "host" else role.index,
                       [p.threads / p.slowdown for p in profiles], available)
    if cpus == available:
        return None
    os.sched_setaffinity(0, cpus)
    return cpus


def _core_turns(comm: AuditedComm, bindings: dict[int, list[int] | None], world_rank: int,
                job: str) -> CoreTurns:
    """Open the compute lock of this rank's core when other CSDs are bound to it too.

    Collective (every rank knows the bindings): all members open their lock
    file (named by ``job``, unique among running jobs), and after a barrier the
    first member of each shared core unlinks it (see CoreTurns).
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, cpus in bindings.items():
        if cpus:
            groups.setdefault(tuple(cpus), []).append(r)
    shared = {cpus: ranks for cpus, ranks in groups.items() if len(ranks) > 1}
    if not shared:
        return CoreTurns(None)
    mine = tuple(bindings[world_rank] or ())
    turns = CoreTurns(CoreTurns.name(job, mine) if mine in shared else None)
    comm.Barrier()
    if mine in shared and world_rank == shared[mine][0]:
        turns.release_name()
    return turns


def _open_data(cfg: dict, role: Role, world_rank: int, seed: int) -> tuple[BatchStream, Any]:
    """This rank's training stream (the host: the public records it keeps; a CSD: its
    private ones and its share of the public), and on the host the public test split."""
    root = cfg["data"]["path"]
    share = cfg["data"]["public_to_csds"]
    n = cfg["stannis"]["csds"]
    is_host = role.kind == "host"
    public = None
    if is_host or share > 0:
        public = open_split(f"{root}/public/train")
    parts = []
    test = None
    if is_host:
        test = open_split(f"{root}/public/test")  # checked now; read by test_batches
        keep = len(public) - int(round(share * len(public))) if n else len(public)
        parts.append((public, np.arange(keep)))
    else:
        private = open_split(csd_dir(cfg, role.index))
        parts.append((private, np.arange(len(private))))
        if share > 0:
            given = np.arange(len(public) - int(round(share * len(public))), len(public))
            parts.append((public, np.array_split(given, n)[role.index - 1]))
    classes = cfg["model"]["num_classes"]
    for reader in {id(r): r for r, _ in parts}.values():
        label_range_ok(reader, classes)  # DataError: labels outside the model's classes
    # Each sample's draws: (run.seed, this rank's epoch, its record in its data set);
    # a TransformError is a DataError, agreed on with the others' verdicts.
    augment = transforms(cfg["data"], seed=seed)
    return BatchStream(parts, seed=seed * 1000 + world_rank, num_classes=classes,
                       augment=augment), test
