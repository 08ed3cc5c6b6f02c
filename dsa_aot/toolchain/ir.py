"""A reader for the lowered host module, printed in MLIR *generic* op form.

Shared by the lift stage (symbolic) and the verify stage (concrete); it only parses, so the two
interpreters built on it stay independent. Standard library only.

Generic form puts every op on one line: ``%r = "dialect.op"(%a, %b)[^bb1, ^bb2] <{props}> {attrs} :
(T, T) -> R``; ops that own regions end the line with ``({`` and close with ``}) ... : type``.
Attribute values are kept as raw text and decoded on demand by the helpers below.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

from ..errors import LiftError

__all__ = ["Module", "Func", "Block", "Op", "parse_module", "parse_type", "sizeof", "alignof", "field_offsets", "gep_offset",
           "Int", "Ptr", "Struct", "Array", "Void", "attr_int", "attr_ints", "attr_str", "attr_sym", "attr_bytes"]


# --- types ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Int:
    bits: int


@dataclass(frozen=True)
class Float:
    bits: int


@dataclass(frozen=True)
class Ptr:
    space: int = 0


@dataclass(frozen=True)
class Struct:
    fields: tuple
    packed: bool = False


@dataclass(frozen=True)
class Array:
    n: int
    elem: object


@dataclass(frozen=True)
class Vector(Array):
    """``vector<N x iM>``: laid out like an array, aligned to its (power-of-two) size."""


@dataclass(frozen=True)
class Void:
    pass


class _TypeParser:
    def __init__(self, s):
        self.s, self.i = s, 0

    def ws(self):
        while self.i < len(self.s) and self.s[self.i] == " ":
            self.i += 1

    def eat(self, tok):
        self.ws()
        if not self.s.startswith(tok, self.i):
            raise LiftError(f"cannot parse type {self.s!r}: expected {tok!r} at column {self.i}")
        self.i += len(tok)

    def peek(self, tok):
        self.ws()
        return self.s.startswith(tok, self.i)

    def parse(self):
        self.ws()
        if self.peek("!llvm."):
            self.i += len("!llvm.")
        m = re.compile(r"[a-z0-9_]+").match(self.s, self.i)
        if not m:
            raise LiftError(f"cannot parse type {self.s!r} at column {self.i}")
        word = m.group(0)
        self.i = m.end()
        if re.fullmatch(r"i\d+", word):
            return Int(int(word[1:]))
        if word in ("f32", "f64", "f16", "bf16"):
            return Float({"f32": 32, "f64": 64, "f16": 16, "bf16": 16}[word])
        if word == "ptr":
            if self.peek("<"):
                self.eat("<")
                self.ws()
                n = re.compile(r"\d+").match(self.s, self.i)
                self.i = n.end()
                self.eat(">")
                return Ptr(int(n.group(0)))
            return Ptr(0)
        if word == "void":
            return Void()
        if word == "struct":
            self.eat("<")
            packed = False
            if self.peek("packed"):
                self.i += len("packed")
                packed = True
            self.eat("(")
            fields = []
            while not self.peek(")"):
                fields.append(self.parse())
                if self.peek(","):
                    self.eat(",")
            self.eat(")")
            self.eat(">")
            return Struct(tuple(fields), packed)
        if word == "array":
            self.eat("<")
            self.ws()
            n = re.compile(r"(\d+) x ").match(self.s, self.i)
            if not n:
                raise LiftError(f"cannot parse array type {self.s!r}")
            self.i = n.end()
            elem = self.parse()
            self.eat(">")
            return Array(int(n.group(1)), elem)
        if word == "vector":
            self.eat("<")
            self.ws()
            n = re.compile(r"(\d+)x").match(self.s, self.i)
            if not n:
                raise LiftError(f"cannot parse vector type {self.s!r} (only fixed-size vectors are understood)")
            self.i = n.end()
            elem = self.parse()
            self.eat(">")
            size = int(n.group(1)) * sizeof(elem)
            if not isinstance(elem, Int) or size & (size - 1) or size > 64:
                raise LiftError(f"vector type {self.s!r}: only integer vectors of a power-of-two size up to 64 bytes are understood")
            return Vector(int(n.group(1)), elem)
        raise LiftError(f"unknown type {word!r} in {self.s!r}: the lifter handles integers, floats, pointers, vectors, structs and arrays")


_TYPE_CACHE: dict = {}


def parse_type(s: str):
    s = s.strip()
    t = _TYPE_CACHE.get(s)
    if t is None:
        p = _TypeParser(s)
        t = p.parse()
        p.ws()
        if p.i != len(s):
            raise LiftError(f"trailing text in type {s!r}")
        _TYPE_CACHE[s] = t
    return t


@functools.lru_cache(maxsize=None)
def alignof(t) -> int:
    if isinstance(t, (Int, Float)):
        return 1 if t.bits <= 8 else min(8, t.bits // 8) if t.bits in (16, 32, 64) else 16
    if isinstance(t, Ptr):
        return 8
    if isinstance(t, Vector):
        return t.n * sizeof(t.elem)
    if isinstance(t, Array):
        return alignof(t.elem)
    if isinstance(t, Struct):
        return 1 if t.packed or not t.fields else max(alignof(f) for f in t.fields)
    raise LiftError(f"no layout for {t}")


@functools.lru_cache(maxsize=None)
def sizeof(t) -> int:
    if isinstance(t, (Int, Float)):
        return max(1, (t.bits + 7) // 8) if t.bits != 1 else 1
    if isinstance(t, Ptr):
        return 8
    if isinstance(t, Array):
        return t.n * _padded(t.elem)
    if isinstance(t, Struct):
        offs = field_offsets(t)
        end = offs[-1] + sizeof(t.fields[-1]) if t.fields else 0
        a = alignof(t)
        return (end + a - 1) // a * a
    raise LiftError(f"no layout for {t}")


def _padded(t) -> int:
    a = alignof(t)
    return (sizeof(t) + a - 1) // a * a


@functools.lru_cache(maxsize=None)
def field_offsets(t: Struct) -> tuple:
    """Byte offsets of ``t``'s fields (a tuple: the result is shared by every caller)."""
    out, off = [], 0
    for f in t.fields:
        if not t.packed:
            a = alignof(f)
            off = (off + a - 1) // a * a
        out.append(off)
        off += sizeof(f)
    return tuple(out)


def gep_offset(elem_type, indices) -> int:
    """The byte offset an ``llvm.getelementptr`` over ``elem_type`` adds for these resolved (signed) indices: the
    first steps over whole elements, the rest into struct fields and array elements; ValueError into a scalar."""
    off, cur = 0, elem_type
    for depth, idx in enumerate(indices):
        if depth == 0:
            off += idx * sizeof(elem_type)
        elif isinstance(cur, Struct):
            off += field_offsets(cur)[idx]
            cur = cur.fields[idx]
        elif isinstance(cur, Array):
            off += idx * sizeof(cur.elem)
            cur = cur.elem
        else:
            raise ValueError(f"getelementptr index into scalar {cur}")
    return off


# --- ops -----------------------------------------------------------------------------------------


@dataclass
class Op:
    results: list
    name: str
    operands: list
    successors: list
    props: dict
    attrs: dict
    sig: str
    line: int
    regions: list = field(default_factory=list)

    # parsed once per op: the verifier interprets each op once per sample (50+ per entry), and parsing its
    # signature again each time was a quarter of an entry's lift+verify seconds
    @functools.cached_property
    def result_type(self):
        return parse_type(_sig_results(self.sig)[0])

    @functools.cached_property
    def operand_types(self) -> tuple:
        return tuple(parse_type(t) for t in _sig_operands(self.sig))

    def prop(self, name):
        if name in self.props:
            return self.props[name]
        if name in self.attrs:
            return self.attrs[name]
        raise LiftError(f"line {self.line}: {self.name} has no attribute {name!r}")

    def where(self) -> str:
        return f"host.mlir line {self.line} ({self.name})"


@dataclass
class Block:
    label: str
    args: list  # [(name, type string)]
    ops: list = field(default_factory=list)


@dataclass
class Func:
    name: str
    blocks: dict  # label -> Block, in order
    entry: str
    arg_types: list
    decl_type: str

    @property
    def args(self):
        return self.blocks[self.entry].args if self.blocks else []


@dataclass
class Module:
    funcs: dict
    globals: dict  # name -> Op (llvm.mlir.global)


def _split_top(s: str, sep: str = ",") -> list:
    """Split on ``sep`` at nesting depth 0, honouring strings and ``->``."""
    out, depth, cur, i, n = [], 0, [], 0, len(s)
    while i < n:
        c = s[i]
        if c == '"':
            j = _end_string(s, i)
            cur.append(s[i:j])
            i = j
            continue
        if c == "-" and s.startswith("->", i):
            cur.append("->")
            i += 2
            continue
        if c in "<([{":
            depth += 1
        elif c in ">)]}":
            depth -= 1
        if c == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _end_string(s: str, i: int) -> int:
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
            continue
        if s[j] == '"':
            return j + 1
        j += 1
    raise LiftError(f"unterminated string in {s[:80]!r}")


def _match(s: str, i: int, open_: str, close: str) -> int:
    """Index just past the bracket closing the one at ``i``."""
    depth, j = 0, i
    while j < len(s):
        c = s[j]
        if c == '"':
            j = _end_string(s, j)
            continue
        if s.startswith("->", j):
            j += 2
            continue
        if c in "<([{":
            depth += 1
        elif c in ">)]}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    raise LiftError(f"unbalanced {open_}{close} in {s[:120]!r}")


def _attr_dict(text: str) -> dict:
    out = {}
    for item in _split_top(text):
        if not item:
            continue
        k, eq, v = item.partition(" = ")
        out[k.strip()] = v.strip() if eq else "unit"
    return out


def _sig_operands(sig: str) -> list:
    lhs = sig[: _arrow(sig)].strip()
    return _split_top(lhs[1:-1]) if lhs.startswith("(") else [lhs]


def _sig_results(sig: str) -> list:
    rhs = sig[_arrow(sig) + 2:].strip()
    return _split_top(rhs[1:-1]) if rhs.startswith("(") else [rhs]


def _arrow(sig: str) -> int:
    depth, i = 0, 0
    while i < len(sig):
        if sig.startswith("->", i) and depth == 0:
            return i
        if sig.startswith("->", i):
            i += 2
            continue
        c = sig[i]
        if c in "<([{":
            depth += 1
        elif c in ">)]}":
            depth -= 1
        i += 1
    raise LiftError(f"no '->' in op type {sig!r}")


_OP_HEAD = re.compile(r'\s*(?:(?P<res>%[\w.$-]+(?::\d+)?(?:\s*,\s*%[\w.$-]+)*)\s*=\s*)?"(?P<name>[\w.]+)"\(')
_BLOCK = re.compile(r"\s*(?P<label>\^[\w.]+)(?:\((?P<args>.*)\))?:")


def _parse_op_line(line: str, lineno: int):
    m = _OP_HEAD.match(line)
    if not m:
        raise LiftError(f"host.mlir line {lineno}: not an op in generic form: {line.strip()[:120]!r}")
    results = [r.strip() for r in m.group("res").split(",")] if m.group("res") else []
    i = m.end() - 1
    j = _match(line, i, "(", ")")
    operands = [o for o in _split_top(line[i + 1 : j - 1]) if o]
    rest = line[j:]
    successors, props, attrs, opens_region = [], {}, {}, False
    rest = rest.lstrip()
    if rest.startswith("["):
        k = _match(rest, 0, "[", "]")
        successors = _split_top(rest[1 : k - 1])
        rest = rest[k:].lstrip()
    if rest.startswith("<{"):
        k = _match(rest, 0, "<", ">")
        props = _attr_dict(rest[2 : k - 2])
        rest = rest[k:].lstrip()
    if rest.startswith("({"):
        return results, m.group("name"), operands, successors, props, attrs, None, True
    if rest.startswith("{"):
        k = _match(rest, 0, "{", "}")
        attrs = _attr_dict(rest[1 : k - 1])
        rest = rest[k:].lstrip()
    if not rest.startswith(":"):
        raise LiftError(f"host.mlir line {lineno}: cannot read the type of {m.group('name')}: {rest[:80]!r}")
    return results, m.group("name"), operands, successors, props, attrs, rest[1:].strip(), opens_region


def parse_module(text: str) -> Module:
    """Parse the generic-form text of a lowered host module."""
    lines = text.splitlines()
    funcs, globals_ = {}, {}
    # stack of (op, blocks, current block)
    stack = []
    top_ops = []
    for n, raw in enumerate(lines, 1):
        line = raw.rstrip()
        s = line.strip()
        if not s or s.startswith("//"):
            continue
        if s.startswith('"builtin.module"()') or s.startswith("module"):
            continue
        if not stack and s.startswith("#") and " = " in s:
            continue  # attribute alias (#loop_annotation = ...): only referenced by branch hints
        if s.startswith("})") or s == "}":
            if not stack:
                continue  # the builtin.module's own close
            op, blocks, _ = stack.pop()
            op.regions.append(blocks)
            tail = s[2:].strip() if s.startswith("})") else ""
            if tail.startswith("{"):
                k = _match(tail, 0, "{", "}")
                op.attrs.update(_attr_dict(tail[1 : k - 1]))
                tail = tail[k:].strip()
            if tail.startswith(":"):
                op.sig = tail[1:].strip()
            continue
        bm = _BLOCK.match(line)
        if bm and s.startswith("^"):
            args = []
            if bm.group("args"):
                for a in _split_top(bm.group("args")):
                    nm, _, ty = a.partition(":")
                    args.append((nm.strip(), ty.strip()))
            blk = Block(bm.group("label"), args)
            stack[-1][1][blk.label] = blk
            stack[-1] = (stack[-1][0], stack[-1][1], blk)
            continue
        results, name, operands, succ, props, attrs, sig, opens = _parse_op_line(line, n)
        op = Op(results, name, operands, succ, props, attrs, sig or "", n)
        if stack:
            cur = stack[-1][2]
            if cur is None:  # first block without a label
                cur = Block("^entry", [])
                stack[-1][1][cur.label] = cur
                stack[-1] = (stack[-1][0], stack[-1][1], cur)
            cur.ops.append(op)
        else:
            top_ops.append(op)
        if opens:
            stack.append((op, {}, None))
    for op in top_ops:
        if op.name == "llvm.func":
            name = attr_str(op.prop("sym_name"))
            blocks = op.regions[0] if op.regions else {}
            ftype = op.prop("function_type")
            funcs[name] = Func(name, blocks, next(iter(blocks)) if blocks else None, [], ftype)
        elif op.name == "llvm.mlir.global":
            globals_[attr_str(op.prop("sym_name"))] = op
    return Module(funcs, globals_)


# --- attribute decoding --------------------------------------------------------------------------


def attr_int(raw: str) -> int:
    """``5 : i32`` / ``-1 : i64`` / ``true`` / ``false`` -> int."""
    v = raw.split(":")[0].strip()
    if v == "true":
        return 1
    if v == "false":
        return 0
    try:
        return int(v, 0)
    except ValueError:
        raise LiftError(f"expected an integer attribute, got {raw[:80]!r}") from None


def attr_f32_bits(raw: str) -> int:
    """``1.44269502 : f32`` / ``0x7F800000 : f32`` -> the fp32 bit pattern (MLIR prints f32 constants
    with digits that round-trip, and non-finite ones as hex bits)."""
    v = raw.split(":")[0].strip()
    if v.lower().startswith("0x"):
        return int(v, 16) & 0xFFFFFFFF
    try:
        x = float(v)
    except ValueError:
        raise LiftError(f"expected an f32 constant, got {raw[:80]!r}") from None
    import struct

    try:
        return int.from_bytes(struct.pack("<f", x), "little")
    except OverflowError:
        raise LiftError(f"f32 constant {raw[:80]!r} does not fit an f32") from None


def attr_dense(raw: str, n: int) -> list:
    """``dense<0> : vector<4xi32>`` (a splat) / ``dense<[1, 2, 3, 4]> : ...`` -> n ints."""
    m = re.fullmatch(r"dense<(.*)>\s*:.*", raw.strip())
    if not m:
        raise LiftError(f"expected a dense integer constant, got {raw[:80]!r}")
    body = m.group(1).strip()
    try:
        vals = [int(x, 0) for x in body.strip("[]").split(",")] if body.startswith("[") else [int(body, 0)] * n
    except ValueError:
        raise LiftError(f"expected a dense integer constant, got {raw[:80]!r}") from None
    if len(vals) != n:
        raise LiftError(f"dense constant {raw[:80]!r} has {len(vals)} values, its type {n}")
    return vals


@functools.lru_cache(maxsize=4096)
def attr_ints(raw: str) -> tuple:
    """``array<i32: 0, 1, -2147483648>`` -> (0, 1, -2147483648) (decoded once per text: the verifier reads
    each op's attributes once per sample)."""
    m = re.fullmatch(r"array<\w+(?::\s*(.*))?>", raw.strip())
    if not m:
        raise LiftError(f"expected an array attribute, got {raw[:80]!r}")
    return tuple(int(x) for x in m.group(1).split(",")) if m.group(1) else ()


def attr_str(raw: str) -> str:
    return attr_bytes(raw).decode("latin-1")


def attr_sym(raw: str) -> str:
    raw = raw.strip()
    if not raw.startswith("@"):
        raise LiftError(f"expected a symbol reference, got {raw[:80]!r}")
    return attr_str(raw[1:]) if raw[1:2] == '"' else raw[1:]


@functools.lru_cache(maxsize=256)
def attr_bytes(raw: str) -> bytes:
    """Decode an MLIR string literal (``"..."`` with ``\\XX`` hex escapes) to bytes."""
    raw = raw.strip()
    if raw.startswith('"'):
        end = _end_string(raw, 0)
        body = raw[1 : end - 1]
    else:
        raise LiftError(f"expected a string attribute, got {raw[:80]!r}")
    out = bytearray()
    i = 0
    while i < len(body):
        c = body[i]
        if c == "\\":
            nxt = body[i + 1]
            if nxt in '\\"':
                out.append(ord(nxt))
                i += 2
            elif nxt == "n":
                out.append(10)
                i += 2
            elif nxt == "t":
                out.append(9)
                i += 2
            else:
                out.append(int(body[i + 1 : i + 3], 16))
                i += 3
        else:
            out.extend(c.encode("utf-8"))
            i += 1
    return bytes(out)
