"""Every override of mlx-lm's server (`mlx_lm.server`) that `h2o-fn serve` makes, in one place.

Written against mlx-lm 0.32.2 (`MLX_LM_VERSION`). `missing()` lists what this module
relies on that the installed mlx-lm no longer has (a private method, a parameter, a
line of `_generate`): `tests/test_serve.py` fails loudly on it, and `serve` logs a
warning when the installed version differs.

- `server_parser()`: mlx_lm.server's own argument parser (it is built inside `main()`).
- `GuardedGenerator` (a `ResponseGenerator`): the generation thread restarts when it
  dies, failing the requests it held (three deaths in a minute stop the server with a
  non-zero exit instead); a request whose client has left is stopped (`ClientGone`),
  whether it waits for its first token or streams; prompts beyond `max_prompt_tokens`
  fail with 413 before they are fed; an error before the first token becomes an
  OpenAI-shaped 4xx/5xx (`Answered`) instead of mlx-lm's 404.
- `FixedModelProvider` (a `ModelProvider`): one model, loaded by the subclass's
  `load_model`; a request can never make it load another.
- `GuardedHandler` (an `APIHandler`): the body is read and checked by `serve_requests`
  before mlx-lm's `do_POST` sees it; `/v1/models` lists the served model only.
- `run_http_server`, `held_entries`: mlx-lm's HTTP loop and its prompt cache's entries.
"""

import _thread
import argparse
import inspect
import io
import json
import logging
import select
import socket
import threading
import time
import types
from queue import Empty, Queue
from typing import Any, List, Optional

from mlx_lm import server as mlx_server
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

from . import serve_requests
from .serve_requests import ClientError

MLX_LM_VERSION = "0.32.2"
POLL_S = 0.2  # how often a waiting request checks that its client is still there
CRASHES, CRASH_WINDOW_S = 3, 60.0  # this many generation-thread deaths in the window: exit
EXIT_CODE = 70  # EX_SOFTWARE: the server stopped itself
ALLOWED = ("GET", "POST", "OPTIONS")  # the methods the handler answers; others get OpenAI's error shape, 405

log = logging.getLogger("h2o_fn.serve")
_client = threading.local()  # the socket of the request this HTTP thread serves


class ClientGone(BaseException):
    """The client closed its connection: the request is stopped, nothing is answered.
    A BaseException, so that it passes mlx-lm's `except Exception` and reaches the handler."""


class Answered(BaseException):
    """A request that fails before its first token, with the error the client gets."""

    def __init__(self, error: ClientError):
        super().__init__(error.message)
        self.error = error


class PromptTooLong(ValueError):
    def __init__(self, n: int, limit: int, param: str):
        super().__init__(f"the prompt ({param}) has {n} tokens: this server takes at most {limit} "
                         "(--max-prompt-tokens; the model's context by default)")
        self.param = param


def client_gone(sock: socket.socket) -> bool:
    """Whether the peer closed `sock` (readable with nothing to read). Data waiting (a
    pipelined request) counts as present."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True


def as_client_error(e: BaseException) -> ClientError:
    """The answer to a request whose generation failed before its first token."""
    if isinstance(e, PromptTooLong):
        return ClientError(413, str(e), e.param, "context_length_exceeded")
    if isinstance(e, RuntimeError):
        return ClientError(503, f"generation is unavailable: {e}", None, "unavailable", "server_error")
    return ClientError(422, f"the request could not be turned into a prompt: {type(e).__name__}: {e}",
                       "messages", "unprocessable")


class GuardedGenerator(mlx_server.ResponseGenerator):
    """mlx-lm's ResponseGenerator that no request can stop (see the module docstring)."""

    def __init__(self, model_provider, prompt_cache, max_prompt_tokens: Optional[int] = None):
        self.max_prompt_tokens = max_prompt_tokens
        self.deaths: List[float] = []  # monotonic times the generation thread died
        self._held = set()  # response queues of the requests being served
        self._left = set()  # response queues of requests whose client left before they started
        self._tokenized = {}  # id(request) -> (request, _tokenize's result), tokenized ahead of the loop
        self._held_lock = threading.Lock()
        super().__init__(model_provider, prompt_cache)  # starts the generation thread

    # ------------------------------------------------------------ work before a request starts

    def _next_request(self, timeout=None):
        """What mlx-lm's generation loop calls for its next request: it waits up to `timeout`
        s, or not at all (None: other requests are being decoded). A request goes first to
        `admit`, which may keep it for work of its own (reading a long prompt); that work
        is done one slice per call (`work`), between the loop's decode steps, and the
        request is handed to the loop when its work is done."""
        busy = timeout is None
        request = super()._next_request(None if self.has_work() else timeout)
        if request is not None:
            request = self.admit(request)
            if request is not None:
                return request
        return self.work(busy)

    def has_work(self) -> bool:
        """Whether requests wait for work of their own (`work`)."""
        return False

    def admit(self, request):
        """`request` (mlx-lm's `(response queue, request, arguments)`) to serve now, or None
        when it was kept for work of its own or answered. Here: served now."""
        return request

    def work(self, busy: bool):
        """One slice of the work kept requests wait for; a request whose work is done (for
        the loop to serve), else None. `busy`: other requests are being decoded."""
        return None

    def left(self, q: Queue) -> bool:
        """Whether the client of the request answering on `q` has left."""
        with self._held_lock:
            return q in self._left

    def _run_generate(self):
        while not self._stop:
            try:
                self._generate()
                return
            except Exception as e:  # noqa: BLE001 - the thread must outlive any request
                log.exception("the generation thread died (%s: %s); failing the requests it held", type(e).__name__, e)
                now = time.monotonic()
                self.deaths = [t for t in self.deaths if now - t < CRASH_WINDOW_S] + [now]
                if len(self.deaths) >= CRASHES:  # decided before the held requests hear of it
                    log.critical("the generation thread died %d times in %.0f s: stopping the server (exit %d)",
                                 CRASHES, CRASH_WINDOW_S, EXIT_CODE)
                    self._generation_failed = True
                    self.give_up()
                self._fail_held(e)
                if self._generation_failed:
                    return
                log.warning("restarting the generation thread")

    def give_up(self) -> None:
        """Stop serving: the HTTP loop ends as on Ctrl-C, and `serve` exits with EXIT_CODE."""
        _thread.interrupt_main()

    def _fail_held(self, e: BaseException) -> None:
        self.forget_work()
        self._tokenized.clear()
        with self._held_lock:
            held, self._held = list(self._held), set()
        for q in held:
            q.put(RuntimeError(f"the generation thread died while serving this request ({type(e).__name__})"))

    def forget_work(self) -> None:
        """Drop the work kept requests wait for (the generation thread died: they are failed)."""

    def _release(self, q: Queue) -> None:
        with self._held_lock:
            self._held.discard(q)
            self._left.discard(q)

    def _tokenize(self, tokenizer, request, args):
        ahead = self._tokenized.pop(id(request), None)
        if ahead is not None and ahead[0] is request:
            return ahead[1]
        out = super()._tokenize(tokenizer, request, args)
        if self.max_prompt_tokens is not None and len(out[0]) > self.max_prompt_tokens:
            raise PromptTooLong(len(out[0]), self.max_prompt_tokens,
                                "messages" if request.request_type == "chat" else "prompt")
        return out

    def tokenize_ahead(self, request, args) -> tuple:
        """mlx-lm's `_tokenize` of a request before the loop sees it: `(prompt, segments,
        segment types, initial state, vision)`; the loop's own call then returns the same
        (once). Raises what tokenizing raises (PromptTooLong, a template's error)."""
        out = self._tokenize(self.model_provider.tokenizer, request, args)
        self._tokenized[id(request)] = (request, out)
        return out

    def forget_tokens(self, request) -> None:
        """The loop will never tokenize `request` (dropped before it started)."""
        self._tokenized.pop(id(request), None)

    def _await_response(self, response_queue: Queue):
        sock = getattr(_client, "sock", None)
        while True:
            if sock is not None and client_gone(sock):  # checked before every response: tokens may never pause
                raise ClientGone()
            try:
                return response_queue.get(timeout=POLL_S)
            except Empty:
                if not self.generation_available():
                    raise RuntimeError("the generation thread died") from None

    def generate(self, request, generation_args, progress_callback=None):
        if not self.generation_available():
            raise Answered(as_client_error(RuntimeError("the generation thread died")))
        q: Queue = Queue()
        with self._held_lock:
            self._held.add(q)
        self.requests.put((q, request, generation_args))
        try:
            ctx = self._await_response(q)
            while isinstance(ctx, tuple):  # progress of work before it starts (a long prompt read)
                handler = getattr(_client, "handler", None)
                if handler is not None:
                    handler.start_stream()  # a streaming client gets its status line at once
                if progress_callback is not None:
                    progress_callback(*ctx)
                ctx = self._await_response(q)
        except (ClientGone, BrokenPipeError, ConnectionResetError):  # stop it as soon as it starts
            with self._held_lock:
                self._left.add(q)
            threading.Thread(target=self._stop_when_started, args=(q,), daemon=True).start()
            raise ClientGone() from None  # past mlx-lm's `except Exception`, which would answer 404
        except RuntimeError as e:
            self._release(q)
            raise Answered(as_client_error(e)) from None
        if isinstance(ctx, Exception):
            self._release(q)
            raise Answered(as_client_error(ctx))
        if ctx is None:  # its work ended it (nothing to answer)
            self._release(q)
            raise Answered(as_client_error(RuntimeError("the request was dropped before it started")))
        self.started(q, ctx)
        return ctx, self._responses(q, progress_callback)

    def started(self, q: Queue, ctx) -> None:
        """The request answering on `q` started (`ctx`: mlx-lm's GenerationContext)."""

    def _responses(self, q: Queue, progress_callback):
        try:
            while True:
                response = self._await_response(q)
                if response is None:
                    return
                if isinstance(response, Exception):
                    raise response
                if isinstance(response, tuple):
                    if progress_callback is not None:
                        progress_callback(*response)
                    continue
                yield response
        finally:
            self._release(q)

    def _stop_when_started(self, q: Queue) -> None:
        try:
            while self.generation_available():
                try:
                    ctx = q.get(timeout=POLL_S)
                except Empty:
                    continue
                if isinstance(ctx, tuple):  # progress of its work: not started yet
                    continue
                if isinstance(ctx, mlx_server.GenerationContext):
                    ctx.stop()
                return  # started and stopped, failed, or dropped by its work (None)
        finally:
            self._release(q)


class GuardedHandler(mlx_server.APIHandler):
    """mlx-lm's APIHandler with every request checked first (see the module docstring).
    `limits` (a `serve_requests.Limits`) is set by `handler_class`."""

    limits: serve_requests.Limits

    def send_json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    _stream_started = False  # the status line of an event stream was sent (`start_stream`)
    _skip_end_headers = False

    def start_stream(self) -> None:
        """Send an event stream's status line and headers now, once (a long prompt is being
        read: the client hears from the server at once); mlx-lm's later call is skipped."""
        if getattr(self, "stream", False) and not self._stream_started:
            mlx_server.APIHandler._set_stream_headers(self, 200)
            mlx_server.APIHandler.end_headers(self)
            self._stream_started = True

    def _set_stream_headers(self, status_code: int = 200):
        if self._stream_started:
            self._skip_end_headers = True
            return
        super()._set_stream_headers(status_code)

    def end_headers(self):
        if self._skip_end_headers:
            self._skip_end_headers = False
            return
        super().end_headers()

    def send_client_error(self, e: ClientError, headers: Optional[dict] = None) -> None:
        log.info("refused (%d): %s", e.status, e.message)
        if e.status in (400, 408) and e.code in ("incomplete_body", "request_timeout"):
            self.close_connection = True  # what is left of the body must not be read as a request
        try:
            if self._stream_started:  # the status line (200) is out: the error is the stream's last event
                self.close_connection = True
                self.wfile.write(f"data: {json.dumps(e.body())}\n\n".encode())
                self.wfile.flush()
            elif headers:
                self._set_completion_headers(e.status)
                for name, value in headers.items():
                    self.send_header(name, value)
                data = json.dumps(e.body()).encode()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()
            else:
                self.send_json(e.status, e.body())
        except (BrokenPipeError, ConnectionResetError):
            log.info("the client left before its %d answer", e.status)
            self.close_connection = True

    def handle(self):
        """BaseHTTPRequestHandler's loop; a client that closes mid-answer ends the connection with a
        log line, not a traceback."""
        try:
            super().handle()
        except (BrokenPipeError, ConnectionResetError) as e:
            log.info("the client closed the connection (%s)", type(e).__name__)

    def do_POST(self):
        if self.path not in serve_requests.CHAT_PATHS + serve_requests.TEXT_PATHS:
            return self.send_client_error(ClientError(404, f"no such endpoint: POST {self.path}", code="not_found"))
        try:
            self.connection.settimeout(serve_requests.BODY_TIMEOUT_S)
            try:
                raw_body = serve_requests.read_body(self.headers, self.rfile)
            finally:
                self.connection.settimeout(None)
            body = serve_requests.check(self.path, raw_body, self.limits)
        except ClientError as e:
            return self.send_client_error(e)
        data = json.dumps(body).encode()
        raw = self.rfile
        self.rfile = io.BytesIO(data)  # mlx-lm's do_POST reads the checked body
        self.headers.replace_header("Content-Length", str(len(data)))
        try:
            super().do_POST()
        finally:
            self.rfile = raw

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if path.startswith("/v1/models") or path == "/health":
            return super().do_GET()
        self.send_client_error(ClientError(404, f"no such endpoint: GET {self.path}", code="not_found"))

    def _method_not_allowed(self):
        self.close_connection = True  # a body it may carry is not read
        self.send_client_error(ClientError(405, f"{self.command} is not allowed on {self.path}: expected "
                                           f"{', '.join(ALLOWED)}", code="method_not_allowed"),
                               {"Allow": ", ".join(ALLOWED)})

    do_PUT = do_DELETE = do_PATCH = do_TRACE = do_CONNECT = _method_not_allowed

    def do_HEAD(self):
        self.close_connection = True
        self.send_response(405)
        self.send_header("Allow", ", ".join(ALLOWED))
        self.send_header("Content-Length", "0")
        self.end_headers()

    def handle_completion(self, request, stop_words):
        _client.sock, _client.handler = self.connection, self
        self._stream_started = self._skip_end_headers = False
        try:
            super().handle_completion(request, stop_words)
        except Answered as a:
            self.send_client_error(a.error)
        except (ClientGone, BrokenPipeError, ConnectionResetError):
            log.info("the client left: request %s stopped", getattr(self, "request_id", "?"))
            self.close_connection = True
        finally:
            _client.sock = _client.handler = None

    def handle_models_request(self):
        model = {"id": self.limits.model_id, "object": "model", "created": self.created, "owned_by": "h2o-fn"}
        wanted = self.path.split("?", 1)[0].rstrip("/")[len("/v1/models"):].lstrip("/")
        if not wanted:
            return self.send_json(200, {"object": "list", "data": [model]})
        if wanted == self.limits.model_id or wanted in self.limits.aliases:
            return self.send_json(200, model)
        self.send_client_error(ClientError(404, f"The model `{wanted}` does not exist on this server: it serves "
                                           f"`{self.limits.model_id}`", "model", "model_not_found"))


class FixedModelProvider(mlx_server.ModelProvider):
    """mlx-lm's ModelProvider serving one model, loaded once by `load_model(path)` (a
    subclass's) -> (model, tokenizer). Any other model, adapter or draft model raises."""

    def load_model(self, model_path: str):
        raise NotImplementedError

    def alias(self, name: str) -> None:
        """Requests may name the served model `name` (its id in `/v1/models`)."""
        self._model_map[name] = self._model_map["default_model"]

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        if self.model_key is not None:
            raise ValueError(f"model {model_path!r} is not served: this server serves {self.model_key[0]!r} only")
        if adapter_path is not None or draft_model_path is not None:
            raise ValueError("adapters and draft models are not available with h2o-fn serve")
        model, tokenizer = self.load_model(model_path)
        if self.cli_args.chat_template:
            tokenizer.chat_template = self.cli_args.chat_template
            tokenizer.has_chat_template = True
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        self.model_key = (model_path, None, None)
        self.model, self.tokenizer = model, tokenizer
        self.processor, self.draft_model = None, None  # text only
        self.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(model))
        log.info("%s: %s", model_path, "continuous batching" if self.is_batchable else
                 "one request at a time (a layer's cache cannot merge)")


def handler_class(base: type, limits: serve_requests.Limits) -> type:
    """`base` (a GuardedHandler subclass) bound to the served model's limits."""
    return type(base.__name__, (base,), {"limits": limits})


class _Built(Exception):
    def __init__(self, parser):
        super().__init__("parser built")
        self.parser = parser


def server_parser() -> argparse.ArgumentParser:
    """mlx_lm.server's own argument parser, exactly as its `main()` builds it: `main()`
    runs with an ArgumentParser that hands itself back at `parse_args`."""

    class Stop(argparse.ArgumentParser):
        def parse_args(self, args=None, namespace=None):
            raise _Built(self)

    saved = mlx_server.argparse
    mlx_server.argparse = types.SimpleNamespace(**{**vars(argparse), "ArgumentParser": Stop})
    try:
        mlx_server.main()
    except _Built as built:
        return built.parser
    finally:
        mlx_server.argparse = saved
    raise RuntimeError("mlx_lm.server.main() returned without parsing arguments: this mlx-lm "
                       f"version builds its parser differently from {MLX_LM_VERSION}")


def parser_actions(parser: argparse.ArgumentParser) -> list:
    """A parser's actions (argparse keeps them in a private list)."""
    return list(parser._actions)


def add_action(group, action: argparse.Action) -> None:
    """Add another parser's action, with its own definition, to an argument group."""
    group._add_action(action)


def run_http_server(host: str, port: int, generator, handler) -> None:
    """mlx-lm's HTTP loop (blocks until Ctrl-C or until the generator gives up)."""
    mlx_server._run_http_server(host, port, generator, handler_class=handler)


def held_entries(prompt_cache: LRUPromptCache, model: Any) -> list:
    """The prompt cache's entries for `model` now (each has `prompt_cache` and `nbytes`)."""
    return [prompt_cache._trie.get(m, t) for lru in prompt_cache._lru._lrus.values() for m, t in lru if m == model]


def held_keys(prompt_cache: LRUPromptCache) -> set:
    """`(model, tuple of tokens)` of every entry held now."""
    return {(m, tuple(t)) for lru in prompt_cache._lru._lrus.values() for m, t in lru}


def search(prompt_cache: LRUPromptCache, model: Any, tokens: List[int]):
    """mlx-lm's trie search for `tokens`: `.exact`, `.shorter` (the longest stored prefix),
    `.longer` (the shortest stored extension) as token lists or None, `.common_prefix`."""
    return prompt_cache._trie.search(model, tokens)


def entry(prompt_cache: LRUPromptCache, model: Any, tokens: List[int]):
    """The stored entry for exactly `tokens` (`.prompt_cache`, `.nbytes`, `.cache_type`)."""
    return prompt_cache._trie.get(model, tokens)


def prefixes(prompt_cache: LRUPromptCache, model: Any, tokens: List[int]) -> List[int]:
    """The lengths of the stored entries that are proper prefixes of `tokens`, shortest first."""
    node, out = prompt_cache._trie._trie.get(model, {}), []
    for i, tok in enumerate(tokens[:-1]):
        node = node.get(tok)
        if node is None:
            break
        if "__value__" in node:
            out.append(i + 1)
    return out


def take(prompt_cache: LRUPromptCache, model: Any, tokens: List[int]):
    """Remove the entry for exactly `tokens` and return it, as mlx-lm's eviction does."""
    found = prompt_cache._trie.pop(model, tokens)
    prompt_cache._lru.remove(model, tokens)
    prompt_cache._n_bytes -= found.nbytes
    prompt_cache._n_bytes_by_type[found.cache_type] -= found.nbytes
    return found


# ---------------------------------------------------------------- what this module relies on

_METHODS = {
    mlx_server.ModelProvider: {
        "__init__": ["self", "cli_args"], "_load": ["self", "model_path", "adapter_path", "draft_model_path"],
        "load": ["self", "model_path", "adapter_path", "draft_model_path"], "load_default": ["self"],
    },
    mlx_server.ResponseGenerator: {
        "__init__": ["self", "model_provider", "prompt_cache"],
        "_run_generate": ["self"], "_generate": ["self"], "generation_available": ["self"],
        "_await_response": ["self", "response_queue"], "_tokenize": ["self", "tokenizer", "request", "args"],
        "_next_request": ["self", "timeout"],
        "generate": ["self", "request", "generation_args", "progress_callback"],
    },
    mlx_server.APIHandler: {
        "do_POST": ["self"], "do_GET": ["self"], "handle_models_request": ["self"],
        "handle_completion": ["self", "request", "stop_words"], "_set_completion_headers": ["self", "status_code"],
    },
    LRUPromptCache: {
        "fetch_nearest_cache": ["self", "model", "tokens"], "trim_to": ["self"],
        "insert_cache": ["self", "model", "tokens", "prompt_cache"],
    },
}
# lines of mlx-lm's code whose behaviour the overrides above assume
_SOURCE = {
    mlx_server.ResponseGenerator.__init__: ["self._generation_failed = False", "self.requests = Queue()",
                                            "Thread(target=self._run_generate)"],
    mlx_server.ResponseGenerator._generate: ["self.prompt_cache.fetch_nearest_cache(", "._should_stop",
                                             "rqueue.put(e)", "self._tokenize(", "return self._next_request(timeout)",
                                             "if (batch_generator is not None and len(batch_results) > 0)",
                                             "result[\"rqueue\"].put(r.progress)"],
    mlx_server.ResponseGenerator._serve_single: ["ctx._should_stop", "self._tokenize("],
    mlx_server.APIHandler.do_POST: ["self.rfile.read(content_length)", 'self.headers.get("Content-Length")'],
    mlx_server.APIHandler.handle_completion: ["self.response_generator.generate(", "ctx.stop()"],
    mlx_server.main: ["argparse.ArgumentParser(", "parser.parse_args()"],
    LRUPromptCache.__init__: ["self._lru", "self._trie", "self._n_bytes", "self._n_bytes_by_type"],
    LRUPromptCache.fetch_nearest_cache: ["self._trie.search(model, tokens)", "result.exact", "result.shorter",
                                         "result.longer", "result.common_prefix", "copy.deepcopy("],
    LRUPromptCache.trim_to: ["model, tokens = self._lru.pop()", "entry = self._trie.pop(model, tokens)",
                             "self._n_bytes -= entry.nbytes",
                             "self._n_bytes_by_type[entry.cache_type] -= entry.nbytes"],
    mlx_server.ResponseGenerator._next_request: ["self.requests.get(timeout=timeout)", "self.requests.get_nowait()"],
    mlx_server.ModelProvider.load: ["self._load(*model_key)", "if self.model_key != model_key"],
}


def missing() -> List[str]:
    """What this module relies on that the installed mlx-lm lacks (empty when all is there)."""
    out = []
    for cls, methods in _METHODS.items():
        for name, params in methods.items():
            fn = getattr(cls, name, None)
            if fn is None:
                out.append(f"{cls.__name__}.{name}")
                continue
            have = list(inspect.signature(fn).parameters)
            if have[: len(params)] != params:
                out.append(f"{cls.__name__}.{name}{tuple(params)} (now {tuple(have)})")
    for fn, lines in _SOURCE.items():
        text = inspect.getsource(fn)
        out += [f"{fn.__qualname__}: {line!r}" for line in lines if line not in text]
    for name in ("_run_http_server", "GenerationContext", "argparse"):
        if not hasattr(mlx_server, name):
            out.append(f"mlx_lm.server.{name}")
    return out
