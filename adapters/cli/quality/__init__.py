"""The quality sections of `python -m h2o_fn eval`, one module each: `measure(run)` returns
its results (a JSON-able dict), `render(results)` turns them into markdown and reads
nothing else. `specs` holds what they share: the run, the caches compared and how to
build one."""
