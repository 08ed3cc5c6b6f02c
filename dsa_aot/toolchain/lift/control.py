"""Control flow of the host code: which branches the lifter follows, and how a branch on a run-time
value becomes Python control flow in the launcher.

A branch on a constant is followed; a CUDA status check follows the success side; a run-time
branch is accepted when one side is an error path (a raising check), when it opens pure integer
arithmetic that rejoins (a helper function), when it is the header of a loop (a ``while``) or when
its arms rejoin (an ``if``/``else``). Anything else fails closed.
"""

from __future__ import annotations

from .. import ir
from ...errors import LiftError
from .arith import BINOPS, ICMP, SIGNED
from .values import K, S, mask

# ops a run-time region may run for it to be emitted as plain Python arithmetic
PURE = {"llvm.mlir.constant", "llvm.icmp", "llvm.select", "llvm.zext", "llvm.sext", "llvm.trunc", "llvm.br", "llvm.cond_br", *BINOPS}


def _deps(lines):
    """Everything a block of residual lines reads (a nested block keeps its reads alive as a whole)."""
    return [d for _, _, deps, _ in lines for d in deps]


class ControlFlow:
    """The branch handling of the interpreter (mixed into it: uses its env, lines and run_blocks)."""

    def cond_br(self, op, ops, func):
        c = ops[0]
        seg = ir.attr_ints(op.prop("operandSegmentSizes"))
        tside, fside = (op.successors[0], ops[1 : 1 + seg[1]]), (op.successors[1], ops[1 + seg[1] :])
        if isinstance(c, K):
            return ("jump", *(tside if c.v else fside))
        if not isinstance(c, S):
            raise LiftError(f"{op.where()}: branch on {c!r}")
        if c.okwhen is not None:  # error check on a shim's status: follow success
            return ("jump", *(tside if c.okwhen else fside))
        t_err, f_err = is_error_path(func, tside[0]), is_error_path(func, fside[0])
        if t_err and not f_err:
            self.effect(f"if {c.name}: raise LaunchError({err_text(op, func, tside[0])!r})", [c])
            return ("jump", *fside)
        if f_err and not t_err:
            self.effect(f"if not {c.name}: raise LaunchError({err_text(op, func, fside[0])!r})", [c])
            return ("jump", *tside)
        return self.runtime_branch(op, func, c, tside, fside)

    def runtime_branch(self, op, func, c, tside, fside):
        """A branch on run-time ``c`` where neither side is an error path."""
        (t, _), (f, _) = tside, fside
        # a run-time branch into pure integer arithmetic that rejoins (e.g. fast-divmod set-up loops):
        # emitted as a small Python function of its inputs, returning the values at the join
        join, region, why = pure_region(func, t, f)
        if join is not None:
            return self.region_call(op, func, c, tside, fside, join, region)
        body = natural_loop(func, self.label)
        if t in body and f not in body:
            return self.loop(op, func, tside, fside)
        join, region = join_of(func, t, f)
        # an if/else may not contain the branch itself, a loop, or the header of a loop being lifted
        # (its arms would hold that loop's back edge)
        if join is not None and self.label not in region and not body and not region & set(self.headers):
            return self.branch(op, func, c, tside, fside, join)
        raise LiftError(f"{op.where()}: branch on a run-time value ({c.name}) where neither side is an error path, and the region it "
                        f"opens is not pure arithmetic ({why}), a loop with launches, or an if/else whose arms rejoin; the lifter only "
                        f"follows host code whose control flow it can reproduce")

    def run_until(self, func, label, stop, op, why):
        """Interpret from ``label`` up to the branch to ``stop``; its block arguments."""
        res = self.run_blocks(func, self.env, label, stop=stop)
        if not (isinstance(res, tuple) and res[0] == "stop"):
            raise LiftError(f"{op.where()}: {why}")
        return res[1]

    def memory(self):
        return {id(r): dict(r.fields) for r in self.regions}

    def check_memory(self, before, op, who, what, kinds):
        """A loop body or an if arm is emitted once but may run any number of times (or not at all), so
        it must not change memory the lifter modelled before it: its constants would go stale."""
        for r in self.regions:
            if id(r) in before and r.fields != before[id(r)]:
                raise LiftError(f"{op.where()}: {who} writes {r.name}, allocated before the {what}; the lifter only lifts "
                                f"{kinds} whose memory is their own")

    def branch(self, op, func, c, tside, fside, join):
        """A run-time if/else whose arms rejoin (a kernel launched only for some extents): emitted as a
        Python if/else. Each arm is interpreted once; the join's block arguments become variables the
        arms assign. Like a loop body, an arm must leave host memory allocated before it alone."""
        self.nif += 1
        outs = []
        for i, (_, ty) in enumerate(func.blocks[join].args):
            t = ir.parse_type(ty)
            if not isinstance(t, ir.Int):
                raise LiftError(f"{op.where()}: the arms of a run-time branch join with a {t}, not an integer")
            outs.append(S(f"J{self.nif}_{i}", t.bits))
        before = self.memory()
        arms = [self.arm(op, func, side, join, outs) for side in (tside, fside)]
        self.check_memory(before, op, "an arm of a run-time branch", "branch", "arms")
        self.lines.append((None, (f"if {c.name}:", arms[0]), [c] + _deps(arms[0]), True))
        self.lines.append((None, ("else:", arms[1]), _deps(arms[1]), True))
        return ("jump", join, outs)

    def arm(self, op, func, side, join, outs):
        """The residual lines of one arm of an if/else, ending in the assignment of the join's values."""
        label, vals = side
        outer_lines, self.lines = self.lines, []
        if label != join:
            for (an, _), v in zip(func.blocks[label].args, vals):
                self.env[an] = v
            vals = self.run_until(func, label, join, op, f"an arm of a run-time branch returns instead of reaching block {join}")
        for o, v in zip(outs, vals):
            if not isinstance(v, (K, S)):
                raise LiftError(f"{op.where()}: an arm of a run-time branch yields {v!r} at block {join}")
            self.effect(f"{o.name} = {self.x(v)}", [v])
        arm, self.lines = self.lines, outer_lines
        return arm

    def loop(self, op, func, body, exit_):
        """A loop whose header branches on a run-time value (e.g. waves over S_q, with launches in
        the body): emitted as a Python while loop. The body is interpreted once with the header's
        block arguments as loop variables; it must not write host memory allocated before the loop."""
        header = self.label
        hblock = func.blocks[header]
        env = self.env
        lv = self.loop_vars(op, hblock)
        if lv:
            self.effect(f"{', '.join(v.name for v in lv)} = {', '.join(self.x(env[an]) for an, _ in hblock.args)}", [env[an] for an, _ in hblock.args])
        before = self.memory()
        outer_lines, self.lines = self.lines, []
        for (an, _), v in zip(hblock.args, lv):
            env[an] = v
        for o in hblock.ops[:-1]:  # the header again, now over the loop variables
            self.step(o, env, func)
        cond = self.val(env, op.operands[0], op)
        if isinstance(cond, K):
            raise LiftError(f"{op.where()}: the loop condition folds to a constant over the loop variables")
        self.effect(f"if not {cond.name}: break", [cond])
        seg = ir.attr_ints(op.prop("operandSegmentSizes"))
        bvals = [self.val(env, x, op) for x in op.operands[1 : 1 + seg[1]]]
        for (an, _), v in zip(func.blocks[body[0]].args, bvals):
            env[an] = v
        self.headers.append(header)  # an if/else in the body must rejoin inside it
        nxt = self.run_until(func, body[0], header, op, "the loop body returns instead of looping back")
        self.headers.pop()
        for v in nxt:
            if not isinstance(v, (K, S)):
                raise LiftError(f"{op.where()}: a loop variable's next value is {v!r}")
        if lv:
            self.effect(f"{', '.join(v.name for v in lv)} = {', '.join(self.x(v) for v in nxt)}", list(nxt))
        self.check_memory(before, op, "the loop body", "loop", "loops")
        inner, self.lines = self.lines, outer_lines
        self.lines.append((None, ("while True:", inner), _deps(inner), True))
        self.label = header
        # after the loop: the exit edge's values, computed by the last (failing) header evaluation
        fvals = [self.val(env, x, op) for x in op.operands[1 + seg[1] :]]
        return ("jump", exit_[0], fvals)

    def loop_vars(self, op, hblock):
        """Fresh residual names for the header's block arguments (which must start as integers)."""
        self.nloop += 1
        lv = []
        for i, (an, ty) in enumerate(hblock.args):
            t = ir.parse_type(ty)
            if not isinstance(t, ir.Int):
                raise LiftError(f"{op.where()}: loop variable {an} is a {t}, not an integer")
            cur = self.env[an]
            if not isinstance(cur, (K, S)):
                raise LiftError(f"{op.where()}: loop variable {an} starts as {cur!r}")
            lv.append(S(f"L{self.nloop}_{i}", t.bits))
        return lv

    def region_call(self, op, func, c, tside, fside, join, region):
        """Pure arithmetic between a run-time branch and its join, as a module-level function of the
        branch condition and the residuals it reads; the join's arguments are its results."""
        env_names = {}
        params, args = [], []

        def outer(name):
            # a value the region reads but does not define: constant literal or a residual passed in
            v = self.env[name]
            if isinstance(v, K):
                return str(v.v)
            if not isinstance(v, S):
                raise LiftError(f"{op.where()}: the run-time region reads {name} = {v!r}, not an integer")
            if name not in env_names:
                env_names[name] = f"x{len(params)}"
                params.append(env_names[name])
                args.append(v)
            return env_names[name]

        src = region_source(func, region, join, tside, fside, outer)
        self.nregion += 1
        fname = f"_region{self.nregion}"
        self.functions.append(f"def {fname}({', '.join(['c', *params])}):\n" + src)
        call = self.emit(f"{fname}({', '.join([c.name] + [a.name for a in args])})", 0, [c, *args])
        outs = []
        for i, (_, ty) in enumerate(func.blocks[join].args):
            t = ir.parse_type(ty)
            if not isinstance(t, ir.Int):
                raise LiftError(f"{op.where()}: the run-time region yields a {t}, not an integer")
            outs.append(self.emit(f"{call.name}[{i}]", t.bits, [call]))
        return ("jump", join, outs)


# --- CFG analysis --------------------------------------------------------------------------------


def is_error_path(func, label, seen=None):
    """A block that, through unconditional branches only, ends in trap/unreachable."""
    seen = seen or set()
    if label in seen:
        return False
    seen.add(label)
    for op in func.blocks[label].ops:
        if op.name in ("llvm.intr.trap", "llvm.unreachable"):
            return True
        if op.name == "llvm.br":
            return is_error_path(func, op.successors[0], seen)
        if op.name in ("llvm.cond_br", "llvm.return"):
            return False
    return False


def err_text(op, func, label):
    return f"the host code of this kernel takes its error path at host.mlir line {op.line} (block {label} of {func.name}); the arguments are outside what the kernel supports"


def succs(func, label):
    term = func.blocks[label].ops[-1]
    return list(term.successors) if term.name in ("llvm.br", "llvm.cond_br") else []


def natural_loop(func, header):
    """Blocks of the natural loop(s) with this header: those that reach a back edge into it without
    passing through it (empty when nothing loops back)."""
    preds = {}
    for b in func.blocks:
        for x in succs(func, b):
            preds.setdefault(x, []).append(b)
    # back edges: from blocks the header dominates (no path from the entry that avoids the header
    # reaches them)
    latches = [p for p in preds.get(header, []) if reaches(func, header, p) and not reaches(func, func.entry, p, avoid=header)]
    body, todo = {header}, list(latches)
    while todo:
        b = todo.pop()
        if b in body:
            continue
        body.add(b)
        todo += preds.get(b, [])
    return body if latches else set()


def reaches(func, start, target, avoid=None):
    """Whether ``target`` can be reached from block ``start`` (without passing block ``avoid``)."""
    seen, todo = {avoid}, [start]
    while todo:
        b = todo.pop()
        if b == target:
            return True
        if b in seen:
            continue
        seen.add(b)
        todo += succs(func, b)
    return False


def abnormal_exit(func, label):
    """An error path (trap), or a block that only returns a status some call produced (a failed launch)."""
    if is_error_path(func, label):
        return True
    ops = func.blocks[label].ops
    if len(ops) == 1 and ops[0].name == "llvm.return" and len(ops[0].operands) == 1:
        v = ops[0].operands[0]
        return any(o.name == "llvm.call" and v in o.results for b in func.blocks.values() for o in b.ops)
    return False


def _post_dominators(labels, succ):
    """block -> the blocks on every path from it to an exit (the iterative set formulation)."""
    pdom = {b: set(labels) for b in labels}
    for b in labels:
        if not succ[b]:
            pdom[b] = {b}
    changed = True
    while changed:
        changed = False
        for b in labels:
            if not succ[b]:
                continue
            new = {b} | set.intersection(*(pdom[x] for x in succ[b]))
            if new != pdom[b]:
                pdom[b], changed = new, True
    return pdom


def join_of(func, t, f, skip_errors=True):
    """(join, blocks between) for the paths from ``t`` and ``f``: their nearest common post-dominator,
    error exits left out unless ``skip_errors`` is false; (None, None) when they never rejoin."""
    labels = list(func.blocks)
    bad = {b for b in labels if abnormal_exit(func, b)} if skip_errors else set()
    succ = {b: [x for x in succs(func, b) if x not in bad] for b in labels}
    pdom = _post_dominators(labels, succ)
    cands = pdom[t] & pdom[f]
    join = next((j for j in cands if cands <= pdom[j]), None)
    if join is None:
        return None, None
    region, todo = set(), [t, f]
    while todo:
        b = todo.pop()
        if b == join or b in region:
            continue
        region.add(b)
        todo += succ[b]
    return join, region


def pure_region(func, t, f):
    """(join, blocks, None) when the paths from a run-time branch rejoin at one block and run only
    pure integer ops until then; else (None, None, why)."""
    join, region = join_of(func, t, f, skip_errors=False)
    if join is None:
        return None, None, "its paths never rejoin"
    for b in region:
        for o in func.blocks[b].ops:
            if o.name not in PURE:
                return None, None, f"{o.name} at host.mlir line {o.line}"
            if o.name == "llvm.mlir.constant" and not isinstance(o.result_type, ir.Int):
                return None, None, f"a non-integer constant at host.mlir line {o.line}"
    return join, region, None


# --- a pure region as Python source --------------------------------------------------------------


def _name(v):
    return "r" + v.lstrip("%").replace("#", "_")


def region_source(func, region, join, tside, fside, outer):
    """Python source of a state machine over ``region``: block by block, returns the join's arguments.
    ``outer(name)`` spells a value defined outside the region (it may add a parameter: values are
    spelled in the order they are read)."""
    defined = {a for b in region for a, _ in func.blocks[b].args} | {r for b in region for o in func.blocks[b].ops for r in o.results}

    def val(v):
        return _name(v) if v in defined else outer(v)

    order = sorted(region, key=list(func.blocks).index)
    ids = {b: i for i, b in enumerate(order)}

    def goto(target, vals, ind):
        if target == join:
            return [f"{ind}return ({''.join(val(v) + ', ' for v in vals)})"]
        lines = [f"{ind}b = {ids[target]}"]
        names = [_name(an) for an, _ in func.blocks[target].args]
        if names:  # one tuple assignment: block arguments are assigned in parallel
            lines.append(f"{ind}{', '.join(names)} = {', '.join(val(v) for v in vals)}")
        return lines

    def branch(cond, tside, fside, ind):
        return [f"{ind}if {cond}:", *goto(*tside, ind + "    "), f"{ind}else:", *goto(*fside, ind + "    ")]

    body = ["    steps = 0", *branch("c", tside, fside, "    ")]
    body += ["    while True:", "        steps += 1", "        if steps > 1000000:",
             "            raise LaunchError('a run-time loop of the host code did not finish')"]
    ind = "            "
    for b in order:
        body.append(f"        {'if' if b == order[0] else 'elif'} b == {ids[b]}:")
        for o in func.blocks[b].ops:
            a = [val(x) for x in o.operands]
            if o.name == "llvm.br":
                body += goto(o.successors[0], o.operands, ind)
            elif o.name == "llvm.cond_br":
                seg = ir.attr_ints(o.prop("operandSegmentSizes"))
                tv, fv = o.operands[1 : 1 + seg[1]], o.operands[1 + seg[1] :]
                body += branch(a[0], (o.successors[0], tv), (o.successors[1], fv), ind)
            elif o.results:
                body.append(f"{ind}{_name(o.results[0])} = {_op_expr(o, a)}")
    return "\n".join(body) + "\n"


def _op_expr(o, a):
    """The Python expression of one pure op over the spelled operands ``a``."""
    if o.name == "llvm.mlir.constant":
        return f"{ir.attr_int(o.prop('value')) & mask(o.result_type.bits)}"
    if o.name in BINOPS:
        bits = o.result_type.bits
        fn, needs = BINOPS[o.name]
        return f"{fn}({a[0]}, {a[1]}, {bits})" if needs else fn.format(a=a[0], b=a[1], m=hex(mask(bits)))
    if o.name == "llvm.icmp":
        pred = ICMP[ir.attr_int(o.prop("predicate"))]
        bits = o.operand_types[0].bits
        cmp = f"sx({a[0]}, {bits}) {SIGNED[pred]} sx({a[1]}, {bits})" if pred in SIGNED else f"{a[0]} {pred} {a[1]}"
        return f"int({cmp})"
    if o.name == "llvm.select":
        return f"{a[1]} if {a[0]} else {a[2]}"
    if o.name == "llvm.zext":
        return a[0]
    if o.name == "llvm.trunc":
        return f"{a[0]} & {hex(mask(o.result_type.bits))}"
    if o.name == "llvm.sext":
        return f"sx({a[0]}, {o.operand_types[0].bits}) & {hex(mask(o.result_type.bits))}"
    raise LiftError(f"{o.where()}: {o.name} in a run-time region")  # pure_region admits only PURE ops
