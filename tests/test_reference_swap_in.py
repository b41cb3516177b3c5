"""The reference swap-in: every rule of its specification, on hand-made cases."""

import torch

from hisparse_sglang.ops import reference
from hisparse_sglang.ops.tables import SwapInTables

D = 4  # LRU slots
P = 4  # page size (reserved page: slot D is the newest token)
ITEM = 16


class Case:
    """One request slot with an offloaded buffer, one resident request slot, host/device rows."""

    def __init__(self, seq_len=40, slot_tokens=(10, 11, 12, 13), stamps=(30, 30, 30, 30)):
        self.seq_len = seq_len
        self.req_to_token = torch.zeros((3, 64), dtype=torch.int32)
        self.req_to_token[0] = torch.arange(1000, 1064, dtype=torch.int32)  # offloaded request: host row = 1000 + pos
        self.req_to_token[1] = torch.arange(2000, 2064, dtype=torch.int32)  # resident request
        self.device_row_of_loc = torch.zeros(3001, dtype=torch.int32)
        self.device_row_of_loc[-1] = -1
        self.device_row_of_loc[2000:2064] = torch.arange(300, 364, dtype=torch.int32)
        self.buffer_of_req = torch.tensor([0, -1, -1], dtype=torch.int32)
        self.slot_rows = torch.tensor([[50, 51, 52, 53, 60, 61, 62, 63]], dtype=torch.int32)
        self.slot_tokens = torch.tensor([list(slot_tokens)], dtype=torch.int32)
        self.stamps = torch.tensor([list(stamps)], dtype=torch.int32)
        self.token_slot = torch.full((1, 64), -1, dtype=torch.int16)
        for slot, token in enumerate(slot_tokens):
            if token >= 0:
                self.token_slot[0, token] = slot
        self.host = torch.arange(3001 * ITEM, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(3001, ITEM)
        self.device = torch.full((400, ITEM), 0xAB, dtype=torch.uint8)  # poison
        self.counters = torch.zeros(2, dtype=torch.int64)

    def run(self, top_k, reqs=(0,), seq_lens=None, num_real=None):
        top_k = torch.tensor(top_k, dtype=torch.int32).reshape(len(reqs), -1)
        seq_lens = torch.tensor(seq_lens or [self.seq_len] * len(reqs), dtype=torch.int64)
        num_real = torch.tensor([len(reqs) if num_real is None else num_real], dtype=torch.int32)
        out = torch.full(top_k.shape, 12345, dtype=torch.int32)  # sentinel
        tables = SwapInTables(
            self.req_to_token, self.device_row_of_loc, self.buffer_of_req, self.slot_rows, self.slot_tokens,
            self.stamps, self.token_slot, self.host, self.device,
        )
        result = reference.swap_in(
            top_k, seq_lens, torch.tensor(reqs, dtype=torch.int64), num_real, tables, out=out, counters=self.counters
        )
        self.check_map()
        return result

    def check_map(self):
        expected = torch.full_like(self.token_slot, -1)
        for slot, token in enumerate(self.slot_tokens[0].tolist()):
            if token >= 0:
                expected[0, token] = slot
        assert torch.equal(self.token_slot, expected), "token -> slot map is not the inverse of the slots"


def test_resident_request_translates_positions():
    case = Case()
    out = case.run([5, -1, 63, 39, 40], reqs=(1,))
    assert out.tolist() == [[305, -1, -1, 339, -1]]  # 63 and 40 are >= seq_len 40: padding
    assert case.counters.tolist() == [0, 0]
    assert bool((case.device == 0xAB).all())


def test_newest_token_maps_to_reserved_slot_every_time():
    case = Case()
    out = case.run([39, 11, 39, -1])
    assert out.tolist() == [[60, 51, 60, -1]]
    assert case.slot_tokens.tolist() == [[10, 11, 12, 13]]


def test_hits_keep_their_slot_and_take_the_current_stamp():
    case = Case()
    out = case.run([11, 13, 39, -1, 13])
    assert out.tolist() == [[51, 53, 60, -1, 53]]
    assert case.stamps.tolist() == [[30, 40, 30, 40]]
    assert case.counters.tolist() == [3, 0]  # every valid non-newest entry is a lookup
    assert bool((case.device == 0xAB).all()), "a hit must not copy"


def test_misses_evict_the_least_recently_used_slots_in_first_occurrence_order():
    case = Case(stamps=(35, 20, 33, 20))
    out = case.run([21, 11, 20, 39])
    # hit: 11 (slot 1). Not hit: slots 0 (age 5), 2 (age 7), 3 (age 20). Two misses take the two
    # oldest: slot 3 (older than the youngest victim's age 7) first, then slot 2; the misses in
    # first-occurrence order are 21, 20.
    assert out.tolist() == [[53, 51, 52, 60]]
    assert case.slot_tokens.tolist() == [[10, 11, 20, 21]]
    assert case.stamps.tolist() == [[35, 40, 40, 40]]
    assert torch.equal(case.device[53], case.host[1021])
    assert torch.equal(case.device[52], case.host[1020])
    untouched = torch.ones(400, dtype=torch.bool)
    untouched[[52, 53]] = False
    assert bool((case.device[untouched] == 0xAB).all()), "only evicted slots' rows may be written"
    assert case.counters.tolist() == [3, 2]


def test_equal_ages_evict_lower_slots_first_and_older_victims_come_first():
    case = Case(stamps=(30, 25, 30, 30))
    out = case.run([5, 6, 7])
    # ages 10, 15, 10, 10: victims slot 1 (older), then slots 0 and 2 (age 10, lower slots first)
    assert out.tolist() == [[51, 50, 52]]
    assert case.slot_tokens.tolist() == [[6, 5, 7, 13]]


def test_ages_are_capped():
    far = reference.AGE_CAP + 100
    case = Case(seq_len=far + 50, stamps=(40, 10, 30, 60))
    case.req_to_token = torch.zeros((3, far + 64), dtype=torch.int32)
    case.req_to_token[0, :64] = torch.arange(1000, 1064, dtype=torch.int32)
    case.token_slot = torch.full((1, far + 64), -1, dtype=torch.int16)
    case.token_slot[0, 10:14] = torch.arange(4, dtype=torch.int16)
    out = case.run([5])
    # every age exceeds AGE_CAP: all count as equally old, the lowest slot goes
    assert out.tolist() == [[50]]
    assert case.slot_tokens.tolist() == [[5, 11, 12, 13]]


def test_a_stamp_ahead_of_the_request_counts_as_age_zero():
    case = Case(stamps=(45, 39, 50, 38))
    case.run([5, 6])
    # ages 0 (clamped), 1, 0 (clamped), 2: victims 3 (age 2) then 1 (age 1, the youngest victim)
    assert case.slot_tokens.tolist() == [[10, 6, 12, 5]]


def test_duplicates_collapse_into_one_copy():
    case = Case()
    out = case.run([20, 20, 11, 20])
    assert out.tolist() == [[50, 50, 51, 50]]
    assert case.counters.tolist() == [4, 1]
    assert case.slot_tokens.tolist() == [[20, 11, 12, 13]]


def test_empty_slots_are_slots_like_any_other():
    case = Case(slot_tokens=(-1, 11, -1, -1), stamps=(0, 0, 0, 0))
    out = case.run([5, 6, 11, 7])
    assert out.tolist() == [[50, 52, 51, 53]]
    assert case.slot_tokens.tolist() == [[5, 11, 6, 7]]
    assert case.stamps.tolist() == [[40, 40, 40, 40]]


def test_all_misses_replace_every_slot():
    case = Case()
    out = case.run([30, 31, 32, 33])
    assert out.tolist() == [[50, 51, 52, 53]]
    assert case.slot_tokens.tolist() == [[30, 31, 32, 33]]


def test_padded_batch_rows_output_minus_one_and_change_nothing():
    case = Case()
    out = case.run([30, 31, 32, 33, 5, 6, 7, 8], reqs=(0, 1), num_real=1)
    assert out[1].tolist() == [-1, -1, -1, -1]
    assert out[0].tolist() == [50, 51, 52, 53]
    case2 = Case()
    out2 = case2.run([30, 31, 32, 33], num_real=0)
    assert out2.tolist() == [[-1, -1, -1, -1]]
    assert case2.slot_tokens.tolist() == [[10, 11, 12, 13]] and bool((case2.device == 0xAB).all())
    assert case2.stamps.tolist() == [[30, 30, 30, 30]]


def test_mixed_batch_resident_and_offloaded():
    case = Case()
    out = case.run([12, 39, -1, 3, 0, 1, 2, 3], reqs=(0, 1))
    # token 3 misses and takes the lowest of the equally old slots not hit (slot 0)
    assert out.tolist() == [[52, 60, -1, 50], [300, 301, 302, 303]]


def test_copy_rows_covers_every_layer():
    device_layers = [torch.arange(80, dtype=torch.int32).reshape(20, 4) + 100 * layer for layer in range(3)]
    host_layers = [torch.full((30, 4), -7, dtype=torch.int32) for _ in range(3)]
    reference.copy_rows(device_layers, host_layers, torch.tensor([4, 9]), torch.tensor([25, 3]))
    for layer in range(3):
        assert torch.equal(host_layers[layer][25], device_layers[layer][4])
        assert torch.equal(host_layers[layer][3], device_layers[layer][9])
        assert int((host_layers[layer] == -7).all(dim=1).sum()) == 28


def test_backup_newest_copies_each_real_rows_newest_token_only():
    case = Case()
    case.device = torch.arange(400 * ITEM, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(400, ITEM)
    case.device_row_of_loc[1039] = 60  # the offloaded request's newest token sits in slot D
    host = torch.full((3001, ITEM), 0xCD, dtype=torch.uint8)  # poison
    # rows: offloaded request (newest position 39), resident request (newest 5), a padding row
    reference.backup_newest(
        torch.tensor([0, 1, 2]), torch.tensor([40, 6, 9]), torch.tensor([2], dtype=torch.int32),
        case.req_to_token, case.device_row_of_loc, case.device, host,
    )
    assert torch.equal(host[1039], case.device[60])
    assert torch.equal(host[2005], case.device[305])
    untouched = torch.ones(3001, dtype=torch.bool)
    untouched[[1039, 2005]] = False
    assert bool((host[untouched] == 0xCD).all()), "only the real rows' newest tokens are written"


def test_backup_newest_skips_tokens_without_a_device_row():
    case = Case()
    host = torch.full((3001, ITEM), 0xCD, dtype=torch.uint8)
    # position 20 of the offloaded request is not on the GPU (device_row_of_loc 0)
    reference.backup_newest(
        torch.tensor([0]), torch.tensor([21]), torch.tensor([1], dtype=torch.int32),
        case.req_to_token, case.device_row_of_loc, case.device, host,
    )
    assert bool((host == 0xCD).all())


def test_bind_rows_by_kind():
    case = Case()
    new_locs = torch.tensor([1040, 2030, 2032], dtype=torch.int64)
    # batch row 0: offloaded -> slot D of its buffer; batch row 2: a resident request starting a
    # page at location 2032 -> the whole logical page maps to device page new_pages[1]; batch row 1
    # (a resident request continuing its page) needs no entry
    plan = torch.tensor([[0, 2], [0, 1], [reference.BIND_BUFFER_SLOT, 1]])
    case.device_row_of_loc[2032:2036] = 0  # the new page is not mapped yet
    table = case.device_row_of_loc.clone()
    reference.bind_rows(plan, new_locs, torch.tensor([7, 9]), table, case.buffer_of_req, case.slot_rows, D, P)
    assert table[1040].item() == 60
    assert table[2032:2036].tolist() == [9 * P, 9 * P + 1, 9 * P + 2, 9 * P + 3]
    changed = (table != case.device_row_of_loc).nonzero().flatten().tolist()
    assert changed == [1040, 2032, 2033, 2034, 2035]
