/*
 * THC in-network aggregation for Tofino (P4_16, TNA), the variant of thc.p4 that the Tofino
 * back end of p4c compiles (`make p4-tofino`). Same wire protocol, same generated constants
 * and THC header, same table and action names as the BMv2 program, so controller/jobs.py
 * writes the same entries.
 *
 * Differences from thc.p4, all forced by the Tofino pipeline (12 stages, 4 stateful ALUs a
 * stage, gateways that compare a few bytes with constants):
 *  - the slot state is a chain of one stage per step: checks and the job's run (thc_check),
 *    the slot's run and seq (thc_run, thc_seq), the bitmap (thc_bitmap_op), the count and
 *    the lane operation (thc_count_op). Each step is a table keyed on what the earlier
 *    steps found, whose actions each execute one RegisterAction (Tofino addresses a
 *    register the same way in every action of a table, one stateful ALU operation per
 *    action); the lanes get the stages after it;
 *  - thc_run and thc_seq are both (run, seq) pairs updated alike: one answers "newer" (a new
 *    run, or a later seq), the other "not older", so the serial comparison takes one stage
 *    (a stateful ALU has two comparisons); the dup test (old bitmap & worker bit) is a
 *    ternary match on the old bitmap and the one-hot worker bit;
 *  - MAX lanes share the lane groups' word registers (four per group; a slot use holds sums
 *    or maxima, never both), so a packet has at most 4 max lanes per lane group;
 *  - a retransmission reads the lane words whether or not the use is complete; a PENDING
 *    reply (incomplete) drops them with the other lanes;
 *  - replies are rewritten for their worker in egress, which sees the ingress outcome
 *    through a bridged header; payload headers leave a reply by being invalidated.
 * DLCP's FLUSH, vote jobs and thc_dscp are in thc.p4 only. See docs/switch.md, "Tofino".
 */
#include <core.p4>
#include <tna.p4>

#include "generated/thc_constants.p4"
#include "generated/thc_headers.p4"
#include "thc_common.p4"

// Ingress -> egress, on every packet: whether it is a reply and to whom.
header thc_bridge_h {
    bit<7> pad;
    bit<1> is_reply;
    bit<8> dest_worker;     // destination of a unicast reply (multicast: egress_rid - 1)
}

// A slot version's run and last seq (thc_run and thc_seq hold the same pair).
struct thc_run_seq_t {
    bit<32> seq;
    bit<32> run;
}

// zero-initialised, as v1model metadata is
@pa_auto_init_metadata
struct metadata_t {
    thc_bridge_h bridge;      // always emitted: egress parses it first
    thc_max_h[4] no_max;      // the max lanes of a lane group that carries none (never valid)
    // from thc_job
    bit<8>  job_index;
    bit<8>  n_workers;
    bit<16> pool_base;
    bit<16> pool_size;
    bit<16> mcast_grp;
    bit<1>  wide;
    bit<32> epoch;
    bit<1>  job_hit;
    // from thc_worker
    bit<32> worker_bit;
    bit<1>  worker_hit;
    // addressing
    bit<16> slot_idx;       // pool_base + slot
    bit<8>  room8;          // n_workers - worker_id, saturating at 0
    bit<16> room16;         // pool_size - slot, saturating at 0
    bit<32> reg_index;      // (pool_base + slot) * 2 + version
    bit<32> jc_base;        // job_index * THC_N_JOB_COUNTERS
    bit<32> jc_index;
    // state as seen by this packet
    bit<1>  run_stale;      // older than the job's run
    bit<1>  seq_newer;      // a new run for the slot version, or a later seq
    bit<1>  seq_ok;         // not older than the slot version's seq
    bit<32> old_bitmap;
    bit<32> bitmap;
    bit<8>  count;
    bit<1>  dup;
    bit<2>  lane_op;        // THC_OP_*: what the lane words do (RESET: none)
    bit<1>  is_max;         // a MAX packet: the lane words hold maxima
    bit<1>  emit;           // the reply carries the lanes (RESULT, MAX_RESULT)
    bit<8>  drop_reason;
}

parser ThcIngressParser(packet_in pkt, out headers_t hdr, out metadata_t meta,
                        out ingress_intrinsic_metadata_t ig_intr_md) {
    ParserCounter() lanes_left;

    state start {
        pkt.extract(ig_intr_md);
        pkt.advance(PORT_METADATA_SIZE);
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.etherType) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }
    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.ihl, hdr.ipv4.fragOffset, hdr.ipv4.protocol) {
            (5, 0, IPPROTO_UDP): parse_udp;
            default: accept;
        }
    }
    state parse_udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dstPort) {
            THC_UDP_PORT: parse_thc;
            default: accept;
        }
    }
    state parse_thc {
        pkt.extract(hdr.thc);
        transition select(hdr.thc.pkt_type, hdr.udp.length) {
            (THC_DATA, THC_UDP_LEN_DATA): start_data;
            (THC_MAX, THC_UDP_LEN_MAX): start_max;
            default: accept;
        }
    }
    state start_data {
        lanes_left.set((bit<8>)THC_GROUPS);
        transition parse_data;
    }
    state parse_data {
        pkt.extract(hdr.thc_data.next);
        lanes_left.decrement(1);
        transition select(lanes_left.is_zero()) {
            true: accept;
            false: parse_data;
        }
    }
    state start_max {
        lanes_left.set((bit<8>)THC_MAX_LANES);
        transition parse_max;
    }
    state parse_max {
        pkt.extract(hdr.thc_max.next);
        lanes_left.decrement(1);
        transition select(lanes_left.is_zero()) {
            true: accept;
            false: parse_max;
        }
    }
}

/*
 * One lane group (8 lanes), as in thc.p4: byte-keyed lookups return the lanes' values
 * packed for the job's width; four 32-bit word registers, of which an 8-bit job uses two.
 * A group built with has_max also holds four max lanes (MAX packets) in the same words.
 * thc_word_op_K picks, from the lane operation, the packet type and the width, the action
 * that executes one RegisterAction on word K and writes what it returns into the reply.
 */
control ThcLaneGroup(inout thc_idx_h idx, inout thc_sum8_h r8, inout thc_sum16_h r16,
                     inout thc_max_h m0, inout thc_max_h m1, inout thc_max_h m2,
                     inout thc_max_h m3, in bit<16> job_id, in bit<1> is_max,
                     in bit<32> reg_index, in bit<2> op, in bit<1> wide, in bit<8> drop_reason,
                     in bit<1> emit)(bool has_max) {
    Register<bit<32>, bit<32>>(THC_REG_SIZE) thc_sum_0;
    Register<bit<32>, bit<32>>(THC_REG_SIZE) thc_sum_1;
    Register<bit<32>, bit<32>>(THC_REG_SIZE) thc_sum_2;
    Register<bit<32>, bit<32>>(THC_REG_SIZE) thc_sum_3;
    bit<32> v0 = 0;
    bit<32> v1 = 0;
    bit<32> v2 = 0;
    bit<32> v3 = 0;

    action thc_lut_set_0(bit<32> value) { v0 = value; }
    action thc_lut_set_1(bit<32> value) { v1 = value; }
    action thc_lut_set_2(bit<32> value) { v2 = value; }
    // the same action names as thc.p4 (one per width, picked by the controller); here the
    // words are added by thc_word_op's RegisterActions
    action thc_lut_sum8(bit<32> value) { v3 = value; }
    action thc_lut_sum16(bit<32> value) { v3 = value; }
    table thc_lut_0 {
        key = { job_id: exact @name("job_id"); idx.b0: exact @name("idx"); }
        actions = { thc_lut_set_0; }
        default_action = thc_lut_set_0(0);
        size = THC_LUT_SIZE;
    }
    table thc_lut_1 {
        key = { job_id: exact @name("job_id"); idx.b1: exact @name("idx"); }
        actions = { thc_lut_set_1; }
        default_action = thc_lut_set_1(0);
        size = THC_LUT_SIZE;
    }
    table thc_lut_2 {
        key = { job_id: exact @name("job_id"); idx.b2: exact @name("idx"); }
        actions = { thc_lut_set_2; }
        default_action = thc_lut_set_2(0);
        size = THC_LUT_SIZE;
    }
    table thc_lut_3 {
        key = { job_id: exact @name("job_id"); idx.b3: exact @name("idx"); }
        actions = { thc_lut_sum8; thc_lut_sum16; }
        default_action = thc_lut_sum8(0);
        size = THC_LUT_SIZE;
    }

    // word K: the write, add, read (sums) and max RegisterActions on register K
#define THC_WORD_ACTIONS(K)                                                                   \
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_sum_##K) thc_write_##K = {                  \
        void apply(inout bit<32> value, out bit<32> rv) { value = v##K; rv = value; }         \
    };                                                                                        \
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_sum_##K) thc_add_##K = {                    \
        void apply(inout bit<32> value, out bit<32> rv) { value = value + v##K; rv = value; } \
    };                                                                                        \
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_sum_##K) thc_read_##K = {                   \
        void apply(inout bit<32> value, out bit<32> rv) { rv = value; }                       \
    };                                                                                        \
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_sum_##K) thc_max_##K = {                    \
        void apply(inout bit<32> value, out bit<32> rv) {                                     \
            if (v##K > value) {                                                               \
                value = v##K;                                                                 \
            }                                                                                 \
            rv = value;                                                                       \
        }                                                                                     \
    };                                                                                        \
    action thc_write16_word_##K() { r16.w##K = thc_write_##K.execute(reg_index); }           \
    action thc_add16_word_##K() { r16.w##K = thc_add_##K.execute(reg_index); }               \
    action thc_read16_word_##K() { r16.w##K = thc_read_##K.execute(reg_index); }             \
    action thc_max_write_word_##K() { m##K.v = thc_write_##K.execute(reg_index); }           \
    action thc_max_word_##K() { m##K.v = thc_max_##K.execute(reg_index); }                   \
    action thc_max_read_word_##K() { m##K.v = thc_read_##K.execute(reg_index); }
    THC_WORD_ACTIONS(0)
    THC_WORD_ACTIONS(1)
    THC_WORD_ACTIONS(2)
    THC_WORD_ACTIONS(3)
#undef THC_WORD_ACTIONS
    // an 8-bit job's two words (lanes packed four a word)
#define THC_WORD8_ACTIONS(K)                                                                  \
    action thc_write8_word_##K() { r8.w##K = thc_write_##K.execute(reg_index); }             \
    action thc_add8_word_##K() { r8.w##K = thc_add_##K.execute(reg_index); }                 \
    action thc_read8_word_##K() { r8.w##K = thc_read_##K.execute(reg_index); }
    THC_WORD8_ACTIONS(0)
    THC_WORD8_ACTIONS(1)
#undef THC_WORD8_ACTIONS

    // One table per word register, each action running one RegisterAction.
#define THC_MAX_ENTRIES(K)                                                                    \
            (THC_OP_WRITE, 1, 0): thc_max_write_word_##K();                                   \
            (THC_OP_WRITE, 1, 1): thc_max_write_word_##K();                                   \
            (THC_OP_ADD, 1, 0): thc_max_word_##K();                                           \
            (THC_OP_ADD, 1, 1): thc_max_word_##K();                                           \
            (THC_OP_READ, 1, 0): thc_max_read_word_##K();                                     \
            (THC_OP_READ, 1, 1): thc_max_read_word_##K();
#define THC_WORD16_ENTRIES(K)                                                                 \
            (THC_OP_WRITE, 0, 1): thc_write16_word_##K();                                     \
            (THC_OP_ADD, 0, 1): thc_add16_word_##K();                                         \
            (THC_OP_READ, 0, 1): thc_read16_word_##K();
#define THC_WORD8_ENTRIES(K)                                                                  \
            (THC_OP_WRITE, 0, 0): thc_write8_word_##K();                                      \
            (THC_OP_ADD, 0, 0): thc_add8_word_##K();                                          \
            (THC_OP_READ, 0, 0): thc_read8_word_##K();
    table thc_word_op_0 {
        key = { op: exact; is_max: exact; wide: exact; }
        actions = {
            thc_write8_word_0; thc_add8_word_0; thc_read8_word_0;
            thc_write16_word_0; thc_add16_word_0; thc_read16_word_0;
            thc_max_write_word_0; thc_max_word_0; thc_max_read_word_0; NoAction;
        }
        const entries = { THC_WORD8_ENTRIES(0) THC_WORD16_ENTRIES(0) THC_MAX_ENTRIES(0) }
        const default_action = NoAction;
        size = 16;
    }
    table thc_word_op_1 {
        key = { op: exact; is_max: exact; wide: exact; }
        actions = {
            thc_write8_word_1; thc_add8_word_1; thc_read8_word_1;
            thc_write16_word_1; thc_add16_word_1; thc_read16_word_1;
            thc_max_write_word_1; thc_max_word_1; thc_max_read_word_1; NoAction;
        }
        const entries = { THC_WORD8_ENTRIES(1) THC_WORD16_ENTRIES(1) THC_MAX_ENTRIES(1) }
        const default_action = NoAction;
        size = 16;
    }
    // words 2 and 3: 16-bit jobs and max lanes only
#define THC_WORD_TABLE_HI(K)                                                                  \
    table thc_word_op_##K {                                                                   \
        key = { op: exact; is_max: exact; wide: exact; }                                    \
        actions = {                                                                           \
            thc_write16_word_##K; thc_add16_word_##K; thc_read16_word_##K;                    \
            thc_max_write_word_##K; thc_max_word_##K; thc_max_read_word_##K; NoAction;        \
        }                                                                                     \
        const entries = { THC_WORD16_ENTRIES(K) THC_MAX_ENTRIES(K) }                          \
        const default_action = NoAction;                                                      \
        size = 16;                                                                            \
    }
    THC_WORD_TABLE_HI(2)
    THC_WORD_TABLE_HI(3)
#undef THC_WORD_TABLE_HI
#undef THC_MAX_ENTRIES
#undef THC_WORD16_ENTRIES
#undef THC_WORD8_ENTRIES

    apply {
        // lookups and packing depend on the packet only: they run in the early stages,
        // beside the slot state
        if (is_max == 0) {
            thc_lut_0.apply();
            thc_lut_1.apply();
            thc_lut_2.apply();
            thc_lut_3.apply();
            if (wide == 0) {
                v0 = v0 | v1;
                v1 = v2 | v3;
            }
        } else if (has_max) {
            v0 = m0.v;
            v1 = m1.v;
            v2 = m2.v;
            v3 = m3.v;
        }
        if (drop_reason == 0) {
            if (is_max == 0 || has_max) {
                thc_word_op_0.apply();
                thc_word_op_1.apply();
                thc_word_op_2.apply();
                thc_word_op_3.apply();
            }
        }
        if (emit == 1) {
            if (is_max == 0) {
                if (wide == 0) {
                    r8.setValid();
                } else {
                    r16.setValid();
                }
            }
        } else if (has_max) {
            m0.setInvalid();
            m1.setInvalid();
            m2.setInvalid();
            m3.setInvalid();
        }
        idx.setInvalid();
    }
}

#include "generated/thc_tna_pragmas.p4"
control ThcIngress(inout headers_t hdr, inout metadata_t meta,
                   in ingress_intrinsic_metadata_t ig_intr_md,
                   in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                   inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                   inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    Counter<bit<32>, bit<32>>(THC_N_DROP_REASONS, CounterType_t.PACKETS) thc_drops;
    Counter<bit<32>, bit<32>>(THC_MAX_JOBS * THC_N_JOB_COUNTERS, CounterType_t.PACKETS)
        thc_job_counters;
    Counter<bit<32>, bit<32>>(THC_MAX_JOBS, CounterType_t.PACKETS) thc_resets;
    Counter<bit<32>, bit<32>>(1, CounterType_t.PACKETS) l2_misses;

    Register<bit<32>, bit<32>>(THC_MAX_JOBS) thc_job_run;
    Register<thc_run_seq_t, bit<32>>(THC_REG_SIZE) thc_run;
    Register<thc_run_seq_t, bit<32>>(THC_REG_SIZE) thc_seq;
    Register<bit<32>, bit<32>>(THC_REG_SIZE) thc_bitmap;
    Register<bit<8>, bit<32>>(THC_REG_SIZE) thc_count;

    // RFC 1982: the first run, or one not older than the job's, takes the job.
    RegisterAction<bit<32>, bit<32>, bit<1>>(thc_job_run) thc_job_run_ra = {
        void apply(inout bit<32> value, out bit<1> stale) {
            if (value == 0 || (int<32>)(hdr.thc.run - value) >= 0) {
                value = hdr.thc.run;
                stale = 0;
            } else {
                stale = 1;
            }
        }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_job_run) thc_job_run_reset = {
        void apply(inout bit<32> value) { value = 0; }
    };
    // A run other than the slot version's last one starts a new use whatever its seq; in
    // the same run a later seq (RFC 1982) does. thc_run answers "newer", thc_seq "not older"
    // (newer or equal); both take (run, seq) when it is not older, so they stay equal.
    RegisterAction<thc_run_seq_t, bit<32>, bit<1>>(thc_run) thc_run_ra = {
        void apply(inout thc_run_seq_t value, out bit<1> newer) {
            if (value.run != hdr.thc.run || (int<32>)(hdr.thc.seq - value.seq) > 0) {
                value.run = hdr.thc.run;
                value.seq = hdr.thc.seq;
                newer = 1;
            } else {
                newer = 0;
            }
        }
    };
    RegisterAction<thc_run_seq_t, bit<32>, bit<1>>(thc_seq) thc_seq_ra = {
        void apply(inout thc_run_seq_t value, out bit<1> not_older) {
            if (value.run != hdr.thc.run || (int<32>)(hdr.thc.seq - value.seq) >= 0) {
                value.run = hdr.thc.run;
                value.seq = hdr.thc.seq;
                not_older = 1;
            } else {
                not_older = 0;
            }
        }
    };
    RegisterAction<thc_run_seq_t, bit<32>, bit<1>>(thc_run) thc_run_reset = {
        void apply(inout thc_run_seq_t value) {
            value.run = 0;
            value.seq = THC_SEQ_RESET;
        }
    };
    RegisterAction<thc_run_seq_t, bit<32>, bit<1>>(thc_seq) thc_seq_reset = {
        void apply(inout thc_run_seq_t value) {
            value.run = 0;
            value.seq = THC_SEQ_RESET;
        }
    };
    // the bitmap before this packet; a new use starts with the sender's bit alone
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_bitmap) thc_bitmap_new = {
        void apply(inout bit<32> value, out bit<32> old) {
            old = value;
            value = meta.worker_bit;
        }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_bitmap) thc_bitmap_ra = {
        void apply(inout bit<32> value, out bit<32> old) {
            old = value;
            value = value | meta.worker_bit;
        }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_bitmap) thc_bitmap_reset = {
        void apply(inout bit<32> value) { value = 0; }
    };
    RegisterAction<bit<8>, bit<32>, bit<8>>(thc_count) thc_count_first = {
        void apply(inout bit<8> value, out bit<8> count) {
            value = 1;
            count = value;
        }
    };
    RegisterAction<bit<8>, bit<32>, bit<8>>(thc_count) thc_count_ra = {
        void apply(inout bit<8> value, out bit<8> count) {
            value = value + 1;
            count = value;
        }
    };
    RegisterAction<bit<8>, bit<32>, bit<8>>(thc_count) thc_count_read = {
        void apply(inout bit<8> value, out bit<8> count) { count = value; }
    };
    RegisterAction<bit<8>, bit<32>, bit<8>>(thc_count) thc_count_reset = {
        void apply(inout bit<8> value) { value = 0; }
    };

#include "generated/thc_tna_groups.p4"

    action set_job(bit<8> job_index, bit<8> n_workers, bit<16> pool_base, bit<16> pool_size,
                   bit<32> full_bitmap, bit<16> mcast_grp, bit<8> sum_bits, bit<32> epoch,
                   bit<8> aggregation) {
        meta.job_index = job_index;
        meta.n_workers = n_workers;
        meta.pool_base = pool_base;
        meta.pool_size = pool_size;
        meta.mcast_grp = mcast_grp;
        meta.wide = (bit<1>)(sum_bits >> 4);
        meta.epoch = epoch;
        meta.job_hit = 1;
    }
    table thc_job {
        key = { hdr.thc.job_id: exact @name("job_id"); }
        actions = { set_job; @defaultonly NoAction; }
        default_action = NoAction();
        size = THC_MAX_JOBS;
    }

    action set_worker(bit<32> worker_bit) {
        meta.worker_bit = worker_bit;
        meta.worker_hit = 1;
    }
    table thc_worker {
        key = {
            hdr.thc.job_id: exact @name("job_id");
            hdr.thc.worker_id: exact @name("worker_id");
            hdr.ipv4.srcAddr: exact @name("src_ip");
            hdr.udp.srcPort: exact @name("src_port");
        }
        actions = { set_worker; @defaultonly NoAction; }
        default_action = NoAction();
        size = THC_MAX_JOBS * THC_MAX_WORKERS;
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

    // one ALU operation per field
    action thc_slot() {
        meta.slot_idx = meta.pool_base + hdr.thc.slot;
        meta.room8 = meta.n_workers |-| hdr.thc.worker_id;
        meta.room16 = meta.pool_size |-| hdr.thc.slot;
        meta.jc_base = 22w0 ++ meta.job_index ++ 2w0;  // x THC_N_JOB_COUNTERS (4)
    }
    action thc_index() {
        meta.reg_index = 15w0 ++ meta.slot_idx ++ hdr.thc.version[0:0];
    }

    // Steps 2-6 of thc.p4 (the header checks of step 1 are gateways), in its order, and
    // the job's run: a RESET clears it, any other packet that passes is checked against it.
    action thc_set_drop(bit<8> reason) {
        meta.drop_reason = reason;
    }
    action thc_job_run_check() {
        meta.run_stale = thc_job_run_ra.execute((bit<32>)meta.job_index);
    }
    action thc_job_run_clear() {
        thc_job_run_reset.execute((bit<32>)meta.job_index);
    }
    table thc_check {
        key = {
            meta.drop_reason: ternary;
            meta.job_hit: ternary;
            hdr.thc.pkt_type: ternary;
            hdr.thc_data[0].isValid(): ternary;
            hdr.thc_max[0].isValid(): ternary;
            hdr.udp.length: ternary;
            meta.room8: ternary;
            meta.worker_hit: ternary;
            meta.room16: ternary;
        }
        actions = { thc_set_drop; thc_job_run_check; thc_job_run_clear; NoAction; }
        const entries = {
            (0, 0, _, _, _, _, _, _, _): thc_set_drop(THC_DROP_UNKNOWN_JOB);
            (0, 1, THC_DATA, false, _, _, _, _, _): thc_set_drop(THC_DROP_BAD_LANES);
            (0, 1, THC_MAX, _, false, _, _, _, _): thc_set_drop(THC_DROP_BAD_LANES);
            (0, 1, THC_RESET, _, _, THC_UDP_LEN_HDR, _, _, 0):
                thc_set_drop(THC_DROP_SLOT_OUTSIDE_POOL);
            (0, 1, THC_RESET, _, _, THC_UDP_LEN_HDR, _, _, _): thc_job_run_clear();
            (0, 1, THC_RESET, _, _, _, _, _, _): thc_set_drop(THC_DROP_BAD_LANES);
            (0, 1, _, _, _, _, 0, _, _): thc_set_drop(THC_DROP_WORKER_OUTSIDE_JOB);
            (0, 1, _, _, _, _, _, 0, _): thc_set_drop(THC_DROP_UNKNOWN_WORKER);
            (0, 1, _, _, _, _, _, _, 0): thc_set_drop(THC_DROP_SLOT_OUTSIDE_POOL);
            (0, 1, _, _, _, _, _, _, _): thc_job_run_check();
        }
        const default_action = NoAction;
        size = 16;
    }

    // Step 7-8: the slot version's run and seq.
    action thc_run_check() {
        meta.seq_newer = thc_run_ra.execute(meta.reg_index);
    }
    action thc_run_clear() {
        thc_run_reset.execute(meta.reg_index);
    }
    table thc_run_op {
        key = {
            meta.drop_reason: ternary;
            hdr.thc.pkt_type: ternary;
            meta.run_stale: ternary;
        }
        actions = { thc_run_check; thc_run_clear; thc_set_drop; NoAction; }
        const entries = {
            (0, THC_RESET, _): thc_run_clear();
            (0, _, 1): thc_set_drop(THC_DROP_STALE_RUN);
            (0, _, 0): thc_run_check();
        }
        const default_action = NoAction;
        size = 4;
    }
    action thc_seq_check() {
        meta.seq_ok = thc_seq_ra.execute(meta.reg_index);
    }
    action thc_seq_clear() {
        thc_seq_reset.execute(meta.reg_index);
    }
    table thc_seq_op {
        key = {
            meta.drop_reason: ternary;
            hdr.thc.pkt_type: ternary;
            meta.run_stale: ternary;
        }
        actions = { thc_seq_check; thc_seq_clear; NoAction; }
        const entries = {
            (0, THC_RESET, _): thc_seq_clear();
            (0, _, 0): thc_seq_check();
        }
        const default_action = NoAction;
        size = 4;
    }

    // The bitmap: a newer use starts from the sender's bit, an equal one adds it, an older
    // seq is stale.
    action thc_bitmap_start() {
        meta.old_bitmap = thc_bitmap_new.execute(meta.reg_index);
    }
    action thc_bitmap_add() {
        meta.old_bitmap = thc_bitmap_ra.execute(meta.reg_index);
    }
    action thc_bitmap_clear() {
        thc_bitmap_reset.execute(meta.reg_index);
    }
    table thc_bitmap_op {
        key = {
            meta.drop_reason: ternary;
            hdr.thc.pkt_type: ternary;
            meta.seq_newer: ternary;
            meta.seq_ok: ternary;
        }
        actions = { thc_bitmap_start; thc_bitmap_add; thc_bitmap_clear; thc_set_drop; NoAction; }
        const entries = {
            (0, THC_RESET, _, _): thc_bitmap_clear();
            (0, _, 1, _): thc_bitmap_start();
            (0, _, 0, 1): thc_bitmap_add();
            (0, _, 0, 0): thc_set_drop(THC_DROP_STALE);
        }
        const default_action = NoAction;
        size = 8;
    }

    // The count and the lane operation: first contribution of a use (a newer use, or an
    // empty bitmap): write; the sender's bit already set: a retransmission, read; else add.
    action thc_count_start() {
        meta.count = thc_count_first.execute(meta.reg_index);
        meta.bitmap = meta.worker_bit;
        meta.lane_op = THC_OP_WRITE;
    }
    action thc_count_add() {
        meta.count = thc_count_ra.execute(meta.reg_index);
        meta.bitmap = meta.old_bitmap | meta.worker_bit;
        meta.lane_op = THC_OP_ADD;
    }
    action thc_count_dup() {
        meta.count = thc_count_read.execute(meta.reg_index);
        meta.bitmap = meta.old_bitmap;
        meta.dup = 1;
        meta.lane_op = THC_OP_READ;
    }
    action thc_count_clear() {
        thc_count_reset.execute(meta.reg_index);
        meta.lane_op = THC_OP_NONE;
        thc_resets.count((bit<32>)meta.job_index);
        ig_dprsr_md.drop_ctl = 1;
    }
    // worker_bit is one-hot (1 << worker_id): the sender's bit set in the old bitmap
#define THC_DUP(W) (0, _, 0, 32w1 << W, (32w1 << W) &&& (32w1 << W)): thc_count_dup();
    table thc_count_op {
        key = {
            meta.drop_reason: ternary;
            hdr.thc.pkt_type: ternary;
            meta.seq_newer: ternary;
            meta.worker_bit: ternary;
            meta.old_bitmap: ternary;
        }
        actions = { thc_count_start; thc_count_add; thc_count_dup; thc_count_clear; NoAction; }
        const entries = {
            (0, THC_RESET, _, _, _): thc_count_clear();
            (0, _, 1, _, _): thc_count_start();
            THC_DUP(0) THC_DUP(1) THC_DUP(2) THC_DUP(3) THC_DUP(4) THC_DUP(5) THC_DUP(6)
            THC_DUP(7) THC_DUP(8) THC_DUP(9) THC_DUP(10) THC_DUP(11) THC_DUP(12) THC_DUP(13)
            THC_DUP(14) THC_DUP(15) THC_DUP(16) THC_DUP(17) THC_DUP(18) THC_DUP(19)
            THC_DUP(20) THC_DUP(21) THC_DUP(22) THC_DUP(23) THC_DUP(24) THC_DUP(25)
            THC_DUP(26) THC_DUP(27) THC_DUP(28) THC_DUP(29) THC_DUP(30) THC_DUP(31)
            (0, _, 0, _, 0): thc_count_start();
            (0, _, 0, _, _): thc_count_add();
        }
        const default_action = NoAction;
        size = 64;
    }
#undef THC_DUP

    action thc_reply(bit<8> pkt_type) {
        hdr.thc.pkt_type = pkt_type;
        hdr.thc.count = meta.count;
        hdr.thc.bitmap = meta.bitmap;
        hdr.thc.epoch = meta.epoch;
        hdr.udp.checksum = 0;
        meta.bridge.is_reply = 1;
    }
    action thc_len(bit<16> udp_len, bit<16> ip_len) {
        hdr.udp.length = udp_len;
        hdr.ipv4.totalLen = ip_len;
    }
    action thc_to_sender(bit<32> jc_event) {
        ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port;
        meta.bridge.dest_worker = hdr.thc.worker_id;
        meta.jc_index = meta.jc_base | jc_event;  // jc_event < 4: the low bits
    }
    action thc_to_job() {
        ig_tm_md.mcast_grp_a = meta.mcast_grp;
        meta.jc_index = meta.jc_base | THC_JC_COMPLETIONS;
    }
    action thc_consume() {
        ig_dprsr_md.drop_ctl = 1;
        meta.jc_index = meta.jc_base | THC_JC_PACKETS;
    }
    action thc_drop() {
        ig_dprsr_md.drop_ctl = 1;
    }

    apply {
        meta.bridge.setValid();
        meta.bridge.is_reply = 0;
        if (hdr.udp.isValid() && hdr.udp.dstPort == THC_UDP_PORT) {
            // 1. well-formed, right direction: one small condition per gateway
            if (!hdr.thc.isValid()) {
                meta.drop_reason = THC_DROP_MALFORMED;
            } else if (ig_prsr_md.parser_err != 0) {
                meta.drop_reason = THC_DROP_MALFORMED;
            } else if (hdr.udp.length[15:5] == 0 || hdr.udp.length[15:2] == 8) {
                // udp.length < THC_UDP_LEN_HDR (36) as two masked comparisons
                meta.drop_reason = THC_DROP_MALFORMED;
            } else if (!(THC_KNOWN_TYPE(hdr.thc.pkt_type))) {
                meta.drop_reason = THC_DROP_MALFORMED;
            } else if (hdr.thc.version > 1) {
                meta.drop_reason = THC_DROP_MALFORMED;
            } else if (hdr.thc.pkt_type == THC_FLUSH) {
                // FLUSH (DLCP's bounded loss) is implemented in thc.p4 only: dropped here
                meta.drop_reason = THC_DROP_MALFORMED;
            } else if (THC_REPLY_TYPE(hdr.thc.pkt_type)) {
                meta.drop_reason = THC_DROP_WRONG_DIRECTION;
            } else if (hdr.thc.pkt_type == THC_RESET && ig_intr_md.ingress_port != THC_CPU_PORT) {
                meta.drop_reason = THC_DROP_NOT_FROM_CPU;
            } else if (hdr.thc.pkt_type != THC_RESET && hdr.thc.run == 0) {
                meta.drop_reason = THC_DROP_MALFORMED;
            }
            // the lookups of steps 2-5 on every THC packet, their verdicts in thc_check
            thc_job.apply();
            thc_worker.apply();
            if (hdr.thc.pkt_type == THC_MAX) {
                meta.is_max = 1;
            }
            thc_slot();
            thc_index();
            thc_check.apply();
            // thc_seq_op first: it reads drop_reason before thc_run_op may set it (stale run),
            // so both run in one stage; its entries skip a stale run themselves
            thc_seq_op.apply();
            thc_run_op.apply();
            thc_bitmap_op.apply();
            thc_count_op.apply();
#include "generated/thc_tna_groups_apply.p4"
            if (meta.drop_reason == 0 && hdr.thc.pkt_type != THC_RESET) {
                if (meta.count == meta.n_workers) {
                    // complete: RESULT / MAX_RESULT with the stored lanes
                    meta.emit = 1;
                    if (hdr.thc.pkt_type == THC_DATA) {
                        if (meta.wide == 1) {
                            thc_len(THC_UDP_LEN_RESULT16, THC_UDP_LEN_RESULT16 + 20);
                        } else {
                            thc_len(THC_UDP_LEN_RESULT8, THC_UDP_LEN_RESULT8 + 20);
                        }
                        thc_reply(THC_RESULT);
                    } else {
                        thc_len(THC_UDP_LEN_MAX, THC_UDP_LEN_MAX + 20);
                        thc_reply(THC_MAX_RESULT);
                    }
                    if (meta.dup == 1) {
                        thc_to_sender(THC_JC_RETRANSMISSIONS);
                    } else {
                        thc_to_job();
                    }
                } else if (meta.dup == 1) {
                    // retransmission of an incomplete slot: tell the worker where it stands
                    thc_len(THC_UDP_LEN_HDR, THC_UDP_LEN_HDR + 20);
                    thc_reply(THC_PENDING);
                    thc_to_sender(THC_JC_PENDING);
                } else {
                    thc_consume();  // consumed, waiting for the other workers
                }
                thc_job_counters.count(meta.jc_index);
            }
            if (meta.drop_reason != 0) {
                thc_drops.count((bit<32>)meta.drop_reason);
                thc_drop();
            }
        } else if (hdr.ethernet.isValid()) {
            l2_forward.apply();
        }
    }
}

control ThcIngressDeparser(packet_out pkt, inout headers_t hdr, in metadata_t meta,
                           in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    apply {
        pkt.emit(meta.bridge);
        pkt.emit(hdr);
    }
}

// Egress sees the bridged header and the packet up to the THC header; lanes pass as payload.
struct eg_headers_t {
    thc_bridge_h bridge;
    ethernet_h   ethernet;
    ipv4_h       ipv4;
    udp_h        udp;
    thc_h        thc;
}

struct eg_metadata_t {
}

parser ThcEgressParser(packet_in pkt, out eg_headers_t hdr, out eg_metadata_t meta,
                       out egress_intrinsic_metadata_t eg_intr_md) {
    state start {
        pkt.extract(eg_intr_md);
        pkt.extract(hdr.bridge);
        transition select(hdr.bridge.is_reply) {
            1: parse_reply;
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
    table thc_worker_addr {
        key = {
            hdr.thc.job_id: exact @name("job_id");
            hdr.thc.worker_id: exact @name("worker_id");
        }
        actions = { set_worker_addr; @defaultonly thc_addr_miss; }
        default_action = thc_addr_miss();
        size = THC_MAX_JOBS * THC_MAX_WORKERS;
    }

    apply {
        if (hdr.bridge.is_reply == 1) {
            if (eg_intr_md.egress_rid != 0) {
                hdr.thc.worker_id = (bit<8>)(eg_intr_md.egress_rid - 1);
            } else {
                hdr.thc.worker_id = hdr.bridge.dest_worker;
            }
            thc_worker_addr.apply();
        }
        hdr.bridge.setInvalid();
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
