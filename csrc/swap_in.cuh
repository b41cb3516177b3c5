// HiSparse swap-in and row-copy kernels. Raw pointers and sizes only; the semantics are those of
// hisparse_sglang/ops/reference.py (swap_in, copy_rows), which these kernels match bit for bit.
//
// swap_in: grid = batch * splits CTAs. CTA (b, part) with b = blockIdx.x % batch and
// part = blockIdx.x / batch, so the planner CTAs (part 0) have the lowest block indices.
//   * padded batch row (b >= num_real_reqs): the planner writes -1 to the output row.
//   * resident request (buffer_of_req[r] < 0): the planner translates positions to device rows.
//   * offloaded request: the planner looks every entry up in the token -> slot map (one load per
//     entry); a hit writes its slot's row and stamps the slot at once. Only if some entry missed
//     does the block go on: it deduplicates and ranks the misses
//     and publishes their host rows (plan stage 1), selects the least recently used slots not hit
//     (two histogram passes over the slots' ages), updates the tables and publishes the device
//     rows (plan stage 2). With splits > 1, helper CTAs start reading their share of the missed
//     host rows (zero-copy reads of pinned host memory) at stage 1 and write them at stage 2, so
//     the copy overlaps the slot selection; the planner copies its share after stage 2. The
//     stage is a per-request flag (0, 1, 2); the last CTA to finish resets it, so the kernel can
//     be replayed in a CUDA graph without host involvement.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace hisparse {

constexpr int kWarpSize = 32;
constexpr int kBatch = 4;  // independent global loads a thread issues before it needs the first
constexpr int32_t kEmptyKey = -1;
constexpr int32_t kNoFirst = 0x7fffffff;
constexpr int kAgeCap = 32767;     // reference.AGE_CAP
constexpr int kCoarseBuckets = 256;  // age >> 7
constexpr int kFineBuckets = 128;    // age & 127
// entry_state of an entry: >= 0 the slot it hit; kDone: padding; kNewest: the newest token;
// <= kMissBase: a miss, kMissBase - state is its token.
constexpr int32_t kDone = -1;
constexpr int32_t kNewest = -2;
constexpr int32_t kMissBase = -3;
// flags[b]: 0 before the plan, kSourcesReady when plan_count and the host rows are published,
// kPlanReady when the device rows are too.
constexpr int32_t kSourcesReady = 1;
constexpr int32_t kPlanReady = 2;

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
  int32_t* plan;                     // [batch, 2 * top_k]: (host row, device row) per miss
  int32_t* plan_count;               // [batch]
  int32_t* flags;                    // [batch], 0 between launches
  int32_t* done;                     // [batch], 0 between launches
  int batch;
  int num_top_k;                     // K <= buffer_size, K <= 8192
  int buffer_size;                   // D <= 32767
  int hash_bits;                     // hash table of 1 << hash_bits >= 2 * K entries
  int splits;
};

// Dynamic shared memory of a swap_in CTA, in bytes.
inline size_t swap_in_smem_bytes(int top_k, int buffer_size, int hash_bits) {
  const size_t hash = size_t(1) << hash_bits;
  size_t bytes = 0;
  bytes += hash * 4 * 4;                          // keys, first occurrence, host and device row of a miss
  bytes += size_t(buffer_size + 1) * 4;           // slot -> device row (slot D included)
  bytes += size_t(buffer_size) * 4;               // slot -> token
  bytes += size_t(top_k) * 4;                     // entry_state
  bytes += (size_t(buffer_size) + 31) / 32 * 4;   // hit bit per slot
  bytes += (kCoarseBuckets + kFineBuckets) * 4;   // age histograms
  bytes += size_t(top_k) * 2 * 2;                 // hash index per miss rank, victim slot per rank
  bytes += size_t(buffer_size) * 2;               // age per slot (-1: hit)
  bytes += size_t(top_k) * 2;                     // hash index of a missed entry
  return bytes;
}

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

constexpr int kCopyUnroll = 4;

// A CTA's share of a copy plan: rows first, first + stride, ... of the plan's `count` rows,
// flattened into (row, 16-byte piece) indices [0, total).
struct CopyShare {
  const int32_t* plan;  // (host row, device row) per planned row
  int first;
  int stride;
  int vectors_per_row;
  int total;

  __device__ __forceinline__ CopyShare(const int32_t* plan_, int count, int first_, int stride_, int64_t row_bytes)
      : plan(plan_), first(first_), stride(stride_), vectors_per_row(static_cast<int>(row_bytes / 16)) {
    const int my_rows = count > first ? (count - first + stride - 1) / stride : 0;
    total = my_rows * vectors_per_row;
  }
};

// One batch of a thread's copy: kCopyUnroll pieces, THREADS apart, starting at flat index `base`.
// load() reads the host pieces (it needs only the plan's host rows); store() writes them to the
// device rows, so the two may be separated by a wait for the device rows.
template <int THREADS>
struct CopyBatch {
  int4 value[kCopyUnroll];
  int row_index[kCopyUnroll];  // -1: no piece

  __device__ __forceinline__ void load(const CopyShare& share, int base, const uint8_t* src_base, int64_t row_bytes) {
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int g = base + u * THREADS;
      row_index[u] = -1;
      if (g < share.total) {
        row_index[u] = share.first + (g / share.vectors_per_row) * share.stride;
        const int32_t src_row = __ldcg(share.plan + 2 * row_index[u]);
        value[u] = __ldg(reinterpret_cast<const int4*>(src_base + int64_t(src_row) * row_bytes) +
                         g % share.vectors_per_row);
      }
    }
  }

  __device__ __forceinline__ void store(const CopyShare& share, int base, uint8_t* dst_base, int64_t row_bytes) const {
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (row_index[u] >= 0) {
        const int g = base + u * THREADS;
        const int32_t dst_row = __ldcg(share.plan + 2 * row_index[u] + 1);
        __stcg(reinterpret_cast<int4*>(dst_base + int64_t(dst_row) * row_bytes) + g % share.vectors_per_row, value[u]);
      }
    }
  }
};

// Copies a CTA's share of a copy plan from flat index `start` on, 16 bytes per thread access,
// with kCopyUnroll independent loads in flight per thread.
template <int THREADS>
__device__ __forceinline__ void copy_share(const CopyShare& share, const uint8_t* src_base, uint8_t* dst_base,
                                           int64_t row_bytes, int start = 0) {
  for (int base = start + threadIdx.x; base < share.total; base += THREADS * kCopyUnroll) {
    CopyBatch<THREADS> batch;
    batch.load(share, base, src_base, row_bytes);
    batch.store(share, base, dst_base, row_bytes);
  }
}

__device__ __forceinline__ int load_acquire(const int32_t* ptr) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ void store_release(int32_t* ptr, int value) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

// The last of the request's `splits` CTAs to arrive resets its flag and counter for the next launch.
__device__ __forceinline__ void arrive_done(const SwapInParams& p, int b) {
  if (atomicAdd(p.done + b, 1) == p.splits - 1) {
    p.done[b] = 0;
    p.flags[b] = 0;
  }
}

// Spins (thread 0) until flags[b] reaches `stage`, then the block goes on together.
__device__ __forceinline__ void wait_for_stage(const SwapInParams& p, int b, int stage) {
  if (threadIdx.x == 0) {
    while (load_acquire(p.flags + b) < stage) __nanosleep(64);
  }
  __syncthreads();
}

// A helper CTA: reads the first batch of its share of the missed host rows as soon as their
// sources are published, writes them once their device rows are, then copies the rest.
template <int THREADS>
__device__ __forceinline__ void helper_copy(const SwapInParams& p, const int32_t* plan, int b, int part,
                                            int* shared_count) {
  wait_for_stage(p, b, kSourcesReady);
  if (threadIdx.x == 0) *shared_count = __ldcg(p.plan_count + b);
  __syncthreads();
  const CopyShare share(plan, *shared_count, part, p.splits, p.row_bytes);
  if (share.total == 0) return;
  CopyBatch<THREADS> first_batch;
  first_batch.load(share, threadIdx.x, p.host_kv, p.row_bytes);
  wait_for_stage(p, b, kPlanReady);
  first_batch.store(share, threadIdx.x, p.device_kv, p.row_bytes);
  copy_share<THREADS>(share, p.host_kv, p.device_kv, p.row_bytes, THREADS * kCopyUnroll);
}

template <int THREADS>
__global__ void __launch_bounds__(THREADS) swap_in_kernel(const SwapInParams p) {
  static_assert(THREADS % kWarpSize == 0 && THREADS <= 1024, "block size");
  __shared__ uint64_t warp_sums[THREADS / kWarpSize + 1];
  __shared__ int shared_count;
  __shared__ int coarse_bucket, coarse_above, fine_bucket, fine_above;

  const int b = blockIdx.x % p.batch;
  const int part = blockIdx.x / p.batch;
  const int tid = threadIdx.x;
  const int K = p.num_top_k;
  const int D = p.buffer_size;
  int32_t* out = p.out + int64_t(b) * p.out_stride;
  const int32_t* top_k = p.top_k_positions + int64_t(b) * p.top_k_stride;

  // Independent loads first: the real-batch size, this row's request and length, and (planner)
  // the first batch of top-k entries.
  const int num_real = *p.num_real_reqs;
  const int64_t req = load_index(p.req_pool_indices, p.req_pool_indices_is_64, b);
  const int64_t seq_len = load_index(p.seq_lens, p.seq_lens_is_64, b);
  int32_t first_batch[kBatch];
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    const int i = tid + u * THREADS;
    first_batch[u] = (part == 0 && i < K) ? top_k[i] : -1;
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
      // Batches of independent loads per thread: the dependent lookups cost one memory round
      // trip each per batch, not per entry.
      for (int base = tid; base < K; base += THREADS * kBatch) {
        int32_t t[kBatch];
        int32_t loc[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int i = base + u * THREADS;
          t[u] = base == tid ? first_batch[u] : (i < K ? top_k[i] : -1);
        }
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

  const int32_t* slot_rows = p.slot_rows + int64_t(buffer) * p.slot_rows_stride;
  int32_t* plan = p.plan + int64_t(b) * 2 * K;

  if (part != 0) {  // helper: copy a share of the misses
    helper_copy<THREADS>(p, plan, b, part, &shared_count);
    __syncthreads();
    if (tid == 0) arrive_done(p, b);
    return;
  }

  // ---------------------------------------------------------------- planner
  extern __shared__ __align__(16) uint8_t smem[];
  const int H = 1 << p.hash_bits;
  const int bitmap_words = (D + 31) / 32;
  int32_t* keys = reinterpret_cast<int32_t*>(smem);
  int32_t* first = keys + H;
  int32_t* hash_host_row = first + H;
  int32_t* hash_device_row = hash_host_row + H;
  int32_t* row_of_slot = hash_device_row + H;
  int32_t* token_of_slot = row_of_slot + D + 1;
  int32_t* entry_state = token_of_slot + D;
  uint32_t* slot_hit = reinterpret_cast<uint32_t*>(entry_state + K);
  int32_t* coarse = reinterpret_cast<int32_t*>(slot_hit + bitmap_words);
  int32_t* fine = coarse + kCoarseBuckets;
  int16_t* miss_hash = reinterpret_cast<int16_t*>(fine + kFineBuckets);
  int16_t* victim_slot = miss_hash + K;
  int16_t* slot_age = victim_slot + K;
  int16_t* entry_hash = slot_age + D;

  int32_t* slot_tokens = p.slot_tokens + int64_t(buffer) * p.slot_tokens_stride;
  int32_t* stamps = p.slot_stamps + int64_t(buffer) * p.slot_stamps_stride;
  int16_t* token_slot = p.token_slot + int64_t(buffer) * p.token_slot_stride;
  const int32_t now = static_cast<int32_t>(seq_len);
  const int32_t newest = now - 1;

  // Each thread owns a contiguous range of slots and (miss path) of entries: scans rank in index
  // order.
  const int slots_per_thread = (D + THREADS - 1) / THREADS;
  const int slot_begin = min(D, tid * slots_per_thread);
  const int slot_end = min(D, slot_begin + slots_per_thread);

  // H1: every entry is looked up in the token -> slot map; the scratch of the miss path is
  // cleared meanwhile.
  {
    const int32_t newest_row = slot_rows[D];
    int lookups = 0;
    int missed = 0;
    for (int base = tid; base < K; base += THREADS * kBatch) {
      int32_t t[kBatch];
      int32_t slot[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = base + u * THREADS;
        t[u] = base == tid ? first_batch[u] : (i < K ? top_k[i] : -1);
      }
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
    for (int i = tid; i < H; i += THREADS) {
      keys[i] = kEmptyKey;
      first[i] = kNoFirst;
    }
    for (int j = tid; j < bitmap_words; j += THREADS) slot_hit[j] = 0;
    for (int j = tid; j < kCoarseBuckets + kFineBuckets; j += THREADS) coarse[j] = 0;
    if (p.counters != nullptr) {
#pragma unroll
      for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) lookups += __shfl_xor_sync(0xffffffffu, lookups, offset);
      if (tid % kWarpSize == 0 && lookups > 0) atomicAdd(p.counters, static_cast<unsigned long long>(lookups));
    }
    missed = __syncthreads_or(missed);

    if (!missed) {  // all hits: done
      if (p.splits > 1 && tid == 0) {
        p.plan_count[b] = 0;
        store_release(p.flags + b, kPlanReady);
        arrive_done(p, b);
      }
      return;
    }
  }

  // ---------------------------------------------------------------- miss path
  const int entries_per_thread = (K + THREADS - 1) / THREADS;
  const int entry_begin = min(K, tid * entries_per_thread);
  const int entry_end = min(K, entry_begin + entries_per_thread);
  const uint32_t mask = static_cast<uint32_t>(H - 1);

  // M1: mark the hit slots; insert the missed tokens into the hash set with their first entry
  // and host row; stage the tokens, ages and device rows of the slots.
  for (int i0 = entry_begin; i0 < entry_end; i0 += kBatch) {
    int32_t state[kBatch];
    int32_t host_row[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) state[u] = i0 + u < entry_end ? entry_state[i0 + u] : kDone;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) host_row[u] = state[u] <= kMissBase ? positions_to_loc[kMissBase - state[u]] : 0;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (state[u] >= 0) {
        atomicOr(slot_hit + (state[u] >> 5), 1u << (state[u] & 31));
      } else if (state[u] <= kMissBase) {
        const int32_t token = kMissBase - state[u];
        uint32_t h = hash_of(token, p.hash_bits);
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
  auto stage_slot = [&](int j, int32_t stamp, int32_t token) {
    token_of_slot[j] = token;
    const int age = now - stamp;
    slot_age[j] = static_cast<int16_t>(age < 0 ? 0 : (age > kAgeCap ? kAgeCap : age));
  };
  for (int j0 = slot_begin; j0 < slot_end; j0 += kBatch) {
    int32_t stamp[kBatch];
    int32_t token[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      stamp[u] = j0 + u < slot_end ? stamps[j0 + u] : 0;
      token[u] = j0 + u < slot_end ? slot_tokens[j0 + u] : -1;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (j0 + u < slot_end) stage_slot(j0 + u, stamp[u], token[u]);
    }
  }
  for (int base = tid; base <= D; base += THREADS * kBatch) {
    int32_t row[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) row[u] = base + u * THREADS <= D ? slot_rows[base + u * THREADS] : 0;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (base + u * THREADS <= D) row_of_slot[base + u * THREADS] = row[u];
    }
  }
  __syncthreads();

  // M2: rank the misses (first occurrences, in entry order) and publish their host rows (plan
  // stage 1); histogram the ages of the slots not hit by their high bits.
  uint64_t local = 0;
  for (int i = entry_begin; i < entry_end; ++i) {
    if (entry_state[i] <= kMissBase && first[entry_hash[i]] == i) ++local;
  }
  for (int j = slot_begin; j < slot_end; ++j) {
    if (slot_hit[j >> 5] & (1u << (j & 31))) {
      slot_age[j] = -1;
    } else {
      atomicAdd(coarse + (slot_age[j] >> 7), 1);
    }
  }
  uint64_t total;
  uint64_t rank = block_exclusive_scan<THREADS>(local, warp_sums, total);
  const int num_miss = static_cast<int>(total);
  for (int i = entry_begin; i < entry_end; ++i) {
    const int h = entry_hash[i];
    if (entry_state[i] <= kMissBase && first[h] == i) {
      miss_hash[rank] = static_cast<int16_t>(h);
      plan[2 * rank] = hash_host_row[h];
      ++rank;
    }
  }
  if (p.splits > 1) __threadfence();
  if (tid < kWarpSize) warp_find_from_top(coarse, kCoarseBuckets, num_miss, &coarse_bucket, &coarse_above);
  __syncthreads();
  if (p.splits > 1 && tid == 0) {
    p.plan_count[b] = num_miss;
    __threadfence();
    store_release(p.flags + b, kSourcesReady);
  }

  // M3: within the coarse bucket of the youngest victim, histogram the low bits of the age.
  const int high = coarse_bucket;
  for (int j = slot_begin; j < slot_end; ++j) {
    const int age = slot_age[j];
    if (age >= 0 && (age >> 7) == high) atomicAdd(fine + (age & (kFineBuckets - 1)), 1);
  }
  __syncthreads();
  if (tid < kWarpSize) warp_find_from_top(fine, kFineBuckets, num_miss - coarse_above, &fine_bucket, &fine_above);
  __syncthreads();
  const int youngest = (high << 7) | fine_bucket;  // age of the youngest victim
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

  // M5: the k-th miss takes the k-th victim: tables, device rows of the plan (stage 2) and of the
  // missed entries' outputs.
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
    plan[2 * k + 1] = device_row;
    hash_device_row[h] = device_row;
  }
  // Every writer of the plan fences before the flag is released (read by helper CTAs).
  if (p.splits > 1) __threadfence();
  __syncthreads();
  if (tid == 0) {
    if (p.splits > 1) store_release(p.flags + b, kPlanReady);
    if (p.counters != nullptr) atomicAdd(p.counters + 1, static_cast<unsigned long long>(num_miss));
  }

  // M6: outputs of the missed entries.
  for (int i = entry_begin; i < entry_end; ++i) {
    if (entry_state[i] <= kMissBase) out[i] = hash_device_row[entry_hash[i]];
  }

  // M7: the planner's share of the copies.
  copy_share<THREADS>(CopyShare(plan, num_miss, 0, p.splits, p.row_bytes), p.host_kv, p.device_kv, p.row_bytes);
  if (p.splits > 1) {
    __syncthreads();
    if (tid == 0) arrive_done(p, b);
  }
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
// has kUnroll loads in flight. Index is uint32_t when the space fits (cheaper division).
template <int THREADS, typename Index>
__global__ void __launch_bounds__(THREADS) copy_rows_kernel(const CopyRowsParams p) {
  constexpr int kUnroll = 4;
  const Index vectors_per_row = static_cast<Index>(p.row_bytes / 16);
  const Index per_layer = static_cast<Index>(p.count) * vectors_per_row;
  const Index total = per_layer * static_cast<Index>(p.layers);
  const Index step = static_cast<Index>(THREADS) * kUnroll;
  const Index chunk = (total + gridDim.x * step - 1) / (gridDim.x * step) * step;
  const Index chunk_begin = static_cast<Index>(blockIdx.x) * chunk;
  const Index chunk_end = chunk_begin + chunk < total ? chunk_begin + chunk : total;
  for (Index base = chunk_begin + threadIdx.x; base < chunk_end; base += step) {
    int4 value[kUnroll];
    int4* dst[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
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
    for (int u = 0; u < kUnroll; ++u) {
      if (dst[u] != nullptr) __stcg(dst[u], value[u]);
    }
  }
}

}  // namespace hisparse
