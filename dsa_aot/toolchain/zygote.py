"""A canonical compile process: the compile stage's cubins do not depend on who runs the build.

Why (docs/fidelity.md has the measurements): the PTX the DSL generates for a key is always the same,
but the cubin its in-process PTX compiler makes of it depends on the process's memory layout. Two
fork children of one process compile a key to the same cubin; two processes generally do not (ASLR,
Python's hash seed, the heap history of everything the process did before). For most kernels that
changes nothing; for the two-CTA sparse attention backward kernels it picks one of several register
assignments (the D576 kernel: a different cubin at nearly every compile).

So the compile stage does not compile in a process of its own making. Per (arch, family) it starts
one **zygote** in a canonical state: the interpreter started through fixed symlinks under a fixed path
(``/tmp/dsa-aot-canonical-<uid>``, held under a lock: a copy of the package's and the specs' sources,
every site directory and the interpreter itself are reached through it, so their real locations and
whatever else lies in the checkout do not reach the heap), ``-S``
with the site directories added in the build's order, an empty environment but for
``PYTHONHASHSEED=0`` and the DSL's settings, working directory ``/``, address-space randomisation off
(``personality(ADDR_NO_RANDOMIZE)``). It imports the DSL, its family's spec and the cudnn modules the
spec names (``PRELOAD``) once, then forks one compile process per entry. Nothing in it reads the family
registry or another family's spec: when a zygote served every family, registering a family changed the
heap its compiles start from, and with it the cubins of the two-CTA kernels of another family (measured:
37 sparse attention backward entries), so an entry's cache key would have had to cover every family. It never imports from cached bytecode (``-B`` and an empty
``PYTHONPYCACHEPREFIX``: whether a ``.pyc`` existed would change what the import allocated), and its
loop between forks leaves no state behind: it reads a fixed-size ticket, forks a child that forks the
compile process and exits, and reaps that child (a warm-up round first, so every real fork sees the
steady state). The compile process reports to the build, which is its subreaper, directly. So an
entry's cubin depends on its key, the toolchain and the sources, and not on the build directory, the
manifest, the other registered families, the order or the concurrency of the build, or the caller's
process (tests/unit/toolchain/test_zygote.py).

The fidelity stage runs cudnn's own route for a key in the same kind of process (request ``task``
``"fidelity"``), so its verdicts are as reproducible as the cubins they judge.

Public API: :class:`Zygote` (a context manager: ``submit(request)`` / ``wait_one()``) and
:func:`run` (a queue of requests through one zygote per arch).
"""

from __future__ import annotations

import ctypes
import fcntl
import importlib
import os
import pickle
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ..errors import CompileError
from .sources import REPO

__all__ = ["Zygote", "canonical_dir", "run"]

_ADDR_NO_RANDOMIZE = 0x0040000
_WIDTH = 6  # fork indices are written with a fixed width: every fork message allocates the same


# The stages' work a compile process runs, by name: imported in the compile process as ``from .compile import
# _compile_one`` did (the same __import__ call), so the zygote module imports no stage and no stage imports it back.
# Requests stay as they were: naming the function in the request (one more key) changed the H128 D512 two-CTA cubin.
STAGES = ("dsa_aot.toolchain.compile", "dsa_aot.toolchain.fidelity")
_TASKS = {"compile": ("compile", "_compile_one"), "fidelity": ("fidelity", "_check_one")}


def canonical_dir() -> Path:
    """Where the canonical paths live: ``/tmp/dsa-aot-canonical-<uid>``. ``AOT_CANONICAL_DIR`` names
    another (two builds on one machine at once; the cubins of layout-sensitive kernels can then
    differ from a build that used the default, so the compile and fidelity caches key on it)."""
    return Path(os.environ.get("AOT_CANONICAL_DIR") or f"/tmp/dsa-aot-canonical-{os.getuid()}")


# The packages the compile processes import from site directories: the directories holding them are
# the zygote's whole import path besides the standard library and the repository. (Not the build's
# sys.path as such: a script directory or the test directory on it would change the zygote's state.)
_TOOLCHAIN = ("nvidia_cutlass_dsl", "cudnn", "torch", "tvm_ffi", "cuda")


def _site_dirs() -> list:
    """The site directories that provide the toolchain, in the build's sys.path order."""
    import importlib.util

    found = set()
    for name in _TOOLCHAIN:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise CompileError(f"the build toolchain is incomplete: {name} is not importable (run ci/setup.sh)")
        for loc in spec.submodule_search_locations:
            found.add(os.path.realpath(os.path.dirname(loc)))
    order = [os.path.realpath(p) for p in sys.path if p]
    return sorted(found, key=lambda d: order.index(d) if d in order else len(order))


_BOOT = """import site, sys
sys.path[:] = [p for p in sys.path if p]
for p in {sites!r}:
    site.addsitedir(p)
sys.path.insert(0, {src!r})
from dsa_aot.toolchain.zygote import _serve
_serve({family!r})
"""


# what a compile or fidelity process imports besides its family's spec (with their import closures)
_PROCESS_SOURCES = ("dsa_aot/toolchain/zygote.py", "dsa_aot/toolchain/specs.py", "dsa_aot/toolchain/compile.py", "dsa_aot/toolchain/fidelity.py")


def source_files(family: str) -> list:
    """The files a canonical process of ``family`` gets (paths under the checkout or the specs directory):
    the import closures of the processes' own modules and of the family's spec, nothing else.

    The import system caches the listing of every directory it searches, and the cubins of some kernels
    depend on the compiling process's heap: untracked entries of a checkout (``.venv``, ``.cache``, a built
    ``dsa_aot/_generated``) reached it (measured: a D576 cubin changed with the checkout root's listing),
    and so did one more policy module of another family (the two-CTA sparse attention backward cubins
    changed when the MoE family's policy file was added). With only these files the listings are a
    function of what the compile cache key covers (:func:`source_names` goes into it)."""
    from .sources import closure
    from .specs import spec_path

    files = {p for f in _PROCESS_SOURCES for p in closure(REPO / f)} | set(closure(spec_path(family)))
    return sorted(files)


def source_names(family: str) -> list:
    """The names :func:`_copy_sources` gives :func:`source_files` under the canonical ``src``."""
    return [str(rel) for _, rel in _placed(family)]


def _placed(family):
    from .specs import kernels_dir

    out = []
    for p in source_files(family):
        for base, rel in ((REPO, Path()), (kernels_dir(), Path("kernels"))):
            try:
                out.append((p, rel / Path(p).relative_to(base)))
                break
            except ValueError:
                continue
        else:
            raise CompileError(f"{p}: a source of the {family} compile processes outside the checkout and the specs directory")
    return out


def _copy_sources(dst: Path, family: str) -> None:
    """The files of :func:`source_files` under ``dst``, as they lie in the checkout."""
    for p, rel in _placed(family):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dst / rel)


def _no_aslr():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.personality(_ADDR_NO_RANDOMIZE) == -1:
        os.write(2, b"dsa-aot zygote: personality(ADDR_NO_RANDOMIZE) failed\n")
        os._exit(97)


class Zygote:
    """One canonical compile process for ``family``'s entries on ``arch``; ``submit(request)`` compiles
    in a process forked from it."""

    def __init__(self, arch: str, family: str, debug_dump: str | None = None):
        from ..policy.families import FAMILIES

        if family not in FAMILIES:
            raise CompileError(f"unknown kernel family {family!r} (registered: {sorted(FAMILIES)})")
        self.arch, self.family, self.debug_dump = arch, family, debug_dump
        self.proc = None
        self._lock = None
        self._n = 0
        self._pending = {}  # ticket -> pid of its compile process (0 until it reports)

    def __enter__(self):
        canon = canonical_dir()
        self._lock = open(f"{canon}.lock", "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # one build at a time uses the canonical paths
        shutil.rmtree(canon, ignore_errors=True)
        (canon / "io").mkdir(parents=True)
        os.symlink(os.path.realpath(sys.executable), canon / "python")
        _copy_sources(canon / "src", self.family)
        sites = []
        for i, d in enumerate(_site_dirs()):
            os.symlink(d, canon / f"s{i}")
            sites.append(str(canon / f"s{i}"))
        env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "CUTE_DSL_ARCH": self.arch, "CUTE_DSL_DISABLE_FILE_CACHING": "1",
               "PYTHONPYCACHEPREFIX": str(canon / "no-pycache"), "AOT_CANONICAL_DIR": str(canon)}
        if self.debug_dump:  # opt-in: kept files for a person to read; the build is marked not for shipping
            d = Path(self.debug_dump) / self.arch
            d.mkdir(parents=True, exist_ok=True)
            env.update(CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=str(d.resolve()))
        _become_subreaper()  # the compile processes are orphaned grandchildren of the zygote: reap them here
        boot = _BOOT.format(sites=sites, src=str(canon / "src"), family=self.family)
        self.proc = subprocess.Popen([str(canon / "python"), "-S", "-B", "-c", boot], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, cwd="/", preexec_fn=_no_aslr)
        self._out = self.proc.stdout
        self._buf = b""
        if self._line() != "ready":
            rc = self.proc.wait()
            raise CompileError(f"the {self.arch} {self.family} compile zygote did not start (exit status {rc}; 97: address-space randomisation "
                               f"cannot be turned off here, which reproducible builds need); its stderr is above")
        return self

    def submit(self, request: dict) -> int:
        """Queue one compile (``request``: family, op, key, arch, sm_count); returns its ticket."""
        if (request["arch"], request["family"]) != (self.arch, self.family):
            raise CompileError(f"a {request['family']} {request['arch']} request sent to the {self.family} {self.arch} zygote")
        self._n += 1
        t = self._n
        (canonical_dir() / "io" / f"req-{t:0{_WIDTH}d}.pickle").write_bytes(pickle.dumps(request))
        self._pending[t] = 0
        os.write(self.proc.stdin.fileno(), f"{t:0{_WIDTH}d}\n".encode())
        return t

    def _line(self, timeout=None) -> str | None:
        """The next protocol line, or None when ``timeout`` seconds pass without one."""
        while b"\n" not in self._buf:
            if timeout is not None and not select.select([self._out], [], [], timeout)[0]:
                return None
            chunk = os.read(self._out.fileno(), 4096)
            if not chunk:
                return ""
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def wait_one(self):
        """(ticket, result dict) of the next compile to finish; the result holds ``error`` on failure."""
        while True:
            line = self._line(timeout=1.0)
            if line == "":
                raise CompileError(f"the {self.arch} {self.family} compile zygote exited (status {self.proc.wait()})")
            if line is None:  # nothing reported: has a compile process died without its report?
                for t, pid in self._pending.items():
                    if pid and _reaped(pid, block=False):
                        self._pending.pop(t)
                        return t, {"error": "the compile process died without a result (see its output above)"}
                continue
            word, ticket, rest = line.split(" ", 2)
            t = int(ticket)
            if word == "start":
                self._pending[t] = int(rest)
                continue
            _reaped(self._pending.pop(t), block=True)
            res = canonical_dir() / "io" / f"res-{t:0{_WIDTH}d}.pickle"
            out = pickle.loads(res.read_bytes())
            res.unlink()
            return t, out

    @property
    def pending(self) -> int:
        return len(self._pending)

    def __exit__(self, *exc):
        try:
            if self.proc is not None and self.proc.poll() is None:
                os.write(self.proc.stdin.fileno(), b"q" * (_WIDTH + 1))
                self.proc.wait(timeout=60)
        finally:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
            shutil.rmtree(canonical_dir(), ignore_errors=True)
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
        return False


def run(items, request_of, on_done, jobs=None, debug_dump=None) -> None:
    """Send ``request_of(item)`` (family, op, key, arch, sm_count; ``task`` "compile" by default or
    "fidelity") for every item through one zygote per (arch, family), at most ``jobs`` at a time; call
    ``on_done(item, result)`` as each finishes (``result`` holds ``error`` on failure)."""
    jobs = max(1, jobs or os.cpu_count() or 1)
    groups: dict = {}
    for item in items:
        r = request_of(item)
        groups.setdefault((r["arch"], r["family"]), []).append(item)
    for (arch, family), group in sorted(groups.items()):
        queue = list(group)
        with Zygote(arch, family, debug_dump) as z:
            tickets = {}
            while queue or z.pending:
                while queue and z.pending < jobs:
                    item = queue.pop(0)
                    tickets[z.submit(request_of(item))] = item
                t, result = z.wait_one()
                on_done(tickets.pop(t), result)


def _reaped(pid: int, block: bool) -> bool:
    """Whether compile process ``pid`` has exited, reaping it. It becomes this process's child only when
    the zygote's short-lived child that forked it has exited, and under load (a niced build beside
    other work) that can be seconds after it reported ``start``: until then ``waitpid`` says ECHILD,
    which once stopped a build. ``block``: wait for the exit and the reparenting."""
    while True:
        try:
            return os.waitpid(pid, 0 if block else os.WNOHANG)[0] != 0
        except ChildProcessError:
            try:
                os.kill(pid, 0)  # running, or a zombie not yet handed to us
            except ProcessLookupError:
                return True  # gone (reaped elsewhere): nothing left to wait for
            if not block:
                return False
            time.sleep(0.01)


def _become_subreaper():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        raise CompileError(f"prctl(PR_SET_CHILD_SUBREAPER) failed (errno {ctypes.get_errno()}): the compile stage reaps its compile processes")


# --- inside the zygote ---------------------------------------------------------------------------


def _serve(family: str):
    import cutlass  # noqa: F401
    import cutlass.cute  # noqa: F401

    from .specs import SPECS

    for mod in SPECS.pin(family).preload:  # this family only: the state must not depend on the others
        __import__(mod)
    report = os.dup(1)  # the compile processes report here; their stdout goes to stderr (the DSL may print)
    os.dup2(2, 1)
    _round(b"0" * _WIDTH + b"\n", report)  # warm-up: every real round starts from the steady state
    os.write(report, b"ready\n")
    while True:
        msg = os.read(0, _WIDTH + 1)
        if len(msg) != _WIDTH + 1 or not msg[:_WIDTH].isdigit():
            break
        _round(msg, report)


def _round(msg: bytes, report: int):
    """Fork a child that forks the compile process and exits; reap the child. Nothing persists in the zygote."""
    pid = os.fork()
    if pid == 0:
        if os.fork() == 0:
            _compile_process(msg, report)
        os._exit(0)
    os.waitpid(pid, 0)


def _compile_process(msg: bytes, report: int):
    ticket = msg[:_WIDTH].decode()
    if ticket == "0" * _WIDTH:
        os._exit(0)
    os.write(report, f"start {ticket} {os.getpid()}\n".encode())
    io = canonical_dir() / "io"
    code = 0
    try:
        req = pickle.loads((io / f"req-{ticket}.pickle").read_bytes())
        if req.get("task") == "modules":  # what a compile process imports before its compile (the tests read it)
            for stage in STAGES:
                importlib.import_module(stage)
            out = sorted(sys.modules)
        else:
            name, fn = _TASKS[req.get("task", "compile")]
            task = getattr(__import__(name, globals(), None, (fn,), 1), fn)
            out = task(req["family"], req["op"], req["key"], req["arch"], req["sm_count"])
    except BaseException as e:  # noqa: BLE001  (reported to the build with the entry)
        out, code = {"error": f"{type(e).__name__}: {e}"}, 1
    tmp = io / f".res-{ticket}.pickle"
    tmp.write_bytes(pickle.dumps(out))
    os.replace(tmp, io / f"res-{ticket}.pickle")
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(report, f"done {ticket} {code}\n".encode())
    os._exit(code)
