"""Which JSON-schema keywords the grammar enforces, and a check that refuses the others.

xgrammar (mm/constraints.py) compiles every schema, but some keywords it drops, with at most a
warning on stderr: an answer generated under such a schema could fail validation against it. A
schema that uses one is refused up front, naming the keyword and where it is, so a request is
either enforced in full or a clear 400. Found by compiling a schema per keyword and checking that an
instance that breaks only that keyword is refused by the grammar (tests/mm/test_schema_check.py
does this for every keyword named here, so a new xgrammar that changes the answer shows up):

- never enforced: `uniqueItems`, `contains` (and `minContains` / `maxContains`), `dependentRequired`,
  `dependentSchemas`, `dependencies`, `not`, `if` / `then` / `else`;
- `allOf` of more than one schema (the intersection is not built);
- `oneOf` whose schemas could overlap: it is enforced as `anyOf`, so an answer may match two. Taken
  only when every schema names its `type` and no two share one (an integer is a number);
- `minLength` / `maxLength` beside `pattern` or `format` (the lengths are dropped: put the bound
  into the pattern, e.g. `^[a-z]{0,12}$`);
- a string's or a number's keywords (`minLength`, `pattern`, `minimum`, ...) on a schema with no
  `type` (they are dropped; say `"type": "string"` or `"number"`);
- `multipleOf` on a `number` (enforced on integers only).
"""

from __future__ import annotations

from typing import Any

NEVER = ("uniqueItems", "contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas",
         "dependencies", "not", "if", "then", "else")  # fmt: skip
STRING_KEYS = ("minLength", "maxLength", "pattern", "format")
NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
ONE_SCHEMA = ("additionalProperties", "propertyNames", "items", "unevaluatedProperties", "unevaluatedItems")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")


def unenforced(schema: Any, where: str = "#") -> str | None:
    """Why the grammar would not enforce `schema` in full (the first keyword found, with its JSON
    pointer), or None when it would."""
    if not isinstance(schema, dict):
        return None  # true / false, or no schema at all: the compiler's own checks answer
    for key in NEVER:
        if key in schema and not (key == "uniqueItems" and schema[key] is False):
            return f"{key} at {where} is not enforced by the grammar library"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"allOf of {len(schema['allOf'])} schemas at {where} is not enforced (only one): merge them into one"
    if isinstance(schema.get("oneOf"), list) and not _disjoint_types(schema["oneOf"]):
        return (f"oneOf at {where} would be enforced as anyOf (its schemas do not each name a type of their "
                "own): use anyOf, or give each schema a different type")  # fmt: skip
    kinds = _types(schema)
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    if lengths and ("pattern" in schema or "format" in schema):
        other = "pattern" if "pattern" in schema else "format"
        return f"{lengths[0]} beside {other} at {where} is not enforced: put the length bound into the pattern"
    if kinds is None and "enum" not in schema and "const" not in schema:
        loose = [k for k in STRING_KEYS + NUMBER_KEYS if k in schema]
        if loose:
            return f"{loose[0]} at {where} needs a type beside it (\"type\": \"string\" / \"number\" / \"integer\")"
    if "multipleOf" in schema and kinds is not None and "number" in kinds:
        return f"multipleOf on a number at {where} is not enforced (only on integers)"
    for key in ONE_SCHEMA:
        sub = schema.get(key)
        if key == "propertyNames" and isinstance(sub, dict) and "type" not in sub:
            sub = {**sub, "type": "string"}  # a name is a string
        if (reason := unenforced(sub, f"{where}/{key}")) is not None:
            return reason
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                if (reason := unenforced(sub, f"{where}/{key}/{name}")) is not None:
                    return reason
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                if (reason := unenforced(sub, f"{where}/{key}/{i}")) is not None:
                    return reason
    return None


def _types(schema: dict) -> set[str] | None:
    kinds = schema.get("type")
    if kinds is None:
        return None
    return {kinds} if isinstance(kinds, str) else set(kinds)


def _disjoint_types(schemas: list) -> bool:
    """Whether each schema names its type(s) and no value can have the types of two (an integer is a number)."""
    seen: set[str] = set()
    for schema in schemas:
        kinds = _types(schema) if isinstance(schema, dict) else None
        if not kinds:
            return False
        widened = kinds | ({"integer"} if "number" in kinds else set()) | ({"number"} if "integer" in kinds else set())
        if widened & seen:
            return False
        seen |= widened
    return True
