// Per-step row bookkeeping of a decode batch, one thread per request: which device row each
// request's previous token is backed up from, and which device row each new token is bound to.
// Reference twins: ops/reference.py::backup_rows and ::bind_rows.
#pragma once

#include <cstdint>

namespace hisparse {

// The tables both kernels read (the coordinator's, shared with the swap-in kernel).
struct DecodeTables {
  const int32_t* req_to_token;  // [R, C]: logical location (= host row) of each position
  int64_t req_to_token_stride;
  int32_t* device_row_of_loc;  // [N + 1]: device row of a logical location while resident
  const int32_t* buffer_of_req;  // [R]: buffer of an offloaded request
  const int32_t* slot_rows;  // [NB, D + page]: device row of each buffer slot
  int64_t slot_rows_stride;
  int buffer_size;  // D: slot D holds the newest token of an offloaded request
};

// Kinds of a bind entry besides a page ordinal (>= 0: first row of new_pages[ordinal]).
constexpr int64_t kBindContinue = -1;  // resident: the row after the previous token's row
constexpr int64_t kBindBufferSlot = -2;  // offloaded: its buffer's slot D

struct BackupRowsParams {
  DecodeTables tables;
  const int64_t* plan;  // [3, count]: slot, position, offloaded (0/1)
  int64_t* rows;  // [2, count]: device row, host row
  int64_t count;
};

struct BindRowsParams {
  DecodeTables tables;
  const int64_t* plan;  // [3, count]: slot, position of the new token, kind
  const int64_t* new_locs;  // [count]: logical location of each new token
  const int64_t* new_pages;  // device page ids for the kinds >= 0
  int64_t count;
  int64_t page_size;
};

__device__ __forceinline__ int64_t newest_slot_row(const DecodeTables& t, int64_t slot) {
  return t.slot_rows[int64_t(t.buffer_of_req[slot]) * t.slot_rows_stride + t.buffer_size];
}

__device__ __forceinline__ int64_t location_of(const DecodeTables& t, int64_t slot, int64_t position) {
  return t.req_to_token[slot * t.req_to_token_stride + position];
}

__global__ void backup_rows_kernel(const BackupRowsParams p) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.count) return;
  const int64_t slot = p.plan[i];
  const int64_t host_row = location_of(p.tables, slot, p.plan[p.count + i]);
  const bool offloaded = p.plan[2 * p.count + i] != 0;
  p.rows[i] = offloaded ? newest_slot_row(p.tables, slot) : int64_t(p.tables.device_row_of_loc[host_row]);
  p.rows[p.count + i] = host_row;
}

// A new location never equals another entry's previous location, so the map reads and writes
// of different threads do not overlap.
__global__ void bind_rows_kernel(const BindRowsParams p) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.count) return;
  const int64_t slot = p.plan[i];
  const int64_t position = p.plan[p.count + i];
  const int64_t kind = p.plan[2 * p.count + i];
  int64_t row;
  if (kind >= 0) {
    row = p.new_pages[kind] * p.page_size;
  } else if (kind == kBindContinue) {
    row = int64_t(p.tables.device_row_of_loc[location_of(p.tables, slot, position - 1)]) + 1;
  } else {
    row = newest_slot_row(p.tables, slot);
  }
  p.tables.device_row_of_loc[p.new_locs[i]] = static_cast<int32_t>(row);
}

}  // namespace hisparse
