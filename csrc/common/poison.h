// Test hook shared by every backend: with DIVERSED_POISON_OUTPUTS set, ops fill their freshly allocated outputs with
// garbage before computing, so a test notices any element a kernel forgets to write.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdlib>
#include <limits>

namespace diversed {

inline bool poison_requested() { return std::getenv("DIVERSED_POISON_OUTPUTS") != nullptr; }

inline void poison_output(at::Tensor& tensor) {
  if (tensor.is_floating_point())
    tensor.fill_(std::numeric_limits<double>::quiet_NaN());
  else
    tensor.fill_(0x5A5A5A5A);
}

template <typename... Tensors>
void poison_outputs(Tensors&... tensors) {
  if (!poison_requested()) return;
  (poison_output(tensors), ...);
}

}  // namespace diversed
