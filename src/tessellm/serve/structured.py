"""Structured outputs over the OpenAI API: ``response_format`` (OpenAI's ``json_object`` and
``json_schema``) and ``structured_outputs`` (vLLM's names: ``json``, ``regex``, ``choice``,
``grammar``, ``json_object``; the openai library sends it with ``extra_body``), turned into
the ``GrammarSpec`` the engine's grammar backend compiles."""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.grammar import GrammarSpec


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema and OpenAI's ``strict`` flag."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object) or ``json_schema`` (output that parses and fits the schema)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type json_schema needs json_schema.schema (the JSON schema the output must fit)")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, as an object or JSON
    text), ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF) or ``json_object``."""

    model_config = ConfigDict(extra="forbid")

    json_: Union[dict[str, Any], str, None] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = Field(None, min_length=1)
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            named = ", ".join(g.rstrip("_") for g in given) or "none"
            raise ValueError(f"give exactly one of json, regex, choice, grammar, json_object (got {named})")
        return self

    def spec(self) -> GrammarSpec:
        if self.json_ is not None:
            return GrammarSpec.schema(_schema_object(self.json_, "structured_outputs.json"))
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        if self.choice is not None:
            return GrammarSpec.choice(self.choice)
        if self.grammar is not None:
            return GrammarSpec("ebnf", self.grammar)
        return GrammarSpec("json_object")


def _schema_object(value: dict[str, Any] | str, where: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequestError(f"{where} must be a JSON schema object, got {type(parsed).__name__}")
    return parsed


def grammar_of(response_format: ResponseFormat | None, structured: StructuredOutputs | None) -> GrammarSpec | None:
    """The request's output constraint, or None; InvalidRequestError when both fields
    constrain it."""
    spec = None
    if response_format is not None and response_format.type == "json_object":
        spec = GrammarSpec("json_object")
    elif response_format is not None and response_format.type == "json_schema":
        schema = response_format.json_schema
        spec = GrammarSpec.schema(schema.schema_, strict=bool(schema.strict))
    if structured is not None:
        if spec is not None:
            raise InvalidRequestError("response_format and structured_outputs both constrain the output; give one")
        spec = structured.spec()
    return spec
