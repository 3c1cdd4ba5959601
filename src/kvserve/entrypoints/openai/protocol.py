"""OpenAI-compatible request schemas and their mapping to :class:`SamplingParams`.

Field names follow OpenAI where OpenAI has one and vLLM for the rest. Types are strict
(``"temperature": "hot"`` or ``"n": 1.5`` are rejected, never coerced); value ranges are
checked by :class:`SamplingParams`, whose ``ValueError`` names the field. Unknown fields
are accepted and ignored with a warning in the log, as vLLM does, except the ones that ask
for what kvserve does not implement (OpenAI's deprecated ``functions``/``function_call``,
vLLM's old ``guided_*`` fields, vLLM's per-request ``kv_transfer_params``): ignoring those would
return text the client cannot parse, or not do what the client arranged, so they get a 400. Structured output comes from OpenAI's ``response_format`` (``json_object``,
``json_schema``) or vLLM's ``structured_outputs`` (:func:`structured_outputs_params`); tool
calls with ``tool_choice`` ``"required"`` or a named function are generated under the tools'
parameter schemas; with ``"auto"`` (the default when tools are given) the model writes freely
and a tool-call parser reads the calls (:func:`tool_call_spec`).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.entrypoints.openai.tool_parsers import forced_tool_calls
from kvserve.engine.tokenizer import bad_words_token_ids

logger = logging.getLogger("kvserve.entrypoints.openai")

Number = float  # strict mode: JSON ints and floats only, never strings or bools


class APIError(Exception):
    """An error returned to the client as OpenAI's error JSON.

    Attributes:
        status: HTTP status code.
        message: what went wrong, for a human.
        type: OpenAI error type (``invalid_request_error``, ``authentication_error``...).
        param: the request field at fault, if any.
        code: a machine-readable code, if any.
        headers: HTTP headers of the response (``Retry-After``...), if any.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: Optional[StrictBool] = False
    continuous_usage_stats: Optional[StrictBool] = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[StrictStr] = None
    # OpenAI
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    seed: Optional[StrictInt] = None
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    logit_bias: Optional[dict[StrictStr, Number]] = None
    user: Optional[StrictStr] = None
    # vLLM
    best_of: Optional[StrictInt] = None
    top_k: Optional[StrictInt] = None
    min_p: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    min_tokens: StrictInt = 0
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    truncate_prompt_tokens: Optional[StrictInt] = None
    prompt_logprobs: Optional[StrictInt] = None
    allowed_token_ids: Optional[list[StrictInt]] = None
    bad_words: Optional[list[StrictStr]] = None
    use_beam_search: StrictBool = False
    beam_width: Optional[StrictInt] = None
    length_penalty: Optional[Number] = None
    echo: StrictBool = False
    cache_salt: Optional[StrictStr] = Field(default=None, min_length=1)  # vLLM: a non-empty string
    priority: StrictInt = 0
    timeout: Optional[Number] = None  # kvserve: seconds before the request is cancelled (408)
    # structured output: OpenAI's response_format, vLLM's structured_outputs (checked by structured_outputs_params)
    response_format: Optional[Any] = None
    structured_outputs: Optional[Any] = None
    # kvserve: this request's KV compression policy (kvserve.core.kv_compression), or {"method": "none"}
    kv_compression: Optional[Any] = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = 16  # OpenAI's default for completions
    logprobs: Optional[StrictInt] = None
    suffix: Optional[StrictStr] = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[Any] = Field(...)
    tools: Optional[Any] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[StrictBool] = None
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    # kvserve: the thinking budget (needs the server's --reasoning-parser)
    max_thinking_tokens: Optional[StrictInt] = None


class TokenizeRequest(BaseModel):
    """POST /tokenize: either ``prompt`` or ``messages``."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[list[Any]] = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: Optional[StrictStr] = None
    tokens: list[StrictInt]


ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_request(cls: type[BaseModel], body: bytes) -> BaseModel:
    """Validate a JSON body against ``cls``; log unknown fields.

    Raises:
        APIError: 400 for malformed JSON, a body that is not an object, a missing field or a
            wrong type (``param`` names the field).
    """
    try:
        req = cls.model_validate_json(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    if isinstance(req, _SamplingFields):
        reject_unsupported_features(req)
    if req.model_extra:
        logger.warning("%s: ignoring unknown field(s) %s", cls.__name__, sorted(req.model_extra))
    return req


_GUIDED = "vLLM's removed guided_* fields (use 'structured_outputs', e.g. {\"regex\": ...}, or 'response_format')"
_TOOL_CALLING = "OpenAI's deprecated functions / function_call (use 'tools' and 'tool_choice')"
_KV_TRANSFER = ("vLLM's per-request KV transfer for prefill/decode disaggregation (kvserve's disaggregation is "
                "configured on the server: kvserve serve --prefill-replicas P --decode-replicas D routes every "
                "request through a prefill and a decode replica)")


def _unsupported_feature(name: str, value: Any) -> Optional[str]:
    """The feature that request field ``name`` = ``value`` asks for, or None if it asks for none."""
    if value is None:
        return None
    if name == "functions":
        return _TOOL_CALLING if value != [] else None
    if name == "function_call":
        return _TOOL_CALLING if value != "none" else None
    if name in ("tools", "tool_choice"):  # (completions: chat has them as fields)
        return "tool calling on /v1/completions (use /v1/chat/completions)" if value not in ([], "none") else None
    if name == "kv_transfer_params":
        return _KV_TRANSFER if value != {} else None
    return _GUIDED  # guided_*: any value asks for a constraint


# Fields that ask for features kvserve does not implement: a 400 rather than unconstrained text.
UNSUPPORTED_FIELDS = ("tools", "tool_choice", "functions", "function_call", "guided_json", "guided_regex",
                      "guided_choice", "guided_grammar", "kv_transfer_params")


def reject_unsupported_features(req: BaseModel) -> None:
    """400 for a request asking for OpenAI's deprecated function calling, tool calling on
    /v1/completions, or using vLLM's old ``guided_*`` fields or its ``kv_transfer_params``.

    ``functions`` null or empty, ``function_call`` null or ``"none"`` and ``kv_transfer_params``
    null or empty ask for nothing and pass.

    Raises:
        APIError: 400 with ``param`` naming the first such field and code ``unsupported_parameter``.
    """
    extra = req.model_extra or {}
    for name in UNSUPPORTED_FIELDS:
        feature = _unsupported_feature(name, extra.get(name))
        if feature is not None:
            raise APIError(400, f"'{name}' is not supported: kvserve does not support {feature}; "
                                f"remove '{name}' from the request",
                           param=name, code="unsupported_parameter")


_RESPONSE_FORMATS = ("text", "json_object", "json_schema")


@dataclass
class ToolCallSpec:
    """A chat request's tool calling: ``tool_choice`` ``"auto"`` (the model may call tools; a
    tool-call parser reads its reply), ``"required"`` or a named function (the reply is
    generated under a grammar).

    Attributes:
        tools: the request's tools (``[{"type": "function", "function": {...}}]``), checked.
        mode: ``"auto"``, ``"required"`` or ``"named"``.
        name: the named function, or None.
        schema: the JSON schema a forced reply follows (compact: no whitespace between JSON
            tokens): the function's parameters (named), or an array of 1 (or, with
            ``parallel_tool_calls``, more) ``{"name", "parameters"}`` objects (``"required"``,
            vLLM's shape); None for ``"auto"``.
        max_calls: ``"auto"``: 1 when ``parallel_tool_calls`` is false, else None (no limit).
    """

    tools: list[dict]
    mode: str
    name: Optional[str] = None
    schema: Optional[dict] = None
    max_calls: Optional[int] = None

    @property
    def forced(self) -> bool:
        """Whether the reply is generated under :attr:`schema` (``"required"`` or named)."""
        return self.schema is not None

    def tool_calls(self, text: str, ids: "Callable[[], str]") -> list[dict]:
        """OpenAI ``tool_calls`` from a finished forced reply that followed :attr:`schema`
        (``arguments``: the JSON as generated).

        Raises:
            ValueError: ``text`` is not JSON (a reply cut by max_tokens or a stop string).
        """
        return [{"id": ids(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in forced_tool_calls(text, self.name)]


def tool_call_spec(req: "ChatCompletionRequest") -> Optional[ToolCallSpec]:
    """The chat request's tool calling, or None (no tools, or ``tool_choice`` ``"none"``).

    ``tool_choice``: ``"auto"`` (the default when tools are given, as in OpenAI: the model
    may answer or call tools, at most one call when ``parallel_tool_calls`` is false),
    ``"required"`` (one or more calls of any of the tools, at most one unless
    ``parallel_tool_calls`` is true) or ``{"type": "function", "function": {"name": ...}}``
    (that function's arguments); ``"none"`` ignores the tools.

    Raises:
        APIError: 400 naming ``tools``, ``tool_choice`` or ``parallel_tool_calls`` for a
            malformed value, an unknown function name, a tool choice without tools, or
            ``parallel_tool_calls`` without tools.
    """
    tools, choice = req.tools, req.tool_choice
    if req.parallel_tool_calls is not None and not tools:
        raise APIError(400, "parallel_tool_calls is only allowed when 'tools' are given", param="parallel_tool_calls",
                       code="invalid_value")
    if choice == "none" or (choice is None and not tools):
        return None
    if not tools:
        raise APIError(400, "tool_choice needs tools: give the functions in 'tools'", param="tool_choice",
                       code="invalid_value")
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of {'type': 'function', 'function': {...}}", param="tools",
                       code="invalid_value")
    names: list[str] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                f"'parameters': {{...}}}}}}", param="tools", code="invalid_value")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise APIError(400, f"tools[{i}].function.name must be 1-64 characters of a-z, A-Z, 0-9, _, . or -, "
                                f"got {name!r}", param="tools", code="invalid_value")
        if name in names:
            raise APIError(400, f"tools[{i}].function.name {name!r} is given twice", param="tools",
                           code="invalid_value")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):  # null: omitted (vLLM)
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON Schema object, or null or left out "
                                f"for a function without arguments; got {type(fn['parameters']).__name__}",
                           param="tools", code="invalid_value")
        names.append(name)
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}}
              for t in tools}
    if choice is None or choice == "auto":
        return ToolCallSpec(tools, "auto", max_calls=1 if req.parallel_tool_calls is False else None)
    if choice == "required":
        item = {"anyOf": [{"type": "object",
                           "properties": {"name": {"const": n},
                                          "parameters": _rebase_refs(p, f"#/items/anyOf/{j}/properties/parameters")},
                           "required": ["name", "parameters"], "additionalProperties": False}
                          for j, (n, p) in enumerate(params.items())]}
        schema = {"type": "array", "items": item, "minItems": 1}
        if not req.parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolCallSpec(tools, "required", None, schema)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict):
        raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                            f"{{'name': ...}}}}, got {choice!r}", param="tool_choice", code="invalid_value")
    if fn.get("name") not in params:
        raise APIError(400, f"tool_choice names the function {fn.get('name')!r}, which is not in tools "
                            f"({', '.join(names)})", param="tool_choice", code="invalid_value")
    return ToolCallSpec(tools, "named", fn["name"], params[fn["name"]])


def _rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` with its local ``$ref`` s (``#``, ``#/...``) made relative to ``base``, the
    place where it is embedded in a larger schema (a function's parameters under
    ``tool_choice: "required"``)."""
    if isinstance(schema, dict):
        out = {k: v if k in ("const", "enum", "default", "examples") else _rebase_refs(v, base)
               for k, v in schema.items() if k != "$ref"}
        if "$ref" in schema:
            ref = schema["$ref"]
            out["$ref"] = base + ref[1:] if isinstance(ref, str) and ref.startswith("#") else ref
        return out
    if isinstance(schema, list):
        return [_rebase_refs(v, base) for v in schema]
    return schema


def structured_outputs_params(req: "_SamplingFields") -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
    """The request's structured-output constraint and the request field that set it.

    ``response_format`` (OpenAI): ``{"type": "text"}`` (none), ``{"type": "json_object"}`` (any
    JSON object), ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
    "strict": ...}}`` (the schema; it is enforced whatever ``strict`` says). ``structured_outputs``
    (vLLM): an object with one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``
    (and optionally ``disable_any_whitespace``). Only the shape is checked here; the grammar is
    compiled by the engine's :class:`~kvserve.structured_output.manager.StructuredOutputManager`.

    Returns:
        (params, field): (None, None) when the request asks for no constraint.

    Raises:
        APIError: 400 naming the field (``response_format`` or ``structured_outputs``) for a
            value of the wrong shape, an unknown type, or both fields set.
    """
    rf, so = req.response_format, req.structured_outputs
    tool = tool_call_spec(req) if isinstance(req, ChatCompletionRequest) else None
    if tool is not None and tool.forced:
        if so is not None or (isinstance(rf, dict) and rf.get("type") != "text"):
            raise APIError(400, "a tool call (tool_choice) cannot be combined with response_format or "
                                "structured_outputs", param="tool_choice", code="invalid_value")
        try:
            # compact JSON: arguments are for programs, and a small model stuck in whitespace never ends
            return StructuredOutputsParams(json=tool.schema, disable_any_whitespace=True), "tools"
        except ValueError as e:
            raise structured_output_error(e, "tools") from None
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in _RESPONSE_FORMATS:
            got = rf.get("type") if isinstance(rf, dict) else rf
            raise APIError(400, f"response_format must be an object whose 'type' is one of "
                                f"{list(_RESPONSE_FORMATS)}, got {got!r}", param="response_format", code="invalid_value")
        if rf["type"] == "text":
            rf = None
    if rf is not None and so is not None:
        raise APIError(400, "set either response_format or structured_outputs, not both", param="structured_outputs",
                       code="invalid_value")
    try:
        if rf is not None:
            if rf["type"] == "json_object":
                return StructuredOutputsParams(json_object=True), "response_format"
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
                raise APIError(400, "response_format.json_schema must be an object with a 'schema' (a JSON Schema "
                                    "object) for type 'json_schema'", param="response_format", code="invalid_value")
            if spec.get("name") is not None and not isinstance(spec["name"], str):
                raise APIError(400, "response_format.json_schema.name must be a string", param="response_format",
                               code="invalid_value")
            schema = spec["schema"]
            return StructuredOutputsParams(json=schema if isinstance(schema, dict) else json.dumps(schema)), \
                "response_format"
        if so is not None:
            if not isinstance(so, dict):
                raise APIError(400, f"structured_outputs must be an object with one of json, regex, choice, grammar, "
                                    f"json_object; got {type(so).__name__}", param="structured_outputs",
                               code="invalid_value")
            unknown = sorted(set(so) - set(StructuredOutputsParams.__dataclass_fields__))
            if unknown:
                raise APIError(400, f"structured_outputs: unknown field(s) {unknown}; kvserve takes json, regex, "
                                    f"choice, grammar, json_object, disable_any_whitespace",
                               param="structured_outputs", code="invalid_value")
            return StructuredOutputsParams(**so), "structured_outputs"
    except ValueError as e:
        raise structured_output_error(e, "response_format" if rf is not None else "structured_outputs") from None
    return None, None


def structured_output_error(e: ValueError, field: str) -> APIError:
    """A structured-output ``ValueError`` (its message names ``structured_outputs.<kind>``) → 400
    naming the request field that set the constraint."""
    msg = str(e)
    if field == "tools":
        msg = msg.replace("structured_outputs.json", "tools: a function's parameters")
    if field == "response_format":
        msg = msg.replace("structured_outputs.json_object", "response_format") \
                 .replace("structured_outputs.json", "response_format.json_schema.schema")
    return APIError(400, msg, param=field, code="invalid_value")


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    kind, loc = err.get("type", ""), err.get("loc", ())
    if kind == "json_invalid":
        msg = f"malformed JSON in the request body: {err.get('msg')}"
        if "hex escape" in str(err.get("msg")):  # the parser's words for an unpaired \ud800-\udfff escape
            msg += " (a \\uD800-\\uDFFF escape must be half of a surrogate pair: a lone one is not Unicode text)"
        return APIError(400, msg, code="invalid_json")
    if not loc:
        return APIError(400, "the request body must be a JSON object", code="invalid_json")
    param = str(loc[0])
    where = param + "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in loc[1:]
                            if p not in ("str", "int", "float", "list[str]", "list[int]", "list[list[int]]"))
    if kind == "missing":
        return APIError(400, f"'{where}' is a required field", param=param, code="missing_required_parameter")
    got = err.get("input")
    shown = repr(got) if not isinstance(got, (str, bytes)) or len(got) < 80 else f"{type(got).__name__} of length {len(got)}"
    return APIError(400, f"invalid value for '{where}': {err.get('msg')} (got {shown})", param=param,
                    code="invalid_type")


_FIELD_RE = re.compile(r"^([a-z_]+)")


def sampling_error(e: ValueError, renames: Optional[dict[str, str]] = None) -> APIError:
    """A :class:`SamplingParams` ``ValueError`` → 400 naming the field; ``renames`` maps a
    SamplingParams field to the request field that set it (chat's ``top_logprobs``), and the
    message and ``param`` then say the request's name."""
    msg = str(e)
    m = _FIELD_RE.match(msg)
    param = m.group(1) if m and m.group(1) in SamplingParams.__dataclass_fields__ else None
    if param is not None and renames and param in renames:
        msg = re.sub(rf"\b{param}\b", renames[param], msg)
        param = renames[param]
    return APIError(400, msg, param=param, code="invalid_value")


def to_sampling_params(req: _SamplingFields, max_tokens: Optional[int], logprobs: Optional[int],
                       tokenizer: Any = None, renames: Optional[dict[str, str]] = None,
                       defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
    """Build validated :class:`SamplingParams` from a request.

    Args:
        req: the parsed request.
        max_tokens: the resolved max_tokens (None: up to max_model_len).
        logprobs: number of top alternatives per generated token, or None.
        tokenizer: to turn ``bad_words`` strings into token id sequences.
        renames: SamplingParams field → the request field that set it, for error messages.
        defaults: the server's defaults (the model's generation config): SamplingParams field
            → value for ``temperature``, ``top_p``, ``top_k``, ``min_p``,
            ``repetition_penalty`` and ``max_tokens``, used where the request sets no value
            (``max_tokens``: neither ``max_tokens`` nor ``max_completion_tokens``).

    Raises:
        APIError: 400 naming the parameter for any invalid value.
    """
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if req.best_of is not None and req.stream and req.best_of > req.n:
        raise APIError(400, "best_of > n is not supported with stream (the best samples are only known at the end)",
                       param="best_of")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs is not available with stream (the prompt's logprobs are sent "
                       "only in a whole response)", param="prompt_logprobs")
    if req.use_beam_search and req.stream:
        raise APIError(400, "use_beam_search is not supported with stream (the best beams are only known at the end)",
                       param="use_beam_search")
    defaults = defaults or {}
    if "max_tokens" in defaults and not {"max_tokens", "max_completion_tokens"} & req.model_fields_set:
        max_tokens = defaults["max_tokens"]
    kw: dict[str, Any] = dict(
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        n=req.n,
        best_of=req.best_of,
        seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        logit_bias=req.logit_bias,
        allowed_token_ids=req.allowed_token_ids,
        kv_compression=req.kv_compression,
    )
    if req.use_beam_search:
        kw.update(use_beam_search=True, beam_width=req.beam_width)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "length_penalty"):
        value = getattr(req, name)
        if value is None:
            value = defaults.get(name)
        if value is not None:
            kw[name] = value
    if kw.get("stop") == []:
        kw["stop"] = None
    if req.bad_words:
        kw["bad_words"] = _bad_words(req.bad_words, tokenizer)
    so, so_field = structured_outputs_params(req)
    if so is not None:
        kw["structured_outputs"] = so
        renames = {**(renames or {}), "structured_outputs": so_field}
    try:
        params = SamplingParams(**kw)
        if tokenizer is not None:
            params.check_token_ids(len(tokenizer))
    except ValueError as e:
        raise sampling_error(e, renames) from None
    return params


def _bad_words(words: list[str], tokenizer: Any) -> list[list[int]]:
    """Each word as token ids, with and without a leading space (vLLM's rule)."""
    if tokenizer is None:
        raise APIError(400, "bad_words needs a tokenizer", param="bad_words")
    try:
        return bad_words_token_ids(tokenizer, words)
    except ValueError:
        raise APIError(400, "bad_words must be non-empty strings", param="bad_words") from None


def _check_tool_fields(m: dict, i: int) -> None:
    """OpenAI's shapes of a message's tool fields: a ``tool`` message names the call it answers
    (``tool_call_id``, a string); an assistant's ``tool_calls`` is a list of
    ``{"id", "type": "function", "function": {"name": str, "arguments": str}}``."""
    if m.get("role") == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise APIError(400, f"messages[{i}].tool_call_id: a tool message must name the call it answers "
                            f"(a string), got {m.get('tool_call_id')!r}", param="messages")
    calls = m.get("tool_calls")
    if calls is None:
        return
    if m.get("role") != "assistant" or not isinstance(calls, list):
        raise APIError(400, f"messages[{i}].tool_calls must be a list, on an assistant message", param="messages")
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)):
            raise APIError(400, f"messages[{i}].tool_calls[{j}] must be {{'id', 'type': 'function', 'function': "
                                "{'name': str, 'arguments': str (JSON)}}", param="messages")


def chat_messages(messages: list[Any], continue_final_message: bool = False) -> list[dict]:
    """Check chat messages and flatten content parts to text.

    Raises:
        APIError: 400 for an empty list, a message that is not an object, an unknown role, a
            message with no content, a ``tool`` message without ``tool_call_id``, or
            ``tool_calls`` not in OpenAI's shape.
    """
    if not messages:
        raise APIError(400, "'messages' must contain at least one message", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object with 'role' and 'content'", param="messages")
        role = m.get("role")
        if role not in ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}", param="messages")
        content = m.get("content")
        if content is None and role == "assistant" and m.get("tool_calls"):
            content = ""  # an assistant turn that only called tools
        if content is None:
            raise APIError(400, f"messages[{i}] has no content", param="messages")
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise APIError(400, f"messages[{i}].content[{j}] must be a text part "
                                        "({'type': 'text', 'text': ...}); other parts are not supported",
                                   param="messages")
                parts.append(p["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        _check_tool_fields(m, i)
        msg = {k: v for k, v in m.items() if k not in ("role", "content")}
        msg.update(role="system" if role == "developer" else role, content=content)
        out.append(msg)
    if continue_final_message and out[-1]["role"] != "assistant":
        raise APIError(400, "continue_final_message needs the last message to be from the assistant",
                       param="continue_final_message")
    return out
