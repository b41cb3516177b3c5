// Named constants of the swap-in and row-copy kernels (swap_in.cuh, decode_rows.cuh) and of their
// launches (swap_in_binding.cu). Values that Python also knows are marked with the name it uses
// there; tests/test_swap_in_limits.py checks that the two agree.
#pragma once

#include <cstdint>

namespace hisparse {

constexpr int kWarpSize = 32;
constexpr int kBitmapWordShift = 5;  // slot_hit bitmap: one uint32 per 32 slots
constexpr int kBitmapWordBits = 1 << kBitmapWordShift;

// Independent global loads a thread issues before it needs the first (lookups and translations).
constexpr int kBatch = 4;

// Hash set of the missed tokens (planner): open addressing over 1 << hash_bits int32 keys.
constexpr int32_t kEmptyKey = -1;
constexpr int32_t kNoFirst = 0x7fffffff;  // no entry yet: atomicMin takes the first
constexpr int kMaxHashBits = 15;          // hash indices are int16 (ops/swap_in_limits.MAX_TOP_K = 1 << (15 - 2))
constexpr int kMaxBufferSize = 32767;     // slot ids are int16 (ops/swap_in_limits.MAX_DEVICE_BUFFER_SIZE)

// LRU ages: now - stamp, capped, chosen by two histogram passes (the high bits, then the low bits
// inside the bucket of the youngest victim).
constexpr int kAgeCap = 32767;  // ops/reference.AGE_CAP
constexpr int kFineBits = 7;
constexpr int kFineBuckets = 1 << kFineBits;                  // age & (kFineBuckets - 1)
constexpr int kCoarseBuckets = (kAgeCap + 1) >> kFineBits;  // age >> kFineBits
// ops/swap_in_limits.COARSE_BUCKETS and FINE_BUCKETS size the two histograms of the shared-memory plan.

// entry_state of a top-k entry: >= 0 the slot it hit; kDone: padding; kNewest: the newest token;
// <= kMissBase: a miss, kMissBase - state is its token.
constexpr int32_t kDone = -1;
constexpr int32_t kNewest = -2;
constexpr int32_t kMissBase = -3;

// A copier CTA's area (from plan.role): its miss list, kCopierListInts int32 per entry of its chunk
// (entry, host row, device row), then staged rows from the next kPieceBytes boundary to the end of
// the plan (ops/swap_in_limits.COPIER_LIST_INTS: the plan reserves the list of a whole top-k).
constexpr int kCopierListInts = 3;

// flags[b]: 0 before the plan, kPlanReady when the missed entries' outputs are published.
constexpr int32_t kPlanReady = 1;

// Waits: a CTA polls its flag or counter every kSpinSleepNs; the late-copier test hook sleeps in
// steps of kLateCopierSleepNs.
constexpr unsigned kSpinSleepNs = 32;
constexpr unsigned kLateCopierSleepNs = 256;

// Row copies: 16-byte pieces, kCopyUnroll independent loads in flight per thread.
constexpr int kPieceBytes = 16;
constexpr int kCopyUnroll = 4;

// copy_rows launch: kCopyRowsThreads per block, at most kCopyRowsBlocksPerSM blocks per
// multiprocessor unless the caller caps the grid.
constexpr int kCopyRowsThreads = 512;
constexpr int kCopyRowsBlocksPerSM = 4;

// backup_newest launch: one warp per batch row.
constexpr int kDecodeRowThreads = 128;
constexpr int kBackupNewestRowsPerBlock = kDecodeRowThreads / kWarpSize;

}  // namespace hisparse
