"""Tool calling on /v1/chat/completions: the tools, the choice, and the guiding grammar.

    tool_choice        what the model may do            how kvflow makes it so
    "none"             answer in text                   tools are not shown to the model
    "auto" (default)   text or calls, its decision      the chat template (or kvflow's
                                                        Hermes-style prompt) shows the
                                                        tools; tool_parser.py extracts
                                                        <tool_call>{...}</tool_call>
    "required"         one or more calls                a JSON schema: an array of
                                                        {"name", "parameters"} objects,
                                                        one per call (maxItems 1 unless
                                                        parallel_tool_calls)
    {"type": "function", "function": {"name": N}}
                       exactly one call of N            the function's parameter schema

Under "required" and a named function the output is guided, so the arguments always
validate against the function's schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from kvflow.errors import InvalidRequestError
from kvflow.sampling_params import StructuredOutputsParams
from kvflow.structured_outputs import check_grammar

_ANY_OBJECT: dict[str, Any] = {"type": "object"}
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


class FunctionSpec(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolSpec(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionSpec


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: NamedFunction


ToolChoice = str | NamedToolChoice


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools and tool_choice resolve to."""

    mode: str  # none | auto | required | named
    tools: list[ToolSpec]
    function: str | None = None  # the named function
    parallel: bool = True

    @property
    def shows_tools(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool.function.name == name:
                return tool.function.parameters or _ANY_OBJECT
        raise KeyError(name)


def tool_use(tools: list[ToolSpec] | None, choice: ToolChoice | None, parallel: bool) -> ToolUse:
    """Resolve and check tools + tool_choice; raises InvalidRequestError (400)."""
    tools = tools or []
    for tool in tools:
        if tool.type != "function":
            raise InvalidRequestError(
                f"tools: only type 'function' is supported, got {tool.type!r}", param="tools"
            )
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: function names must be unique", param="tools")
    if choice is None:
        return ToolUse("auto" if tools else "none", tools, parallel=parallel)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidRequestError(
                f"tool_choice names function {choice.function.name!r}, which is not in tools",
                param="tool_choice",
            )
        return ToolUse("named", tools, choice.function.name, parallel)
    if choice not in ("none", "auto", "required"):
        raise InvalidRequestError(
            f"tool_choice must be none, auto, required or a named function, got {choice!r}",
            param="tool_choice",
        )
    if choice != "none" and not tools:
        raise InvalidRequestError(f"tool_choice {choice!r} needs tools", param="tool_choice")
    return ToolUse(choice, tools, parallel=parallel)


def guide(use: ToolUse) -> StructuredOutputsParams | None:
    """The constraint that makes the output a valid call (None: the model decides);
    a `parameters` schema no call can satisfy is a 400 naming `tools`."""
    constraint = _call_constraint(use)
    if constraint is not None:
        check_grammar(constraint, "tools")
    return constraint


def _call_constraint(use: ToolUse) -> StructuredOutputsParams | None:
    if use.mode == "named":
        assert use.function is not None
        return StructuredOutputsParams(json=use.parameters(use.function))
    if use.mode != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or _ANY_OBJECT,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in use.tools
    ]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not use.parallel:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array)


def tool_guide(
    tools: list[ToolSpec] | None, choice: ToolChoice | None, parallel: bool
) -> StructuredOutputsParams | None:
    return guide(tool_use(tools, choice, parallel))


def tools_prompt(use: ToolUse) -> str:
    """A system-prompt section that shows the tools, for chat templates that do not
    render `tools` themselves (Hermes' format, which tool_parser.py reads back)."""
    listing = "\n".join(
        json.dumps(msgspec.to_builtins(tool), ensure_ascii=False) for tool in use.tools
    )
    return (
        "You can call functions. They are described by these JSON schemas:\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To call a function, answer with one block per call:\n"
        f'{TOOL_CALL_OPEN}{{"name": <function name>, "arguments": <arguments object>}}'
        f"{TOOL_CALL_CLOSE}"
    )


def with_tools(
    conversation: list[dict[str, Any]], use: ToolUse, template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation and the `tools` argument for the chat template: templates that
    know `tools` get them; others get kvflow's tools prompt in the system message."""
    if not use.shows_tools:
        return conversation, None
    if template is not None and "tools" in template:
        return conversation, [msgspec.to_builtins(tool) for tool in use.tools]
    prompt = tools_prompt(use)
    if conversation and conversation[0]["role"] == "system":
        system = dict(conversation[0], content=f"{conversation[0]['content']}\n\n{prompt}")
        return [system, *conversation[1:]], None
    return [{"role": "system", "content": prompt}, *conversation], None
