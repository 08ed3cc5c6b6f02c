"""The shipped build: its index, per-device loaded entries, and the launch hot path.

Nothing here runs at import. The index is read on first use; a cubin is read, checked against its
sha256 and arch, and loaded with cuLibraryLoadData the first time an entry is used on a device (or by
:func:`preload`). Per (entry, device) the launch configs, parameter buffers and void** arrays exist
once; a call rewrites the run-time bytes in place (the lifted ``launch``) and updates only config
fields that changed.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import threading
import time
from pathlib import Path

from ..errors import ArchMismatchError, KernelNotFoundError, LaunchError
from ..cubin import read_cubin
from .driver import check, drv


def read_cubin_arch(data: bytes) -> str:
    return read_cubin(data).arch

__all__ = ["Index", "index", "LoadedEntry", "device_arches", "device_index", "GENERATED"]

GENERATED = Path(__file__).resolve().parent.parent / "_generated"

# compute capability -> cubin arches that run on it, best first (an "a" cubin runs on exactly its arch)
_CAP_ARCHES = {(9, 0): ("sm_90a",), (10, 0): ("sm_100a", "sm_100f"), (10, 3): ("sm_103a", "sm_100f")}


def device_index(device) -> int:
    """None (torch's current device), an int, 'cuda:N' or a torch.device -> N."""
    import torch

    if device is None:
        return torch.cuda.current_device()
    return device if isinstance(device, int) else torch.device(device).index


def device_arches(cap) -> tuple:
    return _CAP_ARCHES.get(tuple(cap), ())


def _key(d: dict, derived=()) -> tuple:
    return tuple(sorted((k, v) for k, v in d.items() if k not in derived))


class Index:
    """index.json of a build directory: entries by (family, op, key, arch)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        path = self.root / "index.json"
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise KernelNotFoundError(
                f"no build found: {path} is missing. Build the kernels first: `python -m aot build` (from a source checkout) or install the dsa-aot wheel"
            ) from None
        if doc.get("format") != 1:
            raise KernelNotFoundError(f"{path}: index format {doc.get('format')!r} is not 1; rebuild with this version of dsa-aot")
        self.doc = doc
        self.entries = doc["entries"]
        # looked up by the op's own key fields; what the spec derived from them is not part of the lookup
        self.by_key = {(e["family"], e["op"], _key(e["key"], e.get("derived", ("schedule",))), e["arch"]): e for e in self.entries}
        self.arches = sorted({e["arch"] for e in self.entries})
        self._sms = {e["arch"]: e["target"]["sm_count"] for e in self.entries if "target" in e}
        self._loaded: dict = {}
        self._lock = threading.Lock()

    def target_sm_count(self, arch) -> int:
        """The SM count the build's target for ``arch`` declared: persistent grids are baked with it."""
        if arch not in self._sms:
            raise ArchMismatchError(f"this build has no target for {arch} (it has: {', '.join(self.arches)})")
        return self._sms[arch]

    def find(self, family, op, key: dict, arch, hint=""):
        e = self.by_key.get((family, op, _key(key), arch))
        if e is None:
            if arch not in self.arches:
                raise ArchMismatchError(f"this build has no cubins for {arch} (it has: {', '.join(self.arches)}). Add a [[target]] with arch = {arch!r} to the manifest and rebuild")
            fields = ", ".join(f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}" for k, v in sorted(key.items()))
            raise KernelNotFoundError(
                f"no shipped {family}/{op} entry for {key} on {arch}{hint}. Add to the manifest:\n"
                f"  [[bucket]]\n  family = {family!r}\n  op = {op!r}\n  {fields}\nand rebuild the wheel"
            )
        return e

    def loaded(self, entry, device: int) -> "LoadedEntry":
        k = (entry["id"], device)
        le = self._loaded.get(k)
        if le is None:
            with self._lock:
                le = self._loaded.get(k)
                if le is None:
                    le = LoadedEntry(self.root, entry, device)
                    self._loaded[k] = le
        return le


_INDEX = None
_INDEX_LOCK = threading.Lock()


def index() -> Index:
    global _INDEX
    if _INDEX is None:
        with _INDEX_LOCK:
            if _INDEX is None:
                _INDEX = Index(GENERATED)
    return _INDEX


def _attr_value(d, aid, fields):
    """Build a CUlaunchAttribute from the lifted (offset, size, value) fields of its 64-byte value."""
    a = d.CUlaunchAttribute()
    a.id = d.CUlaunchAttributeID(aid)
    words = {o: v for o, s, v in fields}
    if aid == 2:
        a.value.cooperative = words.get(0, 0)
    elif aid == 6:
        a.value.programmaticStreamSerializationAllowed = words.get(0, 0)
    elif aid in (4, 11):
        dim = a.value.clusterDim
        dim.x, dim.y, dim.z = words.get(0, 0), words.get(4, 0), words.get(8, 0)
    else:
        raise LaunchError(f"launch attribute id {aid} is not supported by this runtime; rebuild with a matching dsa-aot")
    return a


class LoadedEntry:
    """One entry loaded on one device: kernels, per-device set-up done, launch state prebuilt."""

    def __init__(self, root: Path, entry: dict, device: int):
        d = drv()
        t0 = time.perf_counter()
        self.entry, self.device = entry, device
        path = root / entry["cubin"]
        try:
            data = path.read_bytes()
        except OSError as e:
            raise LaunchError(f"cannot read cubin {path}: {e.strerror}. Reinstall the wheel") from None
        sha = hashlib.sha256(data).hexdigest()
        if sha != entry["sha256"]:
            raise LaunchError(f"cubin {path} is corrupted: sha256 {sha} != {entry['sha256']} recorded at build time. Reinstall or rebuild the wheel; nothing was launched")
        arch = read_cubin_arch(data)
        if arch != entry["arch"]:
            raise LaunchError(f"cubin {path} is for {arch}, but the index lists it as {entry['arch']}. Reinstall or rebuild the wheel; nothing was launched")
        spec = importlib.util.spec_from_file_location(f"aot_launcher_{entry['id'].replace('.', '_')}", root / entry["launcher"])
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        self.mod = mod
        self._keep = data  # cuLibraryLoadData may reference the image; keep it alive with the library
        self.library = check(d.cuLibraryLoadData(data, None, None, 0, None, None, 0), f"cuLibraryLoadData({entry['id']})")
        self.kernels = {}
        for sym in mod.KERNELS:
            self.kernels[sym] = check(d.cuLibraryGetKernel(self.library, sym.encode()), f"cuLibraryGetKernel({sym})")
        dev = check(d.cuDeviceGet(device), "cuDeviceGet")

        def dattr(attr):
            return check(d.cuDeviceGetAttribute(d.CUdevice_attribute(attr), dev), f"cuDeviceGetAttribute({attr})")

        def kattr(sym, attr):
            return check(d.cuKernelGetAttribute(d.CUfunction_attribute(attr), self.kernels[sym], dev), f"cuKernelGetAttribute({attr}, {sym})")

        def set_attr(sym, attr, value):
            check(d.cuKernelSetAttribute(d.CUfunction_attribute(attr), value, self.kernels[sym], dev), f"cuKernelSetAttribute({attr}={value}, {sym})")

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
        self._last_args = self._last_seq = None
        self._seq = []
        self._loops = bool(getattr(mod, "LOOPS", False))
        self._fill = mod.launch
        self.load_ms = (time.perf_counter() - t0) * 1e3

    def _record(self, k, dims):
        # a site that can fire more than once per call (a launch loop) keeps a copy of its bytes
        self._seq.append((k, dims, bytes(self.bufs[k]) if self._loops else None))

    def __call__(self, *args):
        """Launch every kernel of this entry with the JIT host code's arguments (hot path).

        The lifted code runs to the end first (it raises before anything is launched); then the
        launches go out in the JIT's order."""
        if args == self._last_args:  # same tensors, scalars and stream: the param bytes are already there
            seq = self._last_seq
        else:
            self._last_args = None  # a fill that raises half way must not leave a stale hit behind
            self._seq = seq = []
            self._fill(self._record, *self.bufs, *args)
            if not self._loops:
                self._last_args, self._last_seq = args, seq
        for i, dims, snap in seq:
            cfg = self.cfgs[i]
            if dims != self.last[i]:
                if min(dims[:6]) <= 0:
                    raise LaunchError(f"{self.entry['id']}: empty launch (grid {dims[:3]}, block {dims[3:6]}); the op wrapper should have skipped it")
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
