"""Constrained output on the real Qwen2.5-Coder-0.5B-Instruct (`.ci/run` fetches it): JSON
Schema answers (nested objects, arrays, enums, required fields) parse and validate, and the
constrained answer is token-identical to `none`'s in the speculative modes."""

from __future__ import annotations

import json

import jsonschema
import pytest

from mlxspec.chat_session import render_chat
from mlxspec.engine import Engine

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False}
SCHEMAS = [
    ("a person", PERSON),
    ("a list of three fruits", {"type": "object", "properties": {
        "fruits": {"type": "array", "items": {"type": "string", "maxLength": 12},
                   "minItems": 3, "maxItems": 3}}, "required": ["fruits"]}),
    ("the color of the sky", {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}),
    ("a book with its author", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30}, "author": PERSON},
        "required": ["title", "author"]}),
    ("a Python function's name and its arguments", {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[a-z_]{1,20}$"},
        "args": {"type": "array", "items": {"type": "string", "maxLength": 10},
                 "maxItems": 4}}, "required": ["name", "args"]}),
    ("whether 7 is prime", {"type": "object", "properties": {
        "number": {"type": "integer"}, "prime": {"type": "boolean"}},
        "required": ["number", "prime"], "additionalProperties": False}),
    ("two points of a line", {"type": "object", "properties": {
        "points": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
            "required": ["x", "y"], "additionalProperties": False}}},
        "required": ["points"]}),
    ("an HTTP response", {"type": "object", "properties": {
        "status": {"enum": [200, 404, 500]}, "headers": {"type": "object", "properties": {
            "content-type": {"type": "string", "maxLength": 30}},
            "required": ["content-type"]}, "ok": {"type": "boolean"}},
        "required": ["status", "headers", "ok"]}),
]


def prompt(engine, what: str, schema: dict) -> str:
    return render_chat(engine.tokenizer, [{"role": "user", "content": (
        f"Give me {what} as JSON following this schema:\n{json.dumps(schema)}")}])


@pytest.mark.slow
def test_eight_json_schemas_answer_valid_json(coder_small):
    engine = Engine(coder_small.model, coder_small.tokenizer, mode="ngram", num_draft=4)
    for what, schema in SCHEMAS:
        got = engine.generate(prompt(engine, what, schema), max_tokens=120, json_schema=schema)
        assert got.finish_reason == "stop", (what, got.text)
        jsonschema.validate(json.loads(got.text), schema)


@pytest.mark.slow
def test_constrained_answers_are_nones_on_the_real_coder(coder_small, coder_small_4bit):
    engine = Engine(coder_small.model, coder_small.tokenizer, mode="none")
    texts = [prompt(engine, what, schema) for what, schema in SCHEMAS[3:5]]
    want = [engine.generate(p, max_tokens=60, json_schema=s).tokens
            for p, (_, s) in zip(texts, SCHEMAS[3:5])]
    engine.draft_model = coder_small_4bit
    for mode in ("ngram", "draft", "auto"):
        engine.set_mode(mode, num_draft=4)
        for p, (_, s), w in zip(texts, SCHEMAS[3:5], want):
            got = engine.generate(p, max_tokens=60, json_schema=s)
            assert got.tokens == w, mode
