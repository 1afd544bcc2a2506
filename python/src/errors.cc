// Exception classes and the StatusError translator (see errors.h).
#include "errors.h"

#include <Python.h>

#include <array>
#include <cstddef>

namespace pmsnap::python {
namespace {

namespace py = pybind11;

// Indexed by StatusCode. Created once at import and kept for the process's
// life (the module holds references too), so the translator never imports.
std::array<PyObject*, static_cast<std::size_t>(StatusCode::kInternal) + 1> g_classes{};
PyObject* g_base = nullptr;

PyObject* MakeClass(py::module_& module, const char* name, const char* doc, PyObject* bases) {
  const std::string qualified = std::string("pmsnap.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  if (cls == nullptr) throw py::error_already_set();
  module.attr(name) = py::reinterpret_borrow<py::object>(cls);
  return cls;
}

PyObject* Subclass(py::module_& module, const char* name, const char* doc,
                   PyObject* extra_base = nullptr) {
  // Typed per arity in pybind11 3, so no conditional expression.
  py::tuple bases;
  if (extra_base == nullptr) {
    bases = py::make_tuple(py::handle(g_base));
  } else {
    bases = py::make_tuple(py::handle(g_base), py::handle(extra_base));
  }
  return MakeClass(module, name, doc, bases.ptr());
}

void SetClass(StatusCode code, PyObject* cls) { g_classes[static_cast<std::size_t>(code)] = cls; }

}  // namespace

void RegisterErrors(py::module_& module) {
  g_base = MakeClass(module, "Error",
                     "Base of every pmsnap error; .code names the runtime's status code.",
                     PyExc_RuntimeError);
  SetClass(StatusCode::kInvalidArgument,
           Subclass(module, "InvalidArgumentError", "An argument that can never work.",
                    PyExc_ValueError));
  SetClass(
      StatusCode::kModelMismatch,
      Subclass(module, "ModelMismatchError",
               "The pool was made for other units (names, dtypes or shapes).", PyExc_ValueError));
  SetClass(
      StatusCode::kNoSpace,
      Subclass(module, "NoSpaceError", "The file system or the pool is too small.", PyExc_OSError));
  SetClass(StatusCode::kNotFound,
           Subclass(module, "NotFoundError", "A pool, unit or committed epoch does not exist.",
                    PyExc_FileNotFoundError));
  SetClass(StatusCode::kNotAPool,
           Subclass(module, "NotAPoolError", "The file exists but is not a pmsnap pool."));
  SetClass(StatusCode::kUnsupportedVersion,
           Subclass(module, "UnsupportedVersionError", "The pool's format version is unknown."));
  SetClass(StatusCode::kCorruption, Subclass(module, "CorruptionError",
                                             "Persisted bytes fail their checksums (data loss)."));
  SetClass(StatusCode::kCapacityExceeded,
           Subclass(module, "CapacityExceededError",
                    "A configured bound was exceeded (e.g. the extra-state capacity)."));
  SetClass(StatusCode::kIOError,
           Subclass(module, "StorageIOError", "The OS or PMDK failed an operation."));
  SetClass(StatusCode::kBusy,
           Subclass(module, "BusyError", "The pool is open elsewhere or an epoch is in flight."));
  SetClass(StatusCode::kFailedPrecondition, Subclass(module, "FailedPreconditionError",
                                                     "Called in a state that does not allow it."));
  SetClass(StatusCode::kAborted, Subclass(module, "AbortedError", "Work was abandoned."));
  SetClass(StatusCode::kInternal, Subclass(module, "InternalError", "A bug in pmsnap."));

  py::register_exception_translator([](std::exception_ptr pointer) {
    try {
      if (pointer) std::rethrow_exception(pointer);
    } catch (const StatusError& e) {
      const auto index = static_cast<std::size_t>(e.status().code());
      PyObject* cls =
          index < g_classes.size() && g_classes[index] != nullptr ? g_classes[index] : g_base;
      PyObject* instance = PyObject_CallFunction(cls, "s", e.status().message().c_str());
      if (instance == nullptr) return;  // the constructor's own error is set
      PyObject* code = PyUnicode_FromString(StatusCodeName(e.status().code()));
      if (code != nullptr) {
        PyObject_SetAttrString(instance, "code", code);
        Py_DECREF(code);
      }
      PyErr_SetObject(cls, instance);
      Py_DECREF(instance);
    }
  });
}

}  // namespace pmsnap::python
