"""Finding the schemas inside an OpenAPI property's schema, to write in the bounds that depend on the server."""

from __future__ import annotations


def subschemas(schema: dict, want) -> list[dict]:
    """The schemas inside a property's schema (itself, its anyOf branches, array items) for which want() holds."""
    found = [schema] if want(schema) else []
    for sub in schema.get("anyOf", []) + ([schema["items"]] if "items" in schema else []):
        found += subschemas(sub, want)
    return found


def integer_schemas(schema: dict) -> list[dict]:
    return subschemas(schema, lambda s: s.get("type") == "integer")


def token_lists(schema: dict) -> list[dict]:
    return subschemas(schema, lambda s: s.get("type") == "array" and s.get("items", {}).get("type") == "integer")
