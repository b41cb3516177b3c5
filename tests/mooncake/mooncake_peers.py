"""Prefill writer and decode receiver processes for the Mooncake tests, and their shared test data.

Run as a script it plays one side in its own process (it kills itself after ``--max-seconds``):

    python mooncake_peers.py write --control HOST:PORT --layers 4 --row-bytes 1152 --requests '[...]'
    python mooncake_peers.py serve --layers 4 --row-bytes 1152 --pages 64        (JSON commands on stdin)

Every row written is unique: its first 16 bytes are (seed, layer, token, magic) as int32 and the
rest a pattern of the same values, so a row in the wrong place or of the wrong request cannot
match by luck. Rows nobody may write hold POISON.

A writer request spec is ``{"id", "seed", "tokens"}`` plus optional ``layers``, ``row_bytes``
(another source shape), ``session`` (a Mooncake session to write to instead of the layout's),
``after_stdin`` (wait for a line on stdin first), ``timeout`` and ``fault``: ``kill-mid`` /
``stop-mid`` (write half the layers, then SIGKILL / SIGSTOP itself) or ``late-done`` (write
everything, sleep ``delay`` seconds, then report done).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import torch

from hisparse_sglang.memory import HostKVPool
from hisparse_sglang.transfer import KVSource, Receiver, Sender, TransferError

POISON = 0xA5
SOURCE_FILL = 0x3C
MAGIC = 0x5EED
CHILD_MAX_SECONDS = 120


def request_rows(seed: int, layer_num: int, num_tokens: int, row_bytes: int) -> torch.Tensor:
    """uint8 ``[layer_num, num_tokens, row_bytes]``, unique per (seed, layer, token)."""
    layer = torch.arange(layer_num, dtype=torch.int64)[:, None, None]
    token = torch.arange(num_tokens, dtype=torch.int64)[None, :, None]
    byte = torch.arange(row_bytes, dtype=torch.int64)[None, None, :]
    rows = ((byte * 7 + seed * 131 + layer * 31 + token * 17) % 251).to(torch.uint8)
    header = torch.empty(layer_num, num_tokens, 4, dtype=torch.int32)
    header[..., 0] = seed
    header[..., 1] = layer[..., 0].to(torch.int32)
    header[..., 2] = token[..., 0].to(torch.int32)
    header[..., 3] = MAGIC
    rows[..., :16] = header.view(torch.uint8).reshape(layer_num, num_tokens, 16)
    return rows


def build_source(specs: list[dict], layer_num: int, row_bytes: int, page_size: int, shuffle_seed: int = 0):
    """A source pool holding every request of ``specs`` on scattered pages; returns (pool, {id: src_pages})."""
    pages_needed = [(spec["tokens"] + page_size - 1) // page_size for spec in specs]
    num_pages = 2 * sum(pages_needed) + 4
    pool = HostKVPool(layer_num, num_pages * page_size, row_bytes, pin=False)
    for layer in pool.layers:
        layer.fill_(SOURCE_FILL)
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
    src_pages, cursor = {}, 0
    for spec, count in zip(specs, pages_needed):
        pages = order[cursor : cursor + count]
        cursor += count
        src_pages[spec["id"]] = pages
        rows = torch.tensor([pages[t // page_size] * page_size + t % page_size for t in range(spec["tokens"])])
        data = request_rows(spec["seed"], layer_num, spec["tokens"], row_bytes)
        for layer_id in range(layer_num):
            pool.layers[layer_id][rows] = data[layer_id]
    return pool, src_pages


def untouched_are_poisoned(pool: HostKVPool, written_rows: set[int]) -> bool:
    """Every row outside ``written_rows`` still holds POISON in every layer."""
    untouched = torch.ones(pool.num_rows, dtype=torch.bool)
    if written_rows:
        untouched[torch.tensor(sorted(written_rows))] = False
    return all(bool((layer[untouched] == POISON).all()) for layer in pool.layers)


def first_difference(pool: HostKVPool, rows: torch.Tensor, expected: torch.Tensor) -> dict | None:
    """None if every layer's ``rows`` equal ``expected`` ``[layers, n, row_bytes]``, else the first difference."""
    for layer_id in range(pool.layer_num):
        actual = pool.read_rows(layer_id, rows)
        if not torch.equal(actual, expected[layer_id]):
            token, byte = (actual != expected[layer_id]).nonzero()[0].tolist()
            return {"layer": layer_id, "token": token, "byte": byte}
    return None


def wait_for(predicate, timeout_s: float) -> None:
    """Poll ``predicate`` until it holds; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s} s")
        time.sleep(0.02)


class DecodeHarness:
    """A Receiver on a poisoned pool, with the checks the tests need."""

    def __init__(self, layer_num: int, row_bytes: int, num_pages: int, page_size: int = 64, **receiver_args) -> None:
        self.pool = HostKVPool(layer_num, num_pages * page_size, row_bytes, pin=False)
        for layer in self.pool.layers:
            layer.fill_(POISON)
        self.receiver = Receiver(self.pool, page_size, **receiver_args)
        self.outcomes: dict = {}
        self.written_rows: set[int] = set()  # every row any grant ever covered

    def collect(self) -> None:
        for outcome in self.receiver.poll():
            self.outcomes[outcome.request_id] = outcome
            self.written_rows.update(outcome.rows.tolist())

    def wait(self, ids: list[str], timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            self.collect()
            if all(request_id in self.outcomes for request_id in ids):
                return {request_id: self.outcomes[request_id] for request_id in ids}
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests {ids} not all finished after {timeout_s} s: {self.receiver.stats()}")
            time.sleep(0.02)

    def summary(self, ids: list[str]) -> dict:
        self.collect()
        out = {}
        for request_id in ids:
            outcome = self.outcomes.get(request_id)
            out[request_id] = {"status": "open"} if outcome is None else {
                "status": outcome.status,
                "error_type": None if outcome.error is None else type(outcome.error).__name__,
                "message": None if outcome.error is None else str(outcome.error),
            }
        return out

    def verify(self, specs: list[dict]) -> dict:
        """Completed requests hold exactly their rows; every row no grant covered is still POISON."""
        self.collect()
        report = {"bytes_ok": {}, "first_difference": {}}
        for spec in specs:
            outcome = self.outcomes[spec["id"]]
            expected = request_rows(spec["seed"], self.pool.layer_num, spec["tokens"], self.pool.item_bytes)
            difference = first_difference(self.pool, outcome.rows, expected) if outcome.ok else "not completed"
            report["bytes_ok"][spec["id"]] = difference is None and outcome.rows.numel() == spec["tokens"]
            if difference is not None:
                report["first_difference"][spec["id"]] = difference
        report["untouched_poisoned"] = untouched_are_poisoned(self.pool, self.written_rows)
        return report

    def close(self) -> None:
        self.receiver.close()


class Child:
    """A peer process whose stdout JSON lines are read by a thread, so every read has a timeout."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, MC_LOG_LEVEL="ERROR") if env is None else env,
        )
        self.lines: queue.Queue = queue.Queue()
        self.stderr_lines: list[str] = []
        threading.Thread(target=self._pump_stdout, daemon=True).start()
        threading.Thread(target=self._pump_stderr, daemon=True).start()
        self.records: dict[str, dict] = {}

    def _pump_stdout(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)  # end of stream

    def _pump_stderr(self) -> None:
        for line in self.process.stderr:
            self.stderr_lines.append(line)

    def next_json(self, timeout_s: float = 60.0) -> dict:
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"peer sent nothing for {timeout_s} s; stderr: {self.stderr()}") from None
        if line is None:
            raise EOFError(f"peer exited (rc={self.process.wait(timeout=10)}); stderr: {self.stderr()}")
        return json.loads(line)

    def read_until(self, request_id: str, key: str = "ok", timeout_s: float = 60.0) -> dict:
        """Read records until one for ``request_id`` carries ``key``."""
        deadline = time.monotonic() + timeout_s
        while True:
            record = self.next_json(max(deadline - time.monotonic(), 0.01))
            self.records.setdefault(record["id"], {}).update(record)
            if key in record and record["id"] == request_id:
                return self.records[request_id]

    def finish(self, timeout_s: float = 60.0) -> dict[str, dict]:
        """Read every record until the process exits."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                record = self.next_json(max(deadline - time.monotonic(), 0.01))
            except EOFError:
                return self.records
            self.records.setdefault(record["id"], {}).update(record)

    def ask(self, command: dict, timeout_s: float = 30.0) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self.next_json(timeout_s)

    def send_line(self) -> None:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def stderr(self) -> str:
        return "".join(self.stderr_lines)[-2000:]

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP the peer and return once every one of its threads is stopped.

        ``send_signal`` returns before the target's threads have taken the signal; a transfer
        thread still running for that moment can finish a write the test expects to stall.
        """
        self.process.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        task_dir = f"/proc/{self.process.pid}/task"
        while True:
            states = []
            for tid in os.listdir(task_dir):
                try:
                    with open(f"{task_dir}/{tid}/stat") as stat:
                        states.append(stat.read().rsplit(")", 1)[1].split()[0])
                except FileNotFoundError:  # the thread exited meanwhile
                    continue
            if states and all(state in ("T", "t") for state in states):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer {self.process.pid} not stopped after {timeout_s} s: {states}")
            time.sleep(0.005)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
        self.process.wait(timeout=10)


# ---------------------------------------------------------------------- processes
def _emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def _write_one(connection, spec: dict, src_pages: list[int], layers: int) -> dict:
    record: dict = {"id": spec["id"]}
    grant = connection.request(spec["id"], spec["tokens"])
    record["pages"] = list(grant.page_ids)
    fault = spec.get("fault")
    if fault in ("kill-mid", "stop-mid"):
        connection.write(grant, src_pages, layers=range(layers // 2))
        _emit({"id": spec["id"], "progress": "half written"})
        os.kill(os.getpid(), signal.SIGKILL if fault == "kill-mid" else signal.SIGSTOP)
    if fault == "late-done":
        connection.write(grant, src_pages)
        _emit({"id": spec["id"], "progress": "written, not done"})
        time.sleep(spec["delay"])
        connection.done(grant)
        return record | {"ok": True}
    stats = connection.send(grant, src_pages, timeout_s=spec.get("timeout"))
    return record | {"ok": True, "bytes": stats.bytes, "entries": stats.entries, "merged": stats.merged_entries}


def write_main(args) -> None:
    specs = json.loads(args.requests)
    def shape_of(spec: dict) -> tuple[int, int]:
        return spec.get("layers", args.layers), spec.get("row_bytes", args.row_bytes)

    senders, sources = {}, {}
    for shape in {shape_of(spec) for spec in specs}:
        group = [spec for spec in specs if shape_of(spec) == shape]
        pool, pages = build_source(group, *shape, args.page_size, shuffle_seed=args.shuffle_seed)
        sources[shape] = (pool, pages)
        source = KVSource.from_host_pool(pool, args.page_size)
        senders[shape] = Sender(source, mooncake_timeout_s=args.mooncake_timeout)
    connections: dict = {}
    for spec in specs:
        shape = shape_of(spec)
        if spec.get("after_stdin"):
            _emit({"id": spec["id"], "progress": "waiting for stdin"})
            sys.stdin.readline()
        started = time.monotonic()
        try:
            key = (shape, spec.get("session"))
            if key not in connections:
                connections[key] = senders[shape].connect(args.control, session_id=spec.get("session"))
            record = _write_one(connections[key], spec, sources[shape][1][spec["id"]], shape[0])
        except TransferError as exc:
            record = {"id": spec["id"], "ok": False, "error_type": type(exc).__name__, "message": str(exc)}
        record["seconds"] = round(time.monotonic() - started, 3)
        _emit(record)
    for sender in senders.values():
        sender.close()


def serve_main(args) -> None:
    harness = DecodeHarness(
        args.layers, args.row_bytes, args.pages, args.page_size,
        transfer_timeout_s=args.transfer_timeout, quarantine_s=args.quarantine,
    )
    _emit({"id": "decode", "control": harness.receiver.control_address, "session": harness.receiver.session_id})
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "wait":
            harness.wait(command["ids"], command.get("timeout", 30.0))
            _emit({"id": "decode", **harness.summary(command["ids"])})
        elif command["cmd"] == "verify":
            _emit({"id": "decode", **harness.verify(command["requests"])})
    harness.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="role", required=True)
    write = sub.add_parser("write")
    write.add_argument("--control", required=True)
    write.add_argument("--requests", required=True, help="JSON list of request specs (see the module docstring)")
    write.add_argument("--mooncake-timeout", type=float, default=None)
    write.add_argument("--shuffle-seed", type=int, default=0)
    serve = sub.add_parser("serve")
    serve.add_argument("--pages", type=int, default=64)
    serve.add_argument("--transfer-timeout", type=float, default=60.0)
    serve.add_argument("--quarantine", type=float, default=1.0)
    for role in (write, serve):
        role.add_argument("--layers", type=int, default=4)
        role.add_argument("--row-bytes", type=int, default=1152)
        role.add_argument("--page-size", type=int, default=64)
        role.add_argument("--max-seconds", type=float, default=CHILD_MAX_SECONDS)
    args = parser.parse_args()
    # Never outlive a test that died: dump the stacks and exit after max_seconds.
    faulthandler.dump_traceback_later(args.max_seconds, exit=True)
    write_main(args) if args.role == "write" else serve_main(args)


if __name__ == "__main__":
    main()
