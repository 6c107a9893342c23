"""Prompt-cache entries on disk, for `h2o-fn serve --prompt-cache-dir DIR`.

Every entry the server's prompt cache holds is one file in DIR, written in the
`cache-prompt` format (mlx-lm's `save_prompt_cache`, with h2o-fn's metadata: the
format, the model, the policy) plus what serve needs to file it again: its token ids
and mlx-lm's cache type. Its layers are saved as held, packed ones too
(`at_rest.PackedH2OKVCache`). `h2o-fn generate --prompt-cache-file` reads these files too.

- Names: `<key>-<digest>.safetensors`; key: a hash of the served model's id and the
  entry's tokens; digest: a hash of the whole file, checked on load.
- Atomic: a file is written under a temporary name (`.tmp-...`), flushed to disk and
  renamed; a crash mid-write leaves a temporary file (removed at the next start) and
  every earlier file whole.
- Checked on load: a file whose name, digest, format, model, policy, tokens or layers
  do not fit the server is skipped with one log line (foreign, corrupt, partial, or
  written by another configuration) and never stops the server. Nothing is deleted but
  the temporary files of a crash and the entries the server drops.
- Bounded: DIR mirrors the prompt cache, so it holds at most `--prompt-cache-size`
  entries and about `--prompt-cache-bytes` bytes (each file adds its token ids and a
  header), plus the entries lent to requests running now (`H2OPromptCache`).

Example:
    >>> store = PromptCacheDir("/tmp/pc", "SmolLM2-135M-Instruct", {"budget": 256})   # doctest: +SKIP
    >>> store.write(tokens, cache, "assistant")                                        # doctest: +SKIP
    >>> [s.tokens for s in store.load(model)]                                          # doctest: +SKIP
"""

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from h2o_fn import storage

from ..at_rest import unpack_layers
from ..cache import H2OKVCache
from .cache_prompt import FORMAT

log = logging.getLogger("h2o_fn.serve")

SUFFIX = ".safetensors"
TEMP = ".tmp-"  # prefix of files being written
NAME = re.compile(r"([0-9a-f]{32})-([0-9a-f]{32})\.safetensors")


class Loaded(NamedTuple):
    """One entry read back: its tokens, its cache list, mlx-lm's cache type, the file."""

    tokens: List[int]
    cache: List[Any]
    cache_type: str
    path: Path


def digest_of(path: Path) -> str:
    """blake2b (16 bytes, hex) of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


def layer_signature(cache: Any) -> Tuple:
    """What a layer's cache must share with the server's to be continued there: its class,
    and for H2O its policy at the budget it was built with (`target_budget`: a long prompt
    read with the repeat pass reshapes each layer's budget and slots C) with `evict_every`,
    and the dtype and `[B, H, D]` of its key and value stores; for other caches the dtype and
    `[B, H, D]` of its keys and values."""
    name = type(cache).__name__
    if isinstance(cache, H2OKVCache):
        core = cache.core_state
        stores = () if core is None else tuple(
            (str(storage.dtype_of(x)), tuple(storage.parts(x)[0].shape[:2] + storage.parts(x)[0].shape[3:]))
            for x in (core.keys, core.values))
        policy = {**cache.policy.fields(), "budget": cache.target_budget, "evict_every": cache.evict_every}
        return name, json.dumps(policy, sort_keys=True), stores
    arrays = [a for a in getattr(cache, "state", ())[:2] if isinstance(a, mx.array)]
    return name, tuple((str(a.dtype), a.shape[:2] + a.shape[3:]) for a in arrays if a.ndim == 4)


class PromptCacheDir:
    """Prompt-cache entries as files in `path` (see the module docstring).

    Args:
      path: the directory (created if missing).
      model_id: the served model's id; files written for another are skipped on load.
      policy: the H2O policy's fields (`Policy.fields()`), or None for a server without
        H2O; files written under another are skipped.
    """

    def __init__(self, path, model_id: str, policy: Optional[dict]):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.model_id, self.policy = model_id, policy
        self._files: Dict[Tuple[int, ...], Path] = {}  # tokens -> file, for every file written or loaded
        self.writes = 0
        self.write_seconds = 0.0

    def key(self, tokens: Sequence[int]) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update(self.model_id.encode())
        h.update(b"\0" + ",".join(map(str, tokens)).encode())
        return h.hexdigest()

    def metadata(self, tokens: Sequence[int], cache_type: str) -> Dict[str, str]:
        """`cache_prompt.metadata`'s strings, and the tokens and cache type serve files the entry by."""
        return {
            "format": FORMAT,
            "model": self.model_id,
            "chat_template": json.dumps(None),  # the tokens are the whole conversation so far
            "h2o_policy": json.dumps(self.policy),
            "prompt_tokens": str(len(tokens)),
            "tokenizer_config": json.dumps({}),
            "serve_tokens": json.dumps(list(map(int, tokens))),
            "serve_cache_type": cache_type,
        }

    def write(self, tokens: Sequence[int], cache: List[Any], cache_type: str) -> Path:
        """Write the entry for `tokens` atomically (temporary file, fsync, rename); an earlier
        file for the same tokens is replaced. Returns the file."""
        import time

        start = time.perf_counter()
        key = self.key(tokens)
        temp = self.path / f"{TEMP}{key}-{os.getpid()}{SUFFIX}"
        try:
            save_prompt_cache(str(temp), cache, self.metadata(tokens, cache_type))
            with open(temp, "rb") as f:
                digest = hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()
                os.fsync(f.fileno())
            final = self.path / f"{key}-{digest}{SUFFIX}"
            os.replace(temp, final)
            self._sync_dir()
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        old = self._files.get(tuple(tokens))
        if old is not None and old != final:
            old.unlink(missing_ok=True)
        self._files[tuple(tokens)] = final
        self.writes += 1
        self.write_seconds += time.perf_counter() - start
        return final

    def remove(self, tokens: Sequence[int]) -> None:
        """Delete the file of the entry for `tokens` (none: nothing to do)."""
        path = self._files.pop(tuple(tokens), None)
        if path is not None:
            path.unlink(missing_ok=True)

    def usage(self) -> Tuple[int, int]:
        """(files, bytes) of the entries in the directory now."""
        sizes = [p.stat().st_size for p in self._files.values() if p.exists()]
        return len(sizes), sum(sizes)

    def _sync_dir(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def load(self, model) -> List[Loaded]:
        """Every entry file in the directory that fits `model` and this server, oldest first
        (by modification time). Temporary files of a crash are removed; any other file that
        does not fit is skipped with one log line naming why."""
        want = [layer_signature(c) for c in _probe(model)]
        out = []
        for path in sorted(self.path.iterdir(), key=lambda p: (p.stat().st_mtime, p.name)):
            if path.name.startswith(TEMP):
                log.warning("prompt-cache dir: %s is a write a crash left unfinished: removed", path.name)
                path.unlink(missing_ok=True)
                continue
            if not path.is_file():
                continue
            try:
                out.append(self._read(path, want))
            except ValueError as e:
                log.warning("prompt-cache dir: %s skipped: %s", path.name, e)
        for entry in out:
            self._files[tuple(entry.tokens)] = entry.path
        return out

    def _read(self, path: Path, want: List[Tuple]) -> Loaded:
        """One entry file, checked (raises ValueError naming what does not fit)."""
        name = NAME.fullmatch(path.name)
        if name is None:
            raise ValueError("not an entry file of h2o-fn serve (expected <key>-<digest>.safetensors)")
        digest = digest_of(path)
        if digest != name.group(2):
            raise ValueError(f"its bytes hash to {digest}, not {name.group(2)}: the file is corrupt or partial")
        try:
            cache, meta = load_prompt_cache(str(path), return_metadata=True)
            cache = unpack_layers(cache)
        except Exception as e:  # safetensors or mlx-lm's class lookup: not a prompt-cache file
            raise ValueError(f"not a prompt-cache file ({type(e).__name__}: {e})") from None
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}: expected {FORMAT!r}")
        if meta.get("model") != self.model_id:
            raise ValueError(f"written for model {meta.get('model')!r}: this server serves {self.model_id!r}")
        policy = json.loads(meta.get("h2o_policy", "null"))
        if policy != self.policy:
            raise ValueError(f"written under the policy {policy}: this server's is {self.policy}")
        try:
            tokens = [int(t) for t in json.loads(meta["serve_tokens"])]
        except (KeyError, TypeError, ValueError):
            raise ValueError("holds no serve_tokens (a cache-prompt file, not an entry of serve)") from None
        if self.key(tokens) != name.group(1):
            raise ValueError(f"its tokens key to {self.key(tokens)}, not {name.group(1)} (a renamed file)")
        cache_type = meta.get("serve_cache_type", "assistant")
        if cache_type not in ("assistant", "user", "system"):
            raise ValueError(f"cache type {cache_type!r}: expected assistant, user or system")
        got = [layer_signature(c) for c in cache]
        if len(got) != len(want):
            raise ValueError(f"{len(got)} layers: expected {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                raise ValueError(f"layer {i} is {g}: expected {w}")
        mx.eval([c.state for c in cache])  # read now: the file may be deleted while the entry is held
        return Loaded(tokens, cache, cache_type, path)


def _probe(model) -> List[Any]:
    """A cache list of `model` after one token, to compare stored layers with."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]]), cache=cache))
    return cache
