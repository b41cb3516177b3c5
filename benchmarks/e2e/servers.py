"""Server processes: start one in its own process group, wait for /health, stop the whole group; an
arm's servers (one, or a PD pair) as one ServerGroup, the target the phases measure."""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import shlex
import signal
import socket
import subprocess
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

from client import Colocated, http_status
from common import HOST, REPO, Log
from logs import START_MARK, log_tail


class ServerDied(RuntimeError):
    pass


def port_free(port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) != 0


def ephemeral_port_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The ports the kernel gives outgoing connections (Linux's default 32768-60999 where unreadable)."""
    try:
        low, high = (int(x) for x in Path(path).read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port_bases(n: int, offsets, start: int = 20000) -> list[int]:
    """Up to ``n`` bases ``b`` (multiples of 100 from ``start``) such that no port ``b + k`` of ``offsets``
    answers now, all below the ephemeral range. A port in that range can become a client connection's
    local port between this probe and the server's bind (the harness itself opens hundreds), and the
    server then dies with EADDRINUSE, the way the self-test's mock arm b twice did."""
    low, high = ephemeral_port_range()
    top = max(offsets)
    bases = []
    for base in range(start, 65536 - top, 100):
        if low <= base + top and base <= high:  # overlaps the ephemeral range
            continue
        if all(port_free(base + k) for k in offsets):
            bases.append(base)
            if len(bases) == n:
                break
    return bases


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class Server:
    """One `sglang.launch_server` process group; `name` names its pidfile and its log lines.

    A running server can also be what the phases measure (profile_decode.py uses it so): `endpoint`
    sends requests to it, `check()` raises ServerDied if it exited, `log_path` is where its scheduler
    logs batches."""

    def __init__(self, name: str, cmd: list, env: dict, log_path: Path, port: int, state: Path, log: Log):
        self.arm = self.name = name
        self.cmd, self.env, self.log_path, self.port, self.state, self.log = cmd, env, log_path, port, state, log
        self.proc: subprocess.Popen | None = None
        self.pidfile = state / f"server-{name}.pid"
        self.endpoint = Colocated(port)

    def start(self) -> None:
        if not port_free(self.port):
            raise RuntimeError(f"port {self.port} is busy before starting arm {self.name}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.logf = open(self.log_path, "ab")
        self.logf.write(f"\n{START_MARK}{self.name} start {_dt.datetime.now().isoformat()} =====\n"
                        f"$ {shlex.join(self.cmd)}\n".encode())
        self.logf.flush()
        # own process group (killpg kills scheduler + detokenizer too), but the same session, so
        # that the device tool still reaps everything if this harness is killed hard
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self.logf, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=str(REPO), process_group=0)
        self.pidfile.write_text(str(self.proc.pid))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check(self) -> None:
        if not self.alive():
            rc = self.proc.returncode if self.proc else None
            raise ServerDied(f"server of arm {self.name} exited (rc={rc}); last log lines:\n{log_tail(self.log_path)}")

    def wait_healthy(self, timeout: float) -> float:
        t0 = time.monotonic()
        last_note = t0
        while True:
            self.check()
            code = http_status(self.port, "/health")
            if code == 200:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"arm {self.name}: /health not 200 after {timeout:.0f}s; last log lines:\n"
                                   f"{log_tail(self.log_path, 30)}")
            if time.monotonic() - last_note > 30:
                last = log_tail(self.log_path, 1).strip()[-160:]
                self.log(f"  ... waiting for /health ({time.monotonic() - t0:.0f}s, code {code}); log: {last}")
                last_note = time.monotonic()
            time.sleep(2)

    def stop(self, grace: float = 30) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        t0 = time.monotonic()
        while time.monotonic() - t0 < grace:
            if self.proc.poll() is not None and not group_alive(pgid):
                break
            time.sleep(0.5)
        if group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)
        t1 = time.monotonic()
        while group_alive(pgid) and time.monotonic() - t1 < 15:
            time.sleep(0.5)
        t2 = time.monotonic()
        while not port_free(self.port) and time.monotonic() - t2 < 30:
            time.sleep(0.5)
        with contextlib.suppress(OSError):
            self.pidfile.unlink()
        with contextlib.suppress(Exception):
            self.logf.close()
        self.log(f"  server {self.name} stopped in {time.monotonic() - t0:.1f}s "
                 f"(group gone: {not group_alive(pgid)}, port free: {port_free(self.port)})")
        self.proc = None


def group_pids(pgid: int) -> list[int]:
    """The processes of a process group (a server and its scheduler / detokenizer children)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    pids.append(int(entry.name))
    return pids


class ServerGroup:
    """The servers of one arm, started together and stopped together: the target of the phases.

    `endpoint` is how requests reach them (client.Colocated or client.PDPair); `log_path` is the log of
    the server that decodes (the last one); check() raises ServerDied if any of them exited."""

    def __init__(self, arm: str, servers: list[Server], endpoint, log: Log):
        self.arm, self.servers, self.endpoint, self.log = arm, servers, endpoint, log
        self.decoder = servers[-1]
        self.log_path = self.decoder.log_path

    def start(self, stagger_s: float = 0.0) -> None:
        for i, srv in enumerate(self.servers):
            if i and stagger_s:
                time.sleep(stagger_s)
                self.check()
            srv.start()

    def wait_healthy(self, timeout: float) -> dict[str, float]:
        """Seconds until each server answered /health 200 (waited for in parallel); the first failure raises."""
        with ThreadPoolExecutor(max_workers=len(self.servers)) as pool:
            futures = {pool.submit(srv.wait_healthy, timeout): srv.name for srv in self.servers}
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for fut in done:
                if fut.exception() is not None:
                    for srv in self.servers:  # the others' waits end as soon as their process is gone
                        srv.stop(grace=5)
                    raise fut.exception()
            return {futures[f]: round(f.result(), 1) for f in futures}

    def check(self) -> None:
        for srv in self.servers:
            srv.check()

    def stop(self) -> None:
        for srv in self.servers:
            srv.stop()


def kill_stale_servers(state: Path, log: Log) -> None:
    """Servers of an earlier run of this harness that was killed hard (pidfiles in the state dir)."""
    for pf in state.glob("server-*.pid"):
        with contextlib.suppress(Exception):
            pid = int(pf.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if "sglang.launch_server" in cmdline:
                log(f"killing stale server group {pid} from an earlier run ({pf.name})")
                os.killpg(pid, signal.SIGKILL)
                time.sleep(2)
        with contextlib.suppress(OSError):
            pf.unlink()
