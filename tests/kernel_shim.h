// CPU shim for the kernel body in h2o_fn/metal_ops/evict.py (BODY).
//
// Defines, for g++, what METAL_HEADER / CUDA_HEADER define for the GPU compilers,
// plus the Metal built-ins the body may name. The thread index is not a built-in
// here: the harness passes `thread_position_in_grid` as a function argument and
// loops over every thread of the (rounded-up) grid, one after the other.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

struct uint3 {
    unsigned int x, y, z;
};

// Metal address-space qualifiers: plain pointers on the CPU.
#define device
#define constant
#define threadgroup
#define thread

#define H2O_ISNAN(x) std::isnan(x)
#define H2O_NEG_INF (-std::numeric_limits<float>::infinity())
