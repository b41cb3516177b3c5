// Named constants of the swap-in kernel (swap_in.cuh) and of its launch (swap_in_binding.cu), and the
// buffer layout of a verify step that the multi-position swap-in shares with decode_rows.cuh. Values
// that Python also knows are marked with the name it uses there; tests/test_swap_in_plan.py checks
// that the two agree. The constants of the other ops live with them: the warp size and the row-copy
// pieces in primitives.cuh, copy_rows' launch in copy_rows.cuh, the decode-row launch in
// decode_rows.cuh.
#pragma once

#include <cstdint>

namespace hisparse {

constexpr int kBitmapWordShift = 5;  // slot_hit bitmap: one uint32 per 32 slots
constexpr int kBitmapWordBits = 1 << kBitmapWordShift;

// Independent global loads a thread issues before it needs the first (lookups and translations).
constexpr int kBatch = 4;

// Hash set of the missed tokens (planner): open addressing over 1 << hash_bits int32 keys.
constexpr int32_t kEmptyKey = -1;
constexpr int32_t kNoFirst = 0x7fffffff;  // no entry yet: atomicMin takes the first
constexpr int kMaxHashBits = 15;          // hash indices are int16 (ops/swap_in_plan.MAX_TOP_K = 1 << (15 - 2))
constexpr int kMaxBufferSize = 32767;     // slot ids are int16 (ops/swap_in_plan.MAX_DEVICE_BUFFER_SIZE)

// Speculative decoding (docs/speculative.md 2.2): verify position j of an offloaded request lives in
// buffer slot D + kVerifySlotBase + j; slot D keeps the newest accepted token (ops/reference.VERIFY_SLOT_BASE).
constexpr int kVerifySlotBase = 1;
// verify_limit of a batch row whose every verify position is served (ops/reference.NO_VERIFY_LIMIT).
constexpr int32_t kNoVerifyLimit = 0x7fffffff;

// LRU ages: now - stamp, capped, chosen by two histogram passes (the high bits, then the low bits
// inside the bucket of the youngest victim).
constexpr int kAgeCap = 32767;  // ops/reference.AGE_CAP
constexpr int kFineBits = 7;
constexpr int kFineBuckets = 1 << kFineBits;                  // age & (kFineBuckets - 1)
constexpr int kCoarseBuckets = (kAgeCap + 1) >> kFineBits;  // age >> kFineBits
// ops/swap_in_plan.COARSE_BUCKETS and FINE_BUCKETS size the two histograms of the shared-memory plan.

// entry_state of a top-k entry: >= 0 the slot it hit; kDone: padding; kNewest: the newest token;
// <= kMissBase: a miss, kMissBase - state is its token.
constexpr int32_t kDone = -1;
constexpr int32_t kNewest = -2;
constexpr int32_t kMissBase = -3;

// swap_in_positions only: the planner's output for a repeated miss a copier will read (swap_in.cuh,
// M6 and the copier's C3) is kDuplicateBase - row, below every real output (rows >= 0, padding -1);
// the copier restores the row. No output leaves the kernel encoded.
constexpr int32_t kDuplicateBase = -2;

// A copier CTA's area (from plan.role): its miss list, kCopierListInts int32 per entry of its chunk
// (entry, host row, device row), then staged rows from the next kPieceBytes boundary to the end of
// the plan (ops/swap_in_plan.COPIER_LIST_INTS: the plan reserves the list of a whole top-k).
constexpr int kCopierListInts = 3;

// flags[b]: 0 before the plan, kPlanReady when the missed entries' outputs are published.
constexpr int32_t kPlanReady = 1;

// The swap-in workspace, kSyncCountersPerRow int32 per batch row, in arrays of `capacity` rows, all
// zero between launches (ops/swap_in_plan.SYNC_COUNTERS_PER_ROW sizes it): the plan flag
// (flags[b]), the row's counter word (row_counts[b]) and its kClaimWords claim words (claims[b],
// uint64, after the int32 arrays).
constexpr int kClaimWords = 2;
constexpr int kSyncCountersPerRow = 2 + 2 * kClaimWords;

// Claims (swap_in.cuh, "Forward progress"): copier c (block part c + 1) sets bit c % kCopiersPerClaimWord
// of claim word c / kCopiersPerClaimWord when it starts, and may clear it again (give its chunk back)
// while its planner has not started; the planner closes a word by setting kClaimsClosed: the bits it
// gets back are the copiers it waits for, the chunks of the others are its to copy.
constexpr int kCopiersPerClaimWord = 63;
constexpr unsigned long long kClaimsClosed = 1ull << kCopiersPerClaimWord;
constexpr int kMaxSplits = 1 + kClaimWords * kCopiersPerClaimWord;  // CTAs per batch row the binding accepts

// The counter word: looked [0, 10) (copiers done with their lookups), finished [10, 20) (CTAs of the
// row done: the last resets the row's workspace) and kPlannerStarted (the planner announces itself when
// it starts; a copier waits for the plan only once it has seen this bit or lost its give-back).
constexpr int kCounterBits = 10;
constexpr int32_t kCounterMask = (1 << kCounterBits) - 1;
constexpr int32_t kLooked = 1;                       // one copier's lookups
constexpr int32_t kFinished = 1 << kCounterBits;     // one CTA done
constexpr int kFinishedShift = kCounterBits;
constexpr int32_t kPlannerStarted = 1 << 30;
static_assert(kMaxSplits <= kCounterMask && 2 * kCounterBits < 30, "counter word fields");

// Waits: a CTA polls its flag or counter every kSpinSleepNs; the test hooks of variant builds
// (HISPARSE_TEST_LATE_COPIERS_NS, HISPARSE_TEST_LATE_ARRIVALS_NS, HISPARSE_TEST_LATE_PLANNER_NS) sleep
// in steps of kTestSleepNs.
constexpr unsigned kSpinSleepNs = 32;
constexpr unsigned kTestSleepNs = 256;

}  // namespace hisparse
