"""Turn a chain-shaped model into the flat nn.Sequential a pipeline cuts into stages.

Why: the pipeline (mpipipe.pipeline.partition) cuts an nn.Sequential on its children, but
users bring ResNets and other modules whose forward is code, not a list. :func:`sequential`
flattens an nn.Sequential, and traces any other module with torch.fx and cuts its graph
wherever exactly one tensor flows on (so a residual block, whose input is still needed by
its final add, stays whole). Every layer of the chain holds the model's own parameters and
buffers, not copies: training the chain trains the model.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

__all__ = ["ChainError", "sequential", "describe"]


class ChainError(ValueError):
    """A model that cannot be made a chain; the message is one line saying why and what to do."""


def sequential(model: nn.Module, example_input: torch.Tensor | None = None) -> nn.Sequential:
    """Return `model` as a flat nn.Sequential whose layers share the model's parameters.

    An nn.Sequential (one that keeps nn.Sequential's forward) is flattened: nested ones are
    expanded, every other child stays one layer, and the layers are the same module objects.
    Any other module is traced by torch.fx and cut at every point where one tensor alone is
    live, except inside a submodule whose own forward is not a chain (a residual block stays
    whole, its closing relu too) and before an in-place write into that tensor. Each piece is
    a torch.fx.GraphModule that keeps the model's module names (the chain's state_dict keys
    are "<layer index>." + the model's). A parameter or buffer used in two places keeps both
    uses in one piece, so no weight is split over two stages.

    With `example_input`, the chain is run on it against the model (eval mode, no_grad, the
    same random seed for both) and must give the same bits. Without it, cut points are chosen
    by how the graph uses each value; with it, a cut whose value is not a tensor on the
    example is also dropped.

    Raises:
        ChainError: fx cannot trace the model, forward takes more than one input or does not
            return one tensor, the model has no layers, or the chain differs on example_input.
    """
    name = type(model).__name__
    if _plain_sequential(model):
        chain = nn.Sequential(*_flatten(model))
        if not len(chain):
            raise ChainError(f"{name} has no layers: a pipeline needs at least one")
    else:
        chain = _traced_chain(model, example_input)
    _sync_training(chain, model)
    if example_input is not None:
        _check_same(model, chain, example_input)
    return chain


def describe(chain: nn.Sequential) -> list[str]:
    """One short line per layer of `chain`: its name, what it holds and its parameter count.

    Why: a balance is a list of layer counts, so choosing one means knowing which layer is
    which. A traced piece is named by the shortest module paths that no other piece shares
    (a residual block reads "layer1.0", not its seven calls); other layers by their class.
    """
    pieces = list(chain._modules.items())
    owners = [_targets(layer) for _, layer in pieces]
    lines = []
    for i, (key, layer) in enumerate(pieces):
        params = sum(p.numel() for p in layer.parameters())
        if isinstance(layer, fx.GraphModule):
            others = [t for j, ts in enumerate(owners) if j != i for t in ts]
            label = _short_list(_unique_prefixes(owners[i], others) or _op_names(layer.graph))
            ops = sum(n.op not in ("placeholder", "output", "get_attr") for n in layer.graph.nodes)
            kind = f"{ops} op{'s' * (ops != 1)}"
        else:
            label, kind = type(layer).__name__, _short(layer.extra_repr(), 60)
        lines.append(f"{key}: {label} ({kind}{', ' * bool(kind)}{params:,} params)")
    return lines


# --- nn.Sequential ---------------------------------------------------------------------------

def _plain_sequential(module: nn.Module) -> bool:
    """Whether `module` runs its children in order and nothing else (so it may be flattened):
    an nn.Sequential that keeps Sequential's forward and has no forward hooks of its own."""
    return (isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward
            and not module._forward_hooks and not module._forward_pre_hooks)


def _flatten(module: nn.Sequential) -> Iterator[nn.Module]:
    for child in module:
        if _plain_sequential(child):
            yield from _flatten(child)
        else:
            yield child


# --- tracing and cutting ---------------------------------------------------------------------

# Calls whose value is not a tensor (sizes, tuples of chunks): never a cut point, nor a model's output.
_NOT_TENSOR_METHODS = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "item", "tolist", "stride", "element_size",
    "is_contiguous", "is_floating_point", "data_ptr", "get_device", "__len__",
    "chunk", "split", "split_with_sizes", "unbind", "tensor_split", "hsplit", "vsplit", "dsplit"})
_NOT_TENSOR_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset({
    len, torch.split, torch.chunk, torch.unbind, torch.tensor_split, torch.hsplit,
    torch.vsplit, torch.dsplit, torch.meshgrid, torch.broadcast_tensors, torch.numel})
_NOT_TENSOR_ATTRS = frozenset((name,) for name in (
    "shape", "dtype", "device", "ndim", "layout", "is_cuda", "requires_grad", "names", "is_sparse"))
_COMPUTE_OPS = ("call_module", "call_function", "call_method")


def _traced_chain(model: nn.Module, example_input: torch.Tensor | None) -> nn.Sequential:
    name = type(model).__name__
    concrete = _concrete_args(model)
    before = set(model.__dict__)
    try:
        gm = fx.symbolic_trace(model, concrete_args=concrete or None)
    except Exception as exc:  # any tracer failure means the same to the user
        raise ChainError(f"cannot make {name} a chain: torch.fx cannot trace its forward "
                         f"({type(exc).__name__}: {_first_line(exc)}); wrap the data-dependent control "
                         f"flow in a leaf module, or pass an nn.Sequential") from exc
    finally:
        # the tracer hangs tensors made in forward (torch.tensor(1.0)) on the model as
        # _tensor_constantN; the traced module keeps its own reference, the user's model
        # is left as it was
        for key in set(model.__dict__) - before:
            if key.startswith("_tensor_constant"):
                delattr(model, key)
    graph = gm.graph
    source, *extra = [n for n in graph.nodes if n.op == "placeholder"]
    for node in extra:
        _drop_argument(graph, node)
    gm.recompile()
    output = next(n for n in graph.nodes if n.op == "output")
    result = output.args[0]
    if not isinstance(result, fx.Node) or _surely_not_tensor(result):
        raise ChainError(f"{name}.forward returns {_what(result)}, not one tensor; a pipeline's last layer must "
                         f"return one tensor: wrap the model so forward returns one (e.g. the logits)")
    is_tensor = None if example_input is None else _value_kinds(gm, example_input, name)
    if is_tensor is not None and not is_tensor.get(result, True):
        raise ChainError(f"{name}.forward returns no tensor on example_input; a pipeline's last layer must "
                         f"return one tensor: wrap the model so forward returns one")

    nodes = [n for n in graph.nodes if n.op in _COMPUTE_OPS]
    cuts = _cut_points(nodes, source, output, model, is_tensor)
    bounds = [0, *(i + 1 for i, _ in cuts), len(nodes)]
    inputs = [source, *(value for _, value in cuts)]
    outputs = [*(value for _, value in cuts), result]
    pieces = [_piece(gm, model, nodes[bounds[k]:bounds[k + 1]], inputs[k], outputs[k]) for k in range(len(inputs))]
    return nn.Sequential(*pieces)


def _concrete_args(model: nn.Module) -> dict[str, Any]:
    """forward's arguments after the first, each at its default value (they are traced as
    constants). Why: a pipeline feeds each layer one tensor; an argument with a default
    (a flag, an optional mask) is not a second input, one without is."""
    name = type(model).__name__
    params = list(inspect.signature(model.forward).parameters.values())
    if not params:
        raise ChainError(f"{name}.forward takes no input; a pipeline feeds its first layer one tensor")
    star = [("*" if p.kind == p.VAR_POSITIONAL else "**") + p.name for p in params
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if star:
        raise ChainError(f"{name}.forward takes {star[0]} (a variable number of inputs); a pipeline passes "
                         f"one tensor: wrap the model so forward takes one tensor")
    required = [p.name for p in params[1:] if p.default is p.empty]
    if required:
        names = ", ".join([params[0].name, *required])
        raise ChainError(f"{name}.forward takes {len(required) + 1} inputs ({names}); a pipeline passes one "
                         f"tensor from layer to layer: give the others defaults, or wrap the model so forward "
                         f"takes one tensor")
    return {p.name: p.default for p in params[1:]}


# fx's checks that a traced-as-constant argument still has its value (x == value, then
# torch._assert; or _assert_is_none): they hold by construction in a chain, which never
# passes that argument.
_GUARDS = frozenset({"eq", "_assert", "_assert_is_none"})


def _drop_argument(graph: fx.Graph, placeholder: fx.Node) -> None:
    """Remove the placeholder of an argument traced at its default: its guards go, and any
    other use reads the default value itself."""
    default = placeholder.args[0] if placeholder.args else None
    closure: list[fx.Node] = []
    todo = list(placeholder.users)
    while todo:
        node = todo.pop()
        if node not in closure:
            closure.append(node)
            todo.extend(node.users)
    if all(n.op == "call_function" and getattr(n.target, "__name__", "") in _GUARDS for n in closure):
        for node in reversed([n for n in graph.nodes if n in closure]):
            graph.erase_node(node)
    else:
        def swap(n: fx.Node) -> Any:
            return default if n is placeholder else n

        for user in list(placeholder.users):
            user.args = fx.node.map_arg(user.args, swap)
            user.kwargs = fx.node.map_arg(user.kwargs, swap)
    graph.erase_node(placeholder)


def _cut_points(nodes: list[fx.Node], source: fx.Node, output: fx.Node, model: nn.Module,
                is_tensor: dict[fx.Node, bool] | None) -> list[tuple[int, fx.Node]]:
    """Every (i, value) such that after nodes[i] only `value` is used later, it is a tensor,
    no parameter or buffer is used both before and after the cut, and the cut is not inside
    a call of a submodule whose own forward is not a chain, nor right before an operation
    that writes into that value in place (a stage's input is a leaf tensor that requires
    grad, which autograd forbids writing into: ReLU(inplace=True) cannot open a stage).

    Why the last rule: a residual block ends `relu(out + identity)`, and after the add only
    one tensor is live, yet cutting off that relu splits the block in two. A submodule call
    (each call apart, from fx's nn_module_stack) in which some point between two of its own
    nodes has other than one live value is kept whole; one that is a chain (nn.Sequential,
    conv-bn-relu) is still cut everywhere. Attribute reads (get_attr) are not values here:
    each piece reads its own."""
    end = len(nodes)
    position = {n: i for i, n in enumerate(nodes)} | {source: -1, output: end}
    last_use: dict[fx.Node, int] = {}
    for value in [source, *nodes]:
        uses = [position[u] for u in value.users if u in position]
        if uses:
            last_use[value] = max(uses)
    # the span of nodes using each parameter or buffer: no cut inside it
    first: dict[int, int] = {}
    blocked = [False] * end
    for i, node in enumerate(nodes):
        for tensor_id in _state_ids(node, model):
            for j in range(first.setdefault(tensor_id, i), i):
                blocked[j] = True
    # the values live after each node
    live: set[fx.Node] = {source} if source in last_use else set()
    dying: dict[int, list[fx.Node]] = {}
    for value, last in last_use.items():
        dying.setdefault(last, []).append(value)
    after: list[tuple[fx.Node, ...]] = []
    for i, node in enumerate(nodes[:-1]):
        if node in last_use:
            live.add(node)
        live.difference_update(dying.get(i, ()))
        after.append(tuple(live))
    # the submodule calls each cut lies inside, and those that are not chains
    stacks = [list(n.meta.get("nn_module_stack", {})) for n in nodes]
    inside = [_common_prefix(stacks[i], stacks[i + 1]) for i in range(end - 1)]
    whole = {calls[-1] for calls, values in zip(inside, after, strict=True) if calls and len(values) != 1}
    cuts = []
    for i, values in enumerate(after):
        if len(values) != 1 or blocked[i] or whole.intersection(inside[i]):
            continue
        (value,) = values
        if value is not source and _maybe_not_tensor(value):
            continue
        if is_tensor is not None and not is_tensor.get(value, True):
            continue
        if any(position[u] > i and _writes_into(u, value) for u in value.users):
            continue
        cuts.append((i, value))
    return cuts


# operator's augmented assignments (x += y traced on a tensor)
_AUGMENTED = frozenset(getattr(operator, f"i{op}") for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift",
    "matmul"))


def _writes_into(node: fx.Node, value: fx.Node) -> bool:
    """Whether `node` writes into `value` (its first argument) in place: a module built
    with inplace=True, a method or function ending in "_" (relu_, add_), inplace=True, or
    an augmented assignment."""
    if not node.args or node.args[0] is not value:
        return False
    if node.op == "call_module":
        root = node.graph.owning_module
        return root is not None and getattr(root.get_submodule(node.target), "inplace", False) is True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if node.kwargs.get("inplace") is True or node.target in _AUGMENTED:
        return True
    return node.op in ("call_method", "call_function") and name.endswith("_") and not name.startswith("_")


def _common_prefix(a: list[str], b: list[str]) -> list[str]:
    out = []
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        out.append(x)
    return out


def _state_ids(node: fx.Node, model: nn.Module) -> set[int]:
    """The ids of the model's parameters and buffers a node uses directly (module call or
    attribute read), by identity so that one tensor under two names is one tensor."""
    root = node.graph.owning_module or model
    ids: set[int] = set()
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        ids.update(id(t) for t in [*module.parameters(), *module.buffers()])
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            value = _attr(root, arg.target)
            if isinstance(value, nn.Module):
                ids.update(id(t) for t in [*value.parameters(), *value.buffers()])
            elif isinstance(value, torch.Tensor) and _is_state(model, arg.target):
                ids.add(id(value))
    return ids


def _is_state(model: nn.Module, target: str) -> bool:
    """Whether an attribute read is a parameter or buffer of the model (a constant tensor
    fx lifted out of forward is not: each piece may keep its own reference)."""
    owner, _, field = target.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    return field in module._parameters or field in module._buffers


def _attr(root: nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _surely_not_tensor(node: fx.Node) -> bool:
    """A value that is not a tensor: a size, a tuple of chunks, x.shape and the like."""
    return ((node.op == "call_method" and node.target in _NOT_TENSOR_METHODS)
            or (node.op == "call_function" and node.target in _NOT_TENSOR_FUNCTIONS)
            or (node.op == "call_function" and node.target is getattr and node.args[1:2] in _NOT_TENSOR_ATTRS))


def _what(value: Any) -> str:
    """A value that is not a tensor, for a message: "a tuple", "x.shape", "y.size()"."""
    if not isinstance(value, fx.Node):
        return f"a {type(value).__name__}"
    if value.target is getattr:
        return f"{value.args[0]}.{value.args[1]}"
    if value.op == "call_method":
        return f"{value.args[0]}.{value.target}()"
    return f"{getattr(value.target, '__name__', value.target)}(...)"


def _maybe_not_tensor(node: fx.Node) -> bool:
    """A value that may be a tuple or number: a known non-tensor call, any attribute (x.T
    is a tensor, x.shape is not), or one only ever indexed (a module returning a tuple, an
    LSTM say). Costs a cut before an attribute or a tensor index; never makes a wrong one."""
    return (_surely_not_tensor(node) or (node.op == "call_function" and node.target is getattr)
            or bool(node.users) and all(u.op == "call_function" and u.target is operator.getitem
                                        for u in node.users))


def _value_kinds(gm: fx.GraphModule, example_input: torch.Tensor, name: str) -> dict[fx.Node, bool]:
    """Whether each node's value is a tensor when the traced model runs on the example."""
    kinds: dict[fx.Node, bool] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            kinds[n] = isinstance(value, torch.Tensor)
            return value

    with _quiet_run(gm):
        try:
            Recorder(gm).run(example_input)
        except Exception as exc:  # the user's model failing on the user's input
            raise ChainError(f"{name} fails on example_input "
                             f"({type(exc).__name__}: {_first_line(exc)})") from exc
    return kinds


def _piece(gm: fx.GraphModule, model: nn.Module, nodes: list[fx.Node], source: fx.Node,
           result: fx.Node) -> fx.GraphModule:
    """A GraphModule running `nodes` from `source` to `result`; it reads its attributes from
    `gm`, so its submodules, parameters and buffers are the model's own objects.

    A constant tensor of forward becomes a buffer of the piece (so .to() moves it), but not
    a persistent one: the chain's state_dict holds the model's entries and nothing else."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {source: graph.placeholder(source.name)}
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg not in env:
                env[arg] = graph.node_copy(arg)
        env[node] = graph.node_copy(node, lambda n: env[n])
    if result not in env and result.op == "get_attr":
        env[result] = graph.node_copy(result)
    graph.output(env[result])
    graph.lint()
    piece = fx.GraphModule(gm, graph)
    for node in graph.nodes:
        if node.op == "get_attr":
            owner, _, field = node.target.rpartition(".")
            holder = piece.get_submodule(owner)
            value = getattr(holder, field)
            if isinstance(value, torch.Tensor) and not _is_state(model, node.target):
                holder.register_buffer(field, value, persistent=False)
    return piece


def _sync_training(chain: nn.Sequential, model: nn.Module) -> None:
    """Give the containers the chain made (itself, the pieces, the pieces' intermediate
    modules) the training flag of the model's module of the same name. Why not
    chain.train(model.training): that would also reset leaves the user left in another mode
    (a frozen BatchNorm in eval inside a training model)."""
    own = {id(m) for m in model.modules()}
    chain.training = model.training
    for layer in chain:
        for path, module in layer.named_modules():
            if id(module) in own:
                continue
            try:
                module.training = model.get_submodule(path).training
            except AttributeError:
                module.training = model.training


# --- checking on an example ------------------------------------------------------------------

@contextlib.contextmanager
def _quiet_run(*modules: nn.Module) -> Iterator[None]:
    """Eval mode, no autograd and a fixed random seed, then every module's own training flag
    and the caller's random state back. Why the seed: two runs that draw random numbers
    (a random op in forward) must draw the same ones to be compared bit for bit."""
    flags = [(m, m.training) for root in modules for m in root.modules()]
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for root in modules:
                root.eval()
            yield
    finally:
        for module, flag in flags:
            module.training = flag


def _check_same(model: nn.Module, chain: nn.Sequential, example_input: torch.Tensor) -> None:
    name = type(model).__name__
    with _quiet_run(model, chain):
        torch.manual_seed(0)
        try:
            expected = model(example_input)
        except Exception as exc:  # the user's model failing on the user's input
            raise ChainError(f"{name} fails on example_input ({type(exc).__name__}: {_first_line(exc)})") from exc
        torch.manual_seed(0)
        got = chain(example_input)
    if not isinstance(expected, torch.Tensor):
        raise ChainError(f"{name}.forward returns a {type(expected).__name__} on example_input, not one tensor; "
                         f"wrap the model so forward returns one")
    if not _same(got, expected):
        raise ChainError(f"the chain of {name} differs from the model on example_input ({_difference(got, expected)});"
                         f" forward probably branches on a Python value fixed when traced (e.g. self.training):"
                         f" move that into a leaf module, or pass an nn.Sequential")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and values, NaNs in the same places counting as equal."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if not a.is_floating_point():
        return False
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _difference(got: torch.Tensor, expected: torch.Tensor) -> str:
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"{got.dtype}{list(got.shape)} against {expected.dtype}{list(expected.shape)}"
    return f"{int((got != expected).sum())} of {got.numel()} values differ"


# --- naming ----------------------------------------------------------------------------------

def _targets(layer: nn.Module) -> list[str]:
    """The module and attribute paths a traced piece uses, in order (none for other layers)."""
    if not isinstance(layer, fx.GraphModule):
        return []
    out: list[str] = []
    for node in layer.graph.nodes:
        constant = node.op == "get_attr" and node.target.rpartition(".")[2].startswith("_tensor_constant")
        if node.op in ("call_module", "get_attr") and not constant and node.target not in out:
            out.append(node.target)
    return out


def _unique_prefixes(mine: list[str], others: list[str]) -> list[str]:
    """Each path shortened to its shortest dotted prefix that no path of `others` lies under."""
    out: list[str] = []
    for target in mine:
        parts = target.split(".")
        label = target
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            if not any(o == prefix or o.startswith(prefix + ".") for o in others):
                label = prefix
                break
        if label not in out:
            out.append(label)
    return out


def _op_names(graph: fx.Graph) -> list[str]:
    names: list[str] = []
    for node in graph.nodes:
        if node.op in ("call_function", "call_method"):
            name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "op")
            if name not in names:
                names.append(name)
    return names or ["identity"]


def _short_list(names: list[str], keep: int = 3) -> str:
    extra = len(names) - keep
    return ", ".join(names[:keep]) + (f" +{extra} more" if extra > 0 else "")


def _short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else "no message"
