"""Communication-cost model of the plain pipeline and of ResPipe: bytes per step and updates a takeover can lose.

Our reconstruction (the paper's formula is not available): every byte a run
counts is a payload the transport sends, so the model adds up payloads.

- Plain pipeline: for every stage boundary, each sample's activation goes
  forward and the gradient of the same shape comes back, so a boundary costs
  ``2 * batch * act_bytes`` per step (micro-batching splits, not adds). With an
  interleaved schedule every boundary between model chunks is one (v x K - 1 of
  them, rank K-1 sending back to rank 0 between rounds). Labels,
  if the engine sends them from stage 0 to the last stage, add
  ``batch * label_bytes``.
- Replicas: a backup (or, in neighbour mode, the neighbouring stage) receives
  its stage's parameters and optimizer state every R steps:
  ``(param_bytes + state_bytes) / R`` per step per replica holder.
- Hot mode: the stage also relays to each backup its input (the data itself
  for stage 0) and the gradients of its output, so the backup mirrors every
  update: ``batch * (act_in + act_out)`` per step per backup (the last stage's
  backup reads its labels itself).

The figures are averages over R steps; :meth:`Cost.at_step` gives the exact
integer bytes of one step (the replicas all go out on the steps that are a
multiple of R). Control traffic (the per-step figures sent to the log writer,
announcements, decisions) is not in the model and not in a run's ``bytes_sent``:
ResPipe counts it apart, as ``ctrl_bytes_sent`` (see docs/respipe.md).

A takeover loses at most R - 1 optimizer updates of the failed stage in cold
and neighbour modes (0 at R = 1), and none in hot mode, whose backup applies
every update itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "StageShape",
    "Cost",
    "predict",
    "lost_updates",
    "stage_shapes",
    "trade_off",
    "step_seconds",
    "exposed_bytes",
    "link_seconds",
    "shapes_from_config",
    "cut_from_config",
    "Cut",
    "MODES",
]

MODES = ("cold", "hot", "neighbour")
DEFAULT_R = (1, 2, 5, 10, 20, 50, 100)  # the R grid `mpipipe cost` and trade_off tabulate


@dataclass(frozen=True)
class StageShape:
    """What one stage costs to talk to: its output activation and its replica.

    ``act_out`` is bytes per sample of the activation it sends forward (0 for
    the last stage); ``params`` and ``state`` are the bytes of its parameters
    and of the rest a replica carries with them: buffers (BatchNorm's statistics) and
    the optimizer's state (mpipipe.core.state.statecodec).
    """

    act_out: int
    params: int
    state: int = 0
    acts: tuple[int, ...] = ()  # several chunks per stage: each chunk's sent activation

    @property
    def chunk_acts(self) -> tuple[int, ...]:
        """Bytes per sample each of its chunks sends forward, in the stage's chunk order."""
        return self.acts or (self.act_out,)

    @property
    def replica(self) -> int:
        return self.params + self.state


@dataclass(frozen=True)
class Cost:
    """Predicted payload bytes per optimizer step, summed over all ranks, and the loss bound."""

    pipeline: float
    labels: float
    replica: float
    shadow: float
    lost_updates: int
    per_holder: Mapping[int, float] = field(default_factory=dict)
    replica_round: int = 0
    replicate_every: int = 1
    # Average payload bytes per step each rank sends and receives, by role (see _links).
    links: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def at_step(self, step: int) -> int:
        """Exact payload bytes of optimizer step ``step`` (1-based, as the log counts).

        Why: the per-step averages hide a missing or doubled message; a run's byte
        counts are compared with this, integer for integer. Replicas go out after
        the steps whose count is a multiple of R, all in that step.
        """
        base = self.pipeline + self.labels + self.shadow
        burst = self.replica_round if step % self.replicate_every == 0 else 0
        return int(base) + burst

    @property
    def plain(self) -> float:
        return self.pipeline + self.labels

    @property
    def total(self) -> float:
        return self.pipeline + self.labels + self.replica + self.shadow

    @property
    def overhead(self) -> float:
        """ResPipe's extra bytes as a fraction of the plain pipeline's."""
        return (self.replica + self.shadow) / self.plain if self.plain else math.inf


def stage_shapes(partitions: Sequence[Any], in_shape: Sequence[int],
                 make_optimizer: Callable[[Any], Any], *, stages: int | None = None
                 ) -> tuple[list[StageShape], int]:
    """Each stage's activation and replica bytes, from a no-grad forward of one zero sample.

    Returns the shapes and the bytes per sample of the model's input. ``partitions``
    are the model's chunks in order (``nn.Sequential`` slices, as ``split`` cuts them),
    of which stage s holds s, s + K, ... when ``stages`` = K is fewer; or a pipeline's
    ``partitions`` (stage modules that hold their chunks). Replicas carry float32
    the stage's whole state, of all its chunks: parameters, buffers and the state of
    the optimizer ``make_optimizer(module)`` builds (:mod:`mpipipe.core.state.statecodec`, whose
    byte count is the replica message's, byte for byte).
    """
    import torch
    from torch import nn

    from mpipipe.core.state.stagestate import StageState
    from mpipipe.pipeline.partition import StageChunks

    parts = list(partitions)
    if parts and all(isinstance(p, StageChunks) for p in parts):
        k, v = len(parts), len(parts[0].chunks)
        parts = [parts[c % k].chunks[c // k] for c in range(v * k)]
        stages = stages or k
    k = stages or len(parts)
    if not parts or len(parts) % k:
        raise ValueError(f"{len(parts)} chunks do not divide over {k} stages")
    acts: list[int] = []
    with torch.no_grad():
        x = torch.zeros(1, *in_shape)
        in_bytes = x.numel() * x.element_size()
        for c, part in enumerate(parts):
            was = part.training
            part.eval()
            x = part(x)
            part.train(was)
            acts.append(x.numel() * x.element_size() if c < len(parts) - 1 else 0)
    out = []
    for s in range(k):
        module = nn.ModuleList(parts[s::k])
        lay = StageState(module, make_optimizer).layout
        mine = tuple(acts[s::k])
        out.append(StageShape(sum(mine), lay.param_bytes, lay.nbytes - lay.param_bytes,
                              mine if len(mine) > 1 else ()))
    return out, in_bytes


def lost_updates(replicate_every: int, mode: str) -> int:
    """The most optimizer updates of the failed stage a takeover can lose."""
    if mode == "hot" or replicate_every <= 1:
        return 0
    return replicate_every - 1


def _check(stages: Sequence[StageShape], backups: Mapping[int, int], replicate_every: int,
           mode: str, batch_size: int) -> None:
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: choose one of {', '.join(MODES)}")
    if replicate_every < 1:
        raise ValueError(f"replicate_every = {replicate_every}: must be >= 1")
    if batch_size < 1:
        raise ValueError(f"batch_size = {batch_size}: must be >= 1")
    for k in backups:
        if not 0 <= int(k) < len(stages):
            raise ValueError(f"backups name stage {k}, but stages are 0..{len(stages) - 1}")


def predict(
    stages: Sequence[StageShape],
    *,
    batch_size: int,
    backups: Mapping[int, int] | None = None,
    replicate_every: int = 1,
    mode: str = "cold",
    label_bytes: int = 0,
    input_bytes: int = 0,
) -> Cost:
    """Predicted bytes per step for a K-stage pipeline (plain if ``backups`` is empty).

    ``backups`` maps stage -> number of backups; in neighbour mode it names the
    protected stages and the count is ignored (one neighbour holds the replica).
    ``label_bytes`` is bytes per sample of labels sent to the last stage (0 if
    the last stage reads its own labels); ``input_bytes`` is bytes per sample of
    the model's input, which stage 0 relays to its hot backups.

    Raises:
        ValueError: an unknown mode, R < 1, or a backup for a stage that does not exist.
    """
    backups = {int(k): int(v) for k, v in (backups or {}).items() if int(v) > 0}
    _check(stages, backups, replicate_every, mode, batch_size)
    k_last = len(stages) - 1
    # one chunk per stage: the last one sends nothing; interleaved: every stage's chunks do
    senders = stages if any(s.acts for s in stages) else stages[:k_last]
    pipeline = float(sum(2 * batch_size * s.act_out for s in senders))
    labels = float(batch_size * label_bytes) if k_last > 0 else 0.0
    replica = shadow = 0.0
    replica_round = 0
    per_holder: dict[int, float] = {}
    for k, count in sorted(backups.items()):
        holders = 1 if mode == "neighbour" else count
        replica_round += holders * stages[k].replica
        rep = holders * stages[k].replica / replicate_every
        sh = 0.0
        if mode == "hot":
            act_in = stages[k - 1].act_out if k > 0 else input_bytes
            act_out = stages[k].act_out if k < k_last else 0
            sh = count * batch_size * (act_in + act_out)
        replica += rep
        shadow += sh
        per_holder[k] = rep + sh
    lost = lost_updates(replicate_every, mode) if backups else 0
    links = _links(stages, backups, batch_size, replicate_every, mode, label_bytes, input_bytes)
    return Cost(pipeline, labels, replica, shadow, lost, per_holder, replica_round,
                replicate_every, links)


def trade_off(
    stages: Sequence[StageShape],
    *,
    batch_size: int,
    backups: Mapping[int, int],
    modes: Sequence[str] = ("cold", "hot"),
    rs: Sequence[int] = DEFAULT_R,
    label_bytes: int = 0,
    input_bytes: int = 0,
) -> list[dict[str, Any]]:
    """One row per (mode, R): bytes per step, overhead over the plain pipeline, updates at risk."""
    rows = []
    for mode in modes:
        for r in rs:
            c = predict(stages, batch_size=batch_size, backups=backups, replicate_every=r,
                        mode=mode, label_bytes=label_bytes, input_bytes=input_bytes)
            rows.append({"mode": mode, "R": r, "plain_bytes": c.plain, "respipe_bytes": c.total,
                         "replica_bytes": c.replica, "shadow_bytes": c.shadow,
                         "overhead": c.overhead, "lost_updates": c.lost_updates})
    return rows


def _links(stages: Sequence[StageShape], backups: Mapping[int, int], batch_size: int,
           replicate_every: int, mode: str, label_bytes: int, input_bytes: int,
           ) -> dict[str, tuple[float, float]]:
    """Average payload bytes per step that each rank sends and receives, by rank role.

    Why: a testbed gives every rank a node with a link of its own, so what limits a
    step is the busiest link, not the sum over all of them (:func:`predict`). The
    roles are ``stage K``, ``backup K.I`` (cold and hot: the I-th backup of stage K on
    a node of its own). In neighbour mode stage k-1 holds stage k's replica (stage 1
    holds stage 0's), as ResPipe places it. The sends of all roles add up to
    :func:`predict`'s ``total``; :func:`predict` calls it with checked arguments and
    keeps the result as ``Cost.links``.
    """
    k_last = len(stages) - 1
    out: dict[str, list[float]] = {f"stage {k}": [0.0, 0.0] for k in range(len(stages))}

    def move(src: str, dst: str, n: float) -> None:
        out.setdefault(src, [0.0, 0.0])[0] += n
        out.setdefault(dst, [0.0, 0.0])[1] += n

    n_stages = len(stages)
    v = max(len(s.chunk_acts) for s in stages)
    # chunk c (on stage c mod K) sends to chunk c + 1; one chunk per stage: c = k
    for c in range(v * n_stages - 1):
        k, nxt = c % n_stages, (c + 1) % n_stages
        act = batch_size * stages[k].chunk_acts[c // n_stages]
        move(f"stage {k}", f"stage {nxt}", act)  # activations forward
        move(f"stage {nxt}", f"stage {k}", act)  # their gradients back
    if k_last > 0 and label_bytes:
        move("stage 0", f"stage {k_last}", batch_size * label_bytes)
    for k, count in sorted(backups.items()):
        replica = stages[k].replica / replicate_every
        if mode == "neighbour":
            if k_last > 0:
                move(f"stage {k}", f"stage {k - 1 if k > 0 else 1}", replica)
            continue
        act_in = stages[k - 1].act_out if k > 0 else input_bytes
        act_out = stages[k].act_out if k < k_last else 0
        for i in range(count):
            move(f"stage {k}", f"backup {k}.{i}", replica)
            if mode == "hot":
                move(f"stage {k}", f"backup {k}.{i}", batch_size * (act_in + act_out))
    return {role: (sent, received) for role, (sent, received) in out.items()}


def exposed_bytes(stages: Sequence[StageShape], *, batch_size: int, chunks: int) -> float:
    """Activation and gradient bytes a pipelined step waits for: one micro-batch's, at every
    boundary, each way.

    Why: the engine cuts a step's batch into ``chunks`` micro-batches and sends each
    one's activation forward (and its gradient back) while the stage goes on with the
    next. Only the first micro-batch's forward pass and the last one's backward pass
    have nothing to overlap with: they wait for every boundary's transfer in turn. So a
    boundary adds ``2 * batch / chunks * act_bytes`` to the step, not the ``2 * batch *
    act_bytes`` it carries (:func:`predict`); the rest counts once a link is busier than
    the step is long (:func:`step_seconds`). With an interleaved schedule every boundary
    between model chunks is one, as in :func:`predict`.

    Raises:
        ValueError: ``chunks`` below 1.
    """
    if chunks < 1:
        raise ValueError(f"chunks = {chunks}: a step has at least one micro-batch")
    n = len(stages)
    v = max(len(s.chunk_acts) for s in stages)
    per = batch_size / chunks
    return float(sum(2 * per * stages[c % n].chunk_acts[c // n] for c in range(v * n - 1)))


def link_seconds(nbytes: float, link_mbit: float) -> float:
    """Seconds that ``nbytes`` of payload take at ``link_mbit`` (10^6 bits per Mbit)."""
    if link_mbit <= 0:
        raise ValueError(f"link_mbit = {link_mbit}: a link rate must be > 0 Mbit/s")
    return nbytes * 8 / (link_mbit * 1e6)


def step_seconds(links: Mapping[str, tuple[float, float]], *, link_mbit: float, compute_s: float,
                 exposed: float | None = None) -> float:
    """The cost model turned into time: compute, plus bytes at the link rate.

    Why: the bytes of ``Cost.links`` say nothing about time until a link rate is
    given. On a testbed every node's link runs at ``link_mbit`` in each direction (sent
    and received are shaped apart), so what counts is the most loaded direction of one
    link. Two readings:

    - ``exposed`` not given: compute plus the busiest link's bytes of ``links`` at the
      rate, as if nothing overlapped (every byte waited for);
    - ``exposed`` given (:func:`exposed_bytes`: the activations and gradients a pipelined
      step waits for): compute plus those bytes at the rate, or the busiest link's bytes
      of ``links`` at the rate if that is longer. Everything else (the other
      micro-batches' activations, replicas, hot relays) is sent without waiting for the
      receiver and drains while the stages compute, so it costs time only once a link is
      busier than the step is long.

    Payload bytes, 10^6 bits per Mbit.

    Raises:
        ValueError: a link rate that is not positive, or negative compute or bytes.
    """
    if compute_s < 0:
        raise ValueError(f"compute_s = {compute_s}: compute time cannot be negative")
    busiest = link_seconds(max((max(s, r) for s, r in links.values()), default=0.0), link_mbit)
    if exposed is None:
        return compute_s + busiest
    if exposed < 0:
        raise ValueError(f"exposed = {exposed}: bytes cannot be negative")
    return max(compute_s + link_seconds(exposed, link_mbit), busiest)


def shapes_from_config(cfg: Mapping[str, Any], in_shape_arg: str | None = None
                       ) -> tuple[list[StageShape], int, list[int], str]:
    """Build the model of ``cfg`` and cut it as the run would (by parameters when automatic).

    Returns the stages' shapes, the input's bytes per sample, the balance and a note
    (non-empty when the run may cut elsewhere). ``in_shape_arg`` is "C,H,W" when the
    data set is not there to read the shape from.
    """
    from mpipipe.core.run import recipe

    cut = cut_from_config(cfg, in_shape_arg)
    try:
        shapes, in_bytes = stage_shapes(cut.parts, cut.in_shape, cut.make_optimizer,
                                        stages=cfg["pipeline"]["stages"])
    except recipe.RecipeError as e:
        raise ValueError(str(e)) from None
    return shapes, in_bytes, cut.balance, cut.note


@dataclass(frozen=True)
class Cut:
    """The model of a configuration, cut into its chunks as the run would cut it."""

    parts: list[Any]  # the chunks in order (stage s holds s, s + K, ...)
    in_shape: tuple[int, ...]
    make_optimizer: Callable[[Any], Any]
    balance: list[int]
    note: str  # non-empty when the run may cut elsewhere


def cut_from_config(cfg: Mapping[str, Any], in_shape_arg: str | None = None) -> Cut:
    """The model of ``cfg``, built with its seed and cut as the run would (by parameters
    when automatic): what the cost and goodput models measure.

    Raises:
        ValueError: a bad ``--in-shape``, no data set to read the shape from, or a
            model the recipe cannot build (one line each).
    """
    import torch

    from mpipipe.core.run import recipe
    from mpipipe.pipeline.config import chunks_per_stage
    from mpipipe.pipeline.partition import balance_by_params, check_balance, split

    if in_shape_arg:
        in_shape = tuple(int(v) for v in in_shape_arg.split(","))
        if len(in_shape) != 3:
            raise ValueError(f"--in-shape {in_shape_arg!r}: give C,H,W, e.g. 1,8,8")
    else:
        from mpipipe.core.run import batches

        try:
            in_shape = batches.image_shape(cfg["data"]["path"])
        except batches.DataError as e:
            raise ValueError(f"{e} (or pass --in-shape C,H,W)") from None
    torch.manual_seed(cfg["run"]["seed"])
    try:
        made = recipe.Recipe(cfg)
        model = made.build_model(in_shape)
    except recipe.RecipeError as e:
        raise ValueError(str(e)) from None
    k = cfg["pipeline"]["stages"]
    v = chunks_per_stage(cfg)  # v x K chunks with interleaved-1f1b
    note = ""
    if cfg["pipeline"]["balance"]:
        balance = check_balance(model, cfg["pipeline"]["balance"])
    else:
        balance = balance_by_params(model, k, v, cfg["pipeline"]["chunks"])
        if cfg["pipeline"]["balance_by"] == "time":
            note = " (by parameters; the run balances by measured time and may cut elsewhere)"
    return Cut(split(model, balance), tuple(in_shape), made.make_optimizer, list(balance), note)
