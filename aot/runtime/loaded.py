"""One entry loaded on one device, and the launch hot path.

A cubin is read, checked against its sha256, and loaded with cuLibraryLoadData the first time an entry
is used on a device. Per (entry, device) the launch configs, parameter buffers and void** arrays exist
once; a call rewrites the run-time bytes in place (the lifted ``launch``) and updates only config
fields that changed.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import time
from pathlib import Path

from ..errors import LaunchError
from ..policy.launch import CLUSTER_DIM, COOPERATIVE, PDL, PREFERRED_CLUSTER_DIM
from .driver import check, drv

__all__ = ["LoadedEntry"]


def _attr_value(d, aid, fields):
    """Build a CUlaunchAttribute from the lifted (offset, size, value) fields of its 64-byte value."""
    a = d.CUlaunchAttribute()
    a.id = d.CUlaunchAttributeID(aid)
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
