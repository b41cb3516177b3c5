// copy_rows: for every layer, rows copied from one set of row indices to another (any direction:
// pinned host to device, device to host, device to device). The host launch is hisparse_copy_rows in
// swap_in_binding.cu; the reference twin is ops/reference.py::copy_rows.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "primitives.cuh"  // load_index, kPieceBytes, kCopyUnroll

namespace hisparse {

// Launch: kCopyRowsThreads per block, at most kCopyRowsBlocksPerSM blocks per multiprocessor unless
// the caller caps the grid (4 x 512 = the 2048 resident threads of an sm_90 multiprocessor).
constexpr int kCopyRowsThreads = 512;
constexpr int kCopyRowsBlocksPerSM = 4;

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
