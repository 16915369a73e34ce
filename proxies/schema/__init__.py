"""The JSON Schema of a proxy's result (result.schema.json) and a validator for the part of
JSON Schema it uses, so checking a result needs no extra dependency.

    python -c "from proxies import schema; print(schema.check(json.load(open('r.json'))))"
"""

from __future__ import annotations

import json
import os

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "result.schema.json")
# The keywords validate() understands; any other keyword in a schema is an error, so a
# schema never silently asks for more than is checked.
KEYWORDS = ("type", "required", "properties", "additionalProperties", "items", "enum")
ANNOTATIONS = ("$schema", "$id", "$comment", "title", "description")
TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    # JSON has one number type; bool is not a number (Python's bool is an int).
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def load() -> dict:
    """The result schema."""
    with open(PATH) as f:
        return json.load(f)


def validate(value: object, schema: dict | bool, where: str = "$") -> list[str]:
    """Every way `value` breaks `schema` ("$.config: expected object, got list"); [] when
    it conforms. Supports type, required, properties, additionalProperties, items, enum."""
    if schema is True:
        return []
    if schema is False:
        return [f"{where}: not allowed"]
    unknown = set(schema) - set(KEYWORDS) - set(ANNOTATIONS)
    if unknown:
        raise ValueError(f"{where}: schema keywords not supported: {', '.join(sorted(unknown))}")
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(TYPES[t](value) for t in types):
            got = type(value).__name__
            return [f"{where}: expected {' or '.join(types)}, got {got}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where}: {value!r} is not one of {schema['enum']}"]
    errors: list[str] = []
    if isinstance(value, dict):
        errors += [f"{where}: missing {k!r}" for k in schema.get("required", ()) if k not in value]
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for k, v in value.items():
            sub = props.get(k, extra)
            if sub is False:
                errors.append(f"{where}: unexpected field {k!r} (not in the schema)")
            else:
                errors += validate(v, sub, f"{where}.{k}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            errors += validate(v, schema["items"], f"{where}[{i}]")
    return errors


def check(result: object) -> list[str]:
    """validate() against the result schema."""
    return validate(result, load())
