// tvm-ffi entry points of the HiSparse kernels: argument checks, then one kernel launch (swap_in_positions:
// one per group of verify positions) on the stream the caller passes (torch's current stream, also under
// CUDA-graph capture).
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>

#include "copy_rows.cuh"
#include "decode_rows.cuh"
#include "swap_in.cuh"

namespace {

using tvm::ffi::TensorView;

template <typename T>
T* data_of(const TensorView& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

bool is_int(const TensorView& t, int bits) {
  return t.dtype().code == kDLInt && t.dtype().bits == bits && t.dtype().lanes == 1;
}

bool is_uint(const TensorView& t, int bits) {
  return t.dtype().code == kDLUInt && t.dtype().bits == bits && t.dtype().lanes == 1;
}

bool on_cuda(const TensorView& t) { return t.device().device_type == kDLCUDA; }

bool on_cpu(const TensorView& t) { return t.device().device_type == kDLCPU; }

bool host_accessible(const TensorView& t) {
  // Pinned host memory is device-accessible under unified addressing; torch reports it as CPU.
  return t.device().device_type == kDLCPU || t.device().device_type == kDLCUDAHost || on_cuda(t);
}

// "int64 [3, 2048] strides [2048, 1] on cuda:0": what an error message shows of a tensor (at most
// 6 dimensions, so a message stays short whatever is passed).
std::string describe(const TensorView& t) {
  std::ostringstream text;
  const DLDataType dtype = t.dtype();
  const char* code = dtype.code == kDLInt ? "int" : dtype.code == kDLUInt ? "uint" : dtype.code == kDLFloat ? "float"
                     : dtype.code == kDLBfloat ? "bfloat" : "dtype";
  text << code << int(dtype.bits);
  if (dtype.lanes != 1) text << "x" << int(dtype.lanes);
  const int shown = t.ndim() < 6 ? t.ndim() : 6;
  text << " [";
  for (int d = 0; d < shown; ++d) text << (d ? ", " : "") << t.size(d);
  text << (t.ndim() > shown ? ", ...]" : "]") << " strides [";
  for (int d = 0; d < shown; ++d) text << (d ? ", " : "") << t.stride(d);
  text << (t.ndim() > shown ? ", ...]" : "]");
  const int type = t.device().device_type;
  text << " on " << (type == kDLCUDA ? "cuda:" : type == kDLCPU ? "cpu" : type == kDLCUDAHost ? "cuda_host" : "device ");
  if (type != kDLCPU && type != kDLCUDAHost) text << t.device().device_id;
  return text.str();
}

// Rejects an argument: "<op>: <name> must be <expected>; got <tensor>".
void require_tensor(bool condition, const char* op, const char* name, const char* expected, const TensorView& t) {
  if (!condition) TVM_FFI_THROW(ValueError) << op << ": " << name << " must be " << expected << "; got " << describe(t);
}

// Rejects a pair of layer tables (the layers' base addresses) unless both are uint64 [L] on CUDA (`cuda`) or on
// the CPU, with as many layers: "<op>: <second> must be uint64 [L] on CUDA like <first>; got ...".
void require_layer_tables(const TensorView& first, const TensorView& second, bool cuda, const char* op,
                          const char* first_name, const char* second_name) {
  const auto placed = [cuda](const TensorView& t) { return cuda ? on_cuda(t) : on_cpu(t); };
  const std::string expected = std::string("uint64 [L] on ") + (cuda ? "CUDA" : "the CPU");
  require_tensor(placed(first) && is_uint(first, 64) && first.ndim() == 1, op, first_name, expected.c_str(), first);
  require_tensor(placed(second) && is_uint(second, 64) && second.ndim() == 1 && second.numel() == first.numel(), op,
                 second_name, (expected + " like " + first_name).c_str(), second);
}

// Rejects a combination of arguments; the message names the values.
void require(bool condition, const char* op, const std::string& message) {
  if (!condition) TVM_FFI_THROW(ValueError) << op << ": " << message;
}

// A failed CUDA call leaves its error behind as the thread's last error, which the next launch
// check (ours or another library's) would report as its own: clear it before raising.
void check_cuda(cudaError_t status, const char* op, const std::string& what) {
  if (status != cudaSuccess) {
    cudaGetLastError();
    TVM_FFI_THROW(RuntimeError) << op << ": " << what << " failed: " << cudaGetErrorString(status);
  }
}

// Before a launch: a non-sticky error of an earlier, already reported CUDA call (ours or another
// library's) is still the thread's last error and would be read back as this launch's; drop it.
// Sticky errors (a device fault) are returned again by the launch itself.
void clear_stale_error() { cudaGetLastError(); }

int64_t row_bytes_of(const TensorView& t, const char* op, const char* name) {
  require_tensor(t.ndim() >= 1 && t.size(0) > 0, op, name, "a KV tensor with rows along dim 0", t);
  const int64_t element_bytes = (t.dtype().bits * t.dtype().lanes + 7) / 8;
  return t.numel() / t.size(0) * element_bytes;
}

int current_device(const char* op) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), op, "cudaGetDevice");
  return device;
}

constexpr int kMaxDevices = 64;

// The swap-in kernel of a block size: swap_in's (one query position per batch row) or swap_in_positions'.
template <int THREADS, bool POSITIONS>
constexpr void (*swap_in_kernel_of())(const hisparse::SwapInParams) {
  if constexpr (POSITIONS) {
    return hisparse::swap_in_positions_kernel<THREADS>;
  } else {
    return hisparse::swap_in_kernel<THREADS>;
  }
}

// Raises (never lowers) the kernel's dynamic shared-memory limit on the current device; the one
// place that sets it (per kernel). The host checked the plan against the device already
// (ops/swap_in_plan.py); if CUDA still refuses, the message says what was asked and what the device allows.
template <int THREADS, bool POSITIONS>
void ensure_smem(size_t smem, const char* op, const hisparse::SwapInSmemPlan& plan) {
  static size_t configured[kMaxDevices] = {};
  const int device = current_device(op);
  require(device >= 0 && device < kMaxDevices, op, "device index " + std::to_string(device) + " is out of range");
  if (smem <= 48 * 1024 || smem <= configured[device]) return;
  const cudaError_t status =
      cudaFuncSetAttribute(swap_in_kernel_of<THREADS, POSITIONS>(), cudaFuncAttributeMaxDynamicSharedMemorySize,
                           int(smem));
  if (status != cudaSuccess) {
    cudaGetLastError();
    int optin = 0;
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    cudaGetLastError();
    TVM_FFI_THROW(RuntimeError) << op << ": cudaFuncSetAttribute(MaxDynamicSharedMemorySize = " << smem
                                << " B, " << THREADS << " threads, hash_bits " << plan.hash_bits << ") failed on cuda:"
                                << device << ": " << cudaGetErrorString(status) << "; this GPU allows " << optin
                                << " B per block. Lower device_buffer_size (ops/swap_in_plan.py "
                                << "largest_device_buffer_size gives the largest that fits).";
  }
  configured[device] = smem;
}

// The plan the host computed (an int64 CPU tensor in SwapInSmemPlan's field order), checked for
// what the binding can check without restating the layout: offsets aligned, in order, in bounds.
hisparse::SwapInSmemPlan plan_of(const TensorView& plan, const char* op) {
  require_tensor(on_cpu(plan) && is_int(plan, 64) && plan.ndim() == 1 && plan.size(0) == hisparse::kPlanFields &&
                     plan.stride(0) == 1,
                 op, "plan", "a contiguous int64 CPU tensor of swap_in_plan.PLAN_FIELDS", plan);
  hisparse::SwapInSmemPlan result{};
  int64_t* fields = reinterpret_cast<int64_t*>(&result);
  const int64_t* values = data_of<int64_t>(plan);
  for (int i = 0; i < hisparse::kPlanFields; ++i) fields[i] = values[i];
  require(result.hash_bits >= 1 && result.hash_bits <= hisparse::kMaxHashBits, op,
          "plan hash_bits " + std::to_string(result.hash_bits) + " is outside [1, " +
              std::to_string(hisparse::kMaxHashBits) + "]");
  // The region offsets, in layout order: uint64 scan scratch, int32 regions, then int16 regions.
  static const char* const kRegionNames[] = {
      "warp_sums", "selection", "role", "keys", "first", "hash_host_row", "hash_device_row", "row_of_slot",
      "token_of_slot", "entry_state", "slot_hit", "coarse", "fine", "miss_hash", "victim_slot", "slot_age",
      "entry_hash"};
  static_assert(sizeof(kRegionNames) / sizeof(kRegionNames[0]) == hisparse::kPlanFields - 2, "plan fields");
  int64_t previous = 0;
  for (int i = 2; i < hisparse::kPlanFields; ++i) {
    const int64_t alignment = i == 2 ? 8 : (i >= 15 ? 2 : 4);
    require(fields[i] >= previous && fields[i] % alignment == 0 && fields[i] <= result.total_bytes, op,
            std::string("plan region ") + kRegionNames[i - 2] + " at offset " + std::to_string(fields[i]) +
                " is out of order, not " + std::to_string(alignment) + "-byte aligned or beyond total_bytes " +
                std::to_string(result.total_bytes));
    previous = fields[i];
  }
  require(result.role % 16 == 0 && result.total_bytes <= INT32_MAX, op, "plan role offset or total_bytes is invalid");
  return result;
}

template <int THREADS, bool POSITIONS>
void launch_swap_in(const hisparse::SwapInParams& params, cudaStream_t stream, const char* op) {
  const size_t smem = static_cast<size_t>(params.plan.total_bytes);
  ensure_smem<THREADS, POSITIONS>(smem, op, params.plan);
  const int grid = params.batch * params.splits;
  clear_stale_error();
  swap_in_kernel_of<THREADS, POSITIONS>()<<<grid, THREADS, smem, stream>>>(params);
  std::ostringstream what;
  what << op << " launch (grid " << grid << " x " << THREADS << " threads, " << smem << " B shared memory)";
  check_cuda(cudaGetLastError(), op, what.str());
}

template <int THREADS, bool POSITIONS>
int64_t occupancy(const hisparse::SwapInSmemPlan& plan, const char* op) {
  int blocks = 0;
  const size_t smem = static_cast<size_t>(plan.total_bytes);
  ensure_smem<THREADS, POSITIONS>(smem, op, plan);
  check_cuda(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, swap_in_kernel_of<THREADS, POSITIONS>(), THREADS, smem),
      op, "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return blocks;
}

void require_threads(int64_t threads, const char* op) {
  require(threads == 256 || threads == 512 || threads == 1024, op,
          "threads must be 256, 512 or 1024; got " + std::to_string(threads));
}

template <bool POSITIONS>
void launch_swap_in_threads(const hisparse::SwapInParams& params, int64_t threads, int64_t stream, const char* op) {
  const auto cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  switch (threads) {
    case 256: launch_swap_in<256, POSITIONS>(params, cuda_stream, op); break;
    case 512: launch_swap_in<512, POSITIONS>(params, cuda_stream, op); break;
    default: launch_swap_in<1024, POSITIONS>(params, cuda_stream, op); break;
  }
}

// How a swap-in entry point's batch row reads in messages: its entries ("top_k (2048)" or
// "num_draft_tokens x top_k (2 x 2048 = 4096)") and the Python function that plans them.
struct SwapInRowText {
  std::string entries;
  const char* plan_call;
};

// The checks and kernel parameters the two swap-in entry points share: everything but the shapes of
// top_k and out, which the caller checked (`batch` rows of `entries` contiguous int32 entries each,
// rows top_k_stride / out_stride apart, `position_width` entries per query position).
hisparse::SwapInParams swap_in_params(
    const char* op, const SwapInRowText& text, int64_t batch, int64_t entries, int64_t position_width,
    const TensorView& top_k, int64_t top_k_stride, const TensorView& seq_lens, const TensorView& req_pool_indices,
    const TensorView& num_real_reqs, const TensorView& req_to_token, const TensorView& device_row_of_loc,
    const TensorView& buffer_of_req, const TensorView& slot_rows, const TensorView& slot_tokens,
    const TensorView& slot_stamps, const TensorView& token_slot, const TensorView& host_kv,
    const TensorView& device_kv, const TensorView& out, int64_t out_stride, const TensorView& counters,
    const TensorView& sync, const TensorView& plan, int64_t splits, int64_t threads) {
  require_tensor(seq_lens.ndim() == 1 && seq_lens.size(0) == batch && (is_int(seq_lens, 32) || is_int(seq_lens, 64)) &&
                     on_cuda(seq_lens),
                 op, "seq_lens", "int32/int64 [batch] on CUDA", seq_lens);
  require_tensor(req_pool_indices.ndim() == 1 && req_pool_indices.size(0) == batch &&
                     (is_int(req_pool_indices, 32) || is_int(req_pool_indices, 64)) && on_cuda(req_pool_indices),
                 op, "req_pool_indices", "int32/int64 [batch] on CUDA", req_pool_indices);
  require_tensor(num_real_reqs.numel() >= 1 && is_int(num_real_reqs, 32) && on_cuda(num_real_reqs), op, "num_real_reqs",
                 "int32 [1] on CUDA", num_real_reqs);
  require_tensor(req_to_token.ndim() == 2 && is_int(req_to_token, 32) && req_to_token.stride(1) == 1 &&
                     on_cuda(req_to_token),
                 op, "req_to_token", "int32 [R, C] on CUDA, rows contiguous", req_to_token);
  require_tensor(device_row_of_loc.ndim() == 1 && is_int(device_row_of_loc, 32) && on_cuda(device_row_of_loc), op,
                 "device_row_of_loc", "int32 [N + 1] on CUDA", device_row_of_loc);
  require_tensor(buffer_of_req.ndim() == 1 && is_int(buffer_of_req, 32) && on_cuda(buffer_of_req), op, "buffer_of_req",
                 "int32 [R] on CUDA", buffer_of_req);
  require_tensor(slot_tokens.ndim() == 2 && is_int(slot_tokens, 32) && slot_tokens.stride(1) == 1 && on_cuda(slot_tokens),
                 op, "slot_tokens", "int32 [NB, D] on CUDA for one layer", slot_tokens);
  const int64_t D = slot_tokens.size(1);
  require_tensor(slot_rows.ndim() == 2 && is_int(slot_rows, 32) && slot_rows.stride(1) == 1 && slot_rows.size(1) > D &&
                     on_cuda(slot_rows),
                 op, "slot_rows", "int32 [NB, D + page] on CUDA (D = slot_tokens' width)", slot_rows);
  require_tensor(slot_stamps.ndim() == 2 && is_int(slot_stamps, 32) && slot_stamps.size(1) == D &&
                     slot_stamps.stride(1) == 1 && on_cuda(slot_stamps),
                 op, "slot_stamps", "int32 [NB, D] on CUDA for one layer", slot_stamps);
  require_tensor(token_slot.ndim() == 2 && is_int(token_slot, 16) && token_slot.stride(1) == 1 &&
                     token_slot.size(1) >= req_to_token.size(1) && on_cuda(token_slot),
                 op, "token_slot", "int16 [NB, C'] on CUDA for one layer with C' >= req_to_token's width", token_slot);
  require(slot_stamps.size(0) == slot_tokens.size(0) && token_slot.size(0) == slot_tokens.size(0) &&
              slot_rows.size(0) >= slot_tokens.size(0),
          op,
          "slot_rows, slot_tokens, slot_stamps and token_slot must have one row per buffer; got " +
              std::to_string(slot_rows.size(0)) + ", " + std::to_string(slot_tokens.size(0)) + ", " +
              std::to_string(slot_stamps.size(0)) + ", " + std::to_string(token_slot.size(0)));
  require(entries <= D && D <= hisparse::kMaxBufferSize, op,
          text.entries + " must be <= device_buffer_size (" + std::to_string(D) + ") <= " +
              std::to_string(hisparse::kMaxBufferSize));
  require_tensor(host_accessible(host_kv), op, "host_kv", "pinned host memory", host_kv);
  require_tensor(on_cuda(device_kv), op, "device_kv", "on CUDA", device_kv);
  const int64_t row_bytes = row_bytes_of(device_kv, op, "device_kv");
  require(row_bytes == row_bytes_of(host_kv, op, "host_kv") && row_bytes % 16 == 0, op,
          "host and device KV rows must have the same size, a multiple of 16 bytes; got " +
              std::to_string(row_bytes_of(host_kv, op, "host_kv")) + " and " + std::to_string(row_bytes));
  require(splits >= 1 && splits <= hisparse::kMaxSplits, op,
          "splits must be in [1, " + std::to_string(hisparse::kMaxSplits) + "]; got " + std::to_string(splits));
  require(batch * splits <= INT32_MAX, op,
          "batch (" + std::to_string(batch) + ") x splits (" + std::to_string(splits) + ") CTAs exceed the grid limit");
  require_tensor(counters.numel() == 0 || (is_int(counters, 64) && counters.numel() >= 2 && on_cuda(counters)), op,
                 "counters", "int64 [2] on CUDA or empty", counters);
  // sync = [flags | row_counts | claims (kClaimWords uint64 per row)], capacity rows each, all zero
  // between launches.
  constexpr int64_t kCounters = hisparse::kSyncCountersPerRow;
  static const std::string sync_shape = "an int32 CUDA workspace of " + std::to_string(kCounters) + " x capacity >= " +
                                        std::to_string(kCounters) + " x batch entries (SYNC_COUNTERS_PER_ROW)";
  require_tensor(is_int(sync, 32) && on_cuda(sync) && sync.numel() % kCounters == 0 && sync.numel() / kCounters >= batch,
                 op, "sync", sync_shape.c_str(), sync);
  require_threads(threads, op);
  const hisparse::SwapInSmemPlan smem_plan = plan_of(plan, op);
  require((int64_t(1) << smem_plan.hash_bits) >= 2 * entries, op,
          "plan hash_bits " + std::to_string(smem_plan.hash_bits) + " is too small for " + text.entries +
              "; compute the plan with " + text.plan_call);

  const int64_t capacity = sync.numel() / kCounters;
  int32_t* sync_data = data_of<int32_t>(sync);
  hisparse::SwapInParams p{};
  p.top_k_positions = data_of<int32_t>(top_k);
  p.top_k_stride = top_k_stride;
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
  p.out_stride = out_stride;
  p.counters = counters.numel() ? reinterpret_cast<unsigned long long*>(data_of<int64_t>(counters)) : nullptr;
  p.flags = sync_data;
  p.row_counts = sync_data + capacity;
  // 8-byte aligned: the workspace's base is, and 2 * capacity int32 come before.
  p.claims = reinterpret_cast<unsigned long long*>(sync_data + 2 * capacity);
  p.batch = static_cast<int>(batch);
  p.num_top_k = static_cast<int>(entries);
  p.buffer_size = static_cast<int>(D);
  p.splits = static_cast<int>(splits);
  p.plan = smem_plan;
  p.position_width = static_cast<int>(position_width);
  return p;
}

// The verify limits swap_in_positions lowers and cap_accepted applies: one int32 per batch row (or more).
void require_verify_limit(const char* op, const TensorView& verify_limit, int64_t batch) {
  require_tensor(on_cuda(verify_limit) && verify_limit.ndim() == 1 && is_int(verify_limit, 32) &&
                     verify_limit.size(0) >= batch && (verify_limit.size(0) == 0 || verify_limit.stride(0) == 1),
                 op, "verify_limit", "a contiguous int32 [>= B] tensor on CUDA (B: the batch rows)", verify_limit);
}

}  // namespace

// Device rows of one layer's top-k tokens; see ops/reference.py::swap_in for the semantics.
void hisparse_swap_in(
    TensorView top_k, TensorView seq_lens, TensorView req_pool_indices, TensorView num_real_reqs,
    TensorView req_to_token, TensorView device_row_of_loc, TensorView buffer_of_req, TensorView slot_rows,
    TensorView slot_tokens, TensorView slot_stamps, TensorView token_slot, TensorView host_kv, TensorView device_kv, TensorView out,
    TensorView counters, TensorView sync, TensorView plan, int64_t splits, int64_t threads, int64_t stream) {
  constexpr const char* op = "swap_in";
  require_tensor(top_k.ndim() == 2 && is_int(top_k, 32) && on_cuda(top_k) && top_k.stride(1) == 1, op, "top_k",
                 "int32 [batch, top_k] on CUDA, rows contiguous", top_k);
  const int64_t batch = top_k.size(0);
  const int64_t K = top_k.size(1);
  require_tensor(out.ndim() == 2 && is_int(out, 32) && out.size(0) == batch && out.size(1) == K && out.stride(1) == 1 &&
                     on_cuda(out),
                 op, "out", "int32 [batch, top_k] on CUDA like top_k", out);
  const SwapInRowText text{"top_k (" + std::to_string(K) + ")",
                           "swap_in_plan.swap_in_plan(top_k, device_buffer_size, threads)"};
  const hisparse::SwapInParams p = swap_in_params(
      op, text, batch, K, K, top_k, top_k.stride(0), seq_lens, req_pool_indices, num_real_reqs, req_to_token,
      device_row_of_loc, buffer_of_req, slot_rows, slot_tokens, slot_stamps, token_slot, host_kv, device_kv, out,
      out.stride(0), counters, sync, plan, splits, threads);
  if (batch == 0) return;
  launch_swap_in_threads<false>(p, threads, stream, op);
}

// Device rows of one layer's top-k tokens of every verify position (top_k [batch, T, K]); see
// ops/reference.py::swap_in_positions for the semantics. seq_lens is s, the committed length. The positions
// are served in consecutive groups of positions_per_group (G), one launch per group on the stream, each with
// `plan` (computed for G x K entries): ceil(T / G) launches, fixed for the shape (CUDA-graph capturable).
// resident_rows_given != 0: a resident request's entries are its device rows already (verify_page_table),
// passed through.
void hisparse_swap_in_positions(
    TensorView top_k, TensorView seq_lens, TensorView req_pool_indices, TensorView num_real_reqs,
    TensorView req_to_token, TensorView device_row_of_loc, TensorView buffer_of_req, TensorView slot_rows,
    TensorView slot_tokens, TensorView slot_stamps, TensorView token_slot, TensorView host_kv, TensorView device_kv, TensorView out,
    TensorView counters, TensorView verify_limit, TensorView sync, TensorView plan, int64_t positions_per_group,
    int64_t resident_rows_given, int64_t splits, int64_t threads, int64_t stream) {
  constexpr const char* op = "swap_in_positions";
  // A batch row's T x K entries are read as one row: each position's K entries contiguous, positions adjacent.
  require_tensor(top_k.ndim() == 3 && is_int(top_k, 32) && on_cuda(top_k) && top_k.stride(2) == 1 &&
                     top_k.stride(1) == top_k.size(2) && top_k.size(1) >= 1 && top_k.size(2) >= 1,
                 op, "top_k", "int32 [batch, T, K] on CUDA, each row's T x K entries contiguous", top_k);
  const int64_t batch = top_k.size(0);
  const int64_t T = top_k.size(1);
  const int64_t K = top_k.size(2);
  require_tensor(out.ndim() == 3 && is_int(out, 32) && out.size(0) == batch && out.size(1) == T && out.size(2) == K &&
                     out.stride(2) == 1 && out.stride(1) == K && on_cuda(out),
                 op, "out", "int32 [batch, T, K] on CUDA like top_k, each row's T x K entries contiguous", out);
  const int64_t D = slot_tokens.ndim() == 2 ? slot_tokens.size(1) : 0;
  const int64_t verify_slots = slot_rows.ndim() == 2 ? slot_rows.size(1) - D - hisparse::kVerifySlotBase : 0;
  require(slot_rows.ndim() == 2 && (slot_rows.size(0) == 0 || T <= verify_slots), op,
          std::to_string(T) + " verify positions per request, but a buffer's reserved page holds " +
              std::to_string(verify_slots) + " (page size - 1)");
  require_verify_limit(op, verify_limit, batch);
  const int64_t G = positions_per_group;
  require(G >= 1 && G <= T, op,
          "positions_per_group must be in [1, " + std::to_string(T) + "] (the verify positions); got " +
              std::to_string(G));
  const SwapInRowText text{
      "positions_per_group x top_k (" + std::to_string(G) + " x " + std::to_string(K) + " = " + std::to_string(G * K) +
          ")",
      "swap_in_plan.swap_in_positions_plan(positions_per_group, top_k, device_buffer_size, threads)"};
  hisparse::SwapInParams p = swap_in_params(
      op, text, batch, G * K, K, top_k, top_k.stride(0), seq_lens, req_pool_indices, num_real_reqs, req_to_token,
      device_row_of_loc, buffer_of_req, slot_rows, slot_tokens, slot_stamps, token_slot, host_kv, device_kv, out,
      out.stride(0), counters, sync, plan, splits, threads);
  if (batch == 0) return;
  p.verify_limit = data_of<int32_t>(verify_limit);
  p.resident_rows_given = resident_rows_given != 0;
  // Group after group in stream order: each launch finds the tables (and the workspace, reset by its
  // predecessor's last CTA) as the previous one left them.
  const int32_t* top_k_base = p.top_k_positions;
  int32_t* out_base = p.out;
  for (int64_t first = 0; first < T; first += G) {
    const int64_t count = std::min(G, T - first);
    p.top_k_positions = top_k_base + first * K;
    p.out = out_base + first * K;
    p.num_top_k = static_cast<int>(count * K);
    p.position_offset = static_cast<int>(first);
    launch_swap_in_threads<true>(p, threads, stream, op);
  }
}

namespace {

template <bool POSITIONS>
int64_t occupancy_threads(int64_t threads, const TensorView& plan, const char* op) {
  require_threads(threads, op);
  const hisparse::SwapInSmemPlan smem_plan = plan_of(plan, op);
  switch (threads) {
    case 256: return occupancy<256, POSITIONS>(smem_plan, op);
    case 512: return occupancy<512, POSITIONS>(smem_plan, op);
    default: return occupancy<1024, POSITIONS>(smem_plan, op);
  }
}

}  // namespace

// Resident swap_in CTAs per multiprocessor for a block size and shared-memory plan.
int64_t hisparse_swap_in_occupancy(int64_t threads, TensorView plan) {
  return occupancy_threads<false>(threads, plan, "swap_in_occupancy");
}

// The same for swap_in_positions' kernel (its plan: swap_in_plan.swap_in_positions_plan).
int64_t hisparse_swap_in_positions_occupancy(int64_t threads, TensorView plan) {
  return occupancy_threads<true>(threads, plan, "swap_in_positions_occupancy");
}

// For every layer l: dst_layers[l][dst_rows[i]] = src_layers[l][src_rows[i]] (any direction).
void hisparse_copy_rows(
    TensorView src_layers, TensorView dst_layers, TensorView src_rows, TensorView dst_rows, int64_t row_bytes,
    int64_t max_blocks, int64_t stream) {
  constexpr const char* op = "copy_rows";
  require_layer_tables(src_layers, dst_layers, true, op, "src_layers", "dst_layers");
  require_tensor(on_cuda(src_rows) && (is_int(src_rows, 32) || is_int(src_rows, 64)), op, "src_rows",
                 "int32/int64 on CUDA", src_rows);
  require_tensor(on_cuda(dst_rows) && (is_int(dst_rows, 32) || is_int(dst_rows, 64)) &&
                     dst_rows.numel() == src_rows.numel(),
                 op, "dst_rows", "int32/int64 on CUDA, as many as src_rows", dst_rows);
  require(row_bytes > 0 && row_bytes % 16 == 0, op,
          "row_bytes must be a positive multiple of 16; got " + std::to_string(row_bytes));
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
  constexpr int kThreads = hisparse::kCopyRowsThreads;
  constexpr int kStep = kThreads * hisparse::kCopyUnroll;  // pieces a block copies per round
  const int64_t total = count * (row_bytes / hisparse::kPieceBytes) * p.layers;
  int multiprocessors = 0;
  check_cuda(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, src_layers.device().device_id),
             op, "cudaDeviceGetAttribute(MultiProcessorCount)");
  int64_t blocks = (total + kStep - 1) / kStep;
  const int64_t block_limit = max_blocks > 0 ? max_blocks : hisparse::kCopyRowsBlocksPerSM * int64_t(multiprocessors);
  if (blocks > block_limit) blocks = block_limit;
  const auto cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  clear_stale_error();
  // 32-bit indices when no index can reach 2^32: a block's chunk is rounded up to whole rounds and
  // its last round reads one round past it (two rounds per block of slack).
  if (total + int64_t(blocks) * 2 * kStep < (int64_t(1) << 32)) {
    hisparse::copy_rows_kernel<kThreads, uint32_t><<<int(blocks), kThreads, 0, cuda_stream>>>(p);
  } else {
    hisparse::copy_rows_kernel<kThreads, uint64_t><<<int(blocks), kThreads, 0, cuda_stream>>>(p);
  }
  check_cuda(cudaGetLastError(), op,
             "copy_rows launch (" + std::to_string(blocks) + " blocks, " + std::to_string(count) + " rows of " +
                 std::to_string(row_bytes) + " B, " + std::to_string(p.layers) + " layers)");
}

// For every run (s, d, n) of runs and every layer l: rows [s, s + n) of src layer l to rows [d, d + n) of dst
// layer l, by the copy engines (no SM), one cudaMemcpyAsync each on the stream (from C++: ~8x cheaper than
// Tensor.copy_ from Python). src_layers / dst_layers: the layers' base
// pointers (uint64 [L] on the CPU); src_capacity / dst_capacity: rows per layer, which every run must fit.
void hisparse_copy_row_runs(
    TensorView src_layers, TensorView dst_layers, TensorView runs, int64_t row_bytes, int64_t src_capacity,
    int64_t dst_capacity, int64_t stream) {
  constexpr const char* op = "copy_row_runs";
  require_layer_tables(src_layers, dst_layers, false, op, "src_layers", "dst_layers");
  require_tensor(on_cpu(runs) && is_int(runs, 64) && runs.ndim() == 2 && runs.size(1) == 3 &&
                     (runs.size(0) == 0 || (runs.stride(1) == 1 && runs.stride(0) == 3)),
                 op, "runs", "a contiguous int64 [R, 3] tensor on the CPU", runs);
  require(row_bytes > 0, op, "row_bytes must be positive; got " + std::to_string(row_bytes));
  const int64_t count = runs.size(0);
  const int64_t layers = src_layers.numel();
  if (count == 0 || layers == 0) return;
  const int64_t* run = data_of<int64_t>(runs);
  for (int64_t r = 0; r < count; ++r) {
    const int64_t src = run[3 * r], dst = run[3 * r + 1], rows = run[3 * r + 2];
    require(rows > 0 && src >= 0 && dst >= 0 && src <= src_capacity - rows && dst <= dst_capacity - rows, op,
            "run " + std::to_string(r) + " (first source row " + std::to_string(src) + ", first destination row " +
                std::to_string(dst) + ", rows " + std::to_string(rows) + ") must be non-empty and within " +
                std::to_string(src_capacity) + " source and " + std::to_string(dst_capacity) + " destination rows");
  }
  const uint64_t* src_base = data_of<uint64_t>(src_layers);
  const uint64_t* dst_base = data_of<uint64_t>(dst_layers);
  const auto cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  clear_stale_error();
  // One cudaMemcpyAsync per run and layer: ~1.8 us of host time each on an H200 while the copy engines' queue
  // has room (976 copies: 1.7 ms); beyond ~1,000 outstanding copies a call waits for the queue, hence the
  // coordinator's DMA_MAX_OUTSTANDING. (cudaMemcpyBatchAsync, one call for all, was refused there: "invalid
  // argument".)
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t r = 0; r < count; ++r) {
      const char* src = reinterpret_cast<const char*>(src_base[l]) + run[3 * r] * row_bytes;
      char* dst = reinterpret_cast<char*>(dst_base[l]) + run[3 * r + 1] * row_bytes;
      check_cuda(cudaMemcpyAsync(dst, src, size_t(run[3 * r + 2] * row_bytes), cudaMemcpyDefault, cuda_stream), op,
                 "cudaMemcpyAsync of run " + std::to_string(r) + " in layer " + std::to_string(l));
    }
  }
}

namespace {

void require_plan(const TensorView& plan, const char* op) {
  require_tensor(on_cuda(plan) && plan.ndim() == 2 && plan.size(0) == 3 && is_int(plan, 64) &&
                     (plan.size(1) == 0 || (plan.stride(1) == 1 && plan.stride(0) == plan.size(1))),
                 op, "plan", "a contiguous int64 [3, n] tensor on CUDA", plan);
}

bool is_index(const TensorView& t) { return is_int(t, 32) || is_int(t, 64); }

using hisparse::kBackupNewestRowsPerBlock;
using hisparse::kDecodeRowThreads;

// Launches a decode-row kernel over `blocks` blocks and checks the launch.
template <typename Params>
void launch_decode_rows(void (*kernel)(Params), const Params& params, int64_t blocks, int64_t stream, const char* op,
                        const std::string& what) {
  clear_stale_error();
  kernel<<<static_cast<int>(blocks), kDecodeRowThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(params);
  check_cuda(cudaGetLastError(), op, "launch (" + what + ")");
}

// What the per-request row kernels (backup_newest, bind_verify_slots, commit_accepted) check of their
// batch: the index tensors and the request -> location and location -> device-row tables. Returns B.
int64_t check_row_batch(const char* op, const TensorView& req_pool_indices, const TensorView& seq_lens,
                        const TensorView& num_real_reqs, const TensorView& req_to_token,
                        const TensorView& device_row_of_loc) {
  require_tensor(on_cuda(req_pool_indices) && req_pool_indices.ndim() == 1 && is_index(req_pool_indices) &&
                     (req_pool_indices.size(0) == 0 || req_pool_indices.stride(0) == 1),
                 op, "req_pool_indices", "a contiguous int32/int64 [B] tensor on CUDA", req_pool_indices);
  const int64_t batch = req_pool_indices.size(0);
  require_tensor(on_cuda(seq_lens) && seq_lens.ndim() == 1 && seq_lens.size(0) == batch && is_index(seq_lens) &&
                     (batch == 0 || seq_lens.stride(0) == 1),
                 op, "seq_lens", "a contiguous int32/int64 [B] tensor on CUDA, B as req_pool_indices", seq_lens);
  require_tensor(on_cuda(num_real_reqs) && num_real_reqs.numel() == 1 && is_int(num_real_reqs, 32), op,
                 "num_real_reqs", "an int32 [1] tensor on CUDA", num_real_reqs);
  require_tensor(on_cuda(req_to_token) && req_to_token.ndim() == 2 && is_int(req_to_token, 32) &&
                     req_to_token.stride(1) == 1,
                 op, "req_to_token", "int32 [R, C] on CUDA, rows contiguous", req_to_token);
  require_tensor(on_cuda(device_row_of_loc) && device_row_of_loc.ndim() == 1 && is_int(device_row_of_loc, 32), op,
                 "device_row_of_loc", "int32 [N + 1] on CUDA", device_row_of_loc);
  return batch;
}

}  // namespace

// Copies each real batch row's newest token (position seq_lens[b] - 1 of request slot
// req_pool_indices[b]) of one layer from its device row to its host row (its logical location);
// fence_system != 0 fences the stores system-wide (a host pool other processes read).
void hisparse_backup_newest(
    TensorView req_pool_indices, TensorView seq_lens, TensorView num_real_reqs, TensorView req_to_token,
    TensorView device_row_of_loc, TensorView device_kv, TensorView host_kv, int64_t fence_system, int64_t stream) {
  constexpr const char* op = "backup_newest";
  const int64_t batch =
      check_row_batch(op, req_pool_indices, seq_lens, num_real_reqs, req_to_token, device_row_of_loc);
  require_tensor(on_cuda(device_kv), op, "device_kv", "a KV tensor on CUDA", device_kv);
  require_tensor(host_accessible(host_kv) && !on_cuda(host_kv), op, "host_kv", "pinned host memory", host_kv);
  cudaPointerAttributes host_attributes{};
  const cudaError_t host_query = cudaPointerGetAttributes(&host_attributes, data_of<char>(host_kv));
  if (host_query != cudaSuccess) cudaGetLastError();  // a failed query must not leak into later calls
  require_tensor(host_query == cudaSuccess && host_attributes.type == cudaMemoryTypeHost, op, "host_kv",
                 "pinned (page-locked) host memory: the kernel writes it directly", host_kv);
  const int64_t row_bytes = row_bytes_of(device_kv, op, "device_kv");
  require(row_bytes_of(host_kv, op, "host_kv") == row_bytes, op,
          "device rows of " + std::to_string(row_bytes) + " B but host rows of " +
              std::to_string(row_bytes_of(host_kv, op, "host_kv")) + " B");
  require(row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(data_of<char>(device_kv)) % 16 == 0 &&
              reinterpret_cast<uintptr_t>(data_of<char>(host_kv)) % 16 == 0,
          op, "rows must be 16-byte aligned multiples of 16 bytes; got " + std::to_string(row_bytes) + "-byte rows");
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
  p.fence_system = fence_system != 0;
  const int64_t blocks = (batch + kBackupNewestRowsPerBlock - 1) / kBackupNewestRowsPerBlock;
  launch_decode_rows(hisparse::backup_newest_kernel, p, blocks, stream, op, std::to_string(batch) + " batch rows");
}

// Binds the new token of batch row plan[0, i] (request slot plan[1, i], location new_locs[row]):
// kind kBindBufferSlot maps the location to the slot's buffer slot D; kind k >= 0 maps the
// page_size locations from it (a page start) to the rows of device page new_pages[k].
void hisparse_bind_rows(
    TensorView plan, TensorView new_locs, TensorView new_pages, TensorView device_row_of_loc, TensorView buffer_of_req,
    TensorView slot_rows, int64_t buffer_size, int64_t page_size, int64_t stream) {
  constexpr const char* op = "bind_rows";
  require_plan(plan, op);
  const int64_t count = plan.size(1);
  require_tensor(on_cuda(new_locs) && new_locs.ndim() == 1 && new_locs.size(0) >= count && is_int(new_locs, 64) &&
                     (new_locs.size(0) == 0 || new_locs.stride(0) == 1),
                 op, "new_locs", "a contiguous int64 [B] tensor on CUDA with B >= the plan's entries", new_locs);
  require_tensor(on_cuda(new_pages) && new_pages.ndim() == 1 && is_int(new_pages, 64) &&
                     (new_pages.numel() == 0 || new_pages.stride(0) == 1),
                 op, "new_pages", "a contiguous int64 [pages] tensor on CUDA", new_pages);
  require_tensor(on_cuda(device_row_of_loc) && device_row_of_loc.ndim() == 1 && is_int(device_row_of_loc, 32), op,
                 "device_row_of_loc", "int32 [N + 1] on CUDA", device_row_of_loc);
  require_tensor(on_cuda(buffer_of_req) && buffer_of_req.ndim() == 1 && is_int(buffer_of_req, 32), op, "buffer_of_req",
                 "int32 [R] on CUDA", buffer_of_req);
  require(buffer_size >= 0, op, "buffer_size must be >= 0; got " + std::to_string(buffer_size));
  require_tensor(on_cuda(slot_rows) && slot_rows.ndim() == 2 && is_int(slot_rows, 32) && slot_rows.stride(1) == 1 &&
                     slot_rows.size(1) > buffer_size,
                 op, "slot_rows", "int32 [NB, D + page] on CUDA with D = buffer_size", slot_rows);
  require(page_size >= 1, op, "page_size must be >= 1; got " + std::to_string(page_size));
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
  launch_decode_rows(hisparse::bind_rows_kernel, p, (count + kDecodeRowThreads - 1) / kDecodeRowThreads, stream, op,
                     std::to_string(count) + " entries");
}

namespace {

// What bind_verify_slots and commit_accepted both check: the batch's index tensors, the tables, and
// that T verify positions fit the reserved page of a buffer. Returns the batch size.
int64_t check_verify_batch(const char* op, const TensorView& req_pool_indices, const TensorView& seq_lens,
                           const TensorView& num_real_reqs, int64_t num_positions, const TensorView& req_to_token,
                           const TensorView& device_row_of_loc, const TensorView& buffer_of_req,
                           const TensorView& slot_rows, int64_t buffer_size) {
  const int64_t batch =
      check_row_batch(op, req_pool_indices, seq_lens, num_real_reqs, req_to_token, device_row_of_loc);
  require_tensor(on_cuda(buffer_of_req) && buffer_of_req.ndim() == 1 && is_int(buffer_of_req, 32), op, "buffer_of_req",
                 "int32 [R] on CUDA", buffer_of_req);
  require(buffer_size >= 0, op, "buffer_size must be >= 0; got " + std::to_string(buffer_size));
  require_tensor(on_cuda(slot_rows) && slot_rows.ndim() == 2 && is_int(slot_rows, 32) && slot_rows.stride(1) == 1 &&
                     slot_rows.size(1) > buffer_size,
                 op, "slot_rows", "int32 [NB, D + page] on CUDA with D = buffer_size", slot_rows);
  const int64_t verify_slots = slot_rows.size(1) - buffer_size - hisparse::kVerifySlotBase;
  require(num_positions >= 1 && num_positions <= verify_slots, op,
          std::to_string(num_positions) + " verify positions per request, but a buffer's reserved page holds " +
              std::to_string(verify_slots) + " (page size - 1)");
  return batch;
}

}  // namespace

// Before a target-verify forward: the locations of positions s .. s + T - 1 of every real offloaded
// batch row map to its buffer's verify slots (ops/reference.py::bind_verify_slots).
void hisparse_bind_verify_slots(
    TensorView req_pool_indices, TensorView seq_lens, TensorView num_real_reqs, int64_t num_positions,
    TensorView req_to_token, TensorView device_row_of_loc, TensorView buffer_of_req, TensorView slot_rows,
    int64_t buffer_size, int64_t stream) {
  constexpr const char* op = "bind_verify_slots";
  const int64_t batch = check_verify_batch(op, req_pool_indices, seq_lens, num_real_reqs, num_positions, req_to_token,
                                           device_row_of_loc, buffer_of_req, slot_rows, buffer_size);
  if (batch == 0) return;
  hisparse::BindVerifySlotsParams p{};
  p.req_pool_indices = data_of<void>(req_pool_indices);
  p.seq_lens = data_of<void>(seq_lens);
  p.req_pool_indices_is_64 = is_int(req_pool_indices, 64);
  p.seq_lens_is_64 = is_int(seq_lens, 64);
  p.num_real_reqs = data_of<int32_t>(num_real_reqs);
  p.req_to_token = data_of<int32_t>(req_to_token);
  p.req_to_token_stride = req_to_token.stride(0);
  p.context = req_to_token.size(1);
  p.device_row_of_loc = data_of<int32_t>(device_row_of_loc);
  p.buffer_of_req = data_of<int32_t>(buffer_of_req);
  p.slot_rows = data_of<int32_t>(slot_rows);
  p.slot_rows_stride = slot_rows.stride(0);
  p.buffer_size = buffer_size;
  p.batch = batch;
  p.num_positions = num_positions;
  const int64_t threads = batch * num_positions;
  launch_decode_rows(hisparse::bind_verify_slots_kernel, p, (threads + kDecodeRowThreads - 1) / kDecodeRowThreads,
                     stream, op, std::to_string(batch) + " batch rows x " + std::to_string(num_positions) + " positions");
}

// After acceptance: every layer's rows of the accepted positions s .. s + a - 1 go device -> host, and
// an offloaded row's newest accepted token goes from its verify slot into slot D of every layer
// (ops/reference.py::commit_accepted). The layers are tables of base addresses (uint64 [L] on CUDA, as
// copy_rows takes them): device KV and pinned host KV, rows of row_bytes.
void hisparse_commit_accepted(
    TensorView req_pool_indices, TensorView seq_lens, TensorView accept_lens, TensorView num_real_reqs,
    int64_t num_positions, TensorView req_to_token, TensorView device_row_of_loc, TensorView buffer_of_req,
    TensorView slot_rows, int64_t buffer_size, TensorView device_layers, TensorView host_layers, int64_t row_bytes,
    int64_t stream) {
  constexpr const char* op = "commit_accepted";
  const int64_t batch = check_verify_batch(op, req_pool_indices, seq_lens, num_real_reqs, num_positions, req_to_token,
                                           device_row_of_loc, buffer_of_req, slot_rows, buffer_size);
  require_tensor(on_cuda(accept_lens) && accept_lens.ndim() == 1 && accept_lens.size(0) == batch &&
                     is_index(accept_lens) && (batch == 0 || accept_lens.stride(0) == 1),
                 op, "accept_lens", "a contiguous int32/int64 [B] tensor on CUDA, B as req_pool_indices", accept_lens);
  require_layer_tables(device_layers, host_layers, true, op, "device_layers", "host_layers");
  require(row_bytes > 0 && row_bytes % 16 == 0, op,
          "row_bytes must be a positive multiple of 16; got " + std::to_string(row_bytes));
  const int64_t layers = device_layers.numel();
  if (batch == 0 || layers == 0) return;
  hisparse::CommitAcceptedParams p{};
  p.req_pool_indices = data_of<void>(req_pool_indices);
  p.seq_lens = data_of<void>(seq_lens);
  p.accept_lens = data_of<void>(accept_lens);
  p.req_pool_indices_is_64 = is_int(req_pool_indices, 64);
  p.seq_lens_is_64 = is_int(seq_lens, 64);
  p.accept_lens_is_64 = is_int(accept_lens, 64);
  p.num_real_reqs = data_of<int32_t>(num_real_reqs);
  p.req_to_token = data_of<int32_t>(req_to_token);
  p.req_to_token_stride = req_to_token.stride(0);
  p.context = req_to_token.size(1);
  p.device_row_of_loc = data_of<int32_t>(device_row_of_loc);
  p.buffer_of_req = data_of<int32_t>(buffer_of_req);
  p.slot_rows = data_of<int32_t>(slot_rows);
  p.slot_rows_stride = slot_rows.stride(0);
  p.buffer_size = buffer_size;
  p.device_layers = data_of<uint64_t>(device_layers);
  p.host_layers = data_of<uint64_t>(host_layers);
  p.layers = layers;
  p.row_words = row_bytes / 16;
  p.batch = batch;
  p.num_positions = num_positions;
  const int64_t copies = batch * (num_positions + 1) * layers;
  require(copies <= int64_t(INT32_MAX) * hisparse::kCommitCopiesPerBlock, op,
          std::to_string(copies) + " row copies exceed the grid limit");
  launch_decode_rows(hisparse::commit_accepted_kernel, p,
                     (copies + hisparse::kCommitCopiesPerBlock - 1) / hisparse::kCommitCopiesPerBlock, stream, op,
                     std::to_string(batch) + " batch rows x " + std::to_string(num_positions + 1) + " copies x " +
                         std::to_string(layers) + " layers");
}

// Once per target-verify forward: the page table SGLang's fused top-k maps its positions through
// (ops/reference.py::verify_page_table). Row i of page_table (int32 [B x T, W], logical page ids) belongs to
// batch row i / num_positions; out (int32, the same shape) gets a resident request's device pages and an
// offloaded request's column indices.
void hisparse_verify_page_table(TensorView page_table, TensorView req_pool_indices, TensorView buffer_of_req,
                                TensorView device_row_of_loc, TensorView out, int64_t num_positions,
                                int64_t page_size, int64_t stream) {
  constexpr const char* op = "verify_page_table";
  require(num_positions >= 1, op, "num_positions must be >= 1; got " + std::to_string(num_positions));
  require(page_size >= 1, op, "page_size must be >= 1; got " + std::to_string(page_size));
  require_tensor(on_cuda(page_table) && page_table.ndim() == 2 && is_int(page_table, 32) &&
                     (page_table.size(1) <= 1 || page_table.stride(1) == 1),
                 op, "page_table", "int32 [rows, pages] on CUDA, rows contiguous", page_table);
  const int64_t rows = page_table.size(0);
  const int64_t width = page_table.size(1);
  require_tensor(on_cuda(req_pool_indices) && req_pool_indices.ndim() == 1 && is_index(req_pool_indices) &&
                     req_pool_indices.size(0) * num_positions == rows &&
                     (req_pool_indices.size(0) == 0 || req_pool_indices.stride(0) == 1),
                 op, "req_pool_indices",
                 "a contiguous int32/int64 [B] tensor on CUDA with B x num_positions = page_table's rows",
                 req_pool_indices);
  require_tensor(on_cuda(buffer_of_req) && buffer_of_req.ndim() == 1 && is_int(buffer_of_req, 32), op, "buffer_of_req",
                 "int32 [R] on CUDA", buffer_of_req);
  require_tensor(on_cuda(device_row_of_loc) && device_row_of_loc.ndim() == 1 && is_int(device_row_of_loc, 32) &&
                     (device_row_of_loc.size(0) - 1) % page_size == 0,
                 op, "device_row_of_loc", "int32 [N + 1] on CUDA, N a multiple of page_size", device_row_of_loc);
  require_tensor(on_cuda(out) && out.ndim() == 2 && is_int(out, 32) && out.size(0) == rows && out.size(1) == width &&
                     (width <= 1 || out.stride(1) == 1),
                 op, "out", "int32 [rows, pages] on CUDA like page_table, rows contiguous", out);
  const int64_t entries = rows * width;
  if (entries == 0) return;
  hisparse::VerifyPageTableParams p{};
  p.page_table = data_of<int32_t>(page_table);
  p.page_table_stride = page_table.stride(0);
  p.req_pool_indices = data_of<void>(req_pool_indices);
  p.req_pool_indices_is_64 = is_int(req_pool_indices, 64);
  p.buffer_of_req = data_of<int32_t>(buffer_of_req);
  p.device_row_of_loc = data_of<int32_t>(device_row_of_loc);
  p.num_pages = (device_row_of_loc.size(0) - 1) / page_size;
  p.page_size = page_size;
  p.out = data_of<int32_t>(out);
  p.out_stride = out.stride(0);
  p.width = width;
  p.entries = entries;
  p.num_positions = num_positions;
  launch_decode_rows(hisparse::verify_page_table_kernel, p, (entries + kDecodeRowThreads - 1) / kDecodeRowThreads,
                     stream, op, std::to_string(rows) + " rows x " + std::to_string(width) + " pages");
}

// After acceptance, before SGLang uses the accept lengths: a row whose verify_limit (set by
// swap_in_positions) is below its accept length accepts only the positions before the limit
// (ops/reference.py::cap_accepted); every verify_limit entry of the batch is reset for the next step.
void hisparse_cap_accepted(TensorView verify_limit, TensorView accept_lens, TensorView accept_index, TensorView counters,
                           int64_t stream) {
  constexpr const char* op = "cap_accepted";
  require_tensor(on_cuda(accept_lens) && accept_lens.ndim() == 1 && is_index(accept_lens) &&
                     (accept_lens.size(0) == 0 || accept_lens.stride(0) == 1),
                 op, "accept_lens", "a contiguous int32/int64 [B] tensor on CUDA", accept_lens);
  const int64_t batch = accept_lens.size(0);
  require_tensor(on_cuda(accept_index) && accept_index.ndim() == 2 && accept_index.size(0) == batch &&
                     is_int(accept_index, 32) && (batch == 0 || (accept_index.stride(1) == 1 &&
                                                                 accept_index.stride(0) == accept_index.size(1))),
                 op, "accept_index", "a contiguous int32 [B, W] tensor on CUDA, B as accept_lens", accept_index);
  require_verify_limit(op, verify_limit, batch);
  require_tensor(counters.numel() == 0 || (is_int(counters, 64) && counters.numel() >= 2 && on_cuda(counters)), op,
                 "counters", "int64 [2] on CUDA or empty", counters);
  if (batch == 0) return;
  hisparse::CapAcceptedParams p{};
  p.verify_limit = data_of<int32_t>(verify_limit);
  p.accept_lens = data_of<void>(accept_lens);
  p.accept_lens_is_64 = is_int(accept_lens, 64);
  p.accept_index = data_of<int32_t>(accept_index);
  p.width = accept_index.size(1);
  p.counters = counters.numel() ? reinterpret_cast<unsigned long long*>(data_of<int64_t>(counters)) : nullptr;
  p.batch = batch;
  launch_decode_rows(hisparse::cap_accepted_kernel, p, (batch + kDecodeRowThreads - 1) / kDecodeRowThreads, stream, op,
                     std::to_string(batch) + " batch rows");
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(swap_in, hisparse_swap_in);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(swap_in_occupancy, hisparse_swap_in_occupancy);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(swap_in_positions, hisparse_swap_in_positions);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(swap_in_positions_occupancy, hisparse_swap_in_positions_occupancy);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(copy_rows, hisparse_copy_rows);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(copy_row_runs, hisparse_copy_row_runs);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(backup_newest, hisparse_backup_newest);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bind_rows, hisparse_bind_rows);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bind_verify_slots, hisparse_bind_verify_slots);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(commit_accepted, hisparse_commit_accepted);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(cap_accepted, hisparse_cap_accepted);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(verify_page_table, hisparse_verify_page_table);
