"""One g++ build per compile worker for a graph's C++ kernels, not one build per kernel.

    with merged_cpu_builds():
        compiled = compile_fx_inner(gm, example_inputs)   # (lowering.lower)

# Note [One C++ build per compile worker]
Inductor's C++ backend gives every fused kernel of a graph its own shared library: the
generated module calls ``async_compile.cpp_pybinding(argtypes, source)`` once per kernel, and
each call is one g++ run on one translation unit with Python bindings appended. A run costs about
half a second before its first line of kernel code (most of it loading the precompiled header),
more than most kernels' own lines cost, and dpfx's graphs have dozens of kernels (figures:
BENCHMARKS.md, "Levers in the code").

Under ``merged_cpu_builds`` (dpfx's lowering only), ``cpp_pybinding`` defers: the module's
kernels are collected until the module's ``async_compile.wait``, which starts their builds and
leaves each kernel to be waited for at its first call (Note [A graph's C++ builds run while the
next graph lowers]).
They are then dealt, largest first, into one translation unit per compile worker, and the
units are built in parallel through Inductor's own code cache (``load_async``: the same
compiler, flags, vector ISA and precompiled header it would use for each kernel, and its disk
cache keyed by the unit's text, so a warm start loads them without g++). In a unit, each
kernel's source is put in a namespace of its own (``dpfx_k<i>``) with its ``extern "C"``
dropped, so the kernels' identical ``kernel`` symbols and any file-level helpers stay apart;
the headers they include are included once, at the top (Inductor's flags force its precompiled
prefix header in before either). One binding per kernel (``kernel_<i>``, the same argument
conversion as Inductor's) and one module init are appended. Each kernel is compiled from its
own text, less its ``#include`` lines and its entry's ``extern "C"``, with the same flags: what
it computes does not change, only how many g++ runs there are. A kernel whose source has
any other file-level preprocessor line, or not exactly one ``extern "C" void kernel(``, is
built on its own; so is everything when Inductor compiles in-process (one compile
thread), where the module expects each kernel at once. A unit g++ refuses is rebuilt kernel by
kernel, with a ``MergedBuildFailed`` warning: the same code, only more builds.
(tests/lower/test_inductor.py::test_merged_cpu_builds)
"""
from __future__ import annotations

import contextlib
import re
import warnings
from typing import Any

from dpfx.errors import DPFXWarning

_ENTRY = re.compile(r'^extern\s+"C"\s+void\s+kernel\(', re.MULTILINE)
_DIRECTIVE = re.compile(r"^\s*#\s*(\w+)(.*)$")

_BINDINGS_HEAD = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cstdint>
#include <cstdlib>
#include <cerrno>
#include <stdexcept>

static void* (*dpfx_tensor_data)(PyObject*);

template <typename T> static inline T dpfx_arg(PyObject* args, Py_ssize_t i) {
    static_assert(std::is_pointer_v<T>, "a kernel argument is a pointer or a number");
    return static_cast<T>(dpfx_tensor_data(PyTuple_GET_ITEM(args, i)));
}
template <> inline int64_t dpfx_arg<int64_t>(PyObject* args, Py_ssize_t i) {
    Py_ssize_t v = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, i));
    if (v == -1 && PyErr_Occurred()) throw std::runtime_error("expected an int argument");
    return v;
}
template <> inline uintptr_t dpfx_arg<uintptr_t>(PyObject* args, Py_ssize_t i) {
    void* v = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, i));
    if (v == reinterpret_cast<void*>(-1) && PyErr_Occurred())
        throw std::runtime_error("expected an int argument");
    return reinterpret_cast<uintptr_t>(v);
}
template <> inline float dpfx_arg<float>(PyObject* args, Py_ssize_t i) {
    double v = PyFloat_AsDouble(PyTuple_GET_ITEM(args, i));
    if (v == -1.0 && PyErr_Occurred()) throw std::runtime_error("expected a float argument");
    return static_cast<float>(v);
}
"""

_BINDING = r"""
static PyObject* dpfx_call_{i}(PyObject*, PyObject* args) {{
    try {{
        if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != {n})
            throw std::runtime_error("kernel_{i} takes {n} arguments");
        dpfx_k{i}::kernel({parsed});
        Py_RETURN_NONE;
    }} catch (std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }} catch (...) {{
        PyErr_SetString(PyExc_RuntimeError, "kernel_{i} failed");
        return nullptr;
    }}
}}
"""

_MODULE = r"""
static PyMethodDef dpfx_methods[] = {{
{methods}
    {{nullptr, nullptr, 0, nullptr}}}};

static struct PyModuleDef dpfx_module = {{PyModuleDef_HEAD_INIT, "kernel", nullptr, -1,
                                         dpfx_methods}};

PyMODINIT_FUNC PyInit_kernel(void) {{
    // the address of torch's tensor-to-pointer function, as Inductor's own bindings read it
    const char* text = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    char* end = nullptr;
    errno = 0;
    uintptr_t address = text ? std::strtoull(text, &end, 10) : 0;
    if (!text || errno != 0 || end == text || address == 0) {{
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR is not set");
        return nullptr;
    }}
    dpfx_tensor_data = reinterpret_cast<decltype(dpfx_tensor_data)>(address);
    return PyModule_Create(&dpfx_module);
}}
"""


def split(source: str) -> tuple[list[str], str] | None:
    """(the file-level #include lines, the rest with the entry's ``extern "C"`` dropped), or
    None where the source is not a single plain kernel (Note [One C++ build per compile
    worker])."""
    if len(_ENTRY.findall(source)) != 1:
        return None
    includes, body = [], []
    for line in source.splitlines():
        directive = _DIRECTIVE.match(line)
        if directive and not line.startswith((" ", "\t")):
            if directive.group(1) != "include":
                return None
            includes.append(line.strip())
            continue
        body.append(line)
    return includes, _ENTRY.sub("void kernel(", "\n".join(body))


def unit(kernels: list[tuple[list[str], tuple[list[str], str]]]) -> str:
    """One translation unit of ``kernels`` ((argtypes, split source) each): the kernels'
    includes once, each kernel in its namespace, then a Python module with ``kernel_<i>``."""
    includes = list(dict.fromkeys(line for _, (inc, _) in kernels for line in inc))
    parts = includes[:]
    for i, (_, (_, body)) in enumerate(kernels):
        parts.append(f"namespace dpfx_k{i} {{\n{body}\n}}  // namespace dpfx_k{i}")
    parts.append(_BINDINGS_HEAD)
    for i, (argtypes, _) in enumerate(kernels):
        parsed = ", ".join(f"dpfx_arg<{t.replace('const ', '')}>(args, {n})"
                           for n, t in enumerate(argtypes))
        parts.append(_BINDING.format(i=i, n=len(argtypes), parsed=parsed))
    methods = "\n".join(f'    {{"kernel_{i}", dpfx_call_{i}, METH_VARARGS, ""}},'
                        for i in range(len(kernels)))
    parts.append(_MODULE.format(methods=methods))
    return "\n".join(parts) + "\n"


def deal(sizes: list[int], bins: int) -> list[list[int]]:
    """Indices dealt into at most ``bins`` groups, largest first onto the lightest group; each
    group in index order (a deterministic unit text, so the disk cache finds it again)."""
    groups: list[list[int]] = [[] for _ in range(max(1, min(bins, len(sizes))))]
    load = [0] * len(groups)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        g = min(range(len(groups)), key=lambda g: (load[g], g))
        groups[g].append(i)
        load[g] += sizes[i]
    return [sorted(g) for g in groups if g]


class _Batch:
    """The kernels one generated module asked for, built when the first is waited on."""

    def __init__(self, async_compile):
        self.async_compile = async_compile
        self.kernels: list[tuple[list[str], tuple[list[str], str], str]] = []
        self.loaded: dict[int, Any] | None = None

    def add(self, argtypes, parts, source: str) -> "_Member":
        self.kernels.append((list(argtypes), parts, source))
        return _Member(self, len(self.kernels) - 1)

    def build(self) -> None:
        from torch._inductor.async_compile import get_compile_threads
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        submit = self.async_compile.submit
        self.loaded = {}
        for group in deal([len(k[2]) for k in self.kernels], get_compile_threads()):
            if len(group) == 1:
                argtypes, _, source = self.kernels[group[0]]
                self.loaded[group[0]] = CppPythonBindingsCodeCache.load_pybinding_async(
                    argtypes, source, submit_fn=submit)
                continue
            code = unit([self.kernels[i][:2] for i in group])
            load = CppPythonBindingsCodeCache.load_async(code, "cpu", submit_fn=submit)
            for j, i in enumerate(group):
                self.loaded[i] = self._entry(load, j, i)

    def _entry(self, load, j: int, i: int):
        def entry():
            try:
                return getattr(load(), f"kernel_{j}")
            except Exception as e:      # g++ refused the unit: this kernel alone, as Inductor
                from torch._inductor.codecache import CppPythonBindingsCodeCache

                warnings.warn(f"dpfx built a graph's C++ kernels one by one: their merged "
                              f"unit did not build ({type(e).__name__})", MergedBuildFailed)
                argtypes, _, source = self.kernels[i]
                return CppPythonBindingsCodeCache.load_pybinding(argtypes, source)
        return entry

    def start(self) -> None:
        if self.loaded is None:
            self.build()
            _STARTED.append(self)

    def finish(self) -> None:
        for entry in self.loaded.values():
            entry()

    def result(self, index: int):
        self.start()
        return self.loaded[index]()


class MergedBuildFailed(DPFXWarning, RuntimeWarning):
    """A merged unit did not build; its kernels were built one by one (the same code)."""


def _member_class():
    from torch._inductor.codecache import CodeCacheFuture

    class Member(CodeCacheFuture):
        """One kernel of a batch: what ``async_compile.wait`` resolves into the kernel."""

        def __init__(self, batch: _Batch, index: int):
            self.batch, self.index = batch, index

        def result(self, timeout: float | None = None):
            return self.batch.result(self.index)

    return Member


_Member = None


@contextlib.contextmanager
def merged_cpu_builds():
    """Note [One C++ build per compile worker]."""
    global _Member
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads

    if _Member is None:
        _Member = _member_class()
    original = AsyncCompile.cpp_pybinding

    def cpp_pybinding(self, argtypes, source_code):
        parts = split(source_code) if get_compile_threads() > 1 else None
        if parts is None:
            return original(self, argtypes, source_code)
        batch = self.__dict__.get("_dpfx_batch")
        if batch is None or batch.loaded is not None:
            batch = self.__dict__["_dpfx_batch"] = _Batch(self)
        return batch.add(argtypes, parts, source_code)

    original_wait = AsyncCompile.wait

    def wait(self, scope):
        for name, value in list(scope.items()):
            if isinstance(value, _Member):
                value.batch.start()
                scope[name] = _on_first_call(scope, name, value)
        return original_wait(self, scope)

    AsyncCompile.cpp_pybinding = cpp_pybinding
    AsyncCompile.wait = wait
    try:
        yield
    finally:
        AsyncCompile.cpp_pybinding = original
        AsyncCompile.wait = original_wait


# Note [A graph's C++ builds run while the next graph lowers]
# A generated module waits for its kernels' builds when it is loaded, so g++ would run while
# nothing else does: a model with blocks would wait on five graphs' builds one after another (the
# block's forward, part A and part B, the model's forward and backward), while the lowering of
# the next graph, Python on one core, could run beside them. Under
# ``merged_cpu_builds`` a module's ``async_compile.wait`` therefore starts its units' builds and
# puts a stand-in in each kernel's place, which waits for the kernel at its first call and puts
# it in the module in its own place: the builds run while dpfx rewrites, proves and lowers the
# next graph, and the first call (the self-check, at the latest) waits for what is left. The
# kernels, and what the module calls, are those it would have waited for; a unit g++ refuses
# is rebuilt kernel by kernel at that first call (``MergedBuildFailed``). Builds overlap only
# Python: before anything computes (the self-check's runs, a kernel's first call) every build
# started is waited for (``finish_builds``): torch's kernels run on OpenMP threads, one a core,
# that wait at their barriers by spinning, and g++ would take cores from them mid-kernel. A
# model compiled as one graph gains nothing: its backward's builds, the largest, have no graph
# after them to overlap, and are waited for in its self-check instead of its lowering (figures:
# BENCHMARKS.md, "Levers in the code").
_STARTED: list[_Batch] = []     # batches whose builds started and were not all waited for


def finish_builds() -> None:
    """Wait for every C++ build started and not yet waited for: before the self-check computes
    anything, and at any kernel's first call."""
    while _STARTED:
        _STARTED.pop(0).finish()


def _on_first_call(scope: dict, name: str, member) -> Any:
    def kernel(*args):
        finish_builds()
        loaded = member.result()
        scope[name] = loaded
        return loaded(*args)

    kernel.__name__ = name
    kernel.dpfx_stand_in = True
    return kernel
