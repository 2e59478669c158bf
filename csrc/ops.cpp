// Schemas of the verify and stats ops of the `diversed` namespace, and the module init that lets Python import the
// library. Each backend registers the six public kernels in one file: csrc/cpu/ops_cpu.cpp and csrc/cuda/ops_cuda.cu
// (the CPU-only ops below are registered by the CPU file alone); the fake (meta) kernels are registered from Python
// (diversed_ext/ops/_fake.py). The lean forward's ops (products and Llama layers) are a floor of their own, with their
// schemas in a fragment of this library (csrc/forward/ops_forward.cpp), left out of a verify-only build
// (DIVERSED_FORWARD=0, setup.py).
//
// The Python layer (diversed_ext/ops/api.py) validates and normalises the arguments before calling these ops:
//   draft_tokens int64 [B, K], draft_probs [B, K, V], target_probs [B, K+1, V] (float32/bfloat16/float16, contiguous;
//   the draft's dtype may differ from the target's, each read as it lies: csrc/common/op_checks.h, is_verify_dtype),
//   weight float32 [B, K], num_draft int64 [B], greedy bool [B], uniforms float64 [B, K+1], seeds int64 [B],
//   offset, per_row_seed (the row index joins the Philox counter only when seeds are shared).
// draft_probs / draft_logits may be None: the drafter gave tokens only, and q is one-hot at each drafted token (B, K
// and V then come from the target). Every other optional tensor may be None, so that a call with default arguments
// creates no tensor before the op: weight is then weight_value everywhere, num_draft K, greedy false, temperature
// temperature_value; without seeds the shared `seed` is used, and without it (and without uniforms) a seed is drawn
// on the device from its default generator.
// Rows read in place: with target_rows (int64 [B, K+1]) the target is a row tensor [R, V] and position i of request b
// reads row target_rows[b, i] (B and K then come from draft_tokens); draft_rows (int64 [B, K]) does the same for the
// draft [Rd, V], and needs a draft tensor. Indices outside [0, R) are clamped into it (problems.h: indexed_row).
// FLy (csrc/common/fly_math.h): fly_window (int64 [B]) or fly_window_value, 0 switching it off for a request;
// fly_threshold (float32 [B]) or fly_threshold_value; fly_top_k in [1, 32]. Windows are clamped into [0, K - 1].
// Logits: target_temperature (float32 [B]) or target_temperature_value divides the target logits in place of the
// temperature (which still divides the draft logits and marks greedy rows); both absent: the temperature.
#include <Python.h>
#include <torch/library.h>

#include "common/kernel_family.h"

namespace diversed {
std::atomic<int> cuda_kernel_family{kAutoKernels};
}  // namespace diversed

namespace {

// _C.set_cuda_kernel_family(family: int): diversed_ext.set_cuda_kernels checks the name and passes its number.
PyObject* set_cuda_kernel_family(PyObject*, PyObject* family) {
  const long value = PyLong_AsLong(family);
  if (value == -1 && PyErr_Occurred()) return nullptr;
  if (value != diversed::kBlockKernels && value != diversed::kSplitKernels && value != diversed::kAutoKernels) {
    PyErr_Format(PyExc_ValueError, "unknown CUDA kernel family %ld", value);
    return nullptr;
  }
  diversed::cuda_kernel_family.store(static_cast<int>(value), std::memory_order_relaxed);
  Py_RETURN_NONE;
}

PyObject* get_cuda_kernel_family(PyObject*, PyObject*) {
  return PyLong_FromLong(diversed::cuda_kernel_family.load(std::memory_order_relaxed));
}

PyMethodDef module_methods[] = {
    {"set_cuda_kernel_family", set_cuda_kernel_family, METH_O,
     "Sets the CUDA verify kernels (0 block, 1 split, 2 auto)."},
    {"cuda_kernel_family", get_cuda_kernel_family, METH_NOARGS, "The CUDA verify kernels (0 block, 1 split, 2 auto)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" {
// Importing diversed_ext._C loads this library and so runs the registrations below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, module_methods};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(diversed, m) {
  m.def(
      "verify_probs(Tensor draft_tokens, Tensor? draft_probs, Tensor target_probs, Tensor? weight, Tensor? num_draft, "
      "Tensor? greedy, Tensor? uniforms, Tensor? seeds, int offset=0, bool per_row_seed=False, float weight_value=1., "
      "int? seed=None, Tensor? target_rows=None, Tensor? draft_rows=None, "
      "Tensor? fly_window=None, Tensor? fly_threshold=None, int fly_window_value=0, float fly_threshold_value=0.3, "
      "int fly_top_k=3) -> (Tensor, Tensor, Tensor)");
  // Logits path: temperature float32 [B] (0 marks a greedy row), target_logits [B, K+1, V].
  m.def(
      "verify_logits(Tensor draft_tokens, Tensor? draft_logits, Tensor target_logits, Tensor? weight, "
      "Tensor? num_draft, Tensor? temperature, Tensor? uniforms, Tensor? seeds, int offset=0, bool per_row_seed=False, "
      "float weight_value=1., float temperature_value=1., int? seed=None, Tensor? target_rows=None, "
      "Tensor? draft_rows=None, Tensor? target_temperature=None, float? target_temperature_value=None, "
      "Tensor? fly_window=None, Tensor? fly_threshold=None, int fly_window_value=0, float fly_threshold_value=0.3, "
      "int fly_top_k=3) -> (Tensor, Tensor, Tensor)");
  // Per position of [B, T, V] pairs: (p(y), q(y), TV(p, q), log p(y), log q(y)), each float32 [B, T].
  m.def(
      "token_stats(Tensor draft, Tensor target, Tensor tokens, Tensor temperature, bool from_logits) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // nu = w p + (1 - w) q as float32 [B, K, V]; target [B, K or more, V].
  m.def("mix(Tensor draft, Tensor target, Tensor weight, Tensor temperature, bool from_logits) -> Tensor");
  // KL(nu_w || p) with log p floored at log_floor, at the weights w = g / (grid_points - 1), g = 0 .. grid_points - 1,
  // as float32 [B, T, grid_points]; draft and target logits [B, T, V], temperature float32 [B]. CPU only.
  m.def(
      "mixture_divergence(Tensor draft, Tensor target, Tensor temperature, int grid_points, float log_floor) "
      "-> Tensor");
  // What a DIVERSED head reads of pairs of logit rows, as float32 [B, T, 5]: the entropies of q and p over log V,
  // their largest probabilities and TV(p, q) (csrc/common/features_math.h). draft and target [B, T, V], or [R, V] read
  // through target_rows / draft_rows int64 [B, T]; temperature float32 [B], and target_temperature float32 [B] for
  // target rows at a temperature of their own.
  m.def(
      "distribution_features(Tensor draft, Tensor target, Tensor temperature, Tensor? target_rows=None, "
      "Tensor? draft_rows=None, Tensor? target_temperature=None) -> Tensor");
  // What the log-probability gate compares for each drafted token x, as float32 [B, T] each: log p(x) and the
  // expected log p of a rejection's residual sample, +inf without residual (csrc/common/gate_math.h). draft_tokens
  // int64 [B, T]; target logits and draft logits (or, with draft_probs, probabilities) as distribution_features reads
  // them, or no draft (q one-hot at x).
  m.def(
      "gate_statistics(Tensor draft_tokens, Tensor? draft, Tensor target, Tensor temperature, "
      "Tensor? target_rows=None, Tensor? draft_rows=None, Tensor? target_temperature=None, bool draft_probs=False) "
      "-> (Tensor, Tensor)");
  // CPU only: what check_inputs=True needs of values [..., V] (probabilities, or logits with from_logits), in one
  // pass: int32 [...] flags per row, or-ed bits: 1 a NaN, 2 a negative entry, 4 a +inf entry, 8 no positive
  // probability (logits: no entry above -inf).
  m.def("value_flags(Tensor values, bool from_logits) -> Tensor");
  // CPU only: the uniforms the kernels draw, float64 [B, num_positions], for seeds and offsets int64 [B] (row b's row
  // key is b, or 0 with per_row_seed), as verify_math.h's philox_uniform computes them.
  m.def("philox_uniforms(Tensor seeds, Tensor offsets, int num_positions, bool per_row_seed) -> Tensor");
}
