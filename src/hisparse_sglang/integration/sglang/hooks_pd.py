"""Hook bodies for the decode instance of PD disaggregation (``hooks.HOOKS`` declares them): the
preallocated host rows, the Mooncake registration of the host pool, the admission of transferred
and resumed requests against the device budget, and the logical-pool capacity behind its limits.

Imports of sglang and of the adapters happen lazily, in the process that runs the hook.
"""

from __future__ import annotations

import logging

from hisparse_sglang.integration.sglang import compat
from hisparse_sglang.integration.sglang.hook_lookup import coordinator_of, runtime_of

logger = logging.getLogger(__name__)


def _alloc_for_decode_prealloc_after(result, allocator, *, req, fill_len, uses_swa_tail, swa_tail_len):
    """AFTER alloc_for_decode_prealloc_hisparse: remember the logical locations (= host rows) the
    prefill instance must write, before SGLang asks the host pool for them."""
    runtime = runtime_of(allocator)
    if runtime is not None and runtime.started:
        # None (no logical rows left) is kept too, so that alloc_paged_token_slots names the cause.
        runtime.remember_preallocated(compat.req_slot(req), result)
    return result


def _batch_register_after(result, self, ptrs, lengths):
    """AFTER MooncakeTransferEngine.batch_register: a failed registration of a batch holding our host
    pool stops the decode instance with a typed error (SGLang ignores the code); other batches pass."""
    from hisparse_sglang.integration.sglang import mooncake

    host_pointers, host_lengths = compat.host_pool_regions(ptrs, lengths)
    if host_pointers:
        mooncake.check_host_pool_registration(result, host_pointers, host_lengths)
    return result


def _load_kv_cache_after(result, self, req_to_token_pool, token_to_kv_pool_allocator):
    """AFTER Req.load_kv_cache: a retracted PD-decode request resumed with its KV back in the host
    pool is admitted like a transferred one (SGLang 0.5.17 puts it in the waiting queue directly)."""
    coordinator = coordinator_of(token_to_kv_pool_allocator)
    if coordinator is not None:
        coordinator.admit_request_direct(self)
    return result


def _init_req_max_new_tokens(original, self, req):
    """AROUND Scheduler.init_req_max_new_tokens: on a PD decode instance clamp max_new_tokens by the
    logical-pool capacity instead of the device pool (which gives a long prompt 0 new tokens)."""
    capacity = _decode_capacity(self)
    if capacity is None:
        return original(self, req)
    device_tokens = self.max_total_num_tokens
    self.max_total_num_tokens = capacity
    try:
        return original(self, req)
    finally:
        self.max_total_num_tokens = device_tokens


def _decode_prealloc_queue_init_after(result, self, *args, **kwargs):
    """AFTER DecodePreallocQueue.__init__: its max_total_num_tokens is read only by
    _check_if_req_exceed_kv_capacity (every new and every retracted request); make it the
    logical-pool capacity, which is what its preallocation budget uses."""
    coordinator = coordinator_of(self.scheduler)
    if coordinator is not None:
        from hisparse_sglang.integration.sglang import limits

        self.max_total_num_tokens = limits.decode_request_capacity(coordinator, self.num_reserved_decode_tokens)


def _resume_retracted_reqs(original, self, rids_to_check=None):
    """AROUND DecodePreallocQueue.resume_retracted_reqs: resume only the retracted requests (in queue
    order) whose device pages the coordinator can provide now; the others stay retracted until
    pages free. SGLang 0.5.17 checks only the logical budget, and the admission on load_kv_cache
    raised PoolExhaustedError (a scheduler crash) when the device pool was short."""
    coordinator = coordinator_of(self.scheduler)
    if coordinator is None or not self.retracted_queue:
        return original(self, rids_to_check)
    candidates = [req for req in self.retracted_queue if rids_to_check is None or req.rid in rids_to_check]
    admissible = _admissible_rids(coordinator, candidates, self._pre_alloc_fill_len, "retracted", "it resumes")
    return original(self, admissible)


def _pop_transferred(original, self, rids_to_check=None):
    """AROUND DecodeTransferQueue.pop_transferred: hand over (for admit_request_direct) only the
    requests, in queue order, whose device pages the coordinator can provide now; the others stay
    in the transfer queue. Device pages budgeted at preallocation can be taken by resident requests
    growing while the transfer runs; SGLang 0.5.17 then admitted anyway, raising PoolExhaustedError."""
    coordinator = coordinator_of(self.scheduler)
    if coordinator is None or not self.queue:
        return original(self, rids_to_check)
    candidates = [entry.req for entry in self.queue if rids_to_check is None or entry.req.rid in rids_to_check]
    admissible = _admissible_rids(coordinator, candidates, compat.req_kv_allocated_len, "transferred", "admission")
    return original(self, admissible)


def _admissible_rids(coordinator, candidates, kv_len, kind: str, before: str) -> list:
    """The rids of the longest queue-order prefix of ``candidates`` whose device pages the
    coordinator can provide now (``kv_len(req)`` tokens each); the first left out is logged."""
    count = coordinator.admissible_now(kv_len(req) for req in candidates)
    if count < len(candidates):
        logger.debug("HiSparse: %s request %s waits for device pages before %s.", kind, candidates[count].rid, before)
    return [req.rid for req in candidates[:count]]


def _decode_capacity(scheduler) -> int | None:
    """Logical-pool request capacity of a PD decode scheduler with hisparse-sglang, else None."""
    if getattr(scheduler.server_args, "disaggregation_mode", "null") != "decode":
        return None
    coordinator = coordinator_of(scheduler)
    if coordinator is None:
        return None
    from sglang.srt.runtime_context import get_disagg

    from hisparse_sglang.integration.sglang import limits

    return limits.decode_request_capacity(coordinator, get_disagg().num_reserved_decode_tokens)
