"""The swap-in kernel finishes whatever else runs on the GPU (GPU only; issue #27, item 1).

A request's CTAs wait only for CTAs that have started: a copier waits for the plan only once its
planner has announced that it started (or closed the claims), and the planner waits only for the
copiers whose claims it found (docs/kernels.md, "Forward progress"), so the kernel does not need its
grid on the GPU at once:

* late arrivals: a variant build (jit.load_module(defines=...)) whose copiers of block index >= 2 x batch
  claim their chunks 30 us late, after the planner closed the claims, so the planner copies the chunks
  nobody kept; results bit for bit as the reference's, the launch workspace back to zero, also over
  CUDA-graph replays;
* a late planner: a variant whose planner announces itself 30 us late, so its copiers give their
  chunks back and leave, and the planner copies every miss;
* a grid larger than the GPU holds at once (batch x splits beyond the resident CTAs), run in a child
  process with a time limit (a kernel whose CTAs waited for CTAs that cannot start would never end);
* a "hog" kernel (CuPy) on another stream holding every multiprocessor but two, one CTA per SM with
  all of its shared memory. Case A: the hog holds them for a fixed 2 s; the swap-in must finish long
  before, while every hog CTA still holds its SM. Case B: the hog holds them until the swap-in has
  finished (a kernel after it on the swap-in's stream releases it); a swap-in that needed its whole
  grid resident would deadlock, which the hog's own 10 s limit ends and the test reports.

Each hog test checks that the hog really held its SMs (how many of its CTAs ran at once, on how many
distinct SMs) and that the swap-in had misses to copy.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

from hisparse_sglang.ops import reference
from hisparse_sglang.testing.cases import make_case

pytestmark = pytest.mark.gpu

# Test hooks of variant builds: the copiers of block index >= 2 x batch sleep 30 us before they claim;
# the planner sleeps 30 us before it announces itself. benchmarks/gpu_progress_check.sh builds both
# ahead of the tests.
LATE_ARRIVALS = ("HISPARSE_TEST_LATE_ARRIVALS_NS=30000",)
LATE_PLANNER = ("HISPARSE_TEST_LATE_PLANNER_NS=30000",)
TOP_K, BUFFER, ROW_BYTES = 2048, 4096, 1152
FREE_SMS = 2  # multiprocessors the hog leaves to the swap-in
HOLD_S = 2.0  # case A: how long the hog holds its SMs
FINISHED_WITHIN_S = 0.5  # case A: the swap-in's bound while the hog holds them
SAFETY_S = 10.0  # case B: the hog lets go after this long even if nobody releases it
CHILD_TIMEOUT_S = 240.0


def cuda_ops(module=None):
    from hisparse_sglang.ops.swap_in import CudaOps

    return CudaOps(module=module)


def variant(defines):
    from hisparse_sglang.ops.jit import load_module

    return load_module(defines)


def assert_same(name, expected, actual):
    expected = expected.cpu()
    actual = actual.cpu()
    if not torch.equal(expected, actual):
        diff = torch.nonzero(expected != actual)
        first = tuple(diff[0].tolist())
        raise AssertionError(
            f"{name}: {diff.shape[0]} elements differ; first at {first}: expected {expected[first].item()}, "
            f"got {actual[first].item()}"
        )


def assert_workspace_clear(ops):
    """The launch workspace (per row: the plan flag, the word of lookups, CTAs done and the planner's
    announcement, the claim words) is back to 0 after a launch."""
    from hisparse_sglang.ops.swap_in_plan import SYNC_COUNTERS_PER_ROW

    workspace = ops._sync.cpu()
    if bool(workspace.any()):
        rows = workspace.numel() // SYNC_COUNTERS_PER_ROW
        raise AssertionError(f"launch workspace not reset: [flags | row counts] x {rows} rows = "
                             f"{workspace.reshape(SYNC_COUNTERS_PER_ROW, rows).tolist()}")


class Launch:
    """One swap-in call's GPU state (pinned host rows, sentinel outputs) and its reference result."""

    def __init__(self, case):
        expected = case.clone()
        self.expected_counters = torch.zeros(2, dtype=torch.int64)
        self.expected_out = reference.swap_in(*expected.args(), counters=self.expected_counters)
        self.expected = expected
        self.host_kv = case.host_kv
        self.gpu = case.clone(device="cuda", pin_host=True)
        self.out = torch.full(tuple(case.top_k.shape), 777, dtype=torch.int32, device="cuda")
        self.counters = torch.zeros(2, dtype=torch.int64, device="cuda")

    def run(self, ops, splits):
        ops.swap_in(*self.gpu.args(), out=self.out, counters=self.counters, splits=splits)

    def check(self) -> int:
        """Bit for bit against the reference; returns the distinct misses copied."""
        assert_same("out", self.expected_out, self.out)
        assert_same("slot_tokens", self.expected.slot_tokens, self.gpu.slot_tokens)
        assert_same("slot_stamps", self.expected.slot_stamps, self.gpu.slot_stamps)
        assert_same("token_slot", self.expected.token_slot, self.gpu.token_slot)
        assert_same("device_kv", self.expected.device_kv, self.gpu.device_kv)
        assert_same("counters", self.expected_counters, self.counters)
        assert torch.equal(self.gpu.host_kv, self.host_kv), "the kernel wrote host memory"
        return int(self.expected_counters[1])


# ---------------------------------------------------------------------------------------- late arrivals
@pytest.mark.parametrize("late", ["copiers", "planner"])
@pytest.mark.parametrize("miss_rate", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("splits", [3, 5, 17, 65])
def test_planner_copies_the_chunks_no_copier_kept(splits, miss_rate, late):
    """Late copiers: the planner and copier 0 start on time; the other copiers claim after the planner
    closed the claims (with misses) and leave, or find no miss (hit-only rows). Late planner: every
    copier looks its entries up before the planner announces itself, gives its chunk back and leaves.
    One resident row and one padded row are launched alongside."""
    case = make_case(5, TOP_K, BUFFER, ROW_BYTES, miss_rate=miss_rate, duplicate_fraction=0.05, newest_fraction=0.01,
                     resident_fraction=0.25, num_real=4, seed=200 + splits + int(miss_rate * 10))
    ops = cuda_ops(variant(LATE_ARRIVALS if late == "copiers" else LATE_PLANNER))
    launch = Launch(case)
    launch.run(ops, splits)
    torch.cuda.synchronize()
    misses = launch.check()
    assert (misses > 0) == (miss_rate > 0)
    assert_workspace_clear(ops)


def test_graph_replays_after_closed_claims():
    """Capture once, replay over steps whose inputs change in place: every replay closes the claims of
    rows with misses, and the last CTA of each row must reset the claim words and the counter word, or
    the next replay would find its claims closed (or the planner waiting for copiers that never come)."""
    ops = cuda_ops(variant(LATE_ARRIVALS))
    base = make_case(4, 1024, 2048, 656, miss_rate=0.3, seed=210)
    gpu = base.clone(device="cuda", pin_host=True)
    ref = base.clone()
    out = torch.empty(tuple(base.top_k.shape), dtype=torch.int32, device="cuda")
    ops.reserve(4, 1024)
    ops.swap_in(*gpu.clone(device="cuda", pin_host=True).args(), out=out.clone(), splits=9)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.swap_in(*gpu.args(), out=out, splits=9)
    top_k = base.top_k.clone()
    for step in range(6):
        generator = torch.Generator().manual_seed(step)
        seq_len = int(base.seq_lens[0]) + step
        fresh = torch.randint(0, seq_len - 1, tuple(top_k.shape), generator=generator, dtype=torch.int32)
        keep = torch.rand(tuple(top_k.shape), generator=generator) < 0.8
        top_k = torch.where(keep & (top_k >= 0), top_k, fresh)
        for state in (ref, gpu):
            state.top_k.copy_(top_k)
            state.seq_lens.fill_(seq_len)
        expected = reference.swap_in(*ref.args())
        graph.replay()
        torch.cuda.synchronize()
        assert_same(f"out step {step}", expected, out)
        assert_same(f"slot_stamps step {step}", ref.slot_stamps, gpu.slot_stamps)
        assert_same(f"token_slot step {step}", ref.token_slot, gpu.token_slot)
        assert_same(f"device_kv step {step}", ref.device_kv, gpu.device_kv)
        assert_workspace_clear(ops)


# ------------------------------------------------------------------------------ grid beyond residency
CHILD = r"""
import json, sys
import torch
from hisparse_sglang.ops import reference
from hisparse_sglang.ops.swap_in import CudaOps
from hisparse_sglang.testing.cases import make_case

ops = CudaOps()
for batch, splits in json.loads(sys.argv[1]):
    case = make_case(batch, 2048, 4096, 64, miss_rate=0.2, duplicate_fraction=0.02, seed=batch + splits)
    expected = case.clone()
    counters = torch.zeros(2, dtype=torch.int64)
    out = reference.swap_in(*expected.args(), counters=counters)
    gpu = case.clone(device="cuda", pin_host=True)
    gpu_counters = torch.zeros(2, dtype=torch.int64, device="cuda")
    gpu_out = ops.swap_in(*gpu.args(), counters=gpu_counters, splits=splits, threads=1024)
    torch.cuda.synchronize()
    for name, want, got in (("out", out, gpu_out), ("slot_tokens", expected.slot_tokens, gpu.slot_tokens),
                            ("slot_stamps", expected.slot_stamps, gpu.slot_stamps),
                            ("token_slot", expected.token_slot, gpu.token_slot),
                            ("device_kv", expected.device_kv, gpu.device_kv), ("counters", counters, gpu_counters),
                            ("launch workspace", torch.zeros_like(ops._sync.cpu()), ops._sync)):
        if not torch.equal(want, got.cpu()):
            print(f"MISMATCH batch {batch} splits {splits}: {name}", flush=True)
            sys.exit(1)
    print(f"MATCH batch {batch} splits {splits} misses {int(counters[1])}", flush=True)
"""


def test_a_grid_the_gpu_cannot_hold_at_once_finishes_and_matches_the_reference():
    """batch x splits CTAs beyond what the GPU runs at once: the CTAs of the first wave must finish
    without the ones that cannot start yet (the first wave of (resident, 2) is every row's first CTA,
    each then plans and copies alone). In a child process: a kernel that waited forever is killed with
    it when the time limit passes."""
    import hisparse_sglang

    resident = cuda_ops().resident_ctas(TOP_K, BUFFER, 1024)
    configs = [(resident, 2), (resident // 32 + 1, 33)]
    for batch, splits in configs:
        assert batch * splits > resident
    environment = dict(os.environ)
    package_root = str(pathlib.Path(hisparse_sglang.__file__).resolve().parents[1])
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, environment.get("PYTHONPATH")]))
    try:
        result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(configs)], capture_output=True, text=True,
                                env=environment, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"swap-in of {configs} (batch, splits) with {resident} resident CTAs did not finish in "
            f"{CHILD_TIMEOUT_S:.0f} s: its CTAs waited for CTAs that could not start. Output: {exc.stdout!r}"
        ) from None
    assert result.returncode == 0, f"child failed ({result.returncode}):\n{result.stdout}\n{result.stderr[-3000:]}"
    lines = [line for line in result.stdout.splitlines() if line.startswith("MATCH")]
    assert len(lines) == len(configs), result.stdout
    assert all(int(line.rsplit(" ", 1)[1]) > 0 for line in lines), result.stdout


# ------------------------------------------------------------------------------------------------ hog
HOG_SOURCE = r"""
#define RUNNING 0
#define MOST_RUNNING 1
#define RELEASED 2
#define TIMED_OUT 3
#define FIRST_EXIT 0

__device__ __forceinline__ unsigned long long hog_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One CTA per multiprocessor (each asks for all the shared memory a block may have, so nothing else
// that uses shared memory fits beside it): records its SM, counts itself in, and holds the SM until
// `release` is set (when stop_on_release) or hold_ns have passed, whichever comes first.
extern "C" __global__ void hog(const volatile int* release, int* counts, unsigned long long* times, int* smids,
                               volatile int* all_running, long long hold_ns, int stop_on_release) {
  extern __shared__ int held[];
  if (threadIdx.x != 0) return;
  held[0] = blockIdx.x;
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  smids[blockIdx.x] = (int)smid;
  const unsigned long long start = hog_now();
  const int running = atomicAdd(&counts[RUNNING], 1) + 1;
  atomicMax(&counts[MOST_RUNNING], running);
  if (running == (int)gridDim.x) {  // the host waits for this before it launches the swap-in
    *all_running = 1;
    __threadfence_system();
  }
  int reason = TIMED_OUT;
  while ((long long)(hog_now() - start) < hold_ns) {
    if (stop_on_release && *release != 0) {
      reason = RELEASED;
      break;
    }
    __nanosleep(1000);
  }
  atomicMin(&times[FIRST_EXIT], hog_now());
  atomicSub(&counts[RUNNING], 1);
  atomicAdd(&counts[reason], 1);
}

// Stamps the global timer when the work before it on its stream is done; releases the hog if asked.
extern "C" __global__ void mark(unsigned long long* stamp, volatile int* release, int set_release) {
  *stamp = hog_now();
  if (set_release) {
    __threadfence();
    *release = 1;
  }
}
"""
RUNNING, MOST_RUNNING, RELEASED, TIMED_OUT = range(4)
FIRST_EXIT, SWAP_IN_DONE = range(2)


class Hog:
    """The hog kernel (all SMs but FREE_SMS, one CTA each) and its state on the GPU."""

    def __init__(self, cupy):
        import numpy

        self.cupy, self.numpy = cupy, numpy
        device = torch.cuda.current_device()
        cupy.cuda.Device(device).use()
        properties = torch.cuda.get_device_properties(device)
        self.ctas = properties.multi_processor_count - FREE_SMS
        self.shared = properties.shared_memory_per_block_optin
        module = cupy.RawModule(code=HOG_SOURCE)
        self.hog = module.get_function("hog")
        self.hog.max_dynamic_shared_size_bytes = self.shared
        self.mark_kernel = module.get_function("mark")
        self.release = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.counts = torch.zeros(4, dtype=torch.int32, device="cuda")
        self.times = torch.full((2,), 2**63 - 1, dtype=torch.int64, device="cuda")
        self.smids = torch.full((self.ctas,), -1, dtype=torch.int32, device="cuda")
        self.all_running = torch.zeros(1, dtype=torch.int32).pin_memory()  # written by the GPU, polled here
        self.stream = None
        self.mark(torch.cuda.current_stream(), release=False)  # loads the kernel before any hog runs
        torch.cuda.synchronize()
        self.times.fill_(2**63 - 1)
        torch.cuda.synchronize()

    def _pointer(self, tensor, offset=0):
        return self.numpy.uint64(tensor.data_ptr() + offset)

    def start(self, stream, hold_s: float, stop_on_release: bool) -> None:
        """Launch on ``stream`` and wait until every hog CTA runs (at most 10 s)."""
        self.stream = stream
        arguments = (self._pointer(self.release), self._pointer(self.counts), self._pointer(self.times),
                     self._pointer(self.smids), self._pointer(self.all_running), self.numpy.int64(int(hold_s * 1e9)),
                     self.numpy.int32(1 if stop_on_release else 0))
        with self.cupy.cuda.ExternalStream(stream.cuda_stream):
            self.hog((self.ctas,), (32,), arguments, shared_mem=self.shared)
        deadline = time.monotonic() + 10.0
        while int(self.all_running[0]) == 0:
            if time.monotonic() > deadline:
                self.finish()
                raise AssertionError(f"the hog's {self.ctas} CTAs (one per SM) never all ran at once: "
                                     f"at most {int(self.counts.cpu()[MOST_RUNNING])}; is the GPU shared?")
            time.sleep(0.0002)

    def mark(self, stream, release: bool) -> None:
        """On ``stream``: stamp the global timer into times[SWAP_IN_DONE], then release the hog if asked."""
        with self.cupy.cuda.ExternalStream(stream.cuda_stream):
            self.mark_kernel((1,), (1,), (self._pointer(self.times, 8 * SWAP_IN_DONE), self._pointer(self.release),
                                          self.numpy.int32(1 if release else 0)))

    def finish(self) -> dict:
        """Wait for the hog (its own time limit bounds this); its counts and times."""
        if self.stream is not None:
            self.stream.synchronize()
        counts, times, smids = self.counts.cpu(), self.times.cpu(), self.smids.cpu()
        return {
            "most_running": int(counts[MOST_RUNNING]), "released": int(counts[RELEASED]),
            "timed_out": int(counts[TIMED_OUT]), "sms": len(set(smids.tolist()) - {-1}),
            "first_exit_ns": int(times[FIRST_EXIT]), "swap_in_done_ns": int(times[SWAP_IN_DONE]),
        }


@pytest.fixture
def hog():
    cupy = pytest.importorskip("cupy", reason="the hog kernel is built with CuPy (pip install cupy-cuda13x)")
    hog = Hog(cupy)
    yield hog
    # A failed test may leave the hog running: release it and wait (its time limit bounds the wait).
    if hog.stream is not None:
        side = torch.cuda.Stream()
        hog.mark(side, release=True)
        side.synchronize()
        hog.stream.synchronize()


def prepared(batch, splits, seed):
    """A launch with ~50 % misses and its ops, warmed up (kernel loaded, shared-memory limit set,
    workspace sized) so nothing in the timed launch initialises anything."""
    case = make_case(batch, TOP_K, BUFFER, ROW_BYTES, miss_rate=0.5, duplicate_fraction=0.02, seed=seed)
    ops = cuda_ops()
    ops.reserve(batch, TOP_K, BUFFER)
    warm = case.clone(device="cuda", pin_host=True)
    ops.swap_in(*warm.args(), splits=splits)
    launch = Launch(case)
    torch.cuda.synchronize()
    return ops, launch


def wait_for(event, limit_s: float, what: str) -> float:
    """Seconds until ``event`` completes, polled from the host; fails after ``limit_s``."""
    started = time.monotonic()
    while not event.query():
        if time.monotonic() - started > limit_s:
            raise AssertionError(f"{what} did not finish within {limit_s:.0f} s")
        time.sleep(0.0002)
    return time.monotonic() - started


def assert_hog_held_its_sms(hog, state):
    assert state["most_running"] == hog.ctas and state["sms"] == hog.ctas, (
        f"the hog should hold {hog.ctas} SMs at once; {state}")


@pytest.mark.parametrize("splits", [None, 65])
def test_swap_in_finishes_while_another_kernel_holds_all_but_two_sms(hog, splits):
    """Case A: the hog holds its SMs for a fixed 2 s; the swap-in (bs 1, 65 CTAs by default) must be done
    within 0.5 s, before any hog CTA let go. A kernel whose planner waited for all 64 copiers would
    run 2 of them and finish only after the hog (1.95 s measured on an H100)."""
    ops, launch = prepared(1, splits, seed=300)
    hog_stream, swap_stream = torch.cuda.Stream(), torch.cuda.Stream()
    hog.start(hog_stream, hold_s=HOLD_S, stop_on_release=False)
    with torch.cuda.stream(swap_stream):
        launch.run(ops, splits)
        hog.mark(swap_stream, release=False)
        done = torch.cuda.Event()
        done.record(swap_stream)
    elapsed = wait_for(done, HOLD_S + SAFETY_S, "the swap-in")
    state = hog.finish()
    assert_hog_held_its_sms(hog, state)
    assert state["timed_out"] == hog.ctas
    grid = ops.choose_splits(1, TOP_K, BUFFER, 1024) if splits is None else splits
    assert elapsed < FINISHED_WITHIN_S, f"swap-in of {grid} CTAs took {elapsed:.3f} s beside the hog"
    assert state["swap_in_done_ns"] < state["first_exit_ns"], f"the swap-in ended after a hog CTA let go: {state}"
    assert launch.check() > 0
    assert_workspace_clear(ops)


@pytest.mark.parametrize("batch,splits", [(1, None), (1, 65), (4, 17)])
def test_a_kernel_waiting_for_the_swap_in_is_not_deadlocked(hog, batch, splits):
    """Case B: the hog holds its SMs until the swap-in has finished (a kernel after it on the swap-in's
    stream releases it). Every hog CTA must leave by that release, none by its 10 s limit."""
    ops, launch = prepared(batch, splits, seed=310 + batch)
    hog_stream, swap_stream = torch.cuda.Stream(), torch.cuda.Stream()
    hog.start(hog_stream, hold_s=SAFETY_S, stop_on_release=True)
    hog_done = torch.cuda.Event()
    hog_done.record(hog_stream)
    with torch.cuda.stream(swap_stream):
        launch.run(ops, splits)
        hog.mark(swap_stream, release=True)
    elapsed = wait_for(hog_done, SAFETY_S + 10.0, "the hog")
    state = hog.finish()
    assert_hog_held_its_sms(hog, state)
    assert (state["released"], state["timed_out"]) == (hog.ctas, 0), (
        f"the hog was not released by the swap-in's end (deadlock until its {SAFETY_S:.0f} s limit): {state}, "
        f"{elapsed:.2f} s")
    assert elapsed < SAFETY_S / 2
    assert launch.check() > 0
    assert_workspace_clear(ops)
