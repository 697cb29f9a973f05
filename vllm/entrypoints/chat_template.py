"""Chat templates rendered in a sandbox whose work itself is bounded.

Every template (the tokenizer's, ``--chat-template``, and a request's own where the server
trusts them) renders in :class:`BudgetedSandbox`, an ``ImmutableSandboxedEnvironment`` that
meters what the template does while it does it:

* **steps**: every loop iteration, call, filter, test, attribute or item lookup and
  intercepted operator costs one step; ``range(n)`` costs ``n`` up front;
* **size**: no string or output may exceed ``max_chars`` characters, no container
  ``max_chars // ITEM_DIVISOR`` items, no integer ``MAX_INT_BITS`` bits, and the sizes of
  everything the template builds add up against ``ALLOC_FACTOR * max_chars``. Operations
  that can build a large value from small ones (``*``, ``**``, ``+``, ``%``, ``~``, joins,
  ``center``, ``replace``, ``indent``, ``format``, ...) are checked *before* they run;
* **time**: a wall-clock deadline, checked at every step.

Going over any of these raises :class:`ChatTemplateBudgetError` from inside the render, so the
render stops itself (no thread is left running); the server answers it with a 400.
"""

from __future__ import annotations

import functools
import json
import time
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

from vllm.entrypoints import template_sizes as sizes

# Integers beyond this many bits are refused: chat templates count and index, and ``**`` or
# repeated ``*`` could otherwise build numbers whose arithmetic takes seconds.
MAX_INT_BITS = 4096
# The sizes of all values a render builds may add up to this many times ``max_chars``: room
# for a template that copies each message several times, not for one that builds 1000 copies.
ALLOC_FACTOR = 16
# A list, dict or tuple may hold at most ``max_chars // ITEM_DIVISOR`` items: sorting or
# grouping one is a single C call the deadline cannot interrupt.
ITEM_DIVISOR = 8


class ChatTemplateError(ValueError):
    """The chat template failed to render (syntax, ``raise_exception``, a type error)."""


class ChatTemplateBudgetError(ChatTemplateError):
    """The chat template went over its budget of steps, size or time, and was stopped."""


@dataclass(frozen=True)
class ChatTemplateBudget:
    """What one render may do: ``max_steps`` steps, strings and output of at most
    ``max_chars`` characters, and ``timeout`` seconds of wall-clock time."""

    max_steps: int = 1_000_000
    max_chars: int = 4 << 20
    timeout: float = 2.0

    def __post_init__(self) -> None:
        if self.max_steps <= 0 or self.max_chars <= 0 or not self.timeout > 0:
            raise ValueError(f"chat template budget values must be positive, got {self}")


class _Meter:
    """The running account of one render (kept in a ContextVar: renders run concurrently)."""

    __slots__ = ("budget", "steps", "allocated", "deadline")

    def __init__(self, budget: ChatTemplateBudget) -> None:
        self.budget = budget
        self.steps = 0
        self.allocated = 0
        self.deadline = time.monotonic() + budget.timeout

    def tick(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.budget.max_steps:
            raise ChatTemplateBudgetError(
                f"The chat template took more than {self.budget.max_steps} steps "
                "(--chat-template-max-steps) and was stopped."
            )
        if time.monotonic() > self.deadline:
            raise ChatTemplateBudgetError(
                f"The chat template ran longer than {self.budget.timeout:g} s "
                "(--chat-template-timeout) and was stopped."
            )

    def expect(self, size: int, what: str, limit: int | None = None) -> None:
        """Refuses to build a value of ``size`` characters (or items, against ``limit``)."""
        limit = self.budget.max_chars if limit is None else limit
        if size > limit:
            shown = "more than 2**62" if size >= sizes.HUGE else str(size)
            raise ChatTemplateBudgetError(
                f"The chat template tried to build {what} of {shown} characters or items, over "
                f"the limit of {limit} (--chat-template-max-chars) and was stopped."
            )
        self.allocated += size
        if self.allocated > ALLOC_FACTOR * self.budget.max_chars:
            raise ChatTemplateBudgetError(
                f"The chat template built more than {ALLOC_FACTOR * self.budget.max_chars} "
                f"characters in all ({ALLOC_FACTOR} x --chat-template-max-chars) and was stopped."
            )

    def check_value(self, value: Any) -> Any:
        """Counts a value an operation returned (containers by their number of items)."""
        if isinstance(value, (str, bytes)):
            self.expect(len(value), "a string")
        elif isinstance(value, sizes.SIZED):
            self.expect(len(value), f"a {type(value).__name__}", self.max_items)
        elif sizes.is_int(value):
            _check_int_bits(value.bit_length())
        return value

    @property
    def max_items(self) -> int:
        return max(self.budget.max_chars // ITEM_DIVISOR, 1)

    def check_args(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Widths, counts and repeats come in as integers: none may exceed ``max_chars``."""
        for v in (*args, *kwargs.values()):
            if sizes.is_int(v) and abs(v) > self.budget.max_chars:
                raise ChatTemplateBudgetError(
                    f"The chat template passed {v} to a function or filter, over the limit of "
                    f"{self.budget.max_chars} (--chat-template-max-chars)."
                )


_METER: ContextVar[_Meter | None] = ContextVar("vllm_chat_template_meter", default=None)


def _meter() -> _Meter:
    meter = _METER.get()
    if meter is None:
        raise RuntimeError("chat templates render only through render_template()")
    return meter


def _check_int_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise ChatTemplateBudgetError(
            f"The chat template tried to build an integer of {bits} bits (the limit is "
            f"{MAX_INT_BITS})."
        )


def _strftime_now(fmt: str) -> str:
    meter = _meter()
    meter.expect(sizes.format_size(str(fmt), [], meter.budget.max_chars), "a date")
    return datetime.now().strftime(fmt)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML; chat templates want plain JSON (and an indent option).
    if indent is not None and not (sizes.is_int(indent) and 0 <= indent <= 32):
        raise ChatTemplateBudgetError(f"tojson's indent must be an integer in 0..32, got {indent}.")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _TemplateNamespace(Namespace):
    """``namespace()`` whose attributes cannot be private names."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is private")


def _env_call(name: str, args: list[nodes.Expr], lineno: int) -> nodes.Call:
    call = nodes.Call(nodes.EnvironmentAttribute(name), args, [], None, None)
    return call.set_lineno(lineno)


class _Instrument(NodeTransformer):
    """Rewrites a parsed template so that loops tick the meter and ``~`` is size-checked."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.body.insert(0, nodes.ExprStmt(_env_call("budget_tick", [], node.lineno)))
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        node = self.generic_visit(node)
        return _env_call("budget_join", list(node.nodes), node.lineno)


_PASSED = (jinja2.runtime.Context, nodes.EvalContext, jinja2.Environment)


def _budgeted(func: Any, name: str, is_filter: bool) -> Any:
    """A filter or test that ticks, checks its integer arguments, what it would build (from
    its operands, before running) and what it returned."""

    @functools.wraps(func)  # keeps jinja_pass_arg (pass_context and friends)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        meter = _meter()
        meter.tick()
        meter.check_args(args, kwargs)
        plain = [a for a in args if not isinstance(a, _PASSED)]
        if is_filter and plain:
            cap = meter.budget.max_chars
            grown = sizes.filter_size(name, plain[0], plain[1:], kwargs, cap)
            if grown:
                meter.expect(grown, f"the output of the {name!r} filter")
        return meter.check_value(func(*args, **kwargs))

    return wrapper


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox every chat template renders in; see the module docstring."""

    # Only the operators that can build something large; the others cannot grow a value.
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols],
            finalize=self._finalize,
        )
        self.filters["tojson"] = _tojson
        self.filters = {k: _budgeted(f, k, True) for k, f in self.filters.items()}
        self.tests = {k: _budgeted(f, k, False) for k, f in self.tests.items()}
        self.globals.update(
            range=self._range,
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
            namespace=_TemplateNamespace,
            dict=self._dict,
        )

    # ------------------------------------------------------------------ compile
    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = _Instrument().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    # ------------------------------------------------------------------ hooks
    def budget_tick(self) -> None:
        """Called at the top of every loop iteration (the call ticks)."""

    def budget_join(self, *parts: Any) -> str:
        """``a ~ b ~ c``: the joined size is checked before anything is printed."""
        meter = _meter()
        meter.expect(sum(sizes.size_of(p, meter.budget.max_chars) for p in parts), "a string")
        return "".join(str(p) for p in parts)

    def _finalize(self, value: Any) -> Any:
        """Every ``{{ ... }}``: a container is measured before it is printed."""
        if isinstance(value, sizes.SIZED) and not isinstance(value, str):
            meter = _meter()
            meter.expect(sizes.size_of(value, meter.budget.max_chars), "an output")
        return value

    def concat(self, parts: Any) -> str:  # type: ignore[override]
        """Joins a render's (or a block's, or a macro's) output, counting as it goes."""
        meter, out, total = _meter(), [], 0
        for part in parts:
            total += len(part)
            if total > meter.budget.max_chars:
                meter.expect(total, "an output")
            out.append(part)
        meter.expect(total, "an output")
        return "".join(out)

    def _range(self, *args: int) -> range:
        rng = range(*args)
        meter = _meter()
        meter.expect(len(rng), "a range", meter.max_items)
        meter.tick(len(rng))
        return rng

    def _dict(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return _meter().check_value(dict(*args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        meter = _meter()
        meter.tick()
        grown, bits = sizes.binop_size(operator, left, right, meter.budget.max_chars)
        if grown:
            meter.expect(grown, f"the result of {operator!r}")
        _check_int_bits(bits)
        try:
            result = super().call_binop(context, operator, left, right)
        except OverflowError as e:
            raise ChatTemplateBudgetError(f"The chat template overflowed: {e}.") from None
        return meter.check_value(result)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        meter = _meter()
        meter.tick()
        meter.check_args(args, kwargs)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            name = getattr(__obj, "__name__", "")
            values = [*args, *kwargs.values()]
            grown = sizes.str_method_size(name, owner, values, meter.budget.max_chars)
            if grown:
                meter.expect(grown, f"the result of str.{name}")
        return meter.check_value(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _meter().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        meter = _meter()
        meter.tick()
        value = super().getitem(obj, argument)
        # A slice is a copy: count it (a plain lookup returns what already exists).
        return meter.check_value(value) if isinstance(argument, slice) else value

    def wrap_str_format(self, value: Any) -> Any:
        """``str.format`` and ``format_map``, with the formatted size checked first."""
        fmt = super().wrap_str_format(value)
        if fmt is None:
            return None
        template = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            meter = _meter()
            values = [*args, *kwargs.values()]
            size = sizes.format_size(template, values, meter.budget.max_chars)
            meter.expect(size, "a formatted string")
            return fmt(*args, **kwargs)

        return checked


@functools.cache
def _environment() -> BudgetedSandbox:
    return BudgetedSandbox()  # one for the process: it holds no per-render state


@functools.lru_cache(maxsize=32)  # request templates vary: keep a few compiled
def _compiled(source: str) -> jinja2.Template:
    return _environment().from_string(source)


def render_template(
    source: str, context: dict[str, Any], budget: ChatTemplateBudget | None = None
) -> str:
    """Compiles (cached) and renders ``source`` with ``context`` under ``budget``.

    Raises :class:`ChatTemplateBudgetError` when the budget runs out and
    :class:`ChatTemplateError` for any other failure of the template.
    """
    token = _METER.set(_Meter(budget or ChatTemplateBudget()))
    try:
        tmpl = _compiled(source)  # compiling folds constants: that is metered too
        return tmpl.render(**context)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(str(e)) from None
    except RecursionError:
        raise ChatTemplateBudgetError("The chat template nested or recursed too deeply.") from None
    except MemoryError:
        raise ChatTemplateBudgetError("The chat template ran out of memory.") from None
    except (TypeError, ValueError, LookupError, ArithmeticError, AttributeError) as e:
        raise ChatTemplateError(f"The chat template could not be rendered: {e}") from None
    finally:
        _METER.reset(token)
