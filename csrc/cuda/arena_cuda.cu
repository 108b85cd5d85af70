// CUDA-runtime implementation of csrc/cuda/arena_cuda.h: the side stream that takes
// weight snapshots off the compute stream, their events, and L2 persistence windows.
//
// This file includes no torch header on purpose (see the header): it must compile with a
// bare `nvcc -c -arch=sm_90 arena_cuda.cu`, which is how CI checks it on CPU machines.
#include "arena_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace pe {
namespace cuda {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    // Clear the sticky-free error state so later unrelated calls do not report it again.
    (void)cudaGetLastError();
    throw std::runtime_error(std::string("engine._C: ") + what + " failed: " +
                             cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
}

// Runs a block on `device` and restores the caller's current device afterwards, so the
// arena never changes which GPU the rest of the program talks to.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
    changed_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (changed_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// One non-blocking side stream per device, created on first use and kept for the life of
// the process (like torch's stream pools): destroying it at exit would race with driver
// teardown, and one stream per device is all the snapshot traffic needs.
cudaStream_t side_stream(int device) {
  static std::mutex mutex;
  static std::vector<cudaStream_t> streams;
  std::lock_guard<std::mutex> lock(mutex);
  if (device < 0) throw std::runtime_error("engine._C: negative CUDA device index");
  if (static_cast<std::size_t>(device) >= streams.size()) streams.resize(device + 1, nullptr);
  if (streams[device] == nullptr) {
    DeviceGuard guard(device);
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    streams[device] = s;
  }
  return streams[device];
}

}  // namespace

int build_version() { return CUDART_VERSION; }

int runtime_version() {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return v;
}

std::string compiler() {
#if defined(__CUDACC_VER_MAJOR__)
  return "nvcc " + std::to_string(__CUDACC_VER_MAJOR__) + "." +
         std::to_string(__CUDACC_VER_MINOR__);
#else
  return "unknown CUDA compiler";
#endif
}

void* copy_async(int device, void* dst, const void* src, std::size_t bytes,
                 void* producer_stream) {
  DeviceGuard guard(device);
  cudaStream_t side = side_stream(device);
  cudaStream_t producer = static_cast<cudaStream_t>(producer_stream);
  // The side stream must not read the weights before the compute stream has finished
  // writing them: order the copy after everything already enqueued on the producer.
  cudaEvent_t ready = nullptr;
  check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
  cudaEvent_t done = nullptr;
  try {
    check(cudaEventRecord(ready, producer), "cudaEventRecord(producer)");
    check(cudaStreamWaitEvent(side, ready, 0), "cudaStreamWaitEvent(side)");
    if (bytes > 0) {
      check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, side),
            "cudaMemcpyAsync(snapshot)");
    }
    check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    check(cudaEventRecord(done, side), "cudaEventRecord(side)");
  } catch (...) {
    (void)cudaEventDestroy(ready);
    if (done != nullptr) (void)cudaEventDestroy(done);
    throw;
  }
  (void)cudaEventDestroy(ready);  // deferred by the driver until the wait has resolved
  return done;
}

void* record_event(int device, void* stream) {
  DeviceGuard guard(device);
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  cudaError_t err = cudaEventRecord(event, static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) {
    (void)cudaEventDestroy(event);
    check(err, "cudaEventRecord(release)");
  }
  return event;
}

void stream_wait_event(int device, void* stream, void* event) {
  DeviceGuard guard(device);
  check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0),
        "cudaStreamWaitEvent");
}

bool event_done(int device, void* event) {
  DeviceGuard guard(device);
  cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  check(err, "cudaEventQuery");
  return true;
}

void event_sync(int device, void* event) {
  DeviceGuard guard(device);
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(event)), "cudaEventSynchronize");
}

void event_destroy(int device, void* event) noexcept {
  if (event == nullptr) return;
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) {
    (void)cudaGetLastError();
    return;  // the runtime is gone (process exit): nothing left to release
  }
  if (previous != device) (void)cudaSetDevice(device);
  (void)cudaEventDestroy(static_cast<cudaEvent_t>(event));
  if (previous != device) (void)cudaSetDevice(previous);
  (void)cudaGetLastError();
}

L2Window set_l2_persistence(int device, void* stream, void* base, std::size_t bytes,
                            float hit_ratio, std::size_t max_bytes) {
  DeviceGuard guard(device);
  L2Window out;
  int max_persisting = 0;
  int max_window = 0;
  check(cudaDeviceGetAttribute(&max_persisting, cudaDevAttrMaxPersistingL2CacheSize, device),
        "cudaDeviceGetAttribute(MaxPersistingL2CacheSize)");
  check(cudaDeviceGetAttribute(&max_window, cudaDevAttrMaxAccessPolicyWindowSize, device),
        "cudaDeviceGetAttribute(MaxAccessPolicyWindowSize)");
  out.max_persisting_bytes = static_cast<std::size_t>(max_persisting);
  out.max_window_bytes = static_cast<std::size_t>(max_window);
  if (max_persisting <= 0 || max_window <= 0) {
    out.reason = "this GPU has no persisting L2 set-aside (needs compute capability 8.0+)";
    return out;
  }
  if (bytes == 0) {
    out.reason = "the buffer is empty; there is nothing to keep in L2";
    return out;
  }
  std::size_t want = std::min(bytes, out.max_persisting_bytes);
  if (max_bytes > 0) want = std::min(want, max_bytes);
  cudaError_t err = cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, want);
  if (err != cudaSuccess) {
    // MIG slices and MPS clients may refuse the set-aside; that is an answer, not a crash.
    (void)cudaGetLastError();
    out.reason = std::string("cudaDeviceSetLimit(PersistingL2CacheSize) refused: ") +
                 cudaGetErrorString(err);
    return out;
  }
  std::size_t granted = 0;
  check(cudaDeviceGetLimit(&granted, cudaLimitPersistingL2CacheSize),
        "cudaDeviceGetLimit(PersistingL2CacheSize)");
  out.granted_bytes = granted;
  out.window_bytes = std::min(bytes, out.max_window_bytes);
  float ratio = std::max(0.0f, std::min(1.0f, hit_ratio));
  if (granted < out.window_bytes) {
    // Marking more lines persisting than the set-aside holds makes them evict each other.
    ratio = std::min(ratio, static_cast<float>(granted) / static_cast<float>(out.window_bytes));
  }
  out.hit_ratio = ratio;
  cudaStreamAttrValue attr = {};
  attr.accessPolicyWindow.base_ptr = base;
  attr.accessPolicyWindow.num_bytes = out.window_bytes;
  attr.accessPolicyWindow.hitRatio = ratio;
  attr.accessPolicyWindow.hitProp = cudaAccessPropertyPersisting;
  attr.accessPolicyWindow.missProp = cudaAccessPropertyStreaming;
  err = cudaStreamSetAttribute(static_cast<cudaStream_t>(stream),
                               cudaStreamAttributeAccessPolicyWindow, &attr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    out.reason = std::string("cudaStreamSetAttribute(AccessPolicyWindow) refused: ") +
                 cudaGetErrorString(err) +
                 " (run the stage on a non-default stream: torch.cuda.Stream())";
    return out;
  }
  out.ok = true;
  return out;
}

void clear_l2_persistence(int device, void* stream) {
  DeviceGuard guard(device);
  cudaStreamAttrValue attr = {};
  attr.accessPolicyWindow.base_ptr = nullptr;
  attr.accessPolicyWindow.num_bytes = 0;
  attr.accessPolicyWindow.hitRatio = 0.0f;
  attr.accessPolicyWindow.hitProp = cudaAccessPropertyNormal;
  attr.accessPolicyWindow.missProp = cudaAccessPropertyStreaming;
  check(cudaStreamSetAttribute(static_cast<cudaStream_t>(stream),
                               cudaStreamAttributeAccessPolicyWindow, &attr),
        "cudaStreamSetAttribute(clear AccessPolicyWindow)");
  check(cudaCtxResetPersistingL2Cache(), "cudaCtxResetPersistingL2Cache");
  check(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 0),
        "cudaDeviceSetLimit(PersistingL2CacheSize, 0)");
}

}  // namespace cuda
}  // namespace pe
