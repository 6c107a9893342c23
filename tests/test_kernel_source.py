"""The Metal source MLX generates for the op, checked on a machine without a GPU.

How (mlx 0.32): a metal kernel called with `verbose=True` prints the source it
generates (std::cout, C++ side) when it builds its graph node. A plain call raises
"[metal_kernel] No Metal back-end." without Metal, but under `mx.export_function`
mlx records the node on a placeholder GPU stream instead (nothing is evaluated),
so the source is generated and printed anywhere. `capfd` captures it at fd level.
"""

import re
from pathlib import Path

import mlx.core as mx
import pytest

from h2o_fn.metal_ops import evict
from test_kernel_harness import translation_unit

SHIM = Path(__file__).with_name("kernel_shim.h").read_text()
KEYWORDS = {"const", "int", "float", "if", "for", "return", "continue", "uint", "unsigned"}


def generated_source(capfd, tmp_path, shape) -> str:
    """The Metal source printed for `launch` on `shape`-shaped inputs (traced, not run)."""
    kernel = evict.make_metal_kernel()

    def fn(scores, positions, newest):
        return evict.launch(kernel, scores, positions, newest, 1, 2, verbose=True)

    args = (mx.zeros(shape), mx.full(shape, -1, dtype=mx.int32), mx.array(9, dtype=mx.int32))
    capfd.readouterr()
    try:
        mx.export_function(str(tmp_path / "argmin.mlxfn"), fn, *args)
    except RuntimeError as e:
        if "No Metal back-end" in str(e):
            pytest.skip(f"mlx {mx.__version__} cannot trace a metal kernel for export without Metal: {e}")
        raise
    out = capfd.readouterr().out
    found = re.search(r"Generated source code for `h2o_protected_argmin`:\n```\n(.*?)\n```", out, re.S)
    assert found, f"no generated source in the captured output:\n{out}"
    return found.group(1)


def signature(source: str):
    """(kernel name, [parameter declarations]) of the `[[kernel]]` function in `source`."""
    found = re.search(r"\[\[kernel\]\] void (\w+)\((.*?)\) \{", source, re.S)
    assert found, f"no [[kernel]] signature in:\n{source}"
    return found.group(1), [p.strip() for p in found.group(2).split(",\n")]


def free_names(body: str, header: str) -> set:
    """Identifiers `body` uses but neither declares nor gets from `header` macros."""
    code = re.sub(r"//[^\n]*", "", body)
    used = set(re.findall(r"\b[A-Za-z_]\w*\b", code))
    declared = set(re.findall(r"\b(?:int|float|uint)\s+(\w+)\s*=", code))
    members = set(re.findall(r"\.\s*(\w+)", code))  # .x
    macros = set(re.findall(r"#define\s+(\w+)", header))
    return used - declared - members - macros - KEYWORDS


@pytest.mark.parametrize("shape", [(2, 4, 16), (1, 1, 3)], ids=["device", "constant"])
def test_generated_signature_binds_what_the_body_uses(capfd, tmp_path, shape):
    source = generated_source(capfd, tmp_path, shape)
    name, params = signature(source)
    assert name.startswith("custom_kernel_h2o_protected_argmin"), name
    assert evict.METAL_HEADER in source and evict.BODY in source  # the one body, unchanged

    space = lambda n: "constant" if n < 8 else "device"  # noqa: E731  mlx: < 8 elements -> constant
    rows = mx.zeros(shape).size // shape[-1]
    assert params == [
        f"const {space(mx.zeros(shape).size)} float* scores [[buffer(0)]]",
        "const constant int* scores_shape [[buffer(1)]]",
        f"const {space(mx.zeros(shape).size)} int32_t* positions [[buffer(2)]]",
        f"const {space(1 + rows)} int32_t* bounds [[buffer(3)]]",
        "device int32_t* slot [[buffer(4)]]",
        "uint3 thread_position_in_grid [[thread_position_in_grid]]",
    ]
    bound = {re.search(r"(\w+) \[\[", p).group(1) for p in params}
    assert free_names(evict.BODY, evict.METAL_HEADER) == bound


def test_harness_signature_mirrors_metal(capfd, tmp_path):
    """The g++ harness declares the same parameters, types and order as MLX's Metal signature."""
    _, params = signature(generated_source(capfd, tmp_path, (2, 4, 16)))
    metal = [re.sub(r"\s*\[\[.*?\]\]", "", p) for p in params]
    found = re.search(r"static void h2o_thread\((.*?)\) \{", translation_unit(evict.BODY), re.S)
    harness = [p.strip() for p in found.group(1).split(",\n")]
    assert harness == metal


@pytest.mark.parametrize(
    "backend,header",
    [("metal", evict.METAL_HEADER), ("cuda", evict.CUDA_HEADER), ("shim", SHIM)],
)
def test_every_backend_header_defines_the_body_macros(backend, header):
    """Names the body needs beyond MLX's bindings come from each backend's header."""
    bindings = {*evict.INPUT_NAMES, *evict.OUTPUT_NAMES, "scores_shape"}
    needed = free_names(evict.BODY, "") - bindings
    provided = set(re.findall(r"#define\s+(\w+)", header))
    if backend == "metal":
        provided.add("thread_position_in_grid")  # an attribute MLX binds (see above)
    if backend == "shim":
        provided.add("thread_position_in_grid")  # the harness's per-thread argument
    assert needed <= provided, f"{backend} header lacks {sorted(needed - provided)}"
    assert "inf" not in needed  # mlx's CUDA prelude defines `inf` as a macro


def test_cuda_kernel_builder_matches_backend():
    if mx.cuda.is_available():
        assert evict.cuda_kernel() is not None
    else:
        assert evict.cuda_kernel() is None
    assert (evict.metal_kernel() is None) == (not mx.metal.is_available())
