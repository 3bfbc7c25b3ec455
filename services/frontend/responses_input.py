"""A /v1/responses request turned into what the chat path takes: a conversation, the
tool use, and SamplingParams.

    input item                                  chat message
    "text" (input as a string)                  {"role": "user", "content": text}
    {"role", "content"} / type "message"        {"role", "content"} (parts joined;
                                                developer -> system)
    {"type": "function_call", call_id,          an assistant turn's tool_calls entry
     name, arguments}                           (consecutive calls share one turn)
    {"type": "function_call_output",            {"role": "tool", "tool_call_id",
     call_id, output}                            "content": output}
    {"type": "reasoning", ...}                  nothing: earlier thinking is left out

`instructions` becomes a leading system message; it is not carried to later turns
(OpenAI's rule): a stored response keeps its history without it.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from kvflow.errors import InvalidRequestError
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from kvflow.services.frontend.responses_protocol import (
    FunctionCallItem,
    InputContentPart,
    InputItem,
    OutputItem,
    ReasoningItem,
    ResponsesRequest,
    TextConfig,
)
from kvflow.services.frontend.structured_fields import GuidedFields, resolve_structured_outputs
from kvflow.services.frontend.tool_calling import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    FunctionSpec,
    NamedFunction,
    NamedToolChoice,
    ToolChoice,
    ToolSpec,
    ToolUse,
    guide,
    tool_use,
)

Message = dict[str, Any]
T = TypeVar("T")
_NO_GUIDED = GuidedFields(None, None, None, None, None)


def input_messages(items: str | list[InputItem]) -> list[Message]:
    """The chat messages of `input`; raises InvalidRequestError naming the bad item."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[Message] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "message":
            messages.append(_message(item, where))
        elif item.type == "function_call":
            _add_call(messages, item, where)
        elif item.type == "reasoning":
            continue  # earlier thinking stays out of the prompt (module docstring)
        else:
            call_id = _required(item.call_id, where, "call_id")
            output = _required(item.output, where, "output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text(output)})
    return messages


def output_messages(output: list[OutputItem]) -> list[Message]:
    """A response's output as the assistant turn(s) of a later conversation."""
    items = [
        InputItem(type="function_call", call_id=o.call_id, name=o.name, arguments=o.arguments)
        if isinstance(o, FunctionCallItem)
        else InputItem(role="assistant", content="".join(part.text for part in o.content))
        for o in output
        if not isinstance(o, ReasoningItem)
    ]
    return input_messages(items) if items else []


def conversation(
    instructions: str | None, history: list[Message], messages: list[Message]
) -> list[Message]:
    system = [{"role": "system", "content": instructions}] if instructions else []
    return [*system, *history, *messages]


def _message(item: InputItem, where: str) -> Message:
    role = _required(item.role, where, "role")
    content = _required(item.content, where, "content")
    return {"role": "system" if role == "developer" else role, "content": _text(content)}


def _add_call(messages: list[Message], item: InputItem, where: str) -> None:
    call = {
        "id": _required(item.call_id, where, "call_id"),
        "type": "function",
        "function": {
            "name": _required(item.name, where, "name"),
            "arguments": _required(item.arguments, where, "arguments"),
        },
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _required(value: Any, where: str, field: str) -> Any:
    if value is None:
        raise InvalidRequestError(f"{where} needs '{field}'", param=f"{where}.{field}")
    return value


def _text(content: str | list[InputContentPart]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def fold_tool_calls(messages: list[Message], template: str | None) -> list[Message]:
    """For chat templates that do not render `tool_calls`: write an assistant turn's
    calls into its content, in the <tool_call> format the model is asked to use, so the
    model sees the calls it made."""
    if template is not None and "tool_calls" in template:
        return messages
    folded = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            blocks = [_call_block(call["function"]) for call in calls]
            content = "\n".join(filter(None, [message["content"], *blocks]))
            message = {"role": message["role"], "content": content}
        folded.append(message)
    return folded


def _call_block(function: dict[str, Any]) -> str:
    try:
        arguments: Any = json.loads(function["arguments"])
    except json.JSONDecodeError:
        arguments = function["arguments"]
    call = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{call}{TOOL_CALL_CLOSE}"


def request_tool_use(request: ResponsesRequest) -> ToolUse:
    """tools + tool_choice in the chat path's terms (checked there)."""
    tools = []
    for i, tool in enumerate(request.tools or []):
        if tool.type != "function" or tool.name is None:
            raise InvalidRequestError(
                f"tools[{i}]: only function tools with a 'name' are supported, got type "
                f"{tool.type!r}",
                param=f"tools[{i}]",
            )
        spec = FunctionSpec(
            name=tool.name,
            description=tool.description,
            parameters=tool.parameters,
            strict=tool.strict,
        )
        tools.append(ToolSpec(function=spec))
    choice: ToolChoice | None = None
    if isinstance(request.tool_choice, str):
        choice = request.tool_choice
    elif request.tool_choice is not None:
        named = request.tool_choice
        if named.type != "function" or named.name is None:
            raise InvalidRequestError(
                "tool_choice must be none, auto, required or {'type': 'function', 'name': ...}",
                param="tool_choice",
            )
        choice = NamedToolChoice(function=NamedFunction(named.name))
    parallel = request.parallel_tool_calls is not False
    return tool_use(tools, choice, parallel)


def text_format(text: TextConfig | None) -> StructuredOutputsParams | None:
    """text.format through the chat path's response_format resolution (so a schema is
    checked the same way), with errors naming text.format."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        response_format: dict[str, Any] = {"type": "json_object"}
    else:
        if fmt.name is None:
            raise InvalidRequestError(
                "text.format of type json_schema needs a 'name'", param="text.format.name"
            )
        spec = {"name": fmt.name, "schema": fmt.schema_ or {}, "strict": fmt.strict}
        response_format = {"type": "json_schema", "json_schema": spec}
    try:
        return resolve_structured_outputs(response_format, None, _NO_GUIDED)
    except InvalidRequestError as exc:
        # Name the Responses field: the schema itself when the grammar check failed.
        param = exc.param or "response_format"
        param = "text.format.schema" if param == "response_format" else param
        param = param.replace("response_format.json_schema", "text.format")
        message = exc.message.replace("response_format.json_schema", "text.format")
        raise InvalidRequestError(
            message.replace("response_format", "text.format"), param=param
        ) from None


def sampling_params(request: ResponsesRequest, use: ToolUse) -> SamplingParams:
    constraint = text_format(request.text)
    tool_constraint = guide(use)
    if tool_constraint is not None and constraint is not None:
        raise InvalidRequestError(
            "tool_choice 'required' or a named function cannot be combined with a "
            "text.format other than text",
            param="tool_choice",
        )
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    return SamplingParams(
        max_tokens=request.max_output_tokens,
        min_tokens=_or(request.min_tokens, 0),
        temperature=_or(request.temperature, 1.0),
        top_k=_or(request.top_k, 0),
        top_p=_or(request.top_p, 1.0),
        min_p=_or(request.min_p, 0.0),
        presence_penalty=_or(request.presence_penalty, 0.0),
        frequency_penalty=_or(request.frequency_penalty, 0.0),
        repetition_penalty=_or(request.repetition_penalty, 1.0),
        seed=request.seed,
        stop=stop or None,
        ignore_eos=request.ignore_eos,
        bad_words=request.bad_words,
        allowed_token_ids=request.allowed_token_ids,
        structured_outputs=tool_constraint or constraint,
    )


def _or(value: T | None, default: T) -> T:
    return default if value is None else value
