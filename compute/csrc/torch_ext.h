// The torch headers the kernels need, in place of <torch/extension.h>: ATen's tensors and operators and pybind11 with
// torch's tensor casters. <torch/extension.h> parses all of libtorch's C++ API (about 25 s of each kernel's first
// build on a 2-core host); these take about 7 s.
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

namespace torch {  // torch::Tensor, torch::kFloat, torch::empty ... as <torch/types.h> names them
using namespace at;
constexpr auto kFloat32 = at::kFloat;
constexpr auto kFloat16 = at::kHalf;
constexpr auto kInt8 = at::kChar;
}  // namespace torch
