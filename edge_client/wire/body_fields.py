"""A body's fields, declared once: how each is checked, read, written, left out and published.

A body comes from the network, so no field is trusted: a wrong one is a ProtocolError
that says which field of which kind was wrong, and how, which is what a device's error
reply or the coordinator's log needs to be useful.

Each body dataclass (``bodies.py``, ``worker_bodies.py``) subclasses :class:`Body` and
declares each field with :func:`wire` (or :func:`optional`): a :class:`Check` (what the
JSON value must be, the words an error uses, its JSON Schema and how it becomes the
field's value), the value an absent key means, and when the encoder leaves the key out.
:meth:`Body.from_body` and :meth:`Body.to_body` are driven by those declarations, and so
is the published JSON Schema (:mod:`edge_client.wire.schema`): the three cannot drift.

:class:`Fields` reads one field by hand, for bodies not declared this way (the secure
aggregation messages, ``edge_client/secagg``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from edge_client.wire.codec_spec import CodecError, parse_codec
from edge_client.wire.errors import ProtocolError
from edge_client.wire.topics import ID_PATTERN

__all__ = ["Fields", "Check", "Body", "wire", "optional", "rules", "REQUIRED",
           "integer", "number", "text", "matching", "one_of", "boolean", "an_object", "names", "codec_spec", "nested",
           "is_int", "is_number", "is_str", "is_session", "is_object", "is_names", "is_sha256",
           "SESSION", "SHA256", "CLIENT_ID"]

_SESSION_RE = re.compile(r"^[0-9a-f]{1,32}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

_MISSING: Any = object()


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite JSON number (booleans excluded; an integer too large for a float is not finite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def is_str(value: Any) -> bool:
    return isinstance(value, str)


def is_session(value: Any) -> bool:
    return isinstance(value, str) and bool(_SESSION_RE.fullmatch(value))


def is_object(value: Any) -> bool:
    return isinstance(value, dict)


def is_names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(n, str) for n in value)


def is_sha256(value: Any) -> bool:
    """A SHA-256 in lowercase hex, as the model broadcast is referenced by."""
    return isinstance(value, str) and bool(_SHA256_RE.fullmatch(value))


class Fields:
    """Reads the fields of one JSON object of a body, naming the field in every error."""

    def __init__(self, kind: str, body: Any, prefix: str = "") -> None:
        if not isinstance(body, Mapping):
            raise ProtocolError(f"{kind} {'field ' + repr(prefix.rstrip('.')) if prefix else 'body'} "
                                f"must be an object, got {_show(body)}")
        self.kind, self.body, self.prefix = kind, body, prefix

    def __contains__(self, name: str) -> bool:
        return name in self.body

    def get(self, name: str, want: str, ok: Callable[[Any], bool], default: Any = _MISSING) -> Any:
        """``body[name]`` when ``ok`` accepts it; ``default`` when absent (without one, it is required)."""
        if name not in self.body:
            if default is _MISSING:
                raise ProtocolError(f"{self.kind} field {self.prefix + name!r} is missing; it must be {want}")
            return default
        value = self.body[name]
        if not ok(value):
            raise ProtocolError(f"{self.kind} field {self.prefix + name!r} must be {want}, got {_show(value)}")
        return value


# --- what a field's JSON value must be -------------------------------------------------------------------------

def _same(value: Any, *_: Any) -> Any:
    return value


@dataclass(frozen=True)
class Check:
    """What one field's JSON value must be, and what it becomes.

    ``ok`` accepts a JSON value; ``want`` completes "must be ..." in the error; ``schema`` says
    the same in JSON Schema. ``load(value, kind, path)`` makes the field's value of an accepted
    one (it may raise a ProtocolError of its own, naming ``path``); ``dump`` is its inverse.
    """

    ok: Callable[[Any], bool]
    want: str
    schema: Mapping[str, Any]
    load: Callable[[Any, str, str], Any] = _same
    dump: Callable[[Any], Any] = _same

    def wanting(self, want: str) -> Check:
        """The same check, its errors saying ``want`` (what the field is for, not only its type)."""
        return dataclasses.replace(self, want=want)


def _as_float(value: Any, *_: Any) -> float:
    return float(value)


def integer(minimum: int | None = None, want: str | None = None) -> Check:
    """A JSON integer (not a boolean), at least ``minimum``."""
    words = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}
    return Check(lambda v: is_int(v) and (minimum is None or v >= minimum),
                 want or words.get(minimum, f"an integer >= {minimum}"),
                 {"type": "integer", **({} if minimum is None else {"minimum": minimum})})


def number(above: float | None = None, at_least: float | None = None, want: str | None = None) -> Check:
    """A finite JSON number, read as a float: greater than ``above`` or at least ``at_least``."""
    if above is not None:
        return Check(lambda v: is_number(v) and v > above, want or ("a positive number" if above == 0 else
                                                                    f"a number > {above}"),
                     {"type": "number", "exclusiveMinimum": above}, _as_float)
    if at_least is not None:
        return Check(lambda v: is_number(v) and v >= at_least, want or f"a number >= {at_least:g}",
                     {"type": "number", "minimum": at_least}, _as_float)
    return Check(is_number, want or "a finite number", {"type": "number"}, _as_float)


def text(want: str = "a string") -> Check:
    return Check(is_str, want, {"type": "string"})


def matching(pattern: str, want: str) -> Check:
    """A string that ``pattern`` (a regular expression with ``^...$``) matches in full."""
    compiled = re.compile(pattern)
    return Check(lambda v: isinstance(v, str) and bool(compiled.fullmatch(v)), want,
                 {"type": "string", "pattern": pattern})


SESSION = matching(_SESSION_RE.pattern, "1 to 32 lowercase hex digits")
SHA256 = matching(_SHA256_RE.pattern, "a SHA-256 in lowercase hex (64 characters)")
CLIENT_ID = matching(ID_PATTERN, "a client id")


def one_of(values: tuple[str, ...]) -> Check:
    return Check(lambda v: isinstance(v, str) and v in values, f"one of {values}",
                 {"type": "string", "enum": list(values)})


def boolean() -> Check:
    return Check(lambda v: isinstance(v, bool), "true or false", {"type": "boolean"})


def an_object(want: str = "an object", values: Check | None = None) -> Check:
    """A JSON object; with ``values``, each of its values passes that check (and is loaded by it)."""
    if values is None:
        return Check(is_object, want, {"type": "object"})
    inner = values
    return Check(lambda v: isinstance(v, dict) and all(inner.ok(x) for x in v.values()), want,
                 {"type": "object", "additionalProperties": dict(inner.schema)},
                 lambda v, kind, path: {k: inner.load(x, kind, path) for k, x in v.items()},
                 lambda v: {k: inner.dump(x) for k, x in v.items()})


def names(want: str = "a list of tensor names", items: Check | None = None, non_empty: bool = False) -> Check:
    """A JSON list (of strings, or of what ``items`` accepts), held as a tuple."""
    inner = items or text()
    return Check(lambda v: isinstance(v, list) and all(inner.ok(x) for x in v) and (len(v) > 0 or not non_empty),
                 want, {"type": "array", "items": dict(inner.schema), **({"minItems": 1} if non_empty else {})},
                 lambda v, *_: tuple(v), list)


def _load_codec(value: str, kind: str, path: str) -> Any:
    try:
        return parse_codec(value)
    except CodecError as exc:
        raise CodecError(f"{kind} field {path!r}: {exc}") from None


def codec_spec() -> Check:
    """A codec spec string (``topk:0.1+int8+zstd``), held parsed as a CodecSpec."""
    return Check(is_str, "a codec spec string such as 'topk:0.1+int8+zstd'",
                 {"type": "string", "description": "a codec spec, e.g. fp32, int8, topk:0.1+int8+zstd"},
                 _load_codec, lambda spec: spec.text)


def nested(cls: type[Body], definition: str) -> Check:
    """A JSON object that is itself a declared body (``cls``), published as ``$defs/definition``."""
    return Check(is_object, "an object", {"$ref": f"#/$defs/{definition}"},
                 lambda v, kind, path: cls.read(v, kind, path + "."), lambda body: body.to_body())


# --- declaring a field -----------------------------------------------------------------------------------------

REQUIRED: Any = object()   # ``absent=REQUIRED``: the key must be there, though the dataclass has a default
_NEVER: Any = object()
_SAME: Any = object()
_META = "fedge.wire"


@dataclass(frozen=True)
class FieldRule:
    """How one dataclass field travels: kept in the field's metadata by :func:`wire`."""

    check: Check
    absent: Any            # the field's value when its key is absent; REQUIRED: the key may not be
    omit: Any              # the encoder leaves the key out when the value is this; _NEVER: always written
    unless: str | None     # neither read nor written when the body carries this key
    only_with: str | None  # read and written only when the body carries this key
    factory: Callable[[], Any] | None = None   # makes a fresh ``absent`` value (a mutable one: {} or [])

    def omitted(self, value: Any) -> bool:
        return self.omit is not _NEVER and value == self.omit

    def absent_value(self) -> Any:
        return self.factory() if self.factory is not None else self.absent


def wire(check: Check, default: Any = _MISSING, *, factory: Callable[[], Any] | None = None, absent: Any = _SAME,
         omit_when: Any = _NEVER, unless: str | None = None, only_with: str | None = None) -> Any:
    """Declare a body field: ``check`` its JSON value; ``default`` (or ``factory``) the dataclass's default,
    which is also what an absent key means unless ``absent`` says otherwise (``REQUIRED``: the key must be
    there); ``omit_when``: the encoder leaves the key out when the field equals it; ``unless`` / ``only_with``:
    the field belongs to the body only without / with the key of another field (a failed result's fields)."""
    if absent is not _SAME:
        rule = FieldRule(check, absent, omit_when, unless, only_with)
    elif default is _MISSING and factory is None:
        rule = FieldRule(check, REQUIRED, omit_when, unless, only_with)
    else:
        rule = FieldRule(check, default, omit_when, unless, only_with, factory)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={_META: rule})
    if default is _MISSING:
        return dataclasses.field(metadata={_META: rule})
    return dataclasses.field(default=default, metadata={_META: rule})


def optional(check: Check) -> Any:
    """A field that may be absent (None), and is left out of the body when it is."""
    return wire(check, None, omit_when=None)


@functools.cache
def rules(cls: type) -> dict[str, FieldRule]:
    """Each field of a body dataclass with its declaration, in the order its keys are written."""
    fields = dataclasses.fields(cls)
    undeclared = [f.name for f in fields if _META not in f.metadata]
    if undeclared:
        raise TypeError(f"{cls.__name__} fields {undeclared} are not declared: give each a wire(...) or "
                        "optional(...) default, so that it is checked, written and published")
    found = {f.name: f.metadata[_META] for f in fields}
    order = getattr(cls, "WIRE_ORDER", ()) or tuple(found)
    if sorted(order) != sorted(found):
        raise TypeError(f"{cls.__name__}.WIRE_ORDER must list each of its fields once: {sorted(found)}")
    return {name: found[name] for name in order}


B = TypeVar("B", bound="Body")


class Body:
    """A body dataclass whose fields are all declared with :func:`wire`: reads and writes itself from that.

    ``KIND`` names the body in errors (``"task field 'seed' must be ..."``); ``TENSORS`` says which tensors
    a message of the kind carries (published with its schema); ``WIRE_ORDER``, when the keys are written in
    another order than the fields are declared in, lists every field in the written order (the bytes of a
    header, and so of a reproducible run's files, depend on it).
    """

    KIND: ClassVar[str] = ""
    TENSORS: ClassVar[str] = ""
    WIRE_ORDER: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_body(cls: type[B], body: Any) -> B:
        """Parse and check a body from the network; ProtocolError naming the field on any problem."""
        return cls.read(body, cls.KIND, "")

    @classmethod
    def read(cls: type[B], body: Any, kind: str, prefix: str) -> B:
        """:meth:`from_body` for an object at ``prefix`` inside a ``kind`` body (``"upload."``)."""
        f = Fields(kind, body, prefix)
        values: dict[str, Any] = {}
        for name, rule in rules(cls).items():
            if (rule.unless and rule.unless in f) or (rule.only_with and rule.only_with not in f):
                continue   # the dataclass's default stands
            if name in f or rule.absent is REQUIRED:
                values[name] = rule.check.load(f.get(name, rule.check.want, rule.check.ok), kind, prefix + name)
            else:
                values[name] = rule.absent_value()
        return cls(**values)

    def to_body(self) -> dict[str, Any]:
        """The JSON object a message carries: every declared key, in order, but those its rules leave out."""
        out: dict[str, Any] = {}
        for name, rule in rules(type(self)).items():
            value = getattr(self, name)
            if rule.omitted(value) or (rule.unless and not _left_out(self, rule.unless)) \
                    or (rule.only_with and _left_out(self, rule.only_with)):
                continue
            out[name] = rule.check.dump(value)
        return out


def _left_out(body: Body, name: str) -> bool:
    return rules(type(body))[name].omitted(getattr(body, name))
