"""What a request's JSON asks the grammar for: response_format, a forced tool_choice, vLLM's fields.

  - response_format {"type": "json_object"}: any JSON object; {"type": "json_schema", "json_schema":
    {"schema": ..., "strict": ...}}: an instance of the schema (enforced whether strict is true or not:
    the grammar makes any other output impossible); {"type": "text"}: nothing.
  - tool_choice "required": one or more calls, each to one of `tools` with arguments valid for its
    parameters schema; {"type": "function", "function": {"name": N}}: exactly one call to N. The grammar
    writes Qwen3's own format, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` with the tags
    as their single tokens, so chat_parser reads the calls as it reads any others.
  - vLLM's `structured_outputs` {"json" | "regex" | "choice" | "grammar" | "json_object": ...} and its
    older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
Each becomes one `StructuredOutputsParams` (sampling/structured.py). A request may ask for one of them.
In a chat with thinking on, the grammar starts after `</think>` (sampling/after_reasoning.py), as with
vLLM's reasoning parser: the model reasons freely, then answers under the grammar.
"""

import json
from dataclasses import replace

from qwen3_scratch.sampling.structured import StructuredOutputsParams, lark_string
from qwen3_scratch.text.chat_parser import END_THINK, END_TOOL_CALL, TOOL_CALL
from qwen3_scratch.text.tokenizer import Tokenizer

from .fields import RefusedField

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def from_vllm_fields(body) -> tuple[str, StructuredOutputsParams] | None:
    """vLLM's structured_outputs / guided_* fields -> (the field's name, params)."""
    if body.structured_outputs is not None:
        spec = body.structured_outputs
        unknown = set(spec) - {"json", "regex", "choice", "grammar", "json_object"}
        if unknown:
            raise RefusedField("structured_outputs", f"structured_outputs has unknown keys {sorted(unknown)}")
        return "structured_outputs", StructuredOutputsParams(**spec)
    for name, kind in GUIDED.items():
        if getattr(body, name, None) is not None:
            return name, StructuredOutputsParams(**{kind: getattr(body, name)})
    return None


def from_response_format(response_format: dict | None) -> StructuredOutputsParams | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise RefusedField("response_format", "response_format json_schema needs {'json_schema': {'name': ..., "
                                                  "'schema': {...}}}")  # fmt: skip
        return StructuredOutputsParams(json=spec.get("schema", {}))
    raise RefusedField("response_format", f"response_format type {kind!r} is not supported: use text, json_object "
                                          "or json_schema")  # fmt: skip


def from_tool_choice(tool_choice, tools: list[dict] | None, parallel: bool | None, tokenizer: Tokenizer):
    """The grammar a forced tool_choice asks for, or None for "auto", "none" or no choice."""
    if tool_choice in (None, "auto", "none"):
        if parallel is False and tools:
            raise RefusedField("parallel_tool_calls", "parallel_tool_calls false is enforced only with tool_choice "
                                                      "'required' or a named function")  # fmt: skip
        return None
    if not tools:
        raise RefusedField("tool_choice", "tool_choice needs tools")
    functions = {t.get("function", {}).get("name"): t.get("function", {}) for t in tools}
    if tool_choice == "required":
        chosen, many = list(functions.values()), parallel is not False
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in functions:
            raise RefusedField("tool_choice", f"tool_choice names {name!r}, which is not one of the tools")
        chosen, many = [functions[name]], False
    else:
        raise RefusedField("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                          "{'type': 'function', 'function': {'name': ...}}")  # fmt: skip
    return StructuredOutputsParams(grammar=tool_call_grammar(chosen, many, tokenizer))


def tool_call_grammar(functions: list[dict], many: bool, tokenizer: Tokenizer) -> str:
    """A Lark grammar (llguidance's dialect) for Qwen3 tool calls to these functions: one, or one or more."""
    start, end = tokenizer.token_to_id(TOOL_CALL), tokenizer.token_to_id(END_TOOL_CALL)
    if start is None or end is None:
        raise RefusedField("tool_choice", "this checkpoint's tokenizer has no <tool_call> token")
    rules = [f"start: call{' (' + lark_string(chr(10)) + ' call)*' if many else ''}",
             f"call: <[{start}]> {lark_string(chr(10))} body {lark_string(chr(10))} <[{end}]>",
             "body: " + " | ".join(f"fn{i}" for i in range(len(functions)))]  # fmt: skip
    for i, function in enumerate(functions):
        schema = {"type": "object", "properties": {"name": {"const": function.get("name")},
                  "arguments": function.get("parameters") or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False,
                  "x-guidance": {"whitespace_flexible": False}}  # compact: sampling/structured.py  # fmt: skip
        rules.append(f"fn{i}: %json {json.dumps(schema)}")
    return "\n".join(rules)


def chat_structure(body, tokenizer: Tokenizer) -> StructuredOutputsParams | None:
    """The one constraint a chat request asks for, by whichever field; two at once are refused."""
    asked = []
    if (spec := from_response_format(body.response_format)) is not None:
        asked.append(("response_format", spec))
    tools = [tool.as_dict() for tool in body.tools] if body.tools else None
    if (spec := from_tool_choice(body.tool_choice, tools, body.parallel_tool_calls, tokenizer)) is not None:
        asked.append(("tool_choice", spec))
    if (found := from_vllm_fields(body)) is not None:
        asked.append(found)
    if len(asked) > 1:
        raise RefusedField(asked[1][0], f"{asked[1][0]} and {asked[0][0]} both constrain the output; send one")
    return asked[0][1] if asked else None


def after_reasoning(spec: StructuredOutputsParams, tokenizer: Tokenizer) -> StructuredOutputsParams:
    """spec, starting after the reasoning's `</think>`; unchanged for a tokenizer that has no such token."""
    if tokenizer.token_to_id(END_THINK) is None:
        return spec
    return replace(spec, reasoning_end_str=END_THINK)
