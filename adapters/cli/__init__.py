"""The commands: `python -m h2o_fn {generate,eval,bench}` (and the `h2o-fn` script).

One module per command (`generate`, `evaluate`, `bench`), each with
`setup_arg_parser()` and `main(argv=None)`; `common` holds what they share (`--model`
loading, the policy flags, run headers, OpenBLAS, progress, markdown sections) and
`plots` their figures. Measurements shared with the tests live in
`h2o_fn.adapters.metrics`, which imports no command.
"""
