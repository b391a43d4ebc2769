"""Command-line parsing shared by both planes' programs: a misspelled option is answered with the close one and the
command's valid options, not argparse's bare `unrecognized arguments: --tpo 3`.

`OptionParser` is the `argparse.ArgumentParser` of `cona` (`cona.orchestrator.cli`) and of the data plane's
programs (`cona export`, `cona data prepare`: `cona.trainer.export`, `cona.trainer.prepare`). Besides the arguments
no option takes, it catches a misspelled option that argparse would first report as a *missing* one (`--outt DIR`
for a required `--out`: argparse says only `the following arguments are required: --out`). How an error is printed
stays each program's own (`OptionParser.fail`).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
"""A negative number: a value, not an option (as argparse reads it when no option looks like one)."""


def valid_options(parser: argparse.ArgumentParser) -> list[str]:
    """The long options of `parser` that its --help shows, sorted."""
    return sorted({s for action in parser._actions if action.help != argparse.SUPPRESS
                   for s in action.option_strings if s.startswith("--")})  # fmt: skip


def unrecognized_message(parser: argparse.ArgumentParser, unknown: Sequence[str]) -> str:
    """`unrecognized arguments: ...` for what `parser` (the command's own parser) took no option for; when an option
    is among them, the close option for the first one and the command's valid options."""
    message = f"unrecognized arguments: {' '.join(unknown)}"
    options = [u.partition("=")[0] for u in unknown if u.startswith("-") and not _NUMBER.match(u)]
    if options:
        valid = valid_options(parser)
        close = difflib.get_close_matches(options[0], valid, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        message += f"{hint}; valid options: {', '.join(valid)}"
    return message


def empty_value_message(action: argparse.Action, value: str) -> str:
    """What argparse prints after `argument OPTION: ` for an empty (or blank) value of `action`: what to give
    instead, and, for an option that may be left out, that it may."""
    what = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
    option = action.option_strings[-1] if action.option_strings else None
    leave = f", or drop {option}" if option and not action.required else ""
    return f"empty value {value!r} (an unset shell variable?); give {what}{leave}"


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse._SubParsersAction]:
    return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]


def command_parser(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command `namespace` was parsed for: the subcommand's own parser holds its options."""
    for action in _subparsers(parser):
        name = getattr(namespace, action.dest, None) if action.dest != argparse.SUPPRESS else None
        if isinstance(name, str) and name in action.choices:
            return command_parser(action.choices[name], namespace)
    return parser


def _known(parser: argparse.ArgumentParser, option: str) -> bool:
    if option in parser._option_string_actions:
        return True
    # An abbreviation argparse would take (or call ambiguous itself): a prefix of some long option.
    return bool(parser.allow_abbrev and option.startswith("--") and any(
        s.startswith(option) for s in parser._option_string_actions))  # fmt: skip


def misspelled_options(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The options of `argv` that no option of `parser` (or of the subcommand `argv` names) takes, with the parser
    they were given to: what argparse reports only after a required option it misses."""
    subcommands = {name: sub for action in _subparsers(parser) for name, sub in action.choices.items()}
    typos: list[str] = []
    for i, token in enumerate(argv):
        if token == "--":
            break
        if token in subcommands:
            if typos:
                break
            return misspelled_options(subcommands[token], argv[i + 1 :])
        if token.startswith("-") and token != "-" and not _NUMBER.match(token):
            option = token.partition("=")[0] if token.startswith("--") else token
            if not _known(parser, option):
                typos.append(option)
    return parser, typos


_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<given>[^']*)' \(choose from (?P<choices>.*)\)$")


def _with_suggestion(message: str) -> str:
    """argparse's `invalid choice: 'plam' (choose from 'plan', ...)` with the close choice first, as a misspelled
    option is answered (Python 3.11's argparse names none)."""
    match = _INVALID_CHOICE.search(message)
    if match is None:
        return message
    choices = re.findall(r"'([^']*)'", match["choices"])
    close = difflib.get_close_matches(match["given"].lower(), choices, n=1)
    if not close:
        return message
    return (f"{message[: match.start()]}invalid choice: {match['given']!r}; did you mean {close[0]!r}? "
            f"(choose from {match['choices']})")  # fmt: skip


class OptionParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose answer to a misspelled option names the close option and the command's valid
    ones (`unrecognized_message`), for arguments no option takes and for a misspelling argparse would report as a
    missing required option. Subcommands made with `add_subparsers` are of the same class. Errors are printed by
    `fail` (one line, `PROG: error: MESSAGE`, exit 2, unless a program overrides it)."""

    _argv: list[str] | None = None

    def __init__(self, *args: Any, allow_abbrev: bool = False, **kwargs: Any) -> None:
        # No abbreviations, in every program and subcommand alike: `--prof` taken for `--profile` today becomes
        # ambiguous (or another option) when an option is added, and the trainer's flags must not be prefixes of
        # torchrun's. A shortened option is answered like a misspelled one, with the full one to use.
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> tuple[Any, list[str]]:
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            command_parser(self, parsed).error(unrecognized_message(command_parser(self, parsed), unknown))
        return parsed

    def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
        # An empty value (`--run-dir ""`, `--out "$UNSET"`) names nothing, yet was taken: as a path it is the
        # working directory (`Path("")` is `.`), and an option tested for truth reads it as left out, so
        # `cona run --run-dir ""` trained in the default run directory, `--measured ""` was dropped and
        # `cona data prepare --out ""` wrote into the working directory. Refused here, for every option of every
        # program, before any of them sees it. A subcommand's action is handed its own arguments too: its parser
        # checks them.
        if not arg_string.strip() and not isinstance(action, argparse._SubParsersAction):
            raise argparse.ArgumentError(action, empty_value_message(action, arg_string))
        return super()._get_value(action, arg_string)

    def error(self, message: str) -> NoReturn:
        if "required" in message and self._argv is not None:
            owner, typos = misspelled_options(self, self._argv)
            if typos:  # `--outt DIR` left the required `--out` missing: the typo is what to fix
                message = unrecognized_message(owner, typos)
        self.fail(_with_suggestion(message))

    def fail(self, message: str) -> NoReturn:
        """Print `message` as the program's one error line and exit 2: `PROG: error: MESSAGE (see PROG --help)`.
        Not argparse's usage block above it: every other error of cona is one line (a wrapper that keeps the last
        line of stderr, or a log grep, then shows what went wrong), and the usage is one `--help` away."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
