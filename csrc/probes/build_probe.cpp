// The tests' probe of the CPU build the kernels run: the same choice (csrc/cpu_base/capability.h, read on every call)
// named, so a test that caps the build with DIVERSED_CPU_CAPABILITY can see the cap taken, and which builds the CPU has.
#include <torch/library.h>

#include <string>

#include "../cpu_base/capability.h"

namespace diversed {
namespace {

std::string cpu_build() {
  switch (cpu::cpu_capability()) {
    case cpu::Capability::kAvx512: return "avx512";
    case cpu::Capability::kAvx2: return "avx2";
    default: return "baseline";
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(diversed_probes, m) { m.def("cpu_build() -> str", &cpu_build); }

}  // namespace diversed
