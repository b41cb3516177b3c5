"""The test side of the Mooncake PD tests: one decode peer and N prefill peers (``pd_peer.py``,
``pd_decode_peer.py``) in spawned processes, like SGLang's scheduler processes; commands go out, events
come back. Every wait has a deadline and the whole session has one, so a stuck transfer fails the
test instead of hanging it; the peers end themselves after their own deadline too.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
from multiprocessing.connection import wait

import pytest
from pd_decode_peer import decode_peer
from pd_peer import prefill_peer


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PeerSession:
    """Peers "decode" and "prefill0".."prefill{N-1}" (bootstrap ports in ``ports``).

    Args:
        layout: "bf16" or "fp8" (pd_peer.LAYOUTS).
        prefills: prefill processes.
        quarantine_s: the decode's pd_quarantine_s.
        decode_env, prefill_env: environment variables of the peers (SGLang's knobs).
        deadline_s: the whole session; the peers give up 20 s later.
    """

    def __init__(
        self,
        layout: str,
        prefills: int = 1,
        quarantine_s: float = 2.0,
        decode_env: dict[str, str] | None = None,
        prefill_env: dict[str, str] | None = None,
        deadline_s: float = 150.0,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self.started = time.monotonic()
        self.deadline_s = deadline_s
        self.ports = [_free_port() for _ in range(prefills)]
        self.conns, self.processes, self.inbox = {}, {}, {}
        peer_deadline = deadline_s + 20
        targets = {"decode": (decode_peer, (layout, quarantine_s, peer_deadline, decode_env or {}))}
        for index, port in enumerate(self.ports):
            targets[f"prefill{index}"] = (prefill_peer, (layout, port, peer_deadline, prefill_env or {}))
        for name, (target, args) in targets.items():
            self.conns[name], child = context.Pipe()
            self.processes[name] = context.Process(target=target, args=(child, *args), daemon=True)
            self.processes[name].start()
            child.close()
            self.inbox[name] = []
        self.open = set(self.conns)

    def __enter__(self) -> PeerSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- commands and events
    def wait_started(self, timeout_s: float = 180.0) -> dict:
        """Waits until every prefill registered its KV manager and the decode is ready; returns the
        decode's "ready" event. (Importing SGLang alone takes 20-60 s per process on 2 busy cores.)"""
        for index in range(len(self.ports)):
            self.wait(f"prefill{index}", "registered", timeout_s=timeout_s)
        return self.wait("decode", "ready", timeout_s=timeout_s)

    def send(self, peer: str, cmd: str, **fields) -> None:
        self.conns[peer].send({"cmd": cmd, **fields})

    def wait(self, peer: str, event: str, rid: str | None = None, timeout_s: float = 60.0) -> dict:
        """The next ``event`` (about ``rid``, if given) from ``peer``; other events are kept."""
        deadline = min(time.monotonic() + timeout_s, self.started + self.deadline_s)
        while True:
            for index, message in enumerate(self.inbox[peer]):
                if message["event"] == event and (rid is None or message.get("rid") == rid):
                    return self.inbox[peer].pop(index)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or peer not in self.open:
                pending = {
                    name: [{key: value for key, value in m.items() if key not in ("pages", "traceback")} for m in box]
                    for name, box in self.inbox.items()
                }
                pytest.fail(f"no '{event}' {rid or ''} from {peer} in time; unread events: {pending}")
            self._receive(remaining)

    def take(self, peer: str, event: str) -> list[dict]:
        """Every ``event`` received from ``peer`` so far (removed from the inbox)."""
        taken = [m for m in self.inbox[peer] if m["event"] == event]
        self.inbox[peer] = [m for m in self.inbox[peer] if m["event"] != event]
        return taken

    def _receive(self, timeout_s: float) -> None:
        by_conn = {self.conns[name]: name for name in self.open}
        for conn in wait(list(by_conn), timeout=timeout_s):
            name = by_conn[conn]
            try:
                message = conn.recv()
            except EOFError:  # the process ended (killed by the test, or after "exit")
                self.open.discard(name)
                continue
            if message["event"] == "error":
                pytest.fail(f"{name} failed:\n{message['traceback']}")
            self.inbox[name].append(message)

    # -------------------------------------------------------------- processes
    def signal(self, peer: str, signum: int) -> None:
        os.kill(self.processes[peer].pid, signum)
        if signum == signal.SIGKILL:
            self.processes[peer].join(timeout=10)

    def close(self) -> None:
        for name, process in self.processes.items():
            if process.is_alive():
                os.kill(process.pid, signal.SIGCONT)
                try:
                    self.conns[name].send({"cmd": "exit"})
                except OSError:
                    pass
        for process in self.processes.values():
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
