"""Command-line flags with environment-variable twins, resolved in one place.

Every flag of a subcommand has a twin named from the subcommand's prefix and the flag's name
(``--draft-max`` of ``serve`` is ``HYSPEC_DRAFT_MAX``, ``--seed`` of ``make-model`` is
``HYSPEC_MAKE_MODEL_SEED``). Precedence: the command line, then the environment, then the
default. An environment value goes through the same type conversion and ``choices`` check
as the flag (a bad one is a one-line error, exit code 2), and a repeatable flag given on the
command line replaces its environment value rather than adding to it. ``EnvParser`` records
which flags the user set (``given(args)``), so that a client can send only those.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

_GIVEN = "_hyspec_given"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class EnvParser(argparse.ArgumentParser):
    """An ArgumentParser whose flags (added with ``flag``) read their environment twins."""

    def __init__(self, *args: Any, env_prefix: str = "HYSPEC_", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.env_prefix = env_prefix
        self._twins: list[_Twin] = []

    def error(self, message: str) -> NoReturn:
        # One line, exit code 2: the contract for every bad flag or environment value.
        self.exit(2, f"hyspec: error: {message}\n")

    def flag(self, group: argparse._ActionsContainer, name: str, *, type: Callable[[str], Any] = str,
             default: Any = None, help: str, required: bool = False, choices: Sequence[Any] | None = None,
             action: str | None = None) -> None:
        """Add ``name`` to ``group`` with its environment twin; ``default`` applies when
        neither the command line nor the environment sets it."""
        env = self.env_prefix + name.lstrip("-").upper().replace("-", "_")
        shown = "" if default is None or action == "store_true" else f" (default: {default})"
        kwargs: dict[str, Any] = {"help": f"{help}{shown} [{env}]", "default": None}
        if action == "store_true":
            kwargs["action"] = "store_true"
        else:
            kwargs.update(type=type, choices=choices, metavar=_metavar(choices))
            if action is not None:
                kwargs["action"] = action
        dest = group.add_argument(name, **kwargs).dest
        self._twins.append(_Twin(name, dest, env, type, default, required, choices, action))

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed = super().parse_args(args, namespace)
        parser: EnvParser = getattr(parsed, "_hyspec_parser", self)
        parser._resolve(parsed)
        return parsed

    def _resolve(self, ns: argparse.Namespace) -> None:
        given: set[str] = set()
        for twin in self._twins:
            value = getattr(ns, twin.dest)
            if value is not None and value is not False:
                given.add(twin.dest)
                continue
            raw = os.environ.get(twin.env)
            if raw is not None:
                value = twin.convert(raw, self)
                given.add(twin.dest)
            elif twin.required:
                self.error(f"{twin.name} is required (or set {twin.env})")
            else:
                value = False if twin.action == "store_true" and twin.default is None else twin.default
            setattr(ns, twin.dest, value)
        setattr(ns, _GIVEN, given)


def _metavar(choices: Sequence[Any] | None) -> str | None:
    return "{" + ",".join(str(c) for c in choices) + "}" if choices else None


class _Twin:
    def __init__(self, name: str, dest: str, env: str, type: Callable[[str], Any], default: Any, required: bool,
                 choices: Sequence[Any] | None, action: str | None) -> None:
        self.name, self.dest, self.env, self.type = name, dest, env, type
        self.default, self.required, self.choices, self.action = default, required, choices, action

    def convert(self, raw: str, parser: EnvParser) -> Any:
        if self.action == "store_true":
            if raw.strip().lower() in _TRUE:
                return True
            if raw.strip().lower() in _FALSE:
                return False
            parser.error(f"{self.env}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")
        try:
            value = self.type(raw)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            parser.error(f"{self.env}={raw!r}: {e}")
        if self.choices is not None and value not in self.choices:
            parser.error(f"{self.env}={raw!r}: choose from {', '.join(str(c) for c in self.choices)}")
        return [value] if self.action == "append" else value


def subcommand(sub: argparse._SubParsersAction, name: str, *, env_prefix: str, help: str) -> EnvParser:
    """A subcommand parser with its own environment prefix."""
    parser: EnvParser = sub.add_parser(name, help=help, env_prefix=env_prefix)
    parser.set_defaults(_hyspec_parser=parser)
    return parser


def given(args: argparse.Namespace) -> set[str]:
    """The destinations the user set, on the command line or in the environment."""
    return getattr(args, _GIVEN, set())


def env_twins(parser: argparse.ArgumentParser) -> dict[str, list[tuple[str, str]]]:
    """Every environment twin of ``parser``'s subcommands: env name -> [(subcommand, flag)]."""
    out: dict[str, list[tuple[str, str]]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for twin in getattr(sub, "_twins", []):
                    out.setdefault(twin.env, []).append((name, twin.name))
    return out
