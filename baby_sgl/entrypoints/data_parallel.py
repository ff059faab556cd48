"""`baby-sgl serve --dp-size N`: data parallelism on proven machinery. N engine workers, each a
`baby-sgl serve` process on a loopback port with its own share of the machine's cores, behind
SGLang's own router (the `sglang-router` package, a Rust binary) on the public port. The
router's cache_aware policy keeps an approximate prefix tree per worker and sends a request to
the worker that has most of its prefix cached, or to the least loaded one when the load is
uneven; it health-checks the workers and stops sending to one that dies.

This process only supervises: it starts the workers, waits until each answers /health, starts
the router, and on SIGTERM/SIGINT stops every worker (each answers its open requests, through the
router, within --graceful-shutdown-timeout) and then the router. If the router exits,
everything stops (exit code 1); a worker that dies is left to the router to route around.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from types import ModuleType

from baby_sgl.distributed.processes import child_setup, free_port, reap, split_cores
from baby_sgl.entrypoints.request_guard import allowed_host_names
from baby_sgl.server_args import ServerArgs

logger = logging.getLogger(__name__)

_WORKER_START_TIMEOUT_S = 600.0  # a first start may build the decode kernel (~40 s on 2 cores)
_STOP_TIMEOUT_S = 10.0
_ROUTER_HEALTH_FLAGS = ("--health-check-interval-secs", "2", "--health-failure-threshold", "2",
                        "--health-success-threshold", "1", "--health-check-timeout-secs", "2",
                        "--disable-circuit-breaker")
# Settings the front process keeps: each worker gets its own port on loopback and dp_size 1.
_FRONT_ONLY = ("host", "port", "dp_size", "router_policy", "dp_rank", "allowed_hosts")


def worker_argv(args: ServerArgs, worker: ModuleType, port: int, rank: int) -> list[str]:
    """The command of one worker (`python -m worker`, the server process's module) with its
    flags: every setting that differs from the default, except the front's own, plus its loopback
    port and its rank."""
    # A worker answers the Host names its front answers (the router may pass the client's on).
    names = allowed_host_names(args.host, args.allowed_hosts)
    argv = [sys.executable, "-m", worker.__name__, "--host", "127.0.0.1", "--port", str(port),
            "--dp-rank", str(rank), "--allowed-hosts", "*" if names is None else ",".join(sorted(names))]
    for f in dataclasses.fields(ServerArgs):
        value = getattr(args, f.name)
        if f.name in _FRONT_ONLY or value == f.default or value is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def router_executable() -> str:
    exe = shutil.which("sglang-router") or os.path.join(os.path.dirname(sys.executable), "sglang-router")
    if not os.path.exists(exe):
        raise SystemExit("--dp-size needs SGLang's router: pip install 'baby-sgl[router]' (or sglang-router)")
    return exe


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class DataParallelServer:
    def __init__(self, args: ServerArgs, worker: ModuleType) -> None:
        self.args, self.worker = args, worker
        self.workers: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.router: subprocess.Popen | None = None
        self._stopping = threading.Event()

    def start_workers(self) -> None:
        for i, cores in enumerate(split_cores(self.args.dp_size)):
            port = free_port()
            env = dict(os.environ, OMP_NUM_THREADS=str(len(cores)))
            proc = subprocess.Popen(worker_argv(self.args, self.worker, port, i), env=env, preexec_fn=child_setup(cores, die_with_parent=True))
            self.workers.append(proc)
            self.urls.append(f"http://127.0.0.1:{port}")
            logger.info("worker %d: pid %d, %s, cores %s", i, proc.pid, self.urls[-1], cores)
        deadline = time.monotonic() + _WORKER_START_TIMEOUT_S
        for proc, url in zip(self.workers, self.urls):
            while not _healthy(url):
                if proc.poll() is not None:
                    raise RuntimeError(f"worker {url} exited with code {proc.returncode} while starting")
                if time.monotonic() > deadline or self._stopping.is_set():
                    raise RuntimeError(f"worker {url} did not become healthy")
                time.sleep(0.2)

    def start_router(self) -> None:
        a = self.args
        argv = [router_executable(), "launch", "--worker-urls", *self.urls, "--policy", a.router_policy,
                "--host", a.host, "--port", str(a.port), "--log-level", _router_log_level(a.log_level),
                # Its metrics server would bind 0.0.0.0:29000 (and clash with a second router).
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                # A dead worker leaves routing within seconds; the circuit breaker is off because it
                # counts clients' 400s as worker failures (twenty bad requests shut every worker out
                # for a minute).
                *_ROUTER_HEALTH_FLAGS]
        if a.api_key:  # the workers require it too; the router presents it to them
            argv += ["--api-key", a.api_key]
        self.router = subprocess.Popen(argv, env=_router_env(a.log_level), preexec_fn=child_setup(None, die_with_parent=True))
        logger.info("router: pid %d, policy %s, on %s:%d", self.router.pid, a.router_policy, a.host, a.port)

    def stop(self) -> None:
        self._stopping.set()
        for procs, timeout in ((self.workers, self.args.graceful_shutdown_timeout + _STOP_TIMEOUT_S),
                               ([self.router] if self.router else [], _STOP_TIMEOUT_S)):
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            reap(procs, timeout)

    def run(self) -> int:
        """Serves until SIGTERM/SIGINT (0) or until the router exits (1)."""
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        try:
            self.start_workers()
            self.start_router()
            print(f"baby-sgl: {self.args.dp_size} workers behind SGLang's router ({self.args.router_policy}) at "
                  f"http://{self.args.host}:{self.args.port}", file=sys.stderr, flush=True)
            assert self.router is not None
            while not stop.wait(0.5):
                if self.router.poll() is not None:
                    logger.critical("the router exited with code %s; stopping the workers", self.router.returncode)
                    return 1
            return 0
        except RuntimeError as e:
            logger.critical("%s", e)
            return 1
        finally:
            self.stop()


def _router_env(log_level: str) -> dict[str, str]:
    """The router registers a tokenizer for each worker's model from the model path the worker
    reports. It uses none in HTTP routing (only in its gRPC mode and for its own /v1/tokenize),
    but for a .gguf path it logs a warning that it cannot, and for a hub id it would try to
    download one: its tokenizer-registration step logs only errors here, and the hub address
    points nowhere. A RUST_LOG or HF_ENDPOINT set by the user wins."""
    env = dict(os.environ)
    env.setdefault("RUST_LOG", f"smg={_router_log_level(log_level)},"
                               "smg::core::steps::worker::local::register_tokenizer=error")
    env.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")
    return env


def _router_log_level(level: str) -> str:
    return {"warning": "warn", "critical": "error"}.get(level, level if level in ("debug", "info", "error") else "warn")


def launch_data_parallel(args: ServerArgs, worker: ModuleType) -> int:
    """Serves with args.dp_size workers, each a process running `python -m worker` (a layer
    above this one: the server process, which passes itself)."""
    return DataParallelServer(args, worker).run()
