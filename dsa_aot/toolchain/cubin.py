"""Read NVIDIA cubins (CUDA ELF images) and CUDA fatbin containers, with the standard library only.

``read_cubin(data)`` returns a :class:`CubinInfo`: the SASS architecture, the sha256 of the bytes and, per
kernel entry function, its parameter table and resource usage. ``extract_cubins_from_fatbin(data)``
returns the ELF images held in a fatbin (for example the ``kernels_binary`` global that CuTe DSL puts in
the host module).

Where each number comes from (checked against ``cuobjdump -res-usage`` / ``cuobjdump -elf`` 13.2 and
``ptxas -v`` on CUDA 12.9 and 13.0 cubins for sm_80 ... sm_121a; the exact cross-check is in
tests/unit/test_cubin.py):

========================  =====================================================================
``KernelInfo`` field      source in the ELF
========================  =====================================================================
``name``                  the kernel's symbol: STT_FUNC with STO_CUDA_ENTRY (st_other & 0x10)
``params``                EIATTR_KPARAM_INFO in ``.nv.info.<kernel>``, sorted by ordinal; the
                          record's size field has 14 bits, so ptxas writes EIATTR_KPARAM_INFO_V2
                          (16-bit size) for larger parameters (seen for a 20000-byte struct)
``param_bytes``           EIATTR_PARAM_CBANK size, else EIATTR_CBANK_PARAM_SIZE, else
                          max(offset + size) of ``params``
``registers``             EIATTR_REGCOUNT in ``.nv.info`` (cuobjdump REG)
``shared_bytes``          size of ``.nv.shared.<kernel>`` (cuobjdump SHARED): static shared memory
                          only. On sm_90+ the section may also hold 1 KiB of CTA-reserved shared
                          memory, so it can exceed ``ptxas -v``'s "smem" (and be 1024 for a kernel
                          that declares none, e.g. every CuTe DSL kernel here on sm_90a/sm_100a)
``stack_bytes``           EIATTR_MIN_STACK_SIZE (cuobjdump STACK; ptxas "cumulative stack size"),
                          0 when absent, as cuobjdump reports it
``frame_bytes``           EIATTR_FRAME_SIZE of the kernel itself (ptxas "bytes stack frame")
``local_bytes``           size of ``.nv.local.<kernel>`` (cuobjdump LOCAL)
``constant0_bytes``       size of ``.nv.constant0.<kernel>`` (cuobjdump CONSTANT[0])
``spill_stores/loads``    see below
``max_threads``           EIATTR_MAX_THREADS (``__launch_bounds__`` / PTX ``.maxntid``)
``reqntid``               EIATTR_REQNTID (PTX ``.reqntid``; CuTe DSL kernels carry it)
``cluster_dims``          EIATTR_CTA_PER_CLUSTER (``__cluster_dims__`` / ``.reqnctapercluster``);
                          None for clusters chosen at launch time
``max_cluster_rank``      EIATTR_MAX_CLUSTER_RANK (``.maxclusterrank``)
``max_registers``         EIATTR_MAXREG_COUNT: the register cap ptxas honoured (255 = none given)
``num_barriers``          EIATTR_NUM_BARRIERS, else bits 20..24 of the ``.text`` section flags (the
                          older ABI); 0 when neither says otherwise
``attributes``            every record of ``.nv.info.<kernel>``, in file order, as (name, payload)
========================  =====================================================================

Spills. ``cuobjdump -res-usage`` does not report spills; ``ptxas -v`` does ("bytes spill
stores/loads"), and no EIATTR stores those totals. What the cubin does store (ptxas 12.9 and 13.0, every
SM) is EIATTR_ANNOTATIONS: a list of (kind, code offset) pairs where kind 1 ("SpillRefill") marks each
spill or refill instruction. ``spill_stores`` / ``spill_loads`` are recovered by decoding those
instructions: STL (opcode 0x387) and LDL (opcode 0x983) in the low 12 bits of the 128-bit sm_70+
instruction word, access width in bits 73..75. That reproduces ``ptxas -v`` byte for byte on every cubin
tried. They are 0 when the kernel has no spill annotation, and None when an annotated instruction cannot
be decoded (an opcode other than STL/LDL, an unknown width, a pre-sm_70 encoding), i.e. when the total is
not recoverable. A ptxas older than 12.9 was not checked: if it spilled without writing the annotation,
the 0 would be wrong.

Architecture (``CubinInfo.arch``): ``e_ident[EI_ABIVERSION]`` selects the ``e_flags`` layout.

* ABI version 7 (ptxas 12.9 for sm_80 ... sm_90a; OSABI 0x33): SM = ``e_flags & 0xff``; the "a"
  (arch-specific) suffix is bit 11, ``0x800`` (EF_CUDA_ACCELERATORS_V1). sm_90 = 0x5a055a,
  sm_90a = 0x5a0d5a.
* ABI version 8 (ptxas 12.9 for sm_100+, ptxas 13.x for every SM; OSABI 0x41): SM = bits 8..15. ptxas 12.9
  marks "a" with bit 3, ``0x8`` (EF_CUDA_ACCELERATORS): sm_100 = 0x6006402, sm_100a = 0x600640a.
  ptxas 13.0 leaves bit 3 clear for every target (sm_90a and sm_90 are both 0x6005a04) and records "a"
  in the ``.nv.compat`` section instead, as EICOMPAT_ATTR_CUDA_ACCELERATOR_TARGET (attribute 0x09) = 1.
  Either marker gives "a".

The "f" (family) suffix is not in the cubin: ``-arch sm_100f`` and ``-arch sm_100`` produce the same
e_flags and .nv.compat, and cuobjdump calls both sm_100; so does this module.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

from ..errors import CubinError

__all__ = ["CubinError", "CubinInfo", "KernelInfo", "Param", "read_cubin", "extract_cubins_from_fatbin"]


@dataclass(frozen=True)
class Param:
    """One kernel parameter: its ordinal (position in the signature), byte offset and byte size in the param buffer."""

    ordinal: int
    offset: int
    size: int


@dataclass(frozen=True)
class KernelInfo:
    """One kernel entry function of a cubin. The module docstring says where each field comes from."""

    name: str
    params: tuple[Param, ...]
    param_bytes: int
    registers: int
    shared_bytes: int
    stack_bytes: int
    frame_bytes: int
    local_bytes: int
    constant0_bytes: int
    spill_stores: int | None
    spill_loads: int | None
    max_threads: tuple[int, int, int] | None
    reqntid: tuple[int, int, int] | None
    cluster_dims: tuple[int, int, int] | None
    max_cluster_rank: int | None
    max_registers: int | None
    num_barriers: int
    attributes: tuple[tuple[str, bytes], ...] = field(repr=False)


@dataclass(frozen=True)
class CubinInfo:
    """A parsed cubin: SASS architecture (``sm_90a``), its kernels in symbol-table order, sha256 of the bytes."""

    arch: str
    kernels: tuple[KernelInfo, ...]
    sha256: str

    def kernel(self, name: str) -> KernelInfo:
        """The kernel called ``name``; KeyError listing the kernels present if there is none."""
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(f"no kernel {name!r} in this cubin (has {[k.name for k in self.kernels]})")


# --------------------------------------------------------------------------------------------------
# constants

_ELF_MAGIC = b"\x7fELF"
_EM_CUDA = 190
_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")  # ELF64 header, 64 bytes
_SHDR = struct.Struct("<IIQQQQIIQQ")  # ELF64 section header, 64 bytes
_SYM = struct.Struct("<IBBHQQ")  # ELF64 symbol, 24 bytes
_SHT_SYMTAB, _SHT_STRTAB, _SHT_NOBITS = 2, 3, 8
_SHN_LORESERVE, _SHN_XINDEX = 0xFF00, 0xFFFF
_STT_FUNC = 2
_STO_CUDA_ENTRY = 0x10

# e_flags, by EI_ABIVERSION (see module docstring)
_EF_CUDA_ACCELERATORS_V1 = 0x800  # ABI 7
_EF_CUDA_ACCELERATORS = 0x8  # ABI 8
_EICOMPAT_ATTR_CUDA_ACCELERATOR_TARGET = 0x09

# .nv.info record formats: every record starts with (format u8, attribute u8, u16); the u16 is the value
# for BVAL/HVAL, unused for NVAL, and the payload length for SVAL (payload follows).
_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL, _EIFMT_SVAL = 1, 2, 3, 4

# EIATTR codes, named as cuobjdump 13.2 names them.
_EIATTR_NAMES = {
    0x01: "EIATTR_PAD", 0x02: "EIATTR_IMAGE_SLOT", 0x03: "EIATTR_JUMPTABLE_RELOCS",
    0x04: "EIATTR_CTAIDZ_USED", 0x05: "EIATTR_MAX_THREADS", 0x06: "EIATTR_IMAGE_OFFSET",
    0x07: "EIATTR_IMAGE_SIZE", 0x08: "EIATTR_TEXTURE_NORMALIZED", 0x09: "EIATTR_SAMPLER_INIT",
    0x0A: "EIATTR_PARAM_CBANK", 0x0B: "EIATTR_SMEM_PARAM_OFFSETS", 0x0C: "EIATTR_CBANK_PARAM_OFFSETS",
    0x0D: "EIATTR_SYNC_STACK", 0x0E: "EIATTR_TEXID_SAMPID_MAP", 0x0F: "EIATTR_EXTERNS",
    0x10: "EIATTR_REQNTID", 0x11: "EIATTR_FRAME_SIZE", 0x12: "EIATTR_MIN_STACK_SIZE",
    0x13: "EIATTR_SAMPLER_FORCE_UNNORMALIZED", 0x14: "EIATTR_BINDLESS_IMAGE_OFFSETS",
    0x15: "EIATTR_BINDLESS_TEXTURE_BANK", 0x16: "EIATTR_BINDLESS_SURFACE_BANK", 0x17: "EIATTR_KPARAM_INFO",
    0x18: "EIATTR_SMEM_PARAM_SIZE", 0x19: "EIATTR_CBANK_PARAM_SIZE", 0x1A: "EIATTR_QUERY_NUMATTRIB",
    0x1B: "EIATTR_MAXREG_COUNT", 0x1C: "EIATTR_EXIT_INSTR_OFFSETS", 0x1D: "EIATTR_S2RCTAID_INSTR_OFFSETS",
    0x1E: "EIATTR_CRS_STACK_SIZE", 0x1F: "EIATTR_NEED_CNP_WRAPPER", 0x20: "EIATTR_NEED_CNP_PATCH",
    0x21: "EIATTR_EXPLICIT_CACHING", 0x22: "EIATTR_ISTYPEP_USED", 0x23: "EIATTR_MAX_STACK_SIZE",
    0x24: "EIATTR_SUQ_USED", 0x25: "EIATTR_LD_CACHEMOD_INSTR_OFFSETS", 0x26: "EIATTR_LOAD_CACHE_REQUEST",
    0x27: "EIATTR_ATOM_SYS_INSTR_OFFSETS", 0x28: "EIATTR_COOP_GROUP_INSTR_OFFSETS",
    0x29: "EIATTR_COOP_GROUP_MASK_REGIDS", 0x2A: "EIATTR_SW1850030_WAR", 0x2B: "EIATTR_WMMA_USED",
    0x2C: "EIATTR_HAS_PRE_V10_OBJECT", 0x2D: "EIATTR_ATOMF16_EMUL_INSTR_OFFSETS",
    0x2E: "EIATTR_ATOM16_EMUL_INSTR_REG_MAP", 0x2F: "EIATTR_REGCOUNT", 0x30: "EIATTR_SW2393858_WAR",
    0x31: "EIATTR_INT_WARP_WIDE_INSTR_OFFSETS", 0x32: "EIATTR_SHARED_SCRATCH", 0x33: "EIATTR_STATISTICS",
    0x34: "EIATTR_INDIRECT_BRANCH_TARGETS", 0x35: "EIATTR_SW2861232_WAR", 0x36: "EIATTR_SW_WAR",
    0x37: "EIATTR_CUDA_API_VERSION", 0x38: "EIATTR_NUM_MBARRIERS", 0x39: "EIATTR_MBARRIER_INSTR_OFFSETS",
    0x3A: "EIATTR_COROUTINE_RESUME_ID_OFFSETS", 0x3B: "EIATTR_SAM_REGION_STACK_SIZE",
    0x3C: "EIATTR_PER_REG_TARGET_PERF_STATS", 0x3D: "EIATTR_CTA_PER_CLUSTER", 0x3E: "EIATTR_EXPLICIT_CLUSTER",
    0x3F: "EIATTR_MAX_CLUSTER_RANK", 0x40: "EIATTR_INSTR_REG_MAP", 0x41: "EIATTR_RESERVED_SMEM_USED",
    0x42: "EIATTR_RESERVED_SMEM_0_SIZE", 0x43: "EIATTR_UCODE_SECTION_DATA", 0x44: "EIATTR_UNUSED_LOAD_BYTE_OFFSET",
    0x45: "EIATTR_KPARAM_INFO_V2", 0x46: "EIATTR_SYSCALL_OFFSETS", 0x47: "EIATTR_SW_WAR_MEMBAR_SYS_INSTR_OFFSETS",
    0x48: "EIATTR_GRAPHICS_GLOBAL_CBANK", 0x49: "EIATTR_SHADER_TYPE", 0x4A: "EIATTR_VRC_CTA_INIT_COUNT",
    0x4B: "EIATTR_TOOLS_PATCH_FUNC", 0x4C: "EIATTR_NUM_BARRIERS", 0x4D: "EIATTR_TEXMODE_INDEPENDENT",
    0x4E: "EIATTR_PERF_STATISTICS", 0x4F: "EIATTR_AT_ENTRY_FRAGMENTS", 0x50: "EIATTR_SPARSE_MMA_MASK",
    0x51: "EIATTR_TCGEN05_1CTA_USED", 0x52: "EIATTR_TCGEN05_2CTA_USED", 0x53: "EIATTR_GEN_ERRBAR_AT_EXIT",
    0x54: "EIATTR_REG_RECONFIG", 0x55: "EIATTR_ANNOTATIONS", 0x57: "EIATTR_STACK_CANARY_TRAP_OFFSETS",
    0x58: "EIATTR_STUB_FUNCTION_KIND", 0x59: "EIATTR_LOCAL_CTA_ASYNC_STORE_OFFSETS",
    0x5A: "EIATTR_MERCURY_FINALIZER_OPTIONS", 0x5B: "EIATTR_BLOCKS_ARE_CLUSTERS", 0x5C: "EIATTR_SANITIZE",
    0x5D: "EIATTR_SYSCALLS_FALLBACK", 0x5E: "EIATTR_CUDA_REQ", 0x5F: "EIATTR_MERCURY_ISA_VERSION",
    0x61: "EIATTR_RTCORE_ENTRY", 0x62: "EIATTR_CLUSTER_LAUNCH_CONTROL_USED",
    0x64: "EIATTR_MIN_PER_CTA_MEMORY_SIZE", 0x65: "EIATTR_IGNOREOOB_CP_ASYNC_BULK_INSTR_OFFSETS",
    0x66: "EIATTR_LANGUAGE",
}
_A = {v: k for k, v in _EIATTR_NAMES.items()}
_PARAM_CBANK, _CBANK_PARAM_SIZE = _A["EIATTR_PARAM_CBANK"], _A["EIATTR_CBANK_PARAM_SIZE"]
_KPARAM_INFO, _KPARAM_INFO_V2 = _A["EIATTR_KPARAM_INFO"], _A["EIATTR_KPARAM_INFO_V2"]
_REGCOUNT, _FRAME_SIZE, _MIN_STACK_SIZE = _A["EIATTR_REGCOUNT"], _A["EIATTR_FRAME_SIZE"], _A["EIATTR_MIN_STACK_SIZE"]
_MAX_THREADS, _REQNTID = _A["EIATTR_MAX_THREADS"], _A["EIATTR_REQNTID"]
_CTA_PER_CLUSTER, _MAX_CLUSTER_RANK = _A["EIATTR_CTA_PER_CLUSTER"], _A["EIATTR_MAX_CLUSTER_RANK"]
_MAXREG_COUNT, _NUM_BARRIERS, _ANNOTATIONS = _A["EIATTR_MAXREG_COUNT"], _A["EIATTR_NUM_BARRIERS"], _A["EIATTR_ANNOTATIONS"]
del _A

# EIATTR_ANNOTATIONS kind of a spill/refill instruction; SASS (sm_70+, 128-bit words) STL/LDL opcodes and
# the access width field (bits 73..75) in bytes.
_ANNOTATION_SPILL_REFILL = 1
_OP_STL, _OP_LDL = 0x387, 0x983
_LDST_WIDTH = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 8, 6: 16}

# fatbin container (see extract_cubins_from_fatbin)
_FATBIN_MAGIC = 0xBA55ED50
_FATBIN_HDR = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries that follow
_FATBIN_ENTRY = struct.Struct("<HHIQIIHHIIIQQQ")  # 64 bytes, see extract_cubins_from_fatbin
_FATBIN_KIND_PTX, _FATBIN_KIND_ELF = 1, 2
_FATBIN_FLAG_COMPRESSED = 0x2000 | 0x8000  # 0x2000: LZ-compressed (CUDA 11.x), 0x8000: zstd (CUDA 12.x+)


# --------------------------------------------------------------------------------------------------
# ELF plumbing


@dataclass(frozen=True)
class _Section:
    index: int
    name: str
    type: int
    flags: int
    offset: int
    size: int
    link: int
    info: int
    entsize: int


def _as_bytes(data) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"expected bytes, got {type(data).__name__}")


def _unpack(st: struct.Struct, data: bytes, off: int, what: str):
    if off < 0 or off + st.size > len(data):
        raise CubinError(
            f"truncated cubin: {what} at offset {off:#x} needs {st.size} bytes but the file has {len(data)} "
            f"(expected a complete ELF image). Re-extract or rebuild the cubin"
        )
    return st.unpack_from(data, off)


def _cstr(data: bytes, start: int, end: int, what: str) -> str:
    nul = data.find(b"\0", start, end)
    if nul < 0:
        raise CubinError(f"{what} at offset {start:#x} is not NUL-terminated before offset {end:#x} (expected a C string)")
    return data[start:nul].decode("utf-8", errors="surrogateescape")


def _parse_elf(data: bytes):
    """ELF header fields we need and the section table. Every offset is bounds-checked."""
    if len(data) < _EHDR.size:
        if data[:4] != _ELF_MAGIC[: len(data)]:
            raise CubinError(f"not a cubin: bad ELF magic {data[:4]!r} at offset 0x0 (expected {_ELF_MAGIC!r})")
        raise CubinError(f"truncated cubin: {len(data)} bytes, shorter than the 64-byte ELF64 header at offset 0x0")
    (ident, _type, e_machine, _version, _entry, e_phoff, e_shoff, e_flags, _ehsize, e_phentsize, e_phnum,
     e_shentsize, e_shnum, e_shstrndx) = _EHDR.unpack_from(data, 0)
    if ident[:4] != _ELF_MAGIC:
        hint = " (this is a fatbin: use extract_cubins_from_fatbin)" if ident[:4] == struct.pack("<I", _FATBIN_MAGIC) else ""
        raise CubinError(f"not a cubin: bad ELF magic {ident[:4]!r} at offset 0x0 (expected {_ELF_MAGIC!r}){hint}")
    if ident[4] != 2:
        raise CubinError(f"unsupported ELF class {ident[4]} at offset 0x4 (expected 2, ELFCLASS64; 32-bit cubins are not supported)")
    if ident[5] != 1:
        raise CubinError(f"unsupported ELF byte order {ident[5]} at offset 0x5 (expected 1, little-endian)")
    if e_machine != _EM_CUDA:
        raise CubinError(f"not a CUDA cubin: e_machine {e_machine} at offset 0x12 (expected {_EM_CUDA}, EM_CUDA)")
    if e_shoff == 0:
        raise CubinError("cubin has no section header table: e_shoff is 0 at offset 0x28 (expected the table's file offset)")
    if e_shentsize != _SHDR.size:
        raise CubinError(f"unknown section header layout: e_shentsize {e_shentsize} at offset 0x3a (expected {_SHDR.size})")

    first = _unpack(_SHDR, data, e_shoff, "section header 0")
    shnum = e_shnum if e_shnum else first[4]  # extended numbering: the count lives in section 0's sh_size
    shstrndx = first[6] if e_shstrndx == _SHN_XINDEX else e_shstrndx
    if shnum == 0 or e_shoff + shnum * _SHDR.size > len(data):
        raise CubinError(
            f"truncated cubin: section header table at offset {e_shoff:#x} with {shnum} entries of {_SHDR.size} bytes "
            f"runs past the end of the file ({len(data)} bytes)"
        )
    raw = [_SHDR.unpack_from(data, e_shoff + i * _SHDR.size) for i in range(shnum)]
    if shstrndx >= shnum:
        raise CubinError(f"section name table index {shstrndx} at offset 0x3e is out of range (expected < {shnum} sections)")

    end = max(_EHDR.size, e_shoff + shnum * _SHDR.size)
    if e_phnum:
        end = max(end, e_phoff + e_phnum * e_phentsize)
        if e_phoff + e_phnum * e_phentsize > len(data):
            raise CubinError(
                f"truncated cubin: program header table at offset {e_phoff:#x} ({e_phnum} x {e_phentsize} bytes) "
                f"runs past the end of the file ({len(data)} bytes)"
            )
    for i, (_n, sh_type, _f, _a, sh_offset, sh_size, *_r) in enumerate(raw):
        if sh_type != _SHT_NOBITS and sh_size:
            if sh_offset + sh_size > len(data):
                raise CubinError(
                    f"corrupt section header {i} at offset {e_shoff + i * _SHDR.size:#x}: data at offset {sh_offset:#x}, "
                    f"{sh_size} bytes, runs past the end of the file ({len(data)} bytes)"
                )
            end = max(end, sh_offset + sh_size)

    str_off, str_size = raw[shstrndx][4], raw[shstrndx][5]
    if raw[shstrndx][1] != _SHT_STRTAB:
        raise CubinError(f"section {shstrndx} named by e_shstrndx has type {raw[shstrndx][1]:#x} (expected {_SHT_STRTAB}, SHT_STRTAB)")
    sections = []
    for i, (sh_name, sh_type, sh_flags, _addr, sh_offset, sh_size, sh_link, sh_info, _align, sh_entsize) in enumerate(raw):
        if sh_name >= str_size and not (i == 0 and sh_name == 0):
            raise CubinError(
                f"corrupt section header {i} at offset {e_shoff + i * _SHDR.size:#x}: name offset {sh_name} "
                f"(expected < {str_size}, the size of the section name table)"
            )
        name = _cstr(data, str_off + sh_name, str_off + str_size, f"name of section {i}") if str_size else ""
        sections.append(_Section(i, name, sh_type, sh_flags, sh_offset, sh_size, sh_link, sh_info, sh_entsize))
    return ident[8], e_flags, sections, end


def _symbols(data: bytes, sections: list[_Section]):
    """(index, name, st_info, st_other, st_shndx) of every symbol in .symtab."""
    symtab = next((s for s in sections if s.name == ".symtab"), None)
    if symtab is None:
        raise CubinError("cubin has no .symtab section (expected one; kernel names live there)")
    if symtab.type != _SHT_SYMTAB or symtab.size % _SYM.size or symtab.entsize not in (0, _SYM.size):
        raise CubinError(
            f"unknown .symtab layout at offset {symtab.offset:#x}: type {symtab.type:#x}, size {symtab.size}, "
            f"entsize {symtab.entsize} (expected SHT_SYMTAB with {_SYM.size}-byte entries)"
        )
    if symtab.link >= len(sections) or sections[symtab.link].type != _SHT_STRTAB:
        raise CubinError(f".symtab links to section {symtab.link}, which is not a string table (expected SHT_STRTAB)")
    strtab = sections[symtab.link]
    out = []
    for i in range(symtab.size // _SYM.size):
        off = symtab.offset + i * _SYM.size
        st_name, st_info, st_other, st_shndx, _value, _size = _SYM.unpack_from(data, off)
        if st_name >= max(strtab.size, 1):
            raise CubinError(f"corrupt symbol {i} at offset {off:#x}: name offset {st_name} (expected < {strtab.size})")
        name = _cstr(data, strtab.offset + st_name, strtab.offset + strtab.size, f"name of symbol {i}") if strtab.size else ""
        out.append((i, name, st_info, st_other, st_shndx))
    return out


def _records(data: bytes, sec: _Section):
    """The (attribute, format, payload) records of a .nv.info-style section."""
    if sec.type == _SHT_NOBITS and sec.size:
        raise CubinError(f"unknown layout of {sec.name} (section {sec.index}): type SHT_NOBITS has no file data (expected attribute records)")
    out = []
    off, end = sec.offset, sec.offset + sec.size
    while off < end:
        if off + 4 > end:
            raise CubinError(f"truncated attribute record in {sec.name} at offset {off:#x}: {end - off} bytes left (expected a 4-byte record header)")
        fmt, attr, val = data[off], data[off + 1], int.from_bytes(data[off + 2 : off + 4], "little")
        if fmt == _EIFMT_SVAL:
            if off + 4 + val > end:
                raise CubinError(
                    f"truncated attribute {_EIATTR_NAMES.get(attr, hex(attr))} in {sec.name} at offset {off:#x}: "
                    f"payload of {val} bytes runs past the section end {end:#x}"
                )
            out.append((attr, fmt, data[off + 4 : off + 4 + val]))
            off += 4 + val
        elif fmt in (_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL):
            out.append((attr, fmt, data[off + 2 : off + 4] if fmt != _EIFMT_NVAL else b""))
            off += 4
        else:
            raise CubinError(f"unknown attribute record format {fmt} in {sec.name} at offset {off:#x} (expected 1..4, EIFMT_NVAL..EIFMT_SVAL)")
    return out


def _need(payload: bytes, n: int, attr: int, where: str) -> bytes:
    if len(payload) < n:
        raise CubinError(f"{_EIATTR_NAMES[attr]} in {where} has {len(payload)} payload bytes (expected at least {n})")
    return payload


def _dim3(payload: bytes, attr: int, where: str) -> tuple[int, int, int]:
    return struct.unpack_from("<III", _need(payload, 12, attr, where))


def _arch(abi_version: int, e_flags: int, compat_accel: bool) -> str:
    if abi_version >= 8:
        sm, accel = (e_flags >> 8) & 0xFF, bool(e_flags & _EF_CUDA_ACCELERATORS) or compat_accel
    else:
        sm, accel = e_flags & 0xFF, bool(e_flags & _EF_CUDA_ACCELERATORS_V1)
    if sm == 0:
        raise CubinError(f"e_flags {e_flags:#x} at offset 0x30 name no SM architecture (ELF ABI version {abi_version})")
    return f"sm_{sm}" + ("a" if accel else "")


def _spills(text: bytes, annotations: bytes, sm: int):
    """(stores, loads) in bytes from the SpillRefill annotations, or (None, None) if not decodable."""
    if len(annotations) % 8:
        return None, None
    stores = loads = 0
    for kind, off in struct.iter_unpack("<II", annotations):
        if kind != _ANNOTATION_SPILL_REFILL:
            continue
        if sm < 70 or off % 16 or off + 16 > len(text):
            return None, None
        word = int.from_bytes(text[off : off + 16], "little")
        width = _LDST_WIDTH.get((word >> 73) & 7)
        op = word & 0xFFF
        if width is None or op not in (_OP_STL, _OP_LDL):
            return None, None
        if op == _OP_STL:
            stores += width
        else:
            loads += width
    return stores, loads


# --------------------------------------------------------------------------------------------------
# public


def read_cubin(data: bytes) -> CubinInfo:
    """Parse a cubin (CUDA ELF image); raise CubinError saying what is wrong and where if it is malformed."""
    data = _as_bytes(data)
    abi_version, e_flags, sections, _end = _parse_elf(data)
    by_name: dict[str, _Section] = {}
    for s in sections:
        by_name.setdefault(s.name, s)

    compat_accel = False
    if ".nv.compat" in by_name:
        for attr, fmt, payload in _records(data, by_name[".nv.compat"]):
            if attr == _EICOMPAT_ATTR_CUDA_ACCELERATOR_TARGET and fmt == _EIFMT_BVAL and payload[0]:
                compat_accel = True
    arch = _arch(abi_version, e_flags, compat_accel)
    sm = int(arch[3:].rstrip("a"))

    # per-symbol values from the global .nv.info
    per_sym: dict[int, dict[int, int]] = {}
    if ".nv.info" in by_name:
        for attr, fmt, payload in _records(data, by_name[".nv.info"]):
            if attr in (_REGCOUNT, _FRAME_SIZE, _MIN_STACK_SIZE) and fmt == _EIFMT_SVAL:
                sym, value = struct.unpack_from("<II", _need(payload, 8, attr, ".nv.info"))
                per_sym.setdefault(sym, {})[attr] = value

    kernels = []
    for index, name, st_info, st_other, st_shndx in _symbols(data, sections):
        if (st_info & 0xF) != _STT_FUNC or not (st_other & _STO_CUDA_ENTRY) or st_shndx == 0:
            continue
        if st_shndx >= _SHN_LORESERVE or st_shndx >= len(sections):
            raise CubinError(f"kernel symbol {name!r} (symbol {index}) names section {st_shndx} (expected one of the {len(sections)} sections)")
        text_sec = sections[st_shndx]
        info_sec = by_name.get(".nv.info." + name)
        where = info_sec.name if info_sec else name
        records = _records(data, info_sec) if info_sec else []

        params: dict[int, Param] = {}
        cbank_size = cbank_param_size = None
        max_threads = reqntid = cluster_dims = None
        max_cluster_rank = max_registers = num_barriers = None
        spill_stores, spill_loads = 0, 0
        for attr, fmt, payload in records:
            if attr == _KPARAM_INFO:
                _i, ordinal, offset, packed = struct.unpack_from("<IHHI", _need(payload, 12, attr, where))
                params[ordinal] = Param(ordinal, offset, (packed >> 18) & 0x3FFF)
            elif attr == _KPARAM_INFO_V2:
                _i, ordinal, offset, size = struct.unpack_from("<IHHH", _need(payload, 12, attr, where))
                params[ordinal] = Param(ordinal, offset, size)
            elif attr == _PARAM_CBANK:
                _sym, _off, cbank_size = struct.unpack_from("<IHH", _need(payload, 8, attr, where))
            elif attr == _CBANK_PARAM_SIZE and fmt == _EIFMT_HVAL:
                cbank_param_size = int.from_bytes(payload, "little")
            elif attr == _MAX_THREADS:
                max_threads = _dim3(payload, attr, where)
            elif attr == _REQNTID:
                reqntid = _dim3(payload, attr, where)
            elif attr == _CTA_PER_CLUSTER:
                cluster_dims = _dim3(payload, attr, where)
            elif attr == _MAX_CLUSTER_RANK:
                (max_cluster_rank,) = struct.unpack_from("<I", _need(payload, 4, attr, where))
            elif attr == _MAXREG_COUNT and fmt == _EIFMT_HVAL:
                max_registers = int.from_bytes(payload, "little")
            elif attr == _NUM_BARRIERS and fmt in (_EIFMT_BVAL, _EIFMT_HVAL):
                num_barriers = payload[0] if fmt == _EIFMT_BVAL else int.from_bytes(payload, "little")
            elif attr == _ANNOTATIONS:
                text = data[text_sec.offset : text_sec.offset + text_sec.size] if text_sec.type != _SHT_NOBITS else b""
                spill_stores, spill_loads = _spills(text, payload, sm)

        ordered = tuple(params[o] for o in sorted(params))
        if cbank_size is not None:
            param_bytes = cbank_size
        elif cbank_param_size is not None:
            param_bytes = cbank_param_size
        else:
            param_bytes = max((p.offset + p.size for p in ordered), default=0)
        if num_barriers is None:  # older ABI: barrier count in the .text section flags
            num_barriers = (text_sec.flags >> 20) & 0x1F
        sym_vals = per_sym.get(index, {})
        registers = sym_vals.get(_REGCOUNT)
        if registers is None:  # older ABI: register count in the top byte of the .text section's sh_info
            registers = (text_sec.info >> 24) & 0xFF

        def size_of(prefix: str) -> int:
            s = by_name.get(prefix + name)
            return s.size if s else 0

        kernels.append(KernelInfo(
            name=name,
            params=ordered,
            param_bytes=param_bytes,
            registers=registers,
            shared_bytes=size_of(".nv.shared."),
            stack_bytes=sym_vals.get(_MIN_STACK_SIZE, 0),
            frame_bytes=sym_vals.get(_FRAME_SIZE, 0),
            local_bytes=size_of(".nv.local."),
            constant0_bytes=size_of(".nv.constant0."),
            spill_stores=spill_stores,
            spill_loads=spill_loads,
            max_threads=max_threads,
            reqntid=reqntid,
            cluster_dims=cluster_dims,
            max_cluster_rank=max_cluster_rank,
            max_registers=max_registers,
            num_barriers=num_barriers,
            attributes=tuple((_EIATTR_NAMES.get(a, f"EIATTR_{a:#04x}"), p) for a, _f, p in records),
        ))

    names = [k.name for k in kernels]
    if len(set(names)) != len(names):
        raise CubinError(f"kernel symbols are not unique: {sorted({n for n in names if names.count(n) > 1})}")
    return CubinInfo(arch=arch, kernels=tuple(kernels), sha256=hashlib.sha256(data).hexdigest())


def extract_cubins_from_fatbin(data: bytes) -> list[bytes]:
    """The ELF images (cubins) in a CUDA fatbin, in container order.

    Layout (little-endian): a 16-byte container header ``magic u32 = 0xBA55ED50, version u16 = 1,
    header_size u16 = 16, size u64`` (bytes of entries that follow), then entries back to back, each a
    header of at least 64 bytes ``kind u16 (1 = PTX, 2 = ELF), u16, header_size u32, payload_size u64,
    compressed_size u32, u32, minor u16, major u16, sm u32, name_offset u32, name_size u32, flags u64,
    u64, uncompressed_size u64`` (CUDA 12.9/13 write 64, 72 (with a name), 104 or 112 bytes) followed by
    ``payload_size`` bytes. Several containers may follow one another (zero padding between them is
    skipped). PTX and other non-ELF entries are skipped. An ELF entry whose payload is compressed (flags
    0x2000 or 0x8000, or a nonzero uncompressed_size) raises CubinError naming the entry: decompression
    (zstd) is not in the standard library. Zero padding after an ELF image's last byte is dropped, so
    the result equals the cubin ptxas wrote.
    """
    data = _as_bytes(data)
    out: list[bytes] = []
    pos = 0
    n_entry = 0
    while True:
        if pos >= len(data):
            if not out and pos == 0:
                raise CubinError("empty fatbin: 0 bytes (expected a 16-byte header with magic 0xba55ed50)")
            break
        head = data[pos : pos + 4]
        if head != struct.pack("<I", _FATBIN_MAGIC)[: len(head)]:
            hint = " (this is an ELF cubin: use read_cubin)" if head == _ELF_MAGIC else ""
            raise CubinError(f"bad fatbin magic {head.hex()} at offset {pos:#x} (expected 50ed55ba, 0xBA55ED50 little-endian){hint}")
        if pos + _FATBIN_HDR.size > len(data):
            raise CubinError(f"truncated fatbin: header at offset {pos:#x} needs {_FATBIN_HDR.size} bytes, {len(data) - pos} remain")
        magic, version, hdr_size, body = _FATBIN_HDR.unpack_from(data, pos)
        if version != 1 or hdr_size < _FATBIN_HDR.size:
            raise CubinError(
                f"unknown fatbin header at offset {pos:#x}: version {version}, header size {hdr_size} "
                f"(expected version 1, header size >= {_FATBIN_HDR.size})"
            )
        start, end = pos + hdr_size, pos + hdr_size + body
        if end > len(data):
            raise CubinError(
                f"truncated fatbin: container at offset {pos:#x} declares {body} bytes of entries after its "
                f"{hdr_size}-byte header, but only {len(data) - start} bytes follow"
            )
        p = start
        while p < end:
            if p + _FATBIN_ENTRY.size > end:
                raise CubinError(
                    f"truncated fatbin entry {n_entry} at offset {p:#x}: {end - p} bytes left in the container "
                    f"(expected a {_FATBIN_ENTRY.size}-byte entry header)"
                )
            kind, _, ehdr, psize, csize, _, _, _, sm, _, _, flags, _, usize = _FATBIN_ENTRY.unpack_from(data, p)
            if ehdr < _FATBIN_ENTRY.size:
                raise CubinError(
                    f"unknown fatbin entry layout at offset {p:#x} (entry {n_entry}): header size {ehdr} "
                    f"(expected >= {_FATBIN_ENTRY.size})"
                )
            pstart, pend = p + ehdr, p + ehdr + psize
            if pend > end:
                raise CubinError(
                    f"truncated fatbin entry {n_entry} at offset {p:#x}: its {psize}-byte payload at offset {pstart:#x} "
                    f"runs past the container end {end:#x}"
                )
            if kind == _FATBIN_KIND_ELF:
                if (flags & _FATBIN_FLAG_COMPRESSED) or usize or csize:
                    raise CubinError(
                        f"fatbin entry {n_entry} (ELF, SM {sm}) at offset {p:#x} is compressed (flags {flags:#x}, "
                        f"{csize} compressed / {usize} uncompressed bytes; expected an uncompressed ELF image). "
                        f"Build it uncompressed (nvcc -compress-mode=none or -no-compress) or read the cubin directly"
                    )
                image = data[pstart:pend]
                if image[:4] != _ELF_MAGIC:
                    raise CubinError(
                        f"fatbin entry {n_entry} at offset {p:#x} is marked ELF but its payload at offset {pstart:#x} "
                        f"starts with {image[:4]!r} (expected {_ELF_MAGIC!r})"
                    )
                try:
                    *_x, extent = _parse_elf(image)
                except CubinError as e:
                    raise CubinError(f"fatbin entry {n_entry} at offset {p:#x}: {e}") from None
                if extent < len(image) and not image[extent:].strip(b"\0"):
                    image = image[:extent]
                out.append(image)
            p = pend
            n_entry += 1
        pos = end
        while pos < len(data) and data[pos] == 0:  # padding between concatenated containers
            pos += 1
    return out
