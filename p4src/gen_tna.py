"""The generated parts of the Tofino program (p4src/thc_tna.p4): its word instances, their
apply calls, the lookup tables and the parser states that extract each pass's lanes.

A word is four 8-bit lanes or two 16-bit lanes. Pass 0 runs the slot state only; an 8-bit
job's pass 1 adds the packet's last WORDS words, pass 2 its first WORDS; a 16-bit job's
passes 1-4 add a quarter each, last quarter first; all in the same word registers at a
quarter of their index each (docs/switch.md, "Tofino"). gen_p4.py writes these files with
the BMv2 program's.

Where the index blocks ride: pass 0 sends a DATA's four blocks of BLOCK index headers round
last block first, so that what the next pass adds is always at the front. A 16-bit pass
needs each index byte twice (a word's two lookups key on two bytes, and its two 16-bit
lanes are one byte's two indices): the egress of the pass before doubles the next block
(dup()), and the adding passes find the blocks after it in ``rest``.
"""
from __future__ import annotations

WORD_LANES = 4
WORDS = 32
"""Words each adding pass (1 and 2) adds: 4 * WORDS lanes, half a packet."""
RECIRC_PORT = 68
"""The recirculation port of a Tofino-1 pipe (low 7 bits of the port number)."""
CPU_PORT = 320
"""Tofino-1's PCIe CPU port (pipe 2, port 64, on a four-pipe part): where packet-outs enter."""

STAGES = 12
"""MAU stages of a Tofino-1 pipe."""
EXACT_A_STAGE = 8
"""Exact-match tables a stage holds with distinct keys (its hash units): the lookups' bound."""
SALUS_A_STAGE = 4
EXACT_TAKEN = {0: 2, 2: 2, 5: 2}
"""Hash units pass 0 takes: thc_job and thc_worker in stage 0, the register indices' identity
hashes (thc_index) in stage 2, the addresses of the incarnation and acknowledgement
registers in stage 5."""
SLOT_STATE_SALUS = {1: 1, 4: 1, 5: 3, 6: 1, 7: 1, 8: 1, 9: 1}
"""The stateful ALUs pass 0's slot state takes in each stage (thc_tna.p4 pins its tables
there): the job's last-heard time, the job's run, the worker's incarnation, both versions'
acknowledgements, the slot version's run, use, bitmap and count. Kept free of words."""
LUT_JOBS = 4
"""Jobs whose lookup entries a word's tables hold at once. A lookup of two ways takes 20 of a
stage's 416 hash bits (the compiler's default, four ways, 40: too many for eight a stage)."""
SPLIT_WORDS = 13
"""Result words whose halves take a 16-bit container each."""

WORD_DECL = "ThcWord{j:02d}() thc_w{j:02d};\n"
WORD_CONTROL = "THC_WORD(ThcWord{j:02d}, {stage})\n"
WORD_APPLY = ("thc_w{j:02d}.apply(hdr.res[{j}], meta.p1.word_index, meta.p1.lane_op, "
              "meta.p1.is_max, meta.p1.blank, meta.p1.recirc);\n")
OCTS = WORDS // 2
"""Index headers a pass reads: eight 4-bit indices (two words) each."""
BLOCK = OCTS // 2
"""Index headers a 16-bit pass adds (each doubled: OCTS headers, 2 * OCTS lanes' bytes)."""
BLOCKS = 4
"""Blocks of a DATA's indices: a 16-bit job's adding passes."""
REST_OCTS = (BLOCKS - 1) * BLOCK
"""Index headers riding behind the ones a pass adds: at most three blocks."""
SIGN_WORDS = 2 * OCTS // 4
"""Sign words of a vote DATA: 32 sign bits, four index headers' lanes, each parsed into the
first of its four index headers (spread())."""


def check(spec: dict) -> None:
    lanes = spec["lanes"]
    if 2 * WORDS * WORD_LANES != lanes:
        raise SystemExit(f"gen_tna: two passes of {WORDS} words of {WORD_LANES} lanes do "
                         f"not make protocol.json's {lanes} lanes")
    if spec["max_jobs"] > 16 or spec["max_workers"] > 32:
        raise SystemExit("gen_tna: thc_worker_run's index is job_index[3:0] ++ worker_id[4:0]")
    if BLOCKS * BLOCK * 8 != lanes or BLOCKS * WORDS * 2 != lanes:
        raise SystemExit(f"gen_tna: {BLOCKS} 16-bit passes of {WORDS} words (a block of "
                         f"{BLOCK} index headers each) do not make {lanes} lanes")
    if spec["max_lanes"] > WORDS or WORDS % 2 or WORDS > 32:
        raise SystemExit("gen_tna: the max lanes ride one pass's words; index headers hold "
                         "two words; a header stack holds at most 32")


def schedule() -> list[tuple[int, int, int]]:
    """(stage of the word's first lookup, of its second, of its register) for each word: the
    placer left to itself fills the first stages with lookups and the words come after pass
    0's slot state, so each is pinned (@stage). A stage takes EXACT_A_STAGE lookups and
    SALUS_A_STAGE registers (fewer where the slot state runs); the two lookups of a
    word share a stage only where its result word's halves have containers of their own
    (the first SPLIT_WORDS: PHV has no more 16-bit containers to spare); a word's register
    comes after its lookups."""
    exact = [EXACT_A_STAGE] * STAGES
    for s, n in EXACT_TAKEN.items():
        exact[s] -= n
    salus = [SALUS_A_STAGE - SLOT_STATE_SALUS.get(s, 0) for s in range(STAGES)]
    first, second, pending, j = {}, {}, [], 0
    for s in range(STAGES):
        for w in list(pending):
            if exact[s]:
                exact[s] -= 1
                second[w] = s
                pending.remove(w)
        while j < WORDS and exact[s] >= (2 if j < SPLIT_WORDS else 1):
            first[j] = s
            exact[s] -= 1
            if j < SPLIT_WORDS:
                second[j] = s
                exact[s] -= 1
            else:
                pending.append(j)
            j += 1
    out = []
    for w in range(WORDS):
        if w not in second:
            raise SystemExit("gen_tna: the lookups do not fit the pipe's stages")
        c = next((s for s in range(second[w] + 1, STAGES) if salus[s]), None)
        if c is None:
            raise SystemExit("gen_tna: the words do not fit the pipe's stages")
        salus[c] -= 1
        out.append((first[w], second[w], c))
    return out


def _oct(o: int) -> str:
    """Where pass 0 spreads index header ``o`` of a vote DATA, so that the packet carries
    the blocks last first (as PASS0_HOME): blocks 3 and 2 in the index headers of the adding
    passes (``cur``), blocks 1 and 0 in the result words that follow them in the packet, the
    first whose containers are whole (``SPLIT_WORDS`` on). Both are in the containers the
    MAU reads; ``rest`` rides along outside them."""
    b, i = divmod(o, BLOCK)
    return [f"hdr.res[{SPLIT_WORDS + BLOCK + i}].w", f"hdr.res[{SPLIT_WORDS + i}].w",
            f"hdr.cur[{BLOCK + i}].idx", f"hdr.cur[{i}].idx"][b]


def _valid(o: int) -> str:
    return _oct(o).rsplit(".", 1)[0] + ".setValid();"


def _spread_to(o: int, dst: int, src: str, first: int) -> str:
    hi = 31 - 8 * (o % 4) - first
    return f"        {_oct(o)}[{dst}:{dst - 3}] = {src}[{hi}:{hi - 3}];\n"


def spread() -> str:
    """The three actions (one a stage: a container takes one shift a stage) that turn a
    vote DATA's sign bits into the index headers the lookups key on, in pass 0.

    Sign byte P holds the eight lanes of index header P (over the packet, 0-31), and each
    byte of that header is one lookup's key, two lanes: each key byte must hold its two
    lanes' sign bits. The first nibble of sign byte P goes to bits 25-22 of header P, the
    second to bits 9-6: bits 1-0 of the first and third key bytes, bits 7-6 of the second
    and fourth, where controller/targets/tofino.py's vote entries read them; the other bits
    are whatever the container held, and every entry ignores them. Sign word m arrives in
    header 4m (parse_signs): that header's first nibble moves last, from its own bits 31-28,
    once no other header reads the word."""
    first = [o for o in range(2 * OCTS) if o % 4 == 0]
    others = [o for o in range(2 * OCTS) if o % 4]
    a = [f"        {_valid(o)}\n" + _spread_to(o, 25, _oct(o - o % 4), 0) for o in others]
    b = [_spread_to(o, 9, _oct(o - o % 4), 4) for o in others + first]
    c = [_spread_to(o, 25, _oct(o), 0) for o in first]
    return "".join(f"    action thc_spread_{n}() {{\n{''.join(body)}    }}\n"
                   for n, body in enumerate((a, b, c)))


def complement(excluded: set[int], bits: int, prefix: int = 0, width: int = 0) -> list[tuple[int, int]]:
    """Ternary (value, mask) pairs matching every ``bits``-bit value outside ``excluded``:
    a table cannot say "not equal", its entries can cover the rest."""
    if not any(v >> (bits - width) == prefix for v in excluded):
        mask = ((1 << width) - 1) << (bits - width)
        return [(prefix << (bits - width), mask)]
    if width == bits:
        return []
    return (complement(excluded, bits, prefix << 1, width + 1)
            + complement(excluded, bits, prefix << 1 | 1, width + 1))


def below(n: int, bits: int) -> list[tuple[int, int]]:
    """Ternary (value, mask) pairs matching every ``bits``-bit value below ``n``: one per set
    bit of ``n``, its higher bits equal and that bit 0."""
    full = (1 << bits) - 1
    return [(n & ~((2 << k) - 1) & full, full & ~((1 << k) - 1))
            for k in reversed(range(bits)) if n >> k & 1]


WELLFORMED_KEYS = ("thc_valid", "parser_err", "udp_length", "pkt_type", "version",
                   "ingress_port", "run")
WELLFORMED_BITS = (1, 16, 16, 8, 8, 9, 32)


def wellformed(spec: dict, to_aggregator: tuple[str, ...], udp_len_hdr: int) -> str:
    """The entries of thc_wellformed, the checks that need no job (the first entry that
    matches wins): one ternary table, where a chain of conditions would take a logical
    table each and three stages of pass 0. The checks that need the job or the worker
    (lengths, offsets) are thc_check's, after unknown_job, as in the model."""
    types = spec["pkt_types"]
    known = set(types.values())
    replies = [types[n] for n in types if n not in to_aggregator]
    malformed = "thc_set_drop(THC_DROP_MALFORMED)"
    rows = [({"thc_valid": "false"}, malformed)]
    rows += [({"parser_err": (v, m)}, malformed) for v, m in complement({0}, 16)]
    rows += [({"udp_length": vm}, malformed) for vm in below(udp_len_hdr, 16)]
    rows += [({"pkt_type": vm}, malformed) for vm in complement(known, 8)]
    rows += [({"version": vm}, malformed) for vm in complement({0, 1}, 8)]
    rows += [({"pkt_type": (t, 0xFF)}, "thc_set_drop(THC_DROP_WRONG_DIRECTION)")
             for t in replies]
    rows += [({"pkt_type": (types["RESET"], 0xFF), "ingress_port": vm},
              "thc_set_drop(THC_DROP_NOT_FROM_CPU)") for vm in complement({CPU_PORT}, 9)]
    rows += [({"pkt_type": vm, "run": (0, 0xFFFFFFFF)}, malformed)
             for vm in complement({types["RESET"]}, 8)]
    out = []
    for key, action in rows:
        cells = []
        for name, bits in zip(WELLFORMED_KEYS, WELLFORMED_BITS):
            cell = key.get(name, "_")
            if isinstance(cell, tuple):
                v, m = cell
                cell = f"{v:#x} &&& {m:#x}" if m != (1 << bits) - 1 else f"{v:#x}"
            cells.append(cell)
        out.append(f"            ({', '.join(cells)}): {action};\n")
    return "".join(out)


TICK_NS = 1 << 16
"""The unit of the job's idle clock: bits 47-16 of the ingress MAC timestamp (ns)."""


def constants(header: str, spec: dict) -> str:
    idle = -(-int(spec["run_idle_s"] * 1e9) // TICK_NS)
    return "".join([header, "// Sizes of the Tofino program (thc_tna.p4)\n",
                    f"const bit<32> THC_TNA_IDLE = {idle};  // run_idle_s in {TICK_NS} ns ticks\n",
                    f"#define THC_TNA_WORDS {WORDS}\n",
                    f"#define THC_TNA_OCTS {OCTS}\n",
                    f"#define THC_TNA_REST_OCTS {REST_OCTS}\n",
                    f"#define THC_TNA_LUT_SIZE {256 * LUT_JOBS}\n",
                    f"const bit<7> THC_TNA_RECIRC_PORT = {RECIRC_PORT};\n",
                    f"const bit<9> THC_TNA_CPU_PORT = {CPU_PORT};\n"])


LUT_DECL = """    @name("thc_w{j:02d}.thc_lut_set_{h}")
    action thc_w{j:02d}_lut_set_{h}(bit<16> value) {{ hdr.res[{j}].w[{hi}:{lo}] = value; }}
    @name("thc_w{j:02d}.thc_lut_{h}")
    @stage({stage})
    @ways(2)
    table thc_w{j:02d}_lut_{h} {{
        key = {{ meta.p1.lut_job: exact @name("job_index"); {key}: exact @name("idx"); }}
        actions = {{ thc_w{j:02d}_lut_set_{h}; @defaultonly NoAction; }}
        const default_action = NoAction();
        size = THC_TNA_LUT_SIZE;
    }}
"""


def _luts() -> tuple[str, str]:
    """Each word's two lookup tables (thc.p4's names under the word), declared and applied
    in the ingress control. They apply to every packet of the adding passes, without a
    condition (a gateway a word chains the words stage after stage), keyed on the job's
    index that pass 0 bridged (THC_TNA_NO_LUT where the pass carries no indices: a miss
    leaves a MAX packet's lanes alone) and one index byte: two input crossbar bytes, one of
    them shared by every lookup.
    The two write the halves of one result word: in one stage where each half has a
    container of its own (thc_tna_pragmas.p4), else one after the other (schedule)."""
    decl, apply = [], []
    stages = schedule()
    for j in range(WORDS):
        o, second = divmod(j, 2)
        for h in range(2):
            bit = 31 - 16 * second - 8 * h
            decl.append(LUT_DECL.format(j=j, h=h, hi=31 - 16 * h, lo=16 - 16 * h,
                                        stage=stages[j][h],
                                        key=f"hdr.cur[{o}].idx[{bit}:{bit - 7}]"))
        apply.append(f"thc_w{j:02d}_lut_0.apply();\nthc_w{j:02d}_lut_1.apply();\n")
    return "".join(decl), "".join(apply)


def _extract(stack: str, n: int) -> str:
    return "".join(f"        pkt.extract(hdr.{stack}[{i}]);\n" for i in range(n))


def _extract_block(stack: str, first: int) -> str:
    return "".join(f"        pkt.extract(hdr.{stack}[{first + i}]);\n" for i in range(BLOCK))


def _each(fmt: str, n: int) -> str:
    return "".join(fmt.format(i) for i in range(n))


def _state(name: str, body: str) -> str:
    return f"    state {name} {{\n{body}        transition accept;\n    }}\n"


PASS0_HOME = {3: ("rest", 0), 2: ("rest", BLOCK), 1: ("rest", 2 * BLOCK), 0: ("cur", 0)}
"""Where pass 0's parser puts a DATA's block b (its first index header): the deparser emits
rest, then cur, so the packet goes round last block first (the next pass adds the block at
the front, and its sums go behind the blocks left)."""


def pass_states() -> list[tuple[str, int, int, str]]:
    """The adding passes' parser states: (name, wide, adding passes before it, body). An 8-bit pass adds two blocks into cur (the later one in its upper
    half: they arrive last first) and carries the two before them in rest; a 16-bit pass
    finds the block it adds doubled (OCTS headers into cur) and carries the ones left."""
    eight = _extract_block("cur", BLOCK) + _extract_block("cur", 0)
    out = [("parse_idx8_1", 0, 0, eight + _extract("rest", 2 * BLOCK)),
           ("parse_idx8_0", 0, 1, eight)]
    for left in reversed(range(BLOCKS)):
        out.append((f"parse_idx16_{left}", 1, BLOCKS - 1 - left,
                    _extract("cur", OCTS) + _extract("rest", left * BLOCK)))
    return out


def parse_lanes() -> str:
    """The adding passes' choice of parser state: the lane payload the pass before named,
    the job's width, and the adding passes before this one."""
    rows = [f"            (THC_PAY_IDX, {wide}, {step}): {name};\n"
            for name, wide, step, _ in pass_states()]
    return ("    state parse_lanes {\n        transition select(meta.p1.payload, meta.p1.wide, "
            "meta.p1.step) {\n" + "".join(rows)
            + "            (THC_PAY_MAX, _, _): parse_max;\n            default: accept;\n"
            "        }\n    }\n")


UP_PAYLOADS = (("THC_DATA", "DATA", "parse_idx"), ("THC_DATA", "VOTE", "parse_signs"),
               ("THC_MAX", "MAX", "parse_max"), ("THC_FLUSH", "HDR", "parse_hdr_only"),
               ("THC_RESET", "HDR", "parse_hdr_only"))
"""(packet type, THC_UDP_LEN_ label, state): the packets to the aggregator whose lanes pass 0
parses. Any other type and UDP length is left without lanes (thc_wellformed and thc_check
drop it)."""

IPV4_SELECT = ("        transition select(hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.flags[0:0],\n"
               "                          hdr.ipv4.fragOffset, hdr.ipv4.protocol) {{\n"
               "            (4, 5, 0, 0, IPPROTO_UDP): {udp};\n"
               "            default: accept;\n        }}\n")


def _select_state(name: str, extract: str, keys: str, rows: list[str], default: str) -> str:
    return (f"    state {name} {{\n        pkt.extract({extract});\n"
            f"        transition select({keys}) {{\n"
            + "".join(f"            {r};\n" for r in rows)
            + f"            default: {default};\n        }}\n    }}\n")


def parse_ipv4(udp_lengths: dict[str, int]) -> str:
    """The parser from Ethernet to the THC header. A host delivers a UDP datagram only whole:
    its IPv4 total length is its UDP length + 20. The Tofino parser cannot add, and matches a
    field only in the state that reads it, so the Ethernet state looks ahead at the total
    length and picks one chain of states per UDP length a THC packet to the aggregator has
    (``_u<L>``); that chain's UDP state takes the THC port only at that length. A UDP length
    of a THC packet under another total length is left without its THC header, which
    thc_wellformed drops as malformed (thc.p4's check). The selects read no byte more than
    the total length, IHL's, the offset's, the protocol's and the UDP port and length."""
    chains: dict[int, list[str]] = {}
    for ptype, label, state in UP_PAYLOADS:
        rows = chains.setdefault(udp_lengths[label], [])
        if not any(r.startswith(f"{ptype}:") for r in rows):
            rows.append(f"{ptype}: {state}")
    out = ["    state parse_ethernet {\n        pkt.extract(hdr.ethernet);\n"
           "        transition select(hdr.ethernet.etherType, pkt.lookahead<bit<32>>()[15:0]) {\n"]
    out += [f"            (ETHERTYPE_IPV4, {n + 20}): parse_ipv4_u{n};\n" for n in chains]
    out.append("            (ETHERTYPE_IPV4, _): parse_ipv4;\n            default: accept;\n"
               "        }\n    }\n")
    for n, rows in chains.items():
        out.append(f"    state parse_ipv4_u{n} {{\n        pkt.extract(hdr.ipv4);\n"
                   + IPV4_SELECT.format(udp=f"parse_udp_u{n}") + "    }\n")
        out.append(_select_state(f"parse_udp_u{n}", "hdr.udp", "hdr.udp.dstPort, hdr.udp.length",
                                 [f"(THC_UDP_PORT, {n}): parse_thc_u{n}"], "accept"))
        out.append(_select_state(f"parse_thc_u{n}", "hdr.thc", "hdr.thc.pkt_type", rows,
                                 "accept"))
    out.append("    state parse_ipv4 {\n        pkt.extract(hdr.ipv4);\n"
               + IPV4_SELECT.format(udp="parse_udp") + "    }\n")
    out.append(_select_state("parse_udp", "hdr.udp", "hdr.udp.dstPort, hdr.udp.length",
                             [f"(THC_UDP_PORT, {n}): accept" for n in chains]
                             + ["(THC_UDP_PORT, _): parse_thc"], "accept"))
    out.append("    state parse_thc {\n        pkt.extract(hdr.thc);\n"
               "        transition accept;\n    }\n")
    return "".join(out)


def dup() -> tuple[str, str]:
    """The egress parser state and the three actions (one a stage) that double each index
    byte of the block the next 16-bit pass adds: header m (bytes a b c d) becomes dd[2m] =
    a a b b and dd[2m + 1] = c c d d, so that a word's two lookups (bytes 2j and 2j + 1)
    both key on byte j of the block, and the word's two 16-bit lanes are that byte's two
    indices. Each statement moves one 16-bit half or one byte of it: one instruction a
    container, whether the compiler gives a header one 32-bit or two 16-bit containers."""
    state = _state("parse_dup_octs", "".join(f"        pkt.extract(hdr.dd[{2 * m}]);\n"
                                             for m in range(BLOCK)))
    steps = [[], [], []]
    for m in range(BLOCK):
        e, o = f"hdr.dd[{2 * m}]", f"hdr.dd[{2 * m + 1}]"
        steps[0] += [f"{o}.setValid();", f"{o}.lo = {e}.lo;", f"{e}.lo = {e}.hi;"]
        steps[1] += [f"{o}.hi = {o}.lo;", f"{e}.lo[15:8] = {e}.hi[7:0];",
                     f"{e}.hi[7:0] = {e}.hi[15:8];"]
        steps[2] += [f"{o}.lo[15:8] = {o}.hi[7:0];", f"{o}.hi[7:0] = {o}.hi[15:8];"]
    actions = "".join(f"    action thc_dup_{n}() {{\n"
                      + "".join(f"        {st}\n" for st in body) + "    }\n"
                      for n, body in enumerate(steps))
    return state, actions


def files(spec: dict, header: str, to_aggregator: tuple[str, ...],
          udp_lengths: dict[str, int]) -> dict[str, str]:
    """File name -> text of the Tofino program's generated files (``udp_lengths``: by
    THC_UDP_LEN_ label)."""
    check(spec)
    parse = "".join([
        _state("parse_idx", "        meta.lanes_in = THC_IN_IDX;\n"
               + "".join(_extract_block(*PASS0_HOME[b]) for b in range(BLOCKS))),
        *(_state(name, body) for name, _, _, body in pass_states()),
        parse_lanes(),
        _state("parse_max", "        meta.lanes_in = THC_IN_MAX;\n"
               + _extract("res", spec["max_lanes"])),
        _state("parse_signs", "        meta.lanes_in = THC_IN_SIGNS;\n"
               + "".join(f"        pkt.extract({_oct(4 * m).rsplit('.', 1)[0]});\n"
                         for m in range(SIGN_WORDS))),
    ])
    dup_state, dup_actions = dup()
    luts, luts_apply = _luts()
    return {
        "thc_tna_constants.p4": constants(header, spec),
        "thc_tna_luts.p4": header + "// The words' lookup tables (thc_tna.p4's ingress).\n"
                           + luts,
        "thc_tna_luts_apply.p4": header + "// The words' lookups, first in ingress.\n"
                                 + luts_apply,
        "thc_tna_parse.p4": header + "// Parser states of thc_tna.p4: each pass's lanes.\n"
                            + parse,
        "thc_tna_parse_ipv4.p4": header + "// Parser states of thc_tna.p4: Ethernet to the "
                                 "THC header (gen_tna.parse_ipv4).\n" + parse_ipv4(udp_lengths),
        "thc_tna_words.p4": header + "// The word instances of thc_tna.p4.\n"
                            + _each(WORD_DECL.replace("{j:02d}", "{0:02d}"), WORDS),
        "thc_tna_word_controls.p4": header + "// The words of thc_tna.p4, each pinned to "
                                    "its stage (gen_tna.schedule).\n"
                                    + "".join(WORD_CONTROL.format(j=j, stage=c)
                                              for j, (_, _, c) in enumerate(schedule())),
        "thc_tna_eg_parse.p4": header + "// Egress parser state: the block the next 16-bit "
                               "pass adds (gen_tna.dup).\n" + dup_state,
        "thc_tna_dup.p4": header + "// Egress: each index byte of that block twice "
                          "(gen_tna.dup).\n" + dup_actions,
        "thc_tna_spread.p4": header + "// A vote DATA's sign bits spread over the index "
                              "headers (pass 0; gen_tna.spread).\n" + spread(),
        "thc_tna_wellformed.p4": header + "// thc_wellformed's entries, thc.p4's first checks "
                                 "in order (gen_tna.wellformed).\n"
                                 + wellformed(spec, to_aggregator, udp_lengths["HDR"]),
        "thc_tna_pragmas.p4": header + "// Each half of the first result words in a container "
                              "of its own: the word's two lookups write them in one stage.\n"
                              + _each('@pa_container_size("ingress", "hdr.res[{0}].w", 16, 16)\n',
                                      SPLIT_WORDS),
        "thc_tna_words_apply.p4": header + "// The words, in the adding passes (pass 0's "
                                  "decisions, carried in the bridge header).\n"
                                  + _each(WORD_APPLY.replace("{j:02d}", "{0:02d}")
                                          .replace("{j}", "{0}"), WORDS),
        "thc_tna_res_valid.p4": header + "// This pass's sums.\n"
                                + _each("hdr.res[{}].setValid();\n", WORDS),
        "thc_tna_payload_invalid.p4": header + "// A reply without lanes.\n"
                                      + _each("hdr.rest[{}].setInvalid();\n", REST_OCTS)
                                      + _each("hdr.cur[{}].setInvalid();\n", OCTS)
                                      + _each("hdr.res[{}].setInvalid();\n", WORDS),
        "thc_tna_cur_invalid.p4": header + "// Indices this pass has added.\n"
                                  + _each("hdr.cur[{}].setInvalid();\n", OCTS),
    }
