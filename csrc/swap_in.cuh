// The HiSparse swap-in kernel. Raw pointers and sizes only; the semantics are those of
// hisparse_sglang/ops/reference.py::swap_in, which this kernel matches bit for bit. The host launch is
// hisparse_swap_in in swap_in_binding.cu; the constants are in swap_in_config.h, the shared-memory plan
// in ops/swap_in_plan.py.
//
// swap_in: grid = batch * splits CTAs. CTA (b, part) with b = blockIdx.x % batch and
// part = blockIdx.x / batch, so the planner CTAs (part 0) have the lowest block indices.
//   * padded batch row (b >= num_real_reqs): the planner writes -1 to the output row.
//   * resident request (buffer_of_req[r] < 0): every CTA of the row translates its share of the entries
//     (resident_share: K / splits, whole warps) from positions to device rows; nothing else runs. In
//     swap_in_positions with resident_rows_given the entries are device rows already and are copied.
//   * offloaded request: the planner announces that it has started (kPlannerStarted) and looks every
//     entry up in the token -> slot map (one load per entry); a hit writes its slot's row and stamps
//     the slot at once. Only if some entry missed does the block go on: it deduplicates the misses,
//     selects the least recently used slots not hit (two histogram passes over the slots' ages),
//     closes the claims (below), updates the tables, writes the missed entries' outputs and copies
//     the rows no copier claimed (with splits == 1: every missed row).
//   * copier CTAs (part >= 1, splits > 1): copier c = part - 1 claims chunk c of the top-k entries
//     (sets its bit in the row's claim words) as it starts, looks its entries up in the map on its
//     own and, if its claim came before the planner closed the claims, stays: once it has seen the
//     planner's announcement (or failed to give its chunk back, which only a closed claim prevents)
//     it counts its lookups (release) and starts reading the missed host rows into shared memory
//     (zero-copy reads of pinned host memory) while the planner still chooses the slots; once the
//     planner publishes the outputs (flags[b] = kPlanReady) it writes its rows to the device rows
//     named there. A copier with no miss leaves after its lookups.
//   * Closing the claims: before it changes the map, the planner sets kClaimsClosed in each claim
//     word; the bits it gets back are the copiers that stay, and it waits until they have looked
//     (so no copier sees a miss as a hit). A copier whose claim comes later leaves; the planner
//     copies the misses first seen in the chunks no copier kept.
// Forward progress: a CTA only ever waits for CTAs of its row that have started (a copier for the
// planner, whose announcement it saw or whose close beat its give-back; the planner for the copiers
// whose claims it found, whose lookups wait for nothing), so the kernel completes whether or not its
// grid is co-resident (docs/kernels.md, "Forward progress"). The last CTA of an offloaded row to
// finish resets the row's flag, counter word and claim words, so the kernel can be replayed in a CUDA
// graph without host involvement.
//
// swap_in_positions (swap_in_positions_kernel; reference.py::swap_in_positions): one target-verify
// forward asks for T query positions per request (top_k [B, T, K], each row's T x K entries contiguous).
// The positions are served in consecutive groups of G (swap_in_plan.positions_per_group), one launch per
// group in stream order (the binding, hisparse_swap_in_positions): a launch's batch row is the request and
// its entries are the G x K entries of the group's positions (top_k and out advanced to the group's first
// position, the row stride still T x K; position_width = K, position_offset = the group's first position
// g); entry i belongs to query position j = g + i / K, whose causal limit is s + j (s = seq_lens[b], the
// committed length). The same planner and copiers run on the row with length s: history entries
// (t < s - 1) of the group's positions are looked up, deduplicated and copied together, in position-major
// order, as swap_in serves one row of them, each token's row copied once: a token several positions
// missed is copied by the owner of its first entry, and a copier keeping a later entry only writes that
// entry's output (the planner hands it kDuplicateBase - row; without this a launch of G = 2 positions
// copied nearly twice one position's bytes, measured on an H100). The newest accepted token (t == s - 1) maps to slot D
// and a verify token t in [s, s + j] to slot D + kVerifySlotBase + (t - s), both in the hit path; a
// resident request translates every entry up to its position's limit. A later group finds what an earlier
// one copied as hits and never evicts a row an earlier one returned (stamp s this step: not a victim). Where
// a group's misses outnumber the slots it may evict (D < the union of the positions' history), the first
// position whose miss finds no slot and every later one are left out: their outputs are -1, the row's
// verify_limit is lowered to that position (atomicMin; later groups and layers serve none at or past it),
// and the caller caps the step's accepted tokens there (cap_accepted, decode_rows.cuh). The first group
// always fits (G x K <= D), so position 0 is always served. The shared-memory plan is sized
// by the G x K entries (ops/swap_in_plan.py::swap_in_positions_plan). Both kernels share one body,
// specialised at compile time (POSITIONS), so swap_in's code is the one-position kernel's as before.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "primitives.cuh"
#include "swap_in_config.h"

namespace hisparse {

// Byte offsets of the regions of a swap_in CTA's dynamic shared memory, and its size. The host
// computes them (hisparse_sglang/ops/swap_in_plan.py::swap_in_plan, the one owner of the layout
// and of the size the config is checked against) and passes them with every launch; every role
// carves its regions from here. Field order = swap_in_plan.PLAN_FIELDS.
struct SwapInSmemPlan {
  int64_t hash_bits;        // hash table of 1 << hash_bits >= 2 * K entries (indices fit int16)
  int64_t total_bytes;      // dynamic shared memory of every CTA
  int64_t warp_sums;        // uint64 [THREADS / 32 + 1]: block scans (every role)
  int64_t selection;        // int32 [4]: coarse bucket, count above it, fine bucket, count above it
  int64_t role;             // planner: its tables below; copier: miss list, then staged rows
  int64_t keys;             // int32 [H]: missed token per hash entry
  int64_t first;            // int32 [H]: its first entry
  int64_t hash_host_row;    // int32 [H]: its host row (the misses the planner copies)
  int64_t hash_device_row;  // int32 [H]: its device row
  int64_t row_of_slot;      // int32 [D]
  int64_t token_of_slot;    // int32 [D]
  int64_t entry_state;      // int32 [K]
  int64_t slot_hit;         // uint32 [(D + 31) / 32]
  int64_t coarse;           // int32 [kCoarseBuckets]
  int64_t fine;             // int32 [kFineBuckets]
  int64_t miss_hash;        // int16 [K]: hash index per miss rank
  int64_t victim_slot;      // int16 [K]: victim slot per miss rank
  int64_t slot_age;         // int16 [D] (-1: hit)
  int64_t entry_hash;       // int16 [K]: hash index of a missed entry
};
constexpr int kPlanFields = sizeof(SwapInSmemPlan) / sizeof(int64_t);

template <typename T>
__device__ __forceinline__ T* smem_region(uint8_t* smem, int64_t offset) {
  return reinterpret_cast<T*>(smem + offset);
}

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
  int32_t* flags;                    // [batch] kPlanReady once the plan is published, 0 between launches
  int32_t* row_counts;               // [batch] looked | finished | planner started (swap_in_config.h), 0 between launches
  unsigned long long* claims;        // [batch, kClaimWords] copiers' claims | kClaimsClosed, 0 between launches
  int batch;
  int num_top_k;                     // K <= buffer_size, K <= 8192
  int buffer_size;                   // D <= kMaxBufferSize
  int splits;                        // CTAs per batch row, in [1, kMaxSplits]
  SwapInSmemPlan plan;
  // swap_in_positions only (num_top_k is then G x K, the entries of a group of G positions): entries per
  // query position, K, and the group's first position (its entry i belongs to position
  // position_offset + i / K). Last, so the fields swap_in reads keep their offsets.
  int position_width;
  int position_offset;
  // swap_in_positions only: [batch] the first query position of each row that is not served this step
  // (in/out; a large value when every position is). A launch serves no position at or past it and lowers
  // it where its group's misses do not fit the slots it may evict (the planner, after its lookups).
  int32_t* verify_limit;
  // swap_in_positions only: nonzero when a resident request's entries are already its device rows (SGLang's
  // fused top-k mapped them through verify_page_table); they are passed through as they are.
  int resident_rows_given;
};

// swap_in_positions: the query position of a launch's entry i (its group starts at position_offset, each
// position has position_width entries).
__device__ __forceinline__ int query_position(const SwapInParams& p, int i) {
  return p.position_offset + i / p.position_width;
}

// Phase timestamps for diagnostics (`benchmarks/bench_swap_in.py trace` builds with -DHISPARSE_TRACE):
// thread 0 of batch row 0's CTAs records the global timer at each mark and prints them on exit.
#ifdef HISPARSE_TRACE
__shared__ uint64_t trace_marks[8];
#define HISPARSE_START()                                                   \
  do {                                                                     \
    if (threadIdx.x == 0) {                                                \
      for (int k_ = 0; k_ < 8; ++k_) trace_marks[k_] = global_time_ns();   \
    }                                                                      \
  } while (0)
#define HISPARSE_MARK(k) \
  do {                    \
    if (threadIdx.x == 0) trace_marks[k] = global_time_ns(); \
  } while (0)
#define HISPARSE_DUMP(role)                                                                                    \
  do {                                                                                                         \
    if (threadIdx.x == 0 && blockIdx.x % p.batch == 0) {                                                       \
      printf("trace %s %d %llu %lld %lld %lld %lld %lld %lld %lld\n", role, int(blockIdx.x / p.batch),           \
             (unsigned long long)trace_marks[0], (long long)(trace_marks[1] - trace_marks[0]),                 \
             (long long)(trace_marks[2] - trace_marks[0]), (long long)(trace_marks[3] - trace_marks[0]),       \
             (long long)(trace_marks[4] - trace_marks[0]), (long long)(trace_marks[5] - trace_marks[0]),       \
             (long long)(trace_marks[6] - trace_marks[0]), (long long)(trace_marks[7] - trace_marks[0]));      \
    }                                                                                                          \
  } while (0)
#else
#define HISPARSE_START() \
  do {                    \
  } while (0)
#define HISPARSE_MARK(k) \
  do {                    \
  } while (0)
#define HISPARSE_DUMP(role) \
  do {                       \
  } while (0)
#endif

// Thread 0, the CTA's last access to its row's workspace (an offloaded row, splits > 1): counts the CTA
// done; the last of the row's `splits` CTAs resets the flag, the counter word and the claim words for
// the next launch (CUDA-graph replay needs no host work). A CTA that touched the flag or a claim word
// (`released`: every copier, a planner that closed the claims) counts itself with release, so those
// accesses are performed before its count, and the last CTA fences (acquire) before it resets: none of
// them can land after the reset and leak into the next launch. The counter word's own accesses need
// no fence (one location).
__device__ __forceinline__ void arrive_done(const SwapInParams& p, int b, bool released) {
  int32_t before;
  if (released) {
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;"
                 : "=r"(before)
                 : "l"(p.row_counts + b), "r"(kFinished)
                 : "memory");
  } else {
    before = atomicAdd(p.row_counts + b, kFinished);
  }
  if (((before >> kFinishedShift) & kCounterMask) == p.splits - 1) {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    p.flags[b] = 0;
    p.row_counts[b] = 0;
#pragma unroll
    for (int w = 0; w < kClaimWords; ++w) p.claims[int64_t(b) * kClaimWords + w] = 0;
  }
}

#if defined(HISPARSE_TEST_LATE_COPIERS_NS) || defined(HISPARSE_TEST_LATE_ARRIVALS_NS) || \
    defined(HISPARSE_TEST_LATE_PLANNER_NS)
// Test hooks, compiled only into variant builds (jit.load_module(defines=...); tests/gpu): thread 0
// sleeps `ns` nanoseconds on the global timer.
__device__ __forceinline__ void test_sleep(uint64_t ns) {
  if (threadIdx.x == 0) {
    const uint64_t until = global_time_ns() + ns;
    while (global_time_ns() < until) __nanosleep(kTestSleepNs);
  }
}
#endif

// The host row a missed entry is copied from: `row`, except in the test variant built with
// HISPARSE_TEST_CORRUPT_MISSES=N (jit.load_module(defines=...); benchmarks/e2e arm dx), where every N-th
// miss of a CTA's list (`index`) is read from the neighbouring host row, a plausible but wrong KV row:
// the build that the end-to-end judge and the in-server KV check must reject. Never in production.
__device__ __forceinline__ int32_t missed_host_row(int32_t row, int index) {
#ifdef HISPARSE_TEST_CORRUPT_MISSES
  return index % (HISPARSE_TEST_CORRUPT_MISSES) == 0 ? (row ^ 1) : row;
#else
  (void)index;
  return row;
#endif
}

// Thread 0 of copier `c`: claims its chunk; returns whether the claim came before the planner closed
// the claims (the copier stays) — the atomic's result is read only after the copier's lookups.
__device__ __forceinline__ unsigned long long claim_chunk(const SwapInParams& p, int b, int c) {
#ifdef HISPARSE_TEST_LATE_ARRIVALS_NS
  // Test hook: the copiers of block part >= 2 claim late, after the planner has closed the claims
  // (unless it took the hit path), so it must copy the chunks they would have claimed.
  if (blockIdx.x / p.batch >= 2) test_sleep(static_cast<uint64_t>(HISPARSE_TEST_LATE_ARRIVALS_NS));
#endif
  return atomicOr(p.claims + int64_t(b) * kClaimWords + c / kCopiersPerClaimWord,
                  1ull << (c % kCopiersPerClaimWord));
}

// Thread 0 of copier `c`, whose claim came before the close: whether it may wait for the plan. Yes
// once the planner has announced that it started (`started`: the counter word read when the copier
// started, else read again now); otherwise it gives its chunk back (clears its bit): that fails only
// if the planner closed the claims meanwhile, and then the planner has started and counts on it too.
__device__ __forceinline__ bool stay_for_plan(const SwapInParams& p, int b, int c, int32_t started) {
  if (started & kPlannerStarted) return true;
  if (load_acquire(p.row_counts + b) & kPlannerStarted) return true;
  const unsigned long long before = atomicAnd(p.claims + int64_t(b) * kClaimWords + c / kCopiersPerClaimWord,
                                              ~(1ull << (c % kCopiersPerClaimWord)));
  return (before & kClaimsClosed) != 0;
}

// Spins (thread 0) until *counter reaches `value` (acquire), then the block goes on together.
__device__ __forceinline__ void wait_until_at_least(const int32_t* counter, int value) {
  if (threadIdx.x == 0) {
    while (load_acquire(counter) < value) __nanosleep(kSpinSleepNs);
  }
  __syncthreads();
}

// Counts a copier CTA in its row's looked field once all its threads are done with their lookups (the
// caller synchronizes the block first): the release orders those loads before the planner's map update.
__device__ __forceinline__ void count_looked(int32_t* row_count) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(row_count), "r"(kLooked) : "memory");
}

// Threads [0, kClaimWords) of the planner: close the row's claim words; `kept[w]` receives the copiers'
// bits each held at its close (the copiers that stay). Then thread 0 waits until that many copiers
// have counted their lookups; they have started and their lookups wait for nothing, so the wait ends.
// The first poll of the count is issued together with the close (neither waits for the other): in
// the common case the close adds no round trip to the planner's path. The caller synchronizes after.
__device__ __forceinline__ void close_claims(const SwapInParams& p, int b, unsigned long long* kept) {
  const int tid = threadIdx.x;
  if (tid < kClaimWords) {
    kept[tid] = atomicOr(p.claims + int64_t(b) * kClaimWords + tid, kClaimsClosed) & ~kClaimsClosed;
  }
  __syncthreads();
  if (tid == 0) {
    int claimed = 0;
#pragma unroll
    for (int w = 0; w < kClaimWords; ++w) claimed += __popcll(kept[w]);
    int32_t seen = load_acquire(p.row_counts + b);
    while ((seen & kCounterMask) < claimed) {
      __nanosleep(kSpinSleepNs);
      seen = load_acquire(p.row_counts + b);
    }
  }
}

// Whether copier chunk `c` is kept by its copier (its bit in the closed claim words).
__device__ __forceinline__ bool chunk_kept(const unsigned long long* kept, int c) {
  return (kept[c / kCopiersPerClaimWord] >> (c % kCopiersPerClaimWord)) & 1ull;
}

// One round of a thread's top-k entries: kBatch entries THREADS apart from `index`, counted from
// entry `begin`, -1 at or past `end` (also counted from `begin`); the first round takes the batch the
// kernel loaded up front. Every lookup loop of the kernel (resident translation, planner, copier)
// starts its rounds here, so the dependent loads after it cost one memory round trip per batch, not
// per entry.
template <int THREADS>
__device__ __forceinline__ void load_top_k_batch(int32_t (&t)[kBatch], const int32_t* top_k,
                                                 const int32_t (&first_batch)[kBatch], bool first_round, int begin,
                                                 int index, int end) {
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    const int i = index + u * THREADS;
    t[u] = first_round ? first_batch[u] : (i < end ? top_k[begin + i] : -1);
  }
}

// Entries per CTA of a resident row: an equal share of the top-k over all its CTAs, rounded up to whole warps.
// (A resident row's lookups are three dependent loads per entry; spread over the row's CTAs they take one round
// where the planner alone took K / (THREADS * kBatch) rounds, at bs 1 most of the launch.)
__device__ __forceinline__ int resident_share(int top_k, int splits) {
  return ((top_k + splits - 1) / splits + kWarpSize - 1) / kWarpSize * kWarpSize;
}

// Entries per copier CTA: an equal share of the top-k, rounded up to whole warps.
__device__ __forceinline__ int copier_chunk(int top_k, int splits) {
  const int copiers = splits - 1;
  return ((top_k + copiers - 1) / copiers + kWarpSize - 1) / kWarpSize * kWarpSize;
}

// Copier `c` (block part c + 1) of an offloaded request, owning entries [begin, end) of a chunk of
// `chunk` entries; see the file comment. Returns with the block converged, and whether it touched the
// row's claims or flag (the caller counts it done with release then).
template <int THREADS, bool POSITIONS>
__device__ __forceinline__ bool copier(const SwapInParams& p, int b, int c, int begin, int end, int chunk,
                                       const int32_t* top_k, const int32_t (&first_batch)[kBatch],
                                       const int32_t* positions_to_loc, const int16_t* token_slot, int32_t newest,
                                       uint8_t* smem, uint64_t* warp_sums, int32_t* selection) {
  const int tid = threadIdx.x;
  if (begin >= end) return false;  // no entries: no claim (the planner finds its bit clear, nothing to copy)
  const int span = end - begin;
  const int vectors_per_row = static_cast<int>(p.row_bytes / kPieceBytes);
  int32_t* out = p.out + int64_t(b) * p.out_stride;

  // The role's area: the miss list (entry, host row, device row), then as many staged rows as fit.
  int32_t* list_entry = smem_region<int32_t>(smem, p.plan.role);
  int32_t* list_host = list_entry + chunk;
  int32_t* list_device = list_host + chunk;  // before the compaction: host row of a missed entry, else -1
  const int list_bytes = kCopierListInts * chunk * static_cast<int>(sizeof(int32_t));
  const int64_t staged_offset = p.plan.role + (list_bytes + kPieceBytes - 1) / kPieceBytes * kPieceBytes;
  int4* staged = smem_region<int4>(smem, staged_offset);
  const int capacity = max(0, static_cast<int>((p.plan.total_bytes - staged_offset) / p.row_bytes));

  // The claim and a first look at the planner's announcement, in flight with the lookups; thread 0
  // reads them after the lookups.
  unsigned long long claim_before = 0;
  int32_t started = 0;
  if (tid == 0) {
    claim_before = claim_chunk(p, b, c);
    started = load_relaxed(p.row_counts + b);
  }

#ifdef HISPARSE_TEST_LATE_COPIERS_NS
  // Test hook: a copier that claimed its chunk looks its entries up late, long after the planner
  // reached its map update; the planner must wait for it.
  test_sleep(static_cast<uint64_t>(HISPARSE_TEST_LATE_COPIERS_NS));
  __syncthreads();
#endif

  // POSITIONS: positions at or past the row's verify_limit are padding, as for the planner. The planner may
  // lower the limit during this launch (to a position none of whose misses it places); a copier that reads
  // the lower value leaves out only entries whose outputs the planner sets to -1.
  const int32_t limit = POSITIONS ? __ldcg(p.verify_limit + b) : 0;

  // C1: lookups; a miss records its host row.
  int local = 0;
  const int rounds = (span + THREADS * kBatch - 1) / (THREADS * kBatch);
  for (int round = 0; round < rounds; ++round) {
    int32_t t[kBatch];
    int16_t slot[kBatch];
    int32_t host_row[kBatch];
    load_top_k_batch<THREADS>(t, top_k, first_batch, round == 0, begin, tid + round * kBatch * THREADS, span);
    if constexpr (POSITIONS) {
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = begin + tid + (round * kBatch + u) * THREADS;
        if (query_position(p, i) >= limit) t[u] = -1;
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) slot[u] = (t[u] >= 0 && t[u] < newest) ? token_slot[t[u]] : int16_t(0);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      host_row[u] = (t[u] >= 0 && t[u] < newest && slot[u] < 0) ? positions_to_loc[t[u]] : 0;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = tid + (round * kBatch + u) * THREADS;
      const bool miss = t[u] >= 0 && t[u] < newest && slot[u] < 0;
      if (e < span) list_device[e] = miss ? host_row[u] : -1;
      local += miss;
    }
  }
  uint64_t total;
  int rank = static_cast<int>(block_exclusive_scan<THREADS>(local, warp_sums, total));
  const int num_miss = static_cast<int>(total);
  HISPARSE_MARK(1);
  for (int round = 0; round < rounds; ++round) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = tid + (round * kBatch + u) * THREADS;
      if (e < span && list_device[e] >= 0) {
        list_entry[rank] = begin + e;
        list_host[rank] = list_device[e];
        ++rank;
      }
    }
  }

  // Stay (the claim came before the close, and the planner has started or closed meanwhile) or leave
  // the chunk to the planner. Staying, count the lookups: the scan synchronized the block after them.
  if (tid == 0) {
    const bool stays = !(claim_before & kClaimsClosed) && stay_for_plan(p, b, c, started);
    if (stays) count_looked(p.row_counts + b);
    selection[0] = stays;
  }
  __syncthreads();
  if (!selection[0] || num_miss == 0) {
    HISPARSE_DUMP("copy");
    return true;
  }

  // C2: stage the first missed rows in shared memory while the planner chooses the slots.
  const int staged_rows = min(num_miss, capacity);
  copy_rows_by<THREADS>(
      staged_rows, vectors_per_row,
      [&](int m, int v) { return load_piece(p.host_kv, missed_host_row(list_host[m], m), p.row_bytes, v); },
      [&](int m, int v, int4 value) { staged[m * vectors_per_row + v] = value; });

  // C3: the planner's outputs name the device rows.
  HISPARSE_MARK(2);
  wait_until_at_least(p.flags + b, kPlanReady);
  HISPARSE_MARK(3);
  for (int m = tid; m < num_miss; m += THREADS) {
    int32_t row = __ldcg(out + list_entry[m]);
    if constexpr (POSITIONS) {
      // A token this group's positions missed more than once: the planner marked every entry of it
      // but the first (kDuplicateBase) where the entry's chunk is a copier's; the first entry's owner
      // copies the row, this copier only writes the entry's output (no other CTA reads it).
      if (row <= kDuplicateBase) {
        row = kDuplicateBase - row;
        out[list_entry[m]] = row;
        row = -1;
      }
    }
    list_device[m] = row;
  }
  __syncthreads();
  // list_device[m] < 0 (POSITIONS only): a duplicate, neither loaded nor stored.
  copy_rows_by<THREADS>(
      staged_rows, vectors_per_row, [&](int m, int v) { return staged[m * vectors_per_row + v]; },
      [&](int m, int v, int4 value) {
        if (!POSITIONS || list_device[m] >= 0) store_piece(p.device_kv, list_device[m], p.row_bytes, v, value);
      });
  copy_rows_by<THREADS>(
      num_miss - staged_rows, vectors_per_row,
      [&](int m, int v) {
        if (POSITIONS && list_device[staged_rows + m] < 0) return int4{};
        return load_piece(p.host_kv, missed_host_row(list_host[staged_rows + m], staged_rows + m), p.row_bytes, v);
      },
      [&](int m, int v, int4 value) {
        if (!POSITIONS || list_device[staged_rows + m] >= 0) {
          store_piece(p.device_kv, list_device[staged_rows + m], p.row_bytes, v, value);
        }
      });
  HISPARSE_MARK(4);
  HISPARSE_DUMP("copy");
  return true;
}

// The planner CTA (part 0) of an offloaded request; see the file comment. Looks every entry up,
// and if any missed: ranks the misses, selects the least recently used slots not hit, updates the
// tables, writes the missed entries' outputs and copies the rows of the misses no copier claimed.
// POSITIONS (swap_in_positions): K counts the entries of every query position, and a verify token
// takes its verify slot's row in the hit path.
template <int THREADS, bool POSITIONS>
__device__ __forceinline__ void planner(const SwapInParams& p, int b, int K, int D, int32_t* out, const int32_t* top_k,
                                        const int32_t (&first_batch)[kBatch], const int32_t* positions_to_loc,
                                        int32_t buffer, int32_t now, int32_t newest, int16_t* token_slot,
                                        uint8_t* smem, uint64_t* warp_sums, int32_t* selection) {
  const int tid = threadIdx.x;
  // Victim selection: the coarse bucket of the youngest victim and the victims above it, the same
  // for its fine bucket.
  int32_t& coarse_bucket = selection[0];
  int32_t& coarse_above = selection[1];
  int32_t& fine_bucket = selection[2];
  int32_t& fine_above = selection[3];
  const int32_t* slot_rows = p.slot_rows + int64_t(buffer) * p.slot_rows_stride;
  const int hash_bits = static_cast<int>(p.plan.hash_bits);
  const int H = 1 << hash_bits;
  const int bitmap_words = (D + kBitmapWordBits - 1) / kBitmapWordBits;
  int32_t* keys = smem_region<int32_t>(smem, p.plan.keys);
  int32_t* first = smem_region<int32_t>(smem, p.plan.first);
  int32_t* hash_host_row = smem_region<int32_t>(smem, p.plan.hash_host_row);
  int32_t* hash_device_row = smem_region<int32_t>(smem, p.plan.hash_device_row);
  int32_t* row_of_slot = smem_region<int32_t>(smem, p.plan.row_of_slot);
  int32_t* token_of_slot = smem_region<int32_t>(smem, p.plan.token_of_slot);
  int32_t* entry_state = smem_region<int32_t>(smem, p.plan.entry_state);
  uint32_t* slot_hit = smem_region<uint32_t>(smem, p.plan.slot_hit);
  int32_t* coarse = smem_region<int32_t>(smem, p.plan.coarse);
  int32_t* fine = smem_region<int32_t>(smem, p.plan.fine);
  int16_t* miss_hash = smem_region<int16_t>(smem, p.plan.miss_hash);
  int16_t* victim_slot = smem_region<int16_t>(smem, p.plan.victim_slot);
  int16_t* slot_age = smem_region<int16_t>(smem, p.plan.slot_age);
  int16_t* entry_hash = smem_region<int16_t>(smem, p.plan.entry_hash);

  int32_t* slot_tokens = p.slot_tokens + int64_t(buffer) * p.slot_tokens_stride;
  int32_t* stamps = p.slot_stamps + int64_t(buffer) * p.slot_stamps_stride;

  // Each thread owns a contiguous range of slots and (miss path) of entries: scans rank in index
  // order.
  const int slots_per_thread = (D + THREADS - 1) / THREADS;
  const int slot_begin = min(D, tid * slots_per_thread);
  const int slot_end = min(D, slot_begin + slots_per_thread);

  // The announcement copiers wait for before they rely on the plan (fire and forget).
  if (p.splits > 1 && tid == 0) {
#ifdef HISPARSE_TEST_LATE_PLANNER_NS
    // Test hook: the planner announces itself late, after its copiers looked: they give their
    // chunks back and leave, and the planner copies every miss.
    test_sleep(static_cast<uint64_t>(HISPARSE_TEST_LATE_PLANNER_NS));
#endif
    asm volatile("red.relaxed.gpu.global.or.b32 [%0], %1;" ::"l"(p.row_counts + b), "r"(kPlannerStarted) : "memory");
  }

  // POSITIONS: the first position this launch may not serve (an earlier group or layer of the step found
  // its misses did not fit); its entries and every later position's are padding.
  const int32_t limit = POSITIONS ? __ldcg(p.verify_limit + b) : 0;

  // H1: every entry is looked up in the token -> slot map.
  {
    const int32_t newest_row = slot_rows[D];
    int lookups = 0;
    int missed = 0;
    for (int base = tid; base < K; base += THREADS * kBatch) {
      int32_t t[kBatch];
      int32_t slot[kBatch];
      load_top_k_batch<THREADS>(t, top_k, first_batch, base == tid, 0, base, K);
      if constexpr (POSITIONS) {
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          if (query_position(p, base + u * THREADS) >= limit) t[u] = -1;
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) slot[u] = (t[u] >= 0 && t[u] < newest) ? token_slot[t[u]] : -1;
      int32_t row[kBatch];
      if constexpr (POSITIONS) {
        // A verify token t in [s, s + j] of query position j = position_offset + i / position_width: its
        // verify slot's row, loaded with the hits' rows (now = s, newest = s - 1).
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const bool verify =
              t[u] > newest && t[u] - now <= query_position(p, base + u * THREADS);
          row[u] = slot[u] >= 0 ? slot_rows[slot[u]] : (verify ? slot_rows[D + kVerifySlotBase + (t[u] - now)] : -1);
        }
      } else {
#pragma unroll
        for (int u = 0; u < kBatch; ++u) row[u] = slot[u] >= 0 ? slot_rows[slot[u]] : -1;
      }
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
        // Outputs of padding, the newest token and hits (and of verify tokens, whose row[u] is their
        // slot's); hits stamp their slot.
        if (state >= 0) {
          out[i] = row[u];
          stamps[state] = now;
        } else if (state == kNewest) {
          out[i] = newest_row;
        } else if (state == kDone) {
          out[i] = POSITIONS ? row[u] : -1;
        }
      }
    }
    // Lookup counter: one global atomic per CTA (one per warp made many CTAs wait on one address).
    // warp_sums is free until the miss path's first scan, which comes after another barrier.
    if (p.counters != nullptr) {
      lookups = static_cast<int>(__reduce_add_sync(0xffffffffu, static_cast<unsigned>(lookups)));
      if (tid % kWarpSize == 0) warp_sums[tid / kWarpSize] = static_cast<uint64_t>(lookups);
    }
    missed = __syncthreads_or(missed);
    if (p.counters != nullptr && tid < kWarpSize) {
      const unsigned warp_lookups = tid < THREADS / kWarpSize ? static_cast<unsigned>(warp_sums[tid]) : 0u;
      const unsigned block_lookups = __reduce_add_sync(0xffffffffu, warp_lookups);
      if (tid == 0 && block_lookups > 0) atomicAdd(p.counters, static_cast<unsigned long long>(block_lookups));
    }
    HISPARSE_MARK(1);

    if (!missed) {  // all hits: done, claims left open (copiers find no miss and leave without waiting)
      if (p.splits > 1 && tid == 0) {
        arrive_done(p, b, false);  // it touched only the counter word
      }
      HISPARSE_DUMP("plan");
      return;
    }
  }

  // ---------------------------------------------------------------- miss path
  // Its scratch is cleared only now: on the hit path these ~9K shared-memory stores per CTA were
  // wasted and throttled the lookups (Nsight Compute, bs 128 hit-only: the MIO-throttle stall was
  // about a fifth of the samples); measured 0.2-0.5 us off a hit-only call at bs 1-32.
  for (int i = tid; i < H; i += THREADS) {
    keys[i] = kEmptyKey;
    first[i] = kNoFirst;
  }
  for (int j = tid; j < bitmap_words; j += THREADS) slot_hit[j] = 0;
  for (int j = tid; j < kCoarseBuckets + kFineBuckets; j += THREADS) {
    if (j < kCoarseBuckets) coarse[j] = 0;
    else fine[j - kCoarseBuckets] = 0;
  }
  __syncthreads();
  const int entries_per_thread = (K + THREADS - 1) / THREADS;
  const int entry_begin = min(K, tid * entries_per_thread);
  const int entry_end = min(K, entry_begin + entries_per_thread);
  const uint32_t mask = static_cast<uint32_t>(H - 1);

  // M1: mark the hit slots; insert the missed tokens into the hash set with their first entry
  // (and, with splits == 1, their host row: the planner copies every miss); stage the tokens, ages
  // and device rows of the slots.
  for (int i0 = entry_begin; i0 < entry_end; i0 += kBatch) {
    int32_t state[kBatch];
    int32_t host_row[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) state[u] = i0 + u < entry_end ? entry_state[i0 + u] : kDone;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      host_row[u] = (p.splits == 1 && state[u] <= kMissBase) ? positions_to_loc[kMissBase - state[u]] : 0;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (state[u] >= 0) {
        atomicOr(slot_hit + (state[u] >> kBitmapWordShift), 1u << (state[u] & (kBitmapWordBits - 1)));
      } else if (state[u] <= kMissBase) {
        const int32_t token = kMissBase - state[u];
        uint32_t h = hash_of(token, hash_bits);
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
  for (int j0 = slot_begin; j0 < slot_end; j0 += kBatch) {
    int32_t stamp[kBatch];
    int32_t token[kBatch];
    int32_t row[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const bool mine = j0 + u < slot_end;
      stamp[u] = mine ? stamps[j0 + u] : 0;
      token[u] = mine ? slot_tokens[j0 + u] : -1;
      row[u] = mine ? slot_rows[j0 + u] : 0;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (j0 + u < slot_end) {
        const int age = now - stamp[u];
        slot_age[j0 + u] = static_cast<int16_t>(age < 0 ? 0 : (age > kAgeCap ? kAgeCap : age));
        // POSITIONS, a later group: a slot stamped s this step holds a row an earlier group returned and
        // is never a victim (-1, like a hit's).
        if (POSITIONS && p.position_offset > 0 && stamp[u] == now) slot_age[j0 + u] = -1;
        token_of_slot[j0 + u] = token[u];
        row_of_slot[j0 + u] = row[u];
      }
    }
  }
  __syncthreads();

  HISPARSE_MARK(2);

  // M2: rank the misses (first occurrences, in entry order); histogram the ages of the slots not
  // hit by their high bits.
  uint64_t local = 0;
  for (int i = entry_begin; i < entry_end; ++i) {
    if (entry_state[i] <= kMissBase && first[entry_hash[i]] == i) ++local;
  }
  for (int j = slot_begin; j < slot_end; ++j) {
    if (slot_hit[j >> kBitmapWordShift] & (1u << (j & (kBitmapWordBits - 1)))) {
      slot_age[j] = -1;
    } else if (!POSITIONS || slot_age[j] >= 0) {
      atomicAdd(coarse + (slot_age[j] >> kFineBits), 1);
      if constexpr (POSITIONS) local += 1ull << 32;  // an evictable slot (the high half of the scan)
    }
  }
  uint64_t total;
  uint64_t rank = block_exclusive_scan<THREADS>(local, warp_sums, total);
  int num_miss = static_cast<int>(total);
  if constexpr (POSITIONS) rank &= 0xffffffffu;
  for (int i = entry_begin; i < entry_end; ++i) {
    const int h = entry_hash[i];
    if (entry_state[i] <= kMissBase && first[h] == i) {
      miss_hash[rank] = static_cast<int16_t>(h);
      ++rank;
    }
  }
  // POSITIONS: more misses than evictable slots. The misses are ranked position-major, so the position of
  // the first one that finds no slot (rank `evictable`) is the first this step cannot serve: only the
  // misses of earlier positions are placed, and that position and every later one are left out (outputs
  // -1, M6; verify_limit lowered). The first group always fits (G x K <= D), so position 0 is served.
  int failed = kNoVerifyLimit;  // the first position left out by this launch
  if constexpr (POSITIONS) {
    const int evictable = static_cast<int>(total >> 32);
    if (num_miss > evictable) {
      __syncthreads();  // miss_hash complete
      failed = query_position(p, first[miss_hash[evictable]]);
      // Every thread finds the first rank of that position (ranks below `evictable` are of positions <= it).
      int lo = 0;
      int hi = evictable;
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (query_position(p, first[miss_hash[mid]]) >= failed) hi = mid;
        else lo = mid + 1;
      }
      num_miss = lo;
      if (tid == 0) atomicMin(p.verify_limit + b, failed);
    }
  }
  if (tid < kWarpSize && (!POSITIONS || num_miss > 0)) warp_find_from_top(coarse, kCoarseBuckets, num_miss, &coarse_bucket, &coarse_above);
  __syncthreads();
  HISPARSE_MARK(3);

  // M3 and M4 select the victims (none when a launch of positions places no miss: every one was left out).
  if (!POSITIONS || num_miss > 0) {
    // M3: within the coarse bucket of the youngest victim, histogram the low bits of the age.
    const int high = coarse_bucket;
    for (int j = slot_begin; j < slot_end; ++j) {
      const int age = slot_age[j];
      if (age >= 0 && (age >> kFineBits) == high) atomicAdd(fine + (age & (kFineBuckets - 1)), 1);
    }
    __syncthreads();
    if (tid < kWarpSize) warp_find_from_top(fine, kFineBuckets, num_miss - coarse_above, &fine_bucket, &fine_above);
    __syncthreads();
    const int youngest = (high << kFineBits) | fine_bucket;  // age of the youngest victim
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
  }

  // Close the claims: the copiers that keep a chunk must have looked their entries up before the map
  // changes; the chunks no copier keeps are the planner's to copy. selection[] (room for the claim
  // words' kept bits) is free again: its scalars were read before the barrier above.
  HISPARSE_MARK(4);
  static_assert(kClaimWords * sizeof(unsigned long long) <= 4 * sizeof(int32_t), "selection holds the kept bits");
  unsigned long long* kept = reinterpret_cast<unsigned long long*>(selection);
  if (p.splits > 1) {
    close_claims(p, b, kept);
    __syncthreads();
  }
  HISPARSE_MARK(5);

  // M5: the k-th miss takes the k-th victim: tables and the device rows of the misses.
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
    hash_device_row[h] = device_row;
  }
  __syncthreads();
  HISPARSE_MARK(6);

  // M6: outputs of the missed entries; with copiers they are the plan, published by the flag.
  // POSITIONS: several positions of a group miss the same token; the copier that keeps the chunk of a
  // later entry must not copy the row again (a launch of G = 2 positions copied nearly twice the bytes
  // of one position), so such an entry's output carries kDuplicateBase - row, which that copier turns
  // back into the row after reading it (copier, C3). The first entry's owner copies the row.
  // POSITIONS: every entry of a position this launch left out (M2) is -1, its hits' too.
  const int copier_entries = p.splits > 1 ? copier_chunk(K, p.splits) : K;
  for (int i = entry_begin; i < entry_end; ++i) {
    if (POSITIONS && query_position(p, i) >= failed) {
      out[i] = -1;
    } else if (entry_state[i] <= kMissBase) {
      const int h = entry_hash[i];
      const int32_t row = hash_device_row[h];
      const bool duplicate = POSITIONS && p.splits > 1 && first[h] != i && chunk_kept(kept, i / copier_entries);
      out[i] = duplicate ? kDuplicateBase - row : row;
    }
  }
  if (tid == 0 && p.counters != nullptr) atomicAdd(p.counters + 1, static_cast<unsigned long long>(num_miss));

  // The rows the planner copies: a copier copies every missed entry of the chunk it keeps, so the
  // planner copies the misses first seen in a chunk no copier kept (hash indices in `mine`: all of
  // miss_hash with splits == 1, else compacted into victim_slot, free after M5). swap_in: a token also
  // missed in a kept chunk is then written twice, with the same bytes (swap_in_positions: once, M6).
  const int16_t* mine = miss_hash;
  int mine_count = num_miss;
  if (p.splits > 1) {
    bool any_kept = false;
#pragma unroll
    for (int w = 0; w < kClaimWords; ++w) any_kept |= kept[w] != 0;
    __syncthreads();  // the outputs (M6) are written before they are published
    if (tid == 0) {
      if (any_kept) store_release(p.flags + b, kPlanReady);  // cumulative: covers the whole block's outputs
      arrive_done(p, b, true);  // it closed the claims (and published the flag)
    }
    if (any_kept) {
      const int copier_entries = copier_chunk(K, p.splits);
      const int ranks_per_thread = (num_miss + THREADS - 1) / THREADS;
      const int rank_begin = min(num_miss, tid * ranks_per_thread);
      const int rank_end = min(num_miss, rank_begin + ranks_per_thread);
      int count = 0;
      for (int k = rank_begin; k < rank_end; ++k) count += !chunk_kept(kept, first[miss_hash[k]] / copier_entries);
      uint64_t total;
      int position = static_cast<int>(block_exclusive_scan<THREADS>(count, warp_sums, total));
      for (int k = rank_begin; k < rank_end; ++k) {
        if (!chunk_kept(kept, first[miss_hash[k]] / copier_entries)) victim_slot[position++] = miss_hash[k];
      }
      mine = victim_slot;
      mine_count = static_cast<int>(total);
      __syncthreads();
    }
    // Their host rows (M1 loads them only when the planner copies every miss).
    for (int k = tid; k < mine_count; k += THREADS) {
      const int h = mine[k];
      hash_host_row[h] = positions_to_loc[keys[h]];
    }
    __syncthreads();
  }

  // M7: the planner copies its missed rows.
  copy_rows_by<THREADS>(
      mine_count, static_cast<int>(p.row_bytes / kPieceBytes),
      [&](int k, int v) { return load_piece(p.host_kv, missed_host_row(hash_host_row[mine[k]], k), p.row_bytes, v); },
      [&](int k, int v, int4 value) { store_piece(p.device_kv, hash_device_row[mine[k]], p.row_bytes, v, value); });
  HISPARSE_MARK(7);
  HISPARSE_DUMP("plan");
}

// One CTA of either kernel (the file comment): its batch row, its part, its role.
template <int THREADS, bool POSITIONS>
__device__ __forceinline__ void swap_in_cta(const SwapInParams& p) {
  static_assert(THREADS % kWarpSize == 0 && THREADS <= 1024, "block size");
  // Every byte of shared memory is in the host's plan (none is declared statically here).
  extern __shared__ __align__(16) uint8_t smem[];
  uint64_t* warp_sums = smem_region<uint64_t>(smem, p.plan.warp_sums);
  // The planner's victim selection, then the claim words' kept bits; a copier's decision.
  int32_t* selection = smem_region<int32_t>(smem, p.plan.selection);

  const int b = blockIdx.x % p.batch;
  const int part = blockIdx.x / p.batch;
  const int tid = threadIdx.x;
  const int K = p.num_top_k;
  const int D = p.buffer_size;
  HISPARSE_START();
  int32_t* out = p.out + int64_t(b) * p.out_stride;
  const int32_t* top_k = p.top_k_positions + int64_t(b) * p.top_k_stride;

  // Independent loads first: the real-batch size, this row's request and length, and the first
  // batch of this CTA's top-k entries (all of them for the planner, its chunk for a copier).
  const int num_real = *p.num_real_reqs;
  const int64_t req = load_index(p.req_pool_indices, p.req_pool_indices_is_64, b);
  const int64_t seq_len = load_index(p.seq_lens, p.seq_lens_is_64, b);
  const int chunk = part == 0 ? K : copier_chunk(K, p.splits);
  const int entries_begin = part == 0 ? 0 : min(K, (part - 1) * chunk);
  const int entries_end = min(K, entries_begin + chunk);
  int32_t first_batch[kBatch];
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    const int i = entries_begin + tid + u * THREADS;
    first_batch[u] = i < entries_end ? top_k[i] : -1;
  }
  // Padded and resident rows: nothing waits, the workspace is not touched.
  if (b >= num_real) {
    if (part == 0) {
      for (int i = tid; i < K; i += THREADS) out[i] = -1;
    }
    return;
  }
  const int32_t* positions_to_loc = p.req_to_token + req * p.req_to_token_stride;
  const int32_t buffer = p.buffer_of_req[req];

  if (buffer < 0) {  // resident: each CTA of the row translates its share of the entries to device rows
    const int share = resident_share(K, p.splits);
    const int begin = min(K, part * share);
    const int end = min(K, begin + share);
    if constexpr (POSITIONS) {
      if (p.resident_rows_given) {  // the entries are device rows already: passed through
        for (int i = begin + tid; i < end; i += THREADS) out[i] = top_k[i];
        return;
      }
    }
    for (int base = begin + tid; base < end; base += THREADS * kBatch) {
      int32_t t[kBatch];
      int32_t loc[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = base + u * THREADS;
        t[u] = i < end ? top_k[i] : -1;
      }
      if constexpr (POSITIONS) {
        // Entry i of query position j = position_offset + i / position_width is valid up to its causal
        // limit s + j.
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int64_t limit = seq_len + p.position_offset + (base + u * THREADS) / p.position_width;
          loc[u] = (t[u] >= 0 && t[u] <= limit) ? positions_to_loc[t[u]] : -1;
        }
      } else {
#pragma unroll
        for (int u = 0; u < kBatch; ++u) loc[u] = (t[u] >= 0 && t[u] < seq_len) ? positions_to_loc[t[u]] : -1;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (base + u * THREADS < end) out[base + u * THREADS] = loc[u] >= 0 ? p.device_row_of_loc[loc[u]] : -1;
      }
    }
    return;
  }

  const int32_t now = static_cast<int32_t>(seq_len);
  const int32_t newest = now - 1;
  int16_t* token_slot = p.token_slot + int64_t(buffer) * p.token_slot_stride;

  if (part != 0) {
    const bool released = copier<THREADS, POSITIONS>(p, b, part - 1, entries_begin, entries_end, chunk, top_k,
                                                     first_batch, positions_to_loc, token_slot, newest, smem,
                                                     warp_sums, selection);
    if (tid == 0) arrive_done(p, b, released);
    return;
  }

  planner<THREADS, POSITIONS>(p, b, K, D, out, top_k, first_batch, positions_to_loc, buffer, now, newest, token_slot,
                              smem, warp_sums, selection);
}

template <int THREADS>
__global__ void __launch_bounds__(THREADS) swap_in_kernel(const SwapInParams p) {
  swap_in_cta<THREADS, false>(p);
}

// num_top_k = G x K entries per batch row (a request's group of G positions from position_offset on),
// position_width = K; the binding launches it once per group.
template <int THREADS>
__global__ void __launch_bounds__(THREADS) swap_in_positions_kernel(const SwapInParams p) {
  swap_in_cta<THREADS, true>(p);
}

}  // namespace hisparse
