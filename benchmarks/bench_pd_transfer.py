"""PD transfer benchmark: a request's KV written page by page into a decode's host pool vs one large write.

One run starts a decode receiver (``hisparse_sglang.transfer.Receiver``) in a child process and
writes into it from this process through ``hisparse_sglang.transfer`` (Mooncake; the same engine,
peer and link for every row of the table):

* scattered pages: the request's source pages are shuffled (as a prefill's page table leaves
  them), so every page of every layer is its own entry: ``layers x pages`` entries of
  ``page_size x row_bytes`` bytes, in batches of at most ``--max-batch-entries``;
* page runs: the same request with consecutive source pages; each layer merges into one entry;
* one contiguous write: the same number of bytes as a single entry (the link's large-write rate).

Each mode is timed ``--repeats`` times (median shown); the decode checks the bytes it received
(per-layer checksums) once per mode. Prints a table; ``--json PATH`` also writes the numbers.

    python benchmarks/bench_pd_transfer.py                    # 32K tokens x 61 layers x 1152 B (2.3 GB; ~7 GB RAM)
    python benchmarks/bench_pd_transfer.py --quick            # 8K tokens x 8 layers (75 MB), seconds
    python benchmarks/bench_pd_transfer.py --row-bytes 656    # fp8 DSA rows
    python benchmarks/bench_pd_transfer.py --protocol rdma --hostname 10.0.0.1 --device mlx5_0
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from hisparse_sglang.memory import HostKVPool  # noqa: E402
from hisparse_sglang.transfer import KVSource, Receiver, Sender  # noqa: E402


def fill_pattern(words: torch.Tensor, salt: int, chunk_rows: int = 1 << 16) -> None:
    """Distinct int64 words: row index, column and salt in every word of ``[rows, columns]`` (in chunks)."""
    columns = torch.arange(words.shape[1], dtype=torch.int64)[None, :] * 7 + salt * 1_000_000_007
    for start in range(0, words.shape[0], chunk_rows):
        rows = torch.arange(start, min(start + chunk_rows, words.shape[0]), dtype=torch.int64)[:, None]
        words[start : start + chunk_rows].copy_(rows * 1_000_003 + columns)


def checksum(rows: torch.Tensor) -> int:
    """Order-sensitive checksum of uint8 ``[n, row_bytes]`` rows (row_bytes a multiple of 8)."""
    per_row = rows.contiguous().view(torch.int64).sum(dim=1)
    return int((per_row * torch.arange(1, per_row.numel() + 1, dtype=torch.int64)).sum())


# ---------------------------------------------------------------------- decode child
def decode_main(args) -> None:
    pages = (args.tokens + args.page_size - 1) // args.page_size
    pool = HostKVPool(args.layers, (pages + 1) * args.page_size, args.row_bytes, pin=False)
    receiver = Receiver(pool, args.page_size, hostname=args.hostname, protocol=args.protocol, device=args.device)
    total = args.layers * args.tokens * args.row_bytes
    contiguous = torch.zeros(total, dtype=torch.uint8)
    receiver.engine.register_regions([contiguous.data_ptr()], [total])
    print(json.dumps({"control": receiver.control_address, "contiguous": contiguous.data_ptr()}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "checksum":
            outcome = receiver.wait(command["request_id"], timeout_s=60)
            sums = None
            if outcome.ok:
                sums = [checksum(pool.read_rows(layer, outcome.rows)) for layer in range(args.layers)]
            reply = {"ok": outcome.ok, "sums": sums, "error": None if outcome.ok else str(outcome.error)}
        elif command["cmd"] == "release":
            receiver.release(command["request_id"])
            reply = {"ok": True}
        else:
            reply = {"sum": checksum(contiguous.view(-1, args.row_bytes))}
        print(json.dumps(reply), flush=True)
    receiver.close()


# ---------------------------------------------------------------------- prefill side (this process)
class Decode:
    """The decode child and its one-line JSON commands."""

    def __init__(self, argv: list[str]) -> None:
        env = dict(os.environ)
        env.setdefault("MC_LOG_LEVEL", "ERROR")
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--role", "decode", *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env,
        )
        self.peer = json.loads(self.process.stdout.readline())

    def ask(self, command: dict) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=120)


def measure(
    args, decode: Decode, connection, source: torch.Tensor, mode: str, src_pages: torch.Tensor, counter: list
) -> dict:
    """Transfer the request ``--repeats`` times from ``src_pages``; check the bytes once."""
    times, stats = [], None
    for repeat in range(args.repeats):
        counter[0] += 1
        request_id = f"req-{counter[0]}"
        grant = connection.request(request_id, args.tokens)
        stats = connection.write(grant, src_pages)
        connection.done(grant)
        times.append(stats.seconds)
        if repeat == args.repeats - 1:
            reply = decode.ask({"cmd": "checksum", "request_id": request_id})
            page, tokens = args.page_size, torch.arange(args.tokens)
            rows = src_pages[tokens // page] * page + tokens % page
            expected = [checksum(source[layer][rows]) for layer in range(args.layers)]
            if not reply["ok"] or reply["sums"] != expected:
                raise SystemExit(f"{mode}: the decode received different bytes ({reply})")
        decode.ask({"cmd": "release", "request_id": request_id})
    return row(mode, stats, times)


def row(mode: str, stats, times: list[float]) -> dict:
    seconds = statistics.median(times)
    return {
        "mode": mode, "bytes": stats.bytes, "entries": stats.entries, "merged_entries": stats.merged_entries,
        "batches": stats.batches, "seconds": seconds, "seconds_all": times, "gbps": stats.bytes / seconds / 1e9,
    }


def print_table(args, results: list[dict]) -> None:
    reference = results[-1]["gbps"]
    print("| mode | bytes | entries | after merging | batches | median s | GB/s | vs contiguous |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['mode']} | {r['bytes']:,} | {r['entries']:,} | {r['merged_entries']:,} | {r['batches']} | "
            f"{r['seconds']:.3f} | {r['gbps']:.3f} | {r['gbps'] / reference:.2f} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help="default 32768 (8192 with --quick)")
    parser.add_argument("--layers", type=int, default=None, help="default 61, DeepSeek-V3.2 (8 with --quick)")
    parser.add_argument("--row-bytes", type=int, default=1152, help="1152 (bf16 MLA) or 656 (fp8 DSA)")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a small request for a quick check on a small box")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-batch-entries", type=int, default=1024)
    parser.add_argument("--max-inflight-batches", type=int, default=2)
    parser.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"])
    parser.add_argument("--hostname", default="127.0.0.1")
    parser.add_argument("--device", default="")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--role", default="prefill", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.tokens = args.tokens or (8192 if args.quick else 32768)
    args.layers = args.layers or (8 if args.quick else 61)
    if args.role == "decode":
        decode_main(args)
        return 0
    child_argv = [
        "--tokens", str(args.tokens), "--layers", str(args.layers), "--row-bytes", str(args.row_bytes),
        "--page-size", str(args.page_size), "--protocol", args.protocol, "--hostname", args.hostname,
        "--device", args.device,
    ]
    pages = (args.tokens + args.page_size - 1) // args.page_size
    total = args.layers * args.tokens * args.row_bytes
    link = (
        f"Mooncake {args.protocol} {args.hostname}"
        + (" -- TCP loopback, both processes on this host's CPUs: NOT RDMA; compare the rows, not the GB/s, with a NIC"
           if args.protocol == "tcp" else "")
    )
    print(
        f"# {link}\n# host {platform.node()}, {os.cpu_count()} CPUs; "
        f"request {args.tokens} tokens x {args.layers} layers "
        f"x {args.row_bytes} B = {total:,} B ({pages} pages of {args.page_size} per layer); batches <= "
        f"{args.max_batch_entries} entries, {args.max_inflight_batches} in flight; median of {args.repeats}",
        flush=True,
    )
    decode = Decode(child_argv)
    try:
        # one tensor for every layer: the whole source is contiguous, so it also feeds the large write
        source = torch.empty(args.layers, pages * args.page_size, args.row_bytes, dtype=torch.uint8)
        fill_pattern(source.view(-1, args.row_bytes).view(torch.int64), salt=1)
        layer_bytes = pages * args.page_size * args.row_bytes
        kv = KVSource(tuple(source.data_ptr() + layer * layer_bytes for layer in range(args.layers)),
                      pages * args.page_size, args.row_bytes, args.page_size)
        sender = Sender(kv, hostname=args.hostname, protocol=args.protocol, device=args.device,
                        max_batch_entries=args.max_batch_entries, max_inflight_batches=args.max_inflight_batches)
        connection = sender.connect(decode.peer["control"])
        counter = [0]
        # untimed first: the Mooncake handshake and the first touch of both pools' pages
        once = argparse.Namespace(**{**vars(args), "repeats": 1})
        measure(once, decode, connection, source, "warm-up", torch.arange(pages), counter)
        shuffled = torch.randperm(pages, generator=torch.Generator().manual_seed(args.seed))
        results = [
            measure(args, decode, connection, source, "scattered pages", shuffled, counter),
            measure(args, decode, connection, source, "page runs", torch.arange(pages), counter),
        ]
        engine = sender.engine_for(connection.session_id)
        times = []
        for _ in range(args.repeats):
            stats = engine.write(connection.session_id, [source.data_ptr()], [decode.peer["contiguous"]], [total])
            times.append(stats.seconds)
        expected = checksum(source.view(-1)[:total].view(-1, args.row_bytes))
        if decode.ask({"cmd": "checksum_contiguous"})["sum"] != expected:
            raise SystemExit("contiguous write: the decode received different bytes")
        results.append(row("one contiguous write", stats, times))
        sender.close()
        decode.close()
    finally:
        if decode.process.poll() is None:
            decode.process.kill()
    print_table(args, results)
    print(f"# scattered / contiguous = {results[0]['gbps'] / results[-1]['gbps']:.2f}")
    if args.json:
        document = {
            "date": time.strftime("%Y-%m-%d"), "host": platform.node(), "cpus": os.cpu_count(), "link": link,
            "tokens": args.tokens, "layers": args.layers, "row_bytes": args.row_bytes, "page_size": args.page_size,
            "repeats": args.repeats, "max_batch_entries": args.max_batch_entries,
            "max_inflight_batches": args.max_inflight_batches, "torch": torch.__version__, "results": results,
        }
        pathlib.Path(args.json).write_text(json.dumps(document, indent=1))
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
