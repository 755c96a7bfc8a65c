"""Reading p4src/thc_tna.p4 for tests/tna/: cpp for its #includes and macros, then tokens,
expressions and statements (``Parser``), which tests/tna/interp.py turns into the program. A
construct this reading does not know raises Unsupported, naming it, so that a change of the
program fails loudly instead of being read wrong.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

P4SRC = Path(__file__).resolve().parents[2] / "p4src"
PASS1 = ("thc_job_heard_op", "thc_ack_slot", "thc_ack0_new", "thc_ack1_new",
         "thc_detail_index", "thc_nonce_detail_op", "thc_seq_detail_op", "thc_op_detail_op")
"""The statements (tables applied, actions called) of the adding passes that touch the slot
state (or read it into a REFUSED); the rest adds lanes."""
SKIP = ("thc_spread_",)
"""Actions read as no-ops: the vote spread moves sign bits, and lanes are not simulated."""
INTRINSIC = {"ig_intr_md": {"ingress_port": 9, "ingress_mac_tstamp": 48},
             "ig_prsr_md": {"parser_err": 16},
             "ig_tm_md": {"ucast_egress_port": 9, "mcast_grp_a": 16, "qid": 7},
             "ig_dprsr_md": {"drop_ctl": 3},
             "eg_intr_md": {"egress_rid": 16, "egress_port": 9},
             "eg_dprsr_md": {"drop_ctl": 3}}
"""tna.p4's intrinsic metadata that ThcIngress and ThcEgress use (the reading runs without
p4c's include files)."""
TNA_TYPES = {"PortId_t": 9, "QueueId_t": 7, "MulticastGroupId_t": 16}
TOKEN = re.compile(r'\s*(?:(\d+[ws]\d+|0[xX][0-9a-fA-F]+|\d+|[A-Za-z_]\w*|"[^"]*"|&&&|\|-\||'
                   r'\+\+|&&|\|\||[=!<>]=|<<|>>|[-+*/%?&|^~!<>=(){}\[\]:;,.@])|(\S))')
LEVELS = (("||",), ("&&",), ("==", "!="), ("<", ">", "<=", ">="), ("|",), ("^",), ("&",),
          ("<<", ">>"), ("++", "+", "-", "|-|"))
"""Binary operators, lowest precedence first (p4c's grammar: & ^ | bind tighter than
comparisons, unlike C)."""
COMPARE = {"==": int.__eq__, "!=": int.__ne__, "<": int.__lt__, ">": int.__gt__,
           "<=": int.__le__, ">=": int.__ge__}
ARITH = {"+": int.__add__, "-": int.__sub__, "|": int.__or__, "&": int.__and__,
         "^": int.__xor__, "|-|": lambda a, b: max(a - b, 0)}
P1_VALID = ("call", "meta.p1", "isValid", [])
"""The apply block's condition that tells passes 1 and 2 from pass 0."""


class Unsupported(Exception):
    """A construct of the program that this reading does not interpret."""


def preprocess(text: str | None = None) -> str:
    """The program through cpp (tna.p4's includes removed), annotations other than @name
    (the key names the controller writes by) dropped. Read afresh: the program may change."""
    text = (P4SRC / "thc_tna.p4").read_text() if text is None else text
    text = re.sub(r"^\s*#include\s*<[^>]*>", "", text, flags=re.M)
    cpp = subprocess.run(["cpp", "-P", "-undef", "-nostdinc", "-I", str(P4SRC), "-I",
                          str(P4SRC / "generated"), "-"], input=text, capture_output=True,
                         text=True, cwd=P4SRC)
    if cpp.returncode:
        raise Unsupported(f"cpp: {cpp.stderr[:400]}")
    return re.sub(r"@(?!name\b)\w+(\s*\([^()]*\))?", " ", cpp.stdout)


def tokenize(text: str) -> list[str]:
    toks = []
    for m in TOKEN.finditer(text):
        if m[2]:
            raise Unsupported(f"character {m[2]!r} near {text[m.start():m.start() + 40]!r}")
        if m[1]:
            toks.append(m[1])
    return toks


def mask(w: int) -> int:
    return (1 << w) - 1


def signed(v: int, w: int) -> int:
    return v - (1 << w) if v >> (w - 1) & 1 else v


class Parser:
    """Recursive descent over tokens; expressions and statements become tuples."""

    def __init__(self, toks: list[str], i: int = 0):
        self.t, self.i = toks, i

    def peek(self, k: int = 0):
        return self.t[self.i + k] if self.i + k < len(self.t) else None

    def next(self) -> str:
        self.i += 1
        return self.t[self.i - 1]

    def accept(self, *toks: str) -> bool:
        ok = self.peek() in toks
        self.i += ok
        return ok

    def expect(self, tok: str) -> None:
        if not self.accept(tok):
            raise Unsupported(f"expected {tok!r} at: {' '.join(self.t[self.i:self.i + 12])}")

    def skip(self) -> None:
        while self.next() != ";":
            pass

    def group(self) -> Parser:
        """A parser over the inside of the bracket pair starting here (in < >, >> closes two)."""
        close = {"(": ")", "{": "}", "<": ">", "[": "]"}
        opener, depth, start = self.next(), 1, self.i
        while depth > 0:
            tok = self.next()
            depth += (tok == opener) - (tok == close[opener]) - 2 * (opener == "<" and tok == ">>")
        return Parser(self.t[start:self.i - 1] + ([">"] if tok == ">>" else []))

    def items(self, item, sep: str = ",") -> list:
        out = []
        while self.peek() is not None:
            out.append(item())
            if self.peek() is not None:
                self.expect(sep)
        return out

    def type_(self):
        """bit<N> or int<N> -> (N, signed); any other type -> its name."""
        if self.peek() in ("bit", "int"):
            sign = self.next() == "int"
            return (int(self.group().next(), 0), sign)
        return self.next()

    def expr(self, level: int = 0):
        if level == len(LEVELS):
            return self.unary()
        left = self.expr(level + 1)
        while self.peek() in LEVELS[level]:
            left = ("bin", self.next(), left, self.expr(level + 1))
        return left

    def unary(self):
        if self.peek() in ("!", "~", "-"):
            return ("un", self.next(), self.unary())
        tok = self.next()
        if tok[0].isdigit():
            m = re.fullmatch(r"(\d+)([ws])(\d+)", tok)
            e = ("num", int(m[3]) & mask(int(m[1])), int(m[1]), m[2] == "s") if m else \
                ("num", int(tok, 0), None, False)
        elif tok in ("true", "false"):
            e = ("bool", tok == "true")
        elif tok == "{":
            self.i -= 1
            g = self.group()
            e = ("list", g.items(g.expr))
        elif tok == "(":
            typedef = self.peek(1) == ")" and self.peek().endswith("_t")
            if self.peek() in ("bit", "int") or typedef:
                typ = self.type_()
                self.expect(")")
                return ("cast", typ, self.unary())
            e = self.expr()
            self.expect(")")
        elif re.fullmatch(r"[A-Za-z_]\w*", tok) and tok not in ("switch", "return", "exit"):
            e = ("path", tok)
        else:
            raise Unsupported(f"expression at: {' '.join(self.t[self.i - 1:self.i + 10])}")
        return self.postfix(e)

    def postfix(self, e):
        while True:
            if self.peek() == "." and e[0] == "path":
                self.next()
                e = ("path", f"{e[1]}.{self.next()}")
            elif self.peek() == "[" and e[0] == "path" and self.peek(2) == "]":
                e = ("path", f"{e[1]}[{int(self.t[self.i + 1], 0)}]")
                self.i += 3
            elif self.peek() == "[":
                g = self.group()
                hi = int(g.next(), 0)
                g.expect(":")
                e = ("slice", e, hi, int(g.next(), 0))
            elif self.peek() == "<" and e == ("path", "pkt.lookahead"):
                typ = self.group().type_()
                self.group()
                e = ("lookahead", typ)
            elif self.peek() == "(" and e[0] == "path":
                target, _, method = e[1].rpartition(".")
                g = self.group()
                e = ("call", target or None, method, g.items(g.expr))
            else:
                return e

    def stmt(self):
        if self.peek() == "{":
            return ("block", self.group().stmts())
        if self.accept(";"):
            return ("block", [])
        if self.accept("if"):
            cond, then = self.group().expr(), self.stmt()
            return ("if", cond, then, self.stmt() if self.accept("else") else None)
        e = self.expr()
        if self.accept("="):
            e = ("assign", e, self.expr())
        elif e[0] == "call":
            e = ("do", e)
        else:
            raise Unsupported(f"statement {e!r}")
        self.expect(";")
        return e

    def stmts(self) -> list:
        out = []
        while self.peek() is not None:
            out.append(self.stmt())
        return out

    def cell(self):
        """A key set's cell: None for _ or default, else (value, mask or None) expressions."""
        if self.accept("_", "default"):
            return None
        value = self.expr()
        return (value, self.expr() if self.accept("&&&") else None)

    def keyset(self, n: int) -> list:
        if self.accept("_", "default"):
            return [None] * n
        g = self.group() if n > 1 else self
        return g.items(g.cell) if n > 1 else [self.cell()]


def find_body(toks: list[str], *head: str) -> Parser:
    """A parser over the braces after the tokens ``head`` (a parser's or a control's body)."""
    for i in range(len(toks)):
        if tuple(toks[i:i + len(head)]) == head:
            p = Parser(toks, i + len(head))
            while p.peek() != "{":
                p.group() if p.peek() == "(" else p.next()
            return p.group()
    raise Unsupported(f"no {' '.join(head)} in the program")
