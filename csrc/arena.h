// The per-stage weight arena: flat, aligned buffers that own a stage's parameters,
// gradients and weight versions.
//
// Why flat buffers: an optimizer step over a stage becomes one kernel launch per buffer
// instead of one per tensor, snapshots of the weights (weight stashing, PipeDream-2BW's
// shadow copy, predicted weights) become one memcpy, and the whole live buffer can be
// pinned in L2 with a single access-policy window. The Python layer (engine/arena/)
// validates input and re-points the modules' parameters at views of these buffers.
//
// Layout: parameters are grouped into buckets (one per device, dtype, param group and
// requires_grad). Inside a bucket every tensor starts at a multiple of `alignment` bytes
// (a power of two, 256 by default: full 128-byte cache lines / vector loads for every
// tensor, and what cudaMalloc itself guarantees). Padding is zero and nothing writes it,
// so elementwise optimizer kernels may sweep the whole buffer including the gaps.
//
// Weight versions are slots: one flat buffer per bucket, same layout as live. A freed
// slot's buffers go to a per-arena pool and serve the next slot (every slot has the
// buckets' layout, so any pooled set fits): in steady state a micro-batch's snapshot
// allocates nothing, and on CPU touches no fresh pages. `trim_pool` gives them back.
// Since a set is allocated only when the pool is empty, live + grad + slots + pooled never
// exceeds the peak of live + grad + slots, which is what peak_bytes keeps reporting.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "errors.h"

namespace pe {

// Allocates `numel` zeros of `dtype` on `device` whose first element sits at an address
// that is a multiple of `alignment` bytes. torch's CPU allocator only promises 64 bytes,
// so the storage is over-allocated by one alignment and the result is a narrowed view.
at::Tensor aligned_zeros(int64_t numel, at::ScalarType dtype, at::Device device,
                         int64_t alignment);
// Same, uninitialised: for buffers that are overwritten whole right away (slots). On CUDA
// this launches no fill kernel, so nothing can race with the side-stream copy into it.
at::Tensor aligned_empty(int64_t numel, at::ScalarType dtype, at::Device device,
                         int64_t alignment);

struct Bucket {
  at::Device device{at::kCPU};
  at::ScalarType dtype = at::kFloat;
  int64_t group = 0;
  bool requires_grad = true;
  at::Tensor param;  // flat live weights, numel() includes padding
  at::Tensor grad;   // flat gradients (same layout) or undefined when !requires_grad
  std::vector<int64_t> offsets;  // element offset of each tensor
  std::vector<int64_t> numels;
  std::vector<std::vector<int64_t>> shapes;
  int64_t numel = 0;  // padded total
  int64_t nbytes() const { return numel * static_cast<int64_t>(c10::elementSize(dtype)); }
};

// A weight version: one flat buffer per bucket, with the buckets' layout.
struct Slot {
  std::vector<at::Tensor> flats;  // one per bucket
  std::vector<void*> events;      // copy-done event per evented bucket (nullptr: none pending)
  std::map<int64_t, int64_t> pins;  // micro-batch id -> pin count
  int64_t holders = 0;            // double buffers holding the slot (hold/unhold)
  int64_t nbytes = 0;
};

// The buffers of a freed slot, waiting in the pool for the next slot.
//
// Why events and not a host wait: a release must not block the host (it happens once per
// micro-batch). The set keeps the events of what may still touch its buffers; the pool
// queries them when it hands the set out and only makes the new user's stream wait (on the
// device) for those not yet done.
struct PooledSet {
  std::vector<at::Tensor> flats;  // one per bucket; contents: whatever the slot last held
  // CUDA: event per bucket recorded on the releasing stream when the slot was freed (work
  // queued before the release may still read the buffers).
  std::vector<void*> released;
  // CUDA: the slot's snapshot-copy event per bucket, when the copy was still pending at the
  // release (it writes these buffers and reads live; nullptr: none pending).
  std::vector<void*> copies;
};

// One stream/event operation of a traced arena (Arena::trace_start), as a CPU test sees it.
//
// Why: the arena's CUDA ordering (which stream waits for which event, when an event is
// queried, synced or destroyed) decides whether a snapshot, a pooled slot or a writer of
// live races, and a race shows only now and then on a GPU. A traced arena runs the very
// same ordering code on CPU buckets, with this log in place of the CUDA runtime calls
// (copies happen at once), so a CPU test can replay it on a model of the device
// (engine/testing/arena_twin.py) and check every access is ordered after the ones it needs.
struct TraceOp {
  std::string op;        // create (a snapshot stream), copy, record, wait, query, sync, destroy
  int64_t stream = 0;    // the stream it is issued on (create, copy: the snapshot stream)
  int64_t event = 0;     // the event it records, waits on, queries, syncs or destroys
  int64_t producer = 0;  // copy: the stream whose queued work it waits for; query: 1 if done
  int64_t dst = 0;       // copy: destination address
  int64_t src = 0;       // copy: source address
  int64_t bytes = 0;     // copy: length
};

struct Trace {
  bool events_done = false;  // what queries answer (a synced event is always done)
  int64_t next_event = 1;
  std::set<int64_t> synced;
  std::vector<TraceOp> ops;
};

struct L2Result {
  bool supported = false;
  bool ok = false;
  int64_t bucket = -1;
  int64_t granted_bytes = 0;
  int64_t window_bytes = 0;
  int64_t max_persisting_bytes = 0;
  int64_t max_window_bytes = 0;
  double hit_ratio = 0.0;
  std::string reason;
};

class Arena {
 public:
  explicit Arena(int64_t alignment);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  int64_t alignment() const { return alignment_; }

  // Copies `tensors` (all of one device and dtype; validated by the caller and checked
  // again here) into a new bucket and returns its index.
  int64_t add_bucket(const std::vector<at::Tensor>& tensors, int64_t group, bool requires_grad);
  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }
  const Bucket& bucket(int64_t b) const;
  std::vector<at::Tensor> param_views(int64_t b) const;
  std::vector<at::Tensor> grad_views(int64_t b) const;

  // --- weight versions -------------------------------------------------------------
  // `stream` is the caller's current CUDA stream (cudaStream_t as an integer; 0 is the
  // default stream); ignored for CPU buckets and in CPU-only builds.
  int64_t snapshot(int64_t stream, std::optional<int64_t> microbatch);
  // A slot whose contents are unspecified (a pooled set as its last slot left it, or fresh
  // memory zeroed once on allocation so that the padding is zero): no copy, no fill. For
  // callers that overwrite it whole. On CUDA, `stream` waits for the pooled set's release.
  int64_t new_slot(int64_t stream, std::optional<int64_t> microbatch);
  // Exchanges every bucket's live buffer with the slot's buffer (tensor handles only; no
  // byte moves). On CUDA `stream` first waits for every pending snapshot copy (the one into
  // this slot, whose buffer becomes live, and those still reading the old live buffer,
  // which becomes the slot's); the slot's copy events are then dropped. Pins stay with
  // the slot id, gradients are untouched. Callers re-point their views of live.
  void swap_live(int64_t slot, int64_t stream);
  void refresh(int64_t slot, int64_t stream);  // copy live into an existing slot
  void wait(int64_t slot, int64_t stream);     // make `stream` wait for the slot's copy
  void wait_all(int64_t stream);               // ... for every pending copy (before writing live)
  std::vector<at::Tensor> slot_views(int64_t slot, int64_t b) const;
  at::Tensor slot_flat(int64_t slot, int64_t b) const;
  void restore(int64_t slot, int64_t stream);  // copy the slot back into live
  bool has_slot(int64_t slot) const { return slots_.count(slot) != 0; }
  bool was_freed(int64_t slot) const { return slot >= 0 && slot < next_slot_ && !has_slot(slot); }
  std::vector<int64_t> slot_ids() const;
  std::map<int64_t, int64_t> pins(int64_t slot) const;
  int64_t refcount(int64_t slot) const;
  void pin(int64_t slot, int64_t microbatch);
  // Drops one pin; frees the slot (into the pool) when no pin and no holder is left.
  // Returns whether it was freed. `stream`: the caller's stream, on which a CUDA release
  // event is recorded (see PooledSet).
  bool release(int64_t slot, int64_t microbatch, int64_t stream);
  void free_slot(int64_t slot, int64_t stream);  // frees a slot that is neither pinned nor held
  // A double buffer's claim on its back slot: a held slot survives its last release, and
  // free_slot refuses it. unhold frees it when no pin is left; returns whether it did.
  void hold(int64_t slot);
  bool unhold(int64_t slot, int64_t stream);
  // Drops every pooled set (after host-waiting for their CUDA release and copy events);
  // returns the bytes given back to torch's allocator.
  int64_t trim_pool();
  // The arena's snapshot stream on `device` (cudaStream_t as an integer), 0 before the
  // first CUDA snapshot there and in CPU-only builds. Each arena has its own.
  int64_t snapshot_stream(int64_t device) const;

  // --- CPU twin of the CUDA ordering (see TraceOp) ---------------------------------------
  // From now on every bucket takes the CUDA path's stream/event logic, logged instead of
  // issued; queries answer `events_done` (a synced event is done). Only for arenas whose
  // buckets are all on the CPU, before the first snapshot.
  void trace_start(bool events_done);
  std::vector<TraceOp> trace_take();  // the operations logged since the last call

  // --- accounting ---------------------------------------------------------------------
  int64_t live_bytes() const { return live_bytes_; }
  int64_t grad_bytes() const { return grad_bytes_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  int64_t pooled_bytes() const { return pooled_bytes_; }  // not part of slot_bytes or peak
  int64_t peak_bytes() const { return peak_bytes_; }  // max of live + grad + slots
  std::map<int64_t, int64_t> per_slot_bytes() const;

  // --- L2 persistence (CUDA) -----------------------------------------------------------
  L2Result set_l2_persistence(int64_t b, int64_t stream, double hit_ratio, int64_t max_bytes);
  void clear_l2_persistence(int64_t b, int64_t stream);
  // A window over bucket b's live buffer on `stream` only, marking at most `share_bytes`
  // persisting; the device-wide set-aside is left to the caller (several windows share it).
  L2Result set_l2_window(int64_t b, int64_t stream, double hit_ratio, int64_t share_bytes);
  void clear_l2_window(int64_t b, int64_t stream);  // this stream's window only

 private:
  Slot& slot_ref(int64_t slot);
  const Slot& slot_ref(int64_t slot) const;
  void copy_into_slot(Slot& s, int64_t stream);
  void settle(Slot& s);  // host-wait for pending copies and drop their events
  void settle_released(PooledSet& set);  // host-wait for its release and copy events
  void* side_stream(int device);  // this arena's snapshot stream, created on first use
  // The stream/event seam: CUDA runtime calls (csrc/cuda/arena_cuda.h), or the trace.
  // Evented buckets (CUDA ones, or all of a traced arena) keep events; others never do.
  bool evented(size_t b) const;
  int dev_of(size_t b) const;
  void* dev_copy(size_t b, at::Tensor& dst, int64_t producer);  // live -> dst; done event
  void* dev_record(size_t b, int64_t stream);
  void dev_wait(size_t b, int64_t stream, void* event);
  bool dev_done(size_t b, void* event);
  void dev_sync(size_t b, void* event);
  void dev_destroy(size_t b, void* event) noexcept;
  // Buffers for a new slot (pooled, else allocated); `copies` receives the slot's initial
  // copy events (a pooled set's snapshot copy still pending, else nullptr).
  std::vector<at::Tensor> take_buffers(int64_t stream, bool zero_fresh,
                                       std::vector<void*>& copies);
  int64_t add_slot(Slot&& s, std::optional<int64_t> microbatch);
  void erase_slot(int64_t slot, int64_t stream);  // settles, then pools its buffers
  void track_peak();

  int64_t alignment_;
  std::vector<Bucket> buckets_;
  std::map<int64_t, Slot> slots_;
  std::vector<PooledSet> pool_;  // LIFO: the most recently freed set is reused first
  // Snapshot stream per CUDA device index (nullptr until first used there). Per arena, not
  // per process: a shared one would queue every stage's copies behind each other's.
  std::vector<void*> side_streams_;
  std::unique_ptr<Trace> trace_;  // set by trace_start: log instead of CUDA calls
  int64_t next_slot_ = 0;
  int64_t set_bytes_ = 0;  // bytes of one slot: the sum of the buckets' nbytes
  int64_t live_bytes_ = 0;
  int64_t grad_bytes_ = 0;
  int64_t slot_bytes_ = 0;
  int64_t pooled_bytes_ = 0;
  int64_t peak_bytes_ = 0;
};

}  // namespace pe
