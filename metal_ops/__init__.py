"""The kernel ops: the fused protected argmin (Metal and CUDA kernels with a pure MLX fallback,
`evict`) and, on the CPU, a decode token's step and settle as C++ mlx primitives (`cpu_step`)."""

from .evict import (
    BODY,
    CUDA_HEADER,
    METAL_HEADER,
    available_kernel,
    cuda_kernel,
    make_cuda_kernel,
    make_metal_kernel,
    metal_kernel,
    protected_argmin,
)

__all__ = [
    "BODY",
    "CUDA_HEADER",
    "METAL_HEADER",
    "available_kernel",
    "cuda_kernel",
    "make_cuda_kernel",
    "make_metal_kernel",
    "metal_kernel",
    "protected_argmin",
]
