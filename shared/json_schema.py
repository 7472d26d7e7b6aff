"""JSON schemas as constraints read them: an object whose keys the schema fully lists has no others.

JSON Schema allows any further key where a schema does not say `additionalProperties`, and a model under such a
schema writes some (a review saw `{"name": ",", "age": 100, ",": 250.0}`). OpenAI's strict mode refuses a schema
without `additionalProperties: false`, and vLLM's default grammar backend (xgrammar) reads one that says nothing as
closed; so does specmesh, where closing cannot change which objects the schema means: only an object that lists
`properties`, requires none but those, and is not extended by a combinator (`allOf`, `anyOf`/`oneOf` beside its own
properties, `$ref` beside them, `if`, `not`, dependent schemas), nor used as such an extension through `$ref`. A
schema that wants more keys says so (`additionalProperties: true`, or a schema for them, or `patternProperties`).

Also: a schema that refers to itself or its parts moved under the definitions of a schema that embeds it (a tool's
parameters inside a call object), where its `#...` references would point into that one.
"""

from __future__ import annotations

from typing import Any

OPEN_ENDED = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Keywords beside which an object's own `properties` are not all its keys (they add some, or rule on them)
EXTENDED_BY = ("allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "not", "dependentSchemas", "dependencies",
               "propertyNames", "minProperties", "maxProperties")
ANNOTATIONS = frozenset({"$ref", "title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly"})
OWN_SCHEMA_MAPS = ("properties", "patternProperties")  # name -> the schema of that key's value
OWN_SCHEMAS = ("items", "prefixItems", "additionalItems", "additionalProperties", "contains", "unevaluatedItems")
EXTENSIONS = ("allOf", "if", "then", "else", "not")  # schemas that extend the object they stand in
EXTENSION_MAPS = ("dependentSchemas", "dependencies")
DEFINITIONS = ("$defs", "definitions")


class _Unresolved(Exception):
    """A reference other than to a definition by name: what it extends is not tracked, so nothing is closed."""


def closed_objects(schema: Any) -> Any:
    """The schema with every object whose keys it fully lists closed to others (a copy); the schema as it is where it
    refers to anything but its definitions by name."""
    extended: set[tuple[str, str]] = set()  # (definitions keyword, name) used as an extension somewhere
    try:
        while True:  # until no more: a definition extended makes those it refers to extensions too
            before = len(extended)
            _walk(schema, True, extended, close=False)
            if len(extended) == before:
                break
    except _Unresolved:
        return schema
    return _walk(schema, True, extended, close=True)


def _walk(schema: Any, closable: bool, extended: set[tuple[str, str]], close: bool) -> Any:
    """`closable`: whether this schema describes its objects whole, not an extension of one described beside it
    (what stands under an extension is one too)."""
    if isinstance(schema, list):  # allOf's, prefixItems, a draft's items list: each as closable as the list
        return [_walk(sub, closable, extended, close) for sub in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    ref_extended = "$ref" in out and bool(set(out) - ANNOTATIONS)  # a $ref with more than annotations beside it
    if "$ref" in out:
        target = _definition(out["$ref"])
        if ref_extended or not closable:
            extended.add(target)
    if close and closable and _keys_listed(out):
        out["additionalProperties"] = False
    # Its keys' and items' schemas are whole unless something beside them describes the same keys or items further
    described_further = any(key in out for key in (*EXTENSIONS, *EXTENSION_MAPS)) or ref_extended or (
        ("anyOf" in out or "oneOf" in out) and not _alternatives_alone(out)
    )
    own_closable = closable and not described_further
    for key in OWN_SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _walk(sub, own_closable, extended, close) for name, sub in out[key].items()}
    for key in OWN_SCHEMAS:  # a boolean schema (additionalProperties false) comes back as it is
        if key in out:
            out[key] = _walk(out[key], own_closable, extended, close)
    for key in ("anyOf", "oneOf"):  # alternatives, each whole where nothing beside them rules on the object's keys
        if isinstance(out.get(key), list):
            alone = not any(k in out for k in (*OPEN_ENDED, *EXTENDED_BY, "properties", "required") if k != key)
            out[key] = [_walk(sub, closable and alone, extended, close) for sub in out[key]]
    for key in EXTENSIONS:
        if key in out:
            out[key] = _walk(out[key], False, extended, close)
    for key in EXTENSION_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _walk(sub, False, extended, close) for name, sub in out[key].items()}
    for key in DEFINITIONS:
        if isinstance(out.get(key), dict):
            out[key] = {
                name: _walk(sub, (key, name) not in extended, extended, close) for name, sub in out[key].items()
            }
    return out


def _alternatives_alone(schema: dict) -> bool:
    """Whether a schema's anyOf/oneOf stands without anything else ruling on its objects' keys or items."""
    beside = (*OPEN_ENDED, *EXTENDED_BY, *OWN_SCHEMA_MAPS, *OWN_SCHEMAS, "required")
    return sum(key in schema for key in ("anyOf", "oneOf")) == 1 and not any(
        key in schema for key in beside if key not in ("anyOf", "oneOf"))


def _definition(ref: Any) -> tuple[str, str]:
    """(definitions keyword, name) of a reference to a definition by name; _Unresolved for any other."""
    parts = ref.split("/") if isinstance(ref, str) and "%" not in ref else []  # no URI escapes to decode
    if len(parts) != 3 or parts[0] != "#" or parts[1] not in DEFINITIONS:
        raise _Unresolved(ref)
    return parts[1], parts[2].replace("~1", "/").replace("~0", "~")


def _keys_listed(schema: dict) -> bool:
    """Whether the object's keys are exactly those its `properties` may list."""
    properties = schema.get("properties")
    if not isinstance(properties, dict) or any(key in schema for key in OPEN_ENDED + EXTENDED_BY):
        return False
    required = schema.get("required", [])
    dependent = schema.get("dependentRequired", {})
    named = set(required) | set(dependent) | {key for keys in dependent.values() for key in keys}
    return named <= set(properties)


def embedded(schema: dict, name: str) -> tuple[dict, dict]:
    """(a reference to the schema, the definitions to put at the root of the schema that embeds it) for a schema
    that refers to itself or its parts: moved whole under `name` ([a-zA-Z0-9_-]), each reference rewritten to point
    into it, since inside another schema `#...` would point into that one. A schema without references stays as it
    is (no definitions)."""
    if not _refers(schema):
        return schema, {}
    return {"$ref": f"#/$defs/{name}"}, {name: _rebased(schema, f"#/$defs/{name}")}


def _refers(value: Any) -> bool:
    if isinstance(value, list):
        return any(_refers(item) for item in value)
    return isinstance(value, dict) and ("$ref" in value or any(_refers(item) for item in value.values()))


def _rebased(value: Any, base: str) -> Any:
    if isinstance(value, list):
        return [_rebased(item, base) for item in value]
    if not isinstance(value, dict):
        return value
    out = {key: _rebased(item, base) for key, item in value.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    return out
