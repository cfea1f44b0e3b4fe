"""The user's training recipe: the model, optimizer, learning-rate schedule and loss, from
the ``[model]`` and ``[optim]`` sections of either system's configuration.

Why one module for both systems: ResPipe, the plain pipeline and Stannis build the same
recipe the same way, so a user's factory, ``torch.optim`` class, scheduler and loss work
in every mode. The names the project ships (``lenet``, ``sgd``, ``cosine``, ...) stay as
shortcuts.

Why the schedule is precomputed rather than carried: a step replayed after a takeover, a
hot mirror and a resumed run must all apply the hyperparameters the failure-free run
applied at that step. A torch scheduler is therefore stepped once per optimizer step on a
throwaway optimizer, and the values of step ``s`` (every group's ``lr``, and ``momentum``
or ``betas`` where the scheduler moves them, as OneCycleLR does) are set before step
``s``: the schedule is a pure function of the step, and no scheduler state needs to
travel in a replica. Schedulers that need a metric (ReduceLROnPlateau) are refused.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import math
import sys
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpipipe.core.run.lr import decay

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["RecipeError", "Recipe", "Schedule", "MODEL_DEFAULTS", "OPTIM_DEFAULTS", "resolve", "anchor",
           "checksum"]

MODEL_DEFAULTS: dict[str, Any] = {
    "name": "lenet",  # a shipped model (lenet | vgg | resnet), used when factory is empty
    "num_classes": 10,  # output classes of the model
    "factory": "",  # your model: "package.module:function" or "path/to/file.py:function"
    "kwargs": {},  # keyword arguments of the factory
    "loss": "cross_entropy",  # or "package.module:name" (a loss class or function)
    "loss_kwargs": {},  # keyword arguments of the loss, e.g. {label_smoothing = 0.1}
}

OPTIM_DEFAULTS: dict[str, Any] = {
    "name": "sgd",  # sgd | adam | any torch.optim class ("AdamW") | "package.module:Class"
    "lr": 0.05,  # learning rate (at the first step)
    "schedule": "constant",  # constant | cosine (towards 0 over the run's steps)
    "momentum": 0.9,  # SGD momentum (the sgd shortcut)
    "weight_decay": 0.0,  # L2 penalty (the sgd and adam shortcuts)
    "kwargs": {},  # keyword arguments of any other optimizer class (lr comes from optim.lr)
    "scheduler": "",  # any torch.optim.lr_scheduler class ("OneCycleLR") or an import string
    "scheduler_kwargs": {},  # its keyword arguments (total_steps filled from the run)
}


class RecipeError(ValueError):
    """A model, optimizer, scheduler or loss of the configuration cannot be built."""


def _suggest(word: str, known: Sequence[str]) -> str:
    near = [k for k in known if k.lower() == word.lower()]
    near += [k for k in difflib.get_close_matches(word, list(known), n=3, cutoff=0.5) if k not in near]
    near = near[:3]
    return f"; did you mean {', '.join(repr(n) for n in near)}?" if near else ""


def resolve(spec: str, what: str, base: Path | None = None) -> Any:
    """The object an import string names: ``"package.module:attr"`` (imported as Python
    would, with the current directory on the path) or ``"path/to/file.py:attr"`` (a
    relative path is looked up in ``base``, the config file's folder, then the current
    directory).

    Raises:
        RecipeError: the string is malformed, the module or file is missing or fails to
            import, or it has no such attribute (one line naming which).
    """
    if ":" not in spec:
        raise RecipeError(f"{what} = {spec!r}: give \"package.module:name\" or "
                          f"\"path/to/file.py:name\"")
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise RecipeError(f"{what} = {spec!r}: give \"package.module:name\" or "
                          f"\"path/to/file.py:name\"")
    try:
        if where.endswith(".py"):
            candidates = [Path(where)] if Path(where).is_absolute() else \
                [d / where for d in (base, Path.cwd()) if d is not None]
            path = next((p for p in candidates if p.is_file()), None)
            if path is None:
                raise RecipeError(f"{what} = {spec!r}: no file {where} (looked in "
                                  f"{', '.join(str(c.parent) for c in candidates)})")
            name = f"_mpipipe_user_{zlib.crc32(str(path.resolve()).encode()):08x}"
            module = sys.modules.get(name)
            if module is None:
                loader = importlib.util.spec_from_file_location(name, path)
                assert loader is not None and loader.loader is not None
                module = importlib.util.module_from_spec(loader)
                sys.modules[name] = module
                loader.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(where)
    except RecipeError:
        raise
    except ModuleNotFoundError as e:
        raise RecipeError(f"{what} = {spec!r}: cannot import {where} ({e})") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing
        raise RecipeError(f"{what} = {spec!r}: importing {where} failed: "
                          f"{type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        known = [n for n in dir(module) if not n.startswith("_")]
        raise RecipeError(f"{what} = {spec!r}: {where} has no {attr!r}{_suggest(attr, known)}")
    return getattr(module, attr)


_SPECS = (("model", "factory"), ("model", "loss"), ("optim", "name"), ("optim", "scheduler"))


def anchor(cfg: dict[str, Any], config_path: str | Path | None) -> None:
    """Make each relative ``file.py:name`` of the configuration absolute where the file
    lies beside the config file: a path resolves against the config file's folder first,
    then the current directory, and every rank must load the same file."""
    if config_path is None:
        return
    folder = Path(config_path).resolve().parent
    for section, key in _SPECS:
        spec = cfg.get(section, {}).get(key)
        if not isinstance(spec, str) or ":" not in spec:
            continue
        where, _, attr = spec.rpartition(":")
        if where.endswith(".py") and not Path(where).is_absolute() and (folder / where).is_file():
            cfg[section][key] = f"{folder / where}:{attr}"


def _call(fn: Callable[..., Any], what: str, *args: Any, **kwargs: Any) -> Any:
    """Call a user's callable; a wrong keyword is one line naming what it takes."""
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        raise RecipeError(f"{what}: {e}") from None
    except ValueError:  # no signature (a builtin): let the call say
        pass
    try:
        return fn(*args, **kwargs)
    except RecipeError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code failed: say where
        raise RecipeError(f"{what} failed: {type(e).__name__}: {e}") from None


class Recipe:
    """One run's recipe: the configuration's ``[model]`` and ``[optim]``, and the Python
    objects a script gave ``mpipipe.train`` / ``stannis.train`` (model: an ``nn.Module``
    or a builder of one; optimizer: the stage's module -> Optimizer; scheduler: Optimizer
    -> LRScheduler; loss), which take the place of the configuration's names.

    Why an object: it is built once per run and handed down, so two ``train()`` calls in
    one script, with different models, share nothing; and what the model was made of
    (its source, the user's names of the chain's tensors) stays with the run that made it.
    """

    def __init__(self, cfg: Mapping[str, Any], *, model: Any = None, optimizer: Any = None,
                 scheduler: Any = None, loss: Any = None, base: Path | None = None) -> None:
        self.cfg, self.base = cfg, base
        objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loss": loss}
        self.given: dict[str, Any] = {k: v for k, v in objects.items() if v is not None}
        self.names: dict[str, str] = {}  # the chain's state_dict name -> the user's model's
        self.keys: set[str] = set()  # the chain's state_dict names
        # How the model was made (for describe): its source (object | builder | factory |
        # shipped), the nn.Module the user's code returned, before it was cut into a chain
        # (its class is the user's), and the configuration's name, factory and kwargs.
        self.made: dict[str, Any] = {}

    # -- the model -------------------------------------------------------------------
    def build_model(self, in_shape: Sequence[int]) -> nn.Sequential:
        """The model as a chain a pipeline can cut: the script's object (or builder), a
        shipped one by ``model.name``, or the user's ``model.factory`` called with
        ``model.kwargs`` (an ``nn.Sequential`` is flattened, another module traced into
        pieces, :func:`mpipipe.core.run.chain.sequential`). Seed torch first: every rank must
        build the same weights (:func:`checksum` checks it).

        Raises:
            RecipeError: the factory cannot be found or called, returns no ``nn.Module``,
                or the model cannot be cut into a chain.
        """
        self.names, self.made = {}, {}
        chain = self._build(in_shape)
        self.keys = set(chain.state_dict())
        return chain

    def _build(self, in_shape: Sequence[int]) -> nn.Sequential:
        from torch import nn

        from mpipipe.core.run import models

        m = self.cfg["model"]
        if "model" in self.given:
            model = self.given["model"]
            source = "object"
            if not isinstance(model, nn.Module):
                source = "builder"
                model = _call(model, "the model builder given to train()")
                if not isinstance(model, nn.Module):
                    raise RecipeError(f"the model builder given to train() returned a "
                                      f"{type(model).__name__}, not an nn.Module")
            self.made.update(source=source, module=model)
            return self.as_chain(model, in_shape)
        if not m.get("factory"):
            if m.get("kwargs"):
                raise RecipeError(f"model.kwargs = {m['kwargs']} takes effect only with "
                                  f"model.factory; the shipped {m['name']!r} takes none")
            try:
                chain = models.build_model(m["name"], m["num_classes"], in_shape)
            except ValueError as e:
                raise RecipeError(str(e)) from None
            self.made.update(source="shipped", module=chain, name=m["name"])
            return chain
        fn = resolve(m["factory"], "model.factory", self.base)
        if not callable(fn):
            raise RecipeError(f"model.factory = {m['factory']!r} is a {type(fn).__name__}, "
                              f"not a function that returns an nn.Module")
        model = _call(fn, f"model.factory {m['factory']!r}", **dict(m.get("kwargs") or {}))
        if not isinstance(model, nn.Module):
            raise RecipeError(f"model.factory {m['factory']!r} returned a {type(model).__name__}, "
                              f"not an nn.Module")
        self.made.update(source="factory", module=model, factory=m["factory"],
                         kwargs=dict(m.get("kwargs") or {}))
        return self.as_chain(model, in_shape)

    def as_chain(self, model: nn.Module, in_shape: Sequence[int]) -> nn.Sequential:
        """``model`` as an ``nn.Sequential`` (:func:`mpipipe.core.run.chain.sequential`), checked
        on one zero sample of ``in_shape``; remembers the user's names of its tensors.

        Raises:
            RecipeError: the model cannot be cut into a chain (one line saying why).
        """
        import torch

        from mpipipe.core.run.chain import ChainError, sequential

        try:
            chain = sequential(model, torch.zeros(2, *in_shape))
        except ChainError as e:
            raise RecipeError(str(e)) from None
        # The chain's state_dict names are its own ("3.block1.conv1.weight"); the same
        # tensors have the user's names in their model: kept, so a result can be given
        # back in those, and an optimizer given param groups by them.
        # A tensor the model shares (tied weights) has several names in both: each of the
        # chain's takes the next of the user's, so none is lost.
        theirs: dict[int, list[str]] = {}
        for name, t in model.state_dict(keep_vars=True).items():
            theirs.setdefault(id(t), []).append(name)
        for name, t in chain.state_dict(keep_vars=True).items():
            left = theirs.get(id(t))
            if left:
                self.names[name] = left.pop(0) if len(left) > 1 else left[0]
        return chain

    def model_name(self) -> str:
        """What to call the model in messages: "your model", the factory, or the shipped name."""
        m = self.cfg["model"]
        return "your model" if "model" in self.given else m["factory"] or m["name"]

    def user_view(self, module: nn.Module) -> nn.Module:
        """``module`` (a stage, or the whole chain) as your model names its parts.

        Why: a stage is cut from the chain (:meth:`as_chain`), whose names are its own
        ("3.conv1.weight"); an optimizer given to train() builds param groups from
        ``named_parameters()`` in your model's names ("layer1.0.conv1.weight"), and finds
        norms with ``isinstance`` on ``modules()``. The view holds the stage's own modules
        (no copies), each at the place your model has it; a module the chain made (a
        traced piece) or a name it cannot map keeps the chain's, under ``chain.``. A
        stage of the project's shipped models is returned as it is.
        """
        return _view(module, self.names) if self.names else module

    # -- the optimizer, the schedule and the loss ------------------------------------
    def make_optimizer(self, module: nn.Module) -> torch.optim.Optimizer | None:
        """This stage's optimizer over ``module``'s parameters, or None for a stage without.

        ``sgd`` takes ``lr``, ``momentum`` and ``weight_decay``; ``adam`` ``lr`` and
        ``weight_decay``; any other class ``lr`` and ``optim.kwargs``. An optimizer a
        script gave is called with the stage's module as your model names its parts
        (:meth:`user_view`), so that param groups by name (no weight decay on norms and
        biases) work on every stage.

        Raises:
            RecipeError: an unknown optimizer or a keyword it does not take; a given
                optimizer written for a list of parameters (one line shows the fix).
        """
        params = list(module.parameters())
        if not params:
            return None
        if "optimizer" in self.given:
            return _given_optimizer(self.given["optimizer"], self.user_view(module))
        o = self.cfg["optim"]
        cls = _optimizer_class(o["name"], self.base)
        if o["name"] in _SHORTCUTS and o.get("kwargs"):
            raise RecipeError(f"optim.kwargs = {o['kwargs']} takes effect only with a class name "
                              f"(e.g. optim.name = \"{_SHORTCUTS[o['name']]}\"), not the "
                              f"{o['name']!r} shortcut")
        if o["name"] == "sgd":
            kwargs = {"momentum": o["momentum"], "weight_decay": o["weight_decay"]}
        elif o["name"] == "adam":
            kwargs = {"weight_decay": o["weight_decay"]}
        else:
            kwargs = dict(o.get("kwargs") or {})
        return _call(cls, f"optimizer {cls.__name__}", params, lr=o["lr"], **kwargs)

    def schedule(self, total: int) -> Schedule:
        """The hyperparameters of each of ``total`` steps (:class:`Schedule`).

        Raises:
            RecipeError: a scheduler that cannot be built or needs a metric.
        """
        return Schedule(self, total)

    def make_loss(self) -> Callable[..., Any]:
        """The loss the last stage calls on (output, labels): the script's, ``cross_entropy``
        or an import string (a class, instantiated with ``model.loss_kwargs``, or a function
        given them).

        Raises:
            RecipeError: an unknown loss or a keyword it does not take.
        """
        from torch import nn

        if "loss" in self.given:
            return self.given["loss"]
        m = self.cfg["model"]
        name, kwargs = m.get("loss", "cross_entropy"), dict(m.get("loss_kwargs") or {})
        if name == "cross_entropy":
            return _call(nn.CrossEntropyLoss, "loss cross_entropy", **kwargs)
        if ":" not in name:
            known = ["cross_entropy"] + [n for n in dir(nn) if n.endswith("Loss")]
            raise RecipeError(f"model.loss = {name!r}: give \"cross_entropy\" or an import string "
                              f"such as \"torch.nn:NLLLoss\"{_suggest(name, known)}")
        obj = resolve(name, "model.loss", self.base)
        if inspect.isclass(obj):
            return _call(obj, f"loss {obj.__name__}", **kwargs)
        if not callable(obj):
            raise RecipeError(f"model.loss = {name!r} is a {type(obj).__name__}, not callable")
        return functools.partial(obj, **kwargs) if kwargs else obj

    # -- what the log records --------------------------------------------------------
    def unused_keys(self) -> list[tuple[str, str]]:
        """The ``(section, key)`` pairs of the configuration's ``[model]`` and ``[optim]``
        that the recipe which runs does not read: those a script's object replaced,
        ``model.name`` beside a factory, a shipped model's ``factory`` and ``kwargs``, a
        shortcut optimizer's keys it does not take (``sgd``: kwargs; ``adam``: momentum
        and kwargs; a class: momentum and weight_decay), and the rate keys a scheduler
        overrides.

        Why: the log stores the configuration, and a key stored there reads as used; a run
        with the user's model and AdamW stored ``model.name = "lenet"`` and ``optim.name =
        "sgd"`` (issue 37).
        """
        cfg, given = self.cfg, self.given
        m, o = cfg.get("model"), cfg.get("optim")
        out: list[tuple[str, str]] = []
        if isinstance(m, Mapping):
            if "model" in given:
                out += _REPLACED["model"]
            elif m.get("factory"):
                out.append(("model", "name"))
            else:
                out += [("model", "factory"), ("model", "kwargs")]
            if "loss" in given:
                out += _REPLACED["loss"]
        if isinstance(o, Mapping):
            if "optimizer" in given:
                out += _REPLACED["optimizer"]
            elif o.get("name") == "sgd":
                out.append(("optim", "kwargs"))
            elif o.get("name") == "adam":
                out += [("optim", "momentum"), ("optim", "kwargs")]
            else:
                out += [("optim", "momentum"), ("optim", "weight_decay")]
            if "scheduler" in given:
                out += _REPLACED["scheduler"]
            elif o.get("scheduler"):
                out += _REPLACED["scheduler"][2:]  # a configured one: the rate keys
        seen: list[tuple[str, str]] = []
        for section, key in out:
            if key in cfg[section] and (section, key) not in seen:
                seen.append((section, key))
        return seen

    def stored_config(self) -> dict[str, Any]:
        """The configuration as the run log stores it: without :meth:`unused_keys` (absent,
        not empty: an absent key was replaced or does not apply; the ``recipe`` attribute
        says what ran)."""
        out = {section: dict(values) if isinstance(values, Mapping) else values
               for section, values in self.cfg.items()}
        for section, key in self.unused_keys():
            del out[section][key]
        return out

    def describe(self, model: nn.Module, schedule: Schedule, loss: Any, *,
                 optimizer: Any = None, rate: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The recipe that runs, as the log's ``recipe`` attribute records it (its keys:
        :data:`mpipipe.core.logs.logschema.RECIPE`): read from the objects themselves, whether
        the configuration named them or a script gave them.

        Call it on the log's writer right after :meth:`build_model`, before any step or
        checkpoint: the digest is of the model as built. ``model`` is the chain built;
        ``optimizer`` the one over the whole model where the caller holds one (Stannis),
        else one is made over ``model``'s parameters (a pipeline stage's holds only its
        own); ``rate`` the system's own keys of a rate without a scheduler (Stannis's
        base_batch and warmup_steps). Never raises for the user's objects (only the
        writer calls it, and one rank must not fail alone): what cannot be read is left
        out, or named under ``error``.

        Raises:
            mpipipe.core.logs.logschema.SchemaError: a part or key the schema does not declare.
        """
        from mpipipe.core.logs.logschema import check_recipe

        record = {"model": _model_part(model, self.made),
                  "optimizer": _optimizer_part(self, model, optimizer),
                  "schedule": schedule.describe(), "loss": _loss_part(loss, "loss" in self.given)}
        if rate and "rule" in record["schedule"]:
            record["schedule"].update({k: _plain(v) for k, v in rate.items()})
        check_recipe(record)
        return record


def _given_optimizer(fn: Callable[..., Any], module: nn.Module) -> Any:
    """``fn(module)``; a callable written for a parameter list (it fails on the module and
    builds an optimizer from the list) is told how to write it."""
    try:
        return _call(fn, "the optimizer given to train()", module)
    except RecipeError as first:
        try:
            fn(list(module.parameters()))
        except Exception:  # noqa: BLE001 - not a list-taking callable: the first error stands
            raise first from None
        raise RecipeError("the optimizer given to train() is called with the stage's module "
                          "(an nn.Module, your model's names), not a list of parameters: "
                          "write optimizer=lambda m: torch.optim.AdamW(m.parameters(), ...), "
                          "or build param groups from m.named_parameters()") from None


def _view(module: nn.Module, names: Mapping[str, str]) -> nn.Module:
    """:meth:`Recipe.user_view`: ``module``'s own modules, each at the user's path in
    ``names`` (chain name -> the user's), under plain containers that this view makes.

    Never a copy and never a change to a user's module: a tensor whose module cannot sit
    at the user's path (the path is taken, or is a user's module already placed) goes
    under ``chain.`` with the chain's name, and every tensor of ``module`` is in the view.
    """
    from torch import nn

    view = nn.Module()
    ours = {id(view)}  # the plain containers this view made: only these get tensors added
    for where, sub in module.named_modules():
        own = [(n, t) for n, t in sub.named_parameters(recurse=False)] + \
            [(n, t) for n, t in sub.named_buffers(recurse=False)]
        if not own:
            continue
        theirs = [names.get(f"{where}.{n}" if where else n) for n, _ in own]
        paths = {t.rpartition(".")[0] if t else None for t in theirs}
        path = paths.pop() if len(paths) == 1 else None
        if path and not list(sub.children()) and _free(view, path, ours):
            _attach(view, path, sub, ours)  # the user's own module: its class, hooks and all
            continue
        # A module with children, a top-level tensor of the user's model, or a place taken:
        # its own tensors, one by one, under the user's name where it is free.
        for (n, t), user in zip(own, theirs, strict=True):
            chain_name = f"chain.{where}.{n}" if where else f"chain.{n}"
            for place in (user, chain_name, chain_name.replace(".", "_")):
                if not place:
                    continue
                where_to, _, leaf = place.rpartition(".")
                holder = _container(view, where_to, ours)
                if holder is not None and leaf not in holder._parameters \
                        and leaf not in holder._buffers and leaf not in holder._modules:
                    break
            assert holder is not None
            if isinstance(t, nn.Parameter):
                holder.register_parameter(leaf, t)
            else:
                holder.register_buffer(leaf, t)
    return view


def _free(root: nn.Module, path: str, ours: set[int]) -> bool:
    """Whether dotted ``path`` under ``root`` is empty and reached through this view's own
    containers only."""
    node = root
    for part in path.split("."):
        if id(node) not in ours or part in node._parameters or part in node._buffers:
            return False
        child = node._modules.get(part)
        if child is None:
            return True
        node = child
    return False


def _container(root: nn.Module, path: str, ours: set[int]) -> nn.Module | None:
    """The plain container at dotted ``path`` (made on the way), or None where a user's
    module or a tensor is in the way."""
    from torch import nn

    node = root
    for part in path.split(".") if path else []:
        if part in node._parameters or part in node._buffers:
            return None
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            ours.add(id(child))
            node.add_module(part, child)
        elif id(child) not in ours:
            return None
        node = child
    return node


def _attach(root: nn.Module, path: str, module: nn.Module, ours: set[int]) -> None:
    """Put ``module`` at dotted ``path`` (free: :func:`_free`) under ``root``."""
    parent, _, last = path.rpartition(".")
    holder = _container(root, parent, ours)
    assert holder is not None and last not in holder._modules
    holder.add_module(last, module)


_SHORTCUTS = {"sgd": "SGD", "adam": "Adam"}


def _optimizer_class(name: str, base: Path | None = None) -> type:
    import torch

    if ":" in name:
        return resolve(name, "optim.name", base)
    cls_name = _SHORTCUTS.get(name, name)
    known = [n for n, c in vars(torch.optim).items()
             if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer]
    if cls_name not in known:
        raise RecipeError(f"optim.name = {name!r}: not a torch.optim optimizer"
                          f"{_suggest(cls_name, known + list(_SHORTCUTS))} (or give "
                          f"\"package.module:Class\")")
    return getattr(torch.optim, cls_name)


def _scheduler_class(name: str, base: Path | None = None) -> type:
    import torch

    if ":" in name:
        return resolve(name, "optim.scheduler", base)
    sched = torch.optim.lr_scheduler
    known = [n for n, c in vars(sched).items() if inspect.isclass(c) and n[0].isupper()
             and n not in ("LRScheduler", "Optimizer", "Counter")]
    if name not in known:
        raise RecipeError(f"optim.scheduler = {name!r}: not a torch.optim.lr_scheduler class"
                          f"{_suggest(name, known)} (or give \"package.module:Class\")")
    return getattr(sched, name)


_MOVED = ("lr", "momentum", "betas")  # what a scheduler may change in a group


class Schedule:
    """The hyperparameters of every optimizer step, as a pure function of the step.

    ``optim.schedule`` (constant | cosine) sets the rate; ``optim.scheduler`` (a torch
    scheduler class, stepped once per optimizer step) sets whatever it moves.
    """

    def __init__(self, recipe: Recipe, total: int) -> None:
        import torch

        o, base, given = recipe.cfg["optim"], recipe.base, recipe.given
        self._optim, self._total = dict(o), int(total)
        self._values: list[list[dict[str, Any]]] = []
        self._sched: Any = None
        # A given optimizer brings its own rate: optim.lr does not replace it.
        self._own_rate = "optimizer" in given
        self._settings: dict[str, Any] = {}
        self._moved_keys: set[str] | None = None
        if "scheduler" in given:
            self._opt = recipe.make_optimizer(torch.nn.Linear(1, 1, bias=False))
            self._sched = _call(given["scheduler"], "the scheduler given to train()", self._opt)
            self._settings = _scheduler_settings(self._sched, "object")
            return
        if not o.get("scheduler"):
            if o.get("scheduler_kwargs"):
                raise RecipeError(f"optim.scheduler_kwargs = {o['scheduler_kwargs']} takes "
                                  f"effect only with optim.scheduler")
            return
        if o.get("schedule", "constant") != "constant":
            raise RecipeError(f"optim.schedule = {o['schedule']!r} and optim.scheduler = "
                              f"{o['scheduler']!r} both set the rate: choose one (set "
                              f"optim.schedule = \"constant\" to keep the scheduler)")
        cls = _scheduler_class(o["scheduler"], base)
        if cls is torch.optim.lr_scheduler.ReduceLROnPlateau:
            raise RecipeError("optim.scheduler = 'ReduceLROnPlateau' needs a metric each step; "
                              "use a schedule of the step (OneCycleLR, CosineAnnealingLR, ...)")
        kwargs = dict(o.get("scheduler_kwargs") or {})
        try:
            takes = inspect.signature(cls).parameters
        except (TypeError, ValueError):
            takes = {}
        if "total_steps" in takes and "total_steps" not in kwargs and "epochs" not in kwargs:
            kwargs["total_steps"] = max(self._total, 1)
        opt = recipe.make_optimizer(torch.nn.Linear(1, 1, bias=False))
        self._opt = opt
        self._sched = _call(cls, f"scheduler {cls.__name__}", opt, **kwargs)
        self._settings = _scheduler_settings(self._sched, "config")

    @property
    def scheduled(self) -> bool:
        """Whether a scheduler (the configuration's or a script's) sets the rate."""
        return self._sched is not None

    def values(self, step: int) -> list[dict[str, Any]]:
        """Each group's scheduled hyperparameters at 0-based ``step``."""
        import warnings

        while len(self._values) <= step:
            self._values.append([{k: g[k] for k in _MOVED if k in g} for g in self._opt.param_groups])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # stepping past total_steps is the user's
                self._opt.step()
                try:
                    self._sched.step()
                except ValueError as e:  # OneCycleLR past its total_steps
                    raise RecipeError(f"optim.scheduler {type(self._sched).__name__} at "
                                      f"step {len(self._values)}: {e}") from None
        return self._values[step]

    def apply(self, optimizer: Any, step: int) -> None:
        """Give ``optimizer`` the hyperparameters of 0-based ``step``: the one call before
        every update (and before a replayed or mirrored one)."""
        if optimizer is None:
            return
        if self._sched is None:
            factor = decay(step, self._total, self._optim.get("schedule", "constant"))
            self.set_rates(optimizer, lambda base: base * factor)
            return
        values = self.values(step)[0]  # one group is scheduled: each group follows it
        moved = {k: v for k, v in values.items() if k in self._moved()}
        for group in optimizer.param_groups:
            group.update(moved)

    def _moved(self) -> set[str]:
        """What the scheduler changes over the run: the rate, and ``momentum`` or ``betas``
        only where it moves them (OneCycleLR); a group's own momentum or betas stay its own."""
        if self._moved_keys is None:
            self.values(max(self._total - 1, 0))  # every step's values, computed once
            self._moved_keys = {"lr"} | {k for k in _MOVED[1:]
                                          if len({repr(v[0].get(k)) for v in self._values}) > 1}
        return self._moved_keys

    def base_rate(self, group: dict[str, Any]) -> float:
        """The rate a group's schedule starts from: ``optim.lr``, or, for an optimizer a
        script gave, the rate that group was built with (kept in the group as
        ``initial_lr``, torch's own key, so that a checkpoint carries it: a resumed run
        must not take a scheduled rate for the base)."""
        if self._own_rate:
            return float(group.setdefault("initial_lr", group["lr"]))
        return float(self._optim["lr"])

    def set_rates(self, optimizer: Any, rate: Callable[[float], float]) -> None:
        """Set each group's rate to ``rate(base)`` (:meth:`base_rate`): the one place a
        rule without a scheduler (constant, cosine, Stannis's scaling) meets the groups."""
        for group in getattr(optimizer, "param_groups", ()):
            group["lr"] = rate(self.base_rate(group))

    def describe(self) -> dict[str, Any]:
        """The ``schedule`` part of the recipe that runs (mpipipe.core.logs.logschema.RECIPE)."""
        if self._sched is None:
            part: dict[str, Any] = {"source": "config", "rule": self._optim.get("schedule", "constant"),
                                    "base": "optimizer" if self._own_rate else "optim.lr"}
            if not self._own_rate:
                part["lr"] = float(self._optim["lr"])
            return part
        part = dict(self._settings)
        try:
            part["first_step"] = _plain(self.values(0)[0])
        except RecipeError:  # the run reports it at its first step
            pass
        return part


def checksum(module: nn.Module) -> int:
    """CRC-32 of a module's whole state (parameters and buffers, bytes in order): equal on
    every rank that built the same weights."""
    import torch

    crc = 0
    for t in module.state_dict().values():
        crc = zlib.crc32(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return crc


# ---------------------------------------------------------------- what the log records

# The configuration keys a script's object replaces: the run never reads them.
_REPLACED: dict[str, tuple[tuple[str, str], ...]] = {
    "model": (("model", "name"), ("model", "factory"), ("model", "kwargs")),
    "loss": (("model", "loss"), ("model", "loss_kwargs")),
    "optimizer": (("optim", "name"), ("optim", "lr"), ("optim", "momentum"), ("optim", "weight_decay"),
                  ("optim", "kwargs")),
    # A scheduler sets the rate: optim.schedule, and Stannis's scaled rate (stannis.config), go unread.
    "scheduler": (("optim", "scheduler"), ("optim", "scheduler_kwargs"), ("optim", "schedule"),
                  ("optim", "base_batch"), ("optim", "warmup_steps")),
}


def _where(obj: Any) -> tuple[str, str]:
    """(qualified name, where it is defined) of a class or function: its module's import
    path, or the file it came from where that has no importable name (a factory given as
    ``file.py:name``, a script's ``__main__``)."""
    qual = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    name = getattr(obj, "__module__", None) or ""
    if name == "__main__" or name.startswith("_mpipipe_user_"):
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            name = str(Path(file).resolve())
    return qual, name


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON can hold it: numbers, strings, lists and objects as they are, a
    tensor as its number (or its shape), a class or function as its qualified name, a
    scheduler as its class and settings, anything else as its repr."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if depth > 4:
        return repr(value)[:120]
    if isinstance(value, list | tuple):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if hasattr(value, "item") and hasattr(value, "shape"):  # a tensor or numpy value
        try:
            return _plain(value.item(), depth + 1)
        except (ValueError, RuntimeError):  # more than one element
            return f"{type(value).__name__}{list(value.shape)}"
    if hasattr(value, "optimizer") and hasattr(value, "last_epoch"):  # a nested scheduler
        return _scheduler_settings(value, "")
    if inspect.isclass(value) or inspect.isfunction(value) or inspect.ismethod(value):
        qual, where = _where(value)
        return f"{where}.{qual}" if where else qual
    return repr(value)[:200]


# A scheduler's attributes that are its state or its optimizer, not its settings.
_SCHEDULER_STATE = frozenset({"optimizer", "last_epoch", "_step_count", "_is_initial",
                              "_get_lr_called_within_step", "_last_lr", "verbose", "_initial_step"})


def _scheduler_settings(sched: Any, source: str) -> dict[str, Any]:
    """A scheduler as built: its class, its settings (its attributes less its state), and
    what it put in the optimizer's first param group (OneCycleLR keeps max_lr there).
    Read before it steps: the values of step 1 are asked for separately."""
    qual, where = _where(type(sched))
    part: dict[str, Any] = {"source": source} if source else {}
    part.update({"class": qual, "module": where})
    part["arguments"] = {k: _plain(v) for k, v in vars(sched).items() if k not in _SCHEDULER_STATE}
    opt = getattr(sched, "optimizer", None)
    groups, defaults = getattr(opt, "param_groups", None), getattr(opt, "defaults", {})
    if groups:
        part["group"] = {k: _plain(v) for k, v in groups[0].items() if k != "params" and k not in defaults}
    if not source:
        part.pop("source", None)
    return part


def _model_part(chain: nn.Module, made: Mapping[str, Any]) -> dict[str, Any]:
    """The model as :meth:`Recipe.build_model` made it (``made``), or ``chain`` itself."""
    module = made.get("module", chain)
    qual, where = _where(type(module))
    part: dict[str, Any] = {"source": made.get("source", "object"), "class": qual, "module": where}
    for key in ("name", "factory", "kwargs"):
        if key in made:
            part[key] = _plain(made[key])
    part["parameters"] = int(sum(p.numel() for p in module.parameters()))
    part["digest"] = f"crc32:{checksum(module):08x}"
    return part


def _optimizer_part(recipe: Recipe, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    part: dict[str, Any] = {"source": "object" if "optimizer" in recipe.given else "config"}
    try:
        opt = optimizer if optimizer is not None else recipe.make_optimizer(model)
    except Exception as e:  # noqa: BLE001 - the stages build theirs and say what is wrong
        part["error"] = f"{type(e).__name__}: {e}"
        return part
    if opt is None:
        part["error"] = "the model has no parameters"
        return part
    qual, where = _where(type(opt))
    part.update({"class": qual, "module": where})
    part["groups"] = [{k: _plain(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return part


def _loss_part(loss: Any, given: bool) -> dict[str, Any]:
    """A loss module (its class and settings), a function, or a ``functools.partial`` of one
    (its function and keywords); ``given``: a script's object."""
    from torch import nn

    part: dict[str, Any] = {"source": "object" if given else "config"}
    target, arguments = loss, None
    if isinstance(loss, functools.partial):
        target, arguments = loss.func, {k: _plain(v) for k, v in loss.keywords.items()}
    elif isinstance(loss, nn.Module):
        arguments = {k: _plain(v) for k, v in vars(loss).items() if not k.startswith("_") and k != "training"}
        arguments.update({k: _plain(v) for k, v in loss.named_buffers() if v is not None})
    elif not (inspect.isfunction(target) or inspect.isbuiltin(target)):
        arguments = {k: _plain(v) for k, v in getattr(loss, "__dict__", {}).items() if not k.startswith("_")}
    qual, where = _where(target if inspect.isfunction(target) or inspect.isbuiltin(target)
                         or inspect.isclass(target) else type(target))
    part.update({"class": qual, "module": where})
    if arguments:
        part["arguments"] = arguments
    return part
