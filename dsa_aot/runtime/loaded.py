"""One entry loaded on one device, and the launch hot path.

The first use of an entry on a device reads its cubin and its launcher from their groups, checks both
against the sha256 the index records (and the launcher's kernels and parameter sizes against the index), loads
the cubin with cuLibraryLoadData and runs the kernel set-up the JIT's host code does. Per (entry,
device) the launch configs, parameter buffers and void** arrays exist once; a call rewrites the
run-time bytes in place (the lifted ``launch``) and updates only the config fields that changed.

Threading: any number of threads may call one LoadedEntry at once. A lock per entry is held from
the first byte a call writes into the entry's parameter buffers until its last launch has returned
(cuLaunchKernelEx copies the parameters before it returns), so each launch carries exactly its own
call's bytes, dims and stream. Calls of different entries do not wait for each other.

Devices: launches go to the entry's device whatever the calling thread's current context is. If it
is not that device's primary context, that context is pushed for the launches and popped after.

Nothing is half-done: the lifted code runs to the end (it raises on inputs the JIT's own checks
refuse) and every launch's dims are checked before the first launch; a refused call leaves no
config field or cached argument behind.
"""

from __future__ import annotations

import ctypes
import threading
import time
import types
from pathlib import Path

from ..errors import LaunchError
from ..policy.launch import CLUSTER_DIM, COOPERATIVE, PDL, PREFERRED_CLUSTER_DIM
from .bytecode import code_for
from .device import primary_context
from .driver import check, drv

__all__ = ["LoadedEntry", "Prepared"]

_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1
_ENUMS: dict = {}  # (enum class, int) -> member: cuda-python builds a member in ~50 µs


def _enum(cls, v):
    m = _ENUMS.get((cls, v))
    if m is None:
        m = _ENUMS[cls, v] = cls(v)
    return m


def _attr_value(d, aid, fields):
    """Build a CUlaunchAttribute from the lifted (offset, size, value) fields of its 64-byte value."""
    a = d.CUlaunchAttribute()
    a.id = _enum(d.CUlaunchAttributeID, aid)
    words = {o: v for o, s, v in fields}
    if aid == COOPERATIVE:
        a.value.cooperative = words.get(0, 0)
    elif aid == PDL:
        a.value.programmaticStreamSerializationAllowed = words.get(0, 0)
    elif aid in (CLUSTER_DIM, PREFERRED_CLUSTER_DIM):
        dim = a.value.clusterDim
        dim.x, dim.y, dim.z = words.get(0, 0), words.get(4, 0), words.get(8, 0)
    else:
        raise LaunchError(f"launch attribute id {aid} is not supported by this runtime; rebuild with a matching dsa-aot")
    return a


def _launcher_module(index, entry: dict):
    """The entry's lifted launcher, executed from its checked bytes, and checked against the index."""
    name = entry["id"]
    source = index.member(entry, "launcher")
    mod = types.ModuleType(f"aot_launcher_{name.replace('.', '_')}")
    mod.__file__ = str(Path(index.root) / "packs" / entry["launcher"] / f"{name}.py")  # inside its group: what tracebacks name
    try:
        exec(code_for(source, entry["launcher_sha256"], mod.__file__), mod.__dict__)  # noqa: S102  (generated at build time; sha256 checked above)
    except Exception as e:  # noqa: BLE001
        raise LaunchError(f"launcher of {name} does not load ({type(e).__name__}: {e}). Reinstall or rebuild the wheel") from None
    params = entry.get("params") or {}
    kernels = set(entry.get("kernels") or ())
    problems = []
    if not set(getattr(mod, "KERNELS", ())) <= kernels:
        problems.append(f"kernels {sorted(set(getattr(mod, 'KERNELS', ())) - kernels)} that the cubin does not have (it has {sorted(kernels)})")
    for i, L in enumerate(getattr(mod, "LAUNCHES", ())):
        sizes = [size for _, size in L["params"]]
        if L["kernel"] not in kernels or sizes != params.get(L["kernel"]):
            problems.append(f"launch {i} of {L['kernel'][:60]}… passes parameters of {sizes} bytes (the cubin's kernel takes {params.get(L['kernel'])})")
    if problems or not getattr(mod, "LAUNCHES", ()):
        raise LaunchError(f"launcher of {name} does not match the build's index: {'; '.join(problems) or 'no launches'}. Reinstall or rebuild the wheel; nothing was launched")
    return mod


class LoadedEntry:
    """One entry loaded on one device: kernels, per-device set-up done, launch state prebuilt."""

    def __init__(self, index, entry: dict, device: int):
        d = drv()
        t0 = time.perf_counter()
        self.entry, self.device = entry, device
        data = index.member(entry, "cubin")
        mod = _launcher_module(index, entry)
        self.mod = mod
        self._keep = data  # cuLibraryLoadData may reference the image; keep it alive with the library
        dev = check(d.cuDeviceGet(device), "cuDeviceGet")
        self._ctx = primary_context(device)
        self._ctx_id = int(self._ctx)
        self.library = check(d.cuLibraryLoadData(data, None, None, 0, None, None, 0), f"cuLibraryLoadData({entry['id']})")
        self.kernels = {}
        for sym in mod.KERNELS:
            self.kernels[sym] = check(d.cuLibraryGetKernel(self.library, sym.encode()), f"cuLibraryGetKernel({sym})")

        def dattr(attr):
            return check(d.cuDeviceGetAttribute(_enum(d.CUdevice_attribute, attr), dev), f"cuDeviceGetAttribute({attr})")

        def kattr(sym, attr):
            return check(d.cuKernelGetAttribute(_enum(d.CUfunction_attribute, attr), self.kernels[sym], dev), f"cuKernelGetAttribute({attr}, {sym})")

        def set_attr(sym, attr, value):
            check(d.cuKernelSetAttribute(_enum(d.CUfunction_attribute, attr), value, self.kernels[sym], dev), f"cuKernelSetAttribute({attr}={value}, {sym})")

        mod.setup(dattr, kattr, set_attr)
        # launch state, built once
        self.bufs, self.ptr_arrays, self.cfgs, self.funcs, self.last = [], [], [], [], []
        self._param_addrs = []
        for L in mod.LAUNCHES:
            tmpl = bytes.fromhex(L["template"])
            buf = (ctypes.c_char * max(8, len(tmpl))).from_buffer_copy(tmpl.ljust(max(8, len(tmpl)), b"\0"))
            arr = (ctypes.c_void_p * max(1, len(L["params"])))(*[ctypes.addressof(buf) + off for off, _ in L["params"]])
            cfg = d.CUlaunchConfig()
            attrs = [_attr_value(d, aid, fields) for aid, fields in L["attrs"]]
            cfg.attrs = attrs
            cfg.numAttrs = len(attrs)
            self.bufs.append(buf)
            self.ptr_arrays.append(arr)
            self._param_addrs.append(ctypes.addressof(arr))
            self.cfgs.append(cfg)
            self.funcs.append(d.CUfunction(int(self.kernels[L["kernel"]])))
            self.last.append(None)
        self._launch_ex = d.cuLaunchKernelEx
        self._get_ctx, self._push, self._pop = d.cuCtxGetCurrent, d.cuCtxPushCurrent, d.cuCtxPopCurrent
        self._lock = threading.Lock()
        self._last_args = self._last_seq = None
        self._prepared = None  # the last Prepared (read without the lock: replaced whole, never changed)
        self._loops = bool(getattr(mod, "LOOPS", False))
        self._lifted = mod.launch
        self.load_ms = (time.perf_counter() - t0) * 1e3

    def _fill(self, args, snapshot: bool) -> list:
        """Run the lifted code (it raises on inputs the JIT's own checks refuse) and check every launch's
        dims; return [(site, dims, bytes or None)]. Call with the lock held: it writes the buffers."""
        seq, bufs = [], self.bufs
        self._lifted(lambda k, dims: seq.append((k, dims, bytes(bufs[k]) if snapshot else None)), *bufs, *args)
        for _, dims, _ in seq:
            if min(dims[:6]) <= 0 or max(dims[:6]) > _U32 or not 0 <= dims[6] <= _U32 or not 0 <= dims[7] <= _U64:
                raise LaunchError(f"{self.entry['id']}: launch dims {dims} out of range (grid and block in [1, 2**32), "
                                  f"shared memory and stream unsigned); the op wrapper should have refused these inputs; nothing was launched")
        return seq

    def _launch(self, seq):
        """Launch ``seq`` on this entry's device (lock held); a site with bytes first gets them back into its buffer."""
        err, cur = self._get_ctx()
        pushed = int(cur) != self._ctx_id
        if pushed:
            check(self._push(self._ctx), "cuCtxPushCurrent")
        try:
            for i, dims, snap in seq:
                cfg = self.cfgs[i]
                if dims != self.last[i]:
                    self.last[i] = None  # written field by field: valid again only once all are
                    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = dims[0], dims[1], dims[2]
                    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = dims[3], dims[4], dims[5]
                    cfg.sharedMemBytes = dims[6]
                    cfg.hStream = dims[7]
                    self.last[i] = dims
                if snap is not None:  # this firing's bytes back into the site's buffer: the launch copies them
                    ctypes.memmove(self.bufs[i], snap, len(snap))
                err = self._launch_ex(cfg, self.funcs[i], self._param_addrs[i], 0)[0]
                if err:
                    check((err,), f"cuLaunchKernelEx({self.mod.LAUNCHES[i]['kernel'][:60]}…, entry {self.entry['id']})")
        finally:
            if pushed:
                self._pop()

    def __call__(self, *args):
        """Launch every kernel of this entry with the JIT host code's arguments (hot path).

        The lifted code runs to the end first and every launch's dims are checked; then the launches
        go out in the JIT's order, on this entry's device."""
        with self._lock:
            if args == self._last_args:  # same tensors, scalars and stream: the param bytes are already there
                seq = self._last_seq
            else:
                self._last_args = None  # a fill that raises half way must not leave a stale hit behind
                seq = self._fill(args, self._loops)  # a site that can fire more than once keeps each firing's bytes
                if not self._loops:
                    self._last_args, self._last_seq = args, seq
            self._launch(seq)

    def prepare(self, *args) -> "Prepared":
        """Check a call and keep its launches' bytes, launching nothing: an op that runs several entries
        (and memsets) prepares them all before it changes anything, then fires them in order. The last
        prepared call is kept (its bytes are immutable): the same arguments again skip the lifted code."""
        hit = self._prepared
        if hit is not None and hit.args == args:
            return hit
        with self._lock:
            self._last_args = None  # the buffers are about to hold this call's bytes, not the cached call's
            p = self._prepared = Prepared(self, self._fill(args, True), args)
            return p


class Prepared:
    """The launches of one call of an entry, checked and with their bytes: ``fire()`` sends them."""

    __slots__ = ("entry", "seq", "args")

    def __init__(self, entry: LoadedEntry, seq: list, args: tuple):
        self.entry, self.seq, self.args = entry, seq, args

    def fire(self) -> None:
        le = self.entry
        with le._lock:
            le._last_args = None
            le._launch(self.seq)
