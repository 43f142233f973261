"""Constrained output on the OpenAI endpoint: ``response_format`` (OpenAI's ``json_object`` and ``json_schema``) and
vLLM's extra body fields ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``, read into one
:class:`~gpt2onnx.decoding.constraints.Constraint` per request (at most one of them), refused with OpenAI's error
body (400, naming the field) where invalid, before anything is queued."""

from __future__ import annotations

from gpt2onnx.decoding.constraints import Constraint
from gpt2onnx.errors import BadInput
from gpt2onnx.serving.openai.protocol import STRUCTURED, ApiError, Guided

GUIDED_FIELDS = tuple(Guided.model_fields)  # vLLM's names (its extra body fields for guided decoding)
FORMATS = STRUCTURED


def constraint_of(request) -> Constraint | None:
    """The request's constraint (None: it asks for none): its response_format, or one guided_* field."""
    given = [name for name in GUIDED_FIELDS if getattr(request, name, None) is not None]
    response_format = getattr(request, "response_format", None)
    if response_format not in (None, {"type": "text"}):
        given.insert(0, "response_format")
    if len(given) > 1:
        raise ApiError(400, f"give one constraint: {' and '.join(given)} cannot be combined", param=given[1])
    if not given:
        return None
    name = given[0]
    try:
        if name == "response_format":
            return _response_format(response_format)
        value = getattr(request, name)
        if name == "guided_json":
            return Constraint.json_schema(value, source=name)
        if name == "guided_regex":
            return Constraint.regex(value, source=name)
        if name == "guided_choice":
            return Constraint.choice(value, source=name)
        return Constraint.lark(value, source=name)
    except BadInput as err:
        raise ApiError(400, str(err), param=name) from None


def _response_format(value) -> Constraint:
    """OpenAI's response_format: {"type": "json_object"}, or {"type": "json_schema", "json_schema": {"schema": ...}}."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in FORMATS:
        raise BadInput(f"response_format's type must be one of {', '.join(FORMATS)}, got {str(kind)[:40]!r}")
    if kind == "json_object":
        return Constraint.json_object()
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if schema is None:
        raise BadInput('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
    return Constraint.json_schema(schema, source="response_format")
