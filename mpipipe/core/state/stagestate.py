"""The one owner of a stage's training state: its module, its optimizer and its step.

Everything that moves a stage's state goes through a :class:`StageState`: ResPipe's
replicas, the hot mirror, rollback snapshots, rejoin re-syncs and neighbour merges
(:meth:`pack` / :meth:`unpack` / :meth:`absorb`), checkpoints (:meth:`save` /
:meth:`load`), Stannis's broadcast of the host's state, and the final state a script
gets back (:meth:`model_state`). Nothing else builds or replaces a stage's optimizer:
a promoted backup or a merged neighbour builds a new state with the run's recipe.

Two encodings of one state, each where it fits (docs/internals.md, "A stage's state"):

- **in flight, a flat buffer** (:mod:`mpipipe.core.state.statecodec`): a replica or a
  snapshot is one MPI message or one copy, of a size known before the optimizer's first
  step (:attr:`nbytes`, what the cost model predicts);
- **on disk, the state_dict** (:meth:`state_dict`): a checkpoint is
  ``torch.save(state.state_dict())`` plus where it belongs (stage, balance, data
  position). It must outlive this run's code, be read with ``weights_only=True``, and be
  opened by a torch user without us; the flat layout depends on the optimizer's class
  and the parameters' order, which is fine between the ranks of one run only.

The learning-rate schedule's position is the step itself: the schedule is a pure function
of it (:meth:`mpipipe.core.run.recipe.Schedule.apply`), so :meth:`apply_step` takes the
schedule and the step alone carries it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpipipe.core.state.statecodec import StateLayout, layout_of, pack_state, unpack_state

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["StageState", "MakeOptimizer"]

MakeOptimizer = Callable[["nn.Module"], Any]


class StageState:
    """A stage's module, its optimizer (built by the run's recipe) and its step count.

    ``make_optimizer(module)`` is the run's recipe for an optimizer over a stage module;
    it may return None (a stage without parameters to train). ``optimizer`` adopts one
    already built (the plain pipeline builds it before it knows whether to resume).
    """

    def __init__(self, module: nn.Module, make_optimizer: MakeOptimizer, *, step: int = 0,
                 optimizer: Any = None) -> None:
        self.module = module
        self._make_optimizer = make_optimizer
        self.optimizer = optimizer if optimizer is not None else make_optimizer(module)
        self.step = int(step)

    # -- in flight: the flat buffer ------------------------------------------------------
    @property
    def layout(self) -> StateLayout:
        """Where each tensor lies in :meth:`pack`'s buffer (parameters apart from the rest)."""
        return layout_of(self.module, self.optimizer)

    @property
    def nbytes(self) -> int:
        """Exact bytes of :meth:`pack`'s buffer (a replica's message size)."""
        return self.layout.nbytes

    def pack(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The module's ``state_dict`` and the optimizer's per-parameter state, as one flat
        uint8 tensor (``out`` reused if given)."""
        return pack_state(self.module, self.optimizer, out)

    def unpack(self, flat: torch.Tensor, count: int, *, step: int | None = None) -> None:
        """Load a buffer of :meth:`pack` taken at step ``count`` (0: before any optimizer
        step, so the optimizer is left without state); the state's step becomes ``step``
        (default ``count``: a rollback to a snapshot may name the step to replay).

        Raises:
            mpipipe.core.state.statecodec.StateError: the buffer is of another layout.
        """
        unpack_state(flat, self.module, self.optimizer, count)
        self.step = count if step is None else step

    def absorb(self, merged: nn.Module, ward: nn.Module, flat: torch.Tensor,
               count: int) -> None:
        """Neighbour takeover: this stage's layers and a lost ward's become one stage
        (``merged``, sharing both modules' parameters). One new optimizer covers both; it
        keeps this stage's per-parameter state, and the ward's comes from its replica."""
        old = self.optimizer
        opt = self._make_optimizer(merged)
        if old is not None:
            for p in self.module.parameters():
                if p in old.state:
                    opt.state[p] = old.state[p]
        unpack_state(flat, ward, opt, count)
        self.module, self.optimizer = merged, opt

    # -- the step ------------------------------------------------------------------------
    def apply_step(self, schedule: Any, step: int) -> None:
        """Apply step ``step``'s update (gradients are in place): the schedule's
        hyperparameters of that step, then the optimizer; the state is then at ``step + 1``."""
        if self.optimizer is not None:
            schedule.apply(self.optimizer, step)
            self.optimizer.step()
        self.step = step + 1

    # -- on disk: the state_dict ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The portable form: ``{"step", "module", "optimizer"}`` (torch's own dicts)."""
        opt = self._optim()
        return {"step": self.step, "module": self.module.state_dict(),
                "optimizer": opt.state_dict() if opt is not None else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s form.

        Raises:
            mpipipe.core.state.checkpoint.CheckpointError: it does not fit this module
                and optimizer (another model, another optimizer, another balance).
        """
        from mpipipe.core.state.checkpoint import CheckpointError

        try:
            self.module.load_state_dict(state["module"])
            opt = self._optim()
            if state.get("optimizer") and opt is not None:
                opt.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(f"does not fit this model and optimizer: {e}") from None
        self.step = int(state["step"])

    def save(self, directory: str | Path, *, stage: int, balance: Sequence[int],
             sampler: tuple[int, int] = (-1, -1), eval_count: int = 0) -> Path:
        """Write this state as stage ``stage``'s checkpoint (atomically)."""
        from mpipipe.core.state import checkpoint

        return checkpoint.save_stage(directory, self.state_dict(), stage=stage,
                                     balance=balance, sampler=sampler, eval_count=eval_count)

    def model_state(self) -> dict[str, Any]:
        """A detached copy of the module's ``state_dict`` (the final model, gathered)."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def _optim(self) -> torch.optim.Optimizer | None:
        """The optimizer when it is a torch one, for its ``state_dict`` (a user's may be
        something else: a checkpoint then carries the module alone)."""
        import torch

        return self.optimizer if isinstance(self.optimizer, torch.optim.Optimizer) else None
