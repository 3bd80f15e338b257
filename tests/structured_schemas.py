"""JSON schemas the structured-output tests run on random-weight models: every kind of bound a schema
can set (nested objects, enums, arrays with bounds, numbers with ranges, string patterns, optional
fields, $defs/$ref, unions). Every string is bounded (maxLength, pattern or enum): a model with random
weights then ends each object within a bounded number of tokens."""

from __future__ import annotations

from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}},
        "required": ["color", "size"]},
    "bounded_array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"]},
    "number_ranges": {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -50, "maximum": 50},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "count": {"type": "integer", "minimum": 10, "maximum": 20}},
        "required": ["celsius", "ratio", "count"]},
    "patterns": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-1][0-9]-[0-3][0-9]$"}},
        "required": ["code", "date"]},
    "optional_fields": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "nickname": {"type": "string", "maxLength": 6},
        "score": {"type": "integer", "minimum": 0, "maximum": 5}},
        "required": ["id"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {"type": "object", "properties": {
                "street": {"type": "string", "maxLength": 8},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "zip"]}},
            "required": ["name", "address"]}},
        "required": ["user"]},
    "array_of_objects": {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["sku", "qty"]}}},
        "required": ["items"]},
    "bool_and_null": {"type": "object", "properties": {
        "flag": {"type": "boolean"}, "maybe": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                         {"type": "null"}]}},
        "required": ["flag", "maybe"]},
    "matrix": {"type": "object", "properties": {
        "rows": {"type": "array", "maxItems": 2, "items": {
            "type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
        "required": ["rows"]},
    "defs_and_refs": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"]}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"]},
    "top_level_array": {"type": "array", "minItems": 2, "maxItems": 4,
                        "items": {"enum": ["north", "south", "east", "west"]}},
}
