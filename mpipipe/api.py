"""``mpipipe.train(...)``: train your model from a Python script, as a torchrun script does.

Run the script on every rank under mpirun (``mpirun -n 3 python my_script.py``); the
configuration (a TOML path or a dict of the same shape) decides the plain pipeline or
ResPipe, exactly as ``python -m mpipipe train`` does, which is the same program.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from mpipipe.core.run.configfile import ConfigError, load_config
from mpipipe.core.run.python_api import Result, TrainingFailed, run_command, shared_log_path, stage_states
from mpipipe.pipeline.config import PIPELINE_CHOICES, PIPELINE_DEFAULTS

__all__ = ["train", "Result", "TrainingFailed"]


def train(config: str | Path | Mapping[str, Any] | None = None, *, model: Any = None,
          optimizer: Callable[[list[Any]], Any] | None = None,
          scheduler: Callable[[Any], Any] | None = None,
          loss: Callable[[Any, Any], Any] | None = None, log: str | Path | None = None,
          settings: Iterable[str] = (), resume: str | Path | None = None,
          quiet: bool = False, overwrite: bool = False) -> Result:
    """Train on this rank; call it on every rank of the job.

    Args:
        config: a TOML file or a dict of the same sections (``{"pipeline": {"stages": 3}}``).
        model: an ``nn.Module`` (each rank must build the same weights: seed torch first,
            or pass a zero-argument builder, called after ``run.seed`` seeds torch).
        optimizer: ``params -> torch.optim.Optimizer``, called for each stage's parameters.
        scheduler: ``optimizer -> LRScheduler``, stepped once per optimizer step.
        loss: ``(output, labels) -> scalar``, the mean over a micro-batch.
        log: the HDF5 run log (default ``runs/mpipipe-<time>.h5``).
        settings: ``KEY=VALUE`` overrides, as ``--set`` takes them.

    Returns:
        A :class:`~mpipipe.core.run.python_api.Result`; on the rank that wrote the log its metrics
        and the final whole-model ``state_dict`` in your model's names.

    Raises:
        TrainingFailed: the run did not complete. A bad configuration or a lost stage
            ends the job with one error line, as the command line does.
    """
    from mpipipe.train_command import main

    path = shared_log_path(log, "mpipipe")
    sets = list(settings)
    try:  # the final state is read from each stage's last checkpoint: make sure there is one
        cfg = load_config(config, sets, PIPELINE_DEFAULTS, PIPELINE_CHOICES)
        ckpt = cfg["run"]["checkpoint_dir"]
        if not ckpt:
            ckpt = str(path.with_suffix("")) + "-ckpt"
            if not cfg["run"]["checkpoint_every"]:
                sets.append(f'run.checkpoint_dir="{ckpt}"')
    except ConfigError:
        ckpt = ""  # the command says what is wrong

    def state(run: Any) -> dict[str, Any] | None:
        return stage_states(Path(ckpt), int(run.result["steps"])) if ckpt else None

    return run_command(main, config, prog="mpipipe.train", log=path, settings=sets,
                       resume=resume, quiet=quiet, overwrite=overwrite, state=state,
                       objects={"model": model, "optimizer": optimizer,
                                "scheduler": scheduler, "loss": loss})
