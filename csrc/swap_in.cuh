// HiSparse swap-in and row-copy kernels. Raw pointers and sizes only; the semantics are those of
// hisparse_sglang/ops/reference.py (swap_in, copy_rows), which these kernels match bit for bit.
//
// swap_in: grid = batch * splits CTAs. CTA (b, part) with b = blockIdx.x % batch and
// part = blockIdx.x / batch, so the planner CTAs (part 0) have the lowest block indices.
//   * padded batch row (b >= num_real_reqs): the planner writes -1 to the output row.
//   * resident request (buffer_of_req[r] < 0): the planner translates positions to device rows.
//   * offloaded request: the planner looks every entry up in the token -> slot map (one load per
//     entry); a hit writes its slot's row and stamps the slot at once. Only if some entry missed
//     does the block go on: it deduplicates the misses, selects the least recently used slots not
//     hit (two histogram passes over the slots' ages), updates the tables and writes the missed
//     entries' outputs. With splits == 1 the planner then copies the missed rows itself.
//   * copier CTAs (part >= 1, splits > 1): each owns a chunk of the top-k entries. It looks its
//     entries up in the map on its own, counts itself in looked[b] (release) and starts reading
//     the missed host rows into shared memory at once (zero-copy reads of pinned host memory),
//     while the planner still chooses the slots. The planner waits for every copier's lookups
//     before it updates the map (so a copier never sees a miss as a hit), and once it publishes
//     the outputs (flags[b] = kPlanReady) the copiers write their rows to the device rows named
//     there. A copier with no miss leaves after its lookups. Copiers wait for their planner and
//     the planner for its copiers, so the host keeps the grid co-resident (ops.choose_splits).
//     The last CTA of a request to finish resets its flag and counters, so the kernel can be
//     replayed in a CUDA graph without host involvement.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "swap_in_config.h"

namespace hisparse {

// Byte offsets of the regions of a swap_in CTA's dynamic shared memory, and its size. The host
// computes them (hisparse_sglang/ops/swap_in_limits.py::swap_in_plan, the one owner of the layout
// and of the size the config is checked against) and passes them with every launch; every role
// carves its regions from here. Field order = swap_in_limits.PLAN_FIELDS.
struct SwapInSmemPlan {
  int64_t hash_bits;        // hash table of 1 << hash_bits >= 2 * K entries (indices fit int16)
  int64_t total_bytes;      // dynamic shared memory of every CTA
  int64_t warp_sums;        // uint64 [THREADS / 32 + 1]: block scans (every role)
  int64_t selection;        // int32 [4]: coarse bucket, count above it, fine bucket, count above it
  int64_t role;             // planner: its tables below; copier: miss list, then staged rows
  int64_t keys;             // int32 [H]: missed token per hash entry
  int64_t first;            // int32 [H]: its first entry
  int64_t hash_host_row;    // int32 [H]: its host row (planner copies alone)
  int64_t hash_device_row;  // int32 [H]: its device row
  int64_t row_of_slot;      // int32 [D]
  int64_t token_of_slot;    // int32 [D]
  int64_t entry_state;      // int32 [K]
  int64_t slot_hit;         // uint32 [(D + 31) / 32]
  int64_t coarse;           // int32 [kCoarseBuckets]
  int64_t fine;             // int32 [kFineBuckets]
  int64_t miss_hash;        // int16 [K]: hash index per miss rank
  int64_t victim_slot;      // int16 [K]: victim slot per miss rank
  int64_t slot_age;         // int16 [D] (-1: hit)
  int64_t entry_hash;       // int16 [K]: hash index of a missed entry
};
constexpr int kPlanFields = sizeof(SwapInSmemPlan) / sizeof(int64_t);

template <typename T>
__device__ __forceinline__ T* smem_region(uint8_t* smem, int64_t offset) {
  return reinterpret_cast<T*>(smem + offset);
}

struct SwapInParams {
  const int32_t* top_k_positions;  // [batch, top_k_stride], positions, -1 = padding
  int64_t top_k_stride;
  const void* seq_lens;            // [batch] int32 or int64
  const void* req_pool_indices;    // [batch] int32 or int64
  int seq_lens_is_64;
  int req_pool_indices_is_64;
  const int32_t* num_real_reqs;    // [1]
  const int32_t* req_to_token;     // [R, req_to_token_stride] logical location = host row
  int64_t req_to_token_stride;
  const int32_t* device_row_of_loc;  // [N + 1]
  const int32_t* buffer_of_req;      // [R], -1 = resident
  const int32_t* slot_rows;          // [NB, slot_rows_stride], slot D = newest token
  int64_t slot_rows_stride;
  int32_t* slot_tokens;              // [NB, slot_tokens_stride] this layer
  int64_t slot_tokens_stride;
  int32_t* slot_stamps;              // [NB, slot_stamps_stride] this layer
  int64_t slot_stamps_stride;
  int16_t* token_slot;               // [NB, token_slot_stride] this layer
  int64_t token_slot_stride;
  const uint8_t* host_kv;            // pinned host rows (device-accessible)
  uint8_t* device_kv;                // device rows
  int64_t row_bytes;                 // multiple of 16
  int32_t* out;                      // [batch, out_stride]
  int64_t out_stride;
  unsigned long long* counters;      // [2] or nullptr: lookups, misses
  int32_t* flags;                    // [batch], 0 between launches
  int32_t* done;                     // [batch] CTAs finished, 0 between launches
  int32_t* looked;                   // [batch] copiers done with their lookups, 0 between launches
  int batch;
  int num_top_k;                     // K <= buffer_size, K <= 8192
  int buffer_size;                   // D <= kMaxBufferSize
  int splits;
  int late_copiers_ns;               // test hook: copiers sleep this long before their lookups
  SwapInSmemPlan plan;
};

__device__ __forceinline__ int64_t load_index(const void* ptr, int is_64, int i) {
  return is_64 ? static_cast<const int64_t*>(ptr)[i] : static_cast<const int32_t*>(ptr)[i];
}

__device__ __forceinline__ uint32_t hash_of(int32_t key, int bits) {
  return (static_cast<uint32_t>(key) * 2654435761u) >> (32 - bits);
}

__device__ __forceinline__ uint64_t warp_inclusive_scan(uint64_t value) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset <<= 1) {
    const uint64_t other = __shfl_up_sync(0xffffffffu, value, offset);
    if (lane >= offset) value += other;
  }
  return value;
}

// Exclusive prefix sum over the block in thread order; `total` receives the block sum. The 64-bit
// value can carry several narrower counters at once (no field may overflow).
template <int THREADS>
__device__ __forceinline__ uint64_t block_exclusive_scan(uint64_t value, uint64_t* warp_sums, uint64_t& total) {
  constexpr int kWarps = THREADS / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const uint64_t inclusive = warp_inclusive_scan(value);
  if (lane == kWarpSize - 1) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const uint64_t x = lane < kWarps ? warp_sums[lane] : 0;
    const uint64_t x_inclusive = warp_inclusive_scan(x);
    if (lane < kWarps) warp_sums[lane] = x_inclusive - x;
    if (lane == kWarps - 1) warp_sums[kWarps] = x_inclusive;
  }
  __syncthreads();
  const uint64_t exclusive = warp_sums[warp] + inclusive - value;
  total = warp_sums[kWarps];
  return exclusive;
}

// Run by one whole warp over a histogram of `buckets` (a multiple of 32) counts: the highest
// bucket at which the count of items in that bucket or above reaches `target` (>= 1, at most the
// histogram's total), and the count strictly above it.
__device__ __forceinline__ void warp_find_from_top(const int32_t* hist, int buckets, int target, int* bucket_out,
                                                   int* above_out) {
  const int lane = threadIdx.x % kWarpSize;
  const int per_lane = buckets / kWarpSize;
  const int top = buckets - lane * per_lane;  // lane 0 owns the highest buckets
  int sum = 0;
  for (int k = 1; k <= per_lane; ++k) sum += hist[top - k];
  int inclusive = sum;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  const int exclusive = inclusive - sum;
  if (exclusive < target && target <= inclusive) {
    int running = exclusive;
    for (int k = 1; k <= per_lane; ++k) {
      const int count = hist[top - k];
      if (running + count >= target) {
        *bucket_out = top - k;
        *above_out = running;
        break;
      }
      running += count;
    }
  }
}

// Copies `count` rows of `vectors_per_row` 16-byte pieces: piece v of row m goes from load(m, v)
// to store(m, v, value). Consecutive threads take consecutive pieces; each thread has kCopyUnroll
// independent loads in flight. Serves every row copy of swap_in (host, shared memory, device).
template <int THREADS, typename Load, typename Store>
__device__ __forceinline__ void copy_rows_by(int count, int vectors_per_row, Load load, Store store) {
  const int total = count * vectors_per_row;
  for (int base = threadIdx.x; base < total; base += THREADS * kCopyUnroll) {
    int4 value[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int g = base + u * THREADS;
      if (g < total) value[u] = load(g / vectors_per_row, g % vectors_per_row);
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int g = base + u * THREADS;
      if (g < total) store(g / vectors_per_row, g % vectors_per_row, value[u]);
    }
  }
}

// A 16-byte piece of a row: zero-copy read of pinned host memory, streaming write to device memory.
__device__ __forceinline__ int4 load_piece(const uint8_t* base, int32_t row, int64_t row_bytes, int v) {
  return __ldg(reinterpret_cast<const int4*>(base + int64_t(row) * row_bytes) + v);
}

__device__ __forceinline__ void store_piece(uint8_t* base, int32_t row, int64_t row_bytes, int v, int4 value) {
  __stcg(reinterpret_cast<int4*>(base + int64_t(row) * row_bytes) + v, value);
}

__device__ __forceinline__ uint64_t global_time_ns() {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// Phase timestamps for diagnostics (benchmarks/trace_swap_in.py builds with -DHISPARSE_TRACE):
// thread 0 of batch row 0's CTAs records the global timer at each mark and prints them on exit.
#ifdef HISPARSE_TRACE
__shared__ uint64_t trace_marks[8];
#define HISPARSE_START()                                                   \
  do {                                                                     \
    if (threadIdx.x == 0) {                                                \
      for (int k_ = 0; k_ < 8; ++k_) trace_marks[k_] = global_time_ns();   \
    }                                                                      \
  } while (0)
#define HISPARSE_MARK(k) \
  do {                    \
    if (threadIdx.x == 0) trace_marks[k] = global_time_ns(); \
  } while (0)
#define HISPARSE_DUMP(role)                                                                                    \
  do {                                                                                                         \
    if (threadIdx.x == 0 && blockIdx.x % p.batch == 0) {                                                       \
      printf("trace %s %d %llu %lld %lld %lld %lld %lld %lld %lld\n", role, int(blockIdx.x / p.batch),           \
             (unsigned long long)trace_marks[0], (long long)(trace_marks[1] - trace_marks[0]),                 \
             (long long)(trace_marks[2] - trace_marks[0]), (long long)(trace_marks[3] - trace_marks[0]),       \
             (long long)(trace_marks[4] - trace_marks[0]), (long long)(trace_marks[5] - trace_marks[0]),       \
             (long long)(trace_marks[6] - trace_marks[0]), (long long)(trace_marks[7] - trace_marks[0]));      \
    }                                                                                                          \
  } while (0)
#else
#define HISPARSE_START() \
  do {                    \
  } while (0)
#define HISPARSE_MARK(k) \
  do {                    \
  } while (0)
#define HISPARSE_DUMP(role) \
  do {                       \
  } while (0)
#endif

__device__ __forceinline__ int load_acquire(const int32_t* ptr) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ void store_release(int32_t* ptr, int value) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

// The last of the request's `splits` CTAs to arrive resets its flag and counters for the next launch.
__device__ __forceinline__ void arrive_done(const SwapInParams& p, int b) {
  if (atomicAdd(p.done + b, 1) == p.splits - 1) {
    p.done[b] = 0;
    p.flags[b] = 0;
    p.looked[b] = 0;
  }
}

// Spins (thread 0) until *counter reaches `value` (acquire), then the block goes on together.
__device__ __forceinline__ void wait_until_at_least(const int32_t* counter, int value) {
  if (threadIdx.x == 0) {
    while (load_acquire(counter) < value) __nanosleep(kSpinSleepNs);
  }
  __syncthreads();
}

// Counts a copier CTA in looked[b] once all its threads are done with their lookups (the caller
// synchronizes the block first): the release orders those loads before the planner's map update.
__device__ __forceinline__ void count_looked(int32_t* looked) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(looked) : "memory");
}

// One round of a thread's top-k entries: kBatch entries THREADS apart from `index`, counted from
// entry `begin`, -1 at or past `end` (also counted from `begin`); the first round takes the batch the
// kernel loaded up front. Every lookup loop of the kernel (resident translation, planner, copier)
// starts its rounds here, so the dependent loads after it cost one memory round trip per batch, not
// per entry.
template <int THREADS>
__device__ __forceinline__ void load_top_k_batch(int32_t (&t)[kBatch], const int32_t* top_k,
                                                 const int32_t (&first_batch)[kBatch], bool first_round, int begin,
                                                 int index, int end) {
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    const int i = index + u * THREADS;
    t[u] = first_round ? first_batch[u] : (i < end ? top_k[begin + i] : -1);
  }
}

// Entries per copier CTA: an equal share of the top-k, rounded up to whole warps.
__device__ __forceinline__ int copier_chunk(int top_k, int splits) {
  const int copiers = splits - 1;
  return ((top_k + copiers - 1) / copiers + kWarpSize - 1) / kWarpSize * kWarpSize;
}

// A copier CTA (part >= 1) of an offloaded request, owning entries [begin, end) of a chunk of
// `chunk` entries; see the file comment. Returns with the block converged; the caller arrives.
template <int THREADS>
__device__ __forceinline__ void copier(const SwapInParams& p, int b, int begin, int end, int chunk,
                                       const int32_t* top_k, const int32_t (&first_batch)[kBatch],
                                       const int32_t* positions_to_loc, const int16_t* token_slot, int32_t newest,
                                       uint8_t* smem, uint64_t* warp_sums) {
  const int tid = threadIdx.x;
  if (begin >= end) {  // no entries: counted at once
    if (tid == 0) count_looked(p.looked + b);
    return;
  }
  const int span = end - begin;
  const int vectors_per_row = static_cast<int>(p.row_bytes / kPieceBytes);
  int32_t* out = p.out + int64_t(b) * p.out_stride;

  // The role's area: the miss list (entry, host row, device row), then as many staged rows as fit.
  int32_t* list_entry = smem_region<int32_t>(smem, p.plan.role);
  int32_t* list_host = list_entry + chunk;
  int32_t* list_device = list_host + chunk;  // before the compaction: host row of a missed entry, else -1
  const int list_bytes = kCopierListInts * chunk * static_cast<int>(sizeof(int32_t));
  const int64_t staged_offset = p.plan.role + (list_bytes + kPieceBytes - 1) / kPieceBytes * kPieceBytes;
  int4* staged = smem_region<int4>(smem, staged_offset);
  const int capacity = max(0, static_cast<int>((p.plan.total_bytes - staged_offset) / p.row_bytes));

  if (p.late_copiers_ns > 0) {
    if (tid == 0) {
      const uint64_t until = global_time_ns() + static_cast<uint64_t>(p.late_copiers_ns);
      while (global_time_ns() < until) __nanosleep(kLateCopierSleepNs);
    }
    __syncthreads();
  }

  // C1: lookups; a miss records its host row.
  int local = 0;
  const int rounds = (span + THREADS * kBatch - 1) / (THREADS * kBatch);
  for (int round = 0; round < rounds; ++round) {
    int32_t t[kBatch];
    int16_t slot[kBatch];
    int32_t host_row[kBatch];
    load_top_k_batch<THREADS>(t, top_k, first_batch, round == 0, begin, tid + round * kBatch * THREADS, span);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) slot[u] = (t[u] >= 0 && t[u] < newest) ? token_slot[t[u]] : int16_t(0);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      host_row[u] = (t[u] >= 0 && t[u] < newest && slot[u] < 0) ? positions_to_loc[t[u]] : 0;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = tid + (round * kBatch + u) * THREADS;
      const bool miss = t[u] >= 0 && t[u] < newest && slot[u] < 0;
      if (e < span) list_device[e] = miss ? host_row[u] : -1;
      local += miss;
    }
  }
  uint64_t total;
  int rank = static_cast<int>(block_exclusive_scan<THREADS>(local, warp_sums, total));
  const int num_miss = static_cast<int>(total);
  HISPARSE_MARK(1);
  for (int round = 0; round < rounds; ++round) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = tid + (round * kBatch + u) * THREADS;
      if (e < span && list_device[e] >= 0) {
        list_entry[rank] = begin + e;
        list_host[rank] = list_device[e];
        ++rank;
      }
    }
  }

  if (tid == 0) count_looked(p.looked + b);  // the scan synchronized the block after the lookups
  if (num_miss == 0) {
    HISPARSE_DUMP("copy");
    return;
  }
  __syncthreads();

  // C2: stage the first missed rows in shared memory while the planner chooses the slots.
  const int staged_rows = min(num_miss, capacity);
  copy_rows_by<THREADS>(
      staged_rows, vectors_per_row, [&](int m, int v) { return load_piece(p.host_kv, list_host[m], p.row_bytes, v); },
      [&](int m, int v, int4 value) { staged[m * vectors_per_row + v] = value; });

  // C3: the planner's outputs name the device rows.
  HISPARSE_MARK(2);
  wait_until_at_least(p.flags + b, kPlanReady);
  HISPARSE_MARK(3);
  for (int m = tid; m < num_miss; m += THREADS) list_device[m] = __ldcg(out + list_entry[m]);
  __syncthreads();
  copy_rows_by<THREADS>(
      staged_rows, vectors_per_row, [&](int m, int v) { return staged[m * vectors_per_row + v]; },
      [&](int m, int v, int4 value) { store_piece(p.device_kv, list_device[m], p.row_bytes, v, value); });
  copy_rows_by<THREADS>(
      num_miss - staged_rows, vectors_per_row,
      [&](int m, int v) { return load_piece(p.host_kv, list_host[staged_rows + m], p.row_bytes, v); },
      [&](int m, int v, int4 value) { store_piece(p.device_kv, list_device[staged_rows + m], p.row_bytes, v, value); });
  HISPARSE_MARK(4);
  HISPARSE_DUMP("copy");
}

// The planner CTA (part 0) of an offloaded request; see the file comment. Looks every entry up,
// and if any missed: ranks the misses, selects the least recently used slots not hit, updates the
// tables, writes the missed entries' outputs and (without copiers) copies their rows.
template <int THREADS>
__device__ __forceinline__ void planner(const SwapInParams& p, int b, int K, int D, int32_t* out, const int32_t* top_k,
                                        const int32_t (&first_batch)[kBatch], const int32_t* positions_to_loc,
                                        int32_t buffer, int32_t now, int32_t newest, int16_t* token_slot,
                                        uint8_t* smem, uint64_t* warp_sums, int32_t* selection) {
  const int tid = threadIdx.x;
  // Victim selection: the coarse bucket of the youngest victim and the victims above it, the same
  // for its fine bucket.
  int32_t& coarse_bucket = selection[0];
  int32_t& coarse_above = selection[1];
  int32_t& fine_bucket = selection[2];
  int32_t& fine_above = selection[3];
  const int32_t* slot_rows = p.slot_rows + int64_t(buffer) * p.slot_rows_stride;
  const int hash_bits = static_cast<int>(p.plan.hash_bits);
  const int H = 1 << hash_bits;
  const int bitmap_words = (D + kBitmapWordBits - 1) / kBitmapWordBits;
  int32_t* keys = smem_region<int32_t>(smem, p.plan.keys);
  int32_t* first = smem_region<int32_t>(smem, p.plan.first);
  int32_t* hash_host_row = smem_region<int32_t>(smem, p.plan.hash_host_row);
  int32_t* hash_device_row = smem_region<int32_t>(smem, p.plan.hash_device_row);
  int32_t* row_of_slot = smem_region<int32_t>(smem, p.plan.row_of_slot);
  int32_t* token_of_slot = smem_region<int32_t>(smem, p.plan.token_of_slot);
  int32_t* entry_state = smem_region<int32_t>(smem, p.plan.entry_state);
  uint32_t* slot_hit = smem_region<uint32_t>(smem, p.plan.slot_hit);
  int32_t* coarse = smem_region<int32_t>(smem, p.plan.coarse);
  int32_t* fine = smem_region<int32_t>(smem, p.plan.fine);
  int16_t* miss_hash = smem_region<int16_t>(smem, p.plan.miss_hash);
  int16_t* victim_slot = smem_region<int16_t>(smem, p.plan.victim_slot);
  int16_t* slot_age = smem_region<int16_t>(smem, p.plan.slot_age);
  int16_t* entry_hash = smem_region<int16_t>(smem, p.plan.entry_hash);

  int32_t* slot_tokens = p.slot_tokens + int64_t(buffer) * p.slot_tokens_stride;
  int32_t* stamps = p.slot_stamps + int64_t(buffer) * p.slot_stamps_stride;

  // Each thread owns a contiguous range of slots and (miss path) of entries: scans rank in index
  // order.
  const int slots_per_thread = (D + THREADS - 1) / THREADS;
  const int slot_begin = min(D, tid * slots_per_thread);
  const int slot_end = min(D, slot_begin + slots_per_thread);

  // H1: every entry is looked up in the token -> slot map.
  {
    const int32_t newest_row = slot_rows[D];
    int lookups = 0;
    int missed = 0;
    for (int base = tid; base < K; base += THREADS * kBatch) {
      int32_t t[kBatch];
      int32_t slot[kBatch];
      load_top_k_batch<THREADS>(t, top_k, first_batch, base == tid, 0, base, K);
#pragma unroll
      for (int u = 0; u < kBatch; ++u) slot[u] = (t[u] >= 0 && t[u] < newest) ? token_slot[t[u]] : -1;
      int32_t row[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) row[u] = slot[u] >= 0 ? slot_rows[slot[u]] : -1;
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = base + u * THREADS;
        if (i >= K) continue;
        int32_t state = kDone;
        if (t[u] == newest && newest >= 0) {
          state = kNewest;
        } else if (t[u] >= 0 && t[u] < newest) {
          ++lookups;
          if (slot[u] >= 0) {
            state = slot[u];
          } else {
            ++missed;
            state = kMissBase - t[u];
          }
        }
        entry_state[i] = state;
        // Outputs of padding, the newest token and hits; hits stamp their slot.
        if (state >= 0) {
          out[i] = row[u];
          stamps[state] = now;
        } else if (state == kNewest) {
          out[i] = newest_row;
        } else if (state == kDone) {
          out[i] = -1;
        }
      }
    }
    // Lookup counter: one global atomic per CTA (one per warp made many CTAs wait on one address).
    // warp_sums is free until the miss path's first scan, which comes after another barrier.
    if (p.counters != nullptr) {
      lookups = static_cast<int>(__reduce_add_sync(0xffffffffu, static_cast<unsigned>(lookups)));
      if (tid % kWarpSize == 0) warp_sums[tid / kWarpSize] = static_cast<uint64_t>(lookups);
    }
    missed = __syncthreads_or(missed);
    if (p.counters != nullptr && tid < kWarpSize) {
      const unsigned warp_lookups = tid < THREADS / kWarpSize ? static_cast<unsigned>(warp_sums[tid]) : 0u;
      const unsigned block_lookups = __reduce_add_sync(0xffffffffu, warp_lookups);
      if (tid == 0 && block_lookups > 0) atomicAdd(p.counters, static_cast<unsigned long long>(block_lookups));
    }
    HISPARSE_MARK(1);

    if (!missed) {  // all hits: done (copiers find no miss and leave without waiting)
      if (p.splits > 1 && tid == 0) {
        arrive_done(p, b);
      }
      HISPARSE_DUMP("plan");
      return;
    }
  }

  // ---------------------------------------------------------------- miss path
  // Its scratch is cleared only now: on the hit path these ~9K shared-memory stores per CTA were
  // wasted and throttled the lookups (Nsight Compute, bs 128 hit-only: the MIO-throttle stall was
  // about a fifth of the samples); measured 0.2-0.5 us off a hit-only call at bs 1-32.
  for (int i = tid; i < H; i += THREADS) {
    keys[i] = kEmptyKey;
    first[i] = kNoFirst;
  }
  for (int j = tid; j < bitmap_words; j += THREADS) slot_hit[j] = 0;
  for (int j = tid; j < kCoarseBuckets + kFineBuckets; j += THREADS) {
    if (j < kCoarseBuckets) coarse[j] = 0;
    else fine[j - kCoarseBuckets] = 0;
  }
  __syncthreads();
  const int entries_per_thread = (K + THREADS - 1) / THREADS;
  const int entry_begin = min(K, tid * entries_per_thread);
  const int entry_end = min(K, entry_begin + entries_per_thread);
  const uint32_t mask = static_cast<uint32_t>(H - 1);

  // M1: mark the hit slots; insert the missed tokens into the hash set with their first entry
  // (and host row if the planner copies); stage the tokens, ages and device rows of the slots.
  for (int i0 = entry_begin; i0 < entry_end; i0 += kBatch) {
    int32_t state[kBatch];
    int32_t host_row[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) state[u] = i0 + u < entry_end ? entry_state[i0 + u] : kDone;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      host_row[u] = (p.splits == 1 && state[u] <= kMissBase) ? positions_to_loc[kMissBase - state[u]] : 0;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (state[u] >= 0) {
        atomicOr(slot_hit + (state[u] >> kBitmapWordShift), 1u << (state[u] & (kBitmapWordBits - 1)));
      } else if (state[u] <= kMissBase) {
        const int32_t token = kMissBase - state[u];
        uint32_t h = hash_of(token, hash_bits);
        while (true) {
          const int32_t prev = atomicCAS(keys + h, kEmptyKey, token);
          if (prev == kEmptyKey || prev == token) break;
          h = (h + 1u) & mask;
        }
        atomicMin(first + h, i0 + u);
        hash_host_row[h] = host_row[u];  // every duplicate writes the same value
        entry_hash[i0 + u] = static_cast<int16_t>(h);
      }
    }
  }
  for (int j0 = slot_begin; j0 < slot_end; j0 += kBatch) {
    int32_t stamp[kBatch];
    int32_t token[kBatch];
    int32_t row[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const bool mine = j0 + u < slot_end;
      stamp[u] = mine ? stamps[j0 + u] : 0;
      token[u] = mine ? slot_tokens[j0 + u] : -1;
      row[u] = mine ? slot_rows[j0 + u] : 0;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (j0 + u < slot_end) {
        const int age = now - stamp[u];
        slot_age[j0 + u] = static_cast<int16_t>(age < 0 ? 0 : (age > kAgeCap ? kAgeCap : age));
        token_of_slot[j0 + u] = token[u];
        row_of_slot[j0 + u] = row[u];
      }
    }
  }
  __syncthreads();

  HISPARSE_MARK(2);

  // M2: rank the misses (first occurrences, in entry order); histogram the ages of the slots not
  // hit by their high bits.
  uint64_t local = 0;
  for (int i = entry_begin; i < entry_end; ++i) {
    if (entry_state[i] <= kMissBase && first[entry_hash[i]] == i) ++local;
  }
  for (int j = slot_begin; j < slot_end; ++j) {
    if (slot_hit[j >> kBitmapWordShift] & (1u << (j & (kBitmapWordBits - 1)))) {
      slot_age[j] = -1;
    } else {
      atomicAdd(coarse + (slot_age[j] >> kFineBits), 1);
    }
  }
  uint64_t total;
  uint64_t rank = block_exclusive_scan<THREADS>(local, warp_sums, total);
  const int num_miss = static_cast<int>(total);
  for (int i = entry_begin; i < entry_end; ++i) {
    const int h = entry_hash[i];
    if (entry_state[i] <= kMissBase && first[h] == i) {
      miss_hash[rank] = static_cast<int16_t>(h);
      ++rank;
    }
  }
  if (tid < kWarpSize) warp_find_from_top(coarse, kCoarseBuckets, num_miss, &coarse_bucket, &coarse_above);
  __syncthreads();
  HISPARSE_MARK(3);

  // M3: within the coarse bucket of the youngest victim, histogram the low bits of the age.
  const int high = coarse_bucket;
  for (int j = slot_begin; j < slot_end; ++j) {
    const int age = slot_age[j];
    if (age >= 0 && (age >> kFineBits) == high) atomicAdd(fine + (age & (kFineBuckets - 1)), 1);
  }
  __syncthreads();
  if (tid < kWarpSize) warp_find_from_top(fine, kFineBuckets, num_miss - coarse_above, &fine_bucket, &fine_above);
  __syncthreads();
  const int youngest = (high << kFineBits) | fine_bucket;  // age of the youngest victim
  const int older_total = coarse_above + fine_above;  // victims older than it
  const int equal_needed = num_miss - older_total;

  // M4: victims in order: the older ones by slot, then the needed ones of the youngest age by slot.
  local = 0;
  for (int j = slot_begin; j < slot_end; ++j) {
    const int age = slot_age[j];
    if (age > youngest) local += 1;
    else if (age == youngest) local += 1ull << 32;
  }
  rank = block_exclusive_scan<THREADS>(local, warp_sums, total);
  int older_rank = static_cast<int>(rank & 0xffffffffu);
  int equal_rank = static_cast<int>(rank >> 32);
  for (int j = slot_begin; j < slot_end; ++j) {
    const int age = slot_age[j];
    if (age > youngest) {
      victim_slot[older_rank++] = static_cast<int16_t>(j);
    } else if (age == youngest) {
      if (equal_rank < equal_needed) victim_slot[older_total + equal_rank] = static_cast<int16_t>(j);
      ++equal_rank;
    }
  }
  __syncthreads();

  // The copiers must have looked the entries up before the map changes.
  HISPARSE_MARK(4);
  if (p.splits > 1) wait_until_at_least(p.looked + b, p.splits - 1);
  HISPARSE_MARK(5);

  // M5: the k-th miss takes the k-th victim: tables and the device rows of the misses.
  for (int k = tid; k < num_miss; k += THREADS) {
    const int h = miss_hash[k];
    const int16_t victim = victim_slot[k];
    const int32_t token = keys[h];
    const int32_t old_token = token_of_slot[victim];
    const int32_t device_row = row_of_slot[victim];
    if (old_token >= 0) token_slot[old_token] = -1;
    token_slot[token] = victim;
    slot_tokens[victim] = token;
    stamps[victim] = now;
    hash_device_row[h] = device_row;
  }
  __syncthreads();
  HISPARSE_MARK(6);

  // M6: outputs of the missed entries; with copiers they are the plan, published by the flag.
  for (int i = entry_begin; i < entry_end; ++i) {
    if (entry_state[i] <= kMissBase) out[i] = hash_device_row[entry_hash[i]];
  }
  if (tid == 0 && p.counters != nullptr) atomicAdd(p.counters + 1, static_cast<unsigned long long>(num_miss));
  if (p.splits > 1) {
    __syncthreads();
    if (tid == 0) {
      store_release(p.flags + b, kPlanReady);  // cumulative: covers the whole block's outputs
      arrive_done(p, b);
    }
    HISPARSE_MARK(7);
    HISPARSE_DUMP("plan");
    return;
  }

  // M7: the planner copies the missed rows itself.
  copy_rows_by<THREADS>(
      num_miss, static_cast<int>(p.row_bytes / kPieceBytes),
      [&](int k, int v) { return load_piece(p.host_kv, hash_host_row[miss_hash[k]], p.row_bytes, v); },
      [&](int k, int v, int4 value) { store_piece(p.device_kv, hash_device_row[miss_hash[k]], p.row_bytes, v, value); });
  HISPARSE_MARK(7);
  HISPARSE_DUMP("plan");
}

template <int THREADS>
__global__ void __launch_bounds__(THREADS) swap_in_kernel(const SwapInParams p) {
  static_assert(THREADS % kWarpSize == 0 && THREADS <= 1024, "block size");
  // Every byte of shared memory is in the host's plan (none is declared statically here).
  extern __shared__ __align__(16) uint8_t smem[];
  uint64_t* warp_sums = smem_region<uint64_t>(smem, p.plan.warp_sums);
  int32_t* selection = smem_region<int32_t>(smem, p.plan.selection);  // the planner's victim selection

  const int b = blockIdx.x % p.batch;
  const int part = blockIdx.x / p.batch;
  const int tid = threadIdx.x;
  const int K = p.num_top_k;
  const int D = p.buffer_size;
  HISPARSE_START();
  int32_t* out = p.out + int64_t(b) * p.out_stride;
  const int32_t* top_k = p.top_k_positions + int64_t(b) * p.top_k_stride;

  // Independent loads first: the real-batch size, this row's request and length, and the first
  // batch of this CTA's top-k entries (all of them for the planner, its chunk for a copier).
  const int num_real = *p.num_real_reqs;
  const int64_t req = load_index(p.req_pool_indices, p.req_pool_indices_is_64, b);
  const int64_t seq_len = load_index(p.seq_lens, p.seq_lens_is_64, b);
  const int chunk = part == 0 ? K : copier_chunk(K, p.splits);
  const int entries_begin = part == 0 ? 0 : min(K, (part - 1) * chunk);
  const int entries_end = min(K, entries_begin + chunk);
  int32_t first_batch[kBatch];
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    const int i = entries_begin + tid + u * THREADS;
    first_batch[u] = i < entries_end ? top_k[i] : -1;
  }
  if (b >= num_real) {
    if (part == 0) {
      for (int i = tid; i < K; i += THREADS) out[i] = -1;
    }
    return;
  }
  const int32_t* positions_to_loc = p.req_to_token + req * p.req_to_token_stride;
  const int32_t buffer = p.buffer_of_req[req];

  if (buffer < 0) {  // resident: translate positions to device rows
    if (part == 0) {
      for (int base = tid; base < K; base += THREADS * kBatch) {
        int32_t t[kBatch];
        int32_t loc[kBatch];
        load_top_k_batch<THREADS>(t, top_k, first_batch, base == tid, 0, base, K);
#pragma unroll
        for (int u = 0; u < kBatch; ++u) loc[u] = (t[u] >= 0 && t[u] < seq_len) ? positions_to_loc[t[u]] : -1;
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          if (base + u * THREADS < K) out[base + u * THREADS] = loc[u] >= 0 ? p.device_row_of_loc[loc[u]] : -1;
        }
      }
    }
    return;
  }

  const int32_t now = static_cast<int32_t>(seq_len);
  const int32_t newest = now - 1;
  int16_t* token_slot = p.token_slot + int64_t(buffer) * p.token_slot_stride;

  if (part != 0) {
    copier<THREADS>(p, b, entries_begin, entries_end, chunk, top_k, first_batch, positions_to_loc, token_slot, newest,
                    smem, warp_sums);
    __syncthreads();
    if (tid == 0) arrive_done(p, b);
    return;
  }

  planner<THREADS>(p, b, K, D, out, top_k, first_batch, positions_to_loc, buffer, now, newest, token_slot, smem,
                   warp_sums, selection);
}

struct CopyRowsParams {
  const uint64_t* src_layers;  // [layers] base addresses (device or pinned host)
  const uint64_t* dst_layers;  // [layers]
  const void* src_rows;        // [count] int32 or int64
  const void* dst_rows;        // [count] int32 or int64
  int src_rows_is_64;
  int dst_rows_is_64;
  int64_t count;
  int layers;
  int64_t row_bytes;           // multiple of 16
};

// Copies `count` rows of every layer. Each block copies one contiguous chunk of the flattened
// (layer, row, 16-byte piece) space; consecutive threads copy consecutive pieces and each thread
// has kCopyUnroll loads in flight. Index is uint32_t when the space fits (cheaper division).
template <int THREADS, typename Index>
__global__ void __launch_bounds__(THREADS) copy_rows_kernel(const CopyRowsParams p) {
  const Index vectors_per_row = static_cast<Index>(p.row_bytes / kPieceBytes);
  const Index per_layer = static_cast<Index>(p.count) * vectors_per_row;
  const Index total = per_layer * static_cast<Index>(p.layers);
  const Index step = static_cast<Index>(THREADS) * kCopyUnroll;
  const Index chunk = (total + gridDim.x * step - 1) / (gridDim.x * step) * step;
  const Index chunk_begin = static_cast<Index>(blockIdx.x) * chunk;
  const Index chunk_end = chunk_begin + chunk < total ? chunk_begin + chunk : total;
  for (Index base = chunk_begin + threadIdx.x; base < chunk_end; base += step) {
    int4 value[kCopyUnroll];
    int4* dst[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const Index g = base + static_cast<Index>(u) * THREADS;
      dst[u] = nullptr;
      if (g < chunk_end) {
        const Index layer = g / per_layer;
        const Index rest = g - layer * per_layer;
        const Index row = rest / vectors_per_row;
        const Index vector = rest - row * vectors_per_row;
        const int64_t src_row = load_index(p.src_rows, p.src_rows_is_64, static_cast<int>(row));
        const int64_t dst_row = load_index(p.dst_rows, p.dst_rows_is_64, static_cast<int>(row));
        const int4* src =
            reinterpret_cast<const int4*>(reinterpret_cast<const uint8_t*>(p.src_layers[layer]) + src_row * p.row_bytes) +
            vector;
        value[u] = __ldg(src);
        dst[u] = reinterpret_cast<int4*>(reinterpret_cast<uint8_t*>(p.dst_layers[layer]) + dst_row * p.row_bytes) + vector;
      }
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (dst[u] != nullptr) __stcg(dst[u], value[u]);
    }
  }
}

}  // namespace hisparse
