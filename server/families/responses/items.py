"""The Responses API's request -> the chat path's ChatCompletionRequest: `input` items (messages,
function_call, function_call_output, reasoning, earlier output items) -> chat messages, `instructions` -> the
system turn, function tools and tool_choice -> chat's, text.format -> response_format.

Everything a field asks for is either honoured or refused with a 400 naming it; nothing semantic is dropped.
"""

from __future__ import annotations

import json
from typing import Any

from server.families.responses.files import file_text
from server.families.responses.protocol import ResponsesRequest
from server.http.errors import APIError, bad_request
from server.request.openai_protocol import ChatCompletionRequest, JSONSchemaFormat, ResponseFormat

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
INCLUDE_OK = ("reasoning.encrypted_content",)  # nothing to add: accepted as a no-op
LOGPROBS = "message.output_text.logprobs"


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own input as a list of items (a string is one user message)."""
    if req.input is None:
        raise bad_request("input is required.", "input")
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return list(req.input)


def _text(part: dict[str, Any], param: str) -> str:
    text = part.get("text", part.get("refusal"))
    if not isinstance(text, str):
        raise bad_request(f"{param}.text must be a string.", f"{param}.text")
    return text


def _content(content: Any, param: str, images: bool) -> str | list[dict[str, Any]]:
    """A message's content: a string, or parts -> one string (text only) or chat parts (with images)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of content parts.", param)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            parts.append({"type": "text", "text": _text(part, p)})
        elif kind == "input_image":
            url = part.get("image_url")
            if not images:
                raise bad_request(f"{p}: images are not supported: this server serves a text-only model.", p)
            if not isinstance(url, str):
                raise bad_request(
                    f"{p}.image_url must be a URL or a data: URL (file_id is not supported).", f"{p}.image_url"
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "input_file":
            parts.append({"type": "text", "text": file_text(part, p)})
        else:
            raise bad_request(
                f"{p}.type {kind!r} is not supported; use input_text, input_image or input_file.", f"{p}.type"
            )
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)  # as the chat route joins text parts
    return parts


def _arguments(text: Any, param: str) -> Any:
    if not isinstance(text, str):
        raise bad_request(f"{param}.arguments must be a JSON string.", f"{param}.arguments")
    try:
        return json.loads(text) if text.strip() else {}  # templates take the arguments as an object
    except ValueError:
        return text


class _Messages:
    """Items -> chat messages, in order: consecutive function calls join one assistant turn."""

    def __init__(self, images: bool) -> None:
        self.out: list[dict[str, Any]] = []
        self.names: dict[str, str] = {}  # call_id -> function name
        self.images = images
        self.reasoning: list[str] = []  # reasoning items waiting for their assistant turn

    def _assistant(self, new: bool) -> dict[str, Any]:
        """The assistant turn to add to: the last one, unless `new` or reasoning waits for a turn of its own."""
        last = self.out[-1] if self.out else None
        if new or self.reasoning or last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}  # "" rather than none: templates concatenate content
            self.out.append(last)
        if self.reasoning:
            last["reasoning_content"] = "\n".join(self.reasoning)
            self.reasoning = []
        return last

    def add(self, i: int, item: Any) -> None:
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{param} must be an object.", param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            self._message(item, param)
        elif kind == "function_call":
            self._call(item, param)
        elif kind == "function_call_output":
            self._output(item, param)
        elif kind == "reasoning":
            texts = [c.get("text", "") for c in item.get("content") or [] if isinstance(c, dict)]
            self.reasoning.append("".join(t for t in texts if isinstance(t, str)))
        else:  # an item_reference was resolved by the route (resolve_references) before this
            raise bad_request(
                f"{param}.type {kind!r} is not supported; use message, function_call, "
                "function_call_output, reasoning or item_reference.",
                f"{param}.type",
            )

    def _message(self, item: dict[str, Any], param: str) -> None:
        role = item.get("role")
        if role not in ROLES:
            raise bad_request(f"{param}.role must be one of {', '.join(ROLES)}.", f"{param}.role")
        content = _content(item.get("content"), f"{param}.content", self.images and role == "user")
        if role == "assistant":
            self._assistant(True)["content"] = content
            return
        self.out.append({"role": "system" if role == "developer" else role, "content": content})

    def _call(self, item: dict[str, Any], param: str) -> None:
        call_id, name = item.get("call_id"), item.get("name")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"{param}.call_id is required.", f"{param}.call_id")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{param}.name is required.", f"{param}.name")
        turn = self._assistant(False)
        turn.setdefault("tool_calls", []).append(
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": _arguments(item.get("arguments"), param)},
            }
        )
        self.names[call_id] = name

    def _output(self, item: dict[str, Any], param: str) -> None:
        call_id = item.get("call_id")
        if call_id not in self.names:
            raise bad_request(f"{param}.call_id {call_id!r} answers no function_call before it.", f"{param}.call_id")
        output = item.get("output")
        text = output if isinstance(output, str) else _content(output, f"{param}.output", False)
        self.out.append({"role": "tool", "tool_call_id": call_id, "name": self.names[call_id], "content": text})


def chat_messages(instructions: str | None, items: list[Any], images: bool = False) -> list[dict[str, Any]]:
    """instructions + items -> the chat template's messages."""
    m = _Messages(images)
    if instructions is not None:
        m.out.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        m.add(i, item)
    if not any(msg["role"] != "system" for msg in m.out):
        raise bad_request("input must hold at least one message.", "input")
    return m.out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in chat's shape; built-in tools (web_search_preview, file_search, ...) are a 400."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(
                f"tools[{i}].type {tool.get('type')!r} is not supported: this server runs function tools only.",
                f"tools[{i}].type",
            )
        if not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{i}].name is required.", f"tools[{i}].name")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice  # "none" | "auto" | "required": checked by the chat path's tool plan
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}.', "tool_choice"
    )


def response_format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text is not None else None
    kind = fmt.get("type") if fmt is not None else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat(type="json_object")
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return ResponseFormat(
            type="json_schema",
            json_schema=JSONSchemaFormat(
                name=str(fmt.get("name") or "output"),
                description=fmt.get("description"),
                schema=fmt["schema"],
                strict=fmt.get("strict"),
            ),
        )
    raise bad_request(
        'text.format must be {"type": "text"}, {"type": "json_object"} or '
        '{"type": "json_schema", "name": ..., "schema": {...}}.',
        "text.format",
    )


def check_unsupported(req: ResponsesRequest) -> None:
    """400s for what this server does not do yet, rather than silently doing something else."""
    for inc in req.include or []:
        if inc not in INCLUDE_OK and inc != LOGPROBS:
            raise bad_request(f"include {inc!r} is not supported.", "include")
    if req.truncation not in (None, "disabled", "auto"):
        raise bad_request('truncation must be "auto" or "disabled".', "truncation")
    if req.background and not req.store:
        raise bad_request("background responses need store: true (they are read back with GET).", "background")
    if req.background and req.stream:
        raise bad_request("a streamed background response is not supported yet: poll it with GET.", "stream")
    if req.conversation is not None:
        raise bad_request(
            "conversation is not supported: continue a conversation with previous_response_id.", "conversation"
        )
    if req.prompt is not None:
        raise bad_request("prompt (a stored prompt template) is not supported: send instructions and input.", "prompt")


def chat_request(
    req: ResponsesRequest, history: list[Any], *, images: bool = False, given: list[Any] | None = None
) -> ChatCompletionRequest:
    """The chat request the chat path renders, checks and builds the engine request from. `history`: the
    items of the previous response's conversation (its input and output), before this request's input;
    `given`: this request's input items with their references resolved (None: input_items(req))."""
    check_unsupported(req)
    items = [*history, *(input_items(req) if given is None else given)]
    chat = ChatCompletionRequest(
        model=req.model,
        messages=chat_messages(req.instructions, items, images),
        tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=response_format(req),
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=req.stop,
        stream=req.stream,
        user=req.user,
        logprobs=LOGPROBS in (req.include or []),
        top_logprobs=req.top_logprobs,
    )
    return chat


_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


def responses_error(e: APIError) -> APIError:
    """An error the chat path raised, naming the Responses API's field rather than chat's."""
    if e.param is not None:
        head, dot, rest = e.param.partition(".")
        if head in _PARAMS:
            e.message = e.message.replace(head, _PARAMS[head])
            e.param = _PARAMS[head] + dot + rest
    return e
