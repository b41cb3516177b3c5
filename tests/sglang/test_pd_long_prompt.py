"""PD decode requests longer than the GPU KV pool, through SGLang 0.5.17's real decode-side code.

SGLang issue #30401: with HiSparse a decode instance keeps a request's KV in the logical (host)
pool and gives it a device buffer, but SGLang 0.5.17 sizes its request-length checks by the device
pool. hisparse-sglang's hooks make them use the logical pool on a decode instance. Here the device
pool is 8 pages (512 tokens), host_to_device_ratio 8 (4096 logical tokens), device_buffer_size 256
(one buffer of 5 pages fits the device pool), and SGLang's default --num-reserved-decode-tokens 512:
the decode-side capacity is 4096 - 512 = 3584 tokens.

Everything runs in one spawned child (the hooks patch SGLang globally), like a scheduler process:
published ServerArgs (decode mode, FAKE transfer backend), gloo parallel state, the plugin loaded by
``load_plugins()``, our pool / allocator / coordinator, SGLang's ``TpModelWorker.get_worker_info``,
``Scheduler.init_req_max_new_tokens``, the scheduler's ``validate_input_length``,
``DecodePreallocQueue`` / ``DecodeTransferQueue``, ``ScheduleBatch.check_decode_mem`` /
``retract_decode`` and the retraction's ``release_req`` / ``load_kv_cache`` (``pd_decode_harness.py``
holds the decode side and says how it stands in for the scheduler and the prefill). Every decode
step checks every swapped-in row (``Stack.decode``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import traceback
import types
from array import array

import drive
import pytest
from pd_decode_harness import (
    BUFFER_SIZE,
    CAPACITY,
    CONTEXT_LEN,
    DEVICE_TOKENS,
    LOG,
    LONG,
    PAGE,
    RATIO,
    RESERVED,
    SHORTER,
    DecodeQueues,
    init_single_rank_scheduler,
    rejection_message,
)
from pd_peer import NO_LEAKS

pytestmark = pytest.mark.sglang

CHILD_DEADLINE_S = 300


# ------------------------------------------------------------------------------------------ child side
def _admit(decode: DecodeQueues, req) -> None:
    """A new request through the prealloc and transfer queues into the running batch."""
    decode.prealloc_queue.add(req)
    assert [r.rid for r in decode.preallocate()] == [req.rid], decode.streamer.aborted
    assert [r.rid for r in decode.receive()] == [req.rid]
    decode.run_waiting()


def _long_prompt(server_args) -> dict:
    """A 1500-token prompt (device pool 512): limits, admission, 45 decode steps, retraction round
    trip, then a prompt longer than the decode-side capacity."""
    LOG.take("")
    decode = DecodeQueues(server_args)
    report = {"worker_info": [decode.worker_info[i] for i in (0, 4, 5)]}
    report["startup_log"] = LOG.take("HiSparse PD decode")
    req = decode.new_req("long", LONG, max_new_tokens=200)
    report["max_new_tokens"] = req.sampling_params.max_new_tokens
    report["validation_error"] = req.validation_error
    decode.prealloc_queue.add(req)
    report["prealloc_max_total_num_tokens"] = decode.prealloc_queue.max_total_num_tokens
    report["queued"] = [d.req.rid for d in decode.prealloc_queue.queue]
    assert [r.rid for r in decode.preallocate()] == ["long"], decode.streamer.aborted
    assert [r.rid for r in decode.receive()] == ["long"]
    decode.run_waiting()
    report["mode_at_admission"] = decode.mode(req)
    report["device_pages_at_admission"] = decode.allocator.rows.device_rows.used_pages

    report["decode_mem_checks"] = [decode.decode_step() for _ in range(45)]
    report["kv_len_after_decode"] = decode.stack.lens["long"]

    # retraction round trip: SGLang's release_req (KV copied out), the prealloc queue's retracted
    # path (its capacity check), then resume (preallocate, load_kv_cache, admission by our hook)
    drive.release_req(
        req=req, remaing_req_count=0, server_args=server_args, req_to_token_pool=decode.req_to_token_pool,
        token_to_kv_pool_allocator=decode.allocator, tree_cache=decode.tree_cache,
        hisparse_coordinator=decode.coordinator,
    )
    decode.running.remove(req)
    report["leaks_while_retracted"] = decode.leaks()
    decode.prealloc_queue.add(req, is_retracted=True)
    report["retracted_queue"] = [r.rid for r in decode.prealloc_queue.retracted_queue]
    report["resumed"] = [r.rid for r in decode.resume()]
    decode.run_waiting()
    report["mode_after_resume"] = decode.mode(req)
    report["decode_mem_checks_after_resume"] = [decode.decode_step() for _ in range(5)]
    decode.finish(req)
    report["aborted"] = dict(decode.streamer.aborted)

    # longer than the decode-side capacity: rejected by SGLang's checks, with the reason
    too_long = decode.new_req("too_long", CAPACITY + PAGE)
    report["too_long_validation_error"] = too_long.validation_error
    decode.prealloc_queue.add(too_long)
    report["too_long_aborted"] = decode.streamer.aborted.get("too_long")
    report["leaks"] = decode.leaks()
    report["scheduler_max_total_num_tokens"] = decode.scheduler.max_total_num_tokens
    return report


def _retract_under_device_pressure(server_args, hooked: bool, long_len: int) -> dict:
    """A short resident request S runs; a long one L (offloaded, its buffer and S fill the device
    pool) joins. When S needs a new page, SGLang retracts L. Resuming L needs a buffer (5 pages) while
    S holds 4 of the 8: hooked, L waits in the retracted queue until S finishes; SGLang's own resume
    (``hooked=False``) admits it anyway."""
    decode = DecodeQueues(server_args)
    short, long = decode.new_req("S", 150), decode.new_req("L", long_len)
    _admit(decode, short)
    for _ in range(3):
        assert decode.decode_step()
    _admit(decode, long)
    report = {"modes": {"S": decode.mode(short), "L": decode.mode(long)}}
    report["free_pages_full"] = decode.allocator.rows.device_rows.free_pages
    steps = 0
    while decode.decode_step():
        steps += 1
    report["steps_until_short"] = steps
    batch = decode.batch()
    retracted, _, to_abort = drive.call(batch.retract_decode, optional=dict(server_args=server_args))
    report["retracted"] = [r.rid for r in retracted]
    report["aborted_by_retraction"] = [r.rid for r in to_abort]
    for req in retracted:
        decode.running.remove(req)
        decode.prealloc_queue.add(req, is_retracted=True)  # Scheduler._add_request_to_queue, decode mode
    assert decode.decode_step()  # S starts its new page
    report["free_pages_after_short_grew"] = decode.allocator.rows.device_rows.free_pages
    if not hooked:
        queue = decode.prealloc_queue
        try:
            type(queue).resume_retracted_reqs.__wrapped__(queue)
        except Exception as exc:  # noqa: BLE001 - the report names it
            report["unhooked_resume"] = f"{type(exc).__name__}: {exc}"
        return report

    report["steps_waited"] = _steps_waiting(decode, short, decode.resume, "resumed")
    decode.finish(short)
    report["resumed"] = [r.rid for r in decode.resume()]
    decode.run_waiting()
    report["mode_after_resume"] = decode.mode(long)
    report["decode_mem_checks_after_resume"] = [decode.decode_step() for _ in range(40)]
    decode.finish(long)
    report["aborted"] = dict(decode.streamer.aborted)
    report["leaks"] = decode.leaks()
    return report


def _steps_waiting(decode, short, poll, what: str) -> int:
    """Decode steps until S has all its tokens; before each, ``poll`` (resume or receive) must hand
    nothing over: L waits for the device pages S holds."""
    waited = 0
    while len(short.output_ids) < short.sampling_params.max_new_tokens:
        assert poll() == [], f"L {what} without device pages"
        waited += 1
        assert decode.decode_step()
    return waited


def _transfer_under_device_pressure(server_args, hooked: bool, long_len: int) -> dict:
    """S (resident, 3 pages) runs; L is preallocated while 5 device pages are free (SGLang's HiSparse
    budget: one buffer). While its KV is in flight S starts a 4th page. Hooked, L stays in the
    transfer queue until S finishes; SGLang's own pop_transferred hands it to admission anyway."""
    decode = DecodeQueues(server_args)
    short, long = decode.new_req("S", 150), decode.new_req("L", long_len)
    _admit(decode, short)
    decode.prealloc_queue.add(long)
    report = {"preallocated": [r.rid for r in decode.preallocate()]}
    while decode.stack.lens["S"] % PAGE:
        assert decode.decode_step()
    assert decode.decode_step()  # S starts a 4th page while L's transfer runs
    report["free_pages"] = decode.allocator.rows.device_rows.free_pages
    if not hooked:
        queue = decode.transfer_queue
        transferred = type(queue).pop_transferred.__wrapped__(queue)
        report["unhooked_transferred"] = [r.rid for r in transferred]
        try:
            for req in transferred:
                decode.coordinator.admit_request_direct(req)
        except Exception as exc:  # noqa: BLE001 - the report names it
            report["unhooked_admission"] = f"{type(exc).__name__}: {exc}"
        return report

    report["steps_waited"] = _steps_waiting(decode, short, decode.receive, "admitted")
    report["still_in_transfer_queue"] = [d.req.rid for d in decode.transfer_queue.queue]
    decode.finish(short)
    report["received"] = [r.rid for r in decode.receive()]
    decode.run_waiting()
    report["mode"] = decode.mode(long)
    report["decode_mem_checks"] = [decode.decode_step() for _ in range(40)]
    decode.finish(long)
    report["aborted"] = dict(decode.streamer.aborted)
    report["leaks"] = decode.leaks()
    return report


def _colocated(server_args) -> dict:
    """--enable-hisparse without disaggregation: the GPU pool still limits prompts; the rejection
    says so. With a context length below the pool, the rejection is SGLang's alone."""
    from sglang.srt.managers import scheduler as scheduler_module
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.sampling.sampling_params import SamplingParams

    decode = DecodeQueues(server_args)
    report = {}
    for name, context_len in (("pool_limited", CONTEXT_LEN), ("context_limited", 300)):
        worker = types.SimpleNamespace(**vars(decode.worker))
        worker.server_args = types.SimpleNamespace(disaggregation_mode="null")
        worker.model_config = types.SimpleNamespace(context_len=context_len)
        LOG.take("")
        info = TpModelWorker.get_worker_info(worker)
        req = Req("p", "", array("q", range(LONG)), SamplingParams(max_new_tokens=16))
        scheduler = types.SimpleNamespace(hisparse_coordinator=decode.coordinator, max_req_input_len=info[5])
        report[name] = {
            "startup_log": LOG.take("HiSparse co-located"),
            "worker_info": [info[i] for i in (0, 4, 5)],
            "error": rejection_message(scheduler, scheduler_module.validate_input_length(req, info[5], False)),
            "short_error": rejection_message(scheduler, scheduler_module.validate_input_length(
                Req("q", "", array("q", range(100)), SamplingParams(max_new_tokens=16)), info[5], False
            )),
        }
    return report


def _child(conn) -> None:
    """A scheduler-like process: SGLang's process setup, the plugin, then every scenario."""
    try:
        from sglang.srt.server_args import ServerArgs

        from hisparse_sglang.integration.sglang import compat

        # SGLang resolves the retraction backup at launch from the KV pool (0.5.18+): CPU tensors for a DSA pool
        backup = dict(disaggregation_decode_retraction_backup="cpu_tensor") if drive.retraction_backup_is_configurable() else {}
        server_args = ServerArgs(
            model_path="dummy", device="cpu", host="127.0.0.1", page_size=PAGE, disaggregation_mode="decode",
            disaggregation_transfer_backend="fake", **backup,
        )
        init_single_rank_scheduler(server_args)
        os.environ["SGLANG_PLUGINS"] = "hisparse"
        from sglang.srt.plugins import load_plugins

        load_plugins()
        hisparse_logger = logging.getLogger("hisparse_sglang")
        hisparse_logger.setLevel(logging.INFO)
        hisparse_logger.addHandler(LOG)
    except BaseException:
        conn.send({"setup": {"error": traceback.format_exc()}})
        conn.close()
        os._exit(0)
    scenarios = {
        "long_prompt": lambda: _long_prompt(server_args),
        "retract": lambda: _retract_under_device_pressure(server_args, hooked=True, long_len=LONG),
        # shorter than the device pool: the crash does not need a long prompt
        "retract_unhooked": lambda: _retract_under_device_pressure(server_args, hooked=False, long_len=SHORTER),
        "transfer": lambda: _transfer_under_device_pressure(server_args, hooked=True, long_len=LONG),
        "transfer_unhooked": lambda: _transfer_under_device_pressure(server_args, hooked=False, long_len=SHORTER),
        "colocated": lambda: _colocated(server_args),
        # what the plugin reads of the parallel layout (the shared host pool's DP-attention check)
        "parallel": lambda: {"attention_dp_size": compat.attention_dp_size(), "tp_rank": compat.tp_rank()},
    }
    reports = {}
    for name, scenario in scenarios.items():
        try:
            reports[name] = scenario()
        except BaseException:
            reports[name] = {"error": traceback.format_exc()}
    conn.send(reports)
    conn.close()
    os._exit(0)


# ------------------------------------------------------------------------------------------ test side
@pytest.fixture(scope="module")
def reports() -> dict:
    context = multiprocessing.get_context("spawn")
    parent, child_conn = context.Pipe()
    child = context.Process(target=_child, args=(child_conn,), daemon=True)
    child.start()
    try:
        if not parent.poll(CHILD_DEADLINE_S):
            pytest.fail(f"the scenario process sent nothing within {CHILD_DEADLINE_S} s")
        result = parent.recv()
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    if "setup" in result:
        pytest.fail(f"scenario process setup failed:\n{result['setup']['error']}")
    return result


def _report(reports: dict, name: str) -> dict:
    report = reports[name]
    if "error" in report:
        pytest.fail(f"scenario {name} failed:\n{report['error']}")
    return report


def test_long_prompt_is_admitted_decoded_and_retracted_on_a_hisparse_decode_instance(reports):
    report = _report(reports, "long_prompt")
    # get_worker_info: the device pool size stays (item 0); the request limits come from the logical pool
    assert report["worker_info"] == [DEVICE_TOKENS, CAPACITY - 1, CAPACITY - 6]
    assert report["worker_info"][2] > LONG
    assert report["startup_log"] == [
        f"HiSparse PD decode: requests of up to {CAPACITY - 1} tokens are admitted (prompts shorter than "
        f"{CAPACITY - 6}), set by the logical (host) KV pool: {DEVICE_TOKENS * RATIO} tokens less "
        f"--num-reserved-decode-tokens {RESERVED}. The GPU KV pool ({DEVICE_TOKENS} tokens) holds only device "
        f"buffers and resident requests here; the prefill instance's own KV pool still limits prompts there."
    ]
    assert report["max_new_tokens"] == 200, "init_req_max_new_tokens clamped by the device pool"
    assert report["validation_error"] is None
    # 0.5.17 checks a new request against the prealloc queue's max_total_num_tokens, which our hook
    # sets to the decode capacity; from 0.5.18 SGLang checks HiSparse requests against the logical pool
    assert report["prealloc_max_total_num_tokens"] == (CAPACITY if _prealloc_capacity_hooked() else DEVICE_TOKENS)
    assert report["queued"] == ["long"]
    assert report["mode_at_admission"] == "offloaded"
    assert report["device_pages_at_admission"] == (BUFFER_SIZE + PAGE) // PAGE  # one buffer, nothing else
    assert report["decode_mem_checks"] == [True] * 45
    assert report["kv_len_after_decode"] == LONG + 45 and LONG < 24 * PAGE < LONG + 45  # crossed a page
    assert report["leaks_while_retracted"] == NO_LEAKS  # its KV is in SGLang's CPU copy
    assert report["retracted_queue"] == ["long"]
    assert report["resumed"] == ["long"]
    assert report["mode_after_resume"] == "offloaded"
    assert report["decode_mem_checks_after_resume"] == [True] * 5
    assert report["aborted"] == {}
    assert report["leaks"] == NO_LEAKS
    assert report["scheduler_max_total_num_tokens"] == DEVICE_TOKENS


def test_prompt_longer_than_the_decode_capacity_is_rejected_with_the_reason(reports):
    report = _report(reports, "long_prompt")
    error = report["too_long_validation_error"]
    sglang_part = f"Input length ({CAPACITY + PAGE} tokens) exceeds the maximum allowed length ({CAPACITY - 6} tokens)"
    assert error.startswith(sglang_part)
    assert "logical (host) KV pool" in error and f"leaves {CAPACITY}" in error and "host_to_device_ratio" in error
    if _prealloc_capacity_hooked():
        assert report["too_long_aborted"] == (
            f"Request too_long exceeds the maximum number of tokens: {CAPACITY + PAGE} > {CAPACITY}"
        )
    else:  # SGLang's own check (logical pool, 0.5.18+) lets it queue; its validation error rejects it
        assert report["too_long_aborted"] is None


def _prealloc_capacity_hooked() -> bool:
    """Whether the installed release gets our DecodePreallocQueue.__init__ hook (0.5.17 only)."""
    from hisparse_sglang.integration.sglang import compat
    from hisparse_sglang.integration.sglang.hooks import specs_for

    targets = {spec.target for spec in specs_for("scheduler", compat.sglang_version())}
    return "sglang.srt.disaggregation.decode.DecodePreallocQueue.__init__" in targets


def test_sglang_resume_of_a_retracted_request_without_device_pages_crashes(reports):
    """Without our hook, SGLang 0.5.17 resumes on the logical budget alone and the admission fails,
    for a request shorter than the device pool too (a scheduler crash in a server)."""
    report = _report(reports, "retract_unhooked")
    assert report["modes"] == {"S": "resident", "L": "offloaded"} and report["free_pages_full"] == 0
    assert report["retracted"] == ["L"] and report["free_pages_after_short_grew"] == 4
    assert report["unhooked_resume"].startswith("PoolExhaustedError: device KV pool exhausted: 5 page(s) needed")


def test_retracted_long_request_waits_for_device_pages_then_resumes(reports):
    report = _report(reports, "retract")
    assert report["modes"] == {"S": "resident", "L": "offloaded"} and report["free_pages_full"] == 0
    assert report["retracted"] == ["L"] and report["aborted_by_retraction"] == []
    assert report["free_pages_after_short_grew"] == 4
    assert report["steps_waited"] > 0
    assert report["resumed"] == ["L"] and report["mode_after_resume"] == "offloaded"
    assert report["decode_mem_checks_after_resume"] == [True] * 40
    assert report["aborted"] == {}
    assert report["leaks"] == NO_LEAKS


def test_sglang_admission_of_a_transfer_after_resident_growth_crashes(reports):
    """Without our hook, SGLang 0.5.17 admits a transferred request the device pool cannot hold now
    (a request shorter than the device pool here; a scheduler crash in a server)."""
    report = _report(reports, "transfer_unhooked")
    assert report["preallocated"] == ["L"] and report["free_pages"] == 4
    assert report["unhooked_transferred"] == ["L"]
    assert report["unhooked_admission"].startswith("PoolExhaustedError: device KV pool exhausted: 5 page(s) needed")


def test_transferred_long_request_waits_for_device_pages_then_is_admitted(reports):
    report = _report(reports, "transfer")
    assert report["preallocated"] == ["L"] and report["free_pages"] == 4
    assert report["steps_waited"] > 0 and report["still_in_transfer_queue"] == ["L"]
    assert report["received"] == ["L"] and report["mode"] == "offloaded"
    assert report["decode_mem_checks"] == [True] * 40
    assert report["aborted"] == {}
    assert report["leaks"] == NO_LEAKS


def test_colocated_rejection_names_the_gpu_pool_and_the_way_out(reports):
    report = _report(reports, "colocated")
    pool_limited = report["pool_limited"]
    # co-located: SGLang's own limits (the device pool) stay
    assert pool_limited["worker_info"] == [DEVICE_TOKENS, DEVICE_TOKENS - 1, DEVICE_TOKENS - 6]
    error = pool_limited["error"]
    sglang_part = f"Input length ({LONG} tokens) exceeds the maximum allowed length ({DEVICE_TOKENS - 6} tokens)."
    assert error.startswith(sglang_part)
    assert f"GPU KV pool holds {DEVICE_TOKENS} tokens" in error
    assert f"fewer than {DEVICE_TOKENS - 6} tokens" in error
    assert "PD disaggregation with hisparse-sglang on the decode instance" in error
    assert "--mem-fraction-static" in error
    assert pool_limited["short_error"] is None
    assert pool_limited["startup_log"] == [
        f"HiSparse co-located: prompts shorter than {DEVICE_TOKENS - 6} tokens are admitted, set by the GPU KV pool "
        f"({DEVICE_TOKENS} tokens; the prefill writes the whole prompt there). Longer prompts need PD "
        f"disaggregation with hisparse-sglang on the decode instance (docs/pd.md)."
    ]
    context_limited = report["context_limited"]
    assert context_limited["worker_info"] == [DEVICE_TOKENS, 299, 294]
    assert context_limited["startup_log"] == [
        "HiSparse co-located: prompts shorter than 294 tokens are admitted, set by the context length (300)."
    ]
    assert context_limited["error"] == (
        f"Input length ({LONG} tokens) exceeds the maximum allowed length (294 tokens). "
        f"Use a shorter input or enable --allow-auto-truncate."
    )


def test_decode_capacity_is_the_logical_pool_less_the_reserve_and_refuses_less_than_a_page():
    from test_coordinator_sglang import Stack

    from hisparse_sglang.errors import UnsupportedSetupError
    from hisparse_sglang.integration.sglang import limits

    stack = Stack(device_tokens=DEVICE_TOKENS, ratio=RATIO, buffer_size=BUFFER_SIZE)
    assert limits.decode_request_capacity(stack.coordinator, RESERVED) == CAPACITY
    assert limits.decode_request_capacity(stack.coordinator, RESERVED + 1) == CAPACITY - PAGE  # whole pages
    assert limits.decode_request_capacity(None, RESERVED) is None  # not hisparse-sglang's coordinator
    small = Stack(device_tokens=DEVICE_TOKENS, ratio=1, buffer_size=BUFFER_SIZE)
    assert limits.decode_request_capacity(small.coordinator, DEVICE_TOKENS - PAGE) == PAGE
    with pytest.raises(UnsupportedSetupError, match=r"holds 512 tokens .*--num-reserved-decode-tokens \(512\); raise "
                       r"host_to_device_ratio"):
        limits.decode_request_capacity(small.coordinator, DEVICE_TOKENS)


def test_the_plugin_reads_the_parallel_layout_of_the_release(reports):
    """One TP rank, DP attention off: attention DP width 1 (0.5.22+ keep ServerArgs.enable_dp_attention
    false even when attention DP is on, so the width comes from SGLang's parallel context)."""
    assert _report(reports, "parallel") == {"attention_dp_size": 1, "tp_rank": 0}
