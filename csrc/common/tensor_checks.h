// Layout checks of op arguments shared by every binding: the verify and stats ops of each backend (op_checks.h builds
// on them) and the lean forward's ops (csrc/forward/model_bindings.cpp). Structural only: they never read values.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace diversed {

// Exactly this dtype and shape, contiguous: the layout the Python layer produces. Shapes are compared whole, not by
// element count, so a tensor the Python layer would refuse (say [K, B] tokens) is refused here too; an unchecked call
// that passes its tensors straight through (diversed_ext/ops/api.py) relies on that.
inline void check_layout(const at::Tensor& tensor, at::ScalarType dtype, at::IntArrayRef sizes, const char* op,
                         const char* what) {
  TORCH_CHECK(tensor.scalar_type() == dtype && tensor.is_contiguous() && tensor.sizes() == sizes, op, ": ", what,
              " must be contiguous ", dtype, " of shape ", sizes, ", got ", tensor.scalar_type(), " of shape ",
              tensor.sizes());
}

inline void check_float_vector(const at::Tensor& tensor, int64_t size, const char* op, const char* name) {
  check_layout(tensor, at::kFloat, {size}, op, name);
}

}  // namespace diversed
