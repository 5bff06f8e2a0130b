"""JSON schemas of increasing difficulty for the constrained-decoding tests.

Every schema bounds what it allows (string lengths or patterns, number ranges, array sizes, no
free-form additional properties, no recursion), so the grammar forces the output to end well
within the tests' token budget even under a random model. Output must validate with the
``jsonschema`` package (formats checked too).
"""

from __future__ import annotations

from typing import Any

_POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9},
        "y": {"type": "integer", "minimum": -9, "maximum": 9},
    },
    "required": ["x", "y"],
}
_ITEM = {
    "type": "object",
    "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 10},
        "price": {"type": "number", "minimum": 0, "maximum": 1000},
    },
    "required": ["sku", "qty", "price"],
}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    # --- scalars
    ("boolean", {"type": "boolean"}),
    ("null", {"type": "null"}),
    ("bounded_integer", {"type": "integer", "minimum": 0, "maximum": 100}),
    ("negative_integer", {"type": "integer", "minimum": -50, "maximum": -10}),
    ("bounded_number", {"type": "number", "minimum": -10, "maximum": 10}),
    ("string_enum", {"type": "string", "enum": ["red", "green", "blue"]}),
    ("const", {"const": "fixed value"}),
    ("short_string", {"type": "string", "maxLength": 10}),
    ("string_length_range", {"type": "string", "minLength": 3, "maxLength": 5}),
    ("nullable_integer", {"type": ["integer", "null"], "minimum": 0, "maximum": 9}),
    ("mixed_enum", {"enum": ["a", 1, True, None]}),
    # --- patterns and formats
    ("pattern_code", {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}),
    ("pattern_email", {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}),
    ("format_date", {"type": "string", "format": "date"}),
    ("format_uuid", {"type": "string", "format": "uuid"}),
    # --- arrays
    (
        "int_array",
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    ),
    ("exact_pair", {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "minItems": 2, "maxItems": 2}),
    ("empty_or_small_array", {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}),
    # --- objects
    (
        "one_field",
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["a"]},
    ),
    (
        "two_required",
        {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
            "required": ["name", "ok"],
        },
    ),
    (
        "required_and_optional",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 999},
                "tag": {"type": "string", "maxLength": 6},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["id"],
        },
    ),
    ("all_optional", {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}}}),
    (
        "odd_keys",
        {
            "type": "object",
            "properties": {
                "naïve key": {"type": "boolean"},
                'with "quotes"': {"type": "integer", "minimum": 0, "maximum": 3},
            },
            "required": ["naïve key", 'with "quotes"'],
        },
    ),
    (
        "nested_2",
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 8},
                        "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    },
                    "required": ["name", "age"],
                }
            },
            "required": ["user"],
        },
    ),
    (
        "nested_3",
        {
            "type": "object",
            "properties": {
                "a": {
                    "type": "object",
                    "properties": {
                        "b": {
                            "type": "object",
                            "properties": {"c": {"type": "string", "enum": ["deep"]}},
                            "required": ["c"],
                        }
                    },
                    "required": ["b"],
                }
            },
            "required": ["a"],
        },
    ),
    (
        "array_of_objects",
        {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "k": {"type": "string", "maxLength": 4},
                    "v": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["k", "v"],
            },
        },
    ),
    (
        "object_with_arrays",
        {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "enum": ["a", "b", "c"]},
                    "minItems": 1,
                    "maxItems": 3,
                },
                "matrix": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0, "maximum": 1},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                },
            },
            "required": ["tags", "matrix"],
        },
    ),
    # --- anyOf
    (
        "anyof_scalars",
        {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "enum": ["none", "many"]}]},
    ),
    (
        "anyof_objects",
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["kind", "r"],
                },
                {
                    "type": "object",
                    "properties": {
                        "kind": {"const": "rect"},
                        "w": {"type": "integer", "minimum": 1, "maximum": 9},
                        "h": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["kind", "w", "h"],
                },
            ]
        },
    ),
    (
        "optional_anyof_field",
        {
            "type": "object",
            "properties": {
                "value": {
                    "anyOf": [{"type": "boolean"}, {"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 5}]
                },
                "unit": {"type": "string", "enum": ["kg", "m"]},
            },
            "required": ["unit"],
        },
    ),
    # --- $ref / $defs
    (
        "ref_twice",
        {
            "$defs": {"point": _POINT},
            "type": "object",
            "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
            "required": ["from", "to"],
        },
    ),
    (
        "ref_in_array",
        {"$defs": {"point": _POINT}, "type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 3},
    ),
    (
        "ref_chain",
        {
            "$defs": {
                "point": _POINT,
                "segment": {
                    "type": "object",
                    "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
                    "required": ["a", "b"],
                },
            },
            "type": "object",
            "properties": {"segment": {"$ref": "#/$defs/segment"}},
            "required": ["segment"],
        },
    ),
    # --- realistic
    (
        "order",
        {
            "$defs": {"item": _ITEM},
            "type": "object",
            "properties": {
                "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                "customer": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "minLength": 1, "maxLength": 12},
                        "email": {"type": "string", "pattern": "^[a-z]{1,6}@example\\.com$"},
                        "vip": {"type": "boolean"},
                    },
                    "required": ["name", "email"],
                },
                "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2},
                "status": {"type": "string", "enum": ["pending", "shipped", "delivered"]},
                "notes": {"type": "string", "maxLength": 12},
            },
            "required": ["order_id", "customer", "items", "status"],
        },
    ),
    (
        "event",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "minLength": 1, "maxLength": 10},
                "date": {"type": "string", "format": "date"},
                "attendees": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "maxLength": 6},
                            "role": {"type": "string", "enum": ["host", "guest"]},
                        },
                        "required": ["name", "role"],
                    },
                    "minItems": 1,
                    "maxItems": 2,
                },
                "location": {
                    "anyOf": [
                        {"type": "null"},
                        {
                            "type": "object",
                            "properties": {
                                "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                "floor": {"type": "integer", "minimum": 0, "maximum": 20},
                            },
                            "required": ["city"],
                        },
                    ]
                },
            },
            "required": ["title", "date", "attendees", "location"],
        },
    ),
]
