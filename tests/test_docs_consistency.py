"""The user docs (README.md, docs/*.md, manifests/, slurm/ and trainer/README.md) name only what exists:

- every command in their code (`cona SUBCOMMAND --flag`, `python -m cona.trainer --flag`, `python -m benchmarks.X
  --flag`, `make TARGET`) uses a subcommand, options and choices the real parsers accept;
- every dotted config key (`policy.critical_batch_factor`, `--set batch.base_gbs=64`, a job or profile in YAML) is
  a field of the job or the cluster profile;
- every path of the repository they name (`slurm/profiles/a100-4x8.yaml`, a link, a glob, a pytest node id)
  exists;
- every Python name written as `cona.orchestrator.costmodel.predict`, `runstate.event_problem` or
  `RunDir.attempt_exit_code` is defined.

The parsers are the programs' own (`build_parser`, and the parser each other program builds in its `parse_args` or
`main`, taken as it starts to parse); the fields are the pydantic models'; the Python names are read from the
source, so nothing imports torch. No training, no network: a second or two."""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import fnmatch
import importlib
import re
import shlex
import subprocess
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from unittest import mock

import pydantic
import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/*.md", "manifests/README.md", "slurm/README.md", "trainer/README.md")

# What the docs may write that does not exist, each for the reason given.
NOT_COMMANDS = ("cona starts on",)  # README.md quotes a line `cona plan` prints
NOT_CONFIG_KEYS = {
    "optimizer.lrr",  # README.md: the error a misspelled field gets
    "section.field", "dotted.key",  # placeholders for any key (trainer/README.md's synopsis, README.md)
    "model.embed_tokens", "model.layers", "model.norm",  # docs/huggingface.md: Hugging Face Llama weight names
}  # fmt: skip
NOT_PATHS = {"examples/sc21/run_table_1.sh"}  # docs/costmodel.md: a file of NVIDIA/Megatron-LM

# How a file name ends: `model.py`, `slurm.json` and `orchestrator.lock` are files, not keys or Python names.
FILE_SUFFIXES = {"py", "yaml", "yml", "json", "jsonl", "md", "txt", "bin", "png", "sh", "toml", "safetensors", "lock",
                 "sbatch", "out", "log", "gz", "bz2", "xz", "pt", "csv"}  # fmt: skip
# The packages `cona` installs, by their last name, and their folders (pyproject.toml: cona.orchestrator is
# orchestrator/).
PACKAGES = {name.removeprefix("cona."): folder for name, folder in
            tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].items()}  # fmt: skip
# `python -m cona.trainer` runs trainer/__main__.py, which parses with this module's `parse_args`.
ENTRY_MODULES = {"cona.trainer": "cona.trainer.main"}
# Options whose value is KEY=VALUE with KEY a config field: of the job or the profile, and under which section.
KEY_OPTIONS = {"--set": ("job", ""), "--profile-set": ("profile", ""), "--policy-set": ("job", "policy.")}


def _close(word: str, valid: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, sorted(valid), n=1)
    return f"; did you mean {close[0]}?" if close else ""


# -- the docs' code ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Code:
    """A piece of code in a doc: an inline code span, or a line of a block (continuation lines joined)."""

    where: str  # file:line
    text: str
    block: str | None  # the block's language ("" for none); None for an inline span
    fence: int = 0  # the block's first line; 0 for a span


_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


def parse_doc(name: str, text: str) -> tuple[list[Code], list[tuple[str, str]]]:
    """The code of one markdown text (`name` in messages): its spans and the lines of its fenced and indented
    blocks; and the targets of its links, each with where it is."""
    prose: list[str] = []
    code: list[Code] = []
    block: tuple[str, str, int] | None = None  # the open block: its fence ("" if indented), language, first line
    pending: tuple[int, str] | None = None  # a block's line that ends in a backslash, with the next ones
    for number, line in enumerate(text.split("\n"), 1):
        fence = _FENCE.match(line)
        if block is not None and not block[0] and line.strip() and not line.startswith("    "):
            block = None  # the end of an indented block
        if block is None:
            if fence:
                block = (fence.group(1), fence.group(2), number)
                prose.append("")
                continue
            if not (line.startswith("    ") and line.strip() and not (prose and prose[-1].strip())):
                prose.append(line)
                continue
            block = ("", "", number)  # an indented block: indented lines after a blank one
        prose.append("")
        if block[0] and fence and fence.group(1).startswith(block[0]) and not fence.group(2):
            block = None
            continue
        if pending is not None:
            number, line = pending[0], f"{pending[1]} {line.strip()}"
            pending = None
        if line.endswith("\\"):
            pending = (number, line[:-1])
        elif re.match(r"\[?--?\w", line.strip()) and code and code[-1].fence == block[2]:
            # a synopsis's next line of options (trainer/README.md): the same command
            code[-1] = Code(code[-1].where, f"{code[-1].text} {line.strip()}", block[1], block[2])
        elif line.strip():
            code.append(Code(f"{name}:{number}", line, block[1], block[2]))
    joined = "\n".join(prose)
    for span in _SPAN.finditer(joined):
        if "\n\n" not in span.group(2):
            where = f"{name}:{joined.count(chr(10), 0, span.start()) + 1}"
            code.append(Code(where, " ".join(span.group(2).split()), None))
    links = [(f"{name}:{joined.count(chr(10), 0, m.start()) + 1}", m.group(1)) for m in _LINK.finditer(joined)]
    return code, links


def doc_files() -> list[Path]:
    return sorted({p for pattern in DOCS for p in REPO.glob(pattern)})


@cache
def docs() -> dict[Path, tuple[list[Code], list[tuple[str, str]]]]:
    return {path: parse_doc(_rel(path), path.read_text()) for path in doc_files()}


# -- commands ------------------------------------------------------------------------------------------------------

_PREFIXES = {"$", "sudo", "exec", "time", "env", "nohup"}


def _words(text: str) -> list[str]:
    """The shell words of `text`; `<run dir>` (a placeholder) is one word, and `local|slurm` (a choice) no pipe."""
    text = re.sub(r"<[\w .-]+>", lambda m: m.group(0).replace(" ", "_"), text.replace("…", " … "))
    text = re.sub(r"(?<=[\w\]])\|(?=[\w\[])", ",", text)
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        words = list(lexer)
    except ValueError:  # an unbalanced quote in prose: the words are enough
        words = text.split()
    return [w.strip("[]") for w in words if w.strip("[]")]


def commands(text: str) -> Iterator[list[str]]:
    """The simple commands of a shell-like text, without leading `VAR=value`, `sudo` or a `$ ` prompt."""
    current: list[str] = []
    for word in [*_words(text), ";"]:
        if set(word) <= set(";&|()") or word in (">", ">>", "2>", "<"):
            while current and (current[0] in _PREFIXES or re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", current[0])):
                current.pop(0)
            if current:
                yield current
            current = []
        else:
            current.append(word)


class _Parsing(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@cache
def parser_of(module_name: str) -> argparse.ArgumentParser | None:
    """The parser of `python -m MODULE`: `cona`'s `build_parser`, else the one the module's `parse_args` (or `main`)
    builds, taken as it starts to parse; None if it builds none."""
    from cona.orchestrator import cli

    if module_name == cli.__name__:
        return cli.build_parser()
    module = importlib.import_module(ENTRY_MODULES.get(module_name, module_name))
    function = getattr(module, "parse_args", None) or getattr(module, "main", None)
    if not callable(function):
        return None

    def taken(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> typing.NoReturn:
        raise _Parsing(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", taken):
        try:
            function([])
        except _Parsing as parsing:
            if not parsing.parser.prog.startswith(("cona", "python -m")):  # a parser without a prog of its own
                parsing.parser.prog = f"python -m {module_name}"
            return parsing.parser
    return None


@cache
def data_plane_commands() -> dict[str, str]:
    """`cona`'s subcommands that are the data plane's programs (`export`, `data`), with their modules."""
    from cona.orchestrator.cli import DATA_PLANE_COMMANDS

    return DATA_PLANE_COMMANDS


@cache
def make_targets() -> frozenset[str]:
    return frozenset(re.findall(r"^([\w.-]+)\s*:(?!=)", (REPO / "Makefile").read_text(), re.M))


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: sub for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}  # fmt: skip


def check_arguments(where: str, shown: str, parser: argparse.ArgumentParser, argv: list[str]) -> Iterator[str]:
    """`argv`'s problems for `parser`: a subcommand it lacks, an option the (sub)command it reaches does not take,
    a literal value outside an argument's choices."""
    options = parser._option_string_actions
    subcommands = _subparsers(parser)
    positionals = [a for a in parser._actions if not a.option_strings and a.nargs != argparse.PARSER]
    taking: argparse.Action | None = None  # the option whose value comes next
    for i, word in enumerate(argv):
        if word == "--":
            return
        if word.startswith("-") and len(word) > 1 and not re.fullmatch(r"-[\d.].*", word):
            option, _, value = word.partition("=")
            if option not in options:
                yield f"{where}: `{shown}`: {parser.prog} has no option {option}{_close(option, options)}"
                return
            taking = options[option] if options[option].nargs != 0 and not value else None
            if value:
                yield from check_choice(where, shown, options[option], value)
        elif word in ("…", "..."):
            taking = None
        elif taking is not None:
            yield from check_choice(where, shown, taking, word)
            taking = None
        elif subcommands:  # `cona plan`, `cona plan/render`, `cona data prepare`
            names = word.split("/") if re.fullmatch(r"[a-z][a-z-]*(/[a-z][a-z-]*)+", word) else [word]
            if not all(re.fullmatch(r"[a-z][a-z-]*", n) for n in names):
                return  # `cona "$@"`: nothing to check
            for name in names:
                if name not in subcommands:
                    yield f"{where}: `{shown}`: {parser.prog} has no subcommand {name!r}{_close(name, subcommands)}"
                    return
            yield from check_arguments(where, shown, subcommands[names[0]], argv[i + 1 :])
            return
        elif positionals:
            yield from check_choice(where, shown, positionals[0], word)
            if positionals[0].nargs in (None, 1):
                positionals.pop(0)


def check_choice(where: str, shown: str, action: argparse.Action, value: str) -> Iterator[str]:
    """A literal value (not a placeholder such as RUN_DIR or <run>) is among the argument's choices."""
    if action.choices is not None and re.fullmatch(r"[a-z0-9][\w.-]*", value) and value not in action.choices:
        name = "/".join(action.option_strings) or action.metavar or action.dest
        yield f"{where}: `{shown}`: {value!r} is not a choice of {name} ({', '.join(map(str, action.choices))})"


def command_problems(code: Code) -> Iterator[str]:
    if code.block == "python" or code.text.startswith(NOT_COMMANDS):
        return
    for command in commands(code.text):
        head, args = command[0], command[1:]
        shown = " ".join(command)
        if (head == "cona" or head.endswith("/cona")) and args:
            module = data_plane_commands().get(args[0])
            parser = parser_of(module or "cona.orchestrator.cli")
            assert parser is not None, f"found no argument parser in {module}"
            yield from check_arguments(code.where, shown, parser, args[1:] if module else args)
        elif head == "make" and args and re.fullmatch(r"[a-z][\w-]*", args[0]) and args[0] not in make_targets():
            yield f"{code.where}: `{shown}`: the Makefile has no target {args[0]!r}{_close(args[0], make_targets())}"
        elif re.fullmatch(r"(benchmarks|tests)\.\w+", head) and args:  # `benchmarks.ttp --quick`
            yield from command_problems(Code(code.where, f"python -m {shown}", code.block, code.fence))
        elif re.fullmatch(r"python[\d.]*|torchrun", Path(head).name):
            # The module of ours is the one whose options follow, as in
            # `python -m torch.distributed.run --nnodes=N -m cona.trainer --run-dir DIR`.
            module, rest = next(((args[i + 1], args[i + 2 :]) for i, a in enumerate(args[:-1])
                                 if a == "-m" and is_ours(args[i + 1])), (None, []))  # fmt: skip
            if module is None:
                continue
            if problem := module_problem(module):
                yield f"{code.where}: `{shown}`: {problem}"
            elif any(a.startswith("-") for a in rest):
                parser = parser_of(module)
                if parser is None:
                    yield f"{code.where}: `{shown}`: found no argument parser in {module} to check the options against"
                else:
                    yield from check_arguments(code.where, shown, parser, rest)


# -- config keys ---------------------------------------------------------------------------------------------------


@cache
def models() -> dict[str, type[pydantic.BaseModel]]:
    from cona.orchestrator.job import Job
    from cona.orchestrator.profile import ClusterProfile

    return {"job": Job, "profile": ClusterProfile}


def _models_in(annotation: object) -> list[type[pydantic.BaseModel]]:
    """The pydantic models a field's annotation holds: `X`, `X | None`, `list[X]`."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _is_mapping(annotation: object) -> bool:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_is_mapping(a) for a in typing.get_args(annotation))
    return annotation is dict or typing.get_origin(annotation) is dict


@cache
def sections() -> dict[str, str]:
    """The top-level fields of the job and the profile that are sections (models), with which of the two."""
    found: dict[str, str] = {}
    for which, model in models().items():
        for name, field in model.model_fields.items():
            if _models_in(field.annotation):
                assert name not in found, f"{name} is a section of both the job and the profile"
                found[name] = which
    return found


def resolve_key(model: type[pydantic.BaseModel], parts: list[str]) -> str | None:
    """None if `parts` name a field of `model` (through its sections, into a mapping's keys); else why not."""
    for i, part in enumerate(parts):
        fields = model.model_fields
        if part not in fields:
            return f"no field {part!r} in {'.'.join(parts[:i]) or model.__name__}{_close(part, fields)}"
        if i + 1 == len(parts):
            return None
        annotation = fields[part].annotation
        if not _models_in(annotation):
            if _is_mapping(annotation):
                return None
            return f"{'.'.join(parts[: i + 1])} is a value, it has no field {parts[i + 1]!r}"
        model = _models_in(annotation)[0]
    return None


def value_problem(model: type[pydantic.BaseModel], parts: list[str], value: str) -> str | None:
    """Why `value` is not one of the choices of the field `parts` names, when it has choices (a Literal)."""
    for part in parts[:-1]:
        model = _models_in(model.model_fields[part].annotation)[0]
    annotation = model.model_fields[parts[-1]].annotation
    choices = [str(c) for a in (annotation, *typing.get_args(annotation)) if typing.get_origin(a) is typing.Literal
               for c in typing.get_args(a)]  # fmt: skip
    if choices and value.isidentifier() and value not in (*choices, "null", "None"):
        return f"{value!r} is not one of {', '.join(choices)}"
    return None


_KEY = re.compile(r"(?<![\w./$@-])([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)(?![\w(/-]|\.[A-Za-z_])(\s*[:=]\s*(\S+))?")
_KEY_OPTION = re.compile(rf"(?<![\w-])({'|'.join(KEY_OPTIONS)})[ =]['\"]?([\w.]+)=")


def _allowed(key: str) -> bool:
    return key.isupper() or any(key == k or key.startswith(k + ".") for k in NOT_CONFIG_KEYS)


def key_problems(code: Code) -> Iterator[str]:
    """The keys `--set`, `--profile-set` and `--policy-set` set; and every dotted name that starts with a section
    of the job or the profile (`policy.`, `kubernetes.`; not `model.py`), with its value where one is written
    (`policy.noise_estimator: adam`) and the field has choices."""
    if code.block == "python":
        return
    set_keys = set()
    for match in _KEY_OPTION.finditer(code.text):
        option, key = match.groups()
        set_keys.add(match.start(2))
        which, section = KEY_OPTIONS[option]
        if not _allowed(key) and (problem := resolve_key(models()[which], f"{section}{key}".split("."))):
            yield f"{code.where}: `{option} {key}`: {problem}"
    for match in _KEY.finditer(code.text):
        key, parts = match.group(1), match.group(1).split(".")
        if parts[0] not in sections() or parts[-1] in FILE_SUFFIXES or _allowed(key) or match.start() in set_keys:
            continue
        model = models()[sections()[parts[0]]]
        if problem := resolve_key(model, parts):
            yield f"{code.where}: `{key}`: {problem}"
        elif match.group(3) and match.end() == len(code.text) and (problem := value_problem(model, parts, match.group(3))):
            yield f"{code.where}: `{code.text}`: {problem}"


def yaml_problems(lines: list[Code]) -> Iterator[str]:
    """A YAML block that is (part of) a job or a profile holds only their fields, those commented out as a choice
    (`# matmul_efficiency: 0.75`) too."""
    import yaml

    text = "\n".join(c.text for c in lines)
    data = None
    for variant in (re.sub(r"(?m)^(\s*)# (?=[a-z_]+: )", r"\1", text), text):
        with contextlib.suppress(yaml.YAMLError):
            data = yaml.safe_load(variant)
            break
    if not isinstance(data, dict):
        return
    fits = {which: sum(k in model.model_fields for k in data) for which, model in models().items()}
    which = max(fits, key=fits.__getitem__)
    if not fits[which]:
        return  # another YAML (a kustomization)
    for path in _yaml_keys(data):
        if not _allowed(".".join(path)) and (problem := resolve_key(models()[which], list(path))):
            where = next((c.where for c in lines if re.match(rf"\s*(# )?{re.escape(path[-1])}\s*:", c.text)), lines[0].where)
            yield f"{where}: YAML key `{'.'.join(path)}`: {problem}"


def _yaml_keys(data: dict, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for key, value in data.items():
        yield (*prefix, str(key))
        if isinstance(value, dict):
            yield from _yaml_keys(value, (*prefix, str(key)))


# -- paths ---------------------------------------------------------------------------------------------------------


@cache
def repo_files() -> frozenset[str] | None:
    """The repository's files: tracked, or new and not ignored. None outside a git work tree."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                                capture_output=True, check=True, timeout=30).stdout  # fmt: skip
        return frozenset(f for f in listed.decode().split("\0") if f)
    return None


@cache
def repo_dirs() -> frozenset[str]:
    return frozenset(parent.as_posix() for f in repo_files() or () for parent in Path(f).parents) - {"."}


def ignored(paths: Iterable[str]) -> set[str]:
    """Of `paths` (relative to the repository), those git ignores: what a command writes (runs/, data/), not a
    file of the repository."""
    paths = sorted(set(paths))
    if not paths:
        return set()
    done = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=REPO, input="\n".join(paths),
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    return set(done.stdout.split())


def exists(relative: str) -> bool:
    """A file or folder of the repository, or a glob (`tests/published/*.yaml`, `jobs/{gpt,bert}.yaml`) that
    matches one for each choice."""
    relative = relative.rstrip("/")
    if not re.search(r"[*?{]", relative):
        return relative in (repo_files() or ()) or relative in repo_dirs()
    head, brace, tail = relative.partition("{")
    choices, _, rest = tail.partition("}")
    patterns = [head + choice + rest for choice in choices.split(",")] if brace else [relative]
    return all(any(fnmatch.fnmatchcase(f, p) for f in repo_files() or ()) for p in patterns)


_PATH = re.compile(r"[\w@.-]+(/[\w@.*?{},-]+)*/?(::[\w:]+)?")


def path_candidates(doc: Path, code: Code) -> Iterator[tuple[str, list[str]]]:
    """(word, where it may lie, relative to the repository) for each word of `code` that names a file of the
    repository: its first part is a top-level folder (`orchestrator/policy.py`, wherever the doc is); or else, in a
    doc below the top, a folder or file beside the doc (`profiles/a100-4x8.yaml` in slurm/README.md); or else a
    folder inside a top-level one (`backends/kubernetes/lease.py`). A pytest node id (`tests/test_x.py::test_y`) names its file."""
    top = {d for d in repo_dirs() if "/" not in d}
    base = _rel(doc.parent)
    words = _words(code.text) if code.block != "python" else re.findall(r"[\"']([^\"']+)[\"']", code.text)
    for word in words:
        path = word.strip("'\"`,;:()[]").rstrip(".").split("=", 1)[-1]
        if "/" not in path or not _PATH.fullmatch(path) or path.startswith(("./", "../")) or path in NOT_PATHS:
            continue
        path = path.partition("::")[0]
        first = path.split("/", 1)[0]
        if first in top:
            places = [path]
        elif doc.parent != REPO and (f"{base}/{first}" in repo_dirs() or f"{base}/{first}" in (repo_files() or ())):
            places = [f"{base}/{path}"]
        else:
            places = [f"{d}/{path}" for d in sorted(top) if f"{d}/{first}" in repo_dirs()]
        if places:
            yield word, places


def node_id_problem(word: str, places: list[str]) -> str | None:
    """Why `tests/x.py::test_y` names no test of that file; None if it does (or names no file of ours)."""
    name = word.strip("'\"`,;:()[]").rstrip(".").partition("::")[2].split("::")[0]
    file = next((p for p in places if exists(p) and p.endswith(".py")), None)
    if not name or file is None or file.removesuffix(".py").replace("/", ".") not in module_files():
        return None
    names = module(file.removesuffix(".py").replace("/", ".")).names
    return None if name in names else f"{file} has no {name!r}{_close(name, names)}"


def link_target(doc: Path, target: str) -> str | None:
    """A link's file relative to the repository; None for a URL or an anchor of the same doc."""
    if re.match(r"[a-z]+:", target) or target.startswith("#"):
        return None
    return _rel((doc.parent / target.partition("#")[0]).resolve())


# -- Python names --------------------------------------------------------------------------------------------------


@cache
def module_files() -> dict[str, Path]:
    """Every module of the `cona` packages, of `benchmarks` and of `tests`, by dotted name (`cona.orchestrator.cli`,
    `cona.orchestrator.backends`, `benchmarks.ttp`)."""
    found = {}
    folders = {**{f"cona.{p}": d for p, d in PACKAGES.items()}, "benchmarks": "benchmarks", "tests": "tests"}
    for package, folder in folders.items():
        for file in (REPO / folder).rglob("*.py"):
            parts = file.relative_to(REPO / folder).with_suffix("").parts
            found[".".join((package, *parts[:-1], *([] if parts[-1] == "__init__" else [parts[-1]])))] = file
    return found


@dataclass
class Module:
    names: set[str]
    classes: dict[str, ast.ClassDef]


@cache
def module(name: str) -> Module:
    """A module's top-level names (a package's submodules among them) and classes, read from its source."""
    tree = ast.parse(module_files()[name].read_text())
    names = {n for node in tree.body for n in _defined(node)}
    names |= {m.rpartition(".")[2] for m in module_files() if m.rpartition(".")[0] == name}
    return Module(names, {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)})


@cache
def class_modules() -> dict[str, list[str]]:
    """The modules of the `cona` packages that define each top-level class name."""
    found: dict[str, list[str]] = {}
    for name, file in module_files().items():
        if name.startswith("cona."):
            for class_name in re.findall(r"^class (\w+)", file.read_text(), re.M):
                found.setdefault(class_name, []).append(name)
    return found


@cache
def unique_basenames() -> dict[str, str]:
    """The modules of the `cona` packages whose last name is theirs alone (`runstate`, `heartbeat_record`)."""
    by_name: dict[str, list[str]] = {}
    for name in module_files():
        if name.startswith("cona."):
            by_name.setdefault(name.rpartition(".")[2], []).append(name)
    return {base: names[0] for base, names in by_name.items() if len(names) == 1}


def _defined(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, ast.Import | ast.ImportFrom):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, ast.If | ast.Try):  # `if TYPE_CHECKING:`, `try: import x`
        return {n for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt) for n in _defined(child)}
    return set()


# Outside bases whose own attributes the docs do not name: a class on them has its own and our bases' only.
PLAIN_BASES = {"object", "ABC", "Protocol", "Generic", "Enum", "IntEnum", "StrEnum", "BaseModel", "Exception",
               "ValueError", "RuntimeError"}  # fmt: skip


def members(class_name: str, seen: frozenset[str] = frozenset()) -> set[str] | None:
    """The attributes a class of ours defines (`self.x = ...` among them) or inherits from ours; None if its name
    is not one class of ours, or a base of it is from outside and not plain (its attributes are not known here)."""
    where = class_modules().get(class_name, [])
    node = module(where[0]).classes.get(class_name) if len(where) == 1 and class_name not in seen else None
    if node is None:
        return None
    found = {n for child in node.body for n in _defined(child)}
    found |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
              and isinstance(n.value, ast.Name) and n.value.id == "self"}  # fmt: skip
    for base in node.bases:
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        if name not in PLAIN_BASES:
            inherited = members(name, seen | {class_name}) if name else None
            if inherited is None:
                return None
            found |= inherited
    return found


def is_ours(module_name: str) -> bool:
    parts = module_name.split(".")
    return parts[0] in ("benchmarks", "tests") or (parts[0] == "cona" and len(parts) > 1 and parts[1] in PACKAGES)


def module_problem(module_name: str) -> str | None:
    """Why `python -m MODULE` names no module of ours; None if it does."""
    if module_name in module_files():
        return None
    parent = module_name.rpartition(".")[0]
    return f"no module {module_name}{_close(module_name, [m for m in module_files() if m.startswith(parent)])}"


_NAME = re.compile(r"(?<![\w./$@-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/-]|\.\w)")


def name_problems(code: Code) -> Iterator[str]:
    """In spans: `cona.x.y.name` or `protocol.x.name` (a module, a name in it, a member of that class),
    `module.name` for a module whose last name is unique in our packages, `Class.member` for a class whose name
    is. Not a config key (`policy.lr_aware`), a file (`policy.py`) or someone else's (`torch.load`)."""
    if code.block is not None:
        return
    for match in _NAME.finditer(code.text):
        ref, parts = match.group(1), match.group(1).split(".")
        if parts[-1] in FILE_SUFFIXES or parts[0] in sections():
            continue
        if parts[0] in PACKAGES:
            if not parts[1].islower():  # not a module of ours: TrainJob's `trainer.numNodes`
                continue
            parts = ["cona", *parts]
        if is_ours(".".join(parts)):
            found = next((m for i in range(len(parts), 0, -1) if (m := ".".join(parts[:i])) in module_files()), None)
            if found is None:
                yield f"{code.where}: `{ref}`: no module {'.'.join(parts[:2])}"
                continue
            rest = parts[len(found.split(".")) :]
        elif parts[0] in unique_basenames() and parts[0] not in ("cona", "benchmarks", "tests"):
            found, rest = unique_basenames()[parts[0]], parts[1:]
        elif parts[0][0].isupper() and parts[0] in class_modules():
            found, rest = None, parts
        else:
            continue
        if found is not None and rest and rest[0] not in module(found).names:
            yield f"{code.where}: `{ref}`: {found} has no {rest[0]!r}{_close(rest[0], module(found).names)}"
        elif len(rest) > 1 and (attributes := members(rest[0])) is not None and rest[1] not in attributes:
            yield f"{code.where}: `{ref}`: class {rest[0]} has no {rest[1]!r}{_close(rest[1], attributes)}"


# -- the checks ----------------------------------------------------------------------------------------------------

Check = Callable[[Path, list[Code], list[tuple[str, str]]], Iterator[str]]


def check_commands(doc: Path, code: list[Code], links: list[tuple[str, str]]) -> Iterator[str]:
    for c in code:
        yield from command_problems(c)


def check_keys(doc: Path, code: list[Code], links: list[tuple[str, str]]) -> Iterator[str]:
    blocks: dict[int, list[Code]] = {}
    for c in code:
        yield from key_problems(c)
        if c.block in ("yaml", "yml"):
            blocks.setdefault(c.fence, []).append(c)
    for lines in blocks.values():
        yield from yaml_problems(lines)


def check_paths(doc: Path, code: list[Code], links: list[tuple[str, str]]) -> Iterator[str]:
    named = [(c.where, word, places) for c in code for word, places in path_candidates(doc, c)]
    named += [(where, target, [path]) for where, target in links if (path := link_target(doc, target))]
    missing = [(where, word, places) for where, word, places in named if not any(map(exists, places))]
    generated = ignored(path for _, _, places in missing for path in places)
    for where, word, places in missing:
        if not generated & set(places):
            yield f"{where}: `{word}`: no file or folder {' or '.join(places)} in the repository"
    for where, word, places in named:
        if "::" in word and (problem := node_id_problem(word, places)):
            yield f"{where}: `{word}`: {problem}"


def check_names(doc: Path, code: list[Code], links: list[tuple[str, str]]) -> Iterator[str]:
    for c in code:
        yield from name_problems(c)


def problems(check: Check) -> list[str]:
    return [p for doc, (code, links) in docs().items() for p in check(doc, code, links)]


def _report(found: list[str]) -> str:
    return f"{len(found)} problem(s), one a line:\n" + "\n".join(found)


def test_the_docs_are_read():
    """What the checks read: every doc, its commands, keys and paths (a parse that finds nothing checks nothing)."""
    assert {"README.md", "docs/architecture.md", "manifests/README.md", "slurm/README.md", "trainer/README.md"} <= {
        _rel(p) for p in docs()}  # fmt: skip
    code = [c for doc_code, _ in docs().values() for c in doc_code]
    cona_commands = [cmd for c in code for cmd in commands(c.text) if cmd[0].endswith("cona") and len(cmd) > 1]
    keys = [m for c in code for m in _KEY.finditer(c.text) if m.group(1).split(".")[0] in sections()]
    paths = [p for doc, (doc_code, _) in docs().items() for c in doc_code for p in path_candidates(doc, c)]
    assert len(cona_commands) > 100 and len(keys) > 100 and len(paths) > 100, (len(cona_commands), len(keys), len(paths))


def test_commands_use_real_subcommands_and_options():
    found = problems(check_commands)
    assert not found, _report(found)


def test_config_keys_are_fields_of_the_job_or_profile():
    found = problems(check_keys)
    assert not found, _report(found)


def test_paths_and_links_exist():
    if repo_files() is None:
        pytest.skip("not a git work tree: the repository's files cannot be told from generated ones")
    found = problems(check_paths)
    assert not found, _report(found)


def test_python_names_resolve():
    found = problems(check_names)
    assert not found, _report(found)


BROKEN = """\
Run `cona run --bogus 1`, `cona frob`, `cona render k8s --profile P --job J`, `python -m benchmarks.ttp --quik`,
`python -m benchmarks.nope` and `make tests`; set `policy.critical_batch_factr`, `kubernetes.image_pull_secret`,
`batch.base_gbs.x` and `policy.noise_estimator: adamw`; read `orchestrator/policyy.py`, `profiles/nope.yaml`,
[the costs](costmodl.md), `tests/test_policy.py::test_nothing_like_this`, `cona.orchestrator.costmodel.predikt`,
`RunDir.attempt_exit_codes` and `runstate.event_problm`.

```bash
cona plan --profile slurm/profiles/local-cpu.yaml --job examples/tiny-gpt.yaml --set optimizer.lrx=1 \\
    --profile-set nodez=2
OMP_NUM_THREADS=1 torchrun --standalone -m cona.trainer --run-dir runs/x --max-step 3
```

```yaml
policy:
  critical_batch_factor: 5
  bogus: 1
  # min_gian: 0.1    # commented out, still a name
```
"""


def test_each_check_finds_a_broken_line():
    """The checks are not vacuous: each bad name of a broken doc is reported, on its line."""
    doc = REPO / "docs" / "broken.md"
    code, links = parse_doc("docs/broken.md", BROKEN)
    found = [p for check in (check_commands, check_keys, check_paths, check_names) for p in check(doc, code, links)]
    expected = [
        "docs/broken.md:1: `cona run --bogus 1`: cona run has no option --bogus",
        "docs/broken.md:1: `cona frob`: cona has no subcommand 'frob'",
        "docs/broken.md:1: `cona render k8s --profile P --job J`: 'k8s' is not a choice of target",
        "docs/broken.md:1: `python -m benchmarks.ttp --quik`: python -m benchmarks.ttp has no option --quik; did you mean --quick?",
        "docs/broken.md:2: `python -m benchmarks.nope`: no module benchmarks.nope",
        "docs/broken.md:2: `make tests`: the Makefile has no target 'tests'; did you mean test?",
        "docs/broken.md:8: `--set optimizer.lrx`: no field 'lrx' in optimizer; did you mean lr?",
        "docs/broken.md:8: `--profile-set nodez`: no field 'nodez' in ClusterProfile; did you mean nodes?",
        "docs/broken.md:10: `torchrun --standalone -m cona.trainer --run-dir runs/x --max-step 3`: python -m cona.trainer has no option --max-step; did you mean --max-steps?",
        "docs/broken.md:2: `policy.critical_batch_factr`: no field 'critical_batch_factr' in policy; did you mean critical_batch_factor?",
        "docs/broken.md:2: `kubernetes.image_pull_secret`: no field 'image_pull_secret' in kubernetes",
        "docs/broken.md:3: `batch.base_gbs.x`: batch.base_gbs is a value, it has no field 'x'",
        "docs/broken.md:3: `policy.noise_estimator: adamw`: 'adamw' is not one of plain, adam",
        "docs/broken.md:16: YAML key `policy.bogus`: no field 'bogus' in policy",
        "docs/broken.md:17: YAML key `policy.min_gian`: no field 'min_gian' in policy; did you mean min_gain?",
        "docs/broken.md:3: `orchestrator/policyy.py`: no file or folder orchestrator/policyy.py in the repository",
        "docs/broken.md:3: `profiles/nope.yaml`: no file or folder",
        "docs/broken.md:4: `costmodl.md`: no file or folder docs/costmodl.md in the repository",
        "docs/broken.md:4: `tests/test_policy.py::test_nothing_like_this`: tests/test_policy.py has no 'test_nothing_like_this'",
        "docs/broken.md:2: `benchmarks.nope`: benchmarks has no 'nope'",  # as a name too
        "docs/broken.md:4: `cona.orchestrator.costmodel.predikt`: cona.orchestrator.costmodel has no 'predikt'; did you mean predict?",
        "docs/broken.md:5: `RunDir.attempt_exit_codes`: class RunDir has no 'attempt_exit_codes'; did you mean attempt_exit_code?",
        "docs/broken.md:5: `runstate.event_problm`: cona.orchestrator.runstate has no 'event_problm'; did you mean event_problem?",
    ]  # fmt: skip
    missed = [e for e in expected if not any(p.startswith(e) for p in found)]
    assert not missed, "not reported:\n" + "\n".join(missed) + "\nreported:\n" + "\n".join(found)
    assert len(found) == len(expected), "\n".join(found)
