"""Upper bounds on the size of what a chat-template operation would build, computed from its
operands *before* it runs (see :mod:`vllm.entrypoints.chat_template`).

Each function returns a size in characters (or items); 0 means "does not grow its input".
The bounds are deliberately coarse: they only have to be small for the operations real chat
templates perform, and never smaller than the truth.
"""

from __future__ import annotations

import re
from typing import Any

# Containers and strings: what ``len`` measures.
SIZED = (str, list, tuple, dict, set, frozenset, bytes)
_DIGITS = re.compile(r"\d+")
HUGE = 1 << 62  # "certainly over any limit"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def deep_size(value: Any, cap: int) -> int:
    """Characters of strings plus items of containers reachable from ``value``, counting
    shared objects each time they appear (as ``str()`` or ``json.dumps`` would print them);
    stops early once over ``cap``, so the walk costs at most ``cap`` steps."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v)
        elif isinstance(v, dict):
            total += 1 + len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 1 + len(v)
            stack.extend(v)
        else:
            total += 24  # a number, None, a macro: its printed form is short
        if total > cap or len(stack) > cap:
            return HUGE
    return total


def size_of(value: Any, cap: int) -> int:
    """What printing ``value`` costs: its length, or its deep size for containers."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, SIZED):
        return deep_size(value, cap)
    return 24


def format_size(fmt: str, values: list[Any], cap: int) -> int:
    """A formatted string's length: the format, every number in it taken as a width or a
    precision, each field padded to the widest integer argument, and every argument."""
    numbers = 0
    for run in _DIGITS.findall(fmt):
        if len(run) > 9:
            return HUGE
        numbers += int(run)
    if len(values) == 1 and isinstance(values[0], (tuple, dict)):
        values = list(values[0].values() if isinstance(values[0], dict) else values[0])
    widths = max([abs(v) for v in values if is_int(v)] + [0])
    fields = fmt.count("{") + fmt.count("%")
    return len(fmt) + numbers + fields * widths + sum(size_of(v, cap) for v in values)


def replace_size(text: str, new: Any, count: Any = -1) -> int:
    times = len(text) + 1
    if is_int(count) and count >= 0:
        times = min(times, count)
    return len(text) + times * len(str(new))


def join_size(sep: Any, items: Any, cap: int) -> int:
    if not isinstance(items, (list, tuple, str, dict)):
        return 0  # an iterator: its items were built (and counted) one by one
    return sum(size_of(i, cap) for i in items) + len(str(sep)) * max(len(items) - 1, 0)


def str_method_size(name: str, text: str, args: list[Any], cap: int) -> int:
    """The output size of a ``str`` method that can grow its input, else 0."""
    first = args[0] if args else None
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(len(text), first if is_int(first) else 0)
    if name == "expandtabs":
        return len(text) * max(1, first if is_int(first) else 8)
    if name == "replace" and len(args) >= 2:
        return replace_size(text, args[1], args[2] if len(args) > 2 else -1)
    if name == "join" and args:
        return join_size(text, first, cap)
    return 0


def filter_size(name: str, value: Any, args: list[Any], kw: dict[str, Any], cap: int) -> int:
    """The output size of a built-in filter that can grow or print its input, else 0."""
    if name in ("string", "tojson", "pprint", "list", "e", "escape", "safe", "urlencode"):
        return 6 * size_of(value, cap)  # JSON and HTML escapes grow a character up to 6x
    if name == "join":
        return join_size(args[0] if args else kw.get("d", ""), value, cap)
    if name == "sum":
        start = args[1] if len(args) > 1 else kw.get("start", 0)
        if isinstance(start, SIZED) and isinstance(value, (list, tuple)):
            return len(start) + sum(len(v) if isinstance(v, SIZED) else 1 for v in value)
        return 0
    text = value if isinstance(value, str) else ""
    if name == "center":
        return max(len(text), args[0] if args and is_int(args[0]) else 80)
    if name == "indent":
        width = args[0] if args else kw.get("width", 4)
        width_len = width if is_int(width) else len(str(width))
        return len(text) + (text.count("\n") + 1) * width_len
    if name == "replace" and len(args) >= 2:
        return replace_size(text, args[1], args[2] if len(args) > 2 else -1)
    if name == "format":
        return format_size(text, [*args, *kw.values()], cap)
    if name == "wordwrap":
        return len(text) * (2 + len(str(kw.get("wrapstring", "\n"))))
    return 0


def binop_size(operator: str, left: Any, right: Any, cap: int) -> tuple[int, int]:
    """(characters or items, integer bits) that ``left <operator> right`` would build."""
    ints = is_int(left), is_int(right)
    if operator == "*":
        if isinstance(left, SIZED) and ints[1]:
            return size_of(left, cap) * max(right, 0), 0
        if isinstance(right, SIZED) and ints[0]:
            return size_of(right, cap) * max(left, 0), 0
        if all(ints):
            return 0, left.bit_length() + right.bit_length()
    elif operator == "**" and all(ints) and right > 0:
        return 0, max(left.bit_length() - 1, 1) * min(right, 1 << 40)
    elif operator == "+" and isinstance(left, SIZED) and isinstance(right, SIZED):
        return len(left) + len(right), 0
    elif operator == "%" and isinstance(left, str):
        values = list(right) if isinstance(right, tuple) else [right]
        return format_size(left, values, cap), 0
    return 0, 0
