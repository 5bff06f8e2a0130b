// The shared-memory all-reduce / all-gather of the tensor-parallel ranks on one machine: the one
// implementation of the protocol, called from Python (distributed/shm_allreduce.py, which owns the
// segment) and from inside the decode stack between its layers (cpu_decode_stack.cpp).
//
// Segment layout (uint8): world_size flags, one 64-byte line each (the number of the last op the
// rank published), then two sets of world_size slots of slot_bytes each; op n uses set n % 2.
// Op n: copy x into this rank's slot of set n % 2, store n into this rank's flag (release: the
// slot's bytes are visible to whoever sees the flag), then wait until every peer's flag is >= n
// (acquire: their slots are readable) and read the slots in rank order, so every rank computes the
// same sum bit for bit. Two sets suffice: a rank can only start op n + 1 after every peer published
// op n, i.e. finished reading op n - 1's slots, which op n + 1 reuses.
// The op counter lives in an int64 tensor shared with Python (state[0]), so the ops run from Python
// (embedding, LM head, layers outside the stack) and those run by the stack take turns in one
// sequence; state[1..3] count the nanoseconds spent in the ops (copy, wait, sum) and the bytes this
// rank all-reduced and all-gathered, for the benchmarks (two clock reads per op). A peer that never publishes (dead, hung) makes the wait raise after timeout_s, naming it.
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "cpu_kernels.h"

namespace {

constexpr int64_t kFlagBytes = 64;  // one cache line per rank's flag: no false sharing between ranks
enum State : int64_t { kOps, kNanoseconds, kBytesReduced, kBytesGathered, kStateSize };

using Clock = std::chrono::steady_clock;

// Adds an op's time and bytes to the state's counters when it ends.
struct Count {
  const ShmGroup& g;
  State what;
  int64_t bytes;
  Clock::time_point start = Clock::now();
  ~Count() {
    int64_t* state = g.state.data_ptr<int64_t>();
    state[kNanoseconds] += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
    state[what] += bytes;
  }
};

std::atomic_ref<int64_t> flag(const ShmGroup& g, int64_t rank) {
  return std::atomic_ref<int64_t>(*reinterpret_cast<int64_t*>(g.segment.data_ptr<uint8_t>() + rank * kFlagBytes));
}

// Every rank's slot of op n's set, viewed as x (shape and dtype).
std::vector<at::Tensor> slots(const ShmGroup& g, int64_t n, const at::Tensor& x) {
  const int64_t nbytes = x.numel() * x.element_size();
  const int64_t base = g.world_size * kFlagBytes + (n % 2) * g.world_size * g.slot_bytes;
  std::vector<at::Tensor> out;
  for (int64_t r = 0; r < g.world_size; ++r)
    out.push_back(g.segment.narrow(0, base + r * g.slot_bytes, nbytes).view(x.scalar_type()).view(x.sizes()));
  return out;
}

// Spin (yielding the core: the ranks may outnumber the cores) until `rank` has published op n.
void wait_for(const ShmGroup& g, int64_t rank, int64_t n) {
  std::atomic_ref<int64_t> peer = flag(g, rank);
  if (peer.load(std::memory_order_acquire) >= n) return;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                            std::chrono::duration<double>(g.timeout_s));
  while (peer.load(std::memory_order_acquire) < n) {
    TORCH_CHECK(Clock::now() < deadline, "shared-memory all-reduce: rank ", rank,
                " did not publish op ", n, " within ", g.timeout_s, " s (rank ", g.rank,
                " waiting); it is dead or hung");
    std::this_thread::yield();
  }
}

void check(const ShmGroup& g, const at::Tensor& x) {
  TORCH_CHECK(g.segment.scalar_type() == at::kByte && g.segment.dim() == 1 && g.segment.is_contiguous() &&
                  g.segment.numel() >= g.world_size * (kFlagBytes + 2 * g.slot_bytes),
              "shared-memory all-reduce: the segment must be contiguous uint8 of world_size * (64 + 2 * slot_bytes)");
  TORCH_CHECK(g.state.scalar_type() == at::kLong && g.state.numel() == kStateSize && g.state.is_contiguous(),
              "shared-memory all-reduce: state is ", kStateSize, " int64 (op counter, ns, bytes reduced, gathered)");
  TORCH_CHECK(g.world_size >= 2 && g.rank >= 0 && g.rank < g.world_size, "shared-memory all-reduce: rank ", g.rank, " outside ",
              g.world_size);
  TORCH_CHECK(x.numel() * x.element_size() <= g.slot_bytes, "shared-memory all-reduce: ",
              x.numel() * x.element_size(), " bytes exceed a slot (", g.slot_bytes, ")");
}

ShmGroup group(at::Tensor segment, at::Tensor state, int64_t rank, int64_t world_size, int64_t slot_bytes,
               double timeout_s) {
  return ShmGroup{std::move(segment), std::move(state), rank, world_size, slot_bytes, timeout_s};
}

void shm_all_reduce_(at::Tensor x, at::Tensor segment, at::Tensor state, int64_t rank, int64_t world_size,
                     int64_t slot_bytes, double timeout_s) {
  group(segment, state, rank, world_size, slot_bytes, timeout_s).all_reduce(x);
}

at::Tensor shm_all_gather(at::Tensor x, at::Tensor segment, at::Tensor state, int64_t rank, int64_t world_size,
                          int64_t slot_bytes, double timeout_s, int64_t dim) {
  const ShmGroup g = group(segment, state, rank, world_size, slot_bytes, timeout_s);
  const Count count{g, kBytesGathered, x.numel() * x.element_size()};
  return at::cat(g.exchange(x), dim);
}

}  // namespace

std::vector<at::Tensor> ShmGroup::exchange(const at::Tensor& x) const {
  check(*this, x);
  const int64_t n = ++state.data_ptr<int64_t>()[kOps];
  std::vector<at::Tensor> parts = slots(*this, n, x);
  parts[rank].copy_(x);
  flag(*this, rank).store(n, std::memory_order_release);
  for (int64_t r = 0; r < world_size; ++r)
    if (r != rank) wait_for(*this, r, n);
  return parts;
}

void ShmGroup::all_reduce(at::Tensor x) const {
  const Count count{*this, kBytesReduced, x.numel() * x.element_size()};
  const std::vector<at::Tensor> parts = exchange(x);
  at::add_out(x, parts[0], parts[1]);  // in rank order: ((s0 + s1) + s2) + ...
  for (int64_t r = 2; r < world_size; ++r) x.add_(parts[r]);
}

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_OPS, m) {
  m.def("shm_all_reduce_(Tensor(a!) x, Tensor(b!) segment, Tensor(c!) state, int rank, int world_size, "
        "int slot_bytes, float timeout_s) -> ()");
  m.def("shm_all_gather(Tensor x, Tensor(a!) segment, Tensor(b!) state, int rank, int world_size, int slot_bytes, "
        "float timeout_s, int dim) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_OPS, CPU, m) {
  m.impl("shm_all_reduce_", &shm_all_reduce_);
  m.impl("shm_all_gather", &shm_all_gather);
}
