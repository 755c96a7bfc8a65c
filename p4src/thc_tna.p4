/*
 * THC in-network aggregation for Tofino (P4_16, TNA), the variant of thc.p4 that the Tofino
 * back end of p4c compiles (`make p4-tofino`). Same wire protocol, generated constants and
 * THC header; the configuration tables, counters and multicast groups have thc.p4's names,
 * the lookup tables are laid out for this pipeline (controller/targets.py).
 *
 * All 256 lanes of a packet in three passes, five for a 16-bit job (docs/switch.md,
 * "Tofino"). Tofino-1 returns one 32-bit word per stateful ALU access, and a pipe has 48
 * stateful ALUs: 256 8-bit sums are 64 words, more than one pass can read. So a packet of
 * an 8-bit job goes round twice:
 *  - pass 0 checks the packet and runs the slot state (a register a stage: the job's run,
 *    the worker's incarnation and both versions' acknowledgements, the slot version's
 *    (run, seq), its use, its (bitmap, seq), its count), then answers at once what it
 *    refuses before the job's run is checked (REFUSED, drops), or recirculates the packet,
 *    the header thc_pass_h in front carrying what it decided (a PENDING, held PENDING or
 *    later REFUSED: pass 1 sends it, refreshing the job's idle clock);
 *  - pass 1 adds the packet's last 128 lanes in THC_TNA_WORDS word registers (the first
 *    quarter of their index) and recirculates it again, its sums after the first lanes'
 *    indices;
 *  - pass 2 adds the first 128 lanes in the same registers (the second quarter), then
 *    multicasts the result, returns it to the sender, or drops the packet (consumed).
 * A 16-bit job's words hold two lanes: passes 1-4 add 64 lanes each, the last first, in
 * the four quarters. Its index bytes are needed twice (a word's two lookups key on two
 * bytes, its two lanes are one byte's indices): the egress of each pass before doubles
 * the block the next pass adds (thc_dup_*), which pass 0 sends round at the front.
 * The words take the stages after their lookups in the adding passes, where no slot state
 * runs: the slot state and the words never compete for a stage's stateful ALUs.
 * A word holds four 8-bit lanes (no carry crosses lanes: n x g <= 255), two 16-bit lanes,
 * or one max lane. A vote job's DATA carries sign bits: pass 0 spreads them over the index
 * headers (generated/thc_tna_spread.p4), and the job's lookup entries count them (8-bit
 * counts: a 16-bit vote job is dropped as bad_lanes, and the controller refuses it).
 *
 * One incarnation of each worker per run and install (thc_worker_run, reused_run), the run
 * jump and idle rules (thc_job_run, thc_job_seen) and per-use acknowledgements (held:
 * thc_acked0, thc_acked1), as in thc.p4 (docs/switch.md: where they differ).
 * Offsets take 31 bits here (bit 31 tells a MAX use from a DATA use, wrong_use).
 * docs/switch.md lists what each gap allows.
 */
#include <core.p4>
#include <tna.p4>

#include "generated/thc_constants.p4"
#include "generated/thc_headers.p4"
#include "generated/thc_tna_constants.p4"
#include "thc_common.p4"

const bit<2> THC_PAY_NONE = 0;   // the pass parses nothing after the THC header (FLUSH)
const bit<2> THC_PAY_IDX = 1;    // index blocks (parse_lanes: which, by width and pass)
const bit<2> THC_PAY_MAX = 3;    // one 32-bit max lane a word
const bit<8> THC_TNA_NO_LUT = 0xFF;   // no lookup entry has this job index
const bit<3> THC_IN_NONE = 0;    // pass 0: not a size this packet type has
const bit<3> THC_IN_IDX = 1;     // 256 4-bit indices
const bit<3> THC_IN_SIGNS = 2;   // 256 sign bits (a vote job's DATA), in index headers
const bit<3> THC_IN_MAX = 3;     // max lanes
const bit<3> THC_IN_HDR = 4;     // the header alone (FLUSH, RESET)
// thc_run's verdict: its stateful ALU's predicate over (another run, a later seq), one-hot.
// The same run and seq (or an older seq: stale) is THC_STEP_SAME; a later seq of the same
// run while a worker may still need the previous result (meta.hold) is held; any other
// starts a new use.
const bit<4> THC_STEP_SAME = 1;
const bit<4> THC_STEP_SEQ = 4;
// thc_job_seen's verdict, one-hot over (heard before idle_since, no live read pending):
// live (either column without the first), a take, or a wait at the idle edge.
const bit<4> THC_SEEN_WAIT = 2;
const bit<4> THC_SEEN_TAKE = 8;
// Ticks (65.5 us) that a live read of a job holds off an idle take (16.8 ms; at least 254
// ticks, as two ticks share one `now`): far longer than a pass takes to go round, even
// through a recirculation queue that holds the whole packet buffer, so no pass of a packet
// that read the job live is still going round when the job changes hands.
const bit<32> THC_TNA_EDGE = 256;

// A register index: a slot version (pool_base + slot) * 2 + version, and for the words the
// pass's quarter above it (THC_REG_SIZE each).
typedef bit<16> thc_index_t;

// DATA: eight lanes' indices (two words), the first lane in the high nibble. Payload
// headers hold two words: every header costs a validity bit, and a pipe has 256.
header thc_oct_h {
    bit<32> idx;
}

// four 8-bit or two 16-bit sums (big-endian), or one max lane
header thc_word_h {
    bit<32> w;
}

// Ingress -> egress on every packet, and each pass -> the next around the recirculation.
header thc_pass_h {
    bit<7>  passes;       // the last pass to egress: its use's count of last passes plus
                          // one, 0 for another run's (thc_passes)
    bit<9>  in_port;      // where a unicast reply of the last pass goes
    bit<16> mcast_grp;    // the last pass: 0 = unicast to in_port
    bit<1>  recirc;       // go round: egress passes the packet through unchanged
    bit<1>  reply;        // the last pass sends the packet (else: consumed, dropped)
    bit<1>  is_reply;     // egress rewrites the addresses (worker_id or egress_rid - 1)
    bit<1>  new_use;      // pass 1: the packet started a use (its acknowledgements restart)
    bit<2>  step;         // adding passes before the next one (0: the next is pass 1)
    bit<1>  hdr_only;     // pass 1 sends the header pass 0 wrote (no sums): it refreshes the
                          // job's idle clock on the way
    bit<1>  pad1;
    bit<2>  lane_op;      // THC_OP_*
    bit<6>  pad2;
    bit<4>  job;          // the job's index (the adding passes mark it heard from)
    bit<1>  is_max;
    bit<1>  last;         // the next pass is the last (pass 2, pass 4 of a 16-bit job, or
                          // pass 1 for MAX and the answers pass 1 sends)
    bit<2>  payload;      // THC_PAY_*: what the next pass parses after the THC header
    bit<8>  lut_job;      // the job's index for the lookups, THC_TNA_NO_LUT without indices
    bit<1>  blank;        // no payload: a new use's words are cleared (FLUSH)
    bit<6>  pad4;
    // Where an action writes part of a container, Tofino needs the bits written or the bits
    // left to be contiguous, and no arithmetic on a field that shares its container: the
    // pass round sets step and the quarter from its table's entry (thc_next).
    bit<1>  wide;         // a 16-bit job: four adding passes, each block's bytes doubled
    thc_index_t word_index;    // the next pass's quarter of the words' registers
}

// a slot version's run and last seq; its bitmap and the seq of the use it belongs to
struct thc_run_seq_t {
    bit<32> seq;
    bit<32> run;
}
// a worker's incarnation: the run it was recorded under (xor the install's epoch, so that
// a new install starts afresh) and the nonce its packets carry in the epoch field
struct thc_incarnation_t {
    bit<32> run_key;
    bit<32> nonce;
}
struct thc_bitmap_seq_t {
    bit<32> bitmap;
    bit<32> seq;
}
// a slot version's use (its seq) and the workers known to hold its result (all ones: no use
// since the install)
struct thc_ack_t {
    bit<32> seq;
    bit<32> acked;
}
// when the job last accepted a packet, and until when a live read holds off an idle take
struct thc_seen_t {
    bit<32> heard;
    bit<32> until;
}
// a use's last passes: its run, and the workers whose lanes the words hold
struct thc_passes_t {
    bit<32> run;
    bit<32> n;
}

struct tna_headers_t {
    ethernet_h ethernet;
    ipv4_h     ipv4;
    udp_h      udp;
    thc_h      thc;
    thc_oct_h[THC_TNA_REST_OCTS] rest;  // index blocks carried to the passes after this one
    thc_oct_h[THC_TNA_OCTS]   cur;    // the indices this pass adds
    thc_word_h[THC_TNA_WORDS] res;    // their sums, or the max lanes
}

@pa_auto_init_metadata
struct metadata_t {
    thc_pass_h bridge;      // what pass 0 or the last pass tells egress (and pass 1)
    thc_pass_h p1;          // the adding passes: what the pass before decided (parsed)
    // from thc_job
    bit<8>  job_index;
    bit<8>  n_workers;
    bit<16> pool_base;
    bit<16> pool_size;
    bit<16> mcast_grp;
    bit<1>  wide;
    bit<1>  vote;           // a vote job: DATA carries sign bits, the sums count the +1s
    bit<3>  lanes_in;       // THC_IN_*: what pass 0's parser found after the THC header
    bit<32> epoch;
    bit<16> cfg_diff;       // the packet's configuration tag (bitmap[15:0]) ^ the install's
    bit<1>  job_hit;
    // from thc_worker
    bit<32> worker_bit;     // FLUSH: bit 31, the closed mark
    bit<1>  worker_hit;
    // from thc_install: a RESET of the job's current install
    bit<1>  install_hit;
    // addressing
    bit<16> slot_idx;
    bit<16> slotx;          // seq[15:0] ^ slot: the bits the pool mask must clear
    bit<8>  room8;
    bit<16> room16;
    thc_index_t reg_index;
    bit<8>  jc4;            // the job counters' index (at most 80): one byte
    bit<8>  jc1;
    bit<8>  jc_index;       // the job's first counter: packets consumed
    bit<8>  jc_done;        // completions
    bit<8>  jc_again;       // retransmissions answered with the result
    bit<8>  jc_pending;     // retransmissions answered PENDING
    bit<8>  jc_held;        // new uses held: a worker may still need the previous result
    // slot state as seen by this packet
    bit<1>  run_checked;    // the job's run was checked (stale or not)
    bit<1>  run_stale;
    bit<32> now;            // ingress MAC timestamp in THC_TNA_IDLE's ticks, bit 0 set
    bit<32> idle_since;     // now - THC_TNA_IDLE: a job last heard before it is idle
    bit<4>  seen;           // THC_SEEN_*: what thc_job_seen found (0: not read)
    bit<32> run_far;        // run - THC_RUN_JUMP: a job's run below it is too far behind
    bit<32> run_key;        // hdr.thc.run ^ epoch: the run under this install
    bit<16> worker_index;   // job_index * THC_MAX_WORKERS + worker_id
    bit<1>  reused;         // another incarnation of the worker already runs this run
    bit<32> ack_bit;        // the sender's bit (a FLUSH's worker_bit becomes bit 31)
    bit<32> ack0;           // version 0's acknowledgements, this packet's included
    bit<32> ack1;           // version 1's
    bit<4>  use_step;       // THC_STEP_*: what thc_run found
    bit<1>  hold;           // thc_run may not start a use at a later seq of the same run
    bit<32> use_key;        // the use this packet joins: its offset, bit 31 for MAX
    bit<1>  wrong_use;
    bit<32> old_bitmap;     // 0: another seq (stale); bit 31: closed by a FLUSH
    bit<32> bitmap;
    bit<8>  count;
    bit<1>  dup;
    bit<1>  closed;
    bit<1>  is_max;
    bit<1>  blank;
    bit<1>  refuse;
    bit<8>  drop_reason;
    bit<6>  dscp;
}

parser ThcIngressParser(packet_in pkt, out tna_headers_t hdr, out metadata_t meta,
                        out ingress_intrinsic_metadata_t ig_intr_md) {
    state start {
        pkt.extract(ig_intr_md);
        pkt.advance(PORT_METADATA_SIZE);
        transition select(ig_intr_md.ingress_port[6:0]) {
            THC_TNA_RECIRC_PORT: parse_pass;
            default: parse_ethernet;
        }
    }
    // the adding passes: a THC packet that the pass before sent round, its lanes named by
    // the bridge header (parse_lanes)
    state parse_pass {
        pkt.extract(meta.p1);
        pkt.extract(hdr.ethernet);
        pkt.extract(hdr.ipv4);
        pkt.extract(hdr.udp);
        pkt.extract(hdr.thc);
        transition parse_lanes;
    }
    // Ethernet to the THC header (gen_tna.parse_ipv4): THC only in IPv4 version 4 without
    // options (no worker sends any) that is no fragment (no offset, no more-fragments flag:
    // a host delivers no fragment as a datagram); anything else goes to L2 forwarding, where
    // one to the aggregator's MAC is a counted drop (l2_misses): never summed. The Ethernet
    // state looks ahead at the IPv4 total length, and the THC port is taken only at the UDP
    // length it makes (a host delivers a datagram only whole); a THC length under another
    // total length reaches thc_wellformed without its THC header: malformed.
#include "generated/thc_tna_parse_ipv4.p4"
    state parse_hdr_only {
        meta.lanes_in = THC_IN_HDR;
        transition accept;
    }
#include "generated/thc_tna_parse.p4"
}

/*
 * One word of four 8-bit lanes (SwitchML's Processor, for THC's lookups): one register adds,
 * writes or reads the word, or keeps a max lane. thc_word_op picks the RegisterAction:
 * Tofino addresses a register the same way in every action, one operation per packet. A new
 * use writes (op THC_OP_WRITE) and a contribution adds in one program; a FLUSH opening a use
 * clears the word. The word's two byte-keyed lookups (two indices in, two packed table values
 * out, one result halfword each) are tables of the ingress control, applied first
 * (generated/thc_tna_luts*.p4), so that the placer puts them in the first stages.
 */
#define THC_WORD(NAME, STAGE)                                                            \
control NAME(inout thc_word_h r, in thc_index_t index, in bit<2> op, in bit<1> is_max,   \
             in bit<1> blank, in bit<1> run) {                                                \
    Register<bit<32>, thc_index_t>(THC_REG_SIZE * 4) thc_sum;                                 \
    RegisterAction<bit<32>, thc_index_t, bit<32>>(thc_sum) thc_sum_ra = {                     \
        void apply(inout bit<32> value, out bit<32> rv) {                                     \
            if (op == THC_OP_WRITE) {                                                         \
                value = r.w;                                                                  \
            } else {                                                                          \
                value = value + r.w;                                                          \
            }                                                                                 \
            rv = value;                                                                       \
        }                                                                                     \
    };                                                                                        \
    RegisterAction<bit<32>, thc_index_t, bit<32>>(thc_sum) thc_read = {                       \
        void apply(inout bit<32> value, out bit<32> rv) { rv = value; }                       \
    };                                                                                        \
    RegisterAction<bit<32>, thc_index_t, bit<32>>(thc_sum) thc_clear = {                      \
        void apply(inout bit<32> value, out bit<32> rv) { value = 0; rv = value; }            \
    };                                                                                        \
    RegisterAction<bit<32>, thc_index_t, bit<32>>(thc_sum) thc_max = {                        \
        void apply(inout bit<32> value, out bit<32> rv) {                                     \
            if (op == THC_OP_WRITE || r.w > value) {                                          \
                value = r.w;                                                                  \
            }                                                                                 \
            rv = value;                                                                       \
        }                                                                                     \
    };                                                                                        \
    action thc_word_sum() { r.w = thc_sum_ra.execute(index); }                                \
    action thc_word_read() { r.w = thc_read.execute(index); }                                 \
    action thc_word_clear() { r.w = thc_clear.execute(index); }                               \
    action thc_word_max() { r.w = thc_max.execute(index); }                                   \
    /* run is a key, not a condition: a gateway a word would chain the words stage by */      \
    /* stage. Ternary: a stage's exact-match hash units go to the lookups. */                 \
    @stage(STAGE)                                                                             \
    table thc_word_op {                                                                       \
        key = { run: ternary; op: ternary; is_max: ternary; blank: ternary; }                 \
        actions = { thc_word_sum; thc_word_read; thc_word_clear; thc_word_max; NoAction; }    \
        const entries = {                                                                     \
            (1, THC_OP_WRITE, 0, 0): thc_word_sum();                                          \
            (1, THC_OP_ADD, 0, 0): thc_word_sum();                                            \
            (1, THC_OP_WRITE, 0, 1): thc_word_clear();                                        \
            (1, THC_OP_READ, 0, 0): thc_word_read();                                          \
            (1, THC_OP_READ, 0, 1): thc_word_read();                                          \
            (1, THC_OP_WRITE, 1, 0): thc_word_max();                                          \
            (1, THC_OP_ADD, 1, 0): thc_word_max();                                            \
            (1, THC_OP_READ, 1, 0): thc_word_read();                                          \
        }                                                                                     \
        const default_action = NoAction;                                                      \
        size = 16;                                                                            \
    }                                                                                         \
    apply {                                                                                   \
        thc_word_op.apply();                                                                  \
    }                                                                                         \
}

#include "generated/thc_tna_word_controls.p4"
#undef THC_WORD

#include "generated/thc_tna_pragmas.p4"
control ThcIngress(inout tna_headers_t hdr, inout metadata_t meta,
                   in ingress_intrinsic_metadata_t ig_intr_md,
                   in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                   inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                   inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    Counter<bit<32>, bit<32>>(THC_N_DROP_REASONS, CounterType_t.PACKETS) thc_drops;
    Counter<bit<32>, bit<8>>(THC_MAX_JOBS * THC_N_JOB_COUNTERS, CounterType_t.PACKETS)
        thc_job_counters;
    Counter<bit<32>, bit<32>>(THC_MAX_JOBS, CounterType_t.PACKETS) thc_resets;
    Counter<bit<32>, bit<32>>(1, CounterType_t.PACKETS) l2_misses;
    Counter<bit<32>, bit<32>>(1, CounterType_t.PACKETS) thc_dscp_unknown;

#include "generated/thc_tna_words.p4"
#include "generated/thc_tna_luts.p4"
#include "generated/thc_tna_spread.p4"

    // ---- slot state: one register a stage ----
    Register<bit<32>, bit<32>>(THC_MAX_JOBS) thc_job_run;
    Register<thc_seen_t, bit<32>>(THC_MAX_JOBS) thc_job_seen;
    Register<thc_run_seq_t, thc_index_t>(THC_REG_SIZE) thc_run;
    Register<thc_bitmap_seq_t, thc_index_t>(THC_REG_SIZE) thc_bitmap;
    Register<bit<8>, thc_index_t>(THC_REG_SIZE) thc_count;
    Register<bit<32>, thc_index_t>(THC_REG_SIZE) thc_use;
    Register<thc_incarnation_t, bit<16>>(THC_MAX_JOBS * THC_MAX_WORKERS) thc_worker_run;
    Register<thc_ack_t, bit<16>>(THC_REG_SIZE / 2) thc_acked0;
    Register<thc_ack_t, bit<16>>(THC_REG_SIZE / 2) thc_acked1;
    Register<thc_passes_t, thc_index_t>(THC_REG_SIZE) thc_passes;

    // When the job last accepted a packet (heard), and until when a live read holds off an
    // idle take (until). A job idle for THC_TNA_IDLE goes to any run. Pass 0 reaches it
    // only with a packet that passes every check before the job's run (thc_job_seen_op):
    // one that takes an idle job marks it heard at once, so that no packet of another run a
    // recirculation later finds it idle too. A live job's heard is refreshed by the passes
    // after pass 0, which only packets that passed the run check take; a packet that reads
    // it live holds off a take for THC_TNA_EDGE ticks, so that its own passes come round
    // (and refresh it) before any packet may take it. A packet that would take it before
    // then waits (dropped, unanswered: its resend finds the job live or idle) and writes
    // nothing, so a stream of them cannot hold it off longer.
    RegisterAction<thc_seen_t, bit<32>, bit<4>>(thc_job_seen) thc_job_seen_ra = {
        void apply(inout thc_seen_t value, out bit<4> seen) {
            seen = this.predicate((int<32>)(meta.idle_since - value.heard) >= 0,
                                  (int<32>)(meta.now - value.until) >= 0);
            if ((int<32>)(meta.idle_since - value.heard) < 0) {
                value.until = meta.now + THC_TNA_EDGE;
            } else if ((int<32>)(meta.now - value.until) >= 0) {
                value.heard = meta.now;
                value.until = meta.now + THC_TNA_EDGE;
            }
        }
    };
    // An install reads idle and not held off, both times at idle_since (until behind now:
    // no pass after pass 0 refreshes it).
    RegisterAction<thc_seen_t, bit<32>, bit<4>>(thc_job_seen) thc_job_seen_reset = {
        void apply(inout thc_seen_t value) {
            value.heard = meta.idle_since;
            value.until = meta.idle_since;
        }
    };
    // A pass after pass 0 refreshes a job whose hold-off its pass 0 set (a pass goes round
    // in far less than THC_TNA_EDGE): a pass still going round when the controller's RESET
    // installs the job anew leaves the new install idle.
    RegisterAction<thc_seen_t, bit<32>, bit<4>>(thc_job_seen) thc_job_seen_touch = {
        void apply(inout thc_seen_t value) {
            if ((int<32>)(value.until - meta.now) > 0) {
                value.heard = meta.now;
            }
        }
    };
    // RFC 1982: the job's run, or a newer one within THC_RUN_JUMP, takes a live job (a far
    // future run id from one packet cannot lock the job's run out); any run an idle one.
    RegisterAction<bit<32>, bit<32>, bit<1>>(thc_job_run) thc_job_run_ra = {
        void apply(inout bit<32> value, out bit<1> stale) {
            if ((int<32>)(hdr.thc.run - value) >= 0
                    && (int<32>)(meta.run_far - value) <= 0) {
                value = hdr.thc.run;
                stale = 0;
            } else {
                stale = 1;
            }
        }
    };
    RegisterAction<bit<32>, bit<32>, bit<1>>(thc_job_run) thc_job_run_take = {
        void apply(inout bit<32> value, out bit<1> stale) {
            value = hdr.thc.run;
            stale = 0;
        }
    };
    RegisterAction<bit<32>, bit<32>, bit<1>>(thc_job_run) thc_job_run_reset = {
        void apply(inout bit<32> value) { value = 0; }
    };
    // One incarnation of each worker per run and install: a process restarted under the
    // same run id would meet its predecessor's slot uses (and their results) at the same
    // seqs. Only a run that took the job gets here (the stage after thc_job_run).
    RegisterAction<thc_incarnation_t, bit<16>, bit<1>>(thc_worker_run) thc_incarnation_ra = {
        void apply(inout thc_incarnation_t value, out bit<1> reused) {
            if (value.run_key != meta.run_key) {
                value.run_key = meta.run_key;
                value.nonce = hdr.thc.epoch;
                reused = 0;
            } else if (value.nonce != hdr.thc.epoch) {
                reused = 1;
            } else {
                reused = 0;
            }
        }
    };
    // what a REFUSED reused_run names (pass 1): the first incarnation's nonce
    RegisterAction<thc_incarnation_t, bit<16>, bit<32>>(thc_worker_run) thc_nonce_read = {
        void apply(inout thc_incarnation_t value, out bit<32> nonce) {
            nonce = value.nonce;
        }
    };
    // a new use: another run, or a later seq (RFC 1982)
    RegisterAction<thc_run_seq_t, thc_index_t, bit<4>>(thc_run) thc_run_ra = {
        void apply(inout thc_run_seq_t value, out bit<4> step) {
            step = this.predicate(value.run != hdr.thc.run,
                                  (int<32>)(hdr.thc.seq - value.seq) > 0);
            if (value.run != hdr.thc.run || (int<32>)(hdr.thc.seq - value.seq) > 0) {
                value.run = hdr.thc.run;
                value.seq = hdr.thc.seq;
            }
        }
    };
    // the same while a worker may still need the use's result: only another run starts a
    // new use (a later seq of the same run is held)
    RegisterAction<thc_run_seq_t, thc_index_t, bit<4>>(thc_run) thc_run_hold = {
        void apply(inout thc_run_seq_t value, out bit<4> step) {
            step = this.predicate(value.run != hdr.thc.run,
                                  (int<32>)(hdr.thc.seq - value.seq) > 0);
            if (value.run != hdr.thc.run) {
                value.run = hdr.thc.run;
                value.seq = hdr.thc.seq;
            }
        }
    };
    // what a REFUSED stale names (pass 1): the slot version's newer seq
    RegisterAction<thc_run_seq_t, thc_index_t, bit<32>>(thc_run) thc_seq_read = {
        void apply(inout thc_run_seq_t value, out bit<32> seq) {
            seq = value.seq;
        }
    };
    RegisterAction<thc_run_seq_t, thc_index_t, bit<1>>(thc_run) thc_run_reset = {
        void apply(inout thc_run_seq_t value) {
            value.run = 0;
            value.seq = THC_SEQ_RESET;
        }
    };
    // What a slot use adds: its offset, bit 31 set for a MAX use (offsets reach 2^31 only
    // as malformed). A new use records it; a packet of the use must match it (wrong_use).
    RegisterAction<bit<32>, thc_index_t, bit<1>>(thc_use) thc_use_new = {
        void apply(inout bit<32> value, out bit<1> wrong) {
            value = meta.use_key;
            wrong = 0;
        }
    };
    RegisterAction<bit<32>, thc_index_t, bit<1>>(thc_use) thc_use_check = {
        void apply(inout bit<32> value, out bit<1> wrong) {
            if (value != meta.use_key) {
                wrong = 1;
            } else {
                wrong = 0;
            }
        }
    };
    RegisterAction<bit<32>, thc_index_t, bit<1>>(thc_use) thc_use_reset = {
        void apply(inout bit<32> value) { value = 0; }
    };
    // what a REFUSED wrong_use names (pass 1): the use's packet type
    RegisterAction<bit<32>, thc_index_t, bit<32>>(thc_use) thc_op_read = {
        void apply(inout bit<32> value, out bit<32> op) {
            if ((int<32>)value < 0) {
                op = (bit<32>)THC_MAX;
            } else {
                op = (bit<32>)THC_DATA;
            }
        }
    };
    // Acknowledgements of version V's use, a register a version so that a packet reaches
    // both in one stage: every packet of the job's run shows its sender holds the result of
    // every seq up to seq - pool (RFC 1982; a window never exceeds the pool). A slot
    // version's seqs are congruent modulo 2 x pool, so "at most seq - pool" is "older than
    // seq" (one ALU comparison; seq - pool in PHV would take a 32-bit add on seq, whose low
    // half the slot check needs in a 16-bit container). The use's run is not here: the
    // slot's run register, a stage later, decides first whether the packet starts a new use
    // of another run, and a use of an older run is never joined again (stale_run) unless an
    // idle job goes back to that run. Pass 1 restarts them for the use pass 0 started
    // (thc_ack0_new, thc_ack1_new).
#define THC_ACKED(V) \
    RegisterAction<thc_ack_t, bit<16>, bit<32>>(thc_acked##V) thc_acked##V##_ra = {          \
        void apply(inout thc_ack_t value, out bit<32> acked) {                                \
            if ((int<32>)(value.seq - hdr.thc.seq) < 0) {                                      \
                value.acked = value.acked | meta.ack_bit;                                      \
            }                                                                                  \
            acked = value.acked;                                                               \
        }                                                                                      \
    };                                                                                         \
    RegisterAction<thc_ack_t, bit<16>, bit<32>>(thc_acked##V) thc_acked##V##_fresh = {       \
        void apply(inout thc_ack_t value) {                                                    \
            value.seq = hdr.thc.seq;                                                           \
            value.acked = 0;                                                                   \
        }                                                                                      \
    };                                                                                         \
    RegisterAction<thc_ack_t, bit<16>, bit<32>>(thc_acked##V) thc_acked##V##_reset = {       \
        void apply(inout thc_ack_t value) {                                                    \
            value.seq = THC_SEQ_RESET;                                                         \
            value.acked = 0xFFFFFFFF;                                                          \
        }                                                                                      \
    };
    THC_ACKED(0)
    THC_ACKED(1)
#undef THC_ACKED
    // A new use starts from the sender's bit; the same seq adds it unless a FLUSH closed the
    // use (bit 31) and returns the bitmap before; another seq (older) returns 0: a use's
    // bitmap is never 0, since the packet that opened it set a bit.
    RegisterAction<thc_bitmap_seq_t, thc_index_t, bit<32>>(thc_bitmap) thc_bitmap_new = {
        void apply(inout thc_bitmap_seq_t value, out bit<32> old) {
            value.bitmap = meta.worker_bit;
            value.seq = hdr.thc.seq;
        }
    };
    RegisterAction<thc_bitmap_seq_t, thc_index_t, bit<32>>(thc_bitmap) thc_bitmap_same = {
        void apply(inout thc_bitmap_seq_t value, out bit<32> old) {
            if (value.seq == hdr.thc.seq) {
                old = value.bitmap;
                if (value.bitmap < 0x80000000) {
                    value.bitmap = value.bitmap | meta.worker_bit;
                }
            } else {
                old = 0;
            }
        }
    };
    // a packet of another use (wrong_use) adds nothing: the bitmap before, or 0 (stale)
    RegisterAction<thc_bitmap_seq_t, thc_index_t, bit<32>>(thc_bitmap) thc_bitmap_peek = {
        void apply(inout thc_bitmap_seq_t value, out bit<32> old) {
            if (value.seq == hdr.thc.seq) {
                old = value.bitmap;
            } else {
                old = 0;
            }
        }
    };
    RegisterAction<thc_bitmap_seq_t, thc_index_t, bit<32>>(thc_bitmap) thc_bitmap_reset = {
        void apply(inout thc_bitmap_seq_t value) {
            value.bitmap = 0;
            value.seq = THC_SEQ_RESET;
        }
    };
    RegisterAction<bit<8>, thc_index_t, bit<8>>(thc_count) thc_count_first = {
        void apply(inout bit<8> value, out bit<8> count) {
            value = 1;
            count = value;
        }
    };
    RegisterAction<bit<8>, thc_index_t, bit<8>>(thc_count) thc_count_zero = {
        void apply(inout bit<8> value, out bit<8> count) {
            value = 0;
            count = value;
        }
    };
    RegisterAction<bit<8>, thc_index_t, bit<8>>(thc_count) thc_count_ra = {
        void apply(inout bit<8> value, out bit<8> count) {
            value = value + 1;
            count = value;
        }
    };
    RegisterAction<bit<8>, thc_index_t, bit<8>>(thc_count) thc_count_read = {
        void apply(inout bit<8> value, out bit<8> count) { count = value; }
    };
    // Pass 0 counts a worker before the passes after it add its lanes, and a pass lost on
    // the recirculation port never comes back. A packet's last pass comes round only after
    // all its passes before it, and passes keep their order (queue 0): pass 0 of the packet
    // that opens a use restarts its slot version's cell, the last pass of every packet that
    // writes the use's words counts there, and egress withholds a RESULT whose count is not
    // that (it lacks a worker's lanes, or holds the use before's sums beneath them). The
    // cell holds the count plus one, so that a last pass that finds another run's use there
    // (it went round when the cell restarted) bridges 0: it counts nothing and its own
    // RESULT is withheld; so does a late pass of another use of the same run
    // (thc_current_op).
    RegisterAction<thc_passes_t, thc_index_t, bit<7>>(thc_passes) thc_passes_new = {
        void apply(inout thc_passes_t value) {
            value.run = hdr.thc.run;
            value.n = 1;
        }
    };
    // a FLUSH that opens a use clears its words: its last pass counts that
    RegisterAction<thc_passes_t, thc_index_t, bit<7>>(thc_passes) thc_passes_new_blank = {
        void apply(inout thc_passes_t value) {
            value.run = hdr.thc.run;
            value.n = 0;
        }
    };
    RegisterAction<thc_passes_t, thc_index_t, bit<7>>(thc_passes) thc_passes_add = {
        void apply(inout thc_passes_t value, out bit<7> n) {
            if (value.run == hdr.thc.run) {
                value.n = value.n + 1;
                n = (bit<7>)value.n;
            } else {
                n = 0;
            }
        }
    };
    RegisterAction<thc_passes_t, thc_index_t, bit<7>>(thc_passes) thc_passes_read = {
        void apply(inout thc_passes_t value, out bit<7> n) {
            if (value.run == hdr.thc.run) {
                n = (bit<7>)value.n;
            } else {
                n = 0;
            }
        }
    };

    // ---- configuration tables (controller/jobs.py), thc.p4's names ----
    action set_job(bit<8> job_index, bit<8> n_workers, bit<16> pool_base, bit<16> pool_size,
                   bit<32> full_bitmap, bit<16> mcast_grp, bit<8> sum_bits, bit<32> epoch,
                   bit<8> aggregation) {
        meta.job_index = job_index;
        meta.bridge.lut_job = job_index;
        meta.bridge.job = job_index[3:0];
        meta.n_workers = n_workers;
        meta.pool_base = pool_base;
        meta.pool_size = pool_size;
        meta.mcast_grp = mcast_grp;
        meta.wide = (bit<1>)(sum_bits >> 4);
        meta.vote = aggregation[0:0];
        meta.epoch = epoch;
        meta.cfg_diff = hdr.thc.bitmap[15:0] ^ epoch[31:16];
        meta.job_hit = 1;
    }
    @stage(0)
    table thc_job {
        key = { hdr.thc.job_id: exact @name("job_id"); }
        actions = { set_job; @defaultonly NoAction; }
        default_action = NoAction();
        size = THC_MAX_JOBS;
    }

    action set_worker(bit<32> worker_bit) {
        meta.worker_bit = worker_bit;
        meta.ack_bit = worker_bit;
        meta.worker_hit = 1;
    }
    @stage(0)
    // A worker is known by its switch port as well as its addresses (thc.p4's rule).
    table thc_worker {
        key = {
            hdr.thc.job_id: exact @name("job_id");
            hdr.thc.worker_id: exact @name("worker_id");
            hdr.ipv4.srcAddr: exact @name("src_ip");
            hdr.udp.srcPort: exact @name("src_port");
            ig_intr_md.ingress_port: exact @name("ingress_port");
        }
        actions = { set_worker; @defaultonly NoAction; }
        default_action = NoAction();
        size = THC_MAX_JOBS * THC_MAX_WORKERS;
    }

    // The install a RESET belongs to: the controller writes (job_id, epoch) beside the job
    // entry, so a RESET still queued from an earlier install of the job (another epoch)
    // misses, clears nothing and is not counted in thc_resets (stale_reset).
    action set_install() {
        meta.install_hit = 1;
    }
    @stage(0)
    table thc_install {
        key = {
            hdr.thc.job_id: exact @name("job_id");
            hdr.thc.epoch: exact @name("epoch");
        }
        actions = { set_install; @defaultonly NoAction; }
        default_action = NoAction();
        size = THC_MAX_JOBS;
    }

    // DLCP: the DSCP of every IPv4 packet picks its egress queue
    action thc_set_priority(bit<3> priority) {
        ig_tm_md.qid = (QueueId_t)priority;
    }
    action thc_dscp_miss() {
        thc_dscp_unknown.count(0);
        ig_tm_md.qid = 0;
    }
    table thc_dscp {
        key = { meta.dscp: exact @name("dscp"); }
        actions = { thc_set_priority; thc_dscp_miss; }
        default_action = thc_dscp_miss();
        const entries = { THC_DSCP_ENTRIES }
        size = 16;
    }
    // the last pass of a packet that went round: its queue again (pass 0 counted a miss)
    action thc_best_effort() {
        ig_tm_md.qid = 0;
    }
    table thc_dscp_last {
        key = { meta.dscp: exact @name("dscp"); }
        actions = { thc_set_priority; thc_best_effort; }
        default_action = thc_best_effort();
        const entries = { THC_DSCP_ENTRIES }
        size = 16;
    }

    action l2_set_port(PortId_t port) {
        ig_tm_md.ucast_egress_port = port;
    }
    action l2_miss() {
        l2_misses.count(0);
        ig_dprsr_md.drop_ctl = 1;
    }
    table l2_forward {
        key = { hdr.ethernet.dstAddr: exact @name("dst_mac"); }
        actions = { l2_set_port; l2_miss; }
        default_action = l2_miss();
        size = 1024;
    }

    // ---- pass 0: checks ----
    action thc_slot() {
        meta.slot_idx = meta.pool_base + hdr.thc.slot;
        meta.room8 = meta.n_workers |-| hdr.thc.worker_id;
        meta.room16 = meta.pool_size |-| hdr.thc.slot;
        meta.jc4 = meta.job_index[5:0] ++ 2w0;
        meta.jc1 = meta.job_index;
        meta.bridge.wide = meta.wide;
    }
    // register indices through the hash unit's identity: no ALU alignment between the
    // header fields and the indices
    Hash<thc_index_t>(HashAlgorithm_t.IDENTITY) thc_reg_hash;
    Hash<thc_index_t>(HashAlgorithm_t.IDENTITY) thc_word_hash;
    Hash<bit<16>>(HashAlgorithm_t.IDENTITY) thc_worker_hash;
    Hash<bit<16>>(HashAlgorithm_t.IDENTITY) thc_worker_hash1;
    action thc_index() {
        meta.reg_index = thc_reg_hash.get({meta.slot_idx[9:0], hdr.thc.version[0:0]});
        meta.worker_index = thc_worker_hash.get({meta.job_index[3:0], hdr.thc.worker_id[4:0]});
        meta.run_key = hdr.thc.run ^ meta.epoch;
        meta.jc_index = meta.jc4 + meta.jc1;   // x THC_N_JOB_COUNTERS (5)
    }
    // the words' registers hold pass 1's quarter of a slot version below THC_REG_SIZE;
    // each pass going round moves up a quarter
    action thc_word_index() {
        meta.bridge.word_index = thc_word_hash.get({meta.slot_idx[8:0], hdr.thc.version[0:0]});
    }
    action thc_set_drop(bit<8> reason) {
        meta.drop_reason = reason;
    }
    // a drop the sender is told of (REFUSED), so its client fails at once naming the reason
    action thc_refuse(bit<8> reason) {
        meta.drop_reason = reason;
        meta.refuse = 1;
    }
    // thc.p4's first checks, in its order, as one table: a chain of conditions takes a
    // logical table each and three stages before the slot state can start
    table thc_wellformed {
        key = {
            hdr.thc.isValid(): ternary @name("thc_valid");
            ig_prsr_md.parser_err: ternary @name("parser_err");
            hdr.udp.length: ternary @name("udp_length");
            hdr.thc.pkt_type: ternary @name("pkt_type");
            hdr.thc.version: ternary @name("version");
            ig_intr_md.ingress_port: ternary @name("ingress_port");
            hdr.thc.run: ternary @name("run");
        }
        actions = { thc_set_drop; NoAction; }
        const entries = {
#include "generated/thc_tna_wellformed.p4"
        }
        const default_action = NoAction;
        size = 128;
    }
    action thc_job_run_check() {
        meta.run_stale = thc_job_run_ra.execute((bit<32>)meta.job_index);
        meta.run_checked = 1;
    }
    action thc_job_run_idle() {
        meta.run_stale = thc_job_run_take.execute((bit<32>)meta.job_index);
        meta.run_checked = 1;
    }
    action thc_job_seen_check() {
        meta.seen = thc_job_seen_ra.execute((bit<32>)meta.job_index);
    }
    action thc_job_seen_clear() {
        thc_job_seen_reset.execute((bit<32>)meta.job_index);
    }
    action thc_job_heard() {
        thc_job_seen_touch.execute((bit<32>)meta.p1.job);
    }
    // every pass after pass 0 is of a packet pass 0 accepted
    table thc_job_heard_op {
        key = { meta.p1.recirc: exact; }
        actions = { thc_job_heard; NoAction; }
        const entries = { 1: thc_job_heard(); }
        const default_action = NoAction;
        size = 1;
    }
    // The checks of thc_check before the job's run, as its entries make them (a known
    // worker is one of the job's: the controller's thc_worker entries; a slot within the
    // pool has no bit of the pool's mask clear; the configuration tag is the install's), so
    // that only a packet that thc_check leaves to the run check reads (and takes) an idle job.
    // A RESET clears it only where thc_check clears the job's run: header only, of this
    // install, its slot within the pool (a RESET thc_check drops changes nothing).
#define THC_SEEN_RESET(P) \
            (0, 1, THC_RESET, _, THC_IN_HDR, _, P, _, _, _, _, 0 &&& (0xffff - (P - 1)), _, 1, \
             _): thc_job_seen_clear();
#define THC_SEEN_POOL(P) \
            (0, 1, _, _, _, _, P, 0 &&& (P - 1), 0 &&& P, 0, 1, 0 &&& (0xffff - (P - 1)), 0, \
             _, 0): thc_job_seen_check(); \
            (0, 1, _, _, _, _, P, 0 &&& (P - 1), P &&& P, 1, 1, 0 &&& (0xffff - (P - 1)), 0, \
             _, 0): thc_job_seen_check();
    @stage(1)
    table thc_job_seen_op {
        key = {
            meta.drop_reason: ternary;
            meta.job_hit: ternary;
            hdr.thc.pkt_type: ternary;
            meta.vote: ternary;
            meta.lanes_in: ternary;
            meta.wide: ternary;
            meta.pool_size: ternary;
            meta.slotx: ternary;
            hdr.thc.seq[15:0]: ternary @name("seq16");
            hdr.thc.version: ternary;
            meta.worker_hit: ternary;
            hdr.thc.slot: ternary @name("slot");
            hdr.thc.offset[31:31]: ternary @name("offset31");
            meta.install_hit: ternary;
            meta.cfg_diff: ternary;
        }
        actions = { thc_job_seen_check; thc_job_seen_clear; NoAction; }
        const entries = {
            (0, 1, _, 1, _, 1, _, _, _, _, _, _, _, _, _): NoAction();
            THC_SEEN_RESET(1) THC_SEEN_RESET(2) THC_SEEN_RESET(4) THC_SEEN_RESET(8)
            THC_SEEN_RESET(16) THC_SEEN_RESET(32) THC_SEEN_RESET(64) THC_SEEN_RESET(128)
            THC_SEEN_RESET(256) THC_SEEN_RESET(512)
            (0, 1, THC_RESET, _, _, _, _, _, _, _, _, _, _, _, _): NoAction();
            (0, 1, THC_DATA, 0, THC_IN_NONE, _, _, _, _, _, _, _, _, _, _): NoAction();
            (0, 1, THC_DATA, 0, THC_IN_SIGNS, _, _, _, _, _, _, _, _, _, _): NoAction();
            (0, 1, THC_DATA, 1, THC_IN_NONE, _, _, _, _, _, _, _, _, _, _): NoAction();
            (0, 1, THC_DATA, 1, THC_IN_IDX, _, _, _, _, _, _, _, _, _, _): NoAction();
            (0, 1, THC_MAX, _, THC_IN_NONE, _, _, _, _, _, _, _, _, _, _): NoAction();
            (0, 1, THC_FLUSH, _, THC_IN_NONE, _, _, _, _, _, _, _, _, _, _): NoAction();
            THC_SEEN_POOL(1) THC_SEEN_POOL(2) THC_SEEN_POOL(4) THC_SEEN_POOL(8)
            THC_SEEN_POOL(16) THC_SEEN_POOL(32) THC_SEEN_POOL(64) THC_SEEN_POOL(128)
            THC_SEEN_POOL(256) THC_SEEN_POOL(512)
        }
        const default_action = NoAction;
        size = 48;
    }
#undef THC_SEEN_RESET
#undef THC_SEEN_POOL
    action thc_job_run_clear() {
        thc_job_run_reset.execute((bit<32>)meta.job_index);
    }
    // Steps 2-6 of thc.p4 in its order; the slot and version a seq names, for pool sizes
    // that are powers of two: slot == seq mod pool (slotx masked) and version == bit
    // log2(pool) of seq.
#define THC_POOL(P) \
            (0, 1, _, _, _, _, P, 0 &&& (P - 1), 0 &&& P, 0, _, _, _, _, THC_SEEN_TAKE, _, _): \
                thc_job_run_idle(); \
            (0, 1, _, _, _, _, P, 0 &&& (P - 1), 0 &&& P, 0, _, _, _, _, _, _, _): \
                thc_job_run_check(); \
            (0, 1, _, _, _, _, P, 0 &&& (P - 1), P &&& P, 1, _, _, _, _, THC_SEEN_TAKE, _, _): \
                thc_job_run_idle(); \
            (0, 1, _, _, _, _, P, 0 &&& (P - 1), P &&& P, 1, _, _, _, _, _, _, _): \
                thc_job_run_check();
    // a configuration tag unlike the install's: some bit of cfg_diff set
#define THC_CONFIG(B) \
            (0, 1, _, _, _, _, _, _, _, _, _, _, _, _, _, _, (1 << B) &&& (1 << B)): \
                thc_refuse(THC_DROP_WRONG_CONFIG);
    @stage(4)
    table thc_check {
        key = {
            meta.drop_reason: ternary;
            meta.job_hit: ternary;
            hdr.thc.pkt_type: ternary;
            meta.vote: ternary;
            meta.lanes_in: ternary;
            meta.wide: ternary;
            meta.pool_size: ternary;
            meta.slotx: ternary;
            hdr.thc.seq[15:0]: ternary @name("seq16");
            hdr.thc.version: ternary;
            meta.room8: ternary;
            meta.worker_hit: ternary;
            meta.room16: ternary;
            hdr.thc.offset[31:31]: ternary @name("offset31");
            meta.seen: ternary;
            meta.install_hit: ternary;
            meta.cfg_diff: ternary;
        }
        actions = {
            thc_set_drop; thc_refuse; thc_job_run_check; thc_job_run_idle; thc_job_run_clear;
            NoAction;
        }
        const entries = {
            (0, 0, _, _, _, _, _, _, _, _, _, _, _, _, _, _, _): thc_set_drop(THC_DROP_UNKNOWN_JOB);
            (0, 1, _, 1, _, 1, _, _, _, _, _, _, _, _, _, _, _): thc_set_drop(THC_DROP_BAD_LANES);
            (0, 1, THC_DATA, 0, THC_IN_NONE, _, _, _, _, _, _, _, _, _, _, _, _):
                thc_set_drop(THC_DROP_BAD_LANES);
            (0, 1, THC_DATA, 0, THC_IN_SIGNS, _, _, _, _, _, _, _, _, _, _, _, _):
                thc_set_drop(THC_DROP_BAD_LANES);
            (0, 1, THC_DATA, 1, THC_IN_NONE, _, _, _, _, _, _, _, _, _, _, _, _):
                thc_set_drop(THC_DROP_BAD_LANES);
            (0, 1, THC_DATA, 1, THC_IN_IDX, _, _, _, _, _, _, _, _, _, _, _, _):
                thc_set_drop(THC_DROP_BAD_LANES);
            (0, 1, THC_MAX, _, THC_IN_NONE, _, _, _, _, _, _, _, _, _, _, _, _):
                thc_set_drop(THC_DROP_BAD_LANES);
            (0, 1, THC_FLUSH, _, THC_IN_NONE, _, _, _, _, _, _, _, _, _, _, _, _):
                thc_set_drop(THC_DROP_BAD_LANES);
            (0, 1, THC_RESET, _, THC_IN_NONE, _, _, _, _, _, _, _, _, _, _, _, _):
                thc_set_drop(THC_DROP_BAD_LANES);
            (0, 1, THC_RESET, _, _, _, _, _, _, _, _, _, 0, _, _, _, _):
                thc_set_drop(THC_DROP_SLOT_OUTSIDE_POOL);
            (0, 1, THC_RESET, _, _, _, _, _, _, _, _, _, _, _, _, 0, _):
                thc_set_drop(THC_DROP_STALE_RESET);
            (0, 1, THC_RESET, _, _, _, _, _, _, _, _, _, _, _, _, _, _): thc_job_run_clear();
            (0, 1, _, _, _, _, _, _, _, _, 0, _, _, _, _, _, _):
                thc_set_drop(THC_DROP_WORKER_OUTSIDE_JOB);
            (0, 1, _, _, _, _, _, _, _, _, _, 0, _, _, _, _, _):
                thc_set_drop(THC_DROP_UNKNOWN_WORKER);
            THC_CONFIG(0) THC_CONFIG(1) THC_CONFIG(2) THC_CONFIG(3) THC_CONFIG(4) THC_CONFIG(5)
            THC_CONFIG(6) THC_CONFIG(7) THC_CONFIG(8) THC_CONFIG(9) THC_CONFIG(10) THC_CONFIG(11)
            THC_CONFIG(12) THC_CONFIG(13) THC_CONFIG(14) THC_CONFIG(15)
            (0, 1, _, _, _, _, _, _, _, _, _, _, 0, _, _, _, _):
                thc_set_drop(THC_DROP_SLOT_OUTSIDE_POOL);
            (0, 1, _, _, _, _, _, _, _, _, _, _, _, 1, _, _, _):
                thc_refuse(THC_DROP_MALFORMED);   // bit 31 tells a MAX use (thc_use)
            // a packet at the idle edge within THC_TNA_EDGE of a live read: unanswered
            (0, 1, _, _, _, _, _, _, _, _, _, _, _, _, THC_SEEN_WAIT, _, _):
                thc_set_drop(THC_DROP_STALE_RUN);
            THC_POOL(1) THC_POOL(2) THC_POOL(4) THC_POOL(8) THC_POOL(16) THC_POOL(32)
            THC_POOL(64) THC_POOL(128) THC_POOL(256) THC_POOL(512)
            (0, 1, _, _, _, _, _, _, _, _, _, _, _, _, _, _, _): thc_refuse(THC_DROP_WRONG_SLOT);
        }
        const default_action = NoAction;
        size = 128;
    }
#undef THC_POOL
#undef THC_CONFIG

    action thc_incarnation_check() {
        meta.reused = thc_incarnation_ra.execute(meta.worker_index);
    }
    @stage(5)
    table thc_incarnation_op {
        key = {
            meta.drop_reason: ternary;
            hdr.thc.pkt_type: ternary;
            meta.run_stale: ternary;
        }
        actions = { thc_incarnation_check; NoAction; }
        const entries = {
            (0, THC_RESET, _): NoAction();
            (0, _, 0): thc_incarnation_check();
        }
        const default_action = NoAction;
        size = 4;
    }

    // Both versions' acknowledgements, once the job's run is known (a packet refused as
    // stale_run acknowledges nothing), a table a register, in the stage of the worker's
    // incarnation (one refused as reused_run there still acknowledges: docs/switch.md).
    // RESET makes the version it names unused.
#define THC_ACK_OP(V) \
    action thc_ack##V() {                                                                      \
        meta.ack##V = thc_acked##V##_ra.execute(meta.slot_idx);                               \
    }                                                                                          \
    action thc_ack_clear##V() {                                                                \
        thc_acked##V##_reset.execute(meta.slot_idx);                                          \
    }                                                                                          \
    @stage(5)                                                                                  \
    table thc_ack##V##_op {                                                                    \
        key = {                                                                                \
            meta.drop_reason: ternary;                                                         \
            hdr.thc.pkt_type: ternary;                                                         \
            hdr.thc.version: ternary;                                                          \
            meta.run_stale: ternary;                                                           \
        }                                                                                      \
        actions = { thc_ack##V; thc_ack_clear##V; NoAction; }                                  \
        const entries = {                                                                      \
            (0, THC_RESET, V, _): thc_ack_clear##V();                                          \
            (0, THC_RESET, _, _): NoAction();                                                  \
            (0, _, _, 0): thc_ack##V();                                                        \
        }                                                                                      \
        const default_action = NoAction;                                                       \
        size = 4;                                                                              \
    }
    THC_ACK_OP(0)
    THC_ACK_OP(1)
#undef THC_ACK_OP
    // Pass 1: a new use's acknowledgements restart. The slot as pass 0 addressed it, from the
    // bridged word index (one address for both passes: each hash of its own would take a
    // hash distribution unit that stage does not have).
    action thc_ack_slot() {
        meta.slot_idx = 7w0 ++ meta.p1.word_index[9:1];
    }
    // Pass 1 of a REFUSED that pass 0 sent round (reused_run, stale, wrong_use) reads what
    // the model names in its bitmap from the register that refused it, addressed through
    // the same fields as pass 0.
    action thc_detail_index() {
        meta.reg_index = 6w0 ++ meta.p1.word_index[9:0];
        meta.worker_index = thc_worker_hash1.get({meta.p1.job, hdr.thc.worker_id[4:0]});
    }
    action thc_nonce_detail() { hdr.thc.bitmap = thc_nonce_read.execute(meta.worker_index); }
    action thc_seq_detail() { hdr.thc.bitmap = thc_seq_read.execute(meta.reg_index); }
    action thc_op_detail() { hdr.thc.bitmap = thc_op_read.execute(meta.reg_index); }
#define THC_DETAIL(REG, STAGE, REASON) \
    @stage(STAGE) \
    table thc_##REG##_detail_op { \
        key = { hdr.thc.pkt_type: ternary; hdr.thc.count: ternary; } \
        actions = { thc_##REG##_detail; NoAction; } \
        const entries = { (THC_REFUSED, REASON): thc_##REG##_detail(); } \
        const default_action = NoAction; \
        size = 1; \
    }
    THC_DETAIL(nonce, 5, THC_DROP_REUSED_RUN)
    THC_DETAIL(seq, 6, THC_DROP_STALE)
    THC_DETAIL(op, 7, THC_DROP_WRONG_USE)
#undef THC_DETAIL
    action thc_ack_start0() {
        thc_acked0_fresh.execute(meta.slot_idx);
    }
    action thc_ack_start1() {
        thc_acked1_fresh.execute(meta.slot_idx);
    }
    table thc_ack0_new {
        key = {
            meta.p1.new_use: exact;
            hdr.thc.version: exact;
        }
        actions = { thc_ack_start0; NoAction; }
        const entries = { (1, 0): thc_ack_start0(); }
        const default_action = NoAction;
        size = 1;
    }
    table thc_ack1_new {
        key = {
            meta.p1.new_use: exact;
            hdr.thc.version: exact;
        }
        actions = { thc_ack_start1; NoAction; }
        const entries = { (1, 1): thc_ack_start1(); }
        const default_action = NoAction;
        size = 1;
    }

    action thc_run_check() {
        meta.use_step = thc_run_ra.execute(meta.reg_index);
    }
    action thc_run_hold_check() {
        meta.use_step = thc_run_hold.execute(meta.reg_index);
        meta.hold = 1;
    }
    action thc_run_clear() {
        thc_run_reset.execute(meta.reg_index);
    }
    // A version every worker acknowledged starts a new use at a later seq; any other holds
    // it. Worker w's bit is 1 << w (w < n, thc_check), so "every worker" is the low n bits:
    // a ternary match of the packet's version's acknowledgements for each n and version.
#define THC_FULL(N) \
            (0, _, 0, 0, N, 0, ((32w1 << N) - 1) &&& ((32w1 << N) - 1), _): thc_run_check(); \
            (0, _, 0, 0, N, 1, _, ((32w1 << N) - 1) &&& ((32w1 << N) - 1)): thc_run_check();
    @stage(6)
    table thc_run_op {
        key = {
            meta.drop_reason: ternary;
            hdr.thc.pkt_type: ternary;
            meta.run_stale: ternary;
            meta.reused: ternary;
            meta.n_workers: ternary;
            hdr.thc.version: ternary;
            meta.ack0: ternary;
            meta.ack1: ternary;
        }
        actions = { thc_run_check; thc_run_hold_check; thc_run_clear; thc_refuse; NoAction; }
        const entries = {
            (0, THC_RESET, _, _, _, _, _, _): thc_run_clear();
            (0, _, 1, _, _, _, _, _): thc_refuse(THC_DROP_STALE_RUN);
            (0, _, 0, 1, _, _, _, _): thc_refuse(THC_DROP_REUSED_RUN);
            THC_FULL(1) THC_FULL(2) THC_FULL(3) THC_FULL(4) THC_FULL(5) THC_FULL(6)
            THC_FULL(7) THC_FULL(8) THC_FULL(9) THC_FULL(10) THC_FULL(11) THC_FULL(12)
            THC_FULL(13) THC_FULL(14) THC_FULL(15) THC_FULL(16) THC_FULL(17) THC_FULL(18)
            THC_FULL(19) THC_FULL(20) THC_FULL(21) THC_FULL(22) THC_FULL(23) THC_FULL(24)
            THC_FULL(25) THC_FULL(26) THC_FULL(27) THC_FULL(28) THC_FULL(29) THC_FULL(30)
            THC_FULL(31)
            (0, _, 0, 0, _, _, _, _): thc_run_hold_check();
        }
        const default_action = NoAction;
        size = 128;
    }
#undef THC_FULL

    action thc_use_start() {
        meta.wrong_use = thc_use_new.execute(meta.reg_index);
    }
    action thc_use_match() {
        meta.wrong_use = thc_use_check.execute(meta.reg_index);
    }
    action thc_use_clear() {
        thc_use_reset.execute(meta.reg_index);
    }
    @stage(7)
    table thc_use_op {
        key = {
            meta.drop_reason: ternary;
            hdr.thc.pkt_type: ternary;
            meta.use_step: ternary;
            meta.hold: ternary;
        }
        actions = { thc_use_start; thc_use_match; thc_use_clear; NoAction; }
        const entries = {
            (0, THC_RESET, _, _): thc_use_clear();
            (0, _, THC_STEP_SAME, _): thc_use_match();
            (0, _, THC_STEP_SEQ, 1): NoAction();
            (0, _, _, _): thc_use_start();
        }
        const default_action = NoAction;
        size = 4;
    }

    action thc_bitmap_start() {
        meta.old_bitmap = thc_bitmap_new.execute(meta.reg_index);
    }
    action thc_bitmap_add() {
        meta.old_bitmap = thc_bitmap_same.execute(meta.reg_index);
    }
    action thc_bitmap_clear() {
        thc_bitmap_reset.execute(meta.reg_index);
    }
    action thc_bitmap_look() {
        meta.old_bitmap = thc_bitmap_peek.execute(meta.reg_index);
    }
    @stage(8)
    table thc_bitmap_op {
        key = {
            meta.drop_reason: ternary;
            hdr.thc.pkt_type: ternary;
            meta.use_step: ternary;
            meta.hold: ternary;
            meta.wrong_use: ternary;
        }
        actions = { thc_bitmap_start; thc_bitmap_add; thc_bitmap_clear; thc_bitmap_look; NoAction; }
        const entries = {
            (0, THC_RESET, _, _, _): thc_bitmap_clear();
            (0, _, THC_STEP_SAME, _, 0): thc_bitmap_add();
            (0, _, THC_STEP_SAME, _, 1): thc_bitmap_look();
            (0, _, THC_STEP_SEQ, 1, _): NoAction();
            (0, _, _, _, _): thc_bitmap_start();
        }
        const default_action = NoAction;
        size = 8;
    }

    // The count and the lane operation. A new use writes (a FLUSH: zeros, count 0, closed);
    // another seq is stale; a closed use, or the sender's bit already set, is a
    // retransmission (read); else add. RESET clears the count and drops the packet.
    action thc_count_start() {
        meta.count = thc_count_first.execute(meta.reg_index);
        meta.bitmap = meta.worker_bit;
        meta.bridge.lane_op = THC_OP_WRITE;
        meta.bridge.new_use = 1;
    }
    action thc_count_flush_start() {
        meta.count = thc_count_zero.execute(meta.reg_index);
        meta.bitmap = 0;
        meta.closed = 1;
        meta.bridge.lane_op = THC_OP_WRITE;
        meta.bridge.new_use = 1;
    }
    action thc_count_add() {
        meta.count = thc_count_ra.execute(meta.reg_index);
        meta.bitmap = meta.old_bitmap | meta.worker_bit;
        meta.bridge.lane_op = THC_OP_ADD;
    }
    action thc_count_closed() {
        meta.count = thc_count_read.execute(meta.reg_index);
        meta.bitmap = meta.old_bitmap & 0x7FFFFFFF;
        meta.closed = 1;
        meta.dup = 1;
        meta.bridge.lane_op = THC_OP_READ;
    }
    action thc_count_flush() {
        meta.count = thc_count_read.execute(meta.reg_index);
        meta.bitmap = meta.old_bitmap & 0x7FFFFFFF;
        meta.closed = 1;
        meta.bridge.lane_op = THC_OP_READ;
    }
    action thc_count_dup() {
        meta.count = thc_count_read.execute(meta.reg_index);
        meta.bitmap = meta.old_bitmap;
        meta.dup = 1;
        meta.bridge.lane_op = THC_OP_READ;
    }
    action thc_count_clear() {
        meta.count = thc_count_zero.execute(meta.reg_index);
        thc_resets.count((bit<32>)meta.job_index);
        ig_dprsr_md.drop_ctl = 1;
    }
#define THC_DUP(W) \
            (0, _, THC_STEP_SAME, _, 32w1 << W, (32w1 << W) &&& (32w1 << W), _): thc_count_dup();
    @stage(9)
    table thc_count_op {
        key = {
            meta.drop_reason: ternary;
            hdr.thc.pkt_type: ternary;
            meta.use_step: ternary;
            meta.hold: ternary;
            meta.worker_bit: ternary;
            meta.old_bitmap: ternary;
            meta.wrong_use: ternary;
        }
        actions = {
            thc_count_start; thc_count_flush_start; thc_count_add; thc_count_closed;
            thc_count_flush; thc_count_dup; thc_count_clear; thc_refuse; NoAction;
        }
        const entries = {
            (0, THC_RESET, _, _, _, _, _): thc_count_clear();
            (0, _, THC_STEP_SAME, _, _, 0, _): thc_refuse(THC_DROP_STALE);
            (0, _, THC_STEP_SAME, _, _, _, 1): thc_refuse(THC_DROP_WRONG_USE);
            (0, _, THC_STEP_SAME, _, _, 0x80000000 &&& 0x80000000, _): thc_count_closed();
            (0, THC_FLUSH, THC_STEP_SAME, _, _, _, _): thc_count_flush();
            THC_DUP(0) THC_DUP(1) THC_DUP(2) THC_DUP(3) THC_DUP(4) THC_DUP(5) THC_DUP(6)
            THC_DUP(7) THC_DUP(8) THC_DUP(9) THC_DUP(10) THC_DUP(11) THC_DUP(12) THC_DUP(13)
            THC_DUP(14) THC_DUP(15) THC_DUP(16) THC_DUP(17) THC_DUP(18) THC_DUP(19)
            THC_DUP(20) THC_DUP(21) THC_DUP(22) THC_DUP(23) THC_DUP(24) THC_DUP(25)
            THC_DUP(26) THC_DUP(27) THC_DUP(28) THC_DUP(29) THC_DUP(30)
            (0, _, THC_STEP_SAME, _, _, _, _): thc_count_add();
            (0, _, THC_STEP_SEQ, 1, _, _, _): NoAction();
            (0, THC_FLUSH, _, _, _, _, _): thc_count_flush_start();
            (0, _, _, _, _, _, _): thc_count_start();
        }
        const default_action = NoAction;
        size = 64;
    }
#undef THC_DUP

    // ---- replies ----
    // the job's counter of each outcome, ready before the outcome is known
    action thc_jc() {
        meta.jc_done = meta.jc_index + (bit<8>)THC_JC_COMPLETIONS;
        meta.jc_again = meta.jc_index + (bit<8>)THC_JC_RETRANSMISSIONS;
        meta.jc_pending = meta.jc_index + (bit<8>)THC_JC_PENDING;
        meta.jc_held = meta.jc_index + (bit<8>)THC_JC_HELD;
    }
    // Each outcome is one action (its header fields, length, destination and counter): the
    // replies take one stage after the count.
    action thc_answer_now() {
        ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port;
        meta.bridge.is_reply = 1;
#include "generated/thc_tna_payload_invalid.p4"
    }
    // The same answer, sent by pass 1: a packet that passed the job's run check refreshes the
    // job's idle clock (thc_job_heard_op), as in the model, whatever its answer.
    action thc_answer_round() {
        ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port[8:7] ++ THC_TNA_RECIRC_PORT;
        ig_tm_md.qid = 0;
        meta.bridge.recirc = 1;
        meta.bridge.reply = 1;
        meta.bridge.last = 1;
        meta.bridge.hdr_only = 1;
        meta.bridge.payload = THC_PAY_NONE;
        meta.bridge.lut_job = THC_TNA_NO_LUT;
        meta.bridge.lane_op = THC_OP_NONE;
#include "generated/thc_tna_payload_invalid.p4"
    }
    // go round: the next pass adds lanes (pass 0 -> 1 -> 2, to 4 for a 16-bit job; a MAX
    // packet's pass 1 is its last); the last sends (reply) or drops the packet
    action thc_recirculate() {
        ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port[8:7] ++ THC_TNA_RECIRC_PORT;
        ig_tm_md.qid = 0;
        meta.bridge.recirc = 1;
    }
    // an adding pass -> the next: the bridge header this pass read goes round again (the
    // index blocks it carried), the next pass's step and quarter of the words' registers
    // (the quarter is the step: word_index's bits above THC_REG_SIZE's)
    action thc_go_round_again(bit<1> last, bit<2> step) {
        ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port[8:7] ++ THC_TNA_RECIRC_PORT;
        ig_tm_md.qid = 0;
        meta.bridge.setInvalid();
        meta.p1.last = last;
        meta.p1.step = step;
        meta.p1.word_index[11:10] = step;
        meta.p1.new_use = 0;
    }
    // The last pass of a packet of the slot version's current use (its seq the bitmap
    // register's, through pass 1's address fields): a late pass of a use before it, of any
    // run, finds 0 and counts nothing.
    @stage(8)
    table thc_current_op {
        key = { meta.p1.last: exact; }
        actions = { thc_bitmap_look; NoAction; }
        const entries = { 1: thc_bitmap_look(); }
        const default_action = NoAction;
        size = 1;
    }
    // pass 0 of a packet that opens a use (its lanes written, or cleared by a FLUSH)
    action thc_passes_start() { thc_passes_new.execute(meta.reg_index); }
    action thc_passes_start_blank() { thc_passes_new_blank.execute(meta.reg_index); }
    @stage(11)
    table thc_passes_new_op {
        key = { meta.bridge.new_use: exact; meta.bridge.blank: exact; }
        actions = { thc_passes_start; thc_passes_start_blank; NoAction; }
        const entries = {
            (1, 0): thc_passes_start();
            (1, 1): thc_passes_start_blank();
        }
        const default_action = NoAction;
        size = 2;
    }
    // the last pass of a packet that writes (or clears) lanes, or reads the sums
    action thc_passes_join() {
        meta.bridge.passes = thc_passes_add.execute((thc_index_t)meta.p1.word_index[9:0]);
    }
    action thc_passes_look() {
        meta.bridge.passes = thc_passes_read.execute((thc_index_t)meta.p1.word_index[9:0]);
    }
    @stage(11)
    table thc_passes_op {
        key = {
            meta.p1.last: exact;
            meta.p1.lane_op: exact;
            meta.p1.blank: exact;
            meta.old_bitmap: ternary;
        }
        actions = { thc_passes_join; thc_passes_look; NoAction; }
        const entries = {
            (1, THC_OP_WRITE, 0, 0): NoAction();
            (1, THC_OP_WRITE, 1, 0): NoAction();
            (1, THC_OP_ADD, 0, 0): NoAction();
            (1, THC_OP_READ, 0, 0): NoAction();
            (1, THC_OP_READ, 1, 0): NoAction();
            (1, THC_OP_WRITE, 0, _): thc_passes_join();
            (1, THC_OP_WRITE, 1, _): thc_passes_join();
            (1, THC_OP_ADD, 0, _): thc_passes_join();
            (1, THC_OP_READ, 0, _): thc_passes_look();
            (1, THC_OP_READ, 1, _): thc_passes_look();
        }
        const default_action = NoAction;
        size = 16;
    }
    // the last adding pass is pass 2, or pass 4 of a 16-bit job
    table thc_next {
        key = { meta.p1.wide: exact; meta.p1.step: exact; }
        actions = { thc_go_round_again; NoAction; }
        const entries = {
            (0, 0): thc_go_round_again(1, 1);
            (1, 0): thc_go_round_again(0, 1);
            (1, 1): thc_go_round_again(0, 2);
            (1, 2): thc_go_round_again(1, 3);
        }
        const default_action = NoAction;
        size = 4;
    }

    action thc_done(bit<8> pkt_type, bit<16> udp_len) {
        hdr.thc.pkt_type = pkt_type;
        hdr.thc.count = meta.count;
        hdr.thc.bitmap = meta.bitmap;
        hdr.thc.epoch = meta.epoch;
        hdr.udp.checksum = 0;
        hdr.udp.length = udp_len;
        hdr.ipv4.totalLen = udp_len + 20;
        thc_recirculate();
        meta.bridge.reply = 1;
    }
    // complete or closed: RESULT / MAX_RESULT after the last pass, to every worker (a
    // retransmission: to its sender)
    action thc_result() {
        thc_done(THC_RESULT, THC_UDP_LEN_RESULT8);
        meta.bridge.mcast_grp = meta.mcast_grp;
        thc_job_counters.count(meta.jc_done);
    }
    action thc_result_again() {
        thc_done(THC_RESULT, THC_UDP_LEN_RESULT8);
        thc_job_counters.count(meta.jc_again);
    }
    action thc_result16() {
        thc_done(THC_RESULT, THC_UDP_LEN_RESULT16);
        meta.bridge.mcast_grp = meta.mcast_grp;
        thc_job_counters.count(meta.jc_done);
    }
    action thc_result16_again() {
        thc_done(THC_RESULT, THC_UDP_LEN_RESULT16);
        thc_job_counters.count(meta.jc_again);
    }
    action thc_max_result() {
        thc_done(THC_MAX_RESULT, THC_UDP_LEN_MAX);
        meta.bridge.mcast_grp = meta.mcast_grp;
        thc_job_counters.count(meta.jc_done);
    }
    action thc_max_result_again() {
        thc_done(THC_MAX_RESULT, THC_UDP_LEN_MAX);
        thc_job_counters.count(meta.jc_again);
    }
    table thc_done_op {
        key = { meta.is_max: exact; meta.wide: exact; }
        actions = { thc_result; thc_result16; thc_max_result; }
        const entries = {
            (0, 0): thc_result();
            (0, 1): thc_result16();
            (1, 0): thc_max_result();
            (1, 1): thc_max_result();
        }
        size = 4;
    }
    table thc_again_op {
        key = { meta.is_max: exact; meta.wide: exact; }
        actions = { thc_result_again; thc_result16_again; thc_max_result_again; }
        const entries = {
            (0, 0): thc_result_again();
            (0, 1): thc_result16_again();
            (1, 0): thc_max_result_again();
            (1, 1): thc_max_result_again();
        }
        size = 4;
    }
    // retransmission of an incomplete slot: tell the worker where it stands; else consumed
    // once the passes have added its lanes
    action thc_pending() {
        hdr.thc.pkt_type = THC_PENDING;
        hdr.thc.count = meta.count;
        hdr.thc.bitmap = meta.bitmap;
        hdr.thc.epoch = meta.epoch;
        hdr.udp.checksum = 0;
        hdr.udp.length = THC_UDP_LEN_HDR;
        hdr.ipv4.totalLen = THC_UDP_LEN_HDR + 20;
        thc_answer_round();
        thc_job_counters.count(meta.jc_pending);
    }
    // a new use held (a worker may still need the previous result): count 0, and who is
    // known to hold that result
    action thc_held_reply() {
        hdr.thc.pkt_type = THC_PENDING;
        hdr.thc.count = 0;
        hdr.thc.epoch = meta.epoch;
        hdr.udp.checksum = 0;
        hdr.udp.length = THC_UDP_LEN_HDR;
        hdr.ipv4.totalLen = THC_UDP_LEN_HDR + 20;
        thc_answer_round();
        thc_job_counters.count(meta.jc_held);
    }
    action thc_held0() {
        thc_held_reply();
        hdr.thc.bitmap = meta.ack0;
    }
    action thc_held1() {
        thc_held_reply();
        hdr.thc.bitmap = meta.ack1;
    }
    table thc_held_op {
        key = { hdr.thc.version: exact; }
        actions = { thc_held0; thc_held1; NoAction; }
        const entries = {
            0: thc_held0();
            1: thc_held1();
        }
        const default_action = NoAction;
        size = 2;
    }
    action thc_consumed() {
        thc_recirculate();
        thc_job_counters.count(meta.jc_index);
    }
    // a drop the sender is told of (REFUSED) or not; counted by reason either way
    action thc_refusal() {
        thc_drops.count((bit<32>)meta.drop_reason);
        hdr.thc.count = meta.drop_reason;
        hdr.thc.bitmap = 0;
        hdr.thc.pkt_type = THC_REFUSED;
        hdr.thc.epoch = meta.epoch;
        hdr.udp.checksum = 0;
        hdr.udp.length = THC_UDP_LEN_HDR;
        hdr.ipv4.totalLen = THC_UDP_LEN_HDR + 20;
    }
    action thc_refused() {
        thc_refusal();
        thc_answer_now();
    }
    // refused after the job's run took it (reused_run, stale, wrong_use): sent by pass 1
    action thc_refused_round() {
        thc_refusal();
        thc_answer_round();
    }
    action thc_dropped() {
        thc_drops.count((bit<32>)meta.drop_reason);
        ig_dprsr_md.drop_ctl = 1;
    }
    // Tables, not bare actions: a counter's index comes through a table hit, and one table's
    // actions share the index field.
    table thc_drop_op {
        key = {
            meta.refuse: ternary;
            meta.run_checked: ternary;
            meta.run_stale: ternary;
        }
        actions = { thc_refused; thc_refused_round; thc_dropped; }
        const entries = {
            (1, 1, 0): thc_refused_round();
            (1, _, _): thc_refused();
            (0, _, _): thc_dropped();
        }
        size = 4;
    }
    table thc_pending_op {
        key = { meta.dup: exact; }
        actions = { thc_pending; NoAction; }
        const entries = { 1: thc_pending(); }
        const default_action = NoAction;
        size = 1;
    }
    table thc_consumed_op {
        key = { meta.dup: exact; }
        actions = { thc_consumed; NoAction; }
        const entries = { 0: thc_consumed(); }
        const default_action = NoAction;
        size = 1;
    }

    apply {
        meta.bridge.setValid();
        meta.now = ig_intr_md.ingress_mac_tstamp[47:16] | 1;   // never 0: "no run"
        // DLCP: the DSCP of every IPv4 packet picks its queue, first in pass 0 (counted once:
        // the last pass looks it up again, uncounted); a pass going round takes queue 0
        // (thc_recirculate, thc_go_round_again): passes of two packets never overtake each
        // other (a FLUSH's READ after a DATA's WRITE or ADD that pass 0 counted first).
        meta.dscp = hdr.ipv4.diffserv[7:2];
        if (hdr.ipv4.isValid() && !meta.p1.isValid()) {
            thc_dscp.apply();
        }
        // Pass 0 and the adding passes in the two branches of one condition: a table after
        // a condition takes a later stage than the tables before it, and tables of two
        // branches need no order, so the words take the stages beside pass 0's slot state.
        if (meta.p1.isValid()) {
            // ---- the adding passes: every word's lookups, then the words ----
            thc_job_heard_op.apply();
            thc_ack_slot();
            thc_detail_index();
            thc_nonce_detail_op.apply();
            thc_seq_detail_op.apply();
            thc_op_detail_op.apply();
            thc_ack0_new.apply();
            thc_ack1_new.apply();
            thc_current_op.apply();
            thc_passes_op.apply();
#include "generated/thc_tna_luts_apply.p4"
#include "generated/thc_tna_words_apply.p4"
            if (meta.p1.payload != THC_PAY_MAX && meta.p1.hdr_only == 0) {
#include "generated/thc_tna_res_valid.p4"
            }
#include "generated/thc_tna_cur_invalid.p4"
            if (meta.p1.last == 0) {
                thc_next.apply();
            } else if (meta.p1.reply == 1) {
                thc_dscp_last.apply();
                meta.bridge.is_reply = 1;
                if (meta.p1.mcast_grp != 0) {
                    ig_tm_md.mcast_grp_a = meta.p1.mcast_grp;
                } else {
                    ig_tm_md.ucast_egress_port = meta.p1.in_port;
                }
                meta.p1.setInvalid();
            } else {
                meta.p1.setInvalid();
                ig_dprsr_md.drop_ctl = 1;
            }
        } else if (hdr.udp.isValid() && hdr.udp.dstPort == THC_UDP_PORT) {
            // ---- pass 0 ----
            meta.bridge.in_port = ig_intr_md.ingress_port;
            // A vote DATA's sign bits become the index headers the lookups key on (the
            // vote job's entries count them), one shift a header per stage. First: a reply
            // without lanes invalidates them (thc_answer_now).
            if (meta.lanes_in == THC_IN_SIGNS) {
                thc_spread_0();
                thc_spread_1();
                thc_spread_2();
            }
            // 1. well-formed, right direction (the checks that need no job)
            thc_wellformed.apply();
            thc_job.apply();
            thc_worker.apply();
            if (hdr.thc.pkt_type == THC_RESET) {
                thc_install.apply();
            }
            meta.idle_since = ig_intr_md.ingress_mac_tstamp[47:16] - THC_TNA_IDLE;
            meta.run_far = hdr.thc.run - THC_RUN_JUMP;
            meta.slotx = hdr.thc.seq[15:0] ^ hdr.thc.slot;
            thc_job_seen_op.apply();
            meta.use_key = hdr.thc.offset;
            if (hdr.thc.pkt_type == THC_MAX) {
                meta.use_key[31:31] = 1;
                meta.is_max = 1;
                meta.bridge.is_max = 1;
                meta.bridge.last = 1;
                meta.bridge.payload = THC_PAY_MAX;
                meta.bridge.lut_job = THC_TNA_NO_LUT;
            } else if (hdr.thc.pkt_type == THC_FLUSH) {
                meta.worker_bit = 0x80000000;
                meta.blank = 1;
                meta.bridge.blank = 1;
                meta.bridge.lut_job = THC_TNA_NO_LUT;
            } else if (meta.lanes_in != THC_IN_NONE) {
                meta.bridge.payload = THC_PAY_IDX;
            }
            thc_slot();
            thc_index();
            thc_jc();
            thc_word_index();
            thc_check.apply();
            thc_incarnation_op.apply();
            thc_ack0_op.apply();
            thc_ack1_op.apply();
            thc_run_op.apply();
            thc_use_op.apply();
            thc_bitmap_op.apply();
            thc_count_op.apply();
            thc_passes_new_op.apply();
            if (meta.drop_reason != 0) {
                thc_drop_op.apply();
            } else if (meta.use_step == THC_STEP_SEQ && meta.hold == 1) {
                thc_held_op.apply();
            } else if (hdr.thc.pkt_type != THC_RESET) {
                if (meta.count == meta.n_workers || meta.closed == 1) {
                    // a FLUSH at a complete use is a retransmission: its sender's result
                    if (meta.dup == 1 || (hdr.thc.pkt_type == THC_FLUSH
                                          && meta.count == meta.n_workers)) {
                        thc_again_op.apply();
                    } else {
                        thc_done_op.apply();
                    }
                } else if (meta.dup == 1) {
                    thc_pending_op.apply();
                } else {
                    thc_consumed_op.apply();
                }
            }
        } else if (hdr.ethernet.isValid()) {
            l2_forward.apply();
        }
    }
}

control ThcIngressDeparser(packet_out pkt, inout tna_headers_t hdr, in metadata_t meta,
                           in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    apply {
        pkt.emit(meta.bridge);   // pass 0, the last pass
        pkt.emit(meta.p1);       // pass 1, going round again
        pkt.emit(hdr);
    }
}

// Egress sees the bridged header and, for a reply, the packet up to the THC header; a packet
// going round passes unchanged, its bridge header in front for the next pass, except that a
// 16-bit job's next block of indices is doubled.
// Two 16-bit halves: each step of the doubling moves one half, or one byte within it.
header thc_dup_h {
    bit<16> hi;
    bit<16> lo;
}

struct eg_headers_t {
    thc_pass_h   bridge;
    ethernet_h   ethernet;
    ipv4_h       ipv4;
    udp_h        udp;
    thc_h        thc;
    thc_dup_h[THC_TNA_OCTS] dd;   // the next pass's block, each byte twice
}

struct eg_metadata_t {
    bit<8> passes;      // hdr.bridge.passes, aligned as hdr.thc.count for the comparison
    bit<8> want;        // a RESULT's count plus one: what its use's cell holds (thc_passes)
}

parser ThcEgressParser(packet_in pkt, out eg_headers_t hdr, out eg_metadata_t meta,
                       out egress_intrinsic_metadata_t eg_intr_md) {
    state start {
        pkt.extract(eg_intr_md);
        pkt.extract(hdr.bridge);
        transition select(hdr.bridge.recirc, hdr.bridge.is_reply, hdr.bridge.wide,
                          hdr.bridge.payload) {
            (0, 1, _, _): parse_reply;
            (1, _, 1, THC_PAY_IDX): parse_dup;
            default: accept;
        }
    }
    state parse_reply {
        pkt.extract(hdr.ethernet);
        pkt.extract(hdr.ipv4);
        pkt.extract(hdr.udp);
        pkt.extract(hdr.thc);
        transition accept;
    }
    state parse_dup {
        pkt.extract(hdr.ethernet);
        pkt.extract(hdr.ipv4);
        pkt.extract(hdr.udp);
        pkt.extract(hdr.thc);
        transition parse_dup_octs;
    }
#include "generated/thc_tna_eg_parse.p4"
}

control ThcEgress(inout eg_headers_t hdr, inout eg_metadata_t meta,
                  in egress_intrinsic_metadata_t eg_intr_md,
                  in egress_intrinsic_metadata_from_parser_t eg_prsr_md,
                  inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md,
                  inout egress_intrinsic_metadata_for_output_port_t eg_oport_md) {
    action set_worker_addr(bit<48> worker_mac, bit<32> worker_ip, bit<16> worker_port,
                           bit<48> agg_mac, bit<32> agg_ip) {
        hdr.ethernet.srcAddr = agg_mac;
        hdr.ethernet.dstAddr = worker_mac;
        hdr.ipv4.srcAddr = agg_ip;
        hdr.ipv4.dstAddr = worker_ip;
        hdr.ipv4.ttl = 64;
        hdr.udp.srcPort = THC_UDP_PORT;
        hdr.udp.dstPort = worker_port;
    }
    action thc_addr_miss() {
        eg_dprsr_md.drop_ctl = 1;
    }
    // A RESULT whose use's last passes are not its count (thc_passes): one of them was lost
    // on the recirculation port. Dropped, each copy counted.
    Counter<bit<32>, bit<32>>(1, CounterType_t.PACKETS) thc_lost_passes;
    action thc_withhold() {
        thc_lost_passes.count(0);
        eg_dprsr_md.drop_ctl = 1;
    }
    table thc_withhold_op {
        actions = { thc_withhold; }
        const default_action = thc_withhold();
        size = 1;
    }
    // what the cell of a RESULT's use holds: its count plus one; any other reply passes
    action thc_want_result() { meta.want = hdr.thc.count + 1; }
    action thc_want_any() { meta.want = meta.passes; }
    table thc_want_op {
        key = { hdr.thc.pkt_type: exact; }
        actions = { thc_want_result; thc_want_any; }
        const entries = {
            THC_RESULT: thc_want_result();
            THC_MAX_RESULT: thc_want_result();
        }
        const default_action = thc_want_any();
        size = 2;
    }
    table thc_worker_addr {
        key = {
            hdr.thc.job_id: exact @name("job_id");
            hdr.thc.worker_id: exact @name("worker_id");
        }
        actions = { set_worker_addr; @defaultonly thc_addr_miss; }
        default_action = thc_addr_miss();
        size = THC_MAX_JOBS * THC_MAX_WORKERS;
    }

#include "generated/thc_tna_dup.p4"

    apply {
        if (hdr.dd[0].isValid()) {
            thc_dup_0();
            thc_dup_1();
            thc_dup_2();
        }
        if (hdr.bridge.recirc == 0) {
            if (hdr.bridge.is_reply == 1) {
                if (eg_intr_md.egress_rid != 0) {
                    hdr.thc.worker_id = (bit<8>)(eg_intr_md.egress_rid - 1);
                }
                meta.passes = (bit<8>)hdr.bridge.passes;
                thc_want_op.apply();
                if (meta.passes != meta.want) {
                    thc_withhold_op.apply();
                } else {
                    thc_worker_addr.apply();
                }
            }
            hdr.bridge.setInvalid();
        }
    }
}

control ThcEgressDeparser(packet_out pkt, inout eg_headers_t hdr, in eg_metadata_t meta,
                          in egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {
    Checksum() ipv4_checksum;
    apply {
        if (hdr.ipv4.isValid()) {
            hdr.ipv4.hdrChecksum = ipv4_checksum.update({
                hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.totalLen,
                hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.fragOffset, hdr.ipv4.ttl,
                hdr.ipv4.protocol, hdr.ipv4.srcAddr, hdr.ipv4.dstAddr });
        }
        pkt.emit(hdr);
    }
}

Pipeline(ThcIngressParser(), ThcIngress(), ThcIngressDeparser(),
         ThcEgressParser(), ThcEgress(), ThcEgressDeparser()) pipe;

Switch(pipe) main;
