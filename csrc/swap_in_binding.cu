// tvm-ffi entry points of the HiSparse kernels: argument checks, then one kernel launch on the
// stream the caller passes (torch's current stream, also under CUDA-graph capture).
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

#include <cuda_runtime.h>

#include <cstdint>

#include <sstream>
#include <string>

#include "decode_rows.cuh"
#include "swap_in.cuh"

namespace {

using tvm::ffi::TensorView;

template <typename T>
T* data_of(const TensorView& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

void require(bool condition, const std::string& message) {
  if (!condition) TVM_FFI_THROW(ValueError) << message;
}

bool is_int(const TensorView& t, int bits) {
  return t.dtype().code == kDLInt && t.dtype().bits == bits && t.dtype().lanes == 1;
}

bool is_uint(const TensorView& t, int bits) {
  return t.dtype().code == kDLUInt && t.dtype().bits == bits && t.dtype().lanes == 1;
}

bool on_cuda(const TensorView& t) { return t.device().device_type == kDLCUDA; }

bool host_accessible(const TensorView& t) {
  // Pinned host memory is device-accessible under unified addressing; torch reports it as CPU.
  return t.device().device_type == kDLCPU || t.device().device_type == kDLCUDAHost || on_cuda(t);
}

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << what << " failed: " << cudaGetErrorString(status);
  }
}

int64_t row_bytes_of(const TensorView& t) {
  require(t.ndim() >= 1 && t.size(0) > 0, "KV tensor must have rows along dim 0");
  const int64_t element_bytes = (t.dtype().bits * t.dtype().lanes + 7) / 8;
  return t.numel() / t.size(0) * element_bytes;
}

int hash_bits_for(int top_k) {
  int bits = 1;
  while ((1 << bits) < 2 * top_k) ++bits;
  return bits;
}

// Raises (never lowers) the kernel's dynamic shared-memory limit; the one place that sets it.
template <int THREADS>
void ensure_smem(size_t smem) {
  static size_t configured = 48 * 1024;
  if (smem > configured) {
    check_cuda(
        cudaFuncSetAttribute(hisparse::swap_in_kernel<THREADS>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
        "cudaFuncSetAttribute(swap_in)");
    configured = smem;
  }
}

template <int THREADS>
void launch_swap_in(const hisparse::SwapInParams& params, size_t smem, cudaStream_t stream) {
  ensure_smem<THREADS>(smem);
  const int grid = params.batch * params.splits;
  hisparse::swap_in_kernel<THREADS><<<grid, THREADS, smem, stream>>>(params);
  check_cuda(cudaGetLastError(), "swap_in launch");
}

template <int THREADS>
int64_t occupancy(size_t smem) {
  int blocks = 0;
  ensure_smem<THREADS>(smem);
  check_cuda(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, hisparse::swap_in_kernel<THREADS>, THREADS, smem),
      "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return blocks;
}

}  // namespace

// Device rows of one layer's top-k tokens; see ops/reference.py::swap_in for the semantics.
void hisparse_swap_in(
    TensorView top_k, TensorView seq_lens, TensorView req_pool_indices, TensorView num_real_reqs,
    TensorView req_to_token, TensorView device_row_of_loc, TensorView buffer_of_req, TensorView slot_rows,
    TensorView slot_tokens, TensorView slot_stamps, TensorView token_slot, TensorView host_kv, TensorView device_kv, TensorView out,
    TensorView counters, TensorView sync, int64_t splits, int64_t threads, int64_t late_copiers_ns, int64_t stream) {
  require(top_k.ndim() == 2 && is_int(top_k, 32) && on_cuda(top_k), "top_k must be int32 [batch, top_k] on CUDA");
  const int64_t batch = top_k.size(0);
  const int64_t K = top_k.size(1);
  require(top_k.stride(1) == 1, "top_k rows must be contiguous");
  require(seq_lens.ndim() == 1 && seq_lens.size(0) == batch && (is_int(seq_lens, 32) || is_int(seq_lens, 64)),
          "seq_lens must be int32/int64 [batch]");
  require(req_pool_indices.ndim() == 1 && req_pool_indices.size(0) == batch &&
              (is_int(req_pool_indices, 32) || is_int(req_pool_indices, 64)),
          "req_pool_indices must be int32/int64 [batch]");
  require(num_real_reqs.numel() >= 1 && is_int(num_real_reqs, 32), "num_real_reqs must be int32 [1]");
  require(req_to_token.ndim() == 2 && is_int(req_to_token, 32) && req_to_token.stride(1) == 1,
          "req_to_token must be int32 [R, C], rows contiguous");
  require(device_row_of_loc.ndim() == 1 && is_int(device_row_of_loc, 32), "device_row_of_loc must be int32 [N + 1]");
  require(buffer_of_req.ndim() == 1 && is_int(buffer_of_req, 32), "buffer_of_req must be int32 [R]");
  require(slot_tokens.ndim() == 2 && is_int(slot_tokens, 32) && slot_tokens.stride(1) == 1,
          "slot_tokens must be int32 [NB, D] for one layer");
  const int64_t D = slot_tokens.size(1);
  require(slot_rows.ndim() == 2 && is_int(slot_rows, 32) && slot_rows.stride(1) == 1 && slot_rows.size(1) > D,
          "slot_rows must be int32 [NB, D + page]");
  require(slot_stamps.ndim() == 2 && is_int(slot_stamps, 32) && slot_stamps.size(1) == D && slot_stamps.stride(1) == 1,
          "slot_stamps must be int32 [NB, D] for one layer");
  require(token_slot.ndim() == 2 && is_int(token_slot, 16) && token_slot.stride(1) == 1 &&
              token_slot.size(1) >= req_to_token.size(1),
          "token_slot must be int16 [NB, C'] for one layer with C' >= req_to_token's width");
  require(slot_stamps.size(0) == slot_tokens.size(0) && token_slot.size(0) == slot_tokens.size(0) &&
              slot_rows.size(0) >= slot_tokens.size(0),
          "slot_rows, slot_tokens, slot_stamps and token_slot must have one row per buffer");
  require(K <= D, "top_k must not exceed device_buffer_size");
  require(K <= 8192, "top_k above 8192 is not supported by the swap-in kernel");
  require(D <= 32767, "device_buffer_size above 32767 is not supported");
  require(out.ndim() == 2 && is_int(out, 32) && out.size(0) == batch && out.size(1) == K && out.stride(1) == 1,
          "out must be int32 [batch, top_k]");
  require(host_accessible(host_kv), "host_kv must be pinned host memory");
  require(on_cuda(device_kv), "device_kv must be on CUDA");
  const int64_t row_bytes = row_bytes_of(device_kv);
  require(row_bytes == row_bytes_of(host_kv), "host and device KV rows differ in size");
  require(row_bytes % 16 == 0, "KV rows must be a multiple of 16 bytes");
  require(splits >= 1, "splits must be >= 1");
  require(counters.numel() == 0 || (is_int(counters, 64) && counters.numel() >= 2), "counters must be int64 [2] or empty");
  require(late_copiers_ns >= 0 && late_copiers_ns < (int64_t(1) << 31), "late_copiers_ns out of range");
  // sync = [flags | done | looked], capacity rows each, all zero between launches.
  require(is_int(sync, 32) && on_cuda(sync) && sync.numel() % 3 == 0 && sync.numel() / 3 >= batch,
          "sync workspace too small");
  if (batch == 0) return;

  const int64_t capacity = sync.numel() / 3;
  int32_t* sync_data = data_of<int32_t>(sync);
  hisparse::SwapInParams p{};
  p.top_k_positions = data_of<int32_t>(top_k);
  p.top_k_stride = top_k.stride(0);
  p.seq_lens = data_of<void>(seq_lens);
  p.seq_lens_is_64 = is_int(seq_lens, 64);
  p.req_pool_indices = data_of<void>(req_pool_indices);
  p.req_pool_indices_is_64 = is_int(req_pool_indices, 64);
  p.num_real_reqs = data_of<int32_t>(num_real_reqs);
  p.req_to_token = data_of<int32_t>(req_to_token);
  p.req_to_token_stride = req_to_token.stride(0);
  p.device_row_of_loc = data_of<int32_t>(device_row_of_loc);
  p.buffer_of_req = data_of<int32_t>(buffer_of_req);
  p.slot_rows = data_of<int32_t>(slot_rows);
  p.slot_rows_stride = slot_rows.stride(0);
  p.slot_tokens = data_of<int32_t>(slot_tokens);
  p.slot_tokens_stride = slot_tokens.stride(0);
  p.slot_stamps = data_of<int32_t>(slot_stamps);
  p.slot_stamps_stride = slot_stamps.stride(0);
  p.token_slot = data_of<int16_t>(token_slot);
  p.token_slot_stride = token_slot.stride(0);
  p.host_kv = data_of<uint8_t>(host_kv);
  p.device_kv = data_of<uint8_t>(device_kv);
  p.row_bytes = row_bytes;
  p.out = data_of<int32_t>(out);
  p.out_stride = out.stride(0);
  p.counters = counters.numel() ? reinterpret_cast<unsigned long long*>(data_of<int64_t>(counters)) : nullptr;
  p.flags = sync_data;
  p.done = sync_data + capacity;
  p.looked = sync_data + 2 * capacity;
  p.batch = static_cast<int>(batch);
  p.num_top_k = static_cast<int>(K);
  p.buffer_size = static_cast<int>(D);
  p.hash_bits = hash_bits_for(static_cast<int>(K));
  p.splits = static_cast<int>(splits);
  p.late_copiers_ns = static_cast<int>(late_copiers_ns);

  const size_t smem = hisparse::swap_in_smem_bytes(p.num_top_k, p.buffer_size, p.hash_bits);
  p.smem_bytes = static_cast<int>(smem);
  const auto cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  switch (threads) {
    case 256: launch_swap_in<256>(p, smem, cuda_stream); break;
    case 512: launch_swap_in<512>(p, smem, cuda_stream); break;
    case 1024: launch_swap_in<1024>(p, smem, cuda_stream); break;
    default: TVM_FFI_THROW(ValueError) << "threads must be 256, 512 or 1024, got " << threads;
  }
}

// Resident swap_in CTAs per multiprocessor for a (threads, top_k, buffer_size) shape.
int64_t hisparse_swap_in_occupancy(int64_t threads, int64_t top_k, int64_t buffer_size) {
  const size_t smem = hisparse::swap_in_smem_bytes(int(top_k), int(buffer_size), hash_bits_for(int(top_k)));
  switch (threads) {
    case 256: return occupancy<256>(smem);
    case 512: return occupancy<512>(smem);
    case 1024: return occupancy<1024>(smem);
    default: TVM_FFI_THROW(ValueError) << "threads must be 256, 512 or 1024, got " << threads;
  }
  return 0;
}

// For every layer l: dst_layers[l][dst_rows[i]] = src_layers[l][src_rows[i]] (any direction).
void hisparse_copy_rows(
    TensorView src_layers, TensorView dst_layers, TensorView src_rows, TensorView dst_rows, int64_t row_bytes,
    int64_t max_blocks, int64_t stream) {
  require(on_cuda(src_layers) && is_uint(src_layers, 64) && src_layers.ndim() == 1, "src_layers must be uint64 [L] on CUDA");
  require(on_cuda(dst_layers) && is_uint(dst_layers, 64) && dst_layers.numel() == src_layers.numel(),
          "dst_layers must be uint64 [L] on CUDA");
  require(on_cuda(src_rows) && (is_int(src_rows, 32) || is_int(src_rows, 64)), "src_rows must be int32/int64 on CUDA");
  require(on_cuda(dst_rows) && (is_int(dst_rows, 32) || is_int(dst_rows, 64)) && dst_rows.numel() == src_rows.numel(),
          "dst_rows must be int32/int64 on CUDA, as many as src_rows");
  require(row_bytes > 0 && row_bytes % 16 == 0, "row_bytes must be a positive multiple of 16");
  const int64_t count = src_rows.numel();
  if (count == 0 || src_layers.numel() == 0) return;
  hisparse::CopyRowsParams p{};
  p.src_layers = data_of<uint64_t>(src_layers);
  p.dst_layers = data_of<uint64_t>(dst_layers);
  p.src_rows = data_of<void>(src_rows);
  p.dst_rows = data_of<void>(dst_rows);
  p.src_rows_is_64 = is_int(src_rows, 64);
  p.dst_rows_is_64 = is_int(dst_rows, 64);
  p.count = count;
  p.layers = static_cast<int>(src_layers.numel());
  p.row_bytes = row_bytes;
  constexpr int kThreads = 512;
  const int64_t total = count * (row_bytes / 16) * p.layers;
  int multiprocessors = 0;
  check_cuda(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, src_layers.device().device_id),
             "cudaDeviceGetAttribute");
  int64_t blocks = (total + kThreads * 4 - 1) / (kThreads * 4);
  const int64_t block_limit = max_blocks > 0 ? max_blocks : 4 * int64_t(multiprocessors);
  if (blocks > block_limit) blocks = block_limit;
  const auto cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  if (total + int64_t(blocks) * kThreads * 8 < (int64_t(1) << 32)) {
    hisparse::copy_rows_kernel<kThreads, uint32_t><<<int(blocks), kThreads, 0, cuda_stream>>>(p);
  } else {
    hisparse::copy_rows_kernel<kThreads, uint64_t><<<int(blocks), kThreads, 0, cuda_stream>>>(p);
  }
  check_cuda(cudaGetLastError(), "copy_rows launch");
}

namespace {

// The tables of the decode-row kernels; slot_rows may have no buffer yet (then no entry reads it).
void require_plan(const TensorView& plan, const char* name) {
  require(on_cuda(plan) && plan.ndim() == 2 && plan.size(0) == 3 && is_int(plan, 64) &&
              (plan.size(1) == 0 || (plan.stride(1) == 1 && plan.stride(0) == plan.size(1))),
          std::string(name) + " must be a contiguous int64 [3, n] tensor on CUDA");
}

constexpr int kDecodeRowThreads = 128;
constexpr int kBackupNewestThreads = 128;  // four batch rows (one warp each) per block

int decode_row_blocks(int64_t count) { return static_cast<int>((count + kDecodeRowThreads - 1) / kDecodeRowThreads); }

}  // namespace

// Copies each real batch row's newest token (position seq_lens[b] - 1 of request slot
// req_pool_indices[b]) of one layer from its device row to its host row (its logical location).
void hisparse_backup_newest(
    TensorView req_pool_indices, TensorView seq_lens, TensorView num_real_reqs, TensorView req_to_token,
    TensorView device_row_of_loc, TensorView device_kv, TensorView host_kv, int64_t stream) {
  const int64_t batch = req_pool_indices.ndim() == 1 ? req_pool_indices.size(0) : -1;
  require(on_cuda(req_pool_indices) && batch >= 0 && (is_int(req_pool_indices, 32) || is_int(req_pool_indices, 64)) &&
              (batch == 0 || req_pool_indices.stride(0) == 1),
          "backup_newest: req_pool_indices must be a contiguous int32/int64 [B] tensor on CUDA");
  require(on_cuda(seq_lens) && seq_lens.ndim() == 1 && seq_lens.size(0) == batch &&
              (is_int(seq_lens, 32) || is_int(seq_lens, 64)) && (batch == 0 || seq_lens.stride(0) == 1),
          "backup_newest: seq_lens must be a contiguous int32/int64 [B] tensor on CUDA, B = " + std::to_string(batch));
  require(on_cuda(num_real_reqs) && num_real_reqs.numel() == 1 && is_int(num_real_reqs, 32),
          "backup_newest: num_real_reqs must be an int32 [1] tensor on CUDA");
  require(on_cuda(req_to_token) && req_to_token.ndim() == 2 && is_int(req_to_token, 32) && req_to_token.stride(1) == 1,
          "backup_newest: req_to_token must be int32 [R, C] on CUDA, rows contiguous");
  require(on_cuda(device_row_of_loc) && device_row_of_loc.ndim() == 1 && is_int(device_row_of_loc, 32),
          "backup_newest: device_row_of_loc must be int32 [N + 1] on CUDA");
  require(on_cuda(device_kv) && host_accessible(host_kv) && !on_cuda(host_kv),
          "backup_newest: device_kv must be on CUDA and host_kv in pinned host memory");
  cudaPointerAttributes host_attributes{};
  const cudaError_t host_query = cudaPointerGetAttributes(&host_attributes, data_of<char>(host_kv));
  if (host_query != cudaSuccess) cudaGetLastError();  // a failed query must not leak into later calls
  require(host_query == cudaSuccess && host_attributes.type == cudaMemoryTypeHost,
          "backup_newest: host_kv is not pinned (page-locked) host memory; the kernel writes it directly");
  const int64_t row_bytes = row_bytes_of(device_kv);
  require(row_bytes_of(host_kv) == row_bytes,
          "backup_newest: device rows of " + std::to_string(row_bytes) + " bytes but host rows of " +
              std::to_string(row_bytes_of(host_kv)) + " bytes");
  require(row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(data_of<char>(device_kv)) % 16 == 0 &&
              reinterpret_cast<uintptr_t>(data_of<char>(host_kv)) % 16 == 0,
          "backup_newest: rows must be 16-byte aligned multiples of 16 bytes, got " + std::to_string(row_bytes) +
              "-byte rows");
  if (batch == 0) return;
  hisparse::BackupNewestParams p{};
  p.req_to_token = data_of<int32_t>(req_to_token);
  p.req_to_token_stride = req_to_token.stride(0);
  p.device_row_of_loc = data_of<int32_t>(device_row_of_loc);
  p.req_pool_indices = data_of<void>(req_pool_indices);
  p.req_pool_indices_is_64 = is_int(req_pool_indices, 64);
  p.seq_lens = data_of<void>(seq_lens);
  p.seq_lens_is_64 = is_int(seq_lens, 64);
  p.num_real_reqs = data_of<int32_t>(num_real_reqs);
  p.device_kv = data_of<uint4>(device_kv);
  p.host_kv = data_of<uint4>(host_kv);
  p.batch = batch;
  p.row_words = row_bytes / 16;
  const int64_t rows_per_block = kBackupNewestThreads / 32;
  const int blocks = static_cast<int>((batch + rows_per_block - 1) / rows_per_block);
  hisparse::backup_newest_kernel<<<blocks, kBackupNewestThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(p);
  check_cuda(cudaGetLastError(), "backup_newest launch");
}

// Binds the new token of batch row plan[0, i] (request slot plan[1, i], location new_locs[row]):
// kind kBindBufferSlot maps the location to the slot's buffer slot D; kind k >= 0 maps the
// page_size locations from it (a page start) to the rows of device page new_pages[k].
void hisparse_bind_rows(
    TensorView plan, TensorView new_locs, TensorView new_pages, TensorView device_row_of_loc, TensorView buffer_of_req,
    TensorView slot_rows, int64_t buffer_size, int64_t page_size, int64_t stream) {
  require_plan(plan, "plan");
  const int64_t count = plan.size(1);
  require(on_cuda(new_locs) && new_locs.ndim() == 1 && new_locs.size(0) >= count && is_int(new_locs, 64) &&
              (new_locs.size(0) == 0 || new_locs.stride(0) == 1),
          "bind_rows: new_locs must be a contiguous int64 [B] tensor on CUDA with B >= the plan's " +
              std::to_string(count) + " entries");
  require(on_cuda(new_pages) && new_pages.ndim() == 1 && is_int(new_pages, 64) &&
              (new_pages.numel() == 0 || new_pages.stride(0) == 1),
          "bind_rows: new_pages must be a contiguous int64 [pages] tensor on CUDA");
  require(on_cuda(device_row_of_loc) && device_row_of_loc.ndim() == 1 && is_int(device_row_of_loc, 32),
          "bind_rows: device_row_of_loc must be int32 [N + 1] on CUDA");
  require(on_cuda(buffer_of_req) && buffer_of_req.ndim() == 1 && is_int(buffer_of_req, 32),
          "bind_rows: buffer_of_req must be int32 [R] on CUDA");
  require(on_cuda(slot_rows) && slot_rows.ndim() == 2 && is_int(slot_rows, 32) && slot_rows.stride(1) == 1 &&
              slot_rows.size(1) > buffer_size && buffer_size >= 0,
          "bind_rows: slot_rows must be int32 [NB, D + page] on CUDA with D = buffer_size (" +
              std::to_string(buffer_size) + ")");
  require(page_size >= 1, "bind_rows: page_size must be >= 1, got " + std::to_string(page_size));
  if (count == 0) return;
  hisparse::BindRowsParams p{};
  p.device_row_of_loc = data_of<int32_t>(device_row_of_loc);
  p.buffer_of_req = data_of<int32_t>(buffer_of_req);
  p.slot_rows = data_of<int32_t>(slot_rows);
  p.slot_rows_stride = slot_rows.stride(0);
  p.buffer_size = buffer_size;
  p.plan = data_of<int64_t>(plan);
  p.new_locs = data_of<int64_t>(new_locs);
  p.new_pages = new_pages.numel() ? data_of<int64_t>(new_pages) : nullptr;
  p.count = count;
  p.page_size = page_size;
  hisparse::bind_rows_kernel<<<decode_row_blocks(count), kDecodeRowThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(p);
  check_cuda(cudaGetLastError(), "bind_rows launch");
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(swap_in, hisparse_swap_in);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(swap_in_occupancy, hisparse_swap_in_occupancy);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(copy_rows, hisparse_copy_rows);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backup_newest, hisparse_backup_newest);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bind_rows, hisparse_bind_rows);
