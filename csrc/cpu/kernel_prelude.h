// Everything the verify kernels take from outside their own headers, and the torch-free types they share with their
// binding (ops_cpu.cpp): the CPU floors' shared base (../cpu_base/kernel_base.h: standard headers, intrinsics,
// ParallelFor), the verify math shared with CUDA, and the element types and flags of the verify and stats ops.
//
// The kernels are compiled once per instruction set (kernels_baseline.cpp, kernels_avx2.cpp, kernels_avx512.cpp), and
// the AVX2 and AVX-512 builds must include every outside header BEFORE their target pragma (kernel_base.h says why).
// So the kernel headers include this file and nothing else from outside; a header they need goes here.
#pragma once

#include <cstdint>

#include "../cpu_base/kernel_base.h"  // first: its diagnostic setting must precede the vector templates of ../common
#include "../common/problems.h"
#include "../common/features_math.h"
#include "../common/verify_math.h"

namespace diversed {
namespace cpu {

// The 16-bit element types the kernels are written over: the bits of torch's Half and BFloat16, without torch.
struct HalfBits {
  uint16_t bits;
};
struct BFloat16Bits {
  uint16_t bits;
};

// The flags value_flags (check_kernels.h) sets for a row; diversed_ext/ops/_values.py reads the same bits.
constexpr int32_t kValueFlagNan = 1;
constexpr int32_t kValueFlagNegative = 2;
constexpr int32_t kValueFlagPositiveInfinity = 4;
constexpr int32_t kValueFlagNoMass = 8;
constexpr int32_t kValueFlagNoTargetMass = 16;  // probabilities: nothing at or above kMinTargetMass

}  // namespace cpu
}  // namespace diversed
