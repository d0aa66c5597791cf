"""The OpenAI-compatible HTTP API's shapes: request bodies as pydantic models, answers and errors as OpenAI's."""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from coordinator.tool_calls import ToolChoice, parse_tool_calls
from minedraft.proto import generation_pb2

UINT32 = 2**32
INT32 = 2**31
TokenId = Annotated[int, Field(ge=-INT32, lt=INT32)]  # what the proto holds; the vocabulary is checked later


class _Body(BaseModel):
    # In a content part a field this server does not know is an error (400 naming it): dropping it would change the
    # prompt the model sees.
    model_config = ConfigDict(extra="forbid")


class _Lenient(BaseModel):
    # At the request's level, as OpenAI's API and vLLM: a field this server does not know is ignored, and logged
    # (`ignored_fields`); those it knows are checked.
    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        """The fields of the body, its stream options' and messages' included, that this server does not know."""
        names = list(self.model_extra or ())
        for name, value in self:
            if isinstance(value, _Lenient):
                names += [f"{name}.{inner}" for inner in value.ignored_fields()]
            elif isinstance(value, list):
                inner_names = {inner for item in value if isinstance(item, _Lenient) for inner in item.ignored_fields()}
                names += [f"{name}[].{inner}" for inner in inner_names]
        return sorted(names)


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's (guidellm sends it): with include_usage, every chunk its usage


class SamplingBody(_Lenient):
    """What completions and chat completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=0, lt=UINT32)
    temperature: float | None = None  # None: 1, OpenAI's default
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user id for abuse monitoring: taken, and not used
    # Extensions that vLLM takes too
    top_k: int | None = Field(None, ge=-1, lt=INT32)  # -1 or 0: off
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    n: int | None = Field(None, ge=1, lt=UINT32)  # choices of the one prompt (GenerateRequest.n, at most 16)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extensions, as SamplingParams takes them
    min_p: float | None = None
    min_tokens: int | None = Field(None, ge=0, lt=UINT32)
    # Structured outputs (`structured_output`): OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, lt=UINT32)  # vLLM's: each prompt token's, and its top ones

    # Fields not supported yet: each may be left out or given its value that asks for nothing, else a 400.
    NEUTRAL: ClassVar[dict[str, tuple[object, ...]]] = {}

    def logit_bias_of(self) -> dict[int, float] | None:
        """logit_bias by token id (its keys are token ids as strings, as OpenAI's); ValueError for a key that is not
        one."""
        if self.logit_bias is None:
            return None
        try:
            return {int(token): value for token, value in self.logit_bias.items()}
        except ValueError as exc:
            raise ValueError(f"logit_bias keys are token ids, got {list(self.logit_bias)[:3]}") from exc

    def unsupported(self) -> tuple[str, object] | None:
        """The first field given a value this server cannot honour yet, and that value."""
        for name, neutral in self.NEUTRAL.items():
            value = getattr(self, name)
            # By type too: 0 == False, and a completion's logprobs=0 asks for something.
            if value is not None and not any(type(value) is type(v) and value == v for v in neutral):
                return name, value
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingBody):
    """POST /v1/completions."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0, lt=UINT32)  # the top ones per token (0: the chosen one's only)
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    NEUTRAL: ClassVar[dict[str, tuple[object, ...]]] = {
        **SamplingBody.NEUTRAL,
        "best_of": (1,),
        "suffix": ("",),
    }


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    """A message; a field this server does not know (`name`, ...) is ignored as vLLM ignores it."""

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, as an answer gave them
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it; a call's arguments parsed from their JSON text, as templates
        (Qwen's, Hermes') write them out with `tojson`."""
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                function = dict(call.get("function") or {})
                with contextlib.suppress(TypeError, ValueError):
                    function["arguments"] = json.loads(function.get("arguments", "{}"))
                calls.append({**call, "function": function})
            message["tool_calls"] = calls
        return message

    @property
    def text(self) -> str:
        """The content as one text (text parts joined by newlines, as vLLM does)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class FunctionSpec(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Lenient):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=0, lt=UINT32)  # OpenAI's newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, lt=UINT32)  # with logprobs: the top ones per token
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    NEUTRAL: ClassVar[dict[str, tuple[object, ...]]] = SamplingBody.NEUTRAL

    def tool_choice_of(self, parser: str = "hermes") -> ToolChoice | None:
        """How the request's tools are used (`coordinator.tool_calls`; calls the model writes as `parser` reads
        them); None without tools, or with "none". A ValueError names what is wrong (a choice without tools, a
        function not among them)."""
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        if not self.tools:
            if choice in ("auto", "none"):
                return None
            raise ValueError("tool_choice needs tools")
        parallel = self.parallel_tool_calls is not False
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            if name not in {tool.function.name for tool in self.tools}:
                raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
            return ToolChoice("named", name, parallel, parser)
        return None if choice == "none" else ToolChoice(choice, None, parallel, parser)

    def tools_for_template(self, choice: ToolChoice | None) -> list[dict[str, Any]] | None:
        """The tools as the chat template shows them to the model: none under "none", the named one alone."""
        if choice is None or not self.tools:
            return None
        tools = [tool for tool in self.tools if choice.mode != "named" or tool.function.name == choice.name]
        return [tool.model_dump(exclude_none=True) for tool in tools]


class TokenizeRequest(_Lenient):
    """POST /tokenize, as vLLM takes it: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Lenient):
    """POST /detokenize, as vLLM takes it."""

    model: str | None = None
    tokens: list[TokenId]


# vLLM's structured_outputs keys (and the guided_* fields') -> StructuredOutput's fields
_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def structured_output(body: SamplingBody) -> tuple[generation_pb2.StructuredOutput, str] | None:
    """The constraint a body asks for, and the field that asked (its errors' param); None if none. ValueError
    (message, field) where it asks for two, or gives one a shape it cannot have."""
    given: list[tuple[str, str, Any]] = []  # (field, kind, value)
    fmt = body.response_format
    if fmt is not None and fmt.get("type", "text") != "text":
        if fmt.get("type") == "json_object":
            given.append(("response_format", "json_object", True))
        elif fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict | bool):
                raise ValueError("response_format.json_schema.schema: a JSON schema is required", "response_format")
            given.append(("response_format", "json_schema", spec["schema"]))
        else:
            message = f"response_format.type {fmt.get('type')!r}: one of text, json_object, json_schema"
            raise ValueError(message, "response_format")
    for key, value in (body.structured_outputs or {}).items():
        if key == "disable_any_whitespace":  # (how JSON is written, for whichever field asks for JSON)
            continue
        if key == "json_object" and value:
            given.append((f"structured_outputs.{key}", "json_object", True))
        elif key in _VLLM_KINDS and value is not None:
            given.append((f"structured_outputs.{key}", _VLLM_KINDS[key], value))
        elif value not in (None, False):
            raise ValueError(f"structured_outputs.{key} is not supported by this server", f"structured_outputs.{key}")
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{key}")
        if value is not None:
            given.append((f"guided_{key}", _VLLM_KINDS[key], value))
    if not given:
        return None
    if len(given) > 1:
        fields = ", ".join(f for f, _, _ in given)
        raise ValueError(f"give one structured output, not {len(given)}: {fields}", given[1][0])
    field, kind, value = given[0]
    compact = (body.structured_outputs or {}).get("disable_any_whitespace")
    output = generation_pb2.StructuredOutput(disable_any_whitespace=bool(compact))
    if kind == "json_schema":
        output.json_schema = value if isinstance(value, str) else json.dumps(value)
    elif kind == "json_object":
        output.json_object = True
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ValueError(f"{field}: a non-empty list of strings", field)
        output.choice.choices.extend(value)
    elif isinstance(value, str):
        setattr(output, kind, value)  # (regex or grammar)
    else:
        raise ValueError(f"{field}: a string", field)
    return output, field


FINISH_REASONS: dict[int, str] = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
}


def tool_calls_reason(reason: str | None) -> str | None:
    """A choice's finish reason once its text held tool calls: "tool_calls", unless cut short ("length")."""
    return "tool_calls" if reason == "stop" else reason


def finish_reason(reason: int) -> str | None:
    """OpenAI's name of a finish reason; None while running ("abort" for one OpenAI has no name for)."""
    if reason == generation_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return FINISH_REASONS.get(reason, "abort")


def usage_body(usage: generation_pb2.Usage) -> dict[str, Any]:
    """OpenAI's usage, and under `speculation` how speculative decoding did for the request (MineDraft's
    extension; the gRPC Usage has the same figures)."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
        "speculation": {
            "draft_tokens": usage.draft_tokens,
            "accepted_tokens": usage.accepted_tokens,
            "mean_accepted_length": round(usage.mean_accepted_length, 6),
            "acceptance_rate": round(usage.acceptance_rate, 6),
            "steps": usage.steps,
            "drafted_steps": usage.drafted_steps,
            "accepted_per_position": list(usage.accepted_per_position),
        },
    }


# One token's log-probabilities as text: (token, logprob, [(top token, its logprob), ...]); an echoed prompt's first
# token has none (None, None), as OpenAI's
TokenEntry = tuple[str, float | None, list[tuple[str, float]] | None]


def chat_logprobs(entries: list[TokenEntry]) -> dict[str, Any]:
    """A chat choice's `logprobs`, as OpenAI's: per token its text, bytes, logprob and top ones."""

    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = [
        one(token, lp or 0.0) | {"top_logprobs": [one(t, v) for t, v in top or ()]} for token, lp, top in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[TokenEntry], offset: int = 0) -> dict[str, Any]:
    """A completion choice's `logprobs`, as OpenAI's legacy shape: tokens, their logprobs, top ones by text, and
    each token's offset in the choice's text (from `offset`)."""
    offsets = []
    for token, _, _ in entries:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": [token for token, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [None if top is None else dict(top) for _, _, top in entries],
        "text_offset": offsets,
    }


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Reply:
    """One answer as OpenAI shapes it: a completion or a chat completion, whole or as stream chunks."""

    chat: bool
    model: str
    include_usage: bool = False  # streamed: every chunk has "usage" (null), and a last chunk carries it
    tools: ToolChoice | None = None  # a chat's: its answers' tool calls are parsed out of their text
    continuous_usage: bool = False  # streamed: every chunk of a choice carries its usage so far
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)

    def whole(
        self, answers: list[tuple[str, str | None, list[TokenEntry] | None]], usage: generation_pb2.Usage | None
    ) -> dict[str, Any]:
        """The answer of choices (text, finish reason, logprobs when asked) by index; `usage`: theirs together."""
        choices = []
        for index, (text, reason, entries) in enumerate(answers):
            choice: dict[str, Any] = {"index": index}
            if self.chat and self.tools is not None:
                content, calls = parse_tool_calls(text, self.tools)
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = calls
                    reason = tool_calls_reason(reason)
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice | {"logprobs": self._logprobs(entries), "finish_reason": reason})
        body = self._head("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage_body(usage) if usage is not None else None
        return body

    def opening(self, index: int = 0) -> dict[str, Any] | None:
        """A chat stream's first chunk of choice `index`: the assistant's role, no content yet."""
        return self._chunk({"role": "assistant", "content": ""}, None, index) if self.chat else None

    def delta(
        self,
        text: str,
        reason: str | None = None,
        index: int = 0,
        entries: list[TokenEntry] | None = None,
        offset: int = 0,
    ) -> dict[str, Any]:
        """A chunk of `text` of choice `index` and the logprobs of its tokens (chat: the last chunk, with the finish
        reason, has an empty delta); `offset`: the choice's text before it (a completion's text_offset)."""
        if self.chat:
            return self._chunk({"content": text} if reason is None else {}, reason, index, self._logprobs(entries))
        return self._chunk(text, reason, index, self._logprobs(entries, offset))

    def tool_calls_delta(self, calls: list[dict[str, Any]], index: int = 0) -> dict[str, Any]:
        """A chat chunk of choice `index` with its tool calls, each whole (as vLLM streams a call once complete)."""
        return self._chunk({"tool_calls": [{"index": i} | call for i, call in enumerate(calls)]}, None, index)

    def _logprobs(self, entries: list[TokenEntry] | None, offset: int = 0) -> dict[str, Any] | None:
        if entries is None:
            return None
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries, offset)

    def usage_chunk(self, usage: generation_pb2.Usage) -> dict[str, Any]:
        """The last chunk of a stream that asked for usage: no choices."""
        return self._head(self._chunk_object, []) | {"usage": usage_body(usage)}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(
        self, delta: dict[str, Any] | str, reason: str | None, index: int = 0, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice |= {"logprobs": logprobs, "finish_reason": reason}
        body = self._head(self._chunk_object, [choice])
        if self.include_usage:
            body["usage"] = None
        return body

    def _head(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
