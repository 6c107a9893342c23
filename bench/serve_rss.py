"""Memory and waits of `h2o-fn serve` as a client sees them: a long prompt, a soak of short
requests, a chat streamed while a long prompt is read, and a client that leaves a reading.

Usage:
    python bench/serve_rss.py prompt [--tokens 4090] [serve flags ...]
    python bench/serve_rss.py soak [--requests 600] [--prompts 3] [serve flags ...]
    python bench/serve_rss.py interleave [--tokens 4090] [--chat-tokens 128] [serve flags ...]

`prompt` starts the server (bundled model; extra arguments go to `h2o-fn serve`, e.g.
`--dequantize --prompt-retention window`), sends one short request to warm it, then a
text completion of `--tokens` tokens of pydoc_data.topics, and prints the seconds it took
and the process's peak RSS (VmHWM) before and after. `soak` sends `--requests` requests
from 3 clients, one in five a one-token chat over `--prompts` distinct prompts and the
others refused (`"stop": 5`), and prints RSS every 4 s. `interleave` streams a chat of
`--chat-tokens` tokens alone, then again with a `--tokens` prompt sent `--delay` s into it
and a short chat `--delay` s after that, and prints the gaps between the chat's pieces
(median, mean, largest) both ways, the reading's slices, and when the short chat was
answered; then it streams the long prompt again, closes the connection after `--leave-after`
keep-alives (slices read), and prints the server's CPU use (cores, over each 0.5 s) until
it is idle. OpenBLAS is preloaded for the
server when `/usr/lib/*/openblas-pthread/libopenblas.so.0` exists (as eval and bench do).
"""

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

from h2o_fn.adapters.cli.common import openblas_coretype, openblas_path


def start(flags):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    if openblas_path():
        env.update(LD_PRELOAD=openblas_path(), OPENBLAS_CORETYPE=env.get("OPENBLAS_CORETYPE", openblas_coretype()))
    proc = subprocess.Popen([sys.executable, "-m", "h2o_fn", "serve", "--host", "127.0.0.1", "--port", str(port),
                             *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            time.sleep(0.3)
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with {proc.returncode}")


def post(port, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"{}")


def mib(proc, key):
    for line in open(f"/proc/{proc.pid}/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key}")


def document(tokens, start=0):
    """`tokens` tokens of pydoc_data.topics from token `start` on, as text."""
    from pydoc_data.topics import topics

    from h2o_fn.adapters import gguf

    tokenizer = gguf.load_gguf()[1]
    return tokenizer.decode(tokenizer.encode(" ".join(topics.values()))[start : start + tokens])


def stream(port, path, body, leave_after=None):
    """Stream `body`: (the send time, the arrival time of each event carrying text, of each
    keep-alive comment, the end). With `leave_after`, the connection is closed at that keep-alive."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    sent = time.perf_counter()
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    response, pieces, alive = conn.getresponse(), [], []
    while line := response.readline():
        line = line.strip()
        if line.startswith(b":"):
            alive.append(time.perf_counter())
            if len(alive) == leave_after:
                break  # closing the response below closes the socket (the connection gave it up)
        elif line == b"data: [DONE]":
            break
        elif line.startswith(b"data: "):
            choice = json.loads(line[6:])["choices"][0]
            if (choice.get("delta") or {}).get("content") or choice.get("text"):
                pieces.append(time.perf_counter())
    response.close()
    conn.close()
    return sent, pieces, alive, time.perf_counter()


def cpu_seconds(proc):
    fields = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def gaps(pieces):
    d = sorted(b - a for a, b in zip(pieces, pieces[1:]))
    if not d:
        return "no gaps (fewer than 2 pieces)"
    return (f"{len(pieces)} pieces, gaps median {1e3 * d[len(d) // 2]:.0f} ms, mean {1e3 * sum(d) / len(d):.0f} ms, "
            f"largest {1e3 * d[-1]:.0f} ms")


def interleave(args, flags):
    text, other = document(args.tokens), document(args.tokens, start=args.tokens)
    chat = {"messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
            "max_tokens": args.chat_tokens, "temperature": 0.0}
    proc, port = start(flags)
    try:
        stream(port, "/v1/chat/completions", chat)  # warm: the chat's prompt is cached for every run
        sent, alone, *_ = stream(port, "/v1/chat/completions", chat)
        print(f"chat alone: first piece after {alone[0] - sent:.2f} s; {gaps(alone)}", flush=True)
        runs = {}

        def run(name, path, body):
            runs[name] = stream(port, path, body)

        threads = [threading.Thread(target=run, args=a) for a in (
            ("chat", "/v1/chat/completions", chat), ("long", "/v1/completions", {"prompt": text, "max_tokens": 1}),
            ("short", "/v1/chat/completions", {**chat, "max_tokens": 8}))]
        for t, wait in zip(threads, (args.delay, args.delay, 0)):
            t.start()
            time.sleep(wait)
        for t in threads:
            t.join()
        (_, during, *_), (sent, _, alive, end), (short_sent, short, *_) = runs["chat"], runs["long"], runs["short"]
        slices = ", ".join(f"{b - a:.1f}" for a, b in zip(alive, alive[1:]))
        print(f"the same chat with a {args.tokens}-token prompt sent {args.delay:.0f} s into it: {gaps(during)}; "
              f"the prompt read in {end - sent:.1f} s (slices {slices} s); a short chat sent {args.delay:.0f} s "
              f"into the reading: first piece after {short[0] - short_sent:.1f} s, last {end - short[-1]:.1f} s "
              f"before the reading ended", flush=True)
        _, _, alive, _ = stream(port, "/v1/completions", {"prompt": other, "max_tokens": 1},
                                leave_after=args.leave_after)
        left, before = time.perf_counter(), cpu_seconds(proc)
        samples = []
        while time.perf_counter() - left < args.idle_wait and (not samples or samples[-1] >= 0.1):
            time.sleep(0.5)
            cpu = cpu_seconds(proc)
            samples, before = samples + [(cpu - before) / 0.5], cpu
        print(f"left a reading after {len(alive)} keep-alives ({left - alive[-1]:.1f} s into slice {len(alive)}): "
              + (f"idle (< 0.1 cores) {0.5 * len(samples):.1f} s later" if samples[-1] < 0.1 else
                 f"not idle after {args.idle_wait:.0f} s")
              + "; server cores every 0.5 s: " + " ".join(f"{c:.1f}" for c in samples))
    finally:
        proc.terminate()
        proc.wait()


def prompt(args, flags):
    text = document(args.tokens)
    proc, port = start(flags)
    try:
        post(port, "/v1/completions", {"prompt": "x", "max_tokens": 1})
        rss, before = mib(proc, "VmRSS"), mib(proc, "VmHWM")
        t = time.perf_counter()
        status, body = post(port, "/v1/completions", {"prompt": text, "max_tokens": 4})
        print(f"serve {' '.join(flags)}: status {status}, {body.get('usage', {}).get('prompt_tokens')} prompt "
              f"tokens in {time.perf_counter() - t:.1f} s; RSS {rss:.0f} MiB after a warm-up, peak RSS "
              f"{before:.0f} MiB before the prompt, {mib(proc, 'VmHWM'):.0f} MiB after")
    finally:
        proc.terminate()
        proc.wait()


def soak(args, flags):
    proc, port = start(flags)
    done = [0]

    def client(k):
        for i in range(args.requests // 3):
            if i % 5:
                post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": 5})
            else:
                status, _ = post(port, "/v1/chat/completions", {"max_tokens": 1, "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": f"Name thing {(k + i // 5) % args.prompts}."}]})
                assert status == 200
            done[0] += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(3)]
    try:
        start_s = time.perf_counter()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            print(f"{time.perf_counter() - start_s:6.1f} s  {done[0]:5d} requests  RSS {mib(proc, 'VmRSS'):.0f} MiB",
                  flush=True)
            time.sleep(4)
        print(f"end: {done[0]} requests, RSS {mib(proc, 'VmRSS'):.0f} MiB")
    finally:
        proc.terminate()
        proc.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["prompt", "soak", "interleave"])
    parser.add_argument("--tokens", type=int, default=4090)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--chat-tokens", type=int, default=128)
    parser.add_argument("--delay", type=float, default=1.0,
                        help="seconds from the chat to the long prompt, and from it to a short chat")
    parser.add_argument("--leave-after", type=int, default=3, help="keep-alives before the client leaves")
    parser.add_argument("--idle-wait", type=float, default=300.0)
    args, flags = parser.parse_known_args()
    {"prompt": prompt, "soak": soak, "interleave": interleave}[args.what](args, flags)


if __name__ == "__main__":
    main()
