"""Mask and score functions, FlexAttention's signatures, traced into a small checked graph.

    mask_mod(b, h, q_idx, kv_idx) -> bool              which scores are kept
    score_mod(score, b, h, q_idx, kv_idx) -> score      how a kept score is changed (fp32, before the softmax)

The same Python function serves every backend: ``trace`` records its graph by calling it once on symbols;
the reference calls the function itself on broadcast index tensors (``b (B,1,1,1)``, ``h (1,H,1,1)``,
``q_idx (1,1,S_q,1)``, ``kv_idx (1,1,1,S_kv)``, ``score (B,H,S_q,S_kv)``), the blocked loop and the custom ops
of torch.compile evaluate the graph on such tensors (``Graph.evaluate``), and the Triton kernels run a
``@triton.jit`` helper generated from the graph (``sparseflash.attention.triton.codegen``). A function may use:

- ``+ - * /``, ``//`` and ``%`` (integers, rounding down as Python does), unary ``-``, ``**`` with a
  Python-number exponent (0 to 4, or 0.5);
- comparisons, ``& | ^ ~`` (logical on booleans, bitwise on integers);
- ``torch.where``, ``abs``/``torch.abs``, ``torch.minimum``/``torch.maximum``, ``torch.clamp``, ``torch.exp``,
  ``torch.log``, ``torch.tanh``, ``torch.sqrt`` (the ``torch.Tensor`` methods of the same names too);
- Python numbers, and tensors captured from the enclosing scope: indexed (1 to 4 dimensions) by
  expressions of the arguments, or 0-d ones used as numbers. A captured tensor that requires grad gets gradients
  (score functions).

Anything else (``if`` on a traced value, ``math.*``, ``min``/``max``, another torch function) raises
``ValueError`` naming the construct when the mask or the call is built, not in a kernel.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

MASK_ARGS = ("b", "h", "q_idx", "kv_idx")
SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
SUPPORTED = ("+ - * / // % ** and unary -, comparisons, & | ^ ~, torch.where, abs, torch.minimum/maximum/clamp, "
             "torch.exp/log/tanh/sqrt, Python numbers, and captured tensors indexed by the arguments")
UNARY_TORCH = {"abs": "abs", "exp": "exp", "log": "log", "tanh": "tanh", "sqrt": "sqrt", "neg": "neg",
               "negative": "neg", "logical_not": "not", "bitwise_not": "not"}
BINARY_TORCH = {"minimum": "minimum", "maximum": "maximum", "add": "add", "sub": "sub", "subtract": "sub",
                "mul": "mul", "multiply": "mul", "div": "truediv", "true_divide": "truediv",
                "floor_divide": "floordiv", "remainder": "mod", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le",
                "gt": "gt", "ge": "ge", "logical_and": "and", "logical_or": "or", "bitwise_and": "and",
                "bitwise_or": "or", "bitwise_xor": "xor", "__and__": "and", "__or__": "or", "__xor__": "xor",
                "__rand__": "and", "__ror__": "or", "__rxor__": "xor"}
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
MAX_CAPTURE_DIMS = 4
CAPTURE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
                  torch.int8, torch.uint8, torch.bool)  # what the kernels load from a captured tensor


class TraceError(ValueError):
    """A construct outside what sparseflash can compile into its kernels."""


@dataclass(frozen=True)
class Node:
    """One value of a traced function: ``op`` applied to ``args`` (nodes or Python numbers).

    ``kind`` is "bool", "int" or "float"; ``deps`` the arguments it depends on. Ops: "arg" (args: the
    name), "const" (args: the number), "load" (args: capture slot, then one index node per dimension),
    the unary ops neg/not/abs/exp/log/tanh/sqrt, "pow" (args: base, exponent number), the binary ops
    add/sub/mul/truediv/floordiv/mod/minimum/maximum/and/or/xor and the comparisons, and "where"."""

    op: str
    args: tuple
    kind: str
    deps: frozenset = frozenset()


SPECIAL_FUNCTIONS = ("exp", "log", "tanh", "sqrt")  # evaluated by the GPU's special-function units


@dataclass
class Graph:
    """A traced function: its nodes in order of evaluation, its output and its captured tensors
    (``captures[slot]``; each load names its slot)."""

    arg_names: tuple[str, ...]
    nodes: list[Node] = field(default_factory=list)
    output: Node | None = None
    captures: list[torch.Tensor] = field(default_factory=list)

    @property
    def uses_special_functions(self) -> bool:
        """Whether it evaluates exp, log, tanh or sqrt: on a GPU these run on the special-function
        units that the softmax's exp2 also needs, which changes the best tiles (the kernels' configs
        are keyed on it)."""
        return any(n.op in SPECIAL_FUNCTIONS for n in self.nodes)

    @property
    def separable(self) -> bool:
        """Whether the function (a score function) has the form ``a(b, h) * score + g(b, h, q_idx) +
        k(b, h, kv_idx)``: the score enters linearly, with a factor of b and h only, and no term mixes
        the query position with the key position (ALiBi, any bias linear in the distance, a bias per
        key or per query). The kernels then evaluate it on a key tile's positions only, at one query
        of the query tile, and add the difference per query row to the lse (codegen.py)."""
        known: dict[int, bool] = {}  # per node, in evaluation order: each is judged once
        for node in self.nodes:
            known[id(node)] = _separable(node, lambda x: not isinstance(x, Node) or known[id(x)])
        return self.output is not None and known[id(self.output)]

    @property
    def linear_in_keys(self) -> bool:
        """Whether the function is separable with a key term linear in the key position: ``a(b, h) *
        score + g(b, h, q_idx) + c(b, h) * kv_idx`` (ALiBi, any bias linear in the distance). The
        kernels then compute the term's steps ``c * j`` over a key tile's offsets j once, and one value
        per tile (codegen.py)."""
        known: dict[int, bool] = {}
        for node in self.nodes:
            known[id(node)] = _linear_in_keys(node, lambda x: not isinstance(x, Node) or known[id(x)])
        return self.separable and known[id(self.output)]

    def key(self) -> str:
        """The graph as text: its nodes (op, kind and arguments), output, and its captures' dtypes, ranks and
        whether they require grad. It is what generated code depends on, and ``Graph.parse`` reads it back."""
        index = {id(n): i for i, n in enumerate(self.nodes)}
        parts = [f"{n.op}:{n.kind}:{','.join(_arg_text(a, index) for a in n.args)}" for n in self.nodes]
        caps = [f"{str(t.dtype).removeprefix('torch.')}/{t.dim()}{'/grad' if t.requires_grad else ''}"
                for t in self.captures]
        return f"{','.join(self.arg_names)}|" + ";".join(parts) + f"|{index[id(self.output)]}|" + ",".join(caps)

    @classmethod
    def parse(cls, key: str, captures: list[torch.Tensor]) -> "Graph":
        """The graph that ``key()`` wrote, with ``captures`` (in slot order) as its captured tensors; those the
        key says require grad are marked so (detached: inside a custom op they arrive without the mark, and
        the kernels and ``trained`` read it)."""
        captures = [t.detach().requires_grad_() if flag else t for t, flag in zip(captures, trained_flags(key))]
        arg_names, body, output, _ = key.split("|")
        nodes: list[Node] = []
        for text in body.split(";"):
            op, kind, args = text.split(":", 2)
            values = tuple(_parse_arg(a, nodes) for a in args.split(",")) if args else ()
            deps = frozenset().union(*(a.deps for a in values if isinstance(a, Node)))
            nodes.append(Node(op, values, kind, deps | (frozenset(values[:1]) if op == "arg" else frozenset())))
        return cls(tuple(arg_names.split(",")), nodes, nodes[int(output)], list(captures))

    @property
    def trained(self) -> list[torch.Tensor]:
        """The captured tensors that require grad, in slot order."""
        return [t for t in self.captures if t.requires_grad]

    def with_trained(self, trained) -> Callable:
        """The function with the captured tensors that require grad replaced by ``trained``: what
        ``torch.func.vjp`` differentiates to get their gradients."""
        trained = iter(trained)
        captures = [next(trained) if t.requires_grad else t for t in self.captures]
        return lambda *args: self.evaluate(*args, captures=captures)

    def evaluate(self, *args, captures: list[torch.Tensor] | None = None):
        """The function's value at ``args`` (broadcast tensors, as the PyTorch backends pass them), computed
        from the graph with torch ops; ``captures`` replaces the captured tensors."""
        captures = self.captures if captures is None else captures
        values: dict[int, object] = {}
        for node in self.nodes:
            a = [values[id(x)] if isinstance(x, Node) else x for x in node.args]
            if node.op == "arg":
                out = args[self.arg_names.index(a[0])]
            elif node.op == "const":
                out = a[0]
            elif node.op == "load":
                out = captures[a[0]][tuple(a[1:])] if len(a) > 1 else captures[a[0]]
            else:
                out = _EVALUATE[node.op](*a)
            values[id(node)] = out
        return values[id(self.output)]


def _separable(node: Node, separable: Callable) -> bool:
    """``node`` is ``a(b, h) * score + g(b, h, q_idx) + k(b, h, kv_idx)`` (see ``Graph.separable``),
    given ``separable(arg)`` for its arguments."""
    if "score" not in node.deps and not {"q_idx", "kv_idx"} <= node.deps:
        return True  # a term of b, h and at most one of the positions
    if node.op == "arg":  # the score
        return True
    if node.op in ("add", "sub"):
        return separable(node.args[0]) and separable(node.args[1])
    if node.op == "neg":
        return separable(node.args[0])
    if node.op in ("mul", "truediv"):
        first, second = node.args
        if node.op == "mul" and of_batch_and_head(first):
            return separable(second)
        return of_batch_and_head(second) and separable(first)
    return False


def _linear_in_keys(node: Node, linear: Callable) -> bool:
    """``node`` is affine in kv_idx (see ``Graph.linear_in_keys``), given ``linear(arg)`` for its arguments."""
    free = lambda x: not isinstance(x, Node) or "kv_idx" not in x.deps  # noqa: E731
    if free(node) or node.op == "arg":  # no key position, or kv_idx itself
        return True
    first, second = (node.args + (None,))[:2]
    if node.op in ("add", "sub"):
        return linear(first) and linear(second)
    if node.op == "neg":
        return linear(first)
    if node.op == "mul":
        return (free(first) and linear(second)) or (free(second) and linear(first))
    if node.op == "truediv":
        return free(second) and linear(first)
    return False


def of_batch_and_head(x) -> bool:
    """Whether ``x`` (a node or a number) depends on b and h only: one value per program of the kernels."""
    return not isinstance(x, Node) or x.deps <= {"b", "h"}


def trained_flags(key: str) -> list[bool]:
    """Per captured tensor of a ``Graph.key``, whether it requires grad ([] for an empty key)."""
    captures = key.rsplit("|", 1)[1] if key else ""
    return [text.endswith("/grad") for text in captures.split(",")] if captures else []


def _arg_text(arg, index: dict[int, int]) -> str:
    if isinstance(arg, Node):
        return f"%{index[id(arg)]}"
    if isinstance(arg, bool):
        return f"b{int(arg)}"
    if isinstance(arg, int):
        return f"i{arg}"
    if isinstance(arg, float):
        return f"f{arg!r}"
    return f"s{arg}"


def _parse_arg(text: str, nodes: list[Node]):
    tag, body = text[0], text[1:]
    if tag == "%":
        return nodes[int(body)]
    return {"b": lambda x: bool(int(x)), "i": int, "f": float, "s": str}[tag](body)


def _bound(fn, a, b):
    """torch.minimum/maximum of two operands of which one may be a Python number (then a clamp)."""
    if not isinstance(b, torch.Tensor):
        return torch.clamp(a, **{"max" if fn is torch.minimum else "min": b})
    if not isinstance(a, torch.Tensor):
        return _bound(fn, b, a)
    return fn(a, b)


_EVALUATE = {
    "neg": lambda a: -a, "not": lambda a: ~a, "abs": torch.abs, "exp": torch.exp, "log": torch.log,
    "tanh": torch.tanh, "sqrt": torch.sqrt, "pow": lambda a, n: a ** n,
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "truediv": lambda a, b: a / b, "floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b,
    "minimum": lambda a, b: _bound(torch.minimum, a, b), "maximum": lambda a, b: _bound(torch.maximum, a, b),
    "and": lambda a, b: a & b, "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b,
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "lt": lambda a, b: a < b, "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b, "where": torch.where,
}


class Sym:
    """A traced value: arithmetic on it records nodes into the graph being traced."""

    def __init__(self, tracer: "_Tracer", node: Node):
        self._tracer, self.node = tracer, node

    # arithmetic and logic
    def __add__(self, other): return self._tracer.binary("add", self, other)
    def __radd__(self, other): return self._tracer.binary("add", other, self)
    def __sub__(self, other): return self._tracer.binary("sub", self, other)
    def __rsub__(self, other): return self._tracer.binary("sub", other, self)
    def __mul__(self, other): return self._tracer.binary("mul", self, other)
    def __rmul__(self, other): return self._tracer.binary("mul", other, self)
    def __truediv__(self, other): return self._tracer.binary("truediv", self, other)
    def __rtruediv__(self, other): return self._tracer.binary("truediv", other, self)
    def __floordiv__(self, other): return self._tracer.binary("floordiv", self, other)
    def __rfloordiv__(self, other): return self._tracer.binary("floordiv", other, self)
    def __mod__(self, other): return self._tracer.binary("mod", self, other)
    def __rmod__(self, other): return self._tracer.binary("mod", other, self)
    def __and__(self, other): return self._tracer.binary("and", self, other)
    def __rand__(self, other): return self._tracer.binary("and", other, self)
    def __or__(self, other): return self._tracer.binary("or", self, other)
    def __ror__(self, other): return self._tracer.binary("or", other, self)
    def __xor__(self, other): return self._tracer.binary("xor", self, other)
    def __rxor__(self, other): return self._tracer.binary("xor", other, self)
    def __lt__(self, other): return self._tracer.binary("lt", self, other)
    def __le__(self, other): return self._tracer.binary("le", self, other)
    def __gt__(self, other): return self._tracer.binary("gt", self, other)
    def __ge__(self, other): return self._tracer.binary("ge", self, other)
    def __eq__(self, other): return self._tracer.binary("eq", self, other)  # noqa: D105
    def __ne__(self, other): return self._tracer.binary("ne", self, other)
    def __neg__(self): return self._tracer.unary("neg", self)
    def __pos__(self): return self
    def __abs__(self): return self._tracer.unary("abs", self)
    def __invert__(self): return self._tracer.unary("not", self)
    def __pow__(self, exponent): return self._tracer.power(self, exponent)

    __hash__ = None

    # what cannot be traced
    def __bool__(self):
        raise TraceError("uses a traced value in a Python condition (if, while, and/or, min/max, a chained "
                         "comparison): use torch.where, &, |, torch.minimum/maximum instead")

    def _to_number(self, *_):
        raise TraceError("turns a traced value into a Python number (int(), float(), math.*): use torch ops instead")

    __int__ = __float__ = __index__ = __round__ = __trunc__ = __floor__ = __ceil__ = _to_number

    def __getitem__(self, _):
        raise TraceError("indexes an argument: only captured tensors may be indexed")

    def __getattr__(self, name):
        method = getattr(torch.Tensor, name, None)
        if name.startswith("_") or method is None:
            raise AttributeError(name)
        return lambda *args, **kwargs: self._tracer.torch_call(method, (self, *args), kwargs)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        tracer = next(a._tracer for a in _flatten(args) if isinstance(a, Sym))
        return tracer.torch_call(func, args, kwargs or {})


def _flatten(args):
    for a in args:
        if isinstance(a, (tuple, list)):
            yield from _flatten(a)
        else:
            yield a


def _kind_of_dtype(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


class _Tracer:
    def __init__(self, arg_names: tuple[str, ...]):
        self.graph = Graph(arg_names)
        self._slots: dict[int, int] = {}

    def add(self, op: str, args: tuple, kind: str) -> Sym:
        deps = frozenset().union(*(a.deps for a in args if isinstance(a, Node)))
        node = Node(op, args, kind, deps | (frozenset([args[0]]) if op == "arg" else frozenset()))
        self.graph.nodes.append(node)
        return Sym(self, node)

    def value(self, x) -> Node:
        """A node for an operand: a Sym, a Python number, or a 0-d captured tensor."""
        if isinstance(x, Sym):
            return x.node
        if isinstance(x, bool):
            return self.add("const", (x,), "bool").node
        if isinstance(x, (int, float)):
            return self.add("const", (x,), "int" if isinstance(x, int) else "float").node
        if isinstance(x, torch.Tensor):
            if x.dim() != 0:
                raise TraceError(f"uses a captured tensor of shape {tuple(x.shape)} whole: index it by the "
                                 f"arguments (only 0-d captured tensors are used as numbers)")
            return self.add("load", (self.slot(x),), _kind_of_dtype(x.dtype)).node
        raise TraceError(f"uses a value of type {type(x).__name__}; supported: {SUPPORTED}")

    def slot(self, tensor: torch.Tensor) -> int:
        if tensor.dtype not in CAPTURE_DTYPES:
            raise TraceError(f"captures a tensor of dtype {tensor.dtype}; captured tensors may be "
                             f"{', '.join(str(d).removeprefix('torch.') for d in CAPTURE_DTYPES)}")
        if id(tensor) not in self._slots:
            self._slots[id(tensor)] = len(self.graph.captures)
            self.graph.captures.append(tensor)
        return self._slots[id(tensor)]

    def unary(self, op: str, x) -> Sym:
        a = self.value(x)
        if op in SPECIAL_FUNCTIONS:
            kind = "float"
        elif op == "not":
            kind = a.kind
        elif a.kind == "bool":
            raise TraceError(f"applies {op} to a boolean")
        else:
            kind = a.kind
        return self.add(op, (a,), kind)

    def binary(self, op: str, x, y) -> Sym:
        a, b = self.value(x), self.value(y)
        kinds = {a.kind, b.kind}
        if op in COMPARISONS:
            kind = "bool"
        elif op in ("and", "or", "xor"):
            if "float" in kinds:
                raise TraceError("applies &, | or ^ to a float: they take booleans or integers")
            kind = "bool" if kinds == {"bool"} else "int"
        elif op in ("floordiv", "mod"):
            if kinds != {"int"}:
                raise TraceError("uses // or % on a float or boolean: they take integers")
            kind = "int"
        elif op == "truediv":
            kind = "float"
        else:
            kind = "float" if "float" in kinds else "int"
        return self.add(op, (a, b), kind)

    def power(self, x, exponent) -> Sym:
        if exponent not in (0, 1, 2, 3, 4, 0.5) or isinstance(exponent, bool):
            raise TraceError(f"raises to the power {exponent!r}: ** takes a Python-number exponent 0 to 4 or 0.5")
        if exponent == 0.5:
            return self.unary("sqrt", x)
        a = self.value(x)
        return self.add("pow", (a, int(exponent)), a.kind if exponent else "int")

    def where(self, cond, x, y) -> Sym:
        c, a, b = self.value(cond), self.value(x), self.value(y)
        if c.kind != "bool":
            raise TraceError("calls torch.where with a condition that is not a boolean")
        kinds = {a.kind, b.kind}
        kind = "float" if "float" in kinds else "int" if "int" in kinds else "bool"
        return self.add("where", (c, a, b), kind)

    def index(self, tensor: torch.Tensor, index) -> Sym:
        index = index if isinstance(index, tuple) else (index,)
        if not 1 <= tensor.dim() <= MAX_CAPTURE_DIMS or len(index) != tensor.dim():
            raise TraceError(f"indexes a captured tensor of shape {tuple(tensor.shape)} with {len(index)} "
                             f"index(es): captured tensors have 1 to {MAX_CAPTURE_DIMS} dimensions and are "
                             f"indexed in every one")
        nodes = tuple(self.value(i) for i in index)
        if any(n.kind != "int" for n in nodes):
            raise TraceError("indexes a captured tensor with a float or boolean: indices must be integers")
        return self.add("load", (self.slot(tensor), *nodes), _kind_of_dtype(tensor.dtype))

    def torch_call(self, func, args, kwargs) -> Sym:
        name = getattr(func, "__name__", str(func))
        if name in ("clamp", "clip") and set(kwargs) <= {"min", "max"} and len(args) <= 3:
            low, high = (list(args[1:]) + [None, None])[:2]
            low, high = kwargs.get("min", low), kwargs.get("max", high)
            out = args[0]
            if low is not None:
                out = self.binary("maximum", out, low)
            if high is not None:
                out = self.binary("minimum", out, high)
            return out if isinstance(out, Sym) else self.add("const", (out,), self.value(out).kind)
        if kwargs:
            raise TraceError(f"calls {name} with keyword arguments {sorted(kwargs)}")
        if name == "__getitem__" and isinstance(args[0], torch.Tensor):
            return self.index(args[0], args[1])
        if name == "where" and len(args) == 3:
            return self.where(*args)
        if name in UNARY_TORCH and len(args) == 1:
            return self.unary(UNARY_TORCH[name], args[0])
        if name in BINARY_TORCH and len(args) == 2:
            return self.binary(BINARY_TORCH[name], *args)
        if name in ("pow", "__pow__") and len(args) == 2:
            return self.power(*args)
        raise TraceError(f"calls torch's {name}, which sparseflash cannot compile; supported: {SUPPORTED}")


def check_arity(fn: Callable, arg_names: tuple[str, ...], what: str) -> None:
    """Raise TypeError unless ``fn`` is callable, ValueError unless with ``len(arg_names)`` positional arguments."""
    if not callable(fn):
        raise TypeError(f"a {what} must be a function of ({', '.join(arg_names)}); got {type(fn).__name__}")
    try:
        inspect.signature(fn).bind(*arg_names)
    except TypeError:
        raise ValueError(f"a {what} takes ({', '.join(arg_names)}); {_name(fn)} takes "
                         f"{_signature_text(fn)}") from None
    except ValueError:  # no signature (a builtin): let the trace say what fails
        pass


def _signature_text(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "other arguments"


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def trace(fn: Callable, what: str) -> Graph:
    """The graph of ``fn``, a ``mask_mod`` (``what="mask_mod"``) or a ``score_mod``, checked: its arity,
    its ops (``SUPPORTED``) and its result's kind (boolean for a mask_mod, a number for a score_mod).
    Traced anew at each call (tens of microseconds), so that the captured tensors are those the
    function reads now (a module's buffers after ``.to(device)``, say)."""
    arg_names = MASK_ARGS if what == "mask_mod" else SCORE_ARGS
    if not torch.compiler.is_compiling():  # Dynamo (torch 2.11) cannot trace inspect.signature of a module;
        check_arity(fn, arg_names, what)  # there a wrong arity fails in the call below
    tracer = _Tracer(arg_names)
    args = [tracer.add("arg", (name,), "float" if name == "score" else "int") for name in arg_names]
    try:
        out = fn(*args)
    except TraceError as err:
        raise ValueError(f"{what} {_name(fn)} {err}") from None
    except Exception as err:  # noqa: BLE001 - anything else the function tried on a traced value
        raise ValueError(f"{what} {_name(fn)} cannot be traced ({type(err).__name__}: {err}); "
                         f"supported: {SUPPORTED}") from None
    try:
        node = tracer.value(out)
    except TraceError as err:
        raise ValueError(f"{what} {_name(fn)} returns something else than a traced value: {err}") from None
    if what == "mask_mod" and node.kind != "bool":
        raise ValueError(f"mask_mod {_name(fn)} must return a boolean (a comparison, & or |); it returns "
                         f"a {node.kind}")
    if what == "score_mod" and node.kind == "bool":
        raise ValueError(f"score_mod {_name(fn)} must return a number (the new score); it returns a boolean")
    tracer.graph.output = node
    return tracer.graph
