"""``medusa-serve`` and ``medusa-triton-repo``: serve an engine with NVIDIA Triton Inference Server.

    medusa-triton-repo --engine build/model.onnx --out build/triton
    medusa-serve build/triton [--port-grpc 8001 --port-http 8000 --port-metrics 8002]

The server is the ``tritonserver`` binary and Python backend bundled in the PyPI package
``nvidia-pytriton`` (which runs on CPU). ``medusa-serve`` finds them without importing pytriton,
lays out a backend folder for this Python version's stub in a temporary run folder, binds every
endpoint to 127.0.0.1, loads the repository's models, waits until the server is ready and
prints the ports; Ctrl-C or SIGTERM stops it (graceful first, then by force), and whatever
shared-memory segment its Python backend leaves is removed.

Security: Triton's model-repository API (load / unload, which would let any client upload a
``model.py`` and run it) is closed: the server runs with ``--model-control-mode=none`` over a
run-folder repository that links only the chosen models, so the set of models is fixed at start
and every load or unload request is refused. The model-repository API again (a second lock)
and the shared-memory, trace and logging APIs, which this model does not use, are restricted on
HTTP and gRPC to a header holding a random key that nothing is told (it is on tritonserver's
command line, which local users can read: loopback binding is what keeps others out). Endpoints
bind loopback; another ``--host`` (which exposes an unauthenticated server to the network)
needs ``--allow-remote`` and is logged as a warning.

Lifetime: a small watchdog process (a pipe from medusa-serve on its stdin) outlives medusa-serve
only to clean up after it: if medusa-serve dies without stopping the server (``kill -9``, a
crash), the pipe closes, and the watchdog kills tritonserver's process group (the server and
its stubs), removes the Python backend's shared-memory segments and the run folder.

The stub's Python: Triton runs ``model.py`` in a stub process that embeds libpython and takes
its packages from the ``python3`` first on ``PATH``. ``medusa-serve`` puts the chosen
environment's ``bin`` first there and its libpython folder on ``LD_LIBRARY_PATH``. The stub is
built against numpy 1.x: under numpy 2 it garbles every tensor it hands to Python, so the
environment must have numpy<2 (nvidia-pytriton pins it). Choose it with ``--python-env DIR``
or ``MEDUSA_TRT_STUB_ENV``; by default it is the environment running medusa-serve. To keep
numpy 2 in the main environment, ``medusa-serve --make-stub-env DIR`` makes a small venv that
holds only numpy<2 and sees the main environment's packages behind it.

Triton 2.51 (nvidia-pytriton 0.7.0) quirks met here: a gRPC stream that is *cancelled* (not
closed) after Triton itself refused its request (an input the config does not name, a wrong
type or shape) keeps a reference to the model, so unloading at stop waits out
``--exit-timeout-secs`` and the server then exits with status 1 (``stop()`` removes the stub's
shared memory it could not free); ``stream_generate`` closes its streams, which avoids it. And a
stub that loses its server mid-generation (a crash, SIGKILL) may run on: ``stop()`` ends the
server's whole process group.

Python API (what the tests and scripts/serve_bench.py use):

    with TritonServer(ServeConfig(repo="build/triton")) as server:   # started and ready
        client = tritonclient.grpc.InferenceServerClient(server.grpc_address)
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import importlib.util
import ipaddress
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.cli.common import USER_ERRORS, Parser, drafter_list, entry, fail, non_negative_int, positive_int, setup_logging
from medusa_trt.runtime.errors import MedusaError

log = logging.getLogger("medusa_trt.cli.serve")

INSTALL_HINT = "pip install --no-deps nvidia-pytriton==0.7.0 (and 'tritonclient[grpc]' for clients)"
STUB_ENV_VAR = "MEDUSA_TRT_STUB_ENV"


class ServeError(MedusaError):
    """The server cannot be started or stopped as asked; the message says what to do."""


# ---------------------------------------------------------------------------------- the server files


@dataclass(frozen=True)
class TritonDist:
    """Where nvidia-pytriton keeps the server: binary, Python backend, one stub per Python version."""

    root: Path  # site-packages/pytriton/tritonserver
    libs: Path  # site-packages/nvidia_pytriton.libs (libtritonserver and its dependencies)

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def python_backend(self) -> Path:
        return self.root / "backends" / "python"

    @property
    def caches(self) -> Path:
        return self.root / "caches"

    def stub(self, version: str) -> Path:
        return self.root / "python_backend_stubs" / version / "triton_python_backend_stub"


def find_triton() -> TritonDist:
    """The server bundled in nvidia-pytriton, found without importing pytriton (whose client
    side needs packages the server does not)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServeError(f"Triton Inference Server not found (nvidia-pytriton is not installed): {INSTALL_HINT}")
    package = Path(next(iter(spec.submodule_search_locations)))
    dist = TritonDist(root=package / "tritonserver", libs=package.parent / "nvidia_pytriton.libs")
    if not dist.binary.is_file() or not (dist.python_backend / "libtriton_python.so").is_file():
        raise ServeError(f"{dist.root} lacks the tritonserver binary or its Python backend: reinstall nvidia-pytriton ({INSTALL_HINT})")
    return dist


# ---------------------------------------------------------------------------------- the stub's Python

_PROBE = r"""
import json, sys, sysconfig
out = {"version": "%d.%d" % sys.version_info[:2], "prefix": sys.prefix,
       "libdir": sysconfig.get_config_var("LIBDIR") or "", "shared": bool(sysconfig.get_config_var("Py_ENABLE_SHARED")),
       "ldlibrary": sysconfig.get_config_var("INSTSONAME") or sysconfig.get_config_var("LDLIBRARY") or "", "missing": []}
for name in ("numpy", "onnxruntime", "tokenizers", "medusa_trt.runtime.batching"):
    try:
        module = __import__(name, fromlist=["_"])
    except Exception as exc:
        out["missing"].append("%s (%s: %s)" % (name, type(exc).__name__, exc))
    else:
        if name == "numpy":
            out["numpy"] = module.__version__
print(json.dumps(out))
"""


@dataclass(frozen=True)
class StubEnv:
    """The Python environment the Python backend's stub runs ``model.py`` in."""

    bin: Path  # its bin folder: first on PATH, so the stub's embedded Python takes this environment
    version: str  # "3.11": picks the stub built for it
    libdir: Path  # holds libpython3.X.so.1.0, which the stub links
    numpy: str


def stub_env(python_env: str | os.PathLike | None) -> StubEnv:
    """Check an environment (a venv or Python prefix; None: $MEDUSA_TRT_STUB_ENV or this one) can
    run the stub and medusa-trt's runtime; fail with what to install otherwise."""
    python_env = python_env or os.environ.get(STUB_ENV_VAR)
    python = Path(python_env) / "bin" / "python3" if python_env else Path(sys.executable)
    if not python.exists():
        raise ServeError(f"{python} not found: --python-env / {STUB_ENV_VAR} must be a virtual environment or Python prefix")
    try:
        done = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True)
        info = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as exc:
        raise ServeError(f"cannot run {python} to check the stub's environment: {exc}") from exc
    where = f"the stub's Python environment {info['prefix']}"
    if info["missing"]:
        raise ServeError(f"{where} cannot import {'; '.join(info['missing'])}: install medusa-trt there, or choose another with --python-env")
    if int(info["numpy"].split(".")[0]) >= 2:
        raise ServeError(
            f"{where} has numpy {info['numpy']}, but the Triton Python backend stub in nvidia-pytriton is built against numpy 1.x "
            f"(it garbles tensors under numpy 2): pip install 'numpy<2' there, or make a small environment for the stub with "
            f"'medusa-serve --make-stub-env DIR' and pass --python-env DIR (or set {STUB_ENV_VAR})")
    libdir = Path(info["libdir"])
    if not info["shared"] or not any(libdir.glob(f"libpython{info['version']}*.so*")):
        raise ServeError(f"{where}: its Python {info['version']} has no shared libpython in {libdir}, which the Triton stub links: "
                         "use a Python built with --enable-shared (python.org, pyenv with PYTHON_CONFIGURE_OPTS=--enable-shared, distro packages)")
    return StubEnv(bin=python.parent, version=info["version"], libdir=libdir, numpy=info["numpy"])


def make_stub_env(folder: str | os.PathLike) -> Path:
    """A venv holding only numpy<2 that sees this environment's packages (medusa-trt,
    onnxruntime, tokenizers) behind it, through a .pth file: the stub's Python without
    downgrading numpy here. Needs pip and an index to fetch numpy from."""
    import site
    import sysconfig

    folder = Path(folder).expanduser().resolve()
    if folder.exists():
        raise ServeError(f"{folder} exists: choose a new folder for the stub's environment")
    base = Path(getattr(sys, "_base_executable", sys.executable))
    subprocess.run([str(base), "-m", "venv", str(folder)], check=True)
    python = folder / "bin" / "python3"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "numpy>=1.26,<2"], check=True)
    inner = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    ours = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()})
    lines = [f"import site; site.addsitedir({p!r})" for p in ours if Path(p).is_dir()]
    (Path(inner) / "zz_medusa_trt_base_env.pth").write_text("\n".join(lines) + "\n")
    stub_env(folder)  # the same check medusa-serve makes
    return folder


# ---------------------------------------------------------------------------------- the server


@dataclass(frozen=True)
class ServeConfig:
    repo: str | os.PathLike  # a Triton model repository (medusa-triton-repo writes one)
    models: tuple[str, ...] = ()  # models to load; (): every folder in repo with a config.pbtxt
    host: str = "127.0.0.1"  # every endpoint binds here
    grpc_port: int | None = None  # None: a free port
    http_port: int | None = None
    metrics_port: int | None = None
    python_env: str | os.PathLike | None = None  # the stub's environment (see the module doc)
    log_verbose: int = 0  # tritonserver --log-verbose
    log_file: str | os.PathLike | None = None  # server output; None: a file in the run folder
    startup_timeout: float = 300.0  # seconds to wait for the models to load
    exit_timeout: int = 15  # seconds the server waits for running requests on stop before we kill it
    allow_remote: bool = False  # a host other than loopback: the server has no authentication

    def __post_init__(self):
        if not is_loopback(self.host) and not self.allow_remote:
            raise ServeError(f"--host {self.host} is not a loopback address: the server would take requests from other machines "
                             "without authentication; pass --allow-remote to do that on purpose (behind a firewall or an "
                             "authenticating proxy), or keep the default 127.0.0.1")


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TritonServer:
    """One tritonserver process over a model repository; ``start()`` returns when it is ready."""

    def __init__(self, config: ServeConfig, *, inherit_output: bool = False):
        self.config = config
        self.inherit_output = inherit_output  # the CLI lets the server write to the terminal
        self.proc: subprocess.Popen | None = None
        self.run_dir: Path | None = None
        self.shm_prefix = f"medusa_trt_{os.getpid()}_{os.urandom(4).hex()}_"
        self.leftovers: list[str] = []  # what stop() had to clean up: "SIGKILL", shared-memory names
        self._log = None
        self._watchdog: subprocess.Popen | None = None
        # header and value that unlock the restricted APIs (shared memory, trace, logging): told to no one
        self._restricted = f"medusa-trt-admin={os.urandom(16).hex()}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def grpc_address(self) -> str:
        return f"{self.config.host}:{self.config.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.config.host}:{self.config.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.config.host}:{self.config.metrics_port}/metrics"

    @property
    def log_path(self) -> Path | None:
        return None if self.inherit_output else Path(self.config.log_file or self.run_dir / "tritonserver.log")

    def log_text(self) -> str:
        path = self.log_path
        return path.read_text(errors="replace") if path is not None and path.is_file() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _models(self, repo: Path) -> tuple[str, ...]:
        if self.config.models:
            for name in self.config.models:
                if not name or Path(name).name != name or name.startswith("."):
                    raise ServeError(f"model name {name!r} must be a plain folder name of {repo}")
                if not (repo / name / "config.pbtxt").is_file():
                    raise ServeError(f"{repo / name}/config.pbtxt not found: write the model with medusa-triton-repo --out {repo}")
            return tuple(self.config.models)
        found = tuple(sorted(p.parent.name for p in repo.glob("*/config.pbtxt") if not p.parent.name.startswith(".")))
        if not found:
            raise ServeError(f"no model in {repo} (no */config.pbtxt): write one with medusa-triton-repo --engine E --out {repo}")
        return found

    def command(self, dist: TritonDist) -> list[str]:
        c, host = self.config, self.config.host
        restricted = f"{','.join(RESTRICTED_APIS)}:{self._restricted}"
        return [
            str(dist.binary),
            f"--model-repository={self.run_dir / 'models'}",  # links to the chosen models only
            f"--backend-directory={self.run_dir / 'backends'}",
            f"--cache-directory={dist.caches}",
            "--model-control-mode=none",  # every model loads at start; the model-repository API is refused
            f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}",
            f"--grpc-address={host}", f"--grpc-port={c.grpc_port}",
            f"--http-address={host}", f"--http-port={c.http_port}",
            f"--metrics-address={host}", f"--metrics-port={c.metrics_port}", "--allow-gpu-metrics=false",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--exit-timeout-secs={c.exit_timeout}",
            f"--log-verbose={c.log_verbose}",
        ]

    def start(self) -> TritonServer:
        if self.proc is not None:
            raise ServeError("this server was already started: make a new TritonServer")
        repo = Path(self.config.repo).expanduser()
        if not repo.is_dir():
            raise ServeError(f"model repository {repo} does not exist: write one with medusa-triton-repo --engine E --out {repo}")
        models = self._models(repo)
        dist = find_triton()
        env = stub_env(self.config.python_env)
        stub = dist.stub(env.version)
        if not stub.is_file():
            raise ServeError(f"nvidia-pytriton has no Python backend stub for Python {env.version}: use Python 3.8-3.13 for the stub's environment")
        if not is_loopback(self.config.host):
            log.warning("tritonserver binds %s: it serves other machines, without authentication", self.config.host)
        requested = self.config
        for attempt in range(3):
            try:
                self._launch(dist, env, stub, models)
                self._wait_ready(models)
                return self
            except BaseException as exc:
                # a port picked free here was taken before the server bound it: pick others
                picked = {self.config.grpc_port, self.config.http_port, self.config.metrics_port} - {
                    requested.grpc_port, requested.http_port, requested.metrics_port}
                text = self.log_text()
                retry = isinstance(exc, ServeError) and attempt < 2 and any(f":{port}' already in use" in text for port in picked)
                self.stop()
                if not retry:
                    raise
                log.info("a port was taken meanwhile; starting again on other ports")
                self.config, self.proc, self.leftovers = requested, None, []
        raise AssertionError("unreachable")

    def _launch(self, dist: TritonDist, env: StubEnv, stub: Path, models: tuple[str, ...]) -> None:
        names = ("grpc_port", "http_port", "metrics_port")
        taken = {getattr(self.config, n) for n in names} - {None}
        ports = {}
        for name in [n for n in names if getattr(self.config, n) is None]:
            port = free_port(self.config.host)
            while port in taken:
                port = free_port(self.config.host)
            taken.add(port)
            ports[name] = port
        self.config = dataclasses.replace(self.config, **ports)

        # The backend folder: the bundled Python backend plus the stub for this Python version.
        self.run_dir = Path(tempfile.mkdtemp(prefix="medusa-serve-"))
        self._watchdog = _start_watchdog(self.run_dir, self.shm_prefix)
        repo = self.run_dir / "models"  # the models the server may load, and nothing else
        repo.mkdir()
        for name in models:
            (repo / name).symlink_to(Path(self.config.repo).expanduser().resolve() / name, target_is_directory=True)
        backend = self.run_dir / "backends" / "python"
        backend.mkdir(parents=True)
        for item in dist.python_backend.iterdir():
            (backend / item.name).symlink_to(item)
        (backend / "triton_python_backend_stub").symlink_to(stub)

        server_env = dict(os.environ)
        server_env["PATH"] = f"{env.bin}{os.pathsep}{server_env.get('PATH', '')}"
        server_env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(env.libdir), str(dist.libs), server_env.get("LD_LIBRARY_PATH", "")) if p)
        server_env.pop("PYTHONHOME", None)
        out = None
        if not self.inherit_output:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
            out = self._log
        cmd = self.command(dist)
        log.info("starting %s", " ".join(cmd).replace(self._restricted, "medusa-trt-admin=<random>"))
        # its own session: Ctrl-C in a terminal reaches medusa-serve only, which stops the server in order
        self.proc = subprocess.Popen(cmd, env=server_env, stdout=out, stderr=None if out is None else subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self._tell_watchdog(f"pid {self.proc.pid}")
        _RUNNING.add(self)

    def _wait_ready(self, models: tuple[str, ...]) -> None:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
        deadline = time.monotonic() + self.config.startup_timeout
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise ServeError(f"tritonserver exited with status {code} while loading {', '.join(models)}: {self._why()}")
            try:
                with opener.open(f"{self.http_url}/v2/health/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise ServeError(f"tritonserver was not ready after {self.config.startup_timeout:.0f} s: {self._why()}")

    def _why(self) -> str:
        """The server's own error lines (model load failures name the cause), or where its log is."""
        if self.inherit_output:
            return "see its output above"
        lines = [line.strip() for line in self.log_text().splitlines()]
        noise = ("CudaDriverHelper", "DCGM", "NVML", "pinned memory", "chttp2_server")  # a CPU-only machine's usual complaints
        errors = [line for line in lines if (line.startswith("E") or "error" in line.lower()) and not any(n in line for n in noise)]
        tail = errors[-3:] or lines[-3:]
        where = f" (log: {self.log_path})" if self.config.log_file else ""  # the run folder's log goes with it
        return " | ".join(tail)[-1500:] + where

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self.proc.wait(timeout) if self.proc is not None else None
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> int | None:
        """SIGTERM to the server's pid (Triton finishes running requests for up to exit_timeout s,
        then unloads the models, whose stubs release their shared memory); SIGKILL to its process
        group if it is still there after that. Returns the exit status."""
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGTERM)
                code = self.wait(self.config.exit_timeout + 30)
                if code is None:
                    self._kill_group("tritonserver (pid %d) did not stop after SIGTERM: killing it", "SIGKILL")
                    self.proc.wait()
            code = self.proc.returncode
            self._reap_group()
        shm = Path("/dev/shm")
        for segment in sorted(shm.glob(f"{self.shm_prefix}*")) if shm.is_dir() else []:
            self.leftovers.append(segment.name)
            log.warning("removing shared-memory segment %s left by the Python backend", segment.name)
            segment.unlink(missing_ok=True)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        self._tell_watchdog("done")
        _RUNNING.discard(self)
        return code

    def _tell_watchdog(self, line: str) -> None:
        """``pid N``: the server to kill if medusa-serve dies; ``done``: stopped and cleaned, exit."""
        if self._watchdog is None:
            return
        try:
            self._watchdog.stdin.write(f"{line}\n".encode())
            self._watchdog.stdin.flush()
            if line == "done":
                self._watchdog.stdin.close()
                self._watchdog.wait(10)
                self._watchdog = None
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("the server's watchdog (pid %d) did not take %r: %s", self._watchdog.pid, line, exc)

    def _reap_group(self, grace: float = 5.0) -> None:
        """The stubs live in the server's process group; one whose server died (a crash, a kill)
        may keep running (and computing) on its own: give it ``grace`` seconds, then SIGKILL."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.1)
        self._kill_group("processes of tritonserver's group (pid %d) outlived it: killing them", "orphaned processes")

    def _kill_group(self, warning: str, leftover: str) -> None:
        """SIGKILL the server's process group, logging ``warning`` (with the pid) and recording ``leftover``."""
        log.warning(warning, self.proc.pid)
        self.leftovers.append(leftover)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_RUNNING: set[TritonServer] = set()
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")  # open to the holder of the random key only (nobody)

# The watchdog: stdin is a pipe from medusa-serve. "pid N" names the server (a process-group
# leader), "done" means medusa-serve stopped it and cleaned up. End of input without "done":
# medusa-serve died; kill the server's group, then remove its shared memory and run folder.
_WATCHDOG = r"""
import os, shutil, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
run_dir, shm_prefix = sys.argv[1], sys.argv[2]
pid = None
for line in sys.stdin.buffer:
    word, _, value = line.decode().strip().partition(" ")
    if word == "done":
        sys.exit(0)
    if word == "pid":
        pid = int(value)

def group_alive(pgid):
    for entry in os.listdir("/proc"):
        try:
            with open("/proc/%s/stat" % entry) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in "ZX":  # a zombie holds no port and no memory
            return True
    return False

if pid is not None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    deadline = time.monotonic() + 10
    while group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
if os.path.isdir("/dev/shm"):
    for name in os.listdir("/dev/shm"):
        if name.startswith(shm_prefix):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
shutil.rmtree(run_dir, ignore_errors=True)
"""


def _start_watchdog(run_dir: Path, shm_prefix: str) -> subprocess.Popen:
    """The process that cleans up after a medusa-serve that died (see the module doc). Its own
    session: Ctrl-C in the terminal does not reach it; it ends when medusa-serve says "done"."""
    return subprocess.Popen([sys.executable, "-I", "-c", _WATCHDOG, str(run_dir), shm_prefix], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, start_new_session=True)


class RequestFailed(MedusaError):
    """The server answered a request with an error response (its message is the server's)."""


@dataclass(frozen=True)
class Chunk:
    """One response of a streamed generation."""

    text: str  # text added by this engine step
    token_ids: list[int]  # tokens added by it
    finish_reason: str  # "" until the last response


# Python types of the model's optional inputs, as Triton types them (exporter/triton_repo.py)
_INPUT_TYPES = {"max_tokens": ("INT32", "int32"), "temperature": ("FP32", "float32"), "top_p": ("FP32", "float32"),
                "top_k": ("INT32", "int32"), "seed": ("UINT64", "uint64"), "stream": ("BOOL", "bool"), "timeout_s": ("FP32", "float32")}


def stream_generate(address: str, text: str, *, model: str = "medusa", stop=None, timeout: float = 300.0, extra_inputs=(),
                    parameters: dict | None = None, **inputs):
    """Generate over one gRPC stream (tritonclient), yielding a ``Chunk`` per response; raises
    ``RequestFailed`` for an error response. ``inputs``: max_tokens, temperature, top_p, top_k,
    seed, stream (default True), timeout_s; ``extra_inputs``: ready-made ``InferInput``s and ``parameters``:
    request parameters (the model refuses both unless they are its own; tests send them)."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    inputs.setdefault("stream", True)
    tensors = []

    def add(name, array, datatype):
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)

    add("text_input", np.array([text.encode("utf-8")], dtype=np.object_), "BYTES")
    for name, value in inputs.items():
        if name not in _INPUT_TYPES:
            raise TypeError(f"unknown input {name!r}: pass it in extra_inputs")
        datatype, dtype = _INPUT_TYPES[name]
        add(name, np.array([value], dtype=dtype), datatype)
    if stop:
        add("stop", np.array([s.encode("utf-8") for s in ([stop] if isinstance(stop, str) else stop)], dtype=np.object_), "BYTES")
    tensors += list(extra_inputs)
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(address)
    client.start_stream(callback=lambda result, error: responses.put((result, error)), stream_timeout=timeout)
    done = False
    try:
        client.async_stream_infer(model, tensors, parameters=parameters, enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=timeout)
            if error is not None:
                done = True
                raise RequestFailed(error.message() if hasattr(error, "message") else str(error))
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param if "triton_final_response" in response.parameters else False
            if response.outputs:
                reason = result.as_numpy("finish_reason")
                yield Chunk(text=b"".join(result.as_numpy("text_output").tolist()).decode("utf-8"),
                            token_ids=[int(t) for t in result.as_numpy("token_ids")],
                            finish_reason=reason.reshape(-1)[0].decode("utf-8") if reason is not None else "")
            if final:
                done = True
                return
    finally:
        # Half-close when the request is over; cancel only one still running (the caller stopped
        # early). Triton 2.51 leaks a model reference when a stream whose request it refused
        # (unknown input, wrong type) is cancelled rather than closed: unloading then waits out
        # --exit-timeout-secs.
        client.stop_stream(cancel_requests=not done)
        client.close()


@atexit.register
def _stop_all() -> None:  # a script that forgot stop() or died of an exception leaves no server behind
    for server in list(_RUNNING):
        server.stop()


# ---------------------------------------------------------------------------------- commands


def port(text: str) -> int:
    """argparse type: a TCP port, 0 for a free one."""
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="medusa-serve", description="Serve a Triton model repository (medusa-triton-repo) with tritonserver.")
    p.add_argument("repo", nargs="?", help="the model repository folder")
    p.add_argument("--model", action="append", help="model to load (repeatable; default: every model in the repository)")
    p.add_argument("--host", default="127.0.0.1", help="address every endpoint binds (default: loopback only; others need --allow-remote)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a --host other than loopback: the server then takes unauthenticated requests from the network")
    p.add_argument("--port-grpc", type=port, default=8001, help="gRPC port (0: a free one)")
    p.add_argument("--port-http", type=port, default=8000, help="HTTP port (0: a free one)")
    p.add_argument("--port-metrics", type=port, default=8002, help="metrics port (0: a free one)")
    p.add_argument("--python-env", help=f"environment (venv) the Python backend stub runs model.py in; needs numpy<2 (default: ${STUB_ENV_VAR} or this one)")
    p.add_argument("--make-stub-env", metavar="DIR", help="make a venv with numpy<2 over this environment's packages for --python-env, then exit")
    p.add_argument("--log-verbose", type=non_negative_int, nargs="?", const=1, default=0, help="tritonserver verbose logging level (1 if given bare)")
    p.add_argument("--log-file", help="write the server's output there instead of the terminal")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for the models to load")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


@entry("medusa-serve")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    if args.make_stub_env:
        try:
            folder = make_stub_env(args.make_stub_env)
        except (*USER_ERRORS, subprocess.CalledProcessError) as exc:
            return fail("medusa-serve", exc)
        print(f"wrote {folder}: pass --python-env {folder} (or set {STUB_ENV_VAR}={folder})")
        return 0
    if not args.repo:
        parser.error("the model repository is required")
    try:
        config = ServeConfig(repo=args.repo, models=tuple(args.model or ()), host=args.host, allow_remote=args.allow_remote,
                             grpc_port=args.port_grpc or None, http_port=args.port_http or None, metrics_port=args.port_metrics or None,
                             python_env=args.python_env, log_verbose=args.log_verbose, log_file=args.log_file,
                             startup_timeout=args.startup_timeout)
    except ServeError as exc:
        return fail("medusa-serve", exc)
    server = TritonServer(config, inherit_output=args.log_file is None)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the server as Ctrl-C does, loading or serving
    try:
        return _serve(server, args.repo)
    except USER_ERRORS as exc:
        return fail("medusa-serve", exc)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def _serve(server: TritonServer, repo: str) -> int:
    try:
        server.start()  # stops what it started if interrupted
    except KeyboardInterrupt:
        return 130
    print(f"medusa-serve: serving {repo} (tritonserver pid {server.pid})\n"
          f"  gRPC     {server.grpc_address}\n  HTTP     {server.http_url}\n  metrics  {server.metrics_url}\n"
          "Ctrl-C stops it.", flush=True)
    try:
        while server.wait(0.5) is None:
            pass
        code = server.stop()
        print(f"medusa-serve: error: tritonserver exited on its own with status {code}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("medusa-serve: stopping", file=sys.stderr, flush=True)
        code = server.stop()
        return 0 if code == 0 else 1


def build_repo_parser() -> argparse.ArgumentParser:
    p = Parser(prog="medusa-triton-repo", description="Write a Triton model repository that serves an exported engine.")
    p.add_argument("--engine", required=True, help="an exported engine folder, .onnx or .plan (referenced by its path relative to the "
                                                   "repository's model folder unless --copy-engine)")
    p.add_argument("--copy-engine", action="store_true", help="copy the engine into the model folder (hard links where possible): "
                                                              "a self-contained repository")
    p.add_argument("--out", required=True, help="the model repository folder (created; other models in it are kept)")
    p.add_argument("--model-name", default="medusa")
    p.add_argument("--tree", help="the heads' template: preset, chain-N or JSON file (default: the engine's)")
    p.add_argument("--draft", type=drafter_list, metavar="DRAFTERS",
                   help="drafters merged into each step's tree: a comma-separated subset of heads,lookup,recycle, or none "
                        "(plain decoding; default: every drafter the engine supports)")
    p.add_argument("--max-batch", type=positive_int, help="concurrent sequences (default: the engine's)")
    p.add_argument("--max-context", type=positive_int, help="default: the engine's")
    p.add_argument("--threads", type=positive_int, help="ONNX Runtime intra-op threads (default: its own)")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="max_tokens of a request that sends none")
    p.add_argument("--max-tokens-limit", type=positive_int,
                   help="a request asking for more new tokens is refused (default: 1024, or the context if smaller)")
    p.add_argument("--request-timeout", type=float, default=0.0,
                   help="seconds from arrival after which a request ends with finish_reason timeout; a request may ask for "
                        "less with its timeout_s input (default 0: no deadline)")
    p.add_argument("--temperature", type=float, default=0.0, help="temperature of a request that sends none (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="top_p of a request that sends none")
    p.add_argument("--chat-template", choices=["auto", "on", "off"], default="auto", help="apply the chat template to text_input (auto: the engine's default)")
    p.add_argument("--force", action="store_true", help="replace an existing model folder of the same name")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


@entry("medusa-triton-repo")
def repo_main(argv: list[str] | None = None) -> int:
    args = build_repo_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        from medusa_trt.exporter.triton_repo import TritonRepoConfig, write_triton_repo  # no torch: works in the lean install

        folder = write_triton_repo(TritonRepoConfig(
            engine=args.engine, repo=args.out, model_name=args.model_name, tree=args.tree, drafters=args.draft, max_batch=args.max_batch,
            max_context=args.max_context, threads=args.threads, max_tokens=args.max_tokens, max_tokens_limit=args.max_tokens_limit,
            request_timeout=args.request_timeout, temperature=args.temperature,
            top_p=args.top_p, chat_template={"auto": None, "on": True, "off": False}[args.chat_template], overwrite=args.force,
            copy_engine=args.copy_engine))
    except USER_ERRORS as exc:
        return fail("medusa-triton-repo", exc)
    print(f"wrote {folder}/config.pbtxt, {folder.name}/1/model.py: serve it with medusa-serve {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
