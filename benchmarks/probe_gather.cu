// Probe of the two fixed costs that bound the swap-in kernel (no torch, no project code):
//   launch  an empty kernel of the swap-in's shape (1024 threads, 0 or 126 KB of dynamic shared
//           memory, 1..128 CTAs) timed like bench_swap_in.py times a call: a GPU-side spin, then
//           start event, kernel, end event; median of many.
//   gather  scattered zero-copy reads of R random pinned-host rows of 1152 B into device rows
//           with N CTAs, by three methods: 16-byte loads (4 or 8 in flight per thread) and
//           the bulk-copy engine (cp.async.bulk, one row per copy, completing on an mbarrier).
// Build and run on the GPU machine:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/probe benchmarks/probe_gather.cu && /tmp/probe
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#define CHECK(x)                                                                 \
  do {                                                                           \
    cudaError_t e_ = (x);                                                        \
    if (e_ != cudaSuccess) {                                                     \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

constexpr int kRow = 1152;
constexpr int kVec = kRow / 16;

__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

__global__ void empty_kernel(int* sink) {
  extern __shared__ int empty_smem[];
  if (sink != nullptr && threadIdx.x == 0) sink[blockIdx.x] = 1;
}

// One dependent load then a store per thread: the smallest kernel that does memory work.
__global__ void touch_kernel(const int* in, int* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = in[i] + 1;
}

template <int UNROLL>
__global__ void __launch_bounds__(1024) gather_ld(const uint8_t* host, uint8_t* dev, const int* src, const int* dst,
                                                  int rows) {
  const int per_block = (rows + gridDim.x - 1) / gridDim.x;
  const int begin = blockIdx.x * per_block;
  const int end = min(rows, begin + per_block);
  const int total = (end - begin) * kVec;
  for (int base = threadIdx.x; base < total; base += blockDim.x * UNROLL) {
    int4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int g = base + u * blockDim.x;
      if (g < total) {
        const int r = begin + g / kVec;
        v[u] = __ldg(reinterpret_cast<const int4*>(host + int64_t(src[r]) * kRow) + g % kVec);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int g = base + u * blockDim.x;
      if (g < total) {
        const int r = begin + g / kVec;
        __stcg(reinterpret_cast<int4*>(dev + int64_t(dst[r]) * kRow) + g % kVec, v[u]);
      }
    }
  }
}

// Bulk-copy engine: thread 0 issues one cp.async.bulk per row into shared memory (a batch of
// `stage` rows), every thread waits on the mbarrier, then the block writes the rows out.
__global__ void __launch_bounds__(1024) gather_bulk(const uint8_t* host, uint8_t* dev, const int* src, const int* dst,
                                                    int rows, int stage) {
  extern __shared__ __align__(128) uint8_t bulk_smem[];
  uint8_t* smem = bulk_smem;
  __shared__ __align__(8) uint64_t bar;
  const int per_block = (rows + gridDim.x - 1) / gridDim.x;
  const int begin = blockIdx.x * per_block;
  const int end = min(rows, begin + per_block);
  const uint32_t bar_addr = static_cast<uint32_t>(__cvta_generic_to_shared(&bar));
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar_addr));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  uint32_t phase = 0;
  for (int r0 = begin; r0 < end; r0 += stage) {
    const int n = min(stage, end - r0);
    if (threadIdx.x == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_addr), "r"(n * kRow) : "memory");
      for (int k = 0; k < n; ++k) {
        const uint32_t dst_smem = static_cast<uint32_t>(__cvta_generic_to_shared(smem + k * kRow));
        const uint8_t* from = host + int64_t(src[r0 + k]) * kRow;
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst_smem),
            "l"(from), "r"(kRow), "r"(bar_addr)
            : "memory");
      }
    }
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(bar_addr), "r"(phase)
          : "memory");
    }
    phase ^= 1;
    for (int g = threadIdx.x; g < n * kVec; g += blockDim.x) {
      const int k = g / kVec;
      __stcg(reinterpret_cast<int4*>(dev + int64_t(dst[r0 + k]) * kRow) + g % kVec,
             reinterpret_cast<const int4*>(smem + k * kRow)[g % kVec]);
    }
    __syncthreads();
  }
}

template <typename F>
float median_us(F launch, int reps = 40) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < reps + 3; ++i) {
    spin<<<1, 1>>>(200000);
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (i >= 3) t.push_back(ms * 1000.f);
  }
  CHECK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  const bool with_bulk = argc < 2 || atoi(argv[1]) != 0;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  const int big_smem = 129024;
  CHECK(cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, big_smem));
  CHECK(cudaFuncSetAttribute(gather_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  int* sink;
  CHECK(cudaMalloc(&sink, 1 << 20));
  int* scratch;
  CHECK(cudaMalloc(&scratch, 64 << 20));

  printf("\n== launch: empty kernel, 1024 threads (us, spin + events, median of 40)\n");
  for (int grid : {1, 17, 64, 128}) {
    for (int smem : {0, big_smem}) {
      const float us = median_us([&] { empty_kernel<<<grid, 1024, smem>>>(sink); });
      printf("launch grid %4d smem %6d: %6.2f us\n", grid, smem, us);
    }
  }
  for (int grid : {1, 128}) {
    const float us = median_us([&] { touch_kernel<<<grid, 1024>>>(scratch, scratch + (16 << 20)); });
    printf("touch  grid %4d           : %6.2f us (one load + store per thread)\n", grid, us);
  }

  const int64_t host_rows = 1 << 20;  // 1.2 GB of pinned rows
  uint8_t* host;
  CHECK(cudaHostAlloc(&host, host_rows * kRow, cudaHostAllocMapped));
  for (int64_t i = 0; i < host_rows * kRow; i += 4096) host[i] = uint8_t(i >> 12);
  const int max_rows = 131072;
  uint8_t* dev;
  CHECK(cudaMalloc(&dev, int64_t(max_rows) * kRow));
  std::vector<int> src(max_rows), dst(max_rows);
  srand(7);
  for (int i = 0; i < max_rows; ++i) {
    src[i] = int((int64_t(rand()) * 2654435761ll) % host_rows);
    dst[i] = i;
  }
  std::random_shuffle(dst.begin(), dst.end());
  int *d_src, *d_dst;
  CHECK(cudaMalloc(&d_src, max_rows * 4));
  CHECK(cudaMalloc(&d_dst, max_rows * 4));
  CHECK(cudaMemcpy(d_src, src.data(), max_rows * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_dst, dst.data(), max_rows * 4, cudaMemcpyHostToDevice));

  printf("\n== gather: R random 1152-B pinned rows -> device, N CTAs of 1024 threads (us and GB/s)\n");
  for (int rows : {410, 3279, 131072}) {
    {
      const float us = median_us([&] {
        CHECK(cudaMemcpyAsync(dev, host, int64_t(rows) * kRow, cudaMemcpyHostToDevice));
      });
      printf("rows %6d memcpy contiguous          : %8.2f us %6.1f GB/s\n", rows, us, rows * double(kRow) / us / 1e3);
    }
    for (int ctas : {8, 16, 32, 64, 128, 132}) {
      const float a = median_us([&] { gather_ld<4><<<ctas, 1024>>>(host, dev, d_src, d_dst, rows); });
      const float b = median_us([&] { gather_ld<8><<<ctas, 1024>>>(host, dev, d_src, d_dst, rows); });
      printf("rows %6d ctas %4d ld4 %8.2f us %6.1f GB/s | ld8 %8.2f us %6.1f GB/s", rows, ctas, a,
             rows * double(kRow) / a / 1e3, b, rows * double(kRow) / b / 1e3);
      if (with_bulk) {
        const int stage = 96;  // 108 KB of rows per batch
        const float c = median_us([&] {
          gather_bulk<<<ctas, 1024, stage * kRow>>>(host, dev, d_src, d_dst, rows, stage);
        });
        printf(" | bulk %8.2f us %6.1f GB/s", c, rows * double(kRow) / c / 1e3);
      }
      printf("\n");
      fflush(stdout);
    }
  }
  // Check the gathered bytes of the last run.
  std::vector<uint8_t> got(kRow);
  int bad = 0;
  for (int i = 0; i < 64; ++i) {
    CHECK(cudaMemcpy(got.data(), dev + int64_t(dst[i]) * kRow, kRow, cudaMemcpyDeviceToHost));
    for (int j = 0; j < kRow; ++j) bad += got[j] != host[int64_t(src[i]) * kRow + j];
  }
  printf("\ncheck: %d wrong bytes in 64 rows\n", bad);
  return bad != 0;
}
