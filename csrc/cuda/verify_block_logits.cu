// The launchers of the block kernels for logits, for every type pair (verify_instances.cuh).
#include "verify_instances.cuh"

namespace diversed {
namespace gpu {

#define DX_INSTANTIATE(TD, TT) DX_BLOCK_LOGITS_INSTANCE(, TD, TT)
DX_VERIFY_TYPE_PAIRS(DX_INSTANTIATE)
#undef DX_INSTANTIATE

}  // namespace gpu
}  // namespace diversed
