// Operator schemas of the `diversed` namespace. Backends register their kernels in csrc/cpu and csrc/cuda.
//
// The Python layer (diversed_ext/verify.py) validates and normalises the arguments before calling these ops:
//   draft_tokens int64 [B, K], draft_probs [B, K, V], target_probs [B, K+1, V] (float32/bfloat16/float16, contiguous),
//   weight float32 [B, K], num_draft int64 [B], greedy bool [B], uniforms float64 [B, K+1] or None,
//   seeds int64 [B], offset, per_row_seed (the row index joins the Philox counter only when seeds are shared).
#include <Python.h>
#include <torch/library.h>

extern "C" {
// Importing diversed_ext._C loads this library and so runs the registrations below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(diversed, m) {
  m.def(
      "verify_probs(Tensor draft_tokens, Tensor draft_probs, Tensor target_probs, Tensor weight, Tensor num_draft, "
      "Tensor greedy, Tensor? uniforms, Tensor seeds, int offset, bool per_row_seed) -> (Tensor, Tensor, Tensor)");
}
