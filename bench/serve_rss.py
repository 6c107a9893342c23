"""Memory of `h2o-fn serve` as a client sees it: a long prompt, and a soak of short requests.

Usage:
    python bench/serve_rss.py prompt [--tokens 4090] [serve flags ...]
    python bench/serve_rss.py soak [--requests 600] [--prompts 3] [serve flags ...]

`prompt` starts the server (bundled model; extra arguments go to `h2o-fn serve`, e.g.
`--dequantize --prompt-retention window`), sends one short request to warm it, then a
text completion of `--tokens` tokens of pydoc_data.topics, and prints the seconds it took
and the process's peak RSS (VmHWM) before and after. `soak` sends `--requests` requests
from 3 clients, one in five a one-token chat over `--prompts` distinct prompts and the
others refused (`"stop": 5`), and prints RSS every 4 s. OpenBLAS is preloaded for the
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


def prompt(args, flags):
    from pydoc_data.topics import topics

    from h2o_fn.adapters import gguf

    tokenizer = gguf.load_gguf()[1]
    text = tokenizer.decode(tokenizer.encode(" ".join(topics.values()))[: args.tokens])
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
    parser.add_argument("what", choices=["prompt", "soak"])
    parser.add_argument("--tokens", type=int, default=4090)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--prompts", type=int, default=3)
    args, flags = parser.parse_known_args()
    (prompt if args.what == "prompt" else soak)(args, flags)


if __name__ == "__main__":
    main()
