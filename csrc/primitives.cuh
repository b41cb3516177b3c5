// Device building blocks the kernels share (swap_in.cuh, copy_rows.cuh, decode_rows.cuh): index
// loads, a multiplicative hash, warp and block scans, a histogram search, the 16-byte row-copy loop,
// the global timer and the acquire / relaxed / release accesses of global memory. Nothing here knows
// an op's tables; raw pointers and sizes only.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace hisparse {

constexpr int kWarpSize = 32;

// Row copies (copy_rows_by below; copy_rows_kernel): 16-byte pieces, kCopyUnroll independent loads
// in flight per thread.
constexpr int kPieceBytes = 16;
constexpr int kCopyUnroll = 4;

// An int32 or int64 index array, chosen at run time (SGLang passes either for seq_lens and
// req_pool_indices).
__device__ __forceinline__ int64_t load_index(const void* ptr, int is_64, int i) {
  return is_64 ? static_cast<const int64_t*>(ptr)[i] : static_cast<const int32_t*>(ptr)[i];
}

// Fibonacci hashing: the top `bits` bits of key x 2^32 / golden ratio.
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

// The GPU's global timer in nanoseconds (swap_in's trace marks and test sleeps).
__device__ __forceinline__ uint64_t global_time_ns() {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// Global-memory accesses with the ordering they name, at GPU scope (the CTAs of one launch).
__device__ __forceinline__ int load_acquire(const int32_t* ptr) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

// A load that orders nothing after it (a first look at a flag; later work need not wait for it).
__device__ __forceinline__ int load_relaxed(const int32_t* ptr) {
  int value;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ void store_release(int32_t* ptr, int value) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

}  // namespace hisparse
