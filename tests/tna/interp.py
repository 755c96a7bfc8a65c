"""The program of p4src/thc_tna.p4 that tests/tna/pass0.py runs: its constants, field widths,
parser states, RegisterActions, actions and tables (``Program``, read from tests/tna/p4text.py's
tokens), and one pass of one packet through them (``Machine``): metadata starts at zero,
arithmetic wraps at the declared width, a table matches its const entries in order.
"""
from __future__ import annotations

import re
from collections import Counter

from tests.tna.p4text import (ARITH, COMPARE, INTRINSIC, P1_VALID, PASS1, SKIP, TNA_TYPES,
                              Parser, Unsupported, find_body, mask, signed, tokenize)
from thc.controller import program as names

FIELD = re.compile(r"(?:(?:bit|int)\s*<\s*(\d+)\s*>|(\w+))\s*(?:\[[^\]]*\])?\s+(\w+)\s*;")


PIPES = {"ingress": ("ThcIngressParser", "ThcIngress", None, "tna_headers_t", "metadata_t"),
         "egress": ("ThcEgressParser", "ThcEgress", "ThcEgressDeparser", "eg_headers_t",
                    "eg_metadata_t")}
"""Each half of the pipe the reading runs: its parser, control, deparser (the ingress
deparser's order is held to its text, tests/tna/lanes.py) and header and metadata types."""


class Program:
    """What the program declares: types, constants, a parser's states, and a control's
    registers, RegisterActions, hashes, counters, actions, tables and apply (ThcIngress; or
    ThcEgress, with its deparser's checksums and apply: :attr:`egress`)."""

    def __init__(self, text: str, raw: str | None = None, pipe: str = "ingress"):
        self.text, self.raw, self.pipe = text, raw, pipe
        """The program's text before cpp, where it differs from the file's (a broken copy):
        tests/tna/words.py reads its THC_WORD macro from it."""
        self.typedefs = dict(TNA_TYPES, **{m[2]: int(m[1]) for m in re.finditer(
            r"typedef\s+bit\s*<\s*(\d+)\s*>\s*(\w+)\s*;", text)})
        self.structs = {k: dict(v) for k, v in INTRINSIC.items()}
        for m in re.finditer(r"\b(?:header|struct)\s+(\w+)\s*\{([^{}]*)\}", text):
            self.structs[m[1]] = {f[3]: int(f[1]) if f[1] else self.typedefs.get(f[2], f[2])
                                  for f in FIELD.finditer(m[2])}
        parser, control, deparser, headers, metadata = PIPES[pipe]
        self.roots = {"meta": metadata, "hdr": headers, **{k: k for k in INTRINSIC}}
        self.consts, self.widths, self.layouts = {}, {}, {}
        for m in re.finditer(r"\bconst\s+(bit|int)\s*<\s*(\d+)\s*>\s*(\w+)\s*=\s*([^;]+);", text):
            w = int(m[2])
            self.consts[m[3]] = (self.const(Parser(tokenize(m[4])).expr())[0] & mask(w), w,
                                 m[1] == "int")
        toks = tokenize(text)
        self.states, body = {}, find_body(toks, "parser", parser)
        while body.accept("state"):
            name = body.next()
            self.states[name] = self.state(body.group())
        self.registers, self.ras, self.hashes, self.counters = {}, {}, {}, set()
        self.checksums: set[str] = set()
        self.actions, self.tables, self.apply, self.deparse = {}, {}, None, None
        if deparser:
            self.declarations(find_body(toks, "control", deparser))
            self.deparse, self.apply = self.apply, None
        self.declarations(find_body(toks, "control", control))
        missing = [t for t in PASS1 + (names.JOB_TABLE, names.WORKER_TABLE)
                   if t not in self.tables and t not in self.actions] if pipe == "ingress" \
            else [t for t in (names.ADDR_TABLE,) if t not in self.tables]
        if missing or self.apply is None:
            raise Unsupported(f"{control} has no {missing or 'apply block'}")
        self._egress: Program | None = None

    @property
    def egress(self) -> "Program":
        """The egress half of the same text, read once."""
        if self._egress is None:
            self._egress = Program(self.text, self.raw, "egress")
        return self._egress

    def const(self, e) -> tuple:
        v = Machine(self, {}, Counter(), {}).eval(e)
        return (int(v), 1, False) if isinstance(v, bool) else v

    def cells(self, raw: list) -> list:
        """A key set's cells as (value, mask) integers (mask -1: exact), None: any."""
        return [None if c is None else (self.const(c[0])[0],
                                        -1 if c[1] is None else self.const(c[1])[0]) for c in raw]

    def state(self, p: Parser):
        body = []
        while not p.accept("transition"):
            body.append(p.stmt())
        if not p.accept("select"):
            return body, [], [(None, p.next())]
        g = p.group()
        keys, sub, cases = g.items(g.expr), p.group(), []
        while sub.peek() is not None:
            cells = self.cells(sub.keyset(len(keys)))
            sub.expect(":")
            cases.append((cells, sub.next()))
            sub.expect(";")
        return body, keys, cases

    def declarations(self, p: Parser) -> None:
        while p.peek() is not None:
            tok = p.next()
            if tok == "@":
                p.next()
                p.group()
            elif tok == "Checksum":   # Checksum() name;
                p.group()
                self.checksums.add(p.next())
                p.expect(";")
            elif tok in ("Register", "RegisterAction", "Hash", "Counter"):
                g = p.group()
                types, args, name = g.items(g.type_), p.group().t, p.next()
                if tok == "Register":
                    self.registers[name] = self.resolve(types[0])
                elif tok == "Hash":
                    if args != ["HashAlgorithm_t", ".", "IDENTITY"]:
                        raise Unsupported(f"hash {name}: {' '.join(args)}")
                    self.hashes[name] = self.resolve(types[0])[0]
                elif tok == "Counter":
                    self.counters.add(name)
                else:
                    p.expect("=")
                    self.ras[name] = self.register_action(p.group(), args[0], types[2])
                p.expect(";")
            elif tok == "action":
                name, g = p.next(), p.group()
                params = g.items(lambda: (self.resolve(g.type_()), g.next()))
                self.actions[name] = ([(n, t) for t, n in params], ("block", p.group().stmts()))
            elif tok == "table":
                name = p.next()
                self.tables[name] = self.table(name, p.group())
            elif tok == "apply":
                self.apply = ("block", p.group().stmts())
            elif tok != ";":
                p.skip()   # an instance, such as ThcWord00() thc_w00;

    def register_action(self, g: Parser, reg: str, out_type):
        """(register, value parameter, out parameter or None, its type, body)."""
        g.expect("void")
        g.expect("apply")
        h = g.group()
        params = h.items(lambda: (h.next(), h.type_(), h.next()))
        out = params[1][2] if len(params) > 1 else None
        return reg, params[0][2], out, self.resolve(out_type), ("block", g.group().stmts())

    def table(self, name: str, p: Parser) -> dict:
        t = {"keys": [], "key_names": [], "entries": [], "default": ("NoAction", []),
             "first": {}}   # by key: the index of the first const entry it matches, or None
        while p.peek() is not None:
            p.accept("const")
            prop = p.next()
            p.expect("=")
            if prop == "key":
                g = p.group()
                while g.peek() is not None:
                    t["keys"].append(g.expr())
                    g.expect(":")
                    if g.next() not in ("exact", "ternary"):
                        raise Unsupported(f"table {name}: match kind {g.t[g.i - 1]}")
                    named = g.accept("@") and g.next() == "name"
                    t["key_names"].append(g.group().next().strip('"') if named else None)
                    g.expect(";")
            elif prop == "entries":
                g = p.group()
                while g.peek() is not None:
                    cells = self.cells(g.keyset(len(t["keys"])))
                    g.expect(":")
                    call = g.expr()
                    g.expect(";")
                    t["entries"].append((cells, call[2], [self.const(a) for a in call[3]]))
            elif prop == "actions":
                p.group()
            elif prop == "default_action":
                e = p.expr()
                p.expect(";")
                t["default"] = (e[1], []) if e[0] == "path" else \
                    (e[2], [self.const(a) for a in e[3]])
            elif prop == "size":
                p.skip()
            else:
                raise Unsupported(f"table {name}: property {prop}")
        return t

    def resolve(self, typ):
        """A declared type -> (width, signed), or the name of a struct."""
        if isinstance(typ, tuple) or typ in self.structs:
            return typ
        if typ in self.typedefs:
            return (self.typedefs[typ], False)
        raise Unsupported(f"type {typ}")

    def layout(self, path: str) -> list[tuple[str, int]]:
        """The fields of the header at ``path`` (``hdr.udp``, ``meta.p1``) with their widths,
        in packet order."""
        if path in self.layouts:
            return self.layouts[path]
        parts = path.split(".")
        typ = self.roots.get(parts[0])
        for part in parts[1:]:
            typ = self.structs.get(typ, {}).get(part)
        fields = self.structs.get(typ) if isinstance(typ, str) else None
        if not fields or not all(isinstance(w, int) for w in fields.values()):
            raise Unsupported(f"{path} is not a header")
        layout = self.layouts[path] = [(f"{path}.{k}", w) for k, w in fields.items()]
        return layout

    def width(self, path: str) -> int:
        w = self.widths.get(path)
        if w is None:
            parts = re.sub(r"\[\d+\]", "", path).split(".")
            typ = self.roots.get(parts[0])
            for part in parts[1:]:
                if part not in self.structs.get(typ, {}):
                    raise Unsupported(f"field {path}")
                typ = self.structs[typ][part]
            if not isinstance(typ, int):
                raise Unsupported(f"{path} is not a bit field")
            w = self.widths[path] = typ
        return w


PORT_METADATA = "PORT_METADATA_SIZE"
"""tna.p4's size of the port metadata the ingress parser skips after the intrinsic
metadata."""


class Machine:
    """One pass of one packet: its fields (metadata starts at zero, @pa_auto_init_metadata),
    header validity and the interpreter; registers, counters and entries are the engine's."""

    def __init__(self, prog: Program, regs: dict, counters: Counter, installed: dict):
        self.p, self.regs, self.counters, self.installed = prog, regs, counters, installed
        self.f: dict[str, int] = {}
        self.valid: set[str] = set()
        self.packet: bytes | None = None
        """The bytes the parser extracts headers from (the intrinsic metadata and the lane
        stacks aside), and how many bits of them it has read."""
        self.at = 0
        self.skipped = prog.pipe == "egress"
        """Whether the parser skipped the port metadata after the intrinsic metadata (an
        egress parser reads none)."""
        self.locals: dict[str, list] = {}
        self.out, self.out_bits = 0, 0
        """What the deparser emitted, as one number of so many bits."""

    def eval(self, e):
        """A bool, or (value, width or None for an unsized literal, signed)."""
        kind = e[0]
        if kind == "path":
            return self.read(e[1])
        if kind in ("num", "bool"):
            return e[1] if kind == "bool" else e[1:]
        if kind == "slice":
            v = self.eval(e[1])
            if isinstance(v, bool) or v[1] is None or not v[1] > e[2] >= e[3] >= 0:
                raise Unsupported(f"slice [{e[2]}:{e[3]}] of {v!r}")
            return (v[0] >> e[3] & mask(e[2] - e[3] + 1), e[2] - e[3] + 1, False)
        if kind == "cast":
            (width, sign), v = self.p.resolve(e[1]), self.eval(e[2])
            return ((int(v) if isinstance(v, bool) else v[0]) & mask(width), width, sign)
        if kind == "un":
            v = self.eval(e[2])
            if e[1] == "!":
                return not self.boolean(v, "!")
            if v[1] is None:
                raise Unsupported(f"{e[1]} of an unsized literal")
            return ((~v[0] if e[1] == "~" else -v[0]) & mask(v[1]), v[1], v[2])
        if kind == "bin":
            return self.binary(e[1], e[2], e[3])
        if kind == "call":
            return self.call(e)
        if kind == "lookahead":
            typ = self.p.resolve(e[1])
            if not isinstance(typ, tuple):
                raise Unsupported(f"pkt.lookahead<{typ}>")
            return self.ahead(*typ)
        value, width = 0, 0
        for item in map(self.eval, e[1]):   # a list: concatenation (a hash's input)
            value, width = value << item[1] | item[0], width + item[1]
        return (value, width, False)

    def binary(self, op: str, a, b):
        if op in ("&&", "||"):
            x = self.boolean(self.eval(a), op)
            return (x and self.boolean(self.eval(b), op)) if op == "&&" else \
                (x or self.boolean(self.eval(b), op))
        x, y = self.eval(a), self.eval(b)
        if isinstance(x, bool) or isinstance(y, bool):
            raise Unsupported(f"{op} of a bool")
        (xv, xw, xs), (yv, yw, ys) = x, y
        if op == "++":
            return (xv << yw | yv, xw + yw, False)
        if op in ("<<", ">>"):
            v = xv << yv if op == "<<" else (signed(xv, xw) if xs else xv) >> yv
            return (v & mask(xw) if xw else v, xw, xs)
        if xw is not None and yw is not None and xw != yw:
            raise Unsupported(f"{op} of bit<{xw}> and bit<{yw}>")
        w, sign = xw if xw is not None else yw, xs or ys
        if w is not None:
            xv, yv = xv & mask(w), yv & mask(w)
        if op in COMPARE:
            return COMPARE[op](signed(xv, w), signed(yv, w)) if sign else COMPARE[op](xv, yv)
        v = ARITH[op](xv, yv)
        return (v & mask(w) if w else v, w, sign)

    @staticmethod
    def boolean(v, op: str) -> bool:
        """P4 has no truthiness: p4c refuses a bit<n> where a bool goes."""
        if not isinstance(v, bool):
            raise Unsupported(f"{op} of {v!r}, not a bool")
        return v

    def slot(self, path: str):
        """(container, key, width, signed) of a field, a local, or a local struct's field."""
        head, _, rest = path.partition(".")
        local = self.locals.get(head)
        if local is None:
            return self.f, path, self.p.width(path), False
        return (local[0], rest, self.p.structs[local[1]][rest], False) if rest else \
            (local, 0, *local[1])

    def read(self, path: str):
        if self.locals and path.partition(".")[0] in self.locals:
            c, k, w, sign = self.slot(path)
            return (c.get(k, 0) if isinstance(c, dict) else c[k], w, sign)
        const = self.p.consts.get(path)
        if const is not None:
            return const
        return (self.f.get(path, 0), self.p.width(path), False)

    def assign(self, lhs, value) -> None:
        hi, lo = (lhs[2], lhs[3]) if lhs[0] == "slice" else (None, None)
        lhs = lhs[1] if lhs[0] == "slice" else lhs
        if lhs[0] != "path":
            raise Unsupported(f"assignment to {lhs!r}")
        c, k, w, _ = self.slot(lhs[1])
        if not isinstance(value, bool) and value[1] is not None and \
                value[1] != (w if hi is None else hi - lo + 1):
            raise Unsupported(f"{lhs[1]} = a bit<{value[1]}> value: p4c wants a cast")
        v = int(value) if isinstance(value, bool) else value[0]
        if hi is not None:
            m = mask(hi - lo + 1) << lo
            v = self.read(lhs[1])[0] & ~m | v << lo & m
        c[k] = v & mask(w)

    def call(self, e):
        _, target, method, args = e
        if target is None:
            return self.action(method, [self.eval(a) for a in args])
        if target == "pkt":   # the parser: extract marks a header valid and reads it
            if method == "extract":
                self.valid.add(args[0][1])
                self.take(args[0][1])
            elif method == "advance" and args[0] == ("path", PORT_METADATA) \
                    and "ig_intr_md" in self.valid and not self.skipped:
                self.skipped = True   # the port metadata: not in :attr:`packet`
            elif method == "advance":
                self.at += self.eval(args[0])[0]
            elif method == "emit":
                self.emit(args[0][1])
            else:
                raise Unsupported(f"pkt.{method}")
        elif method == "isValid":
            return target in self.valid
        elif method in ("setValid", "setInvalid"):
            (self.valid.add if method == "setValid" else self.valid.discard)(target)
        elif method == "apply" and target in self.p.tables:
            return self.apply_table(target)
        elif method == "execute" and target in self.p.ras:
            return self.execute(target, self.eval(args[0])[0])
        elif method == "get" and target in self.p.hashes:   # IDENTITY
            width = self.p.hashes[target]
            return (self.eval(args[0])[0] & mask(width), width, False)
        elif method == "update" and target in self.p.checksums:   # the IPv4 header's sum
            value, width, _ = self.eval(args[0])
            if width % 16:
                raise Unsupported(f"{target}.update of {width} bits")
            total = sum(value >> s & 0xFFFF for s in range(0, width, 16))
            while total >> 16:
                total = (total & 0xFFFF) + (total >> 16)
            return (~total & 0xFFFF, 16, False)
        elif method == "count" and target in self.p.counters:
            self.counters[target, self.eval(args[0])[0]] += 1
        elif target == "this" and method == "predicate":
            c0, c1 = (bool(self.eval(a)) for a in args)
            return (1 << (c0 + 2 * c1), 4, False)   # one-hot: neither, c0, c1, both
        else:
            raise Unsupported(f"call {target}.{method}")
        return None

    def action(self, name: str, args: list) -> None:
        if name == "NoAction" or name.startswith(SKIP):
            return
        if name not in self.p.actions:
            raise Unsupported(f"action {name}")
        params, body = self.p.actions[name]
        saved = self.locals
        self.locals = {pname: [(int(a) if isinstance(a, bool) else a[0]) & mask(ptype[0]), ptype]
                       for (pname, ptype), a in zip(params, args, strict=True)}
        self.run(body)
        self.locals = saved

    def execute(self, name: str, index: int):
        """RegisterAction ``name`` on cell ``index`` (an int, or a dict of a struct's fields,
        zero at first); returns its out parameter, 0 when unwritten."""
        reg, value, out, out_type, body = self.p.ras[name]
        typ, cells = self.p.registers[reg], self.regs.setdefault(reg, {})
        cur = cells.get(index, 0)
        if isinstance(typ, str):
            cur = dict(cur or dict.fromkeys(self.p.structs[typ], 0))
        saved = self.locals
        self.locals = {value: [cur, typ], **({out: [0, out_type]} if out else {})}
        self.run(body)
        cells[index] = self.locals[value][0]
        result = self.locals[out][0] if out else 0
        self.locals = saved
        return (result, out_type[0], False)

    def keys(self, exprs) -> list[int]:
        return [int(v) if isinstance(v, bool) else v[0] for v in map(self.eval, exprs)]

    @staticmethod
    def matches(cells: list, keys: list[int]) -> bool:
        return all(c is None or k & c[1] == c[0] & c[1] for c, k in zip(cells, keys, strict=True))

    def apply_table(self, name: str) -> bool:
        """The first matching entry (const entries in order, then the controller's) runs its
        action, else the default action."""
        t = self.p.tables[name]
        keys = self.keys(t["keys"])
        key = tuple(keys)
        first = t["first"].get(key, -1)   # the const entries never change
        if first == -1:
            first = t["first"][key] = next(
                (i for i, (cells, _, _) in enumerate(t["entries"]) if self.matches(cells, keys)),
                None)
        hit = t["entries"][first] if first is not None else next(
            (e for e in self.installed.get(name, []) if self.matches(e[0], keys)), None)
        if hit is not None:
            self.action(hit[1], hit[2])
            return True
        self.action(*t["default"])
        return False

    def run(self, s, only: tuple | None = None) -> None:
        """Execute a statement; ``only``: in passes 1 and 2, just these tables' apply and
        these actions."""
        kind = s[0]
        if kind == "block":
            for x in s[1]:
                self.run(x, only)
        elif only is not None:
            if kind == "do" and (s[1][1] if s[1][2] == "apply" else s[1][2]) in only:
                self.call(s[1])
        elif kind == "if":
            cond = self.eval(s[1])
            if not isinstance(cond, bool):
                raise Unsupported(f"condition {s[1]!r} is not a bool")
            if cond:
                self.run(s[2], PASS1 if s[1] == P1_VALID else None)
            elif s[3] is not None:
                self.run(s[3])
        elif kind == "assign":
            self.assign(s[1], self.eval(s[2]))
        else:
            self.call(s[1])

    def ahead(self, width: int, sign: bool) -> tuple:
        """``pkt.lookahead``: the next ``width`` bits of :attr:`packet`, not extracted."""
        if self.packet is None or not self.skipped:
            raise Unsupported("pkt.lookahead before the packet's headers")
        end = self.at + width
        if end > 8 * len(self.packet):
            raise AssertionError(f"the parser looks ahead past the packet's "
                                 f"{len(self.packet)} bytes")
        value = int.from_bytes(self.packet, "big") >> (8 * len(self.packet) - end)
        return (value & mask(width), width, sign)

    def take(self, path: str) -> None:
        """Extract the header at ``path`` from :attr:`packet`: its fields from the next bits.
        The intrinsic metadata is the engine's (it sets those fields, and the port metadata
        that ``advance`` skips, once, is not in the packet; any other ``advance`` skips its
        bits), and the lane stacks' contents are read by tests/tna/passes.py: neither reads
        bits here."""
        if self.packet is None or "[" in path or path.split(".")[0] in INTRINSIC:
            return
        if not self.skipped:
            raise AssertionError(f"the parser extracts {path} from the port metadata (no "
                                 f"advance({PORT_METADATA}) after the intrinsic metadata)")
        layout = self.p.layout(path)
        end = self.at + sum(w for _, w in layout)
        if end > 8 * len(self.packet):
            raise AssertionError(f"the parser extracts {path} past the packet's "
                                 f"{len(self.packet)} bytes")
        value = int.from_bytes(self.packet, "big") >> (8 * len(self.packet) - end)
        for name, w in reversed(layout):
            self.f[name] = value & mask(w)
            value >>= w
        self.at = end

    def emit(self, path: str) -> None:
        """``pkt.emit``: a header if valid, or a struct's valid headers in declaration order
        (a header stack's elements are not read here: Unsupported)."""
        parts = path.split(".")
        typ = self.p.roots.get(parts[0])
        for part in parts[1:]:
            typ = self.p.structs.get(typ, {}).get(part)
        fields = self.p.structs.get(typ) if isinstance(typ, str) else None
        if fields is None:
            raise Unsupported(f"pkt.emit({path})")
        if all(isinstance(w, int) for w in fields.values()):   # a header
            if path in self.valid:
                for name, w in self.p.layout(path):
                    self.out = self.out << w | self.f.get(name, 0)
                    self.out_bits += w
            return
        for member in fields:
            sub = f"{path}.{member}"
            if any(v.startswith(sub + "[") for v in self.valid):
                raise Unsupported(f"pkt.emit of the header stack {sub}")
            if sub not in self.valid and fields[member] in self.p.structs and \
                    all(isinstance(w, int) for w in self.p.structs[fields[member]].values()):
                continue
            self.emit(sub)

    def emitted(self) -> bytes:
        return self.out.to_bytes(self.out_bits // 8, "big")

    def parse(self) -> None:
        """The parser from ``start``, its headers extracted from :attr:`packet`."""
        state = "start"
        for _ in range(32):
            if state == "accept":
                return
            if state not in self.p.states:
                raise Unsupported(f"parser state {state}")
            body, keys, cases = self.p.states[state]
            for s in body:
                self.run(s)
            values = self.keys(keys)
            state = next((nxt for cells, nxt in cases
                          if cells is None or self.matches(cells, values)), None)
        raise Unsupported("the parser does not reach accept")
