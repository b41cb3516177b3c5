// Per-step row bookkeeping of a decode batch.
//
// * bind_rows (host plan, one thread per entry): binds the new token of an offloaded request to
//   its buffer's slot D, and maps every location of the logical page a resident request starts
//   to the rows of a fresh device page (the page's later tokens need no binding).
// * backup_newest (no host plan; CUDA-graph capturable): copies each request's newest token of
//   one layer from its device row to its host row (= its logical location), right after the
//   forward wrote it. One warp per batch row.
//
// Reference twins: ops/reference.py::bind_rows and ::backup_newest.
#pragma once

#include <cstdint>

#include "primitives.cuh"  // load_index, kWarpSize

namespace hisparse {

// Launch of both kernels: kDecodeRowThreads per block; backup_newest gives each batch row one warp.
constexpr int kDecodeRowThreads = 128;
constexpr int kBackupNewestRowsPerBlock = kDecodeRowThreads / kWarpSize;

// Bind kind besides a page ordinal (>= 0: the new token starts a page, mapped to new_pages[ordinal]).
constexpr int64_t kBindBufferSlot = -2;  // offloaded: its buffer's slot D

struct BindRowsParams {
  int32_t* device_row_of_loc;  // [N + 1]: device row of a logical location while on the GPU
  const int32_t* buffer_of_req;  // [R]: buffer of an offloaded request
  const int32_t* slot_rows;  // [NB, D + page]: device row of each buffer slot
  int64_t slot_rows_stride;
  int64_t buffer_size;  // D: slot D holds the newest token of an offloaded request
  const int64_t* plan;  // [3, count]: batch row, slot, kind
  const int64_t* new_locs;  // [B]: logical location of each batch row's new token
  const int64_t* new_pages;  // device page ids for the kinds >= 0
  int64_t count;
  int64_t page_size;
};

struct BackupNewestParams {
  const int32_t* req_to_token;  // [R, C]
  int64_t req_to_token_stride;
  const int32_t* device_row_of_loc;  // [N + 1]
  const void* req_pool_indices;  // [B] int32 or int64
  const void* seq_lens;  // [B] int32 or int64: the newest token is at position seq_len - 1
  int req_pool_indices_is_64;
  int seq_lens_is_64;
  const int32_t* num_real_reqs;  // [1]: rows >= this are CUDA-graph padding
  const uint4* device_kv;  // one layer's device rows, row_words 16-byte words each
  uint4* host_kv;  // the same layer's pinned host rows
  int64_t batch;
  int64_t row_words;
  int fence_system;  // other processes read host_kv: make the stores visible system-wide before exiting
};

// New locations are distinct and a fresh page's locations belong to its request alone, so the
// threads' map writes never overlap.
__global__ void bind_rows_kernel(const BindRowsParams p) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.count) return;
  const int64_t loc = p.new_locs[p.plan[i]];
  const int64_t slot = p.plan[p.count + i];
  const int64_t kind = p.plan[2 * p.count + i];
  if (kind == kBindBufferSlot) {
    p.device_row_of_loc[loc] = p.slot_rows[int64_t(p.buffer_of_req[slot]) * p.slot_rows_stride + p.buffer_size];
    return;
  }
  const int64_t first_row = p.new_pages[kind] * p.page_size;
  for (int64_t offset = 0; offset < p.page_size; ++offset) {
    p.device_row_of_loc[loc + offset] = static_cast<int32_t>(first_row + offset);
  }
}

__global__ void backup_newest_kernel(const BackupNewestParams p) {
  const int64_t warps_per_block = blockDim.x / kWarpSize;
  const int64_t b = int64_t(blockIdx.x) * warps_per_block + threadIdx.x / kWarpSize;
  if (b >= p.batch || b >= int64_t(*p.num_real_reqs)) return;
  const int64_t position = load_index(p.seq_lens, p.seq_lens_is_64, b) - 1;
  if (position < 0) return;
  const int64_t slot = load_index(p.req_pool_indices, p.req_pool_indices_is_64, b);
  const int64_t host_row = p.req_to_token[slot * p.req_to_token_stride + position];
  const int64_t device_row = p.device_row_of_loc[host_row];
  if (device_row <= 0) return;  // not on the GPU: nothing new to back up
  const uint4* src = p.device_kv + device_row * p.row_words;
  uint4* dst = p.host_kv + host_row * p.row_words;
  for (int64_t w = threadIdx.x % kWarpSize; w < p.row_words; w += kWarpSize) dst[w] = src[w];
  // A host pool shared by the TP ranks of a node: the other ranks read these rows in a later step,
  // after the collectives that follow this kernel on this rank's stream. The fence makes this
  // thread's stores to host memory visible to every device and the host before any later store of
  // this thread, hence before the kernel completes and the collective starts
  // (docs/shared-host-pool.md, "Ordering").
  if (p.fence_system) __threadfence_system();
}

}  // namespace hisparse
