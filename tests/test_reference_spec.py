"""The reference twins of speculative decoding (docs/speculative.md): the multi-position swap-in of a
target-verify forward, the binding of verify positions and the commit of accepted tokens."""

import random

import pytest
import torch

from hisparse_sglang.ops import reference
from hisparse_sglang.ops.tables import SwapInTables

D = 4  # LRU slots
P = 8  # page size: slot D holds the newest accepted token, slots D+1 .. D+7 the verify positions
ITEM = 16
POISON = 0xAB


class Case:
    """Request slot 0 offloaded (buffer 0: LRU rows 50..53, slot D row 60, verify rows 61..67, committed
    length 40, slots holding tokens 10..13), request slot 1 resident (position p on device row 300 + p).
    Host row of position p: 1000 + p (slot 0), 2000 + p (slot 1); host rows are unique bytes, device rows
    poisoned."""

    def __init__(self, committed=40, slot_tokens=(10, 11, 12, 13), stamps=(30, 30, 30, 30)):
        self.committed = committed
        self.req_to_token = torch.zeros((3, 64), dtype=torch.int32)
        self.req_to_token[0] = torch.arange(1000, 1064, dtype=torch.int32)
        self.req_to_token[1] = torch.arange(2000, 2064, dtype=torch.int32)
        self.device_row_of_loc = torch.zeros(3001, dtype=torch.int32)
        self.device_row_of_loc[-1] = -1
        self.device_row_of_loc[2000:2064] = torch.arange(300, 364, dtype=torch.int32)
        self.buffer_of_req = torch.tensor([0, -1, -1], dtype=torch.int32)
        self.slot_rows = torch.tensor([[50, 51, 52, 53, 60, 61, 62, 63, 64, 65, 66, 67]], dtype=torch.int32)
        self.slot_tokens = torch.tensor([list(slot_tokens)], dtype=torch.int32)
        self.stamps = torch.tensor([list(stamps)], dtype=torch.int32)
        self.token_slot = torch.full((1, 65), -1, dtype=torch.int16)
        for slot, token in enumerate(slot_tokens):
            if token >= 0:
                self.token_slot[0, token] = slot
        self.host = torch.arange(3001 * ITEM, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(3001, ITEM)
        self.device = torch.full((400, ITEM), POISON, dtype=torch.uint8)
        self.counters = torch.zeros(2, dtype=torch.int64)

    def tables(self):
        return SwapInTables(
            self.req_to_token, self.device_row_of_loc, self.buffer_of_req, self.slot_rows, self.slot_tokens,
            self.stamps, self.token_slot, self.host, self.device,
        )

    def run(self, top_k, reqs=(0,), committed=None, num_real=None, group=None, verify_limit=None, resident_rows=False):
        top_k = torch.tensor(top_k, dtype=torch.int32)
        if top_k.dim() == 2:
            top_k = top_k.unsqueeze(0)
        seq_lens = torch.tensor(committed or [self.committed] * len(reqs), dtype=torch.int64)
        num_real = torch.tensor([len(reqs) if num_real is None else num_real], dtype=torch.int32)
        out = torch.full(top_k.shape, 12345, dtype=torch.int32)  # sentinel
        result = reference.swap_in_positions(
            top_k, seq_lens, torch.tensor(reqs, dtype=torch.int64), num_real, self.tables(), out=out,
            counters=self.counters, verify_limit=verify_limit, group=group, resident_rows=resident_rows,
        )
        assert result is out
        self.check_map()
        return result

    def check_map(self):
        expected = torch.full_like(self.token_slot, -1)
        for slot, token in enumerate(self.slot_tokens[0].tolist()):
            if token >= 0:
                expected[0, token] = slot
        assert torch.equal(self.token_slot, expected), "token -> slot map is not the inverse of the slots"

    def written_rows(self):
        return torch.nonzero((self.device != POISON).any(dim=1)).reshape(-1).tolist()


# ------------------------------------------------------------------------------------ swap_in_positions
def test_history_newest_and_verify_tokens_each_take_their_rows():
    case = Case()
    out = case.run([
        [11, 39, 40, 41, -1],  # position 0 is token 40: 41 is beyond its causal limit
        [11, 39, 40, 41, 42],  # position 1 (token 41): 42 is beyond it
        [12, 39, 40, 41, 42],  # position 2 (token 42)
    ])
    assert out.tolist() == [[
        [51, 60, 61, -1, -1],
        [51, 60, 61, 62, -1],
        [52, 60, 61, 62, 63],
    ]]
    assert case.counters.tolist() == [3, 0]  # the history entries of every position, none missed
    assert case.stamps.tolist() == [[30, 40, 40, 30]]
    assert case.written_rows() == [], "hits, the newest token and verify tokens copy nothing"


def test_a_token_missed_by_two_positions_is_copied_once():
    case = Case()
    out = case.run([[20, 11], [20, 21]])
    # Union in position-major order: 20 (miss), 11 (hit, slot 1), 20 (repeat), 21 (miss). The slots not
    # hit (0, 2, 3) are equally old: the lower ones go first, 20 -> slot 0, 21 -> slot 2.
    assert out.tolist() == [[[50, 51], [50, 52]]]
    assert case.slot_tokens.tolist() == [[20, 11, 21, 13]]
    assert case.stamps.tolist() == [[40, 40, 40, 30]]
    assert case.counters.tolist() == [4, 2]
    assert case.written_rows() == [50, 52]
    assert torch.equal(case.device[50], case.host[1020]) and torch.equal(case.device[52], case.host[1021])


def test_no_position_evicts_a_token_another_position_reads():
    # Ages 1, 30, 30, 30. Alone, position 0's miss (20) would evict token 11 (slot 1, oldest and lowest),
    # which position 1 reads; together, 11 and 12 are hits of the request and stay.
    stamps = (39, 10, 10, 10)
    case = Case(stamps=stamps)
    out = case.run([[20, -1, -1], [11, 12, 21]], group=2)
    # hits 11 (slot 1), 12 (slot 2); misses 20, 21 take slots 3 (age 30) and 0 (age 1, the youngest victim)
    assert out.tolist() == [[[53, -1, -1], [51, 52, 50]]]
    assert case.slot_tokens.tolist() == [[21, 11, 12, 20]]
    assert case.counters.tolist() == [4, 2]

    one_at_a_time = Case(stamps=stamps)
    one_at_a_time.run([[20, -1, -1]])
    one_at_a_time.run([[11, 12, 21]])
    assert one_at_a_time.counters.tolist() == [4, 3], "alone, position 0 evicts 11 and position 1 copies it back"


def test_each_position_reads_the_kv_it_would_read_alone():
    """Served together, every position reads the same KV as when it is the request's only position
    (run on a fresh copy of the tables; the rows may differ, the bytes read may not)."""
    top_k = [[20, 11, 39, 40, -1], [21, 20, 13, 41, 40], [20, 13, 11, 42, 39]]

    def consistent_case():
        case = Case()
        case.device[[50, 51, 52, 53]] = case.host[[1010, 1011, 1012, 1013]]  # LRU slots hold their tokens
        case.device[60] = case.host[1039]  # slot D holds the newest accepted token
        for j in range(3):  # what the verify forward wrote for positions 40, 41, 42
            case.device[61 + j] = torch.full((ITEM,), 7 + j, dtype=torch.uint8)
        return case

    together = consistent_case()
    out = together.run(top_k)[0]
    for position, row in enumerate(top_k):
        alone = consistent_case()
        rows_alone = alone.run([[-1] * len(row)] * position + [row])[0, position]
        for entry, token in enumerate(row):
            if token < 0:
                assert int(out[position, entry]) == -1 and int(rows_alone[entry]) == -1
                continue
            read_together = together.device[int(out[position, entry])]
            read_alone = alone.device[int(rows_alone[entry])]
            assert torch.equal(read_together, read_alone), (position, entry, token)
            written = torch.full((ITEM,), 7 + token - 40, dtype=torch.uint8)
            expected = together.host[1000 + token] if token < 40 else written
            assert torch.equal(read_together, expected), (position, entry, token)


def test_one_position_of_history_is_swap_in():
    top_k = [[20, 11, 39, -1, 21, 20, 13, 11]]
    positions = Case(stamps=(35, 20, 33, 20))
    single = Case(stamps=(35, 20, 33, 20))
    out = positions.run(top_k)
    expected = reference.swap_in(
        torch.tensor(top_k, dtype=torch.int32), torch.tensor([40]), torch.tensor([0]),
        torch.tensor([1], dtype=torch.int32), single.tables(), counters=single.counters,
    )
    assert torch.equal(out[0], expected)
    for name in ("slot_tokens", "stamps", "token_slot", "device", "counters"):
        assert torch.equal(getattr(positions, name), getattr(single, name)), name


def test_resident_request_translates_every_valid_entry():
    case = Case()
    out = case.run([[5, 39, 40, 41, -1], [5, 39, 40, 41, 63]], reqs=(1,))
    assert out.tolist() == [[[305, 339, 340, -1, -1], [305, 339, 340, 341, -1]]]
    assert case.counters.tolist() == [0, 0]
    assert case.written_rows() == []


def test_resident_rows_given_pass_through_and_offloaded_positions_are_served_as_before():
    """With ``resident_rows`` (the fused top-k through verify_page_table) a resident request's entries are its rows
    already: out as they are, -1 included, never translated again; an offloaded request's are still positions."""
    case = Case()
    out = case.run(
        [[[60, 61], [62, 52]], [[305, 339], [-1, 341]], [[1, 2], [3, 4]]],
        reqs=(0, 1, 2), committed=[40, 40, 9], num_real=2, resident_rows=True,
    )
    assert out.tolist()[1:] == [[[305, 339], [-1, 341]], [[-1, -1], [-1, -1]]]
    offloaded = Case().run([[[60, 61], [62, 52]]], reqs=(0,), committed=[40])
    assert out.tolist()[0] == offloaded.tolist()[0]


def test_mixed_batch_with_a_padded_row():
    case = Case()
    out = case.run(
        [[[39, 40], [41, 12]], [[3, 40], [41, 4]], [[1, 2], [3, 4]]],
        reqs=(0, 1, 2), committed=[40, 40, 9], num_real=2,
    )
    assert out.tolist() == [[[60, 61], [62, 52]], [[303, 340], [341, 304]], [[-1, -1], [-1, -1]]]


def test_padding_rows_output_minus_one_and_change_nothing():
    case = Case()
    out = case.run([[30, 31], [32, 33]], num_real=0)
    assert out.tolist() == [[[-1, -1], [-1, -1]]]
    assert case.slot_tokens.tolist() == [[10, 11, 12, 13]]
    assert case.stamps.tolist() == [[30, 30, 30, 30]]
    assert case.counters.tolist() == [0, 0]
    assert case.written_rows() == []


def test_positions_whose_misses_do_not_fit_are_left_out_and_lower_the_limit():
    case = Case()
    limit = torch.full((1,), reference.NO_VERIFY_LIMIT, dtype=torch.int32)
    top_k = [
        [20, 39, -1],  # group 0: 20 misses; 39 is the newest accepted token (slot D)
        [21, 40, -1],  # 21 misses; 40 is position 0's verify token (slot D + 1)
        [12, 22, 41],  # group 1: 12 hits slot 2, 22 misses, 41 is a verify token
        [23, 24, 42],  # 23 and 24 miss: no slot left for them
    ]
    out = case.run(top_k, group=2, verify_limit=limit)
    # Group 0 takes slots 0 and 1 (equally old, lowest first). Group 1 may evict only slot 3: slots 0 and 1
    # carry stamp 40 (group 0's rows) and slot 2 is its hit. Its misses in order are 22, 23, 24: 23, of
    # position 3, is the first without a slot, so 22 alone is placed (slot 3) and position 3 is left out.
    assert out.tolist() == [[[50, 60, -1], [51, 61, -1], [52, 53, 62], [-1, -1, -1]]]
    assert limit.tolist() == [3]
    assert case.slot_tokens.tolist() == [[20, 21, 12, 22]]
    assert case.stamps.tolist() == [[40, 40, 40, 40]]
    assert case.counters.tolist() == [6, 3]  # position 3's entries were looked up; three rows copied
    assert case.written_rows() == [50, 51, 53]
    # A later layer of the same forward serves no position at or past the limit: here every entry hits.
    again = case.run(top_k, group=2, verify_limit=limit)
    assert again.tolist() == out.tolist() and limit.tolist() == [3]
    assert case.counters.tolist() == [6 + 4, 3]
    # The acceptance then takes at most positions 0 .. 2.
    accept_lens, accept_index = torch.tensor([4], dtype=torch.int32), torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    capped = torch.zeros(2, dtype=torch.int64)
    reference.cap_accepted(limit, accept_lens, accept_index, capped)
    assert accept_lens.tolist() == [3] and accept_index.tolist() == [[0, 1, 2, -1]] and capped.tolist() == [1, 1]
    assert limit.tolist() == [reference.NO_VERIFY_LIMIT]


def test_a_position_with_no_slot_left_leaves_out_every_later_one():
    case = Case()
    limit = torch.full((1,), reference.NO_VERIFY_LIMIT, dtype=torch.int32)
    out = case.run([[20, 21, -1], [22, 23, 24], [20, 11, -1]], group=1, verify_limit=limit)
    # Position 0 takes slots 0 and 1; position 1 may evict slots 2 and 3 only, for three misses: left out;
    # position 2 is then padding (its 20 would have hit).
    assert out.tolist() == [[[50, 51, -1], [-1, -1, -1], [-1, -1, -1]]]
    assert limit.tolist() == [1]
    assert case.slot_tokens.tolist() == [[20, 21, 12, 13]] and case.stamps.tolist() == [[40, 40, 30, 30]]
    assert case.counters.tolist() == [5, 2]


def test_stamps_equal_to_the_committed_length_only_make_fewer_slots_evictable():
    # Slots 1..3 carry stamp s = 40 before the call (a previous call of the same committed length): position 1
    # may evict none of them, nor slot 0 (position 0's hit), so it is left out instead of evicting a row.
    case = Case(stamps=(30, 40, 40, 40))
    limit = torch.full((1,), reference.NO_VERIFY_LIMIT, dtype=torch.int32)
    assert case.run([[10], [21]], group=1, verify_limit=limit).tolist() == [[[50], [-1]]]
    assert limit.tolist() == [1] and case.slot_tokens.tolist() == [[10, 11, 12, 13]]
    # With stamps below s the same call is served.
    fine = Case(stamps=(30, 39, 39, 39))
    assert fine.run([[10], [21]], group=1).tolist() == [[[50], [51]]]


def test_a_first_group_whose_history_exceeds_the_buffer_is_refused():
    case = Case()
    with pytest.raises(ValueError, match="first group's positions select 5 distinct history tokens .* 4 slots"):
        case.run([[20, 21, 22, 23, 24]])  # five distinct history tokens, four slots: position 0 cannot be served


def test_cap_accepted_caps_only_rows_above_their_limit():
    limit = torch.tensor([2, reference.NO_VERIFY_LIMIT, 3, 0, 1], dtype=torch.int32)
    accept_lens = torch.tensor([4, 4, 2, 3], dtype=torch.int64)
    accept_index = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, -1, -1], [12, 13, 14, -1]], dtype=torch.int32)
    counters = torch.zeros(2, dtype=torch.int64)
    reference.cap_accepted(limit, accept_lens, accept_index, counters)
    # Row 0: 4 -> 2; row 1: unlimited; row 2: 2 <= 3; row 3: a limit below 1 counts as 1 (the root).
    assert accept_lens.tolist() == [2, 4, 2, 1]
    assert accept_index.tolist() == [[0, 1, -1, -1], [4, 5, 6, 7], [8, 9, -1, -1], [12, -1, -1, -1]]
    assert counters.tolist() == [2, 4]
    # The batch's limits are reset; a row past the batch keeps its value.
    assert limit.tolist() == [reference.NO_VERIFY_LIMIT] * 4 + [1]


def test_more_positions_than_the_reserved_page_holds_are_refused():
    case = Case()
    with pytest.raises(ValueError, match="num-draft-tokens"):
        case.run([[1]] * P)


# ------------------------------------------------------------------------ swap_in_positions in groups
def test_groups_of_one_a_token_an_earlier_group_copied_is_a_hit():
    case = Case()
    out = case.run([[20, 11], [20, 21]], group=1)
    # Position 0: 11 hits slot 1, 20 misses and takes slot 0 (slots 0, 2, 3 equally old, lowest first).
    # Position 1: 20 is now a hit (copied once); 21 misses: slots 0 and 1 carry stamp 40 (age 0), so it takes
    # slot 2 (age 10), never a row position 0 returned.
    assert out.tolist() == [[[50, 51], [50, 52]]]
    assert case.slot_tokens.tolist() == [[20, 11, 21, 13]]
    assert case.stamps.tolist() == [[40, 40, 40, 30]]
    assert case.counters.tolist() == [4, 2]
    assert case.written_rows() == [50, 52]
    assert torch.equal(case.device[50], case.host[1020]) and torch.equal(case.device[52], case.host[1021])


def test_groups_of_one_never_evict_an_earlier_groups_row_but_recopy_what_it_evicted():
    # Ages 1, 30, 30, 30 (test_no_position_evicts_a_token_another_position_reads in one group).
    case = Case(stamps=(39, 10, 10, 10))
    out = case.run([[20, -1, -1], [11, 12, 21]], group=1)
    # Position 0 alone: 20 evicts 11 (slot 1: oldest, lowest) and returns row 51. Position 1: 12 hits slot 2;
    # 11 (evicted by position 0, which did not name it) and 21 miss; the slots position 1 did not hit are 0
    # (age 1), 1 (age 0: position 0's row) and 3 (age 30): 11 -> slot 3, 21 -> slot 0; row 51 keeps token 20.
    assert out.tolist() == [[[51, -1, -1], [53, 52, 50]]]
    assert case.slot_tokens.tolist() == [[21, 20, 12, 11]]
    assert case.counters.tolist() == [4, 3]
    for row, token in ((51, 20), (53, 11), (52, 12), (50, 21)):
        assert case.slot_tokens[0, row - 50] == token
        if row != 52:  # 12 was a hit: its row is still poisoned in this hand case
            assert torch.equal(case.device[row], case.host[1000 + token]), row
    # One group of both positions: 11 and 12 are hits of the request; one copy fewer.
    together = Case(stamps=(39, 10, 10, 10))
    assert together.run([[20, -1, -1], [11, 12, 21]], group=2).tolist() == [[[53, -1, -1], [51, 52, 50]]]
    assert together.counters.tolist() == [4, 2]


def test_a_group_outside_the_positions_is_refused():
    for group in (0, 3):
        with pytest.raises(ValueError, match=f"group {group} outside \\[1, 2\\]"):
            Case().run([[10], [11]], group=group)


def _union_of_every_position(case, counters):
    """swap_in_positions before groups existed: every position's history as one swap_in row."""
    out = torch.full(tuple(case.top_k.shape), -1, dtype=torch.int32)
    positions = case.top_k.shape[1]
    offsets = torch.arange(positions).reshape(-1, 1)
    for b in range(min(int(case.num_real_reqs[0]), case.top_k.shape[0])):
        req, committed = int(case.req_pool_indices[b]), int(case.seq_lens[b])
        tokens = case.top_k[b].to(torch.int64)
        valid = (tokens >= 0) & (tokens <= committed + offsets)
        buf = int(case.buffer_of_req[req])
        if buf < 0:
            out[b][valid] = case.device_row_of_loc[case.req_to_token[req, tokens[valid]].to(torch.int64)]
            continue
        history = valid & (tokens < committed - 1)
        row = torch.where(history, tokens, torch.full_like(tokens, -1)).reshape(1, -1).to(torch.int32)
        rows = reference.swap_in(row, case.seq_lens[b : b + 1], case.req_pool_indices[b : b + 1],
                                 torch.ones(1, dtype=torch.int32), case.tables, counters=counters)
        out[b][history] = rows.reshape(positions, -1)[history]
        out[b][valid & (tokens == committed - 1)] = case.slot_rows[buf, case.slot_tokens.shape[1]]
        verify = valid & (tokens >= committed)
        out[b][verify] = case.slot_rows[buf, case.slot_tokens.shape[1] + 1 + (tokens[verify] - committed)]
    return out


def _positions_case(positions, top_k=64, seed=0, **options):
    from hisparse_sglang.testing.cases import make_positions_case

    options = dict(dict(page_size=8, miss_rate=0.4, overlap=0.5, resident_fraction=0.25, duplicate_fraction=0.03,
                        padding_fraction=0.02, out_of_range_fraction=0.01, num_real=4), **options)
    return make_positions_case(5, positions, top_k, positions * top_k, 16, seed=seed, **options)


@pytest.mark.parametrize("positions", [1, 2, 3, 4])
def test_one_group_of_every_position_is_the_union_as_before(positions):
    case = _positions_case(positions, seed=positions)
    before, counters_before = case.clone(), torch.zeros(2, dtype=torch.int64)
    expected = _union_of_every_position(before, counters_before)
    for group in (positions, None):  # None: positions_per_group, T here (64 entries per position fit easily)
        grouped, counters = case.clone(), torch.zeros(2, dtype=torch.int64)
        out = reference.swap_in_positions(*grouped.args(), counters=counters, group=group)
        assert torch.equal(out, expected)
        for name in ("slot_tokens", "slot_stamps", "token_slot", "device_kv"):
            assert torch.equal(getattr(grouped, name), getattr(before, name)), name
        assert torch.equal(counters, counters_before)
        assert int(counters[1]) == case.expected_misses


@pytest.mark.parametrize("positions,group", [(3, 1), (3, 2), (4, 1), (4, 2), (4, 3)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_groups_serve_the_right_kv_copy_each_group_once_and_keep_earlier_rows(positions, group, seed):
    from hisparse_sglang.testing.cases import union_misses

    case = _positions_case(positions, seed=100 * positions + 10 * group + seed)
    state, counters = case.clone(), torch.zeros(2, dtype=torch.int64)
    buffer_size = case.slot_tokens.shape[1]
    out = reference.swap_in_positions(*state.args(), counters=counters, group=group)
    changed = (state.device_kv != case.device_kv).any(dim=1)
    history_entries = 0
    for b in range(int(case.num_real_reqs[0])):
        req, committed = int(case.req_pool_indices[b]), int(case.seq_lens[b])
        buf = int(case.buffer_of_req[req])
        tokens = case.top_k[b].to(torch.int64)
        valid = (tokens >= 0) & (tokens <= committed + torch.arange(positions).reshape(-1, 1))
        history = valid & (tokens < committed - 1)
        if buf < 0:
            continue
        history_entries += int(history.sum())
        # Every history row returned, by any group, holds its token after the last group: its slot still names
        # the token, and its KV is the token's host row.
        rows = out[b][history].to(torch.int64)
        slot_of_row = {int(row): slot for slot, row in enumerate(case.slot_rows[buf, :buffer_size].tolist())}
        slots = torch.tensor([slot_of_row[int(row)] for row in rows])
        assert torch.equal(state.slot_tokens[buf, slots].to(torch.int64), tokens[history])
        host_rows = case.req_to_token[req, tokens[history]].to(torch.int64)
        assert torch.equal(state.device_kv[rows], case.host_kv[host_rows])
        # A token names one row in every position, whichever group served it.
        for token in torch.unique(tokens[history]).tolist():
            assert torch.unique(out[b][history & (tokens == token)]).numel() == 1, token
        verify = valid & (tokens >= committed)
        assert torch.equal(out[b][verify], case.slot_rows[buf, buffer_size + 1 + (tokens[verify] - committed)])
        assert bool((out[b][valid & (tokens == committed - 1)] == case.slot_rows[buf, buffer_size]).all())
    assert bool((out[int(case.num_real_reqs[0]):] == -1).all())
    # Lookups: every position's history entries, as in one group. Misses: one copy per device row written (no
    # row is written twice: a later group never takes an earlier group's row), at least the union's misses.
    assert int(counters[0]) == history_entries
    assert int(counters[1]) == int(changed.sum()) >= union_misses(case)
    # The same call in one group copies exactly the union's misses: a group can only add copies.
    single = torch.zeros(2, dtype=torch.int64)
    reference.swap_in_positions(*case.clone().args(), counters=single, group=positions)
    assert int(single[1]) == union_misses(case) <= int(counters[1]) and int(single[0]) == history_entries


def test_top_k_2048_with_three_and_four_positions_goes_one_position_per_group_by_default():
    from hisparse_sglang.ops.swap_in_plan import positions_per_group
    from hisparse_sglang.testing.cases import make_positions_case

    for positions in (3, 4):
        assert positions_per_group(positions, 2048, positions * 2048) == 1
        case = make_positions_case(2, positions, 2048, positions * 2048, 16, miss_rate=0.3, overlap=0.6,
                                   resident_fraction=0.0, seed=positions)
        by_default, one_each = case.clone(), case.clone()
        counters = [torch.zeros(2, dtype=torch.int64) for _ in range(2)]
        out = reference.swap_in_positions(*by_default.args(), counters=counters[0])
        assert torch.equal(out, reference.swap_in_positions(*one_each.args(), counters=counters[1], group=1))
        for name in ("slot_tokens", "slot_stamps", "token_slot", "device_kv"):
            assert torch.equal(getattr(by_default, name), getattr(one_each, name)), name
        assert torch.equal(counters[0], counters[1])
    assert positions_per_group(2, 2048, 4096) == 2  # T = 2 keeps one group


# ------------------------------------------------------------------------------------ bind / commit
def _bind(case, reqs, committed, num_positions, num_real=None):
    reference.bind_verify_slots(
        torch.tensor(reqs), torch.tensor(committed), torch.tensor([len(reqs) if num_real is None else num_real]),
        num_positions, case.req_to_token, case.device_row_of_loc, case.buffer_of_req, case.slot_rows, D,
    )


def test_bind_verify_slots_binds_offloaded_requests_only():
    case = Case()
    before = case.device_row_of_loc.clone()
    _bind(case, reqs=[0, 1], committed=[40, 40], num_positions=3)
    assert case.device_row_of_loc[1040:1043].tolist() == [61, 62, 63]
    changed = torch.nonzero(case.device_row_of_loc != before).reshape(-1).tolist()
    assert changed == [1040, 1041, 1042], "resident requests keep their page rows"
    padded = Case()
    _bind(padded, reqs=[0], committed=[40], num_positions=3, num_real=0)
    assert torch.equal(padded.device_row_of_loc, before)


def _commit(case, reqs, committed, accept_lens, num_positions, layers=None, num_real=None):
    device_layers, host_layers = layers or ([case.device], [case.host])
    reference.commit_accepted(
        torch.tensor(reqs), torch.tensor(committed), torch.tensor(accept_lens),
        torch.tensor([len(reqs) if num_real is None else num_real]), num_positions, case.req_to_token,
        case.device_row_of_loc, case.buffer_of_req, case.slot_rows, D, device_layers, host_layers,
    )


def test_commit_backs_up_exactly_the_accepted_tokens_and_moves_the_newest_to_slot_d():
    case = Case()
    _bind(case, reqs=[0, 1], committed=[40, 40], num_positions=3)
    device_layers = [torch.arange(400 * ITEM).remainder(241).to(torch.uint8).reshape(400, ITEM) + layer
                     for layer in range(2)]
    host_layers = [torch.full((3001, ITEM), 0xCD, dtype=torch.uint8) for _ in range(2)]
    originals = [layer.clone() for layer in device_layers]
    _commit(case, reqs=[0, 1], committed=[40, 40], accept_lens=[2, 3], num_positions=3,
            layers=(device_layers, host_layers))
    for layer, (device, host) in enumerate(zip(device_layers, host_layers)):
        assert torch.equal(host[1040], originals[layer][61]) and torch.equal(host[1041], originals[layer][62])
        assert torch.equal(host[[2040, 2041, 2042]], originals[layer][[340, 341, 342]])
        written = torch.nonzero((host != 0xCD).any(dim=1)).reshape(-1).tolist()
        assert written == [1040, 1041, 2040, 2041, 2042], "a rejected position's host row is never written"
        assert torch.equal(device[60], originals[layer][62]), "the newest accepted token moves to slot D"
        changed = torch.nonzero((device != originals[layer]).any(dim=1)).reshape(-1).tolist()
        assert changed == [60]


def test_commit_of_nothing_changes_nothing():
    case = Case()
    _bind(case, reqs=[0], committed=[40], num_positions=3)
    device, host = case.device.clone(), case.host.clone()
    _commit(case, reqs=[0, 1], committed=[40, 40], accept_lens=[0, 2], num_positions=3, num_real=1)
    assert torch.equal(case.device, device) and torch.equal(case.host, host)


def test_commit_refuses_an_accept_length_beyond_the_verify_positions():
    case = Case()
    with pytest.raises(ValueError, match="accept length 4"):
        _commit(case, reqs=[0], committed=[40], accept_lens=[4], num_positions=3)


# ------------------------------------------------------------------------------------ random verify steps
class SpecModel:
    """Two requests (slot 0 offloaded, slot 1 resident) over ``layers`` layers, run through random verify
    steps: bind, the forward's KV writes, the swap-in of every layer, random acceptance, commit. Every
    KV value ever written is unique, so a row read for the wrong token or version cannot match."""

    buffer_size, page, top_k, context = 16, 8, 4, 512
    layers = 2

    def __init__(self, seed: int, num_positions: int):
        self.rng = random.Random(seed)
        self.T = num_positions
        self.next_value = 1
        n_locs = 4000
        self.req_to_token = torch.zeros((2, self.context), dtype=torch.int32)
        self.req_to_token[0] = torch.arange(1000, 1000 + self.context, dtype=torch.int32)
        self.req_to_token[1] = torch.arange(2000, 2000 + self.context, dtype=torch.int32)
        self.device_row_of_loc = torch.zeros(n_locs + 1, dtype=torch.int32)
        self.device_row_of_loc[-1] = -1
        self.device_row_of_loc[2000:2000 + self.context] = torch.arange(100, 100 + self.context, dtype=torch.int32)
        self.buffer_of_req = torch.tensor([0, -1], dtype=torch.int32)
        self.slot_rows = torch.arange(20, 20 + self.buffer_size + self.page, dtype=torch.int32).reshape(1, -1)
        self.slot_tokens = torch.full((self.layers, 1, self.buffer_size), -1, dtype=torch.int32)
        self.stamps = torch.zeros((self.layers, 1, self.buffer_size), dtype=torch.int32)
        self.token_slot = torch.full((self.layers, 1, self.context + 1), -1, dtype=torch.int16)
        self.device = [torch.full((700, ITEM), POISON, dtype=torch.uint8) for _ in range(self.layers)]
        self.host = [torch.full((n_locs, ITEM), POISON, dtype=torch.uint8) for _ in range(self.layers)]
        self.counters = [torch.zeros(2, dtype=torch.int64) for _ in range(self.layers)]
        self.committed = [30, 30]
        # truth[layer][request][position]: the accepted KV of each committed position
        self.truth = [[{}, {}] for _ in range(self.layers)]
        for request in (0, 1):
            for position in range(30):
                for layer in range(self.layers):
                    self.truth[layer][request][position] = self.value()
                    loc = int(self.req_to_token[request, position])
                    self.host[layer][loc] = self.truth[layer][request][position]
                    if request == 1:
                        self.device[layer][int(self.device_row_of_loc[loc])] = self.truth[layer][request][position]
        # the offloaded request's buffer: slot D holds position 29, some LRU slots hold history
        for layer in range(self.layers):
            self.device[layer][int(self.slot_rows[0, self.buffer_size])] = self.truth[layer][0][29]
            for slot, token in enumerate(self.rng.sample(range(29), 6)):
                self.slot_tokens[layer, 0, slot] = token
                self.token_slot[layer, 0, token] = slot
                self.stamps[layer, 0, slot] = self.rng.randrange(30)
                self.device[layer][int(self.slot_rows[0, slot])] = self.truth[layer][0][token]

    def value(self) -> torch.Tensor:
        self.next_value += 1
        return torch.tensor(list(self.next_value.to_bytes(8, "little")) * (ITEM // 8), dtype=torch.uint8)

    def tables(self, layer):
        return SwapInTables(
            self.req_to_token, self.device_row_of_loc, self.buffer_of_req, self.slot_rows, self.slot_tokens[layer],
            self.stamps[layer], self.token_slot[layer], self.host[layer], self.device[layer],
        )

    def step(self):
        reqs, committed = torch.tensor([0, 1]), torch.tensor(self.committed)
        real = torch.tensor([2], dtype=torch.int32)
        reference.bind_verify_slots(reqs, committed, real, self.T, self.req_to_token, self.device_row_of_loc,
                                    self.buffer_of_req, self.slot_rows, self.buffer_size)
        written = [[{}, {}] for _ in range(self.layers)]  # what this verify forward writes, per position
        for request in (0, 1):
            for j in range(self.T):
                loc = int(self.req_to_token[request, self.committed[request] + j])
                position = self.committed[request] + j
                for layer in range(self.layers):
                    written[layer][request][position] = self.value()
                    self.device[layer][int(self.device_row_of_loc[loc])] = written[layer][request][position]
        for layer in range(self.layers):
            top_k = torch.tensor([[[self.entry(request, j) for _ in range(self.top_k)] for j in range(self.T)]
                                  for request in (0, 1)], dtype=torch.int32)
            before_tokens = self.slot_tokens[layer].clone()
            before_lru = self.device[layer][self.slot_rows[0, : self.buffer_size].long()].clone()
            before_counters = self.counters[layer].clone()
            out = reference.swap_in_positions(top_k, committed, reqs, real, self.tables(layer),
                                              counters=self.counters[layer])
            self.check_rows(layer, top_k, out, written)
            self.check_counts(layer, top_k[0], before_tokens, before_lru, before_counters)
        accept = [self.rng.randint(0, self.T) for _ in (0, 1)]
        reference.commit_accepted(reqs, committed, torch.tensor(accept), real, self.T, self.req_to_token,
                                  self.device_row_of_loc, self.buffer_of_req, self.slot_rows, self.buffer_size,
                                  self.device, self.host)
        for request in (0, 1):
            for position in range(self.committed[request], self.committed[request] + accept[request]):
                for layer in range(self.layers):
                    self.truth[layer][request][position] = written[layer][request][position]
            self.committed[request] += accept[request]
        self.check_host_and_slot_d()

    def entry(self, request, j):
        """A random top-k entry of query position j: history, newest accepted, verify token, or padding."""
        s = self.committed[request]
        kind = self.rng.random()
        if kind < 0.55:
            return self.rng.randrange(max(s - 1, 1))
        if kind < 0.65:
            return s - 1
        if kind < 0.85:
            return s + self.rng.randint(0, j)
        return self.rng.choice([-1, s + j + 1 + self.rng.randrange(3)])

    def check_rows(self, layer, top_k, out, written):
        for request in (0, 1):
            s = self.committed[request]
            for j in range(self.T):
                for k in range(self.top_k):
                    token = int(top_k[request, j, k])
                    row = int(out[request, j, k])
                    if token < 0 or token > s + j:
                        assert row == -1
                        continue
                    expected = self.truth[layer][request][token] if token < s else written[layer][request][token]
                    assert torch.equal(self.device[layer][row], expected), (layer, request, j, token)

    def check_counts(self, layer, offloaded_top_k, before_tokens, before_lru, before_counters):
        s = self.committed[0]
        history = {int(t) for t in offloaded_top_k.reshape(-1) if 0 <= int(t) < s - 1}
        lookups = sum(1 for t in offloaded_top_k.reshape(-1) if 0 <= int(t) < s - 1)
        misses = len(history - set(before_tokens.reshape(-1).tolist()))
        assert (self.counters[layer] - before_counters).tolist() == [lookups, misses]
        after_lru = self.device[layer][self.slot_rows[0, : self.buffer_size].long()]
        assert int((after_lru != before_lru).any(dim=1).sum()) == misses, "each distinct miss is copied once"

    def check_host_and_slot_d(self):
        for request in (0, 1):
            s = self.committed[request]
            locs = self.req_to_token[request].long()
            for layer in range(self.layers):
                for position in range(s):
                    assert torch.equal(self.host[layer][int(locs[position])], self.truth[layer][request][position])
                never_committed = self.host[layer][locs[s:]]
                assert bool((never_committed == POISON).all()), "a rejected token's KV reached its host row"
        for layer in range(self.layers):
            slot_d = self.device[layer][int(self.slot_rows[0, self.buffer_size])]
            assert torch.equal(slot_d, self.truth[layer][0][self.committed[0] - 1])


@pytest.mark.parametrize("seed", range(6))
def test_random_verify_steps_with_random_accept_lengths(seed):
    model = SpecModel(seed, num_positions=1 + seed % 4)
    for _ in range(40):
        model.step()
    assert model.committed[0] > 30 or model.T == 1


# ------------------------------------------------------------------------------ the fused top-k's page table
def test_verify_page_table_maps_resident_positions_to_their_rows_and_offloaded_ones_to_themselves():
    """Through the table, a fused top-k's ``table[i, p // P] * P + p % P`` is the device row of a resident
    request's position ``p`` (the allocator maps its pages whole) and ``p`` itself for an offloaded request."""
    from hisparse_sglang.memory.allocator import KVAllocator

    page, positions = 8, 3
    allocator = KVAllocator(host_pages=40, device_pages=20, page_size=page)
    lens = [5 * page + 3, 2 * page + 7, 3 * page]
    locs = allocator.alloc_extend(torch.zeros(3, dtype=torch.int64), torch.tensor(lens), torch.full((3,), -1))
    width = 6
    req_to_token = torch.zeros((5, width * page), dtype=torch.int32)
    slots = torch.tensor([3, 0, 4])
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    for slot, begin, end in zip(slots.tolist(), starts, starts[1:]):
        req_to_token[slot, : end - begin] = locs[begin:end].to(torch.int32)
    buffer_of_req = torch.tensor([0, -1, -1, -1, -1], dtype=torch.int32)  # slot 0 offloaded
    logical = (req_to_token[slots][:, ::page] // page).repeat_interleave(positions, dim=0)
    table = reference.verify_page_table(logical, slots, positions, buffer_of_req, allocator.device_row_of_loc, page)
    assert table.shape == logical.shape and table.dtype == torch.int32
    for row in range(3 * positions):
        b = row // positions
        p = torch.arange(lens[b])
        mapped = table[row, p // page].to(torch.int64) * page + p % page
        if int(slots[b]) == 0:
            assert torch.equal(mapped, p)
        else:
            want = allocator.translate(req_to_token[slots[b], : lens[b]]).to(torch.int64)
            assert bool((want > 0).all()) and torch.equal(mapped, want)
    # a resident request's page id outside the logical space maps to page 0, as an unmapped page does; an
    # offloaded request's column stays its index whatever the id
    logical[0, 1], logical[1, 2], logical[positions, 1] = -1, 10**6, -1
    table = reference.verify_page_table(logical, slots, positions, buffer_of_req, allocator.device_row_of_loc, page)
    assert int(table[0, 1]) == 0 and int(table[1, 2]) == 0 and int(table[positions, 1]) == 1
