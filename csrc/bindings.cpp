// Python bindings of the weight arena: module `engine._C`.
//
// The binding is deliberately thin (indices in, tensors out): validation with
// parameter names, module wiring (`p.data = view`) and error messages that teach the fix
// live in the engine/arena/ package, where the names are known.
#include <torch/extension.h>

#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include "arena.h"
#include "sgd_cpu.h"
#ifdef PE_WITH_CUDA
#include "cuda/arena_cuda.h"
#endif

// setup.py and CMakeLists.txt generate this header into the build directory: the CUDA
// archs and the torch version the extension was built for (strings through a header,
// because quoting them through -D flags breaks under ninja and nvcc).
#if __has_include("pe_build_config.h")
#include "pe_build_config.h"
#endif
#ifndef PE_CUDA_ARCHS
#define PE_CUDA_ARCHS ""
#endif
#ifndef PE_TORCH_VERSION
#define PE_TORCH_VERSION ""
#endif

namespace py = pybind11;

namespace {

// ---- exceptions at the binding boundary ------------------------------------------------
//
// Every binding runs inside `guard`: whatever C++ throws under it is caught here and turned
// into a Python exception with PyErr_SetString, then handed to pybind11 as
// error_already_set, which its dispatcher restores first, before (and instead of) any
// registered exception translator. See csrc/errors.h for why (a TORCH_CHECK that crossed
// the default path crashed a CUDA build). Called only inside a catch block.
[[noreturn]] void raise(PyObject* type, const char* what) {
  PyErr_SetString(type, what);
  throw py::error_already_set();
}

[[noreturn]] void raise_as_python() {
  try {
    throw;
  } catch (py::error_already_set&) {
    throw;  // already a Python error (e.g. a cast inside the binding)
  } catch (const py::builtin_exception& e) {
    e.set_error();
    throw py::error_already_set();
  } catch (const c10::IndexError& e) {
    raise(PyExc_IndexError, e.what_without_backtrace());
  } catch (const c10::ValueError& e) {
    raise(PyExc_ValueError, e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    raise(PyExc_TypeError, e.what_without_backtrace());
  } catch (const c10::NotImplementedError& e) {
    raise(PyExc_NotImplementedError, e.what_without_backtrace());
  } catch (const c10::Error& e) {  // an ATen op failing under us (e.g. out of memory)
    raise(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    raise(PyExc_MemoryError, "engine._C: host allocation failed (std::bad_alloc)");
  } catch (const std::exception& e) {  // pe::Error, CUDA runtime errors (csrc/cuda)
    raise(PyExc_RuntimeError, e.what());
  } catch (...) {
    raise(PyExc_RuntimeError, "engine._C: unknown C++ exception");
  }
}

// guard(f): f with the same signature, whose exceptions leave as Python exceptions. One
// overload per kind of callable the module binds: free functions, member functions (const
// or not; `self` becomes the first argument, as pybind11 expects) and captureless lambdas.
template <typename R, typename... A>
auto guard(R (*f)(A...)) {
  return [f](A... a) -> R {
    try {
      return f(std::forward<A>(a)...);
    } catch (...) {
      raise_as_python();
    }
  };
}

template <typename R, typename C, typename... A>
auto guard(R (C::*f)(A...)) {
  return [f](C& self, A... a) -> R {
    try {
      return (self.*f)(std::forward<A>(a)...);
    } catch (...) {
      raise_as_python();
    }
  };
}

template <typename R, typename C, typename... A>
auto guard(R (C::*f)(A...) const) {
  return [f](const C& self, A... a) -> R {
    try {
      return (self.*f)(std::forward<A>(a)...);
    } catch (...) {
      raise_as_python();
    }
  };
}

template <typename F, typename R, typename... A>
auto guard_call(F f, R (F::*)(A...) const) {
  return [f](A... a) -> R {
    try {
      return f(std::forward<A>(a)...);
    } catch (...) {
      raise_as_python();
    }
  };
}

template <typename F, typename = std::enable_if_t<std::is_class_v<F>>>
auto guard(F f) {
  return guard_call(f, &F::operator());
}

std::string cxx_compiler() {
#if defined(__clang__)
  return std::string("clang++ ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("g++ ") + __VERSION__;
#elif defined(_MSC_VER)
  return "msvc " + std::to_string(_MSC_VER);
#else
  return "unknown C++ compiler";
#endif
}

py::list split_archs(const std::string& s) {
  py::list out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ';')) {
    if (!item.empty()) out.append(item);
  }
  return out;
}

py::dict build_info() {
  py::dict d;
  std::string torch_version = PE_TORCH_VERSION;
  if (torch_version.empty()) {
    torch_version = std::to_string(TORCH_VERSION_MAJOR) + "." +
                    std::to_string(TORCH_VERSION_MINOR) + "." +
                    std::to_string(TORCH_VERSION_PATCH);
  }
  d["torch_version"] = torch_version;
#ifdef PE_WITH_CUDA
  const int v = pe::cuda::build_version();
  d["cuda"] = true;
  d["cuda_archs"] = split_archs(PE_CUDA_ARCHS);
  d["cuda_version"] = std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
  d["compiler"] = cxx_compiler() + "; " + pe::cuda::compiler();
#else
  d["cuda"] = false;
  d["cuda_archs"] = py::list();
  d["cuda_version"] = py::none();
  d["compiler"] = cxx_compiler();
#endif
  return d;
}

py::dict l2_to_dict(const pe::L2Result& r) {
  py::dict d;
  d["supported"] = r.supported;
  d["ok"] = r.ok;
  d["bucket"] = r.bucket;
  d["granted_bytes"] = r.granted_bytes;
  d["window_bytes"] = r.window_bytes;
  d["max_persisting_bytes"] = r.max_persisting_bytes;
  d["max_window_bytes"] = r.max_window_bytes;
  d["hit_ratio"] = r.hit_ratio;
  d["reason"] = r.reason;
  return d;
}

// Device-wide persisting-L2 facts and set-aside, for callers that share one set-aside
// between several windows (engine/runtime/setup/l2.py). Without CUDA: supported=False, reason.
py::dict l2_device(int64_t device) {
  py::dict d;
  d["max_persisting_bytes"] = 0;
  d["max_window_bytes"] = 0;
  d["set_aside_bytes"] = 0;
#ifdef PE_WITH_CUDA
  std::size_t persisting = 0;
  std::size_t window = 0;
  pe::cuda::l2_limits(static_cast<int>(device), &persisting, &window);
  d["supported"] = true;
  d["max_persisting_bytes"] = static_cast<int64_t>(persisting);
  d["max_window_bytes"] = static_cast<int64_t>(window);
  d["set_aside_bytes"] = static_cast<int64_t>(pe::cuda::persisting_l2(static_cast<int>(device)));
  d["reason"] = persisting == 0 || window == 0
                    ? "this GPU has no persisting L2 set-aside (needs compute capability 8.0+)"
                    : "";
#else
  (void)device;
  d["supported"] = false;
  d["reason"] =
      "engine._C was built without CUDA; rebuild on a machine with a CUDA torch and nvcc "
      "(see docs/building.md)";
#endif
  return d;
}

py::dict set_persisting_l2(int64_t device, int64_t bytes) {
  py::dict d;
#ifdef PE_WITH_CUDA
  std::size_t granted = 0;
  std::string reason;
  const bool ok = pe::cuda::set_persisting_l2(
      static_cast<int>(device), static_cast<std::size_t>(std::max<int64_t>(0, bytes)), &granted,
      &reason);
  d["ok"] = ok;
  d["granted_bytes"] = static_cast<int64_t>(granted);
  d["reason"] = reason;
#else
  (void)device;
  (void)bytes;
  d["ok"] = false;
  d["granted_bytes"] = 0;
  d["reason"] = "engine._C was built without CUDA";
#endif
  return d;
}

void reset_persisting_l2(int64_t device) {
#ifdef PE_WITH_CUDA
  pe::cuda::reset_persisting_l2(static_cast<int>(device));
#else
  (void)device;
  PE_CHECK(false, "engine._C was built without CUDA: there is no L2 set-aside to reset");
#endif
}

void clear_stream_window(int64_t device, int64_t stream) {
#ifdef PE_WITH_CUDA
  pe::cuda::clear_l2_window(static_cast<int>(device),
                            reinterpret_cast<void*>(static_cast<intptr_t>(stream)));
#else
  (void)device;
  (void)stream;
  PE_CHECK(false, "engine._C was built without CUDA: there is no L2 window to clear");
#endif
}

py::dict stream_window(int64_t device, int64_t stream) {
  py::dict d;
#ifdef PE_WITH_CUDA
  void* base = nullptr;
  std::size_t bytes = 0;
  float ratio = 0.0f;
  pe::cuda::l2_window_of(static_cast<int>(device),
                         reinterpret_cast<void*>(static_cast<intptr_t>(stream)), &base, &bytes,
                         &ratio);
  d["base"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(base));
  d["num_bytes"] = static_cast<int64_t>(bytes);
  d["hit_ratio"] = static_cast<double>(ratio);
#else
  (void)device;
  (void)stream;
  PE_CHECK(false, "engine._C was built without CUDA: streams have no L2 window");
#endif
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() =
      "engine._C: the per-stage flat weight arena (buffers, version slots, L2 persistence). "
      "Use it through engine.arena.";
  m.def("build_info", guard(&build_info),
        "Facts fixed at build time: cuda (bool), cuda_archs (list[str]), cuda_version "
        "(str | None), torch_version (str), compiler (str).");
  m.def("aligned_zeros", guard(&pe::aligned_zeros), py::arg("numel"), py::arg("dtype"),
        py::arg("device"), py::arg("alignment"),
        "Zeros whose first element is aligned to `alignment` bytes (a power of two).");
  m.def("l2_device", guard(&l2_device), py::arg("device"),
        "Persisting-L2 facts of a CUDA device: supported, max_persisting_bytes, "
        "max_window_bytes, set_aside_bytes (now), reason.");
  m.def("set_persisting_l2", guard(&set_persisting_l2), py::arg("device"), py::arg("bytes"),
        "Sets the device-wide persisting-L2 set-aside; returns ok, granted_bytes, reason.");
  m.def("reset_persisting_l2", guard(&reset_persisting_l2), py::arg("device"),
        "Evicts persisting lines and sets the set-aside back to 0.");
  m.def("clear_stream_window", guard(&clear_stream_window), py::arg("device"), py::arg("stream"),
        "Removes the access-policy window from one stream (cudaStream_t as an int).");
  m.def("stream_window", guard(&stream_window), py::arg("device"), py::arg("stream"),
        "The access-policy window on a stream: base, num_bytes, hit_ratio (for checks).");

  m.def("sgd_step_cpu", guard(&pe::sgd_step_cpu), py::arg("param"), py::arg("grad"),
        py::arg("momentum_buffer"), py::arg("predicted"), py::arg("delta"), py::arg("lr"),
        py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"),
        py::arg("maximize"), py::arg("init_momentum"), py::arg("spike"), py::arg("sc_a"),
        py::arg("sc_bd"), py::arg("predict_coeff"), py::arg("delta_gamma"),
        py::arg("grad_scale"),
        "One fused SGD step (spike compensation, prediction, delta) over contiguous fp32 CPU "
        "tensors, in place; use it through engine.optim.cpu_loop. Returns the ISA variant.");
  m.def("sgd_cpu_variant", guard(&pe::sgd_cpu_variant),
        "The ISA variant sgd_step_cpu runs here: 'fma' or 'baseline' (follows torch's CPU "
        "capability, so the loop rounds as torch's kernels do).");

  py::class_<pe::Arena>(m, "Arena")
      .def(py::init(guard([](int64_t alignment) { return std::make_unique<pe::Arena>(alignment); })),
           py::arg("alignment"))
      .def_property_readonly("alignment", guard(&pe::Arena::alignment))
      .def("add_bucket", guard(&pe::Arena::add_bucket), py::arg("tensors"), py::arg("group"),
           py::arg("requires_grad"))
      .def_property_readonly("num_buckets", guard(&pe::Arena::num_buckets))
      .def("bucket_param", guard([](const pe::Arena& a, int64_t b) { return a.bucket(b).param; }))
      .def("bucket_grad", guard([](const pe::Arena& a, int64_t b) -> py::object {
             const auto& bk = a.bucket(b);
             if (!bk.requires_grad) return py::none();
             return py::cast(bk.grad);
           }))
      .def("bucket_offsets", guard([](const pe::Arena& a, int64_t b) { return a.bucket(b).offsets; }))
      .def("bucket_numels", guard([](const pe::Arena& a, int64_t b) { return a.bucket(b).numels; }))
      .def("bucket_numel", guard([](const pe::Arena& a, int64_t b) { return a.bucket(b).numel; }))
      .def("bucket_nbytes", guard([](const pe::Arena& a, int64_t b) { return a.bucket(b).nbytes(); }))
      .def("param_views", guard(&pe::Arena::param_views), py::arg("bucket"))
      .def("grad_views", guard(&pe::Arena::grad_views), py::arg("bucket"))
      .def("snapshot", guard(&pe::Arena::snapshot), py::arg("stream"), py::arg("microbatch"))
      .def("new_slot", guard(&pe::Arena::new_slot), py::arg("stream"), py::arg("microbatch"))
      .def("swap_live", guard(&pe::Arena::swap_live), py::arg("slot"), py::arg("stream"))
      .def("refresh", guard(&pe::Arena::refresh), py::arg("slot"), py::arg("stream"))
      .def("wait", guard(&pe::Arena::wait), py::arg("slot"), py::arg("stream"))
      .def("wait_all", guard(&pe::Arena::wait_all), py::arg("stream"))
      .def("slot_views", guard(&pe::Arena::slot_views), py::arg("slot"), py::arg("bucket"))
      .def("slot_flat", guard(&pe::Arena::slot_flat), py::arg("slot"), py::arg("bucket"))
      .def("restore", guard(&pe::Arena::restore), py::arg("slot"), py::arg("stream"))
      .def("has_slot", guard(&pe::Arena::has_slot), py::arg("slot"))
      .def("was_freed", guard(&pe::Arena::was_freed), py::arg("slot"))
      .def("slot_ids", guard(&pe::Arena::slot_ids))
      .def("pins", guard(&pe::Arena::pins), py::arg("slot"))
      .def("refcount", guard(&pe::Arena::refcount), py::arg("slot"))
      .def("pin", guard(&pe::Arena::pin), py::arg("slot"), py::arg("microbatch"))
      .def("release", guard(&pe::Arena::release), py::arg("slot"), py::arg("microbatch"),
           py::arg("stream"))
      .def("free_slot", guard(&pe::Arena::free_slot), py::arg("slot"), py::arg("stream"))
      .def("hold", guard(&pe::Arena::hold), py::arg("slot"))
      .def("unhold", guard(&pe::Arena::unhold), py::arg("slot"), py::arg("stream"))
      .def("trim_pool", guard(&pe::Arena::trim_pool))
      .def("snapshot_stream", guard(&pe::Arena::snapshot_stream), py::arg("device"))
      .def("trace_start", guard(&pe::Arena::trace_start), py::arg("events_done"))
      .def("trace_take", guard([](pe::Arena& a) {
             // (op, stream, event, producer, dst, src, bytes) per logged operation
             py::list out;
             for (const auto& o : a.trace_take()) {
               out.append(py::make_tuple(o.op, o.stream, o.event, o.producer, o.dst, o.src,
                                         o.bytes));
             }
             return out;
           }))
      .def_property_readonly("live_bytes", guard(&pe::Arena::live_bytes))
      .def_property_readonly("grad_bytes", guard(&pe::Arena::grad_bytes))
      .def_property_readonly("slot_bytes", guard(&pe::Arena::slot_bytes))
      .def_property_readonly("pooled_bytes", guard(&pe::Arena::pooled_bytes))
      .def_property_readonly("peak_bytes", guard(&pe::Arena::peak_bytes))
      .def("per_slot_bytes", guard(&pe::Arena::per_slot_bytes))
      .def(
          "set_l2_persistence",
          guard([](pe::Arena& a, int64_t b, int64_t stream, double hit_ratio, int64_t max_bytes) {
            return l2_to_dict(a.set_l2_persistence(b, stream, hit_ratio, max_bytes));
          }),
          py::arg("bucket"), py::arg("stream"), py::arg("hit_ratio"), py::arg("max_bytes"))
      .def("clear_l2_persistence", guard(&pe::Arena::clear_l2_persistence), py::arg("bucket"),
           py::arg("stream"))
      .def(
          "set_l2_window",
          guard([](pe::Arena& a, int64_t b, int64_t stream, double hit_ratio, int64_t share_bytes) {
            return l2_to_dict(a.set_l2_window(b, stream, hit_ratio, share_bytes));
          }),
          py::arg("bucket"), py::arg("stream"), py::arg("hit_ratio"), py::arg("share_bytes"))
      .def("clear_l2_window", guard(&pe::Arena::clear_l2_window), py::arg("bucket"), py::arg("stream"));
}
