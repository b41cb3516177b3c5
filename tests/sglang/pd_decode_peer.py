"""The decode peer of the Mooncake PD tests: SGLang 0.5.17's ``process_decode_queue`` step by step on
hisparse-sglang's stack (``pd_peer.DecodeSide``), with admission deferred until the test asks, so the
bytes can be checked first.

Commands (from the test):

* ``add`` (specs, bootstrap_port): new requests into ``DecodePreallocQueue``;
* ``abort`` (rid): SGLang's ``Scheduler.abort_request`` (with our AFTER hook), as an ``AbortReq`` from
  the tokenizer would run it;
* ``check`` (expect: rid -> [pages landed, index-K landed]): host rows and index-K pages now;
* ``admit`` (rids): ``admit_request_direct`` of transferred requests (they then wait in the waiting
  queue), then their device rows;
* ``release`` (rids): admitted requests finish (``request_finished`` + ``release_kv_cache``);
* ``drain`` (timeout_s): the running request ends; once the quarantine is empty, the leak report;
* ``register_again``: SGLang's ``register_buffer_to_engine`` once more; Mooncake refuses the host
  pool's regions (registered already), and our hook must turn that into a typed error.

Events (to the test): ``ready``, ``preallocated``, ``landed`` (a stalled request's first chunk is in
its host rows), ``transferred``, ``failed`` (SGLang aborted a request: its message and what our hooks
released), ``released`` (quarantined pages freed), ``abort_called``, ``checked``, ``admitted``,
``drained``, ``registered_again``.
"""

from __future__ import annotations

import time

import drive
import torch
from pd_peer import (
    LAYERS,
    LAYOUTS,
    PAGE,
    POISON,
    DecodeSide,
    command_loop,
    first_difference,
    first_not_poison,
    index_words,
    kv_words,
    leak_report,
    logical_pages_in_use,
    new_req,
    page_rows,
    run_peer,
)

from hisparse_sglang.integration.sglang import compat


class _Decode:
    def __init__(self, conn, side: DecodeSide) -> None:
        self.conn, self.side = conn, side
        self.specs: dict = {}
        self.reqs: dict = {}
        self.granted: dict[str, torch.Tensor] = {}
        self.slots: dict[str, int] = {}
        self.transferred: dict = {}  # KV arrived, not admitted yet
        self.failing: dict[str, str] = {}  # rid -> abort message: aborted, their KV not released yet
        self.admitted: dict = {}
        self.watch: dict[str, int] = {}  # rid -> pages of its first chunk not seen landed yet
        self.held_pages: set[int] = set()
        self.ever_granted = torch.zeros(side.host.num_rows, dtype=torch.bool)  # whole pages
        self.device_written = torch.zeros(side.device_rows(0).shape[0], dtype=torch.bool)
        # A running request holds a page in the middle of the free list, so the first preallocation
        # gets non-contiguous logical pages and the transfers must leave that page alone.
        freed = side.alloc_logical(2 * PAGE)
        self.running_rows = side.alloc_logical(PAGE)
        side.allocator.free(freed)

    # -------------------------------------------------------------- commands
    def add(self, command) -> None:
        reqs = []
        for spec in command["specs"]:
            self.specs[spec.rid] = spec
            self.reqs[spec.rid] = new_req(spec, command["bootstrap_port"], spec.room)
            reqs.append(self.reqs[spec.rid])
            if spec.stall:
                self.watch[spec.rid] = spec.first_chunk_pages()
        self.side.prealloc_queue.extend(reqs)

    def abort(self, command) -> None:
        from sglang.srt.managers.io_struct import AbortReq

        rid = command["rid"]
        waiting = self.reqs[rid] in self.side.waiting_queue
        self.side.view.abort_request(AbortReq(rid=rid))
        if waiting:
            self.admitted.pop(rid)
        self.conn.send(
            {"event": "abort_called", "rid": rid, "was_waiting": waiting, "tokenizer_aborts": self.side.tokenizer_aborts,
             **self._release_report(rid)}
        )

    def check(self, command) -> None:
        side, problems = self.side, []
        index_pages = side.pool.index_k_with_scale_buffer
        for rid, (pages_landed, index_landed) in command["expect"].items():
            problems += self._check_request(rid, pages_landed, index_landed)
        never_pages = ~self.ever_granted.view(-1, PAGE).any(1)
        for layer in range(LAYERS):
            problems.append(first_not_poison(side.host.layers[layer][~self.ever_granted], f"layer {layer} rows never granted"))
            problems.append(first_not_poison(index_pages[layer][never_pages], f"layer {layer} index-K pages never granted"))
            problems.append(first_not_poison(side.device_rows(layer)[~self.device_written], f"layer {layer} device rows"))
        self.conn.send(
            {
                "event": "checked",
                "problems": [p for p in problems if p],
                "host_rows_written": int((side.host.layers[0] != POISON).any(1).sum()),
                "index_pages_written": int((index_pages[0] != POISON).any(1).sum()),
                "held_pages": sorted(self.held_pages),
            }
        )

    def admit(self, command) -> None:
        from hisparse_sglang.coordinator import OFFLOADED, RESIDENT

        side, problems, modes = self.side, [], {}
        for rid in command["rids"]:
            req = self.admitted[rid] = self.transferred.pop(rid)
            side.coordinator.admit_request_direct(req)
            side.waiting_queue.append(req)
            record = side.coordinator.core.requests[compat.req_slot(req)]
            modes[rid] = record.mode
            rows = side.pool.translate_loc_to_hisparse_device(self.granted[rid]).to(torch.int64)
            spec = self.specs[rid]
            if record.mode == RESIDENT and bool((rows > 0).all()):
                self.device_written[rows] = True
                for layer in range(LAYERS):
                    problems.append(
                        first_difference(
                            side.device_rows(layer)[rows],
                            kv_words(layer, spec.prefill_rows()[: spec.tokens], side.layout.row_bytes),
                            f"{rid} layer {layer} device rows",
                        )
                    )
            elif record.mode == RESIDENT:
                problems.append(f"{rid}: resident but {int((rows <= 0).sum())} locations have no device row")
            elif record.mode == OFFLOADED and bool((rows != 0).any()):
                problems.append(f"{rid}: offloaded but {int((rows != 0).sum())} locations map to device rows")
            elif record.mode != OFFLOADED:
                problems.append(f"{rid}: unexpected mode {record.mode}")
        for layer in range(LAYERS):
            problems.append(first_not_poison(side.device_rows(layer)[~self.device_written], f"layer {layer} other device rows"))
        self.conn.send(
            {
                "event": "admitted",
                "problems": [p for p in problems if p],
                "modes": modes,
                "buffers_used": side.coordinator.buffers.used_buffers,
            }
        )

    def release(self, command) -> None:
        for rid in command["rids"]:
            req = self.admitted.pop(rid)
            self.side.waiting_queue.remove(req)
            self.side.coordinator.request_finished(req)
            drive.release_kv_cache(req, self.side.tree_cache)

    def register_again(self, command) -> None:
        from hisparse_sglang.errors import MooncakeRegistrationError

        try:
            self.side.kv_manager.register_buffer_to_engine()
            error = None
        except MooncakeRegistrationError as exc:
            error = str(exc)
        self.conn.send({"event": "registered_again", "error": error})

    def drain(self, command) -> None:
        self.side.allocator.free(self.running_rows)
        deadline = time.monotonic() + command["timeout_s"]
        while self.side.allocator.quarantine.pages_held and time.monotonic() < deadline:
            self._watch_quarantine()
            time.sleep(0.02)
        self._watch_quarantine()
        self.conn.send({"event": "drained", "leaks": leak_report(self.side)})

    # -------------------------------------------------------------- process_decode_queue
    def step(self) -> None:
        side = self.side
        aborted_before = len(side.streamer.aborted)
        preallocated, _ = side.prealloc_queue.pop_preallocated()
        for decode_req in preallocated:
            req = decode_req.req
            slot = self.slots[req.rid] = compat.req_slot(req)
            locations = side.req_to_token_pool.req_to_token[slot, : self.specs[req.rid].tokens].to(torch.int64)
            self.granted[req.rid] = locations
            pages = locations[::PAGE] // PAGE
            self.ever_granted[page_rows(pages)] = True
            hooked = side.coordinator.mem_pool_host.preallocated.get(slot)
            self.conn.send(
                {
                    "event": "preallocated",
                    "rid": req.rid,
                    "pages": pages.tolist(),
                    "captured": hooked is not None and torch.equal(hooked.to(torch.int64), locations),
                }
            )
        side.transfer_queue.extend(preallocated)
        for req in side.transfer_queue.pop_transferred():
            self.transferred[req.rid] = req
            self.conn.send({"event": "transferred", "rid": req.rid, "output_ids": list(req.output_ids)})
        for rid, message in side.streamer.aborted[aborted_before:]:
            self.watch.pop(rid, None)
            self.failing[rid] = message
            self.conn.send({"event": "aborted", "rid": rid, "reason": message})  # the transfer failed
        # SGLang's failure path runs request_finished and release_kv_cache for these requests (from
        # 0.5.21 once the prefill acknowledged that its writes drained, or 30 s later if it cannot:
        # a dead prefill); "failed" reports the release
        drive.resolve_deferred_releases(side.transfer_queue)
        for rid in [rid for rid in self.failing if compat.req_slot_or_none(self.reqs[rid]) is None]:
            message = self.failing.pop(rid)
            self.conn.send(
                {"event": "failed", "rid": rid, "reason": message, "time": time.monotonic(), **self._release_report(rid)}
            )
        self._watch_landing()
        self._watch_quarantine()

    def _release_report(self, rid: str) -> dict:
        """What a released request left behind: its slot, our state, and whether each of its pages
        is held by the quarantine."""
        coordinator, slot = self.side.coordinator, self.slots.get(rid)
        pages = (self.granted[rid][::PAGE] // PAGE).tolist() if rid in self.granted else []
        held = set(self.side.allocator.quarantine.held_pages().tolist())
        return {
            "slot_released": compat.req_slot_or_none(self.reqs[rid]) is None,
            "coordinator_forgot": slot is None
            or (slot not in coordinator.core.requests and slot not in coordinator.mem_pool_host.preallocated),
            "pages": pages,
            "pages_held": [page in held for page in pages],
            "finished_reason": type(self.reqs[rid].finished_reason).__name__,
            "logical_pages_in_use": logical_pages_in_use(self.side.allocator),
        }

    def _watch_landing(self) -> None:
        for rid, pages in list(self.watch.items()):
            if rid not in self.granted:
                continue
            rows = page_rows(self.granted[rid][::PAGE][:pages] // PAGE)
            source = self.specs[rid].prefill_rows()[: pages * PAGE]
            row_bytes = self.side.layout.row_bytes
            if all(
                torch.equal(self.side.host.layers[layer][rows], kv_words(layer, source, row_bytes))
                for layer in range(LAYERS)
            ):
                del self.watch[rid]
                self.conn.send({"event": "landed", "rid": rid})

    def _watch_quarantine(self) -> None:
        logical_pages_in_use(self.side.allocator)  # returns pages whose quarantine is over
        held = set(self.side.allocator.quarantine.held_pages().tolist())
        released = self.held_pages - held
        if released:
            self.conn.send({"event": "released", "pages": sorted(released), "time": time.monotonic()})
        self.held_pages = held

    def _check_request(self, rid: str, pages_landed: int, index_landed: bool) -> list:
        """A request's pages: the first ``pages_landed`` hold the prefill's pages, the others nothing;
        its index-K pages hold the prefill's when ``index_landed``, else nothing."""
        side, spec = self.side, self.specs[rid]
        locations = self.granted[rid]
        pages = locations[::PAGE] // PAGE
        problems = []
        if not torch.equal(locations, page_rows(pages)[: spec.tokens]):
            problems.append(f"{rid}: granted locations are not page-aligned runs")
        landed, untouched = page_rows(pages[:pages_landed]), page_rows(pages[pages_landed:])
        source = spec.prefill_rows()[: pages_landed * PAGE]
        for layer in range(LAYERS):
            rows = side.host.layers[layer]
            problems.append(
                first_difference(rows[landed], kv_words(layer, source, side.layout.row_bytes), f"{rid} layer {layer} host rows")
            )
            problems.append(first_not_poison(rows[untouched], f"{rid} layer {layer} host rows not sent"))
            index = side.pool.index_k_with_scale_buffer[layer][pages]
            if index_landed:
                expected = index_words(layer, torch.tensor(spec.prefill_pages))
                problems.append(first_difference(index, expected, f"{rid} layer {layer} index-K pages"))
            else:
                problems.append(first_not_poison(index, f"{rid} layer {layer} index-K pages"))
        return problems


def decode_peer(conn, layout_name: str, quarantine_s: float, deadline_s: float, env: dict[str, str]) -> None:
    """Decode process: sends "ready" (with what its KV manager registered), then runs commands."""

    def body() -> None:
        import logging

        from pd_decode_harness import LogLines
        from sglang.srt.plugins.hook_registry import HookRegistry

        log = LogLines()
        hisparse_logger = logging.getLogger("hisparse_sglang")
        hisparse_logger.setLevel(logging.INFO)
        hisparse_logger.addHandler(log)
        side = DecodeSide(LAYOUTS[layout_name], quarantine_s, env)
        decode = _Decode(conn, side)
        conn.send(
            {
                "event": "ready",
                "registration": side.registration_report(),
                "prealloc_hook_applied": "sglang.srt.disaggregation.decode.alloc_for_decode_prealloc_hisparse"
                in HookRegistry._patched,
                "registration_log": log.take("HiSparse: host KV pool registered with Mooncake"),
            }
        )
        handlers = {
            "add": decode.add, "abort": decode.abort, "check": decode.check, "admit": decode.admit,
            "release": decode.release, "drain": decode.drain, "register_again": decode.register_again,
        }
        command_loop(conn, handlers, decode.step, deadline_s)

    run_peer(conn, body)
