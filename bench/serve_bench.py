"""Many conversations in bounded memory: `h2o-fn serve` as a chat client sees it, on loopback.

Usage:
    python bench/serve_bench.py [--conversations 10] [--doc-tokens 2000] [--cache-entries 2.5]
                                [--configs full-unbounded full h2o-512 ...] [--sweep 1 2.5 6 12]
                                [--out results/serve-bench]
    python bench/serve_bench.py share [--doc-tokens 2048] [--budget 512]
    python bench/serve_bench.py report --inputs A/serve-bench.json B/serve-bench.json [--out DIR]

Each of K conversations is a natural-text document (`--doc-tokens` tokens of
pydoc_data.topics, a different part for each) with three facts in it ("The code of the
door is 4821.", at 20%, 50% and 80% of its length) and a question about the first. Then
two follow-ups per conversation, each about another fact, interleaved across all K (the
first follow-up of every conversation, then the second), with the server restarted
before each round of follow-ups (`--prompt-cache-dir`: the entries come back from disk).
Every request is one streamed chat (greedy, 12 tokens at most), sent one at a time.

For each configuration (`CONFIGS`: the full cache with no bound, the full cache and H2O
at two budgets with float and 8-bit rows, all at one `--prompt-cache-bytes`, which is
`--cache-entries` times the bytes of one full-cache entry of a question's length) it
reports: the entries held after the questions, the follow-ups answered from a cache
hit (the prompt cache held at least the previous turn), their time to first token, the
follow-ups answered right (the code in the answer), the server's peak RSS (VmHWM, the
largest over its three runs) and the bytes in its --prompt-cache-dir at the end.
`--sweep`: the same for the full cache and each H2O configuration at other bounds (in
full-cache entries), for a plot of conversations held and accuracy against the bound.

`share` (in process): the peak memory of continuing a stored H2O entry with a few new
tokens, when the entry is deep-copied (mlx-lm's fetch), shared (`serve.share`), or
handed to the request (`H2OPromptCache` for a conversation's evicted entry); then the same
document read as serve reads a long prompt (`cache_prompt`), held as it is (shared or
handed over) or packed (`at_rest.pack_layers`: shared = unpacked into new arrays, handed
over = unpacked in place, layer by layer).

`report`: the table and the plot of several runs' results together (runs at other bounds,
commits or configurations, with the same conversations); each row keeps its own bound.

The server runs with `--dequantize` and OpenBLAS preloaded when
`/usr/lib/*/openblas-pthread/libopenblas.so.0` exists (bench/serve_rss.py's `start`).
Results: `<out>/serve-bench.json`, `<out>/serve-bench.md`, `<out>/serve-bench.png`.
"""

import argparse
import http.client
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_rss import mib  # noqa: E402

from h2o_fn.adapters.cli.common import openblas_coretype, openblas_path  # noqa: E402

NAMES = ("door", "safe", "locker", "vault")
SYSTEM = "You answer questions about the document the user gives. Answer with the code only."
MAX_TOKENS = 12
LAYERS, KV_HEADS, HEAD_DIM, FLOAT32 = 30, 3, 64, 4  # SmolLM2-135M with --dequantize
CONFIGS = {  # name: (serve flags, bounded by --prompt-cache-bytes)
    "full-unbounded": (["--full-cache"], False),
    "full": (["--full-cache"], True),
    "h2o-512": (["--budget", "512"], True),
    "h2o-512-8bit": (["--budget", "512", "--kv-bits", "8"], True),
    "h2o-512-8bit-no-windows": (["--budget", "512", "--kv-bits", "8", "--prompt-share", "0"], True),
    "h2o-256": (["--budget", "256"], True),
    "h2o-256-8bit": (["--budget", "256", "--kv-bits", "8"], True),
}


# ---------------------------------------------------------------- the conversations


def conversations(tokenizer, k: int, doc_tokens: int, seed: int = 0) -> list:
    """K conversations: (document text, [(name, code)] * 3), each document a different part
    of pydoc_data.topics with the three facts put in after a sentence at 20/50/80%."""
    from pydoc_data.topics import topics

    ids = tokenizer.encode(" ".join(topics[t] for t in sorted(topics)))
    if len(ids) < k * doc_tokens:
        raise SystemExit(f"pydoc_data.topics has {len(ids)} tokens: too few for {k} x {doc_tokens}")
    rng = random.Random(seed)
    out = []
    for i in range(k):
        text = tokenizer.decode(ids[i * doc_tokens : (i + 1) * doc_tokens])
        names = rng.sample(NAMES, 3)
        facts = [(name, str(rng.randrange(1000, 10000))) for name in names]
        for depth, (name, code) in sorted(zip((0.2, 0.5, 0.8), facts), reverse=True):
            at = text.find(". ", int(depth * len(text)))
            at = len(text) if at < 0 else at + 2
            text = text[:at] + f"The code of the {name} is {code}. " + text[at:]
        out.append((text, facts))
    return out


def turn(doc: str, facts: list, answers: list, t: int) -> list:
    """The messages of turn t (0: the document and its first question; 1, 2: follow-ups)."""
    ask = lambda name: f"What is the code of the {name}?"  # noqa: E731
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{doc}\n\n{ask(facts[0][0])}"}]
    for i in range(1, t + 1):
        messages += [{"role": "assistant", "content": answers[i - 1]}, {"role": "user", "content": ask(facts[i][0])}]
    return messages


# ---------------------------------------------------------------- the server


class Server:
    def __init__(self, flags, folder: Path, log: Path):
        self.flags, self.folder, self.log, self.peak_mib = flags, folder, log, 0.0
        self.proc = None

    def start(self):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = dict(os.environ)
        if openblas_path():
            env.update(LD_PRELOAD=openblas_path(), OPENBLAS_CORETYPE=env.get("OPENBLAS_CORETYPE", openblas_coretype()))
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "h2o_fn", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                 "--dequantize", "--prompt-cache-dir", str(self.folder), *self.flags],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"serve exited with {self.proc.returncode}: see {self.log}")
            try:
                if self.get("/health")[0] == 200:
                    return time.monotonic() - start
            except OSError:
                time.sleep(0.3)

    def stop(self):
        self.peak_mib = max(self.peak_mib, mib(self.proc, "VmHWM"))
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def get(self, path):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")

    def chat(self, messages) -> dict:
        """One streamed chat: its text, time to first token, usage."""
        body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        start = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise SystemExit(f"chat answered {response.status}: {response.read()[:500]}")
        text, first, usage = "", None, None
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - start
                text += piece
        return {"text": text, "ttft": first if first is not None else time.perf_counter() - start,
                "seconds": time.perf_counter() - start, "usage": usage}


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


# ---------------------------------------------------------------- one configuration


def run_config(name: str, flags: list, cache_bytes, convs: list, out: Path) -> dict:
    folder = out / f"dir-{name}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    bound = [] if cache_bytes is None else ["--prompt-cache-bytes", str(int(cache_bytes))]
    server = Server([*flags, "--prompt-cache-size", "1000", *bound], folder, out / f"{name}.log")
    answers = [[] for _ in convs]
    rounds, held, starts = [], [], []
    for t in range(3):
        starts.append(server.start())
        rows = []
        for k, (doc, facts) in enumerate(convs):
            r = server.chat(turn(doc, facts, answers[k], t))
            answers[k].append(r["text"])
            prev = rounds[-1][k]["usage"]["total_tokens"] if t else 0
            cached = (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            rows.append({**r, "right": facts[t][1] in r["text"], "hit": t > 0 and cached >= prev - MAX_TOKENS,
                         "cached": cached})
            print(f"  {name} turn {t} conversation {k}: {'hit ' if rows[-1]['hit'] else ''}"
                  f"{'right' if rows[-1]['right'] else 'wrong'} {r['text'][:30]!r} ttft {r['ttft']:.1f} s "
                  f"({cached} of {r['usage']['prompt_tokens']} cached)", flush=True)
        stats = server.get("/v1/h2o/stats")[1]["prompt_cache"]
        held.append(stats)
        rounds.append(rows)
        server.stop()
    follow = [r for rows in rounds[1:] for r in rows]
    ttft = sorted(r["ttft"] for r in follow)
    return {
        "name": name, "flags": flags, "cache_bytes": cache_bytes,
        "held_after_questions": held[0]["entries"], "held_bytes": held[0]["bytes"],
        "entry_bytes": held[0]["bytes"] / max(held[0]["entries"], 1),
        "questions_right": sum(r["right"] for r in rounds[0]),
        "follow_ups": len(follow), "follow_up_hits": sum(r["hit"] for r in follow),
        "follow_ups_right": sum(r["right"] for r in follow),
        "follow_up_ttft_median": ttft[len(ttft) // 2], "follow_up_ttft_max": ttft[-1],
        "hit_ttft_median": _median([r["ttft"] for r in follow if r["hit"]]),
        "miss_ttft_median": _median([r["ttft"] for r in follow if not r["hit"]]),
        "peak_rss_mib": server.peak_mib, "disk_bytes": disk_bytes(folder), "start_seconds": starts,
        "stats": held, "rounds": [[{k: v for k, v in r.items()} for r in rows] for rows in rounds],
    }


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def full_entry_bytes(tokens: int) -> int:
    """Bytes a full KVCache entry of `tokens` tokens holds (float32 rows, grown 256 at a time)."""
    slots = -(-tokens // 256) * 256
    return slots * LAYERS * 2 * KV_HEADS * HEAD_DIM * FLOAT32


# ---------------------------------------------------------------- sharing, in process


def share_peaks(doc_tokens: int, budget: int) -> dict:
    """Peak memory above what was live, continuing a stored entry (doc_tokens read, budget)
    with 8 new tokens and 16 decoded: deep copy, shared, handed over, packed (see the docstring)."""
    import copy
    import gc

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from pydoc_data.topics import topics

    from h2o_fn.adapters.at_rest import pack_layers, unpack_layers
    from h2o_fn.adapters.cli import common, serve
    from h2o_fn.adapters.mlx_lm import use_h2o
    from h2o_fn.adapters.retention import cache_prompt, repeat_prefix

    model, tokenizer = common.load_model(None, dequantize=True)
    use_h2o(model, budget=budget)
    ids = tokenizer.encode(" ".join(topics.values()))[:doc_tokens]
    new = tokenizer.encode(" What is the code of the door? The code is")[:8]
    out = {}
    for mode in ("deep copy", "shared", "handed over", "read, shared", "read, handed over", "packed, shared",
                 "packed, handed over"):
        if mode.startswith(("read", "packed")):  # a long prompt read as serve reads it
            entry = make_prompt_cache(model)
            cache_prompt(model, ids, entry, repeat_prefix=repeat_prefix(tokenizer))
            slots = sum(c.nbytes for c in entry)
            entry = pack_layers(entry) if mode.startswith("packed") else serve.share(entry)
        else:
            entry = make_prompt_cache(model)
            for i in range(0, len(ids), 512):
                model(mx.array(ids[i : i + 512])[None], cache=entry)
                mx.eval([c.state for c in entry])
            entry = serve.share(entry)  # as the prompt cache stores it: no view of the last chunk held
            slots = sum(c.nbytes for c in entry)
        size = sum(c.nbytes for c in entry)
        gc.collect()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        if mode == "packed, handed over":
            cache = unpack_layers(entry, in_place=True)
        else:
            cache = copy.deepcopy(entry) if mode == "deep copy" else serve.share(entry)
        if mode.endswith("handed over"):
            del entry
            gc.collect()
        logits = model(mx.array(new)[None], cache=cache)
        y = mx.argmax(logits[0, -1])
        for _ in range(16):
            y = mx.argmax(model(y.reshape(1, 1), cache=cache)[0, -1])
            mx.eval(y)
        out[mode] = {"entry_mib": size / 2**20, "slots_mib": slots / 2**20,
                     "peak_mib": (mx.get_peak_memory() - base) / 2**20}
        print(f"{mode}: entry {size / 2**20:.1f} MiB (its slots {slots / 2**20:.1f} MiB), "
              f"peak +{out[mode]['peak_mib']:.1f} MiB above what was live")
        del cache, logits, y
        gc.collect()
    return out


# ---------------------------------------------------------------- report


def render(results: dict) -> list:
    a = results["args"]
    lines = [f"K = {a['conversations']} conversations of {a['doc_tokens']} tokens, --prompt-cache-bytes as the "
             f"bound column says (a full-cache entry: {results['full_entry_bytes'] / 2**20:.1f} MiB), --dequantize"
             f"{', OpenBLAS' if results['openblas'] else ''}", "",
             "| server | bound MiB | entries held | entry MiB | questions right | follow-up hits | follow-ups right | "
             "follow-up TTFT median (hit / miss), s | peak RSS MiB | disk MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["configs"] + results.get("sweep", []):  # the sweep's rows: the same at other bounds
        f = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
        bound = "-" if r.get("cache_bytes") is None else f"{r['cache_bytes'] / 2**20:.0f}"
        lines.append(f"| {r['name']} | {bound} | {r['held_after_questions']} | {r['entry_bytes'] / 2**20:.1f} | "
                     f"{r['questions_right']}/{a['conversations']} | {r['follow_up_hits']}/{r['follow_ups']} | "
                     f"{r['follow_ups_right']}/{r['follow_ups']} | {f(r['follow_up_ttft_median'])} "
                     f"({f(r['hit_ttft_median'])} / {f(r['miss_ttft_median'])}) | {r['peak_rss_mib']:.0f} | "
                     f"{r['disk_bytes'] / 2**20:.0f} |")
    return lines


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["configs"] + results.get("sweep", [])
    names = dict.fromkeys(r["name"] for r in rows if r["name"] != "full-unbounded")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in names:
        pts = sorted((r["cache_bytes"] / 2**20, r["held_after_questions"], r["follow_ups_right"] / r["follow_ups"])
                     for r in rows if r["name"] == name)
        a1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        a2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=name)
    for r in rows:  # follow-ups that missed were answered by reading the conversation again
        if r["name"] != "full-unbounded" and r["follow_up_hits"] < r["follow_ups"]:
            a2.annotate(f"{r['follow_up_hits']}/{r['follow_ups']} hits, TTFT {r['follow_up_ttft_median']:.0f} s",
                        (r["cache_bytes"] / 2**20, r["follow_ups_right"] / r["follow_ups"]), fontsize=7,
                        textcoords="offset points", xytext=(4, -10))
    for r in results["configs"]:
        if r["name"] == "full-unbounded":
            a2.axhline(r["follow_ups_right"] / r["follow_ups"], color="k", ls="--", lw=1, label="full, unbounded")
    a1.set_xlabel("--prompt-cache-bytes (MiB)")
    a1.set_ylabel(f"conversations held (of {results['args']['conversations']})")
    a2.set_xlabel("--prompt-cache-bytes (MiB)")
    a2.set_ylabel("follow-ups answered right")
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(inputs: list, out: Path) -> None:
    """The rows of several runs' `serve-bench.json` in one table and plot (`<out>/serve-bench.md`,
    `.png`); the first file gives the header (conversations, document length, full entry)."""
    if not inputs:
        raise SystemExit("report: --inputs names no serve-bench.json: expected at least one")
    runs = [json.loads(Path(p).read_text()) for p in inputs]
    first = runs[0]
    for p, r in zip(inputs, runs):
        if (r["args"]["conversations"], r["args"]["doc_tokens"]) != (first["args"]["conversations"],
                                                                     first["args"]["doc_tokens"]):
            raise SystemExit(f"report: {p} ran {r['args']['conversations']} conversations of "
                             f"{r['args']['doc_tokens']} tokens: expected {first['args']['conversations']} of "
                             f"{first['args']['doc_tokens']}, as {inputs[0]}")
    rows = [row for r in runs for row in r["configs"] + r.get("sweep", [])]
    joined = dict(first, configs=rows, sweep=[], inputs=inputs)
    text = "\n".join(render(joined)) + "\n"
    (out / "serve-bench.json").write_text(json.dumps(joined, indent=1))
    (out / "serve-bench.md").write_text(text)
    plot(joined, out / "serve-bench.png")
    print(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="?", choices=["conversations", "share", "report"], default="conversations")
    parser.add_argument("--inputs", nargs="+", default=[], help="report: serve-bench.json files to join")
    parser.add_argument("--conversations", type=int, default=10)
    parser.add_argument("--doc-tokens", type=int, default=2000)
    parser.add_argument("--cache-entries", type=float, default=2.5,
                        help="--prompt-cache-bytes, in full-cache entries of a question's length (default 2.5)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--sweep", type=float, nargs="*", default=[],
                        help="other bounds (in full-cache entries) for the plot, run for every bounded config")
    parser.add_argument("--budget", type=int, default=512, help="share: the entry's budget")
    parser.add_argument("--out", default="results/serve-bench")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "share":
        result = share_peaks(args.doc_tokens, args.budget)
        (out / "serve-share.json").write_text(json.dumps(result, indent=1))
        return
    if args.what == "report":
        report(args.inputs, out)
        return
    from h2o_fn.adapters import gguf

    tokenizer = gguf.load_gguf()[1]
    convs = conversations(tokenizer, args.conversations, args.doc_tokens)
    question_tokens = len(tokenizer.apply_chat_template(turn(*convs[0], [], 0), add_generation_prompt=True))
    entry = full_entry_bytes(question_tokens + MAX_TOKENS)
    results = {"args": vars(args), "openblas": bool(openblas_path()), "full_entry_bytes": entry,
               "cache_bytes": args.cache_entries * entry, "configs": [], "sweep": [],
               "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip(),
               "load": os.getloadavg()}
    for name in args.configs:
        flags, bounded = CONFIGS[name]
        print(f"{name}: {' '.join(flags)}", flush=True)
        row = run_config(name, flags, args.cache_entries * entry if bounded else None, convs, out)
        results["configs"].append(row)
        (out / "serve-bench.json").write_text(json.dumps(results, indent=1))
    for times in args.sweep:
        for name in args.configs:
            flags, bounded = CONFIGS[name]
            if bounded:
                row = run_config(f"{name}", flags, times * entry, convs, out)
                results["sweep"].append(row)
                (out / "serve-bench.json").write_text(json.dumps(results, indent=1))
    results["load_after"] = os.getloadavg()
    (out / "serve-bench.json").write_text(json.dumps(results, indent=1))
    text = "\n".join(render(results)) + "\n"
    (out / "serve-bench.md").write_text(text)
    plot(results, out / "serve-bench.png")
    print(text)


if __name__ == "__main__":
    main()
