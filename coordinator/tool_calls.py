"""Tool calls in a chat answer, parsed whole or as it streams: Hermes' and Qwen's `<tool_call>{json}</tool_call>`, or
Llama 3's JSON (`{"name": ..., "parameters": ...}`, calls joined by `;`)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PARSERS = ("hermes", "llama3_json")  # --tool-call-parser


@dataclass(frozen=True)
class ToolChoice:
    """How a request's tools are used: "none" (not shown to the model), "auto" (the model may call one),
    "required" (it calls one) or "named" (it calls `name`). Required and named open the call in the assistant's
    turn (`forced_prefix`) and constrain what follows to the call's JSON (`call_schema`), so the call is valid."""

    mode: str
    name: str | None = None
    parallel: bool = True  # parallel_tool_calls: False keeps the first call only
    parser: str = "hermes"  # the model's format, one of PARSERS

    @property
    def forced(self) -> bool:
        return self.mode in ("named", "required")

    @property
    def forced_prefix(self) -> str:
        """Text put at the start of the assistant's turn, after the chat template's generation prompt: a forced
        call's opening tag in Hermes' format (Llama 3's call is its JSON alone)."""
        return f"{OPEN}\n" if self.forced and self.parser == "hermes" else ""

    def call_schema(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """The JSON schema of a forced choice's call as the parser reads it, `{"name": ..., "arguments": ...}`
        (Llama 3's: "parameters"), its arguments under the function's `parameters` schema (none: `{}`): the named
        function's, or for "required" any one of `tools` (the tools as the template shows them)."""
        key = "parameters" if self.parser == "llama3_json" else "arguments"

        def call(function: Mapping[str, Any]) -> dict[str, Any]:
            parameters = function.get("parameters") or {"type": "object", "properties": {}}
            properties = {"name": {"const": function["name"]}, key: parameters}
            return {"type": "object", "properties": properties, "required": ["name", key]}  # (strict: no others)

        functions = [t["function"] for t in tools if self.mode != "named" or t["function"]["name"] == self.name]
        return json.dumps(call(functions[0]) if len(functions) == 1 else {"anyOf": [call(f) for f in functions]})


def new_call(name: str, arguments: str) -> dict[str, Any]:
    """One tool call as OpenAI's chat API returns it (arguments: a JSON text, as the model wrote it)."""
    return {
        "id": "call_" + secrets.token_hex(12),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _call_of(body: str) -> dict[str, Any] | None:
    """The call a `<tool_call>` block's JSON body holds, or None if it is not one."""
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    return new_call(parsed["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def parse_tool_calls(text: str, choice: ToolChoice) -> tuple[str | None, list[dict[str, Any]]]:
    """The message's content (the text before its first call; None if empty) and its calls, from the model's text
    (after the `forced_prefix`). A block that does not parse stays in the content, except under a forced choice,
    whose call the grammar kept valid but max_tokens may have cut short (`_unfinished_call`)."""
    full = choice.forced_prefix + text
    content, calls = full, list[dict[str, Any]]()
    start = full.find(OPEN)
    if choice.parser == "llama3_json":
        content, calls = ("", _json_calls(full)) if full.lstrip().startswith("{") else (full, [])
    elif start >= 0:
        content = full[:start]
        for block in full[start:].split(OPEN)[1:]:
            call = _call_of(block.split(CLOSE)[0].strip())
            if call is not None:
                calls.append(call)
    if not calls and choice.forced:  # (cut short by max_tokens: the client sees the model's text)
        return None, [_unfinished_call(text, choice)]
    if not calls:
        return (full or None), []
    return (content.strip() or None), calls if choice.parallel else calls[:1]


def _unfinished_call(text: str, choice: ToolChoice) -> dict[str, Any]:
    """A forced call the model did not finish: its name as far as written (a named choice's own), and its
    arguments' text as far as written."""
    body = text.split(CLOSE)[0]
    written = body.partition('"name"')[2].partition(":")[2].strip()
    name = choice.name or (written[1:].partition('"')[0] if written.startswith('"') else "")
    key = '"parameters"' if choice.parser == "llama3_json" else '"arguments"'
    arguments = body.partition(key)[2].partition(":")[2].strip()
    arguments = arguments[:-1].rstrip() if arguments.endswith("}") and _closes_twice(arguments) else arguments
    return new_call(name, arguments)


def _json_calls(text: str) -> list[dict[str, Any]]:
    """Llama 3's calls: JSON objects from the start of `text`, joined by `;`; none unless each is a call."""
    decoder, at = json.JSONDecoder(), 0
    calls: list[dict[str, Any]] = []
    while at < len(text):
        try:
            parsed, end = decoder.raw_decode(text, len(text) - len(text[at:].lstrip()))
        except json.JSONDecodeError:
            return []
        call = _call_of(json.dumps(parsed))
        if call is None:
            return []
        calls.append(call)
        at = end
        rest = text[at:].lstrip()
        if rest and not rest.startswith(";"):
            return []
        at = len(text) - len(rest) + (1 if rest else 0)
    return calls


def _closes_twice(arguments: str) -> bool:
    """Whether `arguments` ends with the call object's closing brace after its own (one brace too many)."""
    try:
        json.loads(arguments)
    except json.JSONDecodeError:
        try:
            json.loads(arguments[:-1])
            return True
        except json.JSONDecodeError:
            return False
    return False


@dataclass
class ToolCallStream:
    """One streamed choice's text under tools: content is passed on as it comes until a `<tool_call>` begins (a
    tail that may begin one is held back); from there it is kept, and parsed into calls at the end (`finish`)."""

    choice: ToolChoice
    text: str = ""  # everything the model wrote
    sent: int = 0  # characters of `text` passed on as content
    held: bool = field(init=False, default=False)  # a call began: nothing more is content

    def __post_init__(self) -> None:
        self.held = self.choice.forced

    def feed(self, delta: str) -> str:
        """The content to stream now, of the model's next `delta`."""
        self.text += delta
        if self.held:
            return ""
        if self.choice.parser == "llama3_json":  # a call is the whole answer: held from its first character
            begun = self.text.lstrip()
            self.held = begun.startswith("{")
            return "" if self.held or not begun else self._send(len(self.text))
        start = self.text.find(OPEN, self.sent)
        if start >= 0:
            self.held = True
            return self._send(start)
        safe = len(self.text)
        for size in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1):  # a tail that may open a call
            if OPEN.startswith(self.text[-size:]):
                safe -= size
                break
        return self._send(safe)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The content not streamed yet, and the calls, once the choice has finished."""
        _, calls = parse_tool_calls(self.text, self.choice)
        if not calls:
            return self._send(len(self.text)), []
        start = self.text.find(OPEN) if self.choice.mode == "auto" and self.choice.parser == "hermes" else 0
        rest = self.text[self.sent : start].rstrip() if start > self.sent else ""
        self.sent = len(self.text)
        return rest, calls

    def _send(self, end: int) -> str:
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out
