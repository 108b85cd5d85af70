// CUDA-runtime implementation of csrc/cuda/arena_cuda.h: the arenas' snapshot streams that
// take weight copies off the compute stream, their events, and L2 persistence windows.
//
// This file includes no torch header on purpose (see the header): it must compile with a
// bare `nvcc -c -arch=sm_90 arena_cuda.cu`, which is how CI checks it on CPU machines.
#include "arena_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

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

void* stream_create(int device) {
  if (device < 0) throw std::runtime_error("engine._C: negative CUDA device index");
  DeviceGuard guard(device);
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return s;
}

void stream_destroy(int device, void* stream) noexcept {
  if (stream == nullptr) return;
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) {
    (void)cudaGetLastError();
    return;  // the runtime is gone (process exit)
  }
  if (previous != device) (void)cudaSetDevice(device);
  (void)cudaStreamDestroy(static_cast<cudaStream_t>(stream));
  if (previous != device) (void)cudaSetDevice(previous);
  (void)cudaGetLastError();
}

void* copy_async(int device, void* side_stream, void* dst, const void* src, std::size_t bytes,
                 void* producer_stream) {
  DeviceGuard guard(device);
  cudaStream_t side = static_cast<cudaStream_t>(side_stream);
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

void l2_limits(int device, std::size_t* max_persisting, std::size_t* max_window) {
  int persisting = 0;
  int window = 0;
  check(cudaDeviceGetAttribute(&persisting, cudaDevAttrMaxPersistingL2CacheSize, device),
        "cudaDeviceGetAttribute(MaxPersistingL2CacheSize)");
  check(cudaDeviceGetAttribute(&window, cudaDevAttrMaxAccessPolicyWindowSize, device),
        "cudaDeviceGetAttribute(MaxAccessPolicyWindowSize)");
  *max_persisting = static_cast<std::size_t>(std::max(0, persisting));
  *max_window = static_cast<std::size_t>(std::max(0, window));
}

bool set_persisting_l2(int device, std::size_t bytes, std::size_t* granted, std::string* reason) {
  DeviceGuard guard(device);
  cudaError_t err = cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, bytes);
  if (err != cudaSuccess) {
    // MIG slices and MPS clients may refuse the set-aside; that is an answer, not a crash.
    (void)cudaGetLastError();
    *reason = std::string("cudaDeviceSetLimit(PersistingL2CacheSize) refused: ") +
              cudaGetErrorString(err);
    return false;
  }
  check(cudaDeviceGetLimit(granted, cudaLimitPersistingL2CacheSize),
        "cudaDeviceGetLimit(PersistingL2CacheSize)");
  return true;
}

namespace {

// Checks the device can persist anything and that the buffer is not empty; fills the maxima.
bool l2_usable(int device, std::size_t bytes, L2Window* out) {
  l2_limits(device, &out->max_persisting_bytes, &out->max_window_bytes);
  if (out->max_persisting_bytes == 0 || out->max_window_bytes == 0) {
    out->reason = "this GPU has no persisting L2 set-aside (needs compute capability 8.0+)";
    return false;
  }
  if (bytes == 0) {
    out->reason = "the buffer is empty; there is nothing to keep in L2";
    return false;
  }
  return true;
}

// Sets the window with hit_ratio lowered to persisting / window: marking more lines
// persisting than the set-aside (or this window's share of it) holds makes them evict
// each other.
void put_window(void* stream, void* base, std::size_t bytes, float hit_ratio,
                std::size_t persisting, L2Window* out) {
  out->window_bytes = std::min(bytes, out->max_window_bytes);
  float ratio = std::max(0.0f, std::min(1.0f, hit_ratio));
  if (persisting < out->window_bytes) {
    ratio = std::min(ratio, static_cast<float>(persisting) / static_cast<float>(out->window_bytes));
  }
  out->hit_ratio = ratio;
  cudaStreamAttrValue attr = {};
  attr.accessPolicyWindow.base_ptr = base;
  attr.accessPolicyWindow.num_bytes = out->window_bytes;
  attr.accessPolicyWindow.hitRatio = ratio;
  attr.accessPolicyWindow.hitProp = cudaAccessPropertyPersisting;
  attr.accessPolicyWindow.missProp = cudaAccessPropertyStreaming;
  cudaError_t err = cudaStreamSetAttribute(static_cast<cudaStream_t>(stream),
                                           cudaStreamAttributeAccessPolicyWindow, &attr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    out->reason = std::string("cudaStreamSetAttribute(AccessPolicyWindow) refused: ") +
                  cudaGetErrorString(err) +
                  " (run the stage on a non-default stream: torch.cuda.Stream())";
    return;
  }
  out->ok = true;
}

}  // namespace

L2Window set_l2_persistence(int device, void* stream, void* base, std::size_t bytes,
                            float hit_ratio, std::size_t max_bytes) {
  DeviceGuard guard(device);
  L2Window out;
  if (!l2_usable(device, bytes, &out)) return out;
  std::size_t want = std::min(bytes, out.max_persisting_bytes);
  if (max_bytes > 0) want = std::min(want, max_bytes);
  std::size_t granted = 0;
  if (!set_persisting_l2(device, want, &granted, &out.reason)) return out;
  out.granted_bytes = granted;
  put_window(stream, base, bytes, hit_ratio, granted, &out);
  return out;
}

L2Window set_l2_window(int device, void* stream, void* base, std::size_t bytes, float hit_ratio,
                       std::size_t share_bytes) {
  DeviceGuard guard(device);
  L2Window out;
  if (!l2_usable(device, bytes, &out)) return out;
  if (share_bytes == 0) {
    out.reason = "no share of the persisting L2 set-aside was given to this window";
    return out;
  }
  out.granted_bytes = share_bytes;
  put_window(stream, base, bytes, hit_ratio, share_bytes, &out);
  return out;
}

void clear_l2_window(int device, void* stream) {
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
}

void reset_persisting_l2(int device) {
  DeviceGuard guard(device);
  check(cudaCtxResetPersistingL2Cache(), "cudaCtxResetPersistingL2Cache");
  check(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 0),
        "cudaDeviceSetLimit(PersistingL2CacheSize, 0)");
}

std::size_t persisting_l2(int device) {
  DeviceGuard guard(device);
  std::size_t bytes = 0;
  check(cudaDeviceGetLimit(&bytes, cudaLimitPersistingL2CacheSize),
        "cudaDeviceGetLimit(PersistingL2CacheSize)");
  return bytes;
}

void l2_window_of(int device, void* stream, void** base, std::size_t* bytes, float* hit_ratio) {
  DeviceGuard guard(device);
  cudaStreamAttrValue attr = {};
  check(cudaStreamGetAttribute(static_cast<cudaStream_t>(stream),
                               cudaStreamAttributeAccessPolicyWindow, &attr),
        "cudaStreamGetAttribute(AccessPolicyWindow)");
  *base = attr.accessPolicyWindow.base_ptr;
  *bytes = attr.accessPolicyWindow.num_bytes;
  *hit_ratio = attr.accessPolicyWindow.hitRatio;
}

void clear_l2_persistence(int device, void* stream) {
  clear_l2_window(device, stream);
  reset_persisting_l2(device);
}

}  // namespace cuda
}  // namespace pe
