"""`python -m mpipipe plan`: a dry run that shows how a configuration's model is cut into stages.

Why: a pipeline run only says how it cut the model once MPI is up and every rank has
built it; a factory that fx cannot trace, a balance that does not add up or a stage
that is far heavier than the others should be seen before asking a cluster for ranks.
This command builds the model exactly as a training run does (same configuration
loader, seed and :meth:`mpipipe.core.run.recipe.Recipe.build_model`), cuts it with the run's
partitioner, and prints every layer of the chain and, per stage, its layers, parameter
count, buffer bytes, the activation bytes it sends on and the exact bytes of its replica
(:attr:`mpipipe.core.state.stagestate.StageState.layout`, the size of the message a backup receives).
It needs no MPI and never imports mpi4py.

When ``pipeline.balance`` is empty the cut is the run's own: the dry run calls the
function the run calls (:func:`mpipipe.pipeline.partition.automatic_balance`), which
with ``pipeline.balance_by = "time"`` times every layer on one micro-batch with the
run's threads, as rank 0 of a run does, and cuts with the same rule. Timings are noisy,
so it measures MEASUREMENTS times and says whether they agreed; layers that take about
as long may swap sides between measurements, and the run measures again. The plan
prints the ``--set pipeline.balance=[...]`` that makes a run use its cut exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from mpipipe.core.run.cli import add_dry_run_arguments

if TYPE_CHECKING:
    from mpipipe.respipe.costmodel import StageShape

__all__ = ["StagePlan", "ModelPlan", "add_parser", "plan_main", "build_plan", "format_plan"]

PROG = "python -m mpipipe plan"
MEASUREMENTS = 3  # timings of the layers by which a dry run cuts, to see how stable the cut is


@dataclass(frozen=True)
class StagePlan:
    """One stage of the cut: what it holds and what it sends.

    ``layers`` are the half-open layer ranges of its chunks, in the stage's chunk order
    (one range per stage, several with an interleaved schedule); ``activations`` are the
    bytes per sample each chunk sends forward (0 for the model's last chunk, whose output
    goes to the loss); ``replica_bytes`` is the exact size of a replica of the stage
    (parameters, persistent buffers and optimizer state).
    """

    stage: int
    layers: list[tuple[int, int]]
    params: int
    param_bytes: int
    buffer_bytes: int
    optimizer_state_bytes: int
    activations: list[int]
    replica_bytes: int


@dataclass(frozen=True)
class ModelPlan:
    """The whole dry run: the model's chain and its cut into stages."""

    model: str
    input_shape: list[int]
    input_bytes: int
    layers: list[str]  # one line per layer (mpipipe.core.run.chain.describe)
    layer_params: list[int]
    num_stages: int
    chunks_per_stage: int
    schedule: str
    balance: list[int]
    balance_source: str  # "pipeline.balance", "params" or "time"
    optimizer: str
    stages: list[StagePlan] = field(default_factory=list)
    # An automatic cut's per-layer costs (seconds of forward+backward, or parameters + 1),
    # of the measurement that gave ``balance``; the cuts of the other measurements
    # (``balance`` once for each that agreed: the cut is as stable as they are alike).
    layer_costs: list[float] = field(default_factory=list)
    measured_cuts: list[list[int]] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)  # resilience.inject, a process with its first events

    @property
    def params(self) -> int:
        return sum(self.layer_params)

    def as_json(self) -> dict[str, Any]:
        """The plan as plain JSON values (what ``--json`` prints)."""
        out = asdict(self)
        for s in out["stages"]:
            s["layers"] = [list(r) for r in s["layers"]]
        out["params"] = self.params
        out["replica_bytes_total"] = sum(s.replica_bytes for s in self.stages)
        return out


def _in_shape(cfg: Mapping[str, Any], arg: str | None) -> tuple[int, int, int]:
    """The input's (C, H, W): from ``--in-shape`` or, as a run reads it, from the data set."""
    if arg:
        try:
            shape = tuple(int(v) for v in arg.split(","))
        except ValueError:
            shape = ()
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError(f"--in-shape {arg!r}: give three positive integers C,H,W, e.g. 1,8,8")
        return shape  # type: ignore[return-value]
    from mpipipe.core.run import batches

    try:
        return batches.image_shape(cfg["data"]["path"])
    except batches.DataError as e:
        raise ValueError(f"{e} (or pass --in-shape C,H,W)") from None


@dataclass(frozen=True)
class _Cut:
    balance: list[int]
    source: str
    costs: list[float] = field(default_factory=list)
    cuts: list[list[int]] = field(default_factory=list)


def _choose_balance(cfg: Mapping[str, Any], model: Any, in_shape: tuple[int, int, int], k: int,
                    v: int) -> _Cut:
    """The balance the run would use, with the same checks the run makes before cutting.

    An automatic cut comes from the run's own function, measured MEASUREMENTS times when
    by time: the cut most of them gave (the first such on a tie) is the plan's."""
    from mpipipe.pipeline.partition import automatic_balance, check_balance

    p = cfg["pipeline"]
    name = cfg["model"]["factory"] or cfg["model"]["name"]
    if p["balance"]:
        cut = _Cut(check_balance(model, p["balance"]), "pipeline.balance")
    else:
        if v * k > len(model):
            raise ValueError(f"pipeline.stages = {k}" + (f" with {v} chunks each" if v > 1 else "")
                             + f" but model {name} has only {len(model)} layers")
        by_time = p["balance_by"] == "time"
        seen = [automatic_balance(cfg, model, in_shape) for _ in range(MEASUREMENTS if by_time else 1)]
        cuts = [b for b, _ in seen]
        balance, costs = max(seen, key=lambda bc: cuts.count(bc[0]))  # (max keeps the first)
        cut = _Cut(balance, "time" if by_time else "params", costs, cuts)
    if len(cut.balance) != v * k:
        raise ValueError(f"pipeline.balance = {cut.balance} has {len(cut.balance)} entries for "
                         f"pipeline.stages = {k}" + (f" x {v} chunks" if v > 1 else ""))
    return cut


def build_plan(cfg: Mapping[str, Any], in_shape_arg: str | None = None) -> ModelPlan:
    """Build ``cfg``'s model as a run does and cut it as the run would.

    Raises:
        ValueError: any bad input, with a one-line message: an unreadable data set, a
            factory that cannot be imported or traced (RecipeError), a balance that does
            not fit, more stages than layers, an optimizer that cannot be built.
    """
    import torch

    from mpipipe.core.run import recipe
    from mpipipe.core.run.chain import describe
    from mpipipe.pipeline.config import chunks_per_stage
    from mpipipe.pipeline.partition import split
    from mpipipe.respipe.costmodel import stage_shapes

    in_shape = _in_shape(cfg, in_shape_arg)
    k = cfg["pipeline"]["stages"]
    if k < 1:
        raise ValueError(f"pipeline.stages = {k}: a pipeline has at least one stage")
    v = chunks_per_stage(cfg)
    torch.manual_seed(cfg["run"]["seed"])  # as training does: the same weights on every rank
    made = recipe.Recipe(cfg)
    model = made.build_model(in_shape)
    cut = _choose_balance(cfg, model, in_shape, k, v)
    balance = cut.balance
    chunks = split(model, balance)

    make_optimizer = made.make_optimizer

    try:
        shapes, in_bytes = stage_shapes(chunks, in_shape, make_optimizer, stages=k)
    except RuntimeError as e:  # a chunk that cannot run on this input (a wrong --in-shape)
        raise ValueError(f"model {cfg['model']['factory'] or cfg['model']['name']} does not run "
                         f"on input {in_shape}: {e}") from None
    stages = _stage_plans(chunks, balance, k, shapes, make_optimizer)
    return ModelPlan(
        model=cfg["model"]["factory"] or cfg["model"]["name"],
        input_shape=list(in_shape),
        input_bytes=in_bytes,
        layers=describe(model),
        layer_params=[sum(p.numel() for p in layer.parameters()) for layer in model],
        num_stages=k,
        chunks_per_stage=v,
        schedule=cfg["pipeline"]["schedule"],
        balance=balance,
        balance_source=cut.source,
        optimizer=cfg["optim"]["name"],
        stages=stages,
        layer_costs=cut.costs,
        measured_cuts=cut.cuts,
        faults=_faults(cfg),
    )


def _faults(cfg: Mapping[str, Any]) -> list[str]:
    """The injected faults (``resilience.inject``) as the run would draw them, on the
    launch plan of the configuration's own world (stages and backups, or its [plan]).

    Raises:
        ValueError: a bad fault spec, or a plan that does not fit (one line).
    """
    specs = cfg["resilience"].get("inject", [])
    if not specs:
        return []
    from mpipipe.core.mpi.faults import parse_all, preview
    from mpipipe.pipeline.plan import backup_counts, pipeline_plan

    k = cfg["pipeline"]["stages"]
    world = len(cfg["plan"]) if cfg.get("plan") else \
        k + sum(backup_counts(cfg["resilience"].get("backups", {}), k).values())
    launch = pipeline_plan(cfg, world)
    return [preview(f, launch) for f in parse_all(specs)]


def _stage_plans(chunks: Sequence[Any], balance: Sequence[int], k: int,
                 shapes: Sequence[StageShape], make_optimizer: Callable[[Any], Any]
                 ) -> list[StagePlan]:
    """Per stage: its layers, parameters, buffer and optimizer bytes, the activations it
    sends on and its replica's exact size, from the modules a run replicates."""
    import torch

    from mpipipe.core.state.stagestate import StageState
    from mpipipe.pipeline.partition import stage_modules

    starts = [sum(balance[:c]) for c in range(len(balance))]
    stages = []
    for s, module in enumerate(stage_modules(chunks, k)):  # the modules a run replicates
        lay = StageState(module, make_optimizer).layout
        buffers = sum(t.numel() * t.element_size() for t in module.state_dict(keep_vars=True).values()
                      if not isinstance(t, torch.nn.Parameter))
        mine = range(s, len(balance), k)
        stages.append(StagePlan(
            stage=s,
            layers=[(starts[c], starts[c] + balance[c]) for c in mine],
            params=sum(p.numel() for p in module.parameters()),
            param_bytes=lay.param_bytes,
            buffer_bytes=buffers,
            optimizer_state_bytes=lay.nbytes - lay.param_bytes - buffers,
            activations=list(shapes[s].chunk_acts),
            replica_bytes=lay.nbytes,
        ))
    return stages


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> list[str]:
    """Aligned columns; ``align`` has one letter per column: "l" (names) or "r" (numbers)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w)
                         for c, w, a in zip(cells, widths, align, strict=True)).rstrip()

    return [line(head), *(line(r) for r in rows)]


def format_plan(plan: ModelPlan) -> str:
    """The plan as aligned text (what ``python -m mpipipe plan`` prints)."""
    stage_of = {}
    for st in plan.stages:
        for a, b in st.layers:
            stage_of.update(dict.fromkeys(range(a, b), st.stage))
    buffers = sum(s.buffer_bytes for s in plan.stages)
    shape = "x".join(map(str, plan.input_shape))
    out = [f"model {plan.model}: {len(plan.layers)} layers, {plan.params:,} parameters, "
           f"{buffers:,} bytes of buffers; input {shape} ({plan.input_bytes:,} bytes/sample)"]
    timed = plan.balance_source == "time"
    rows = []
    for i, text in enumerate(plan.layers):
        _, _, rest = text.partition(": ")
        name, _, what = rest.partition(" (")
        ms = [f"{plan.layer_costs[i] * 1e3:.3f}"] if timed else []
        rows.append((str(i), str(stage_of.get(i, "?")), *ms, name, f"({what}" if what else ""))
    head = ("layer", "stage", *(["time (ms)"] if timed else []), "name", "holds")
    out += ["  " + r for r in _table(head, rows, "rrrll" if timed else "rrll")]
    chunks = f", {plan.chunks_per_stage} chunks per stage" if plan.chunks_per_stage > 1 else ""
    out.append(f"{plan.num_stages} stages ({plan.schedule}{chunks}), balance {plan.balance} "
               f"({_how(plan)})")
    rows = []
    for st in plan.stages:
        ranges = "/".join(f"{a}-{b - 1}" if b - a > 1 else str(a) for a, b in st.layers)
        acts = "/".join(f"{n:,}" if n else "-" for n in st.activations)
        rows.append((str(st.stage), ranges, f"{st.params:,}", f"{st.buffer_bytes:,}", acts,
                     f"{st.optimizer_state_bytes:,}", f"{st.replica_bytes:,}"))
    rows.append(("all", "", f"{plan.params:,}", f"{buffers:,}", "",
                 f"{sum(s.optimizer_state_bytes for s in plan.stages):,}",
                 f"{sum(s.replica_bytes for s in plan.stages):,}"))
    out += ["  " + r for r in _table(
        ("stage", "layers", "params", "buffers (B)", "activation out (B/sample)",
         f"optimizer state (B, {plan.optimizer})", "replica (B)"), rows, "rlrrrrr")]
    out.append("activation out: bytes per sample each chunk sends on (\"-\": the model's output, "
               "not sent);")
    out.append("replica: the exact bytes a backup receives (parameters, buffers, optimizer state).")
    if plan.faults:
        out.append("faults (resilience.inject; a process's times count from the run's start):")
        out += ["  " + f for f in plan.faults]
    return "\n".join(out)


def _how(plan: ModelPlan) -> str:
    """Where the balance comes from and, for a timed cut, how far to trust it."""
    if plan.balance_source == "pipeline.balance":
        return "from pipeline.balance"
    if plan.balance_source == "params":
        return "by parameters, as the run cuts"
    agree = plan.measured_cuts.count(plan.balance)
    others = sorted({str(c) for c in plan.measured_cuts if c != plan.balance})
    text = (f"by measured time, as the run cuts: {agree} of {len(plan.measured_cuts)} "
            "timings here cut so")
    if others:
        text += (f", the others {', '.join(others)}: layers that take about as long swap "
                 "sides with any noise, and the run times them again")
    return text + f"; to make the run cut so: --set 'pipeline.balance={plan.balance}'"


# -- `python -m mpipipe plan` ------------------------------------------------------------------

EPILOG = """\
example:
  python -m mpipipe plan --config jobs/configs/respipe-digits.toml \\
      --set model.factory="tests/models/own.py:own_net" --in-shape 1,8,8

Prints every layer of the chain (the units a balance counts) and, per stage, its
layers, parameters, buffer bytes, activation bytes per sample it sends on, and the
exact bytes of its replica. With an empty pipeline.balance the cut is made by the
run's own function; with balance_by = "time" it times the layers as rank 0 of a run
does (three times, and says whether they agreed) and prints the --set that makes a
run use exactly its cut.
Exit status 2, with one line on stderr, when the configuration cannot be run."""


def add_parser(subparsers: Any) -> Any:
    """Register ``plan`` on the ``python -m mpipipe`` dispatcher."""
    parser = subparsers.add_parser(
        "plan", help="show how the model is cut into stages, before a run (no MPI needed)",
        description="Dry run: build the configuration's model exactly as a training run does\n"
                    "and print its layers and the per-stage cut, before launching MPI.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dry_run_arguments(parser)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    parser.set_defaults(func=plan_main)
    return parser


def plan_main(args: Any) -> int:
    """Body of ``python -m mpipipe plan``; exit status 2 with one line on any bad input."""
    from mpipipe.core.run.configfile import load_config
    from mpipipe.pipeline.config import PIPELINE_CHOICES, PIPELINE_DEFAULTS

    try:
        cfg = load_config(args.config, args.set, PIPELINE_DEFAULTS, PIPELINE_CHOICES)
        plan = build_plan(cfg, args.in_shape)
    except ValueError as e:  # ConfigError, RecipeError, ChainError, DataError, StateError
        message = " ".join(str(e).split())  # one line, whatever the message held
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    print(json.dumps(plan.as_json()) if args.json else format_plan(plan))
    return 0
