"""Hook bodies on the scheduler's own paths (``hooks.HOOKS`` declares them), in every mode: the
decode-step memory check, the release of a request's KV, aborts of staging requests and the message
of a rejected prompt.

Imports of sglang and of the adapters happen lazily, in the process that runs the hook.
"""

from __future__ import annotations

from hisparse_sglang.integration.sglang import compat
from hisparse_sglang.integration.sglang.hook_lookup import coordinator_of, runtime_of


def _check_decode_mem(original, self, selected_indices=None):
    """AROUND ScheduleBatch.check_decode_mem: logical rows for every request, device rows only
    for resident requests (offloaded ones decode into their buffer). Under speculative decoding
    (0.5.22+) the logical rows are the reserve SGLang allocates next (its own count), and the device
    check is the coordinator's for that reserve."""
    coordinator = coordinator_of(self)
    if coordinator is None:
        return original(self, selected_indices)
    from sglang.srt.managers import schedule_batch

    num_tokens = self.new_tokens_required_next_decode(selected_indices)
    schedule_batch.evict_from_tree_cache(self.tree_cache, num_tokens)
    requests = self.reqs if selected_indices is None else [self.reqs[i] for i in selected_indices]
    allocator = self.token_to_kv_pool_allocator
    if allocator.rows.logical.free_rows < num_tokens:
        return False
    if not self.spec_algorithm.is_none():
        return coordinator.can_verify(requests)
    return coordinator.can_decode([compat.req_slot(req) for req in requests])


def _release_kv_cache_before(req, tree_cache, *args, **kwargs):
    """BEFORE release_kv_cache: every release of a request's KV also releases its HiSparse state.
    (Its third argument is ``is_insert`` up to 0.5.21, the keyword ``checkpoint`` from 0.5.22.)"""
    coordinator = coordinator_of(tree_cache)
    if coordinator is not None:
        coordinator.release_request(req)


def _abort_request_after(result, self, recv_req):
    """AFTER Scheduler.abort_request: abort requests still staging (SGLang 0.5.17 leaves them running)."""
    coordinator = coordinator_of(self)
    if coordinator is None:
        return result
    for req in coordinator.staging_reqs():
        if not req.finished() and (recv_req.abort_all or req.rid.startswith(recv_req.rid)):
            req.to_finish = compat.abort_reason("Aborted by AbortReq.")
    return result


def _add_request_to_queue_before(self, req, *args, **kwargs):
    """BEFORE Scheduler._add_request_to_queue: a prompt SGLang rejected for a limit a KV pool sets
    (``validate_input_length``) gets the runtime's note on which pool and how to admit it appended
    to its abort message, which the client receives."""
    runtime = runtime_of(self)
    abort = getattr(req, "to_finish", None)
    message = getattr(abort, "message", None)
    if runtime is not None and isinstance(message, str):
        abort.message = runtime.explain_rejection(message, self.max_req_input_len)
