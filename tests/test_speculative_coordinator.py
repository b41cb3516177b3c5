"""The coordinator's verify-step API (coordinator/speculative.py) on the CPU with the reference ops: what
prepare binds, what commit writes, and the refusals of misuse (typed errors, nothing changed)."""

import types

import pytest
import torch

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.coordinator import Coordinator
from hisparse_sglang.errors import HiSparseConfigError, HiSparseMemoryError, UnsupportedSetupError
from hisparse_sglang.ops import reference
from hisparse_sglang.testing.sim import SimulatedServer, SpeculativeMode, token_rows

PAGE, BUFFER, TOP_K, T = 4, 8, 2, 3


def server(device_pages: int = 32, resident_first: bool = True, **config) -> SimulatedServer:
    values = dict(top_k=TOP_K, device_buffer_size=BUFFER, page_size=PAGE, host_to_device_ratio=4,
                  resident_first=resident_first, switch_cooldown_steps=0, promote_free_fraction=0.0)
    values.update(config)
    return SimulatedServer(
        HiSparseConfig(**values), layer_num=2, item_bytes=16, device_pages=device_pages, max_reqs=4,
        max_context=96, speculative=SpeculativeMode(T, host_lag=False, accept=lambda uid, i: 2),
    )


def admitted(sim: SimulatedServer, prompt_len: int = 30) -> int:
    """A prefilled request released for decoding (nothing verified yet); returns its slot."""
    uid = sim.add_request(prompt_len, 20)
    sim.coordinator.collect_ready()
    sim.requests[uid].state = "decoding"
    return sim.requests[uid].slot


def reserve(sim: SimulatedServer, slot: int, old: int, new: int) -> None:
    """Logical locations for positions [old, new) of a request (SGLang's alloc_for_spec_decode)."""
    last = sim.req_to_token[slot, old - 1 : old].to(torch.int64)
    locs = sim.allocator.alloc_extend(torch.tensor([old]), torch.tensor([new]), last, with_device_rows=False)
    sim.req_to_token[slot, old:new] = locs.to(torch.int32)


def prepare(sim, slots, committed, allocated, s=None, num_draft_tokens=T):
    s = committed if s is None else s
    sim.coordinator.prepare_verify(
        list(slots), list(committed), list(allocated), torch.tensor(slots), torch.tensor(s), num_draft_tokens
    )


def state(sim: SimulatedServer) -> tuple:
    coordinator = sim.coordinator
    return (
        {slot: (r.seq_len, r.mode, r.allocated_len) for slot, r in coordinator.requests.items()},
        coordinator.allocator.device_row_of_loc.clone(),
        coordinator.allocator.device_rows.free_pages,
        coordinator.speculative.num_draft_tokens,
        coordinator._step_kind,
    )


def unchanged(before, after) -> bool:
    return before[0] == after[0] and torch.equal(before[1], after[1]) and before[2:] == after[2:]


# ---------------------------------------------------------------------------------------------- binding
def test_prepare_gives_a_resident_request_exactly_the_pages_of_its_reserve():
    sim = server()
    slot = admitted(sim, 30)  # 8 pages, positions 30, 31 mapped with the last one
    free = sim.allocator.device_rows.free_pages
    reserve(sim, slot, 30, 40)
    prepare(sim, [slot], [30], [40])
    assert free - sim.allocator.device_rows.free_pages == 2  # logical pages 8 and 9
    rows = sim.allocator.translate(sim.req_to_token[slot, :40].long())
    assert bool((rows > 0).all()) and bool((rows % PAGE == sim.req_to_token[slot, :40] % PAGE).all())
    assert sim.coordinator.requests[slot].allocated_len == 40
    prepare(sim, [slot], [32], [40])  # the same reserve: nothing new
    assert free - sim.allocator.device_rows.free_pages == 2


def test_prepare_binds_an_offloaded_requests_verify_positions_to_its_verify_slots_only():
    sim = server(resident_first=False)
    slot = admitted(sim, 30)
    sim.coordinator.reclaim(sim.allocator.device_rows.capacity_pages)  # demotes it (always-offload)
    record = sim.coordinator.requests[slot]
    reserve(sim, slot, 30, 40)
    prepare(sim, [slot], [30], [40], s=[33])  # the device is one verify ahead of the host
    assert record.mode == "offloaded"
    buffer = sim.buffers.buffer_of(slot)
    slot_rows = sim.buffers.slot_rows[buffer]
    rows = sim.allocator.translate(sim.req_to_token[slot, :40].long())
    assert rows[33:36].tolist() == slot_rows[BUFFER + 1 : BUFFER + 1 + T].tolist()
    # Nothing else is bound now; what an earlier binding left (positions of the demoted request's last
    # page) points into its own buffer, and no forward reads it (finish unmaps every allocated location).
    others = torch.cat([rows[:33], rows[36:]])
    assert bool(torch.isin(others[others > 0], slot_rows).all())
    assert int((others[:28] > 0).sum()) == 0


def test_the_first_verify_of_a_pd_admitted_request_refreshes_slot_d_from_the_host():
    sim = server()
    uid = sim.admit_transferred(40, 20)  # long: offloaded with an empty buffer
    slot = sim.requests[uid].slot
    record = sim.coordinator.requests[slot]
    assert record.mode == "offloaded" and record.spec is None
    newest_row = int(sim.buffers.slot_rows[sim.buffers.buffer_of(slot), BUFFER])
    reserve(sim, slot, 40, 48)
    prepare(sim, [slot], [40], [48])
    for layer_id, layer in enumerate(sim.device_layers):
        assert torch.equal(layer[newest_row], token_rows(sim.requests[uid].uid, torch.tensor([39]), layer_id, 16)[0])
    assert not record.spec.slot_d_stale


def test_commit_backs_up_the_accepted_tokens_and_moves_the_newest_to_slot_d():
    sim = server(resident_first=False)
    slot = admitted(sim, 30)
    sim.coordinator.reclaim(sim.allocator.device_rows.capacity_pages)
    reserve(sim, slot, 30, 40)
    prepare(sim, [slot], [30], [40])
    locs = sim.req_to_token[slot, 30:33].long()
    rows = sim.allocator.translate(locs).long()
    for layer_id, layer in enumerate(sim.device_layers):
        layer[rows] = token_rows(7, torch.arange(30, 33), layer_id, 16)
    before = [layer.clone() for layer in sim.host_pool.layers]
    sim.coordinator.commit_verify(torch.tensor([slot]), torch.tensor([30]), torch.tensor([2]))
    newest_row = int(sim.buffers.slot_rows[sim.buffers.buffer_of(slot), BUFFER])
    for layer_id, (host, old) in enumerate(zip(sim.host_pool.layers, before)):
        assert torch.equal(host[locs[:2]], token_rows(7, torch.arange(30, 32), layer_id, 16))
        assert torch.equal(host[locs[2]], old[locs[2]]), "the rejected position's host row is untouched"
        assert torch.equal(sim.device_layers[layer_id][newest_row], token_rows(7, torch.tensor([31]), layer_id, 16)[0])


# ---------------------------------------------------------------------------------------------- refusals
def test_a_coordinator_serves_decode_steps_or_verify_steps_not_both():
    sim = server()
    slot = admitted(sim, 30)
    reserve(sim, slot, 30, 40)
    prepare(sim, [slot], [30], [40])
    with pytest.raises(HiSparseMemoryError, match="serves speculative verify steps, so it cannot serve plain decode"):
        sim.coordinator.prepare_decode([slot], [31], torch.zeros(1, dtype=torch.int64))
    with pytest.raises(HiSparseMemoryError, match="cannot serve plain decode steps"):
        sim.coordinator.can_decode([slot])

    plain = SimulatedServer(HiSparseConfig(top_k=TOP_K, device_buffer_size=BUFFER, page_size=PAGE), layer_num=1,
                            device_pages=32, max_reqs=4, max_context=96)
    uid = plain.add_request(30, 5)
    plain.step()
    slot = plain.requests[uid].slot
    before = state(plain)
    with pytest.raises(HiSparseMemoryError, match="serves plain decode steps, so it cannot serve speculative"):
        prepare(plain, [slot], [31], [40])
    with pytest.raises(HiSparseMemoryError, match="serves plain decode steps"):
        plain.coordinator.can_verify([slot], [40])
    assert unchanged(before, state(plain))


MISUSE = {
    "repeated": r"slot\(s\) \[{a}\] more than once",
    "unknown": r"request slot 3 is not admitted",
    "staging": r"request slot {c} is still staging",
    "lengths": r"pass one of each per slot",
    "committed_back": r"committed length 29 is below the 30",
    "short_reserve": r"allocated length 32 must be in \[33, 96\]",
    "shrinking": r"allocated length 36 must be in \[40, 96\]",
    "past_context": r"allocated length 100 must be in \[33, 96\]",
}


@pytest.mark.parametrize("case", sorted(MISUSE))
def test_misuse_of_prepare_is_refused_and_changes_nothing(case):
    match = MISUSE[case]
    sim = server()
    a, b = admitted(sim, 30), admitted(sim, 22)
    reserve(sim, a, 30, 40)
    reserve(sim, b, 22, 32)
    prepare(sim, [a, b], [30, 22], [40, 32])
    c = sim.requests[sim.add_request(9, 5)].slot  # staging
    calls = {
        "repeated": ([a, a], [30, 30], [40, 40]),
        "unknown": ([a, 3], [30, 9], [40, 20]),
        "staging": ([a, c], [30, 9], [40, 20]),
        "lengths": ([a, b], [30], [40, 32]),
        "committed_back": ([a], [29], [40]),
        "short_reserve": ([b], [30], [32]),
        "shrinking": ([a], [30], [36]),
        "past_context": ([b], [30], [100]),
    }
    slots, committed, allocated = calls[case]
    before = state(sim)
    with pytest.raises(HiSparseMemoryError, match=match.format(a=a, c=c)):
        sim.coordinator.prepare_verify(
            slots, committed, allocated, torch.tensor(slots), torch.tensor(committed + [0] * (len(slots) - len(committed))), T
        )
    assert unchanged(before, state(sim))


@pytest.mark.parametrize(
    "config, num_draft_tokens, match",
    [
        ({}, 4, r"num_draft_tokens \(4\) must be in \[1, 3\]"),
        ({}, 0, r"num_draft_tokens \(0\) must be in \[1, 3\]"),
    ],
    ids=["more-than-the-page-holds", "none"],
)
def test_verify_shapes_the_buffer_cannot_hold_are_refused(config, num_draft_tokens, match):
    sim = server(**config)
    slot = admitted(sim, 30)
    reserve(sim, slot, 30, 40)
    before = state(sim)
    with pytest.raises(HiSparseConfigError, match=match):
        prepare(sim, [slot], [30], [40], num_draft_tokens=num_draft_tokens)
    assert unchanged(before, state(sim))


def test_the_number_of_verify_positions_is_fixed_by_the_first_step():
    sim = server()
    slot = admitted(sim, 30)
    reserve(sim, slot, 30, 40)
    prepare(sim, [slot], [30], [40])
    with pytest.raises(HiSparseMemoryError, match="num_draft_tokens 2, but this coordinator's verify steps have 3"):
        prepare(sim, [slot], [30], [40], num_draft_tokens=2)


def test_commit_needs_the_prepared_batch_once():
    sim = server()
    slot = admitted(sim, 30)
    one = torch.tensor([slot])
    with pytest.raises(HiSparseMemoryError, match="prepared and not yet committed has none"):
        sim.coordinator.commit_verify(one, torch.tensor([30]), torch.tensor([1]))
    reserve(sim, slot, 30, 40)
    prepare(sim, [slot], [30], [40])
    with pytest.raises(HiSparseMemoryError, match="has 1 rows"):
        sim.coordinator.commit_verify(torch.tensor([slot, slot]), torch.tensor([30, 30]), torch.tensor([1, 1]))
    sim.coordinator.commit_verify(one[:0], torch.tensor([]), torch.tensor([]))  # an idle step commits nothing
    sim.coordinator.commit_verify(one, torch.tensor([30]), torch.tensor([1]))
    with pytest.raises(HiSparseMemoryError, match="has none"):
        sim.coordinator.commit_verify(one, torch.tensor([30]), torch.tensor([1]))


def test_swap_in_verify_refuses_a_top_k_of_another_shape():
    sim = server()
    slot = admitted(sim, 30)
    with pytest.raises(HiSparseMemoryError, match="before any prepare_verify"):
        sim.coordinator.swap_in_verify(torch.tensor([slot]), torch.tensor([30]), torch.zeros((1, T, TOP_K), dtype=torch.int32), 0)
    reserve(sim, slot, 30, 40)
    prepare(sim, [slot], [30], [40])
    with pytest.raises(HiSparseMemoryError, match=r"expected \[B, 3, 2\]"):
        sim.coordinator.swap_in_verify(torch.tensor([slot]), torch.tensor([30]), torch.zeros((1, 2, TOP_K), dtype=torch.int32), 0)


def test_ops_without_the_verify_ops_are_refused_by_name():
    decode_only = types.SimpleNamespace(
        swap_in=reference.swap_in, copy_rows=reference.copy_rows, copy_row_runs=reference.copy_row_runs,
        backup_newest=reference.backup_newest, bind_rows=reference.bind_rows,
    )
    sim = server()
    sim.coordinator.ops = decode_only
    slot = admitted(sim, 30)
    reserve(sim, slot, 30, 40)
    with pytest.raises(UnsupportedSetupError, match="no swap_in_positions, bind_verify_slots, verify_page_table, commit_accepted"):
        prepare(sim, [slot], [30], [40])


def test_a_host_pool_shared_by_tp_ranks_is_refused():
    sim = server()
    coordinator = Coordinator(
        sim.config, sim.allocator, sim.buffers, sim.host_pool, sim.device_layers, sim.req_to_token,
        ranks_share_host_pool=True,
    )
    coordinator.admit_prefilled(0, 30)
    coordinator.collect_ready()
    with pytest.raises(UnsupportedSetupError, match="share_host_pool_across_tp to false"):
        coordinator.prepare_verify([0], [30], [40], torch.tensor([0]), torch.tensor([30]), T)


def test_reclaim_counts_and_frees_a_resident_requests_reserve():
    """A resident request with a reserve past its newest committed token's page: reclaimable_pages (which
    the scheduler's admission counts) is every page beyond a buffer, and a demotion frees exactly those
    and unmaps every location of the request."""
    sim = server(device_pages=32)
    slot = admitted(sim, 30)
    reserve(sim, slot, 30, 44)
    prepare(sim, [slot], [30], [44])  # 11 pages: 8 below position 32, 3 of the reserve
    buffer_pages = (BUFFER + PAGE) // PAGE
    assert sim.coordinator.reclaimable_pages() == 11 - buffer_pages
    free = sim.allocator.device_rows.free_pages
    assert sim.coordinator.reclaim(free + 11 - buffer_pages)
    assert sim.allocator.device_rows.free_pages == free + 11 - buffer_pages
    record = sim.coordinator.requests[slot]
    assert record.mode == "offloaded" and record.spec.slot_d_stale
    assert bool((sim.allocator.translate(sim.req_to_token[slot, :44].long()) == 0).all())


def test_can_verify_counts_the_reserve_pages_of_resident_requests_only():
    sim = server(device_pages=12)  # 11 pages
    slot = admitted(sim, 6)  # 2 pages, not demotable
    free = sim.allocator.device_rows.free_pages
    assert sim.coordinator.can_verify([slot], [8 + PAGE * free])  # exactly the free pages
    assert not sim.coordinator.can_verify([slot], [8 + PAGE * free + 1])
    long_slot = admitted(sim, 30)  # demotable: its pages beyond a buffer count as reclaimable
    free = sim.allocator.device_rows.free_pages
    assert sim.coordinator.can_verify([slot, long_slot], [8 + PAGE * free + PAGE * 5, 40])
    assert not sim.coordinator.can_verify([slot, long_slot], [8 + PAGE * free + PAGE * 6, 40])


@pytest.mark.parametrize("count", [1, 2, 16, 17, 40])
def test_entries_of_the_request_table(count, monkeypatch):
    """The page starts the prepare binds, read from req_to_token: one-element views (no upload) for a few,
    one uploaded gather beyond; the same values either way."""
    from hisparse_sglang.coordinator import speculative

    uploads = []
    real_upload = speculative.upload_ints
    monkeypatch.setattr(speculative, "upload_ints", lambda *a: uploads.append(a) or real_upload(*a))
    generator = torch.Generator().manual_seed(count)
    table = torch.randint(0, 10_000, (8, 50), generator=generator, dtype=torch.int32)
    rows = torch.randint(0, 8, (count,), generator=generator).tolist()
    columns = torch.randint(0, 50, (count,), generator=generator).tolist()
    assert speculative._entries(table, rows, columns).tolist() == table[rows, columns].tolist()
    assert len(uploads) == (count > speculative._FEW_ENTRIES)


# ---------------------------------------------------------------------------------------------- fused top-k
class CountingOps(types.SimpleNamespace):
    """The reference ops, counting the swap-ins of verify steps."""

    def __init__(self):
        super().__init__(**{name: getattr(reference, name) for name in reference.__all__ if name != "swap_in_positions"})
        self.swap_ins = 0

    def swap_in_positions(self, *args, **kwargs):
        self.swap_ins += 1
        return reference.swap_in_positions(*args, **kwargs)


def fused_step(sim, slots, committed, padding=0):
    """A prepared verify step's page table and one layer's swap-in with the fused top-k (entries of resident
    requests given as rows); returns (top_k handed in, what the swap-in returned)."""
    for slot, length in zip(slots, committed):
        reserve(sim, slot, length, length + 2 * T)
    prepare(sim, slots, committed, [length + 2 * T for length in committed])
    rows_in = len(slots) + padding
    indices = torch.tensor(list(slots) + [slots[0]] * padding)
    sim.coordinator.verify_page_table(indices, torch.zeros((rows_in * T, 1), dtype=torch.int32))
    top_k = torch.full((rows_in, T, TOP_K), -1, dtype=torch.int32)
    top_k[:, :, 0] = torch.tensor([length - 2 for length in committed] + [committed[0] - 2] * padding).reshape(-1, 1)
    return top_k, sim.coordinator.swap_in_verify(indices, torch.tensor(list(committed) + [committed[0]] * padding),
                                                 top_k, 0, resident_rows=True)


@pytest.mark.parametrize("resident_first,padding,skipped", [(True, 0, True), (True, 1, False), (False, 0, False)])
def test_an_eager_fused_verify_of_resident_requests_only_skips_its_swap_in(resident_first, padding, skipped):
    """With the fused top-k a resident request's entries are its rows already: an eager forward whose prepared rows
    are all resident returns the top-k itself and launches nothing. A batch with padding rows (a CUDA graph's) or
    with an offloaded request runs the swap-in into the coordinator's rows."""
    sim = server(resident_first=resident_first)
    sim.coordinator.ops = ops = CountingOps()
    slots = [admitted(sim, 30), admitted(sim, 22)]
    top_k, rows = fused_step(sim, slots, [30, 22], padding)
    assert (rows is top_k) == skipped
    assert ops.swap_ins == (0 if skipped else 1)
    if not skipped:
        assert rows.data_ptr() == sim.coordinator.speculative.rows.data_ptr()
    sim.coordinator.commit_verify(torch.tensor(slots), torch.tensor([30, 22]), torch.tensor([1, 1]))
    # After the commit, a forward of no prepared step (CUDA-graph warm-up, capture) never skips.
    again = sim.coordinator.swap_in_verify(torch.tensor(slots), torch.tensor([30, 22]), top_k, 0, resident_rows=True)
    assert again is not top_k


def test_the_all_resident_graph_is_captured_without_swap_ins_and_only_all_resident_steps_may_replay_it():
    """Under ``capturing_all_resident_verify`` (SGLang capturing the verify graph of all-resident steps, hook H11)
    a fused verify top-k is its own rows, padded or not, and no swap-in launches; positions still swap in. Only a
    prepared, uncommitted step whose rows are all resident may replay that graph (``verify_all_resident``)."""
    sim = server()
    sim.coordinator.ops = ops = CountingOps()
    slots = [admitted(sim, 30), admitted(sim, 22)]
    assert not sim.coordinator.verify_all_resident  # nothing prepared
    top_k, rows = fused_step(sim, slots, [30, 22], padding=1)  # a padded forward outside it swaps in
    assert sim.coordinator.verify_all_resident and ops.swap_ins == 1
    indices, lengths = torch.tensor(slots + slots[:1]), torch.tensor([30, 22, 30])
    with sim.coordinator.capturing_all_resident_verify():
        assert sim.coordinator.swap_in_verify(indices, lengths, top_k, 0, resident_rows=True) is top_k
        assert ops.swap_ins == 1
        sim.coordinator.swap_in_verify(indices, lengths, top_k, 0, resident_rows=False)  # positions: swapped in
        assert ops.swap_ins == 2
        with pytest.raises(HiSparseMemoryError, match="entered twice"):
            with sim.coordinator.capturing_all_resident_verify():
                pass
    assert sim.coordinator.swap_in_verify(indices, lengths, top_k, 0, resident_rows=True) is not top_k
    sim.coordinator.commit_verify(torch.tensor(slots), torch.tensor([30, 22]), torch.tensor([1, 1]))
    assert not sim.coordinator.verify_all_resident  # committed

    # A step with an offloaded row: resident first with too few device pages for both (the verify demotes the
    # first), and always-offload.
    for sim in (server(device_pages=16), server(resident_first=False)):
        slots = [admitted(sim, 30), admitted(sim, 22)]
        fused_step(sim, slots, [30, 22])
        assert "offloaded" in {sim.coordinator.requests[slot].mode for slot in slots}
        assert not sim.coordinator.verify_all_resident
