"""One representative swap-in and copy for compute-sanitizer (memcheck, racecheck); exits 1 on a mismatch.

    compute-sanitizer --tool memcheck python tests/gpu/sanitize_swap_in.py
"""

import sys

import torch

from hisparse_sglang.ops import reference
from hisparse_sglang.ops import swap_in as ops
from hisparse_sglang.ops.cases import make_case


def main() -> int:
    case = make_case(
        3, 2048, 4096, 1152, miss_rate=0.3, duplicate_fraction=0.02, padding_fraction=0.01,
        out_of_range_fraction=0.01, resident_fraction=0.34, num_real=3, seed=42,
    )
    expected = case.clone()
    expected_out = reference.swap_in(*expected.args())
    for splits, late_copiers_ns in ((1, 0), (4, 0), (17, 0), (4, 20_000)):
        actual = case.clone(device="cuda", pin_host=True)
        out = ops.swap_in(*actual.args(), splits=splits, late_copiers_ns=late_copiers_ns)
        host = [actual.host_kv]
        device = [actual.device_kv]
        rows = torch.arange(64, 96, device="cuda")
        ops.copy_rows(device, host, rows, rows + 1000)
        torch.cuda.synchronize()
        for name, want, got in (
            ("out", expected_out, out),
            ("slot_tokens", expected.slot_tokens, actual.slot_tokens),
            ("slot_stamps", expected.slot_stamps, actual.slot_stamps),
            ("token_slot", expected.token_slot, actual.token_slot),
            ("device_kv", expected.device_kv, actual.device_kv),
        ):
            if not torch.equal(want, got.cpu()):
                print(f"MISMATCH splits={splits} late_copiers_ns={late_copiers_ns}: {name}")
                return 1
    print("sanitize case: outputs match the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
