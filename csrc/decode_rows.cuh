// Per-step row bookkeeping of a decode batch, and of a speculative verify step.
//
// * bind_rows (host plan, one thread per entry): binds the new token of an offloaded request to
//   its buffer's slot D, and maps every location of the logical page a resident request starts
//   to the rows of a fresh device page (the page's later tokens need no binding).
// * backup_newest (no host plan; CUDA-graph capturable): copies each request's newest token of
//   one layer from its device row to its host row (= its logical location), right after the
//   forward wrote it. One warp per batch row.
// * bind_verify_slots (no host plan; one thread per batch row and verify position): before a
//   target-verify forward, maps the locations of positions s .. s + T - 1 of every offloaded request
//   to its buffer's verify slots D + kVerifySlotBase + j.
// * commit_accepted (no host plan; one warp per batch row, verify position and layer, plus one per
//   batch row and layer for slot D): after acceptance, copies the accepted positions s .. s + a - 1
//   of every layer from device to host, and an offloaded request's newest accepted token from its
//   verify slot into slot D. The shape is fixed ([B, T + 1] x layers), the accept lengths are read on
//   the device.
//
// * cap_accepted (no host plan; one thread per batch row): after acceptance, caps a row's accept length
//   at the first verify position swap_in_positions could not serve (verify_limit), drops the capped
//   positions from accept_index, and resets verify_limit for the next step.
//
// * verify_page_table (no host plan; one thread per entry): once per target-verify forward, the page table
//   through which SGLang's fused top-k maps a selected position p (table[i, p / P] x P + p % P): a resident
//   request's rows get the device page of each logical page (its pages are mapped whole), so the top-k
//   yields device rows; an offloaded request's rows get the identity, so it yields positions for
//   swap_in_positions.
//
// The verify kernels read s (seq_lens) and a (accept_lens) on the device: no host synchronization, and
// a CUDA graph may capture them.
//
// Reference twins: ops/reference.py::bind_rows, ::backup_newest, ::bind_verify_slots, ::commit_accepted,
// ::cap_accepted, ::verify_page_table.
#pragma once

#include <cstdint>

#include "primitives.cuh"      // load_index, kWarpSize
#include "swap_in_config.h"    // kVerifySlotBase

namespace hisparse {

// Launch of every kernel here: kDecodeRowThreads per block; backup_newest gives each batch row one warp,
// commit_accepted each row copy (a batch row, a position or slot D, a layer) one warp.
constexpr int kDecodeRowThreads = 128;
constexpr int kBackupNewestRowsPerBlock = kDecodeRowThreads / kWarpSize;
constexpr int kCommitCopiesPerBlock = kDecodeRowThreads / kWarpSize;

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

struct BindVerifySlotsParams {
  const void* req_pool_indices;  // [B] int32 or int64
  const void* seq_lens;  // [B] int32 or int64: s, the committed length
  int req_pool_indices_is_64;
  int seq_lens_is_64;
  const int32_t* num_real_reqs;  // [1]: rows >= this are left alone
  const int32_t* req_to_token;  // [R, C]
  int64_t req_to_token_stride;
  int64_t context;  // C: positions at or past it have no location (skipped)
  int32_t* device_row_of_loc;  // [N + 1], written
  const int32_t* buffer_of_req;  // [R]: -1 resident (left alone)
  const int32_t* slot_rows;  // [NB, D + page]
  int64_t slot_rows_stride;
  int64_t buffer_size;  // D
  int64_t batch;
  int64_t num_positions;  // T
};

struct CommitAcceptedParams {
  const void* req_pool_indices;  // [B] int32 or int64
  const void* seq_lens;  // [B] int32 or int64: s before this verify
  const void* accept_lens;  // [B] int32 or int64: a, accepted positions
  int req_pool_indices_is_64;
  int seq_lens_is_64;
  int accept_lens_is_64;
  const int32_t* num_real_reqs;  // [1]: rows >= this are skipped
  const int32_t* req_to_token;  // [R, C]
  int64_t req_to_token_stride;
  int64_t context;  // C
  const int32_t* device_row_of_loc;  // [N + 1]
  const int32_t* buffer_of_req;  // [R]
  const int32_t* slot_rows;  // [NB, D + page]
  int64_t slot_rows_stride;
  int64_t buffer_size;  // D
  const uint64_t* device_layers;  // [L] base addresses of the device KV of each layer
  const uint64_t* host_layers;  // [L] base addresses of the pinned host KV of each layer
  int64_t layers;
  int64_t row_words;  // 16-byte words per row
  int64_t batch;
  int64_t num_positions;  // T
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

// Thread (b, j): the location of position s + j of batch row b's request, if offloaded, maps to verify
// slot D + kVerifySlotBase + j of its buffer. Requests in a batch are distinct, so no two threads write
// the same map entry.
__global__ void bind_verify_slots_kernel(const BindVerifySlotsParams p) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.batch * p.num_positions) return;
  const int64_t b = i / p.num_positions;
  const int64_t j = i - b * p.num_positions;
  if (b >= int64_t(*p.num_real_reqs)) return;
  const int64_t slot = load_index(p.req_pool_indices, p.req_pool_indices_is_64, b);
  const int32_t buffer = p.buffer_of_req[slot];
  if (buffer < 0) return;
  const int64_t position = load_index(p.seq_lens, p.seq_lens_is_64, b) + j;
  if (position < 0 || position >= p.context) return;  // no location (a precondition of the reference)
  const int64_t loc = p.req_to_token[slot * p.req_to_token_stride + position];
  if (loc < 0) return;  // not allocated (the reference's precondition)
  p.device_row_of_loc[loc] = p.slot_rows[int64_t(buffer) * p.slot_rows_stride + p.buffer_size + kVerifySlotBase + j];
}

// Warp w of the grid is copy (b, j, layer) with w = (b * (T + 1) + j) * L + layer: for j < a, the row of
// position s + j goes from its device row (device_row_of_loc of its location) to its host row (the
// location); j == T copies an offloaded request's verify slot D + kVerifySlotBase + a - 1 into slot D.
// Rejected positions (j >= a), a == 0 and rows >= num_real_reqs copy nothing; so does an accept length
// outside [0, T], which the reference refuses (the kernel cannot raise: a precondition here). The rows
// read (the accepted positions' device rows, the verify slots) are never the rows written (host rows,
// slot D), so the copies do not depend on one another.
__global__ void commit_accepted_kernel(const CommitAcceptedParams p) {
  const int64_t warps_per_block = blockDim.x / kWarpSize;
  const int64_t w = int64_t(blockIdx.x) * warps_per_block + threadIdx.x / kWarpSize;
  const int64_t copies_per_row = (p.num_positions + 1) * p.layers;
  if (w >= p.batch * copies_per_row) return;
  const int64_t b = w / copies_per_row;
  const int64_t rest = w - b * copies_per_row;
  const int64_t j = rest / p.layers;
  const int64_t layer = rest - j * p.layers;
  if (b >= int64_t(*p.num_real_reqs)) return;
  const int64_t accepted = load_index(p.accept_lens, p.accept_lens_is_64, b);
  if (accepted < 1 || accepted > p.num_positions || (j < p.num_positions && j >= accepted)) return;
  const int64_t slot = load_index(p.req_pool_indices, p.req_pool_indices_is_64, b);
  const uint4* src;
  uint4* dst;
  uint4* device_kv = reinterpret_cast<uint4*>(p.device_layers[layer]);
  if (j < p.num_positions) {
    const int64_t position = load_index(p.seq_lens, p.seq_lens_is_64, b) + j;
    if (position < 0 || position >= p.context) return;
    const int64_t loc = p.req_to_token[slot * p.req_to_token_stride + position];
    if (loc < 0) return;  // not allocated (the reference's precondition)
    const int64_t device_row = p.device_row_of_loc[loc];
    if (device_row < 0) return;  // an unbound location (the reference's precondition)
    src = device_kv + device_row * p.row_words;
    dst = reinterpret_cast<uint4*>(p.host_layers[layer]) + loc * p.row_words;
  } else {
    const int32_t buffer = p.buffer_of_req[slot];
    if (buffer < 0) return;
    const int32_t* rows = p.slot_rows + int64_t(buffer) * p.slot_rows_stride + p.buffer_size;
    src = device_kv + int64_t(rows[kVerifySlotBase + accepted - 1]) * p.row_words;
    dst = device_kv + int64_t(rows[0]) * p.row_words;
  }
  for (int64_t word = threadIdx.x % kWarpSize; word < p.row_words; word += kWarpSize) dst[word] = src[word];
}

struct CapAcceptedParams {
  int32_t* verify_limit;  // [>= B]: first position not served (kNoVerifyLimit: all were); reset here
  void* accept_lens;  // [B] int32 or int64, in/out: positions accepted, the root included
  int accept_lens_is_64;
  int32_t* accept_index;  // [B, width] in/out: accepted entries, -1 after the last
  int64_t width;
  unsigned long long* counters;  // [2] or nullptr: rows capped, positions dropped
  int64_t batch;
};

// Thread b: a row whose accept length exceeds its limit accepts the positions before the limit (at
// least the root: a limit below 1 counts as 1, a precondition the kernel cannot raise).
__global__ void cap_accepted_kernel(const CapAcceptedParams p) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= p.batch) return;
  const int64_t limit = max(int64_t(p.verify_limit[b]), int64_t(1));
  p.verify_limit[b] = kNoVerifyLimit;
  const int64_t accepted = load_index(p.accept_lens, p.accept_lens_is_64, b);
  if (accepted <= limit) return;
  for (int64_t i = limit; i < p.width; ++i) p.accept_index[b * p.width + i] = -1;
  if (p.accept_lens_is_64) static_cast<int64_t*>(p.accept_lens)[b] = limit;
  else static_cast<int32_t*>(p.accept_lens)[b] = static_cast<int32_t>(limit);
  if (p.counters != nullptr) {
    atomicAdd(p.counters, 1ull);
    atomicAdd(p.counters + 1, static_cast<unsigned long long>(accepted - limit));
  }
}

struct VerifyPageTableParams {
  const int32_t* page_table;  // [B x T, width]: logical page ids, row i of batch row i / num_positions
  int64_t page_table_stride;
  const void* req_pool_indices;  // [B] int32 or int64
  int req_pool_indices_is_64;
  const int32_t* buffer_of_req;  // [R]: -1 = resident
  const int32_t* device_row_of_loc;  // [N + 1]: a resident page's start maps to its device page's start
  int64_t num_pages;  // N / page_size: a logical page id outside [0, num_pages) maps to page 0
  int64_t page_size;
  int32_t* out;  // [B x T, width]
  int64_t out_stride;
  int64_t width;
  int64_t entries;  // B x T x width
  int64_t num_positions;  // T
};

// Thread e: entry (i, w) = (e / width, e % width) of the table.
__global__ void verify_page_table_kernel(const VerifyPageTableParams p) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= p.entries) return;
  const int64_t i = e / p.width;
  const int64_t w = e % p.width;
  const int64_t req = load_index(p.req_pool_indices, p.req_pool_indices_is_64, static_cast<int>(i / p.num_positions));
  int32_t value = static_cast<int32_t>(w);
  if (p.buffer_of_req[req] < 0) {
    const int64_t page = p.page_table[i * p.page_table_stride + w];
    value = (page >= 0 && page < p.num_pages)
                ? static_cast<int32_t>(p.device_row_of_loc[page * p.page_size] / p.page_size)
                : 0;
  }
  p.out[i * p.out_stride + w] = value;
}

}  // namespace hisparse
