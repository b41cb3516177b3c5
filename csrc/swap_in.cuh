// HiSparse swap-in and row-copy kernels. Raw pointers and sizes only; the semantics are those of
// hisparse_sglang/ops/reference.py (swap_in, copy_rows), which these kernels match bit for bit.
//
// swap_in: grid = batch * splits CTAs. CTA (b, part) with b = blockIdx.x % batch and
// part = blockIdx.x / batch, so the planner CTAs (part 0) have the lowest block indices.
//   * padded batch row (b >= num_real_reqs): the planner writes -1 to the output row.
//   * resident request (buffer_of_req[r] < 0): the planner translates positions to device rows.
//   * offloaded request: the planner finds hits and misses, rewrites the LRU order and the slot
//     tables, writes the output row and publishes a copy plan (host row, device row) per miss;
//     all `splits` CTAs of the request then copy their share of the missed rows host -> device
//     (zero-copy reads of pinned host memory). With splits > 1 the helpers wait on a flag the
//     planner releases; the last CTA to finish resets the flag, so the kernel can be replayed in
//     a CUDA graph without host involvement.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace hisparse {

constexpr int kWarpSize = 32;
constexpr int kBatch = 4;  // independent global loads a thread issues before it needs the first
constexpr int32_t kEmptyKey = -1;
constexpr int32_t kNoFirst = 0x7fffffff;

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
  int16_t* lru_order;                // [NB, lru_stride] this layer
  int64_t lru_stride;
  const uint8_t* host_kv;            // pinned host rows (device-accessible)
  uint8_t* device_kv;                // device rows
  int64_t row_bytes;                 // multiple of 16
  int32_t* out;                      // [batch, out_stride]
  int64_t out_stride;
  unsigned long long* counters;      // [2] or nullptr: distinct lookups, misses
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
  bytes += hash * 4;            // keys
  bytes += hash * 4;            // first occurrence index
  bytes += hash * 2;            // slot holding the token (int16), -1 none
  bytes += size_t(buffer_size) * 4;  // copy of the slot -> token table
  bytes += size_t(buffer_size + 1) * 4;  // copy of the slot -> device row table (slot D included)
  bytes += size_t(top_k) * 2;   // hash index per entry (-1: padding or newest)
  bytes += size_t(top_k) * 2;   // hash index per miss rank
  bytes += size_t(top_k) * 2;   // evictable slot per miss rank
  bytes += size_t(buffer_size) * 2;  // copy of the LRU order
  bytes += (size_t(buffer_size) + 3) / 4 * 4;  // hit flag per slot
  return bytes;
}

__device__ __forceinline__ int64_t load_index(const void* ptr, int is_64, int i) {
  return is_64 ? static_cast<const int64_t*>(ptr)[i] : static_cast<const int32_t*>(ptr)[i];
}

__device__ __forceinline__ uint32_t hash_of(int32_t key, int bits) {
  return (static_cast<uint32_t>(key) * 2654435761u) >> (32 - bits);
}

__device__ __forceinline__ int find_key(const int32_t* keys, int32_t key, int bits) {
  const uint32_t mask = (1u << bits) - 1u;
  uint32_t h = hash_of(key, bits);
  while (true) {
    const int32_t k = keys[h];
    if (k == key) return static_cast<int>(h);
    if (k == kEmptyKey) return -1;
    h = (h + 1u) & mask;
  }
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
// value carries four 16-bit counters at once (no field overflows: every total is < 2^16).
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

// Copies rows [first, count) step `stride` of a copy plan, 16 bytes per thread access, with
// several independent loads in flight per thread.
template <int THREADS>
__device__ __forceinline__ void copy_planned_rows(
    const int32_t* plan, int count, int first, int stride, const uint8_t* src_base, uint8_t* dst_base,
    int64_t row_bytes) {
  constexpr int kUnroll = 4;
  const int vectors_per_row = static_cast<int>(row_bytes / 16);
  const int my_rows = count > first ? (count - first + stride - 1) / stride : 0;
  const int total = my_rows * vectors_per_row;
  for (int base = threadIdx.x; base < total; base += THREADS * kUnroll) {
    int4 value[kUnroll];
    uint8_t* dst[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int g = base + u * THREADS;
      dst[u] = nullptr;
      if (g < total) {
        const int row_index = first + (g / vectors_per_row) * stride;
        const int vector = g % vectors_per_row;
        const int32_t src_row = __ldcg(plan + 2 * row_index);
        const int32_t dst_row = __ldcg(plan + 2 * row_index + 1);
        const int4* src = reinterpret_cast<const int4*>(src_base + int64_t(src_row) * row_bytes) + vector;
        value[u] = __ldg(src);
        dst[u] = dst_base + int64_t(dst_row) * row_bytes + int64_t(vector) * 16;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (dst[u] != nullptr) __stcg(reinterpret_cast<int4*>(dst[u]), value[u]);
    }
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

template <int THREADS>
__global__ void __launch_bounds__(THREADS) swap_in_kernel(const SwapInParams p) {
  static_assert(THREADS % kWarpSize == 0 && THREADS <= 1024, "block size");
  __shared__ uint64_t warp_sums[THREADS / kWarpSize + 1];
  __shared__ int shared_count;

  const int b = blockIdx.x % p.batch;
  const int part = blockIdx.x / p.batch;
  const int tid = threadIdx.x;
  const int K = p.num_top_k;
  const int D = p.buffer_size;
  int32_t* out = p.out + int64_t(b) * p.out_stride;

  // Independent loads first: the real-batch size, this row's request and length.
  const int num_real = *p.num_real_reqs;
  const int64_t req = load_index(p.req_pool_indices, p.req_pool_indices_is_64, b);
  const int64_t seq_len = load_index(p.seq_lens, p.seq_lens_is_64, b);
  if (b >= num_real) {
    if (part == 0) {
      for (int i = tid; i < K; i += THREADS) out[i] = -1;
    }
    return;
  }
  const int32_t* top_k = p.top_k_positions + int64_t(b) * p.top_k_stride;
  const int32_t* positions_to_loc = p.req_to_token + req * p.req_to_token_stride;
  const int32_t buffer = p.buffer_of_req[req];

  if (buffer < 0) {  // resident: translate positions to device rows
    if (part == 0) {
      // Batches of independent loads per thread: the three dependent lookups cost three
      // memory round trips per batch, not per entry.
      for (int base = tid; base < K; base += THREADS * kBatch) {
        int32_t t[kBatch];
        int32_t loc[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) t[u] = base + u * THREADS < K ? top_k[base + u * THREADS] : -1;
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

  if (part != 0) {  // helper: wait for the plan, copy a share of the misses
    if (tid == 0) {
      while (load_acquire(p.flags + b) == 0) __nanosleep(64);
      shared_count = __ldcg(p.plan_count + b);
    }
    __syncthreads();
    copy_planned_rows<THREADS>(plan, shared_count, part, p.splits, p.host_kv, p.device_kv, p.row_bytes);
    __syncthreads();
    if (tid == 0 && atomicAdd(p.done + b, 1) == p.splits - 1) {
      p.done[b] = 0;
      p.flags[b] = 0;
    }
    return;
  }

  // ---------------------------------------------------------------- planner
  extern __shared__ __align__(16) uint8_t smem[];
  const int H = 1 << p.hash_bits;
  int32_t* keys = reinterpret_cast<int32_t*>(smem);
  int32_t* first = keys + H;
  int32_t* held_tokens = first + H;
  int32_t* row_of_slot = held_tokens + D;
  int16_t* token_slot = reinterpret_cast<int16_t*>(row_of_slot + D + 1);
  int16_t* entry_hash = token_slot + H;
  int16_t* miss_hash = entry_hash + K;
  int16_t* miss_slot = miss_hash + K;
  int16_t* lru_copy = miss_slot + K;
  uint8_t* slot_hit = reinterpret_cast<uint8_t*>(lru_copy + D);

  int32_t* slot_tokens = p.slot_tokens + int64_t(buffer) * p.slot_tokens_stride;
  int16_t* lru = p.lru_order + int64_t(buffer) * p.lru_stride;
  const int32_t newest = static_cast<int32_t>(seq_len - 1);

  for (int i = tid; i < H; i += THREADS) {
    keys[i] = kEmptyKey;
    first[i] = kNoFirst;
    token_slot[i] = -1;
  }
  for (int j = tid; j < D; j += THREADS) slot_hit[j] = 0;
  __syncthreads();

  // S1, two halves of the block at once so that their global loads overlap:
  //  - first half: classify the top-k entries, insert the distinct non-newest tokens with their
  //    first index (host rows are looked up later, for the misses only);
  //  - second half: stage the slot -> token, slot -> device row tables and the LRU order in shared
  //    memory.
  constexpr int kHalf = THREADS / 2;
  const uint32_t mask = static_cast<uint32_t>(H - 1);
  if (tid < kHalf) {
    const int32_t newest_row = slot_rows[D];
    for (int base = tid; base < K; base += kHalf * kBatch) {
      int32_t t[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) t[u] = base + u * kHalf < K ? top_k[base + u * kHalf] : -1;
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = base + u * kHalf;
        if (i >= K) continue;
        int16_t h_out = -1;
        if (t[u] < 0 || t[u] >= seq_len) {
          out[i] = -1;
        } else if (t[u] == newest) {
          out[i] = newest_row;
        } else {
          uint32_t h = hash_of(t[u], p.hash_bits);
          while (true) {
            const int32_t prev = atomicCAS(keys + h, kEmptyKey, t[u]);
            if (prev == kEmptyKey || prev == t[u]) break;
            h = (h + 1u) & mask;
          }
          atomicMin(first + h, i);
          h_out = static_cast<int16_t>(h);
        }
        entry_hash[i] = h_out;
      }
    }
  } else {
    constexpr int kSlotBatch = 2 * kBatch;
    if (tid == kHalf) row_of_slot[D] = slot_rows[D];
    for (int base = tid - kHalf; base < D; base += kHalf * kSlotBatch) {
      int32_t t[kSlotBatch];
      int32_t row[kSlotBatch];
      int16_t order[kSlotBatch];
#pragma unroll
      for (int u = 0; u < kSlotBatch; ++u) {
        const int j = base + u * kHalf;
        t[u] = j < D ? slot_tokens[j] : -1;
        row[u] = j < D ? slot_rows[j] : 0;
        order[u] = j < D ? lru[j] : 0;
      }
#pragma unroll
      for (int u = 0; u < kSlotBatch; ++u) {
        const int j = base + u * kHalf;
        if (j < D) {
          held_tokens[j] = t[u];
          row_of_slot[j] = row[u];
          lru_copy[j] = order[u];
        }
      }
    }
  }
  __syncthreads();

  // S2: hit detection over the LRU slots.
  for (int j = tid; j < D; j += THREADS) {
    const int32_t t = held_tokens[j];
    if (t >= 0) {
      const int h = find_key(keys, t, p.hash_bits);
      if (h >= 0) {
        slot_hit[j] = 1;
        token_slot[h] = static_cast<int16_t>(j);
      }
    }
  }
  __syncthreads();

  // S3: one block scan ranks two things at once, in four 16-bit fields:
  //  - over the entries (in entry order): distinct tokens (bits 0-15) and misses = first
  //    occurrences whose token no slot holds (bits 16-31);
  //  - over the LRU order: evictable slots (bits 32-47) and hit slots (bits 48-63).
  const int entries_per_thread = (K + THREADS - 1) / THREADS;
  const int entry_begin = min(K, tid * entries_per_thread);
  const int entry_end = min(K, entry_begin + entries_per_thread);
  const int slots_per_thread = (D + THREADS - 1) / THREADS;
  const int slot_begin = min(D, tid * slots_per_thread);
  const int slot_end = min(D, slot_begin + slots_per_thread);
  uint64_t local = 0;
  for (int i = entry_begin; i < entry_end; ++i) {
    const int h = entry_hash[i];
    if (h >= 0 && first[h] == i) local += token_slot[h] < 0 ? 0x10001ull : 0x1ull;
  }
  for (int position = slot_begin; position < slot_end; ++position) {
    local += slot_hit[lru_copy[position]] ? (1ull << 48) : (1ull << 32);
  }
  uint64_t totals;
  const uint64_t rank = block_exclusive_scan<THREADS>(local, warp_sums, totals);
  const int num_distinct = static_cast<int>(totals & 0xffff);
  const int num_miss = static_cast<int>((totals >> 16) & 0xffff);
  const int num_evictable = static_cast<int>((totals >> 32) & 0xffff);

  // S4: misses in entry order take the first num_miss evictable slots of the LRU walk; hits and
  // evictable slots keep their relative order. New order: [unused evictable | miss slots | hits].
  int miss_rank = static_cast<int>((rank >> 16) & 0xffff);
  for (int i = entry_begin; i < entry_end; ++i) {
    const int h = entry_hash[i];
    if (h >= 0 && first[h] == i && token_slot[h] < 0) miss_hash[miss_rank++] = static_cast<int16_t>(h);
  }
  int evict_rank = static_cast<int>((rank >> 32) & 0xffff);
  int hit_rank = static_cast<int>(rank >> 48);
  for (int position = slot_begin; position < slot_end; ++position) {
    const int16_t slot = lru_copy[position];
    int destination;
    if (slot_hit[slot]) {
      destination = num_evictable + hit_rank++;
    } else {
      const int e = evict_rank++;
      if (e < num_miss) {
        miss_slot[e] = slot;
        destination = num_evictable - num_miss + e;
      } else {
        destination = e - num_miss;
      }
    }
    lru[destination] = slot;
  }
  __syncthreads();

  // S5: assign misses to slots, publish the copy plan.
  for (int base = tid; base < num_miss; base += THREADS * kBatch) {
    int32_t host_row[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int k = base + u * THREADS;
      host_row[u] = k < num_miss ? positions_to_loc[keys[miss_hash[k]]] : 0;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int k = base + u * THREADS;
      if (k < num_miss) {
        const int h = miss_hash[k];
        const int16_t slot = miss_slot[k];
        token_slot[h] = slot;
        slot_tokens[slot] = keys[h];
        plan[2 * k] = host_row[u];
        plan[2 * k + 1] = row_of_slot[slot];
      }
    }
  }
  // Every writer of the plan fences before the flag is released (read by helper CTAs).
  if (p.splits > 1 && num_miss > 0) __threadfence();
  __syncthreads();
  if (tid == 0 && p.splits > 1) {
    p.plan_count[b] = num_miss;
    __threadfence();
    store_release(p.flags + b, 1);
  }

  // S6: output rows of the non-newest valid entries; statistics.
  for (int base = tid; base < K; base += THREADS * kBatch) {
    int32_t row[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * THREADS;
      const int h = i < K ? entry_hash[i] : -1;
      row[u] = h >= 0 ? row_of_slot[token_slot[h]] : -1;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * THREADS;
      if (i < K && entry_hash[i] >= 0) out[i] = row[u];
    }
  }
  if (tid == 0 && p.counters != nullptr) {
    atomicAdd(p.counters, static_cast<unsigned long long>(num_distinct));
    atomicAdd(p.counters + 1, static_cast<unsigned long long>(num_miss));
  }

  // S7: the planner's share of the copies.
  copy_planned_rows<THREADS>(plan, num_miss, 0, p.splits, p.host_kv, p.device_kv, p.row_bytes);
  if (p.splits > 1) {
    __syncthreads();
    if (tid == 0 && atomicAdd(p.done + b, 1) == p.splits - 1) {
      p.done[b] = 0;
      p.flags[b] = 0;
    }
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
