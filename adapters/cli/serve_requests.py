"""What `h2o-fn serve` accepts: every request checked before it reaches mlx-lm's generator.

`read_body(headers, rfile, max_bytes)` turns the raw request into a JSON object and
`check(path, body, limits)` turns that object into the body mlx-lm's handler reads:
every field mlx-lm would use is type- and range-checked, numbers are made the types
mlx-lm's own checks expect (an integer `xtc_probability` becomes a float), the model is
pinned to the one served, and `stream_options` gets its `include_usage`. A request that
fails raises `ClientError`, whose `body()` is OpenAI's error object naming the field and
the expected value; its `status` is 400, 413 (too large) or 404 (another model, as
OpenAI answers an unknown model). Pure functions of their arguments: no server needed.

Example:
    >>> limits = Limits(model_id="smollm2", aliases=(), max_tokens=512, vocab_size=100)
    >>> check("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, limits)["model"]
    'smollm2'
    >>> try:
    ...     check("/v1/completions", {"prompt": "Hi", "stop": 5}, limits)
    ... except ClientError as e:
    ...     e.status, e.param
    (400, 'stop')
"""

import json
import math
from typing import Any, Dict, NamedTuple, Optional, Tuple

CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
TEXT_PATHS = ("/v1/completions",)
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_BODY_BYTES = 8 << 20
BODY_TIMEOUT_S = 10.0  # a body that stops arriving for this long is answered 408 (GuardedHandler's socket timeout)
MAX_CONTEXT_SIZE = 1 << 20  # repetition/presence/frequency windows (tokens)
# Fields that change what OpenAI's API returns and that this server cannot honour.
UNSUPPORTED = {
    "n": (1, "one choice per request"),
    "best_of": (1, "one choice per request"),
    "echo": (False, "the prompt is not echoed"),
    "suffix": (None, "no insertion after a suffix"),
    "audio": (None, "text output only"),
    "prediction": (None, "no predicted outputs"),
    "functions": (None, "use tools"),
    "function_call": (None, "use tools"),
    "num_draft_tokens": (None, "no draft model"),
}


class ClientError(Exception):
    """A request the server refuses: `status`, and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class Limits(NamedTuple):
    """What the served model allows.

    model_id: the served model's id (what `/v1/models` lists and answers carry).
    aliases: other names a request may give as `model` (besides "default_model" and none).
    max_tokens: the most tokens a request may ask for (`--max-tokens`, also the default).
    vocab_size: logits per token (top_k and logit_bias ids are checked against it).
    """

    model_id: str
    aliases: Tuple[str, ...]
    max_tokens: int
    vocab_size: int


def read_body(headers, rfile, max_bytes: int = MAX_BODY_BYTES) -> Dict[str, Any]:
    """The JSON object of a POST (`headers` with `.get`, `rfile` with `.read`).

    A body shorter than its Content-Length (the client closed early) is 400; one that
    stops arriving (`rfile.read` raises TimeoutError: the handler reads it with a socket
    timeout of BODY_TIMEOUT_S) is 408. Strings that UTF-8 cannot encode are 400 naming the
    field (`lone_surrogate`)."""
    length = headers.get("Content-Length")
    if length is None:
        raise ClientError(411, "the Content-Length header is required", code="length_required")
    try:
        n = int(length)
    except ValueError:
        raise ClientError(400, f"Content-Length={length!r} is invalid: expected a non-negative integer") from None
    if n < 0:
        raise ClientError(400, f"Content-Length={n} is invalid: expected a non-negative integer")
    if n > max_bytes:
        raise ClientError(413, f"the body has {n} bytes: expected at most {max_bytes}", code="body_too_large")
    try:
        raw = rfile.read(n)
    except TimeoutError:
        raise ClientError(408, f"Content-Length={n}, but the body stopped arriving for {BODY_TIMEOUT_S:g} s: "
                          f"expected {n} bytes", code="request_timeout") from None
    if len(raw) < n:
        raise ClientError(400, f"the body has {len(raw)} bytes: Content-Length={n} expected {n}",
                          code="incomplete_body")
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ClientError(400, f"the body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ClientError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise ClientError(400, "the body nests JSON too deeply: expected an object of a few levels") from None
    if not isinstance(body, dict):
        raise ClientError(400, f"the body is a JSON {type(body).__name__}: expected an object")
    bad = lone_surrogate(body)
    if bad is not None:
        where, text, at = bad
        raise ClientError(400, f"{where} holds a lone surrogate (U+{ord(text[at]):04X} at character {at}): "
                          "expected text that encodes as UTF-8 (a pair of surrogates, or the character itself)",
                          where)
    return body


def lone_surrogate(body) -> Optional[Tuple[str, str, int]]:
    """The first string (a value or a key) of a parsed JSON body that UTF-8 cannot encode:
    `(field, string, index of its lone surrogate)`, or None. JSON's `\\ud800` escapes
    parse into such strings, which the tokenizer cannot take. Walked without recursion
    (the body may nest as deeply as the JSON parser allowed)."""
    stack = [("body", body)]
    while stack:
        where, x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as e:
                return where, x, e.start
        elif isinstance(x, dict):
            for k, v in reversed(list(x.items())):
                stack += [(_field(where, k), v), (f"{_field(where, k)} (the key)", k)]
        elif isinstance(x, list):
            stack += [(f"{where}[{i}]", v) for i, v in reversed(list(enumerate(x)))]
    return None


def _field(where: str, key: str) -> str:
    key = key.encode("utf-8", "backslashreplace").decode("utf-8")  # a key may hold the surrogate itself
    return key if where == "body" else f"{where}.{key}"


def check(path: str, body: Dict[str, Any], limits: Limits) -> Dict[str, Any]:
    """The body mlx-lm's handler may read, or ClientError (see the module docstring)."""
    out = dict(body)
    out["model"] = _model(body.get("model"), limits)
    for name in ("draft_model", "adapters"):
        if body.get(name) is not None:
            raise ClientError(400, f"{name}={body[name]!r} is not available: this server serves one model, "
                              "without adapters or a draft model", name)
    for name, (default, why) in UNSUPPORTED.items():
        if name in body and body[name] is not None and body[name] != default:
            raise ClientError(400, f"{name}={body[name]!r} is not supported ({why}): expected {default!r} "
                              "or no value", name)
    _response_format(body.get("response_format"))
    if path in CHAT_PATHS:
        _messages(body.get("messages"))
        _optional(body, "tools", list)
        _optional(body, "role_mapping", dict)
    elif path in TEXT_PATHS:
        if not isinstance(body.get("prompt"), str):
            raise ClientError(400, f"prompt={_show(body.get('prompt'))} is invalid: expected a string", "prompt")
    out["stop"] = _stop(body.get("stop"))
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            _int(body, name, 1, limits.max_tokens, hint=" (this server's --max-tokens)")
    _sampling(body, out, limits)
    _bool(body, "stream")
    _bool(body, "logprobs")
    _optional(body, "chat_template_kwargs", dict)
    if body.get("stream_options") is not None:
        options = body["stream_options"]
        if not isinstance(options, dict):
            raise ClientError(400, f"stream_options={_show(options)} is invalid: expected an object",
                              "stream_options")
        _bool(options, "include_usage", "stream_options.include_usage")
        out["stream_options"] = {**options, "include_usage": bool(options.get("include_usage", False))}
    return out


def _model(name, limits: Limits) -> str:
    if name is None or name == "default_model" or name == limits.model_id or name in limits.aliases:
        return limits.model_id
    if not isinstance(name, str):
        raise ClientError(400, f"model={_show(name)} is invalid: expected a string", "model")
    raise ClientError(404, f"The model `{name}` does not exist on this server: it serves `{limits.model_id}` "
                      "(give that name, or none)", "model", "model_not_found")


def _response_format(fmt) -> None:
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if kind != "text":
        raise ClientError(400, f"response_format={_show(fmt)} is not supported: expected {{'type': 'text'}} "
                          "(no JSON mode or schema)", "response_format")


def _messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ClientError(400, f"messages={_show(messages)} is invalid: expected a non-empty list", "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ClientError(400, f"{where}={_show(m)} is invalid: expected an object", where)
        if m.get("role") not in ROLES:
            raise ClientError(400, f"{where}.role={_show(m.get('role'))} is invalid: expected one of "
                              f"{', '.join(ROLES)}", f"{where}.role")
        content = m.get("content")
        if content is None:
            if m["role"] == "assistant" and m.get("tool_calls"):
                continue
            raise ClientError(400, f"{where}.content is null: expected a string or a list of text parts "
                              "(null only for an assistant message with tool_calls)", f"{where}.content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ClientError(400, f"{where}.content[{j}]={_show(part)} is invalid: expected "
                                      "{'type': 'text', 'text': <string>} (this server reads text only)",
                                      f"{where}.content[{j}]")
        elif not isinstance(content, str):
            raise ClientError(400, f"{where}.content={_show(content)} is invalid: expected a string or a "
                              "list of text parts", f"{where}.content")


def _stop(stop):
    if stop is None:
        return []
    words = [stop] if isinstance(stop, str) else stop
    if not isinstance(words, list) or len(words) > MAX_STOP or not all(isinstance(w, str) and w for w in words):
        raise ClientError(400, f"stop={_show(stop)} is invalid: expected a non-empty string or a list of at "
                          f"most {MAX_STOP} non-empty strings", "stop")
    return words


def _sampling(body, out, limits: Limits) -> None:
    _number(body, out, "temperature", 0.0, None)
    _number(body, out, "top_p", 0.0, 1.0)
    _number(body, out, "min_p", 0.0, 1.0)
    _number(body, out, "xtc_probability", 0.0, 1.0)
    _number(body, out, "xtc_threshold", 0.0, 1.0)
    _number(body, out, "repetition_penalty", 0.0, None)
    _number(body, out, "presence_penalty", -2.0, 2.0)
    _number(body, out, "frequency_penalty", -2.0, 2.0)
    _int(body, "top_k", 0, limits.vocab_size, hint=" (the vocabulary)")
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        _int(body, name, 0, MAX_CONTEXT_SIZE)
    _int(body, "seed", 0, 2**64 - 1)
    if body.get("top_logprobs") is not None and body["top_logprobs"] != -1:
        _int(body, "top_logprobs", 0, 11, hint=" (mlx-lm's limit)")
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise ClientError(400, f"logit_bias={_show(bias)} is invalid: expected an object", "logit_bias")
        for k, v in bias.items():
            if not (str(k).isdigit() and int(k) < limits.vocab_size):
                raise ClientError(400, f"logit_bias key {k!r} is invalid: expected a token id in "
                                  f"[0, {limits.vocab_size})", "logit_bias")
            if not (_is_number(v) and -100 <= v <= 100):
                raise ClientError(400, f"logit_bias[{k!r}]={_show(v)} is invalid: expected a number in "
                                  "[-100, 100]", "logit_bias")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _number(body, out, name, lo: float, hi: Optional[float]) -> None:
    x = body.get(name)
    if x is None:
        return
    if not (_is_number(x) and x >= lo and (hi is None or x <= hi)):
        span = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ClientError(400, f"{name}={_show(x)} is invalid: expected a finite number {span}", name)
    out[name] = float(x)


def _int(body, name, lo: int, hi: int, hint: str = "") -> None:
    x = body.get(name)
    if x is None:
        return
    if not (isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi):
        raise ClientError(400, f"{name}={_show(x)} is invalid: expected an integer in [{lo}, {hi}]{hint}", name)


def _bool(body, name, param: Optional[str] = None) -> None:
    if body.get(name) is not None and not isinstance(body[name], bool):
        raise ClientError(400, f"{param or name}={_show(body[name])} is invalid: expected true or false",
                          param or name)


def _optional(body, name, kind) -> None:
    if body.get(name) is not None and not isinstance(body[name], kind):
        raise ClientError(400, f"{name}={_show(body[name])} is invalid: expected a JSON "
                          f"{'object' if kind is dict else 'list'}", name)


def _show(x, limit: int = 60) -> str:
    try:
        text = json.dumps(x)
    except (TypeError, ValueError, RecursionError):
        text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."
