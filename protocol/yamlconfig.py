"""YAML loading, `--set` overrides and one-line validation errors, shared by job specs and cluster profiles.

Torch-free: the orchestrator imports this on login nodes.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)
MAX_INT = 2**53
"""The largest integer a config field takes (the largest a float holds exactly)."""


class ConfigError(ValueError):
    """A user error in a YAML file or an override; its message is one line meant for stderr."""


class _DuplicateKey(yaml.MarkedYAMLError):
    """A YAML error of cona's own reading (a key given twice, an octal count), with its line and column."""


class _StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping. PyYAML keeps the last one, so a section
    pasted twice (two `batch:`) silently replaces the first one whole, defaults and all. Keys brought in by a
    merge (`<<: *base`) may still be overridden, as YAML intends."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                first = seen[key].start_mark.line + 1
                raise _DuplicateKey(problem=f"duplicate key {key!r} (first at line {first}); merge the two into one",
                                    problem_mark=key_node.start_mark)  # fmt: skip
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def _construct_int(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    # YAML 1.1 reads a leading zero as octal: `gbs: 0100` was 64, silently. Nobody writes a count in octal.
    text = str(node.value).replace("_", "").lstrip("+-")
    if len(text) > 1 and text[0] == "0" and text.isdigit():
        raise _DuplicateKey(problem=f"{node.value} is an octal number to YAML 1.1 ({int(text, 8)}); write it without "
                                    "the leading zero, or quote it if it is text", problem_mark=node.start_mark)  # fmt: skip
    if ":" in str(node.value):
        raise _Sexagesimal(node, loader.construct_yaml_int(node))
    return loader.construct_yaml_int(node)


def _construct_float(loader: _StrictLoader, node: yaml.ScalarNode) -> float:
    if ":" in str(node.value):  # `1:30.5` is 90.5 to YAML 1.1
        raise _Sexagesimal(node, loader.construct_yaml_float(node))
    return loader.construct_yaml_float(node)


class _Sexagesimal(_DuplicateKey):
    """YAML 1.1 reads digits separated by colons as one number in base 60: `gbs: 1:04` was 64, `1:30:00` 5400 and
    `env: {FOO: 1:30}` reached the trainers as FOO=90, without a word. No field of cona takes a number written so;
    the text as written is what such a value means (a Slurm time), and quotes keep it: a file's value is refused,
    saying so, and an override's (`--set`, `--profile-set`) is that text (`apply_overrides`), as `_as_written`
    takes any other. `text`: the value as written."""

    def __init__(self, node: yaml.ScalarNode, value: float) -> None:
        self.text = str(node.value)
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        super().__init__(problem=f"{self.text} is a base-60 number to YAML 1.1 ({shown}); write the number itself, or "
                                 f'quote it if it is text ("{self.text}", e.g. a Slurm time)',
                         problem_mark=node.start_mark)  # fmt: skip


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def load_yaml(path: str | Path, *, run_file: bool = False) -> dict[str, Any]:
    """Read a YAML mapping with `yaml.safe_load`, turning every failure into a `ConfigError`. `run_file`: a file of a
    run directory (run.yaml), which must be a regular file (`rundir.open_regular`: a FIFO there hung `cona status`);
    a job or profile may come through a pipe (`--job <(sed ... job.yaml)`)."""
    from cona.protocol.rundir import open_regular

    path = Path(path)
    try:
        if run_file:
            with open_regular(path) as f:
                text = f.read().decode()
        else:
            text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:  # a ValueError that names no file: say which one, and where
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                          "save it as UTF-8") from None  # fmt: skip
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f": line {mark.line + 1} column {mark.column + 1}" if mark else ""
        if isinstance(e, yaml.reader.ReaderError):  # a control character: it has a position but no problem_mark
            where = f": offset {e.position}"
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of fields at the top level, got {type(data).__name__}")
    return data


def _split_override(item: str) -> tuple[str, str]:
    """`key=value` at the first `=` outside a quoted key segment (a label key may hold no `=`, but be safe)."""
    quoted = False
    for i, ch in enumerate(item):
        if ch == '"':
            quoted = not quoted
        elif ch == "=" and not quoted:
            return item[:i].strip(), item[i + 1 :]
    return item.strip(), ""


def _key_parts(key: str) -> list[str]:
    """A dotted key's parts. A part holding dots — a Kubernetes label such as `cloud.google.com/gke-accelerator`
    under `kubernetes.node_selector` — is written in double quotes or with its dots escaped as `\\.` (Helm's
    `--set` convention): `kubernetes.node_selector."cloud.google.com/gke-accelerator"=nvidia-tesla-a100`."""
    parts, current, quoted, i = [], "", False, 0
    while i < len(key):
        ch = key[i]
        if ch == "\\" and i + 1 < len(key) and key[i + 1] == ".":
            current, i = current + ".", i + 2
            continue
        if ch == '"':
            quoted = not quoted
        elif ch == "." and not quoted:
            parts.append(current)
            current = ""
        else:
            current += ch
        i += 1
    parts.append(current)
    return parts


def apply_overrides(data: dict[str, Any], overrides: list[str], *, source: str = "--set") -> dict[str, Any]:
    """Apply `dotted.key=value` overrides; the value is parsed as YAML so `1e-3`, `true`, `[1,2]` work."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{source} {item!r}: expected dotted.key=value, e.g. optimizer.lr=3e-4")
        key, raw = _split_override(item)
        parts = _key_parts(key)
        if not key or any(not part for part in parts):
            raise ConfigError(f"{source} {item!r}: empty field name in {key!r}; expected dotted.key=value, e.g. "
                              "optimizer.lr=3e-4")  # fmt: skip
        try:
            value = yaml.load(raw, Loader=_StrictLoader) if raw.strip() else ""  # as a file reads it (an octal count)
        except _Sexagesimal as e:
            if e.text != raw.strip():  # inside a list or mapping: the quotes go there
                raise ConfigError(f"{source} {item!r}: {e.problem}") from None
            value = e.text  # on the command line the text is what was meant (`slurm.time_limit=1:30:00`)
        except _DuplicateKey as e:
            raise ConfigError(f"{source} {item!r}: {e.problem}") from None
        except yaml.YAMLError:
            value = raw
        node = data
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                # What to give instead: an item of a list (`batch.mbs_choices.0=4`) cannot be set on its own.
                path = ".".join(parts[: depth + 1])
                if isinstance(child, list):
                    now = json.dumps(child)
                    raise ConfigError(f"{source} {item!r}: {path!r} is a list, not a section; give the whole list, "
                                      f"e.g. {source} {path}={now if len(now) <= 60 else '[...]'}")  # fmt: skip
                raise ConfigError(f"{source} {item!r}: {path!r} is a value, not a section; set it whole: "
                                  f"{source} {path}=VALUE")  # fmt: skip
            node = child
        node[parts[-1]] = value
    return data


def _field_names(model: type[pydantic.BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The valid field names at `loc` (the parent of an unknown key), following nested models."""
    current: Any = model
    for part in loc:
        if isinstance(part, int) and isinstance(current, type) and issubclass(current, pydantic.BaseModel):
            continue  # an item of a list of sections (`policy.schedule.0`): `list[Model]` was unwrapped to Model
        if isinstance(current, type) and issubclass(current, pydantic.BaseModel) and isinstance(part, str):
            field = current.model_fields.get(part)
            if field is None:
                return []
            current = field.annotation
            # unwrap Optional[X], X | None and list[X] to the section X
            args = [a for a in getattr(current, "__args__", ()) if a is not type(None)]
            if args and not (isinstance(current, type) and issubclass(current, pydantic.BaseModel)):
                models = [a for a in args if isinstance(a, type) and issubclass(a, pydantic.BaseModel)]
                current = models[0] if models else current
        else:
            return []
    if isinstance(current, type) and issubclass(current, pydantic.BaseModel):
        return list(current.model_fields)
    return []


def _describe(model: type[pydantic.BaseModel], error: dict[str, Any]) -> str:
    loc = tuple(error["loc"])
    path = ".".join(str(p) for p in loc) or "(top level)"
    kind = error["type"]
    if kind == "extra_forbidden":
        valid = _field_names(model, loc[:-1])
        name = str(loc[-1])
        close = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        listing = f"valid fields here: {', '.join(valid)}" if valid else ""
        return f"unknown field {path!r}; " + ("; ".join(x for x in (hint, listing) if x) or "remove it")
    if kind == "missing":
        return f"missing required field {path!r}"
    msg = error["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    value = error.get("input")
    # Say what was given, unless the message already quotes it (`must be positive, got '0 GB'`).
    shown = f" (got {value!r})" if not isinstance(value, dict | list) and repr(value) not in msg else ""
    if kind == "string_type" and isinstance(value, int | float) and not isinstance(value, bool):
        # `memory: 80` lacks its unit. (An unquoted 24:00:00, base 60 to YAML 1.1, is refused as it is read.)
        shown += '; YAML read a number here: write the value in quotes, with its unit if it has one (e.g. "80 GB")'
    return f"field {path!r}: {msg}{shown}" if loc else f"{msg}{shown}"


def validate(
    model: type[ModelT], data: dict[str, Any], *, source: str, overrides: list[str] | tuple[str, ...] = (),
    flag: str = "--set",
) -> ModelT:  # fmt: skip
    """Build `model` from `data`, answering the first problem as a one-line `ConfigError` naming its path (and the
    `flag` override that set it, when one of `overrides` did: the file is then not where to look)."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        retry = _as_written(data, e.errors(), overrides)
        if retry is not None:  # each retry turns at least one field into text, which is no string_type error again
            return validate(model, retry, source=source, overrides=overrides, flag=flag)
        # A misspelled key usually also causes a "missing" error for the intended one: report the typo first.
        errors = sorted(e.errors(), key=lambda err: err["type"] != "extra_forbidden")
        first = _describe(model, errors[0])
        more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
        path = ".".join(str(p) for p in errors[0]["loc"])
        keys = [(o, o.partition("=")[0].strip() + ".") for o in overrides]
        given = [o for o, key in keys if (path + ".").startswith(key)]  # the field itself, or a section set whole
        inside = [o for o, key in keys if key.startswith(path + ".")]  # a field of the section that is wrong
        origin = f", set by {flag} {given[-1]}" if given else f", with {flag} {' '.join(inside)}" if inside else ""
        if errors[0]["type"] == "string_type" and isinstance(errors[0].get("input"), dict) and inside:
            # `--profile-set kubernetes.node_selector.cloud.google.com/gke-accelerator=x` split the label at its dots.
            origin += "; a key with dots goes in quotes there (node_selector.\"cloud.google.com/gke-accelerator\"=x)"
        raise ConfigError(f"{source}: {first}{more}{origin}") from None


def _as_written(data: dict[str, Any], errors: list[Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any] | None:
    """`data` with each text field that an override set to what YAML read as a number given the override's own text
    instead, or None when there is none. On the command line the text is what was meant: YAML reads `--set
    data.path=2024` as an integer, and the fix the error suggested, quotes, has to survive the shell
    (`'data.path="2024"'`); a base-60 number (`slurm.time_limit=1:00:00`) is kept as written already
    (`_Sexagesimal`). A file's value is left as it is: there the quotes are easy, and its error says so."""
    raw = {key: value.strip() for key, value in map(_split_override, overrides)}
    fixed: dict[tuple[str, ...], str] = {}
    for error in errors:
        value, loc = error.get("input"), tuple(error["loc"])
        path = ".".join(str(p) for p in loc)
        if (error["type"] == "string_type" and isinstance(value, int | float) and not isinstance(value, bool)
                and path in raw and raw[path] and all(isinstance(p, str) for p in loc)):  # fmt: skip
            fixed[loc] = raw[path]
    if not fixed:
        return None
    out = copy.deepcopy(data)
    for loc, text in fixed.items():
        node = out
        for part in loc[:-1]:
            node = node[part]
        node[loc[-1]] = text
    return out


class StrictModel(pydantic.BaseModel):
    """Base of every config section: unknown keys are errors and every value is validated on assignment. No
    infinite or NaN number: none means anything here, and one reaches the cost model as a division by zero."""

    model_config = pydantic.ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)

    @pydantic.field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        # pydantic's lax mode reads YAML's true/false as 1/0 in a number field (`nodes: true` is one node); a
        # boolean where the field takes none is a slip, so say so.
        field = cls.model_fields.get(info.field_name or "")
        if field is None:
            return value
        if _stray_bool(field.annotation, value):
            raise ValueError(_bool_message(field.annotation))
        if _arms(field.annotation) == [bool] and value is not None and (problem := not_a_bool(value)):
            raise ValueError(problem)
        if isinstance(value, str) and ":" in value and _takes_number_not_text(field.annotation):
            # An override's base-60 number stays the text written (`_Sexagesimal`): a count field says why not.
            try:
                number = yaml.safe_load(value)  # YAML 1.1's own reading, to show it
            except yaml.YAMLError:
                number = None
            if isinstance(number, int | float) and not isinstance(number, bool):
                raise ValueError(f"{value!r} is not a number here (YAML 1.1 reads it as base 60, {number:g}); write "
                                 "the number itself")  # fmt: skip
        if isinstance(value, str) and _takes_int_not_text(field.annotation):
            # YAML 1.1 reads `1.5e8` and `1e6` (no dot, or no sign in the exponent) as text, which pydantic will
            # not read as an integer: a whole number written in e-notation is what the user meant.
            try:
                number = float(value)
            except ValueError:
                return value
            if math.isfinite(number) and number.is_integer():
                value = int(number)
        whole = isinstance(value, float) and math.isfinite(value) and value.is_integer()
        if ((isinstance(value, int) and not isinstance(value, bool)) or (whole and _takes_int_not_text(field.annotation))) \
                and abs(value) > MAX_INT:  # fmt: skip
            # No count here comes near 2**53; a larger one overflows float arithmetic in the cost model. Checked
            # after the e-notation above, which is how such a number is usually written (`1e20`).
            raise ValueError(f"too large (at most {MAX_INT:.0e})")
        return value


def not_a_bool(value: Any) -> str | None:
    """Why `value` is not a true/false (one line), or None. pydantic's lax mode reads "false", "no", "off" or 0 as
    false and "true", "on" or 1 as true: a quoted or numeric value in a switch is a slip (or a list where one value
    goes), so it is said, not guessed."""
    if isinstance(value, bool):
        return None
    return f"{value!r} is not true or false; write true or false without quotes (or leave it out)"


def _arms(annotation: Any) -> list[Any]:
    """The types a field admits, None left out (`int | None` → [int])."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _takes_number_not_text(annotation: Any) -> bool:
    arms = _arms(annotation)
    return (int in arms or float in arms) and str not in arms and Any not in arms


def _takes_int_not_text(annotation: Any) -> bool:
    arms = _arms(annotation)
    return int in arms and str not in arms and Any not in arms


def _leaf_arms(annotation: Any) -> list[Any]:
    """`_arms`, with a list's, tuple's or set's item types in place of the container."""
    leaves: list[Any] = []
    for arm in _arms(annotation):
        if typing.get_origin(arm) in (list, tuple, set, frozenset):
            leaves += [leaf for inner in typing.get_args(arm) if inner is not Ellipsis for leaf in _leaf_arms(inner)]
        else:
            leaves.append(arm)
    return leaves


def _bool_message(annotation: Any) -> str:
    """What a field that takes no true/false expects. YAML 1.1 reads an unquoted yes/no/on/off as true/false, so
    `lr_scaling: no` or `recompute: off` arrive as booleans."""
    arms = _leaf_arms(annotation)  # a list's items: `setup: [..., true]` is a shell command to quote
    choices = [c for arm in arms if typing.get_origin(arm) is typing.Literal for c in typing.get_args(arm)]
    quote = " (YAML reads an unquoted yes/no/on/off/true/false as a boolean: quote the value)"
    if choices:
        return f"expects one of {', '.join(repr(c) for c in choices)}, not true/false" + quote
    if str in arms:
        return "expects text, not true/false" + quote
    return "expects a number (or a list of numbers), not true/false"


def _admits_bool(annotation: Any) -> bool:
    if annotation is bool or annotation is Any or isinstance(annotation, bool):
        return True
    return any(_admits_bool(arm) for arm in typing.get_args(annotation))


def _stray_bool(annotation: Any, value: Any) -> bool:
    """Whether `value` holds a true/false where `annotation` (a field's type) admits no boolean."""
    if isinstance(value, bool):
        return not _admits_bool(annotation)
    origin = typing.get_origin(annotation)
    arms = [a for a in typing.get_args(annotation) if a is not type(None) and a is not Ellipsis]
    if origin in (typing.Union, types.UnionType):
        return bool(arms) and all(_stray_bool(arm, value) for arm in arms)
    if isinstance(value, list | tuple) and origin in (list, tuple, set, frozenset) and arms:
        return any(_stray_bool(arms[0], item) for item in value)
    return False


_UNITS = {
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: Any, *, per_second: bool = False) -> float:
    """Parse `"80 GB"`, `"80GiB"`, `"300 GB/s"`, `"200 Gbit/s"` or `"200 Gb/s"` into bytes (per second).

    Units are required so that bits and bytes can never be confused.
    """
    if isinstance(value, bool) or not isinstance(value, str):
        unit = "e.g. '200 Gbit/s' or '300 GB/s'" if per_second else "e.g. '80 GiB' or '80 GB'"
        raise ValueError(f"give a number with a unit, {unit}")
    text = value.strip().replace(" ", "")
    if per_second:
        if not (text.endswith("/s") or text.endswith("ps")):
            raise ValueError(f"expected a rate such as '200 Gbit/s' or '300 GB/s', got {value!r}")
        text = text[:-2]
    elif text.endswith("/s"):
        raise ValueError(f"{value!r} is a rate; a size has no /s: write e.g. '80 GB' or '80 GiB'")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = text[len(number) :]
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(f"cannot read a number in {value!r}") from None
    if not math.isfinite(amount):
        raise ValueError(f"must be a finite number, got {value!r}")
    if amount <= 0:
        raise ValueError(f"must be positive, got {value!r}")
    if not unit:  # units are required so that bits and bytes are never confused
        example = f"'{number} GB/s' or '{number} Gbit/s'" if per_second else f"'{number} GB' or '{number} GiB'"
        raise ValueError(f"{value!r} has no unit; write e.g. {example}")
    bits = unit.endswith("bit") or (unit.endswith("b") and not unit.endswith("B"))
    if bits and not per_second:
        # A memory size in bits is almost always a mistyped "GB" ("80 gb" would silently be 10 GB).
        raise ValueError(f"{value!r} is in bits (a lower-case b); a size is in bytes: write e.g. '80 GB' or '80 GiB'")
    if unit.endswith("bit"):
        unit = unit[:-3] + "b"
    key = unit.lower()
    if key not in _UNITS:
        raise ValueError(f"unknown unit {unit!r} in {value!r}; use B, KB, MB, GB, TB, GiB, Gbit (or Gb)")
    factor = _UNITS[key] / (8 if bits and key != "b" else 1)
    if key == "b" and bits:
        factor = 1 / 8
    if amount <= 0:
        raise ValueError(f"must be positive, got {value!r}")
    if amount * factor < 1:
        # Under a byte (per second) is a slip (`1e-300 B/s`), and a denormal rate divides the cost model by zero.
        raise ValueError(f"{value!r} is less than one byte{' per second' if per_second else ''}; check the number and unit")
    return amount * factor


def unindented(cls: type[StrictModel], data: dict[str, Any], path: str | Path) -> None:
    """ConfigError for top-level keys that are fields of a section left empty (`model:` over an unindented `preset:
    tiny-gpt`, `accelerator:` over an unindented `name: cpu`): the indent was lost, which the unknown-key message
    would answer with an unrelated close match ("did you mean 'target'?"). For a job and a profile alike."""
    if not isinstance(data, dict):
        return
    for section, field in cls.model_fields.items():
        model = field.annotation
        if section not in data or data[section] is not None:
            continue
        if not (isinstance(model, type) and issubclass(model, StrictModel)):
            continue
        stray = [k for k in data if k not in cls.model_fields and k in model.model_fields]
        if stray:
            raise ConfigError(f"{path}: {', '.join(repr(k) for k in stray)} at the top level after an empty "
                              f"'{section}:' section; indent {'them' if len(stray) > 1 else 'it'} under "
                              f"'{section}:'")  # fmt: skip
