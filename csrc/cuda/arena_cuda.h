// CUDA-runtime half of the weight arena, behind a plain C++ interface.
//
// Why a separate header with void* handles: the torch side (csrc/arena.cpp) must compile
// in the CPU-only build, where there are no CUDA headers at all, and the .cu side must
// compile standalone with `nvcc -c -arch=sm_90` on a machine whose torch has no CUDA
// headers either. So neither side sees the other's headers: streams and events cross this
// boundary as opaque pointers (cudaStream_t / cudaEvent_t are pointers themselves), and
// errors cross it as std::runtime_error carrying cudaGetErrorString's text.
//
// Only compiled (and only included) when PE_WITH_CUDA is defined.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pe {
namespace cuda {

// CUDART_VERSION the .cu file was compiled against (e.g. 13000), and the driver-visible
// runtime version at run time (0 when it cannot be queried).
int build_version();
int runtime_version();
// "nvcc <major>.<minor>" of the compiler that built the .cu file.
std::string compiler();

// A new non-blocking stream on `device` for an arena's snapshot copies (one per arena and
// device, so that unrelated stages' copies never queue behind each other). The owner
// destroys it with stream_destroy.
void* stream_create(int device);
// Releases the stream; work already queued on it still runs (the driver defers the
// release). Safe at process exit, when the runtime may be gone.
void stream_destroy(int device, void* stream) noexcept;

// Copies `bytes` from `src` to `dst` (both device memory on `device`) on `side_stream` (the
// arena's snapshot stream), after all work already enqueued on `producer_stream` (so the
// copy sees every earlier write to the source). Returns an event recorded on the side
// stream after the copy; consumers make their stream wait on it (stream_wait_event) and
// the owner must destroy it (event_destroy) once nothing can still wait on it.
void* copy_async(int device, void* side_stream, void* dst, const void* src, std::size_t bytes,
                 void* producer_stream);

// Records a new event on `stream` (after all work already enqueued there) and returns it;
// the owner must destroy it. The arena records one when a slot's buffers go back to its
// pool, so that their next user waits for the work that still read them.
void* record_event(int device, void* stream);

// Makes `stream` wait (on the device, without blocking the host) for `event`.
void stream_wait_event(int device, void* stream, void* event);
// True when the work before `event` has finished (cudaEventQuery).
bool event_done(int device, void* event);
// Blocks the host until `event` has completed.
void event_sync(int device, void* event);
// Releases the event; safe while it is still pending (the driver defers the release).
void event_destroy(int device, void* event) noexcept;

// Result of asking the device to keep a window of memory resident in L2.
struct L2Window {
  bool ok = false;                     // the window is set on the stream
  std::size_t granted_bytes = 0;       // cudaLimitPersistingL2CacheSize after the request
  std::size_t window_bytes = 0;        // bytes covered by the access-policy window
  std::size_t max_persisting_bytes = 0;  // cudaDevAttrMaxPersistingL2CacheSize
  std::size_t max_window_bytes = 0;    // cudaDevAttrMaxAccessPolicyWindowSize
  float hit_ratio = 0.0f;              // fraction of the window marked persisting
  std::string reason;                  // why not, when ok is false
};

// Reserves up to min(bytes, max_bytes, device maximum) of L2 for persisting accesses
// (a device-wide limit) and sets an access-policy window over [base, base + bytes) on
// `stream`. hit_ratio is lowered to granted/window when the device grants less than the
// window, so persisting lines do not thrash each other. max_bytes == 0 means no cap.
L2Window set_l2_persistence(int device, void* stream, void* base, std::size_t bytes,
                            float hit_ratio, std::size_t max_bytes);
// Removes the window from `stream`, evicts persisting lines and gives the L2 set-aside
// back (limit 0), so other work on the device gets the whole cache again.
void clear_l2_persistence(int device, void* stream);

// The pieces of the two calls above, for a caller that shares one set-aside between
// several windows (the pipeline: one window per stage stream, the set-aside set once).
// Device maxima: cudaDevAttrMaxPersistingL2CacheSize and MaxAccessPolicyWindowSize.
void l2_limits(int device, std::size_t* max_persisting, std::size_t* max_window);
// Sets the device-wide set-aside to `bytes`; returns false (and why) when the device
// refuses (MIG, MPS), else stores what it granted in `granted`.
bool set_persisting_l2(int device, std::size_t bytes, std::size_t* granted, std::string* reason);
// Sets a window over [base, base + bytes) on `stream` without touching the set-aside;
// hit_ratio is lowered to share_bytes / window so that the windows together mark at most
// the sum of their shares persisting. granted_bytes reports share_bytes.
L2Window set_l2_window(int device, void* stream, void* base, std::size_t bytes, float hit_ratio,
                       std::size_t share_bytes);
// Removes the window from `stream` only (other streams keep theirs, the set-aside stays).
void clear_l2_window(int device, void* stream);
// Evicts persisting lines and sets the set-aside back to 0.
void reset_persisting_l2(int device);
// What is in place now, for checks: the device's set-aside and the window on `stream`.
std::size_t persisting_l2(int device);
void l2_window_of(int device, void* stream, void** base, std::size_t* bytes, float* hit_ratio);

}  // namespace cuda
}  // namespace pe
