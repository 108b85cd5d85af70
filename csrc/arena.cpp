// Implementation of csrc/arena.h. See that header for why the arena exists.
//
// CUDA specifics (side-stream snapshots, events, L2 windows) go through
// csrc/cuda/arena_cuda.h, compiled only when PE_WITH_CUDA is defined; without it the
// same operations fall back to stream-ordered torch copies, which are correct on any
// device, just not overlapped with compute.
#include "arena.h"

#include <algorithm>
#include <string>

#ifdef PE_WITH_CUDA
#include "cuda/arena_cuda.h"
#endif

namespace pe {
namespace {

bool is_power_of_two(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Elements per alignment unit: 256 bytes is 64 float32s, 128 bf16s, 32 float64s.
int64_t align_elems(int64_t alignment, at::ScalarType dtype) {
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
  return std::max<int64_t>(1, alignment / item);
}

void* as_ptr(int64_t stream) { return reinterpret_cast<void*>(static_cast<intptr_t>(stream)); }
int64_t as_int(const void* p) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(p)); }

// A traced arena's snapshot stream per device: far from the small ids tests give streams.
constexpr int64_t kTraceSideStream = int64_t{1} << 40;

}  // namespace

namespace {

at::Tensor aligned_alloc(int64_t numel, at::ScalarType dtype, at::Device device,
                         int64_t alignment, bool zero) {
  PE_CHECK(is_power_of_two(alignment), "alignment must be a power of two, got ", alignment);
  PE_CHECK(numel >= 0, "numel must be >= 0, got ", numel);
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t slack = std::max<int64_t>(0, alignment / item - 1);
  auto opts = at::TensorOptions().dtype(dtype).device(device);
  at::Tensor raw = zero ? at::zeros({numel + slack}, opts) : at::empty({numel + slack}, opts);
  if (device.is_meta() || slack == 0) return raw.narrow(0, 0, numel);
  const auto addr = reinterpret_cast<uintptr_t>(raw.data_ptr());
  const auto misalign = static_cast<int64_t>(addr % static_cast<uintptr_t>(alignment));
  int64_t shift = 0;
  if (misalign != 0) {
    PE_CHECK((alignment - misalign) % item == 0, "allocator returned an address (", addr,
                ") that is not a multiple of the element size ", item);
    shift = (alignment - misalign) / item;
  }
  return raw.narrow(0, shift, numel);
}

}  // namespace

at::Tensor aligned_zeros(int64_t numel, at::ScalarType dtype, at::Device device,
                         int64_t alignment) {
  return aligned_alloc(numel, dtype, device, alignment, /*zero=*/true);
}

at::Tensor aligned_empty(int64_t numel, at::ScalarType dtype, at::Device device,
                         int64_t alignment) {
  return aligned_alloc(numel, dtype, device, alignment, /*zero=*/false);
}

Arena::Arena(int64_t alignment) : alignment_(alignment) {
  PE_CHECK(is_power_of_two(alignment),
              "alignment must be a power of two (e.g. 256), got ", alignment);
}

Arena::~Arena() {
  // Pending side-stream copies still read the live buffers and write the slots: wait for
  // them before the tensors go back to the caching allocator.
  for (auto& kv : slots_) {
    try {
      settle(kv.second);
    } catch (...) {
      // Destructors must not throw; at interpreter exit the CUDA runtime may be gone.
    }
  }
  for (auto& set : pool_) {
    try {
      settle_released(set);
    } catch (...) {
    }
  }
#ifdef PE_WITH_CUDA
  // After the waits above nothing of ours is queued on them any more. A traced arena's
  // streams are ids, not CUDA streams.
  if (!trace_) {
    for (size_t d = 0; d < side_streams_.size(); ++d) {
      cuda::stream_destroy(static_cast<int>(d), side_streams_[d]);
    }
  }
#endif
}

void* Arena::side_stream(int device) {
  PE_CHECK(device >= 0, "negative CUDA device index ", device);
  if (static_cast<size_t>(device) >= side_streams_.size()) {
    side_streams_.resize(static_cast<size_t>(device) + 1, nullptr);
  }
  if (side_streams_[device] == nullptr) {
    if (trace_) {
      side_streams_[device] = as_ptr(kTraceSideStream + device);
      trace_->ops.push_back({"create", kTraceSideStream + device});
    } else {
#ifdef PE_WITH_CUDA
      side_streams_[device] = cuda::stream_create(device);
#else
      PE_CHECK(false, "engine._C was built without CUDA: no snapshot stream");
#endif
    }
  }
  return side_streams_[device];
}

// ---------------------------------------------------------------------------------------
// the stream/event seam: CUDA runtime calls, or the trace of a traced arena

bool Arena::evented(size_t b) const {
  if (trace_) return true;
#ifdef PE_WITH_CUDA
  return buckets_[b].device.is_cuda();
#else
  (void)b;
  return false;
#endif
}

int Arena::dev_of(size_t b) const {
  return trace_ ? 0 : static_cast<int>(buckets_[b].device.index());
}

void* Arena::dev_copy(size_t b, at::Tensor& dst, int64_t producer) {
  const auto& bk = buckets_[b];
  void* side = side_stream(dev_of(b));
  if (trace_) {
    {
      c10::NoGradGuard no_grad;
      dst.copy_(bk.param);  // CPU buffers: the copy is done at once, its order is logged
    }
    const int64_t ev = trace_->next_event++;
    trace_->ops.push_back({"copy", as_int(side), ev, producer, as_int(dst.data_ptr()),
                           as_int(bk.param.data_ptr()), bk.nbytes()});
    return as_ptr(ev);
  }
#ifdef PE_WITH_CUDA
  return cuda::copy_async(dev_of(b), side, dst.data_ptr(), bk.param.data_ptr(),
                          static_cast<size_t>(bk.nbytes()), as_ptr(producer));
#else
  PE_CHECK(false, "engine._C was built without CUDA: no asynchronous copy");
  return nullptr;
#endif
}

void* Arena::dev_record(size_t b, int64_t stream) {
  if (trace_) {
    const int64_t ev = trace_->next_event++;
    trace_->ops.push_back({"record", stream, ev});
    return as_ptr(ev);
  }
#ifdef PE_WITH_CUDA
  return cuda::record_event(dev_of(b), as_ptr(stream));
#else
  (void)b;
  (void)stream;
  PE_CHECK(false, "engine._C was built without CUDA: no events");
  return nullptr;
#endif
}

void Arena::dev_wait(size_t b, int64_t stream, void* event) {
  if (trace_) {
    trace_->ops.push_back({"wait", stream, as_int(event)});
    return;
  }
#ifdef PE_WITH_CUDA
  cuda::stream_wait_event(dev_of(b), as_ptr(stream), event);
#else
  (void)b;
  (void)stream;
  (void)event;
  PE_CHECK(false, "engine._C was built without CUDA: no events");
#endif
}

bool Arena::dev_done(size_t b, void* event) {
  if (trace_) {
    const bool done = trace_->events_done || trace_->synced.count(as_int(event)) != 0;
    trace_->ops.push_back({"query", 0, as_int(event), done ? 1 : 0});
    return done;
  }
#ifdef PE_WITH_CUDA
  return cuda::event_done(dev_of(b), event);
#else
  (void)b;
  (void)event;
  PE_CHECK(false, "engine._C was built without CUDA: no events");
  return false;
#endif
}

void Arena::dev_sync(size_t b, void* event) {
  if (trace_) {
    trace_->synced.insert(as_int(event));
    trace_->ops.push_back({"sync", 0, as_int(event)});
    return;
  }
#ifdef PE_WITH_CUDA
  cuda::event_sync(dev_of(b), event);
#else
  (void)b;
  (void)event;
  PE_CHECK(false, "engine._C was built without CUDA: no events");
#endif
}

void Arena::dev_destroy(size_t b, void* event) noexcept {
  if (trace_) {
    try {
      trace_->ops.push_back({"destroy", 0, as_int(event)});
    } catch (...) {
    }
    return;
  }
#ifdef PE_WITH_CUDA
  cuda::event_destroy(dev_of(b), event);
#else
  (void)b;
  (void)event;
#endif
}

void Arena::trace_start(bool events_done) {
  PE_CHECK(slots_.empty() && pool_.empty() && side_streams_.empty(),
           "trace_start: trace an arena before its first snapshot");
  for (const auto& bk : buckets_) {
    PE_CHECK(bk.device.is_cpu(), "trace_start: a traced arena holds CPU buckets only (its "
             "CUDA calls are logged, not made); this one has a bucket on ", bk.device.str());
  }
  trace_ = std::make_unique<Trace>();
  trace_->events_done = events_done;
}

std::vector<TraceOp> Arena::trace_take() {
  PE_CHECK(trace_ != nullptr, "trace_take: this arena is not traced (call trace_start)");
  std::vector<TraceOp> out = std::move(trace_->ops);
  trace_->ops.clear();
  return out;
}

int64_t Arena::snapshot_stream(int64_t device) const {
  if (device < 0 || static_cast<size_t>(device) >= side_streams_.size()) return 0;
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(side_streams_[device]));
}

int64_t Arena::add_bucket(const std::vector<at::Tensor>& tensors, int64_t group,
                          bool requires_grad) {
  PE_CHECK(!tensors.empty(), "a bucket needs at least one tensor");
  // Existing slots cover only the buckets they were taken with; a bucket added later
  // would leave them incomplete, so all buckets come before the first snapshot.
  PE_CHECK(slots_.empty() && pool_.empty(), "buckets must be added before the first snapshot");
  PE_CHECK(!trace_ || tensors[0].device().is_cpu(),
           "a traced arena holds CPU buckets only, got a tensor on ", tensors[0].device().str());
  Bucket bk;
  bk.device = tensors[0].device();
  bk.dtype = tensors[0].scalar_type();
  bk.group = group;
  bk.requires_grad = requires_grad;
  PE_CHECK(at::isFloatingType(bk.dtype),
              "the arena holds floating-point weights only, got ", bk.dtype);
  const int64_t unit = align_elems(alignment_, bk.dtype);
  int64_t cursor = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    PE_CHECK(t.device() == bk.device && t.scalar_type() == bk.dtype,
                "tensor ", i, " of a bucket is ", t.scalar_type(), " on ", t.device(),
                " but the bucket is ", bk.dtype, " on ", bk.device);
    PE_CHECK(t.layout() == at::kStrided, "tensor ", i, " is not a dense (strided) tensor");
    cursor = round_up(cursor, unit);
    bk.offsets.push_back(cursor);
    bk.numels.push_back(t.numel());
    bk.shapes.push_back(t.sizes().vec());
    cursor += t.numel();
  }
  // Pad the tail too: every buffer is a whole number of alignment units, so a vectorised
  // kernel never needs a scalar epilogue and two buckets never share a cache line.
  bk.numel = round_up(cursor, unit);
  bk.param = aligned_zeros(bk.numel, bk.dtype, bk.device, alignment_);
  {
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (bk.numels[i] == 0) continue;
      bk.param.narrow(0, bk.offsets[i], bk.numels[i]).view(bk.shapes[i]).copy_(tensors[i]);
    }
  }
  if (requires_grad) bk.grad = aligned_zeros(bk.numel, bk.dtype, bk.device, alignment_);
  live_bytes_ += bk.nbytes();
  set_bytes_ += bk.nbytes();
  if (requires_grad) grad_bytes_ += bk.nbytes();
  buckets_.push_back(std::move(bk));
  track_peak();
  return static_cast<int64_t>(buckets_.size()) - 1;
}

const Bucket& Arena::bucket(int64_t b) const {
  PE_CHECK(b >= 0 && b < num_buckets(), "bucket index ", b, " out of range (",
              num_buckets(), " buckets)");
  return buckets_[static_cast<size_t>(b)];
}

static std::vector<at::Tensor> views_of(const at::Tensor& flat, const Bucket& bk) {
  std::vector<at::Tensor> out;
  out.reserve(bk.offsets.size());
  for (size_t i = 0; i < bk.offsets.size(); ++i) {
    out.push_back(flat.narrow(0, bk.offsets[i], bk.numels[i]).view(bk.shapes[i]));
  }
  return out;
}

std::vector<at::Tensor> Arena::param_views(int64_t b) const {
  const auto& bk = bucket(b);
  return views_of(bk.param, bk);
}

std::vector<at::Tensor> Arena::grad_views(int64_t b) const {
  const auto& bk = bucket(b);
  PE_CHECK(bk.requires_grad, "bucket ", b, " holds requires_grad=False tensors: no gradients");
  return views_of(bk.grad, bk);
}

// ---------------------------------------------------------------------------------------
// weight versions

Slot& Arena::slot_ref(int64_t slot) {
  auto it = slots_.find(slot);
  PE_CHECK(it != slots_.end(), "weight slot ", slot,
              was_freed(slot) ? " was already freed" : " does not exist");
  return it->second;
}

const Slot& Arena::slot_ref(int64_t slot) const {
  auto it = slots_.find(slot);
  PE_CHECK(it != slots_.end(), "weight slot ", slot,
              was_freed(slot) ? " was already freed" : " does not exist");
  return it->second;
}

void Arena::copy_into_slot(Slot& s, int64_t stream) {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const auto& bk = buckets_[b];
    if (evented(b)) {
      // A previous copy into this slot may still be in flight; the new one goes on the
      // arena's same snapshot stream, so it is ordered after it, and its event supersedes
      // the old one (destroying a pending event is legal: waits enqueued on it still hold).
      if (s.events[b] != nullptr) {
        dev_destroy(b, s.events[b]);
        s.events[b] = nullptr;
      }
      s.events[b] = dev_copy(b, s.flats[b], stream);
      continue;
    }
    c10::NoGradGuard no_grad;
    s.flats[b].copy_(bk.param);  // stream-ordered on the current stream for CUDA tensors
  }
}

std::vector<at::Tensor> Arena::take_buffers(int64_t stream, bool zero_fresh,
                                            std::vector<void*>& copies) {
  copies.assign(buckets_.size(), nullptr);
  if (!pool_.empty()) {
    PooledSet& set = pool_.back();
    // Work queued on the releasing stream before the release may still read the buffers,
    // and the slot's own snapshot copy may still write them: order the new user (`stream`,
    // and through it the side-stream copy, which waits for `stream`) after both. A done
    // event costs a query; only a pending one makes `stream` wait, on the device (the
    // host never blocks). Release events are dropped as soon as they are waited on, so a
    // failure half-way leaves the set in the pool with only the events still to wait for.
    for (size_t b = 0; b < set.released.size(); ++b) {
      void*& ev = set.released[b];
      if (ev == nullptr) continue;
      if (!dev_done(b, ev)) dev_wait(b, stream, ev);
      dev_destroy(b, ev);
      ev = nullptr;
    }
    std::vector<char> pending(set.copies.size(), 0);
    for (size_t b = 0; b < set.copies.size(); ++b) {
      void* ev = set.copies[b];
      if (ev == nullptr) continue;
      if (!dev_done(b, ev)) {
        dev_wait(b, stream, ev);
        pending[b] = 1;
      }
    }
    // A pending copy also still reads live: it goes on with the buffers as the new slot's
    // copy event, so that wait/wait_all (writers of live) keep waiting for it.
    for (size_t b = 0; b < set.copies.size(); ++b) {
      if (set.copies[b] == nullptr) continue;
      if (pending[b]) {
        copies[b] = set.copies[b];
      } else {
        dev_destroy(b, set.copies[b]);
      }
      set.copies[b] = nullptr;
    }
    std::vector<at::Tensor> flats = std::move(set.flats);
    pool_.pop_back();
    pooled_bytes_ -= set_bytes_;
    return flats;
  }
  std::vector<at::Tensor> flats;
  flats.reserve(buckets_.size());
  for (const auto& bk : buckets_) {
    // zero_fresh: the one fill in a buffer's life, so that its padding is zero for
    // callers that write only the tensors (new_slot). A snapshot needs none: its copy
    // covers the whole flat buffer, padding (zero in live) included, and on CUDA a fill
    // on the current stream could race with the side-stream copy.
    flats.push_back(zero_fresh ? aligned_zeros(bk.numel, bk.dtype, bk.device, alignment_)
                               : aligned_empty(bk.numel, bk.dtype, bk.device, alignment_));
  }
  return flats;
}

int64_t Arena::add_slot(Slot&& s, std::optional<int64_t> microbatch) {
  const int64_t id = next_slot_++;
  if (microbatch.has_value()) {
    s.pins[*microbatch] = 1;
  }
  slot_bytes_ += s.nbytes;
  slots_.emplace(id, std::move(s));
  track_peak();
  return id;
}

int64_t Arena::snapshot(int64_t stream, std::optional<int64_t> microbatch) {
  Slot s;
  s.flats = take_buffers(stream, /*zero_fresh=*/false, s.events);
  s.nbytes = set_bytes_;
  copy_into_slot(s, stream);
  return add_slot(std::move(s), microbatch);
}

int64_t Arena::new_slot(int64_t stream, std::optional<int64_t> microbatch) {
  // Why the padding of a pooled set is zero without a fill: its buffers were last a
  // snapshot (a copy of live, whose padding is zero), a new_slot (zeroed when allocated)
  // or a live buffer handed over by swap_live, and the arena never writes padding.
  Slot s;
  s.flats = take_buffers(stream, /*zero_fresh=*/true, s.events);
  s.nbytes = set_bytes_;
  return add_slot(std::move(s), microbatch);
}

void Arena::swap_live(int64_t slot, int64_t stream) {
  auto& s = slot_ref(slot);
  // The slot's buffer becomes live, so the copy into it must be done before `stream` uses
  // live; the old live buffer becomes the slot's, so a later write to the slot (through
  // `stream`) must come after the copies still reading it. wait_all covers both (and is
  // what flat_buffers_for does before an optimizer writes live anyway). The slot's events
  // described a copy into what is now live, which `stream` has waited for: drop them.
  wait_all(stream);
  for (size_t b = 0; b < s.events.size(); ++b) {
    if (s.events[b] == nullptr) continue;
    dev_destroy(b, s.events[b]);
    s.events[b] = nullptr;
  }
  for (size_t b = 0; b < buckets_.size(); ++b) std::swap(buckets_[b].param, s.flats[b]);
}

void Arena::refresh(int64_t slot, int64_t stream) { copy_into_slot(slot_ref(slot), stream); }

void Arena::wait(int64_t slot, int64_t stream) {
  auto& s = slot_ref(slot);
  for (size_t b = 0; b < s.events.size(); ++b) {
    if (s.events[b] == nullptr) continue;
    if (dev_done(b, s.events[b])) {
      dev_destroy(b, s.events[b]);
      s.events[b] = nullptr;
    } else {
      dev_wait(b, stream, s.events[b]);
    }
  }
}

void Arena::wait_all(int64_t stream) {
  for (auto& kv : slots_) wait(kv.first, stream);
  // A freed slot's copy may still be reading live (release does not wait for it).
  for (auto& set : pool_) {
    for (size_t b = 0; b < set.copies.size(); ++b) {
      if (set.copies[b] == nullptr) continue;
      if (dev_done(b, set.copies[b])) {
        dev_destroy(b, set.copies[b]);
        set.copies[b] = nullptr;
      } else {
        dev_wait(b, stream, set.copies[b]);
      }
    }
  }
}

void Arena::settle_released(PooledSet& set) {
  for (auto* events : {&set.released, &set.copies}) {
    for (size_t b = 0; b < events->size(); ++b) {
      void*& ev = (*events)[b];
      if (ev == nullptr) continue;
      dev_sync(b, ev);
      dev_destroy(b, ev);
      ev = nullptr;
    }
  }
}

void Arena::settle(Slot& s) {
  for (size_t b = 0; b < s.events.size(); ++b) {
    if (s.events[b] == nullptr) continue;
    dev_sync(b, s.events[b]);
    dev_destroy(b, s.events[b]);
    s.events[b] = nullptr;
  }
}

std::vector<at::Tensor> Arena::slot_views(int64_t slot, int64_t b) const {
  const auto& s = slot_ref(slot);
  const auto& bk = bucket(b);
  return views_of(s.flats[static_cast<size_t>(b)], bk);
}

at::Tensor Arena::slot_flat(int64_t slot, int64_t b) const {
  const auto& s = slot_ref(slot);
  bucket(b);
  return s.flats[static_cast<size_t>(b)];
}

void Arena::restore(int64_t slot, int64_t stream) {
  auto& s = slot_ref(slot);
  // Writes live: wait for the copy into the slot and for every copy still reading live.
  wait_all(stream);
  c10::NoGradGuard no_grad;
  for (size_t b = 0; b < buckets_.size(); ++b) buckets_[b].param.copy_(s.flats[b]);
}

std::vector<int64_t> Arena::slot_ids() const {
  std::vector<int64_t> ids;
  for (const auto& kv : slots_) ids.push_back(kv.first);
  return ids;
}

std::map<int64_t, int64_t> Arena::pins(int64_t slot) const { return slot_ref(slot).pins; }

int64_t Arena::refcount(int64_t slot) const {
  const auto& s = slot_ref(slot);
  int64_t n = s.holders;
  for (const auto& kv : s.pins) n += kv.second;
  return n;
}

void Arena::pin(int64_t slot, int64_t microbatch) {
  auto& s = slot_ref(slot);
  s.pins[microbatch] += 1;
}

bool Arena::release(int64_t slot, int64_t microbatch, int64_t stream) {
  auto& s = slot_ref(slot);
  auto it = s.pins.find(microbatch);
  PE_CHECK(it != s.pins.end(), "weight slot ", slot, " is not pinned to micro-batch ",
              microbatch);
  if (--it->second == 0) s.pins.erase(it);
  if (s.pins.empty() && s.holders == 0) {
    erase_slot(slot, stream);
    return true;
  }
  return false;
}

void Arena::free_slot(int64_t slot, int64_t stream) {
  auto& s = slot_ref(slot);
  PE_CHECK(s.pins.empty(), "weight slot ", slot, " is still pinned by ", s.pins.size(),
              " micro-batch(es); release them instead");
  PE_CHECK(s.holders == 0, "weight slot ", slot,
              " belongs to a double buffer; close the double buffer instead");
  erase_slot(slot, stream);
}

void Arena::hold(int64_t slot) { slot_ref(slot).holders += 1; }

bool Arena::unhold(int64_t slot, int64_t stream) {
  auto& s = slot_ref(slot);
  PE_CHECK(s.holders > 0, "weight slot ", slot, " is not held by a double buffer");
  s.holders -= 1;
  if (s.holders == 0 && s.pins.empty()) {
    erase_slot(slot, stream);
    return true;
  }
  return false;
}

void Arena::erase_slot(int64_t slot, int64_t stream) {
  auto it = slots_.find(slot);
  Slot& s = it->second;
  // No host wait here: a copy still writing the slot travels with its buffers (copies) and
  // is waited for, on the device, by their next user (take_buffers) or by wait_all.
  PooledSet set;
  set.released.assign(s.flats.size(), nullptr);
  for (size_t b = 0; b < s.flats.size(); ++b) {
    if (!evented(b)) continue;
    try {
      set.released[b] = dev_record(b, stream);
    } catch (...) {
      for (size_t e = 0; e < b; ++e) {
        if (set.released[e] != nullptr) dev_destroy(e, set.released[e]);
      }
      throw;  // the slot stays allocated, unpinned: free() can still drop it
    }
  }
  set.copies = std::move(s.events);
  set.flats = std::move(s.flats);
  slot_bytes_ -= s.nbytes;
  pooled_bytes_ += s.nbytes;
  slots_.erase(it);
  pool_.push_back(std::move(set));
}

int64_t Arena::trim_pool() {
  const int64_t freed = pooled_bytes_;
  // Host-wait for the release and copy events: once dropped, the buffers go back to torch's
  // caching allocator, which may hand them to another stream at once.
  for (auto& set : pool_) settle_released(set);
  pool_.clear();
  pooled_bytes_ = 0;
  return freed;
}

// ---------------------------------------------------------------------------------------
// accounting

std::map<int64_t, int64_t> Arena::per_slot_bytes() const {
  std::map<int64_t, int64_t> out;
  for (const auto& kv : slots_) out[kv.first] = kv.second.nbytes;
  return out;
}

void Arena::track_peak() {
  peak_bytes_ = std::max(peak_bytes_, live_bytes_ + grad_bytes_ + slot_bytes_);
}

// ---------------------------------------------------------------------------------------
// L2 persistence

namespace {

// The part every L2 call shares: false, with the reason in ``out``, when this bucket (not on
// CUDA) or this build (without CUDA) cannot hold a window.
bool l2_possible(const Bucket& bk, L2Result& out) {
  if (!bk.device.is_cuda()) {
    out.reason = std::string("L2 persistence needs a CUDA buffer; this bucket is on ") +
                 bk.device.str();
    return false;
  }
#ifdef PE_WITH_CUDA
  out.supported = true;
  return true;
#else
  out.reason =
      "engine._C was built without CUDA; rebuild on a machine with a CUDA torch and nvcc "
      "(see docs/building.md)";
  return false;
#endif
}

#ifdef PE_WITH_CUDA
void fill_l2(L2Result& out, const cuda::L2Window& w) {
  out.ok = w.ok;
  out.granted_bytes = static_cast<int64_t>(w.granted_bytes);
  out.window_bytes = static_cast<int64_t>(w.window_bytes);
  out.max_persisting_bytes = static_cast<int64_t>(w.max_persisting_bytes);
  out.max_window_bytes = static_cast<int64_t>(w.max_window_bytes);
  out.hit_ratio = w.hit_ratio;
  out.reason = w.reason;
}
#endif

}  // namespace

L2Result Arena::set_l2_persistence(int64_t b, int64_t stream, double hit_ratio,
                                   int64_t max_bytes) {
  const auto& bk = bucket(b);
  L2Result out;
  out.bucket = b;
  if (!l2_possible(bk, out)) return out;
#ifdef PE_WITH_CUDA
  fill_l2(out, cuda::set_l2_persistence(bk.device.index(), as_ptr(stream), bk.param.data_ptr(),
                                        static_cast<size_t>(bk.nbytes()),
                                        static_cast<float>(hit_ratio),
                                        static_cast<size_t>(std::max<int64_t>(0, max_bytes))));
#else
  (void)stream;
  (void)hit_ratio;
  (void)max_bytes;
#endif
  return out;
}

L2Result Arena::set_l2_window(int64_t b, int64_t stream, double hit_ratio,
                              int64_t share_bytes) {
  const auto& bk = bucket(b);
  L2Result out;
  out.bucket = b;
  if (!l2_possible(bk, out)) return out;
#ifdef PE_WITH_CUDA
  fill_l2(out, cuda::set_l2_window(bk.device.index(), as_ptr(stream), bk.param.data_ptr(),
                                   static_cast<size_t>(bk.nbytes()),
                                   static_cast<float>(hit_ratio),
                                   static_cast<size_t>(std::max<int64_t>(0, share_bytes))));
#else
  (void)stream;
  (void)hit_ratio;
  (void)share_bytes;
#endif
  return out;
}

void Arena::clear_l2_window(int64_t b, int64_t stream) {
  const auto& bk = bucket(b);
  PE_CHECK(bk.device.is_cuda(), "L2 persistence needs a CUDA buffer; bucket ", b, " is on ",
              bk.device.str());
#ifdef PE_WITH_CUDA
  cuda::clear_l2_window(bk.device.index(), as_ptr(stream));
#else
  (void)stream;
  PE_CHECK(false, "engine._C was built without CUDA: there is no L2 window to clear");
#endif
}

void Arena::clear_l2_persistence(int64_t b, int64_t stream) {
  const auto& bk = bucket(b);
  PE_CHECK(bk.device.is_cuda(), "L2 persistence needs a CUDA buffer; bucket ", b, " is on ",
              bk.device.str());
#ifdef PE_WITH_CUDA
  cuda::clear_l2_persistence(bk.device.index(), as_ptr(stream));
#else
  (void)stream;
  PE_CHECK(false, "engine._C was built without CUDA: there is no L2 window to clear");
#endif
}

}  // namespace pe
