"""JSON schemas as constraints read them: an object that lists its properties and says nothing of others has none.

JSON Schema allows any further key where a schema does not say `additionalProperties`, and a model under such a
schema writes some (a review saw `{"name": ",", "age": 100, ",": 250.0}`). OpenAI's strict mode refuses a schema
without `additionalProperties: false`, and vLLM's default grammar backend (xgrammar) reads one that says nothing as
closed; so does specmesh. A schema that wants more keys says so (`additionalProperties: true`, or a schema for them,
or `patternProperties`). Objects under `allOf` stay open: each branch lists only some of the keys the others add.
"""

from __future__ import annotations

from typing import Any

SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")  # lists of schemas
SCHEMAS = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
           "propertyNames", "unevaluatedItems")
OPEN_ENDED = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any, closing: bool = True) -> Any:
    """The schema with every object that lists `properties` and none of OPEN_ENDED closed to others (a copy)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if closing and "properties" in out and not any(key in out for key in OPEN_ENDED):
        out["additionalProperties"] = False
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub, closing) for name, sub in out[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub, closing) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(sub, closing=False) for sub in out["allOf"]]
    for key in SCHEMAS:
        if key in out:
            out[key] = closed_objects(out[key], closing)
    return out
