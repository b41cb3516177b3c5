"""The reference swap-in: every rule of its specification, on hand-made cases."""

import torch

from hisparse_sglang.ops import reference

D = 4  # LRU slots
P = 4  # page size (reserved page: slot D is the newest token)
ITEM = 16


class Case:
    """One request slot with an offloaded buffer, one resident request slot, host/device rows."""

    def __init__(self, seq_len=40, slot_tokens=(10, 11, 12, 13)):
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
        self.lru = torch.arange(D, dtype=torch.int16).reshape(1, D).clone()
        self.host = torch.arange(3001 * ITEM, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(3001, ITEM)
        self.device = torch.full((400, ITEM), 0xAB, dtype=torch.uint8)  # poison
        self.counters = torch.zeros(2, dtype=torch.int64)

    def run(self, top_k, reqs=(0,), seq_lens=None, num_real=None):
        top_k = torch.tensor(top_k, dtype=torch.int32).reshape(len(reqs), -1)
        seq_lens = torch.tensor(seq_lens or [self.seq_len] * len(reqs), dtype=torch.int64)
        num_real = torch.tensor([len(reqs) if num_real is None else num_real], dtype=torch.int32)
        out = torch.full(top_k.shape, 12345, dtype=torch.int32)  # sentinel
        return reference.swap_in(
            top_k, seq_lens, torch.tensor(reqs, dtype=torch.int64), num_real, self.req_to_token,
            self.device_row_of_loc, self.buffer_of_req, self.slot_rows, self.slot_tokens, self.lru,
            self.host, self.device, out=out, counters=self.counters,
        )


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


def test_hits_keep_their_slot_and_become_most_recent():
    case = Case()
    out = case.run([11, 13, 39, -1])
    assert out.tolist() == [[51, 53, 60, -1]]
    assert case.lru.tolist() == [[0, 2, 1, 3]]
    assert case.counters.tolist() == [2, 0]
    assert bool((case.device == 0xAB).all()), "a hit must not copy"


def test_misses_take_least_recently_used_slots_in_first_occurrence_order():
    case = Case()
    case.lru[0] = torch.tensor([2, 0, 3, 1], dtype=torch.int16)
    out = case.run([21, 11, 20, 39])
    # hit: 11 (slot 1). misses in first-occurrence order: 21, 20 -> evictable LRU slots 2, 0
    assert out.tolist() == [[52, 51, 50, 60]]
    assert case.slot_tokens.tolist() == [[20, 11, 21, 13]]
    # unused evictable (3), then miss slots (2, 0), then hits (1)
    assert case.lru.tolist() == [[3, 2, 0, 1]]
    assert torch.equal(case.device[52], case.host[1021])
    assert torch.equal(case.device[50], case.host[1020])
    untouched = torch.ones(400, dtype=torch.bool)
    untouched[[50, 52]] = False
    assert bool((case.device[untouched] == 0xAB).all()), "only evicted slots' rows may be written"
    assert case.counters.tolist() == [3, 2]


def test_duplicates_collapse_into_one_copy():
    case = Case()
    out = case.run([20, 20, 11, 20])
    assert out.tolist() == [[50, 50, 51, 50]]
    assert case.counters.tolist() == [2, 1]
    assert case.slot_tokens.tolist() == [[20, 11, 12, 13]]


def test_empty_slots_are_evicted_in_lru_order():
    case = Case(slot_tokens=(-1, 11, -1, -1))
    case.lru[0] = torch.tensor([3, 1, 0, 2], dtype=torch.int16)
    out = case.run([5, 6, 11, 7])
    assert out.tolist() == [[53, 50, 51, 52]]
    assert case.slot_tokens.tolist() == [[6, 11, 7, 5]]
    assert case.lru.tolist() == [[3, 0, 2, 1]]


def test_all_misses_replace_every_slot():
    case = Case()
    out = case.run([30, 31, 32, 33])
    assert out.tolist() == [[50, 51, 52, 53]]
    assert case.slot_tokens.tolist() == [[30, 31, 32, 33]]
    assert case.lru.tolist() == [[0, 1, 2, 3]]


def test_padded_batch_rows_output_minus_one_and_change_nothing():
    case = Case()
    out = case.run([30, 31, 32, 33, 5, 6, 7, 8], reqs=(0, 1), num_real=1)
    assert out[1].tolist() == [-1, -1, -1, -1]
    assert out[0].tolist() == [50, 51, 52, 53]
    case2 = Case()
    out2 = case2.run([30, 31, 32, 33], num_real=0)
    assert out2.tolist() == [[-1, -1, -1, -1]]
    assert case2.slot_tokens.tolist() == [[10, 11, 12, 13]] and bool((case2.device == 0xAB).all())


def test_mixed_batch_resident_and_offloaded():
    case = Case()
    out = case.run([12, 39, -1, 3, 0, 1, 2, 3], reqs=(0, 1))
    # token 3 misses and takes the least recently used slot not hit (slot 0)
    assert out.tolist() == [[52, 60, -1, 50], [300, 301, 302, 303]]


def test_copy_rows_and_eager_backup_cover_every_layer():
    device_layers = [torch.arange(80, dtype=torch.int32).reshape(20, 4) + 100 * layer for layer in range(3)]
    host_layers = [torch.full((30, 4), -7, dtype=torch.int32) for _ in range(3)]
    reference.eager_backup(device_layers, host_layers, torch.tensor([4, 9]), torch.tensor([25, 3]))
    for layer in range(3):
        assert torch.equal(host_layers[layer][25], device_layers[layer][4])
        assert torch.equal(host_layers[layer][3], device_layers[layer][9])
        assert int((host_layers[layer] == -7).all(dim=1).sum()) == 28
