"""The Triton Inference Server path of ``medusa-serve --api triton``: the server process and its files.

    medusa-triton-repo --engine build/model.onnx --out build/triton
    medusa-serve build/triton [--port-grpc 8001 --port-http 8000 --port-metrics 8002]
    medusa-serve build/smollm2-135m-medusa --api triton      # an engine: its repository goes in the run folder

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
or ``MEDUSA_TRT_STUB_ENV``; by default it is ``.venv-stub`` beside the environment running medusa-serve where
``make install`` made one (``STUB_FOLDER``), else that environment itself. To keep
numpy 2 in the main environment, ``medusa-serve --make-stub-env DIR`` makes a small venv that
holds only numpy<2 and sees the main environment's packages behind it.

Triton 2.51 (nvidia-pytriton 0.7.0) quirks met here: a gRPC stream that is *cancelled* (not
closed) after Triton itself refused its request (an input the config does not name, a wrong
type or shape) keeps a reference to the model, so unloading at stop waits out
``--exit-timeout-secs`` and the server then exits with status 1 (``stop()`` removes the stub's
shared memory it could not free); ``stream_generate`` closes its streams, which avoids it. And a
stub that loses its server mid-generation (a crash, SIGKILL) may run on: ``stop()`` ends the
server's whole process group.

Python API (what the tests use; ``serving.client.stream_generate`` talks to it):

    with TritonServer(ServeConfig(repo="build/triton")) as server:   # started and ready
        client = tritonclient.grpc.InferenceServerClient(server.grpc_address)
    TritonServer(ServeConfig(engine=TritonRepoConfig(engine="build/e", repo=""))).start()  # an engine, no repository of yours
"""

from __future__ import annotations

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

from medusa_trt.runtime.errors import MedusaError

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install --no-deps nvidia-pytriton==0.7.0 (and 'tritonclient[grpc]' for clients)"
STUB_ENV_VAR = "MEDUSA_TRT_STUB_ENV"
STUB_FOLDER = ".venv-stub"  # the stub's environment make install makes, beside .venv
GRPC_PORT, HTTP_PORT, METRICS_PORT = 8001, 8000, 8002  # tritonserver's own defaults: medusa-serve's for a repository


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
    """Check an environment (a venv or Python prefix; None: $MEDUSA_TRT_STUB_ENV, else ``STUB_FOLDER`` beside this
    environment where there is one, else this one) can run the stub and medusa-trt's runtime; fail with what to install
    otherwise."""
    beside = Path(sys.prefix).parent / STUB_FOLDER  # make install's, for a shell that never set the variable
    python_env = python_env or os.environ.get(STUB_ENV_VAR) or (beside if (beside / "bin" / "python3").exists() else None)
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
        raise ServeError(
            f"{where} cannot import {'; '.join(info['missing'])}: install medusa-trt there, or choose another with --python-env"
        )
    if int(info["numpy"].split(".")[0]) >= 2:
        raise ServeError(
            f"{where} has numpy {info['numpy']}, but the Triton Python backend stub in nvidia-pytriton is built against numpy 1.x "
            f"(it garbles tensors under numpy 2): pip install 'numpy<2' there, or make a small environment for the stub with "
            f"'medusa-serve --make-stub-env DIR' and pass --python-env DIR (or set {STUB_ENV_VAR})"
        )
    libdir = Path(info["libdir"])
    if not info["shared"] or not any(libdir.glob(f"libpython{info['version']}*.so*")):
        raise ServeError(
            f"{where}: its Python {info['version']} has no shared libpython in {libdir}, which the Triton stub links: "
            "use a Python built with --enable-shared (python.org, pyenv with PYTHON_CONFIGURE_OPTS=--enable-shared, "
            "distro packages)"
        )
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
    inner = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    ours = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()})
    lines = [f"import site; site.addsitedir({p!r})" for p in ours if Path(p).is_dir()]
    (Path(inner) / "zz_medusa_trt_base_env.pth").write_text("\n".join(lines) + "\n")
    stub_env(folder)  # the same check medusa-serve makes
    return folder


# ---------------------------------------------------------------------------------- the server


@dataclass(frozen=True)
class ServeConfig:
    repo: str | os.PathLike | None = None  # a Triton model repository (medusa-triton-repo writes one)
    # or an engine to serve: its model folder (this TritonRepoConfig, whose ``repo`` is ignored) is
    # written into the run folder at start and goes with it at stop; exactly one of repo / engine
    engine: object | None = None  # serving.triton_repo.TritonRepoConfig
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
        if (self.repo is None) == (self.engine is None):
            raise ServeError("pass a model repository (repo=) or an engine to serve (engine=), not both")
        if self.engine is not None and self.models:
            raise ServeError("--model picks models of a repository: an engine is served as one model (--model-name)")
        if not is_loopback(self.host) and not self.allow_remote:
            raise ServeError(
                f"--host {self.host} is not a loopback address: the server would take requests from other machines "
                "without authentication; pass --allow-remote to do that on purpose (behind a firewall or an "
                "authenticating proxy), or keep the default 127.0.0.1"
            )


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
            f"--http-restricted-api={restricted}",
            f"--grpc-restricted-protocol={restricted}",
            f"--grpc-address={host}",
            f"--grpc-port={c.grpc_port}",
            f"--http-address={host}",
            f"--http-port={c.http_port}",
            f"--metrics-address={host}",
            f"--metrics-port={c.metrics_port}",
            "--allow-gpu-metrics=false",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--exit-timeout-secs={c.exit_timeout}",
            f"--log-verbose={c.log_verbose}",
        ]

    def start(self) -> TritonServer:
        if self.proc is not None:
            raise ServeError("this server was already started: make a new TritonServer")
        if self.config.engine is not None:
            from medusa_trt.serving.triton_repo import check_engine_config

            check_engine_config(self.config.engine)  # refused here, naming the fix, before the server starts
            models = (self.config.engine.model_name,)
        else:
            repo = Path(self.config.repo).expanduser()
            if not repo.is_dir():
                raise ServeError(f"model repository {repo} does not exist: write one with medusa-triton-repo --engine E --out {repo}")
            models = self._models(repo)
        dist = find_triton()
        env = stub_env(self.config.python_env)
        stub = dist.stub(env.version)
        if not stub.is_file():
            raise ServeError(
                f"nvidia-pytriton has no Python backend stub for Python {env.version}: use Python 3.8-3.13 for the stub's environment"
            )
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
                    requested.grpc_port,
                    requested.http_port,
                    requested.metrics_port,
                }
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
        if self.config.engine is not None:  # the engine's model folder, written here: it goes with the run folder
            from medusa_trt.serving.triton_repo import write_triton_repo

            source = self.run_dir / "repository"
            write_triton_repo(dataclasses.replace(self.config.engine, repo=source))
        else:
            source = Path(self.config.repo).expanduser().resolve()
        repo = self.run_dir / "models"  # the models the server may load, and nothing else
        repo.mkdir()
        for name in models:
            (repo / name).symlink_to(source / name, target_is_directory=True)
        backend = self.run_dir / "backends" / "python"
        backend.mkdir(parents=True)
        for item in dist.python_backend.iterdir():
            (backend / item.name).symlink_to(item)
        (backend / "triton_python_backend_stub").symlink_to(stub)

        server_env = dict(os.environ)
        server_env["PATH"] = f"{env.bin}{os.pathsep}{server_env.get('PATH', '')}"
        server_env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(env.libdir), str(dist.libs), server_env.get("LD_LIBRARY_PATH", "")) if p
        )
        server_env.pop("PYTHONHOME", None)
        out = None
        if not self.inherit_output:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
            out = self._log
        cmd = self.command(dist)
        log.info("starting %s", " ".join(cmd).replace(self._restricted, "medusa-trt-admin=<random>"))
        # its own session: Ctrl-C in a terminal reaches medusa-serve only, which stops the server in order
        self.proc = subprocess.Popen(
            cmd,
            env=server_env,
            stdout=out,
            stderr=None if out is None else subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
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
                # ready means every endpoint answers: tritonserver binds the metrics port after HTTP's
                with opener.open(f"{self.http_url}/v2/health/ready", timeout=2) as response:
                    ready = response.status == 200
                if ready:
                    with opener.open(self.metrics_url, timeout=2) as response:
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
    return subprocess.Popen(
        [sys.executable, "-I", "-c", _WATCHDOG, str(run_dir), shm_prefix],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )


@atexit.register
def _stop_all() -> None:  # a script that forgot stop() or died of an exception leaves no server behind
    for server in list(_RUNNING):
        server.stop()
