"""How command lines are read: the spellings, value forms and config files vLLM accepts.

* ``--max_model_len`` is ``--max-model-len`` (real launch scripts use both).
* Dictionary flags take JSON (``--limit-mm-per-prompt '{"image": 2}'``) or the dotted form,
  one key a time (``--limit-mm-per-prompt.image 2``, ``--hf-overrides.text_config.x 1``);
  several occurrences merge, key by key.
* ``--config FILE.yaml`` reads flags from a YAML mapping (``max-model-len: 4096``, lists for
  flags that take several values); flags on the command line win over the file.
* Lengths may be written ``32k`` (32,000) or ``32K`` (32,768), likewise ``m``/``M``, ``g``/``G``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm.transformers_utils.config import apply_overrides as merge_dicts

CONFIG_FLAG = "--config"
_HUMAN_INT = re.compile(r"^(?P<num>\d+(?:\.\d+)?)(?P<unit>[kKmMgG]?)$")
_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_readable_int(value: str) -> int:
    """argparse type: ``4096``, ``32k`` (32,000), ``32K`` (32,768), ``1m``, ``1M``, ``25.6k``
    (decimal units only take fractions)."""
    text = value.strip()
    match = _HUMAN_INT.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected an integer such as 4096, 32k (32000) or 32K (32768), got {value!r}"
        )
    num, unit = match["num"], match["unit"]
    if not unit:
        if "." in num:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}")
        return int(num)
    if "." in num and unit.isupper():
        raise argparse.ArgumentTypeError(
            f"{value!r}: a fraction needs a decimal unit (k, m, g), not a binary one"
        )
    whole = float(num) * _UNITS[unit]
    if whole != int(whole):
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number")
    return int(whole)


def json_dict_type(value: str) -> dict[str, Any]:
    """argparse type: a JSON object."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r} ({e})") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


class MergeDictAction(argparse.Action):
    """Stores a dictionary flag, merging each occurrence into the value so far (so the dotted
    form can give one key a time, and a command line can refine a config file's value)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, merge_dicts(current or {}, values))


def normalize_flag_spelling(args: Sequence[str]) -> list[str]:
    """``--max_model_len=8`` -> ``--max-model-len=8``; dotted keys and values are untouched."""
    out = []
    for arg in args:
        if arg.startswith("--") and len(arg) > 2:
            name, sep, value = arg.partition("=")
            flag, dot, keys = name.partition(".")
            arg = flag.replace("_", "-") + dot + keys + sep + value
        out.append(arg)
    return out


def _dotted_value(text: str) -> Any:
    """A dotted flag's value: JSON when it parses (``2``, ``true``, ``[1]``), else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` with vLLM's spellings, dotted dictionary keys and ``--config``."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if args is None:
            args = sys.argv[1:]
        args = self._expand_dotted(normalize_flag_spelling(args))
        if CONFIG_FLAG in self._option_string_actions:
            args, from_file = self._split_config(args)
            if from_file is not None:
                namespace = self._namespace_from_config(from_file, namespace)
        return super().parse_known_args(args, namespace)

    def _expand_dotted(self, args: list[str]) -> list[str]:
        """``--flag.a.b V`` / ``--flag.a.b=V`` -> ``--flag '{"a": {"b": V}}'`` for dictionary
        flags of this parser (other parsers leave them to their subcommands)."""
        out: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            flag, dot, rest = arg.partition(".")
            action = self._option_string_actions.get(flag) if arg.startswith("--") else None
            if not dot or not isinstance(action, MergeDictAction):
                out.append(arg)
                i += 1
                continue
            keys, eq, value = rest.partition("=")
            if not eq:
                if i + 1 >= len(args):
                    self.error(f"{flag}.{keys} needs a value")
                value = args[i + 1]
                i += 1
            nested: Any = _dotted_value(value)
            for key in reversed([k for k in keys.split(".") if k]):
                nested = {key: nested}
            out += [flag, json.dumps(nested)]
            i += 1
        return out

    @staticmethod
    def _split_config(args: list[str]) -> tuple[list[str], str | None]:
        """Takes ``--config FILE`` (or ``--config=FILE``) out of ``args``."""
        rest, path = [], None
        i = 0
        while i < len(args):
            arg = args[i]
            if arg == CONFIG_FLAG and i + 1 < len(args):
                path = args[i + 1]
                i += 2
                continue
            if arg.startswith(CONFIG_FLAG + "="):
                path = arg.partition("=")[2]
            else:
                rest.append(arg)
            i += 1
        return rest, path

    def _namespace_from_config(
        self, path: str, namespace: argparse.Namespace | None
    ) -> argparse.Namespace:
        """The flags of a YAML file, parsed as if typed, as the starting namespace: values the
        command line gives later replace them."""
        tokens, dests = self._config_tokens(path)
        parsed, extra = super().parse_known_args(tokens, None)
        if extra:
            self.error(f"{CONFIG_FLAG} {path}: cannot use {' '.join(extra)}")
        namespace = namespace or argparse.Namespace()
        for dest in dests:
            setattr(namespace, dest, getattr(parsed, dest))
        namespace.config = path
        return namespace

    def _config_tokens(self, path: str) -> tuple[list[str], list[str]]:
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            self.error(f"{CONFIG_FLAG} {path}: cannot read it ({e})")
        if data is None:
            return [], []
        if not isinstance(data, dict):
            self.error(f"{CONFIG_FLAG} {path}: expected a mapping of flag names to values")
        tokens: list[str] = []
        dests: list[str] = []
        for key, value in data.items():
            flag = "--" + str(key).replace("_", "-")
            action = self._option_string_actions.get(flag)
            if action is None or flag == CONFIG_FLAG:
                self.error(f"{CONFIG_FLAG} {path}: unknown option {key!r}")
            dests.append(action.dest)
            tokens += _config_value_tokens(flag, action, value)
        return tokens, dests


def _config_value_tokens(flag: str, action: argparse.Action, value: Any) -> list[str]:
    """The command-line tokens that give ``flag`` the YAML ``value``."""
    if value is None:
        return []
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if value else "--no-" + flag[2:]]
    if action.nargs == 0:  # store_true and friends
        return [flag] if value else []
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    if isinstance(value, list):
        return [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
    if isinstance(value, bool):
        return [flag, str(value).lower()]
    return [flag, str(value)]
