// Python bindings of the weight arena: module `engine._C`.
//
// The binding is deliberately thin (indices in, tensors out): validation with
// parameter names, module wiring (`p.data = view`) and error messages that teach the fix
// live in the engine/arena/ package, where the names are known.
#include <torch/extension.h>

#include <sstream>
#include <string>

#include "arena.h"
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() =
      "engine._C: the per-stage flat weight arena (buffers, version slots, L2 persistence). "
      "Use it through engine.arena.";
  m.def("build_info", &build_info,
        "Facts fixed at build time: cuda (bool), cuda_archs (list[str]), cuda_version "
        "(str | None), torch_version (str), compiler (str).");
  m.def("aligned_zeros", &pe::aligned_zeros, py::arg("numel"), py::arg("dtype"),
        py::arg("device"), py::arg("alignment"),
        "Zeros whose first element is aligned to `alignment` bytes (a power of two).");

  py::class_<pe::Arena>(m, "Arena")
      .def(py::init<int64_t>(), py::arg("alignment"))
      .def_property_readonly("alignment", &pe::Arena::alignment)
      .def("add_bucket", &pe::Arena::add_bucket, py::arg("tensors"), py::arg("group"),
           py::arg("requires_grad"))
      .def_property_readonly("num_buckets", &pe::Arena::num_buckets)
      .def("bucket_param", [](const pe::Arena& a, int64_t b) { return a.bucket(b).param; })
      .def("bucket_grad",
           [](const pe::Arena& a, int64_t b) -> py::object {
             const auto& bk = a.bucket(b);
             if (!bk.requires_grad) return py::none();
             return py::cast(bk.grad);
           })
      .def("bucket_offsets", [](const pe::Arena& a, int64_t b) { return a.bucket(b).offsets; })
      .def("bucket_numels", [](const pe::Arena& a, int64_t b) { return a.bucket(b).numels; })
      .def("bucket_numel", [](const pe::Arena& a, int64_t b) { return a.bucket(b).numel; })
      .def("bucket_nbytes", [](const pe::Arena& a, int64_t b) { return a.bucket(b).nbytes(); })
      .def("param_views", &pe::Arena::param_views, py::arg("bucket"))
      .def("grad_views", &pe::Arena::grad_views, py::arg("bucket"))
      .def("snapshot", &pe::Arena::snapshot, py::arg("stream"), py::arg("microbatch"))
      .def("new_slot", &pe::Arena::new_slot, py::arg("stream"), py::arg("microbatch"))
      .def("swap_live", &pe::Arena::swap_live, py::arg("slot"), py::arg("stream"))
      .def("refresh", &pe::Arena::refresh, py::arg("slot"), py::arg("stream"))
      .def("wait", &pe::Arena::wait, py::arg("slot"), py::arg("stream"))
      .def("wait_all", &pe::Arena::wait_all, py::arg("stream"))
      .def("slot_views", &pe::Arena::slot_views, py::arg("slot"), py::arg("bucket"))
      .def("slot_flat", &pe::Arena::slot_flat, py::arg("slot"), py::arg("bucket"))
      .def("restore", &pe::Arena::restore, py::arg("slot"), py::arg("stream"))
      .def("has_slot", &pe::Arena::has_slot, py::arg("slot"))
      .def("was_freed", &pe::Arena::was_freed, py::arg("slot"))
      .def("slot_ids", &pe::Arena::slot_ids)
      .def("pins", &pe::Arena::pins, py::arg("slot"))
      .def("refcount", &pe::Arena::refcount, py::arg("slot"))
      .def("pin", &pe::Arena::pin, py::arg("slot"), py::arg("microbatch"))
      .def("release", &pe::Arena::release, py::arg("slot"), py::arg("microbatch"),
           py::arg("stream"))
      .def("free_slot", &pe::Arena::free_slot, py::arg("slot"), py::arg("stream"))
      .def("hold", &pe::Arena::hold, py::arg("slot"))
      .def("unhold", &pe::Arena::unhold, py::arg("slot"), py::arg("stream"))
      .def("trim_pool", &pe::Arena::trim_pool)
      .def_property_readonly("live_bytes", &pe::Arena::live_bytes)
      .def_property_readonly("grad_bytes", &pe::Arena::grad_bytes)
      .def_property_readonly("slot_bytes", &pe::Arena::slot_bytes)
      .def_property_readonly("pooled_bytes", &pe::Arena::pooled_bytes)
      .def_property_readonly("peak_bytes", &pe::Arena::peak_bytes)
      .def("per_slot_bytes", &pe::Arena::per_slot_bytes)
      .def(
          "set_l2_persistence",
          [](pe::Arena& a, int64_t b, int64_t stream, double hit_ratio, int64_t max_bytes) {
            return l2_to_dict(a.set_l2_persistence(b, stream, hit_ratio, max_bytes));
          },
          py::arg("bucket"), py::arg("stream"), py::arg("hit_ratio"), py::arg("max_bytes"))
      .def("clear_l2_persistence", &pe::Arena::clear_l2_persistence, py::arg("bucket"),
           py::arg("stream"));
}
