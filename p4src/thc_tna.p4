/*
 * THC in-network aggregation for Tofino (P4_16, TNA), the variant of thc.p4 that the Tofino
 * back end of p4c compiles (`make p4-tofino`). Same wire protocol, same generated files
 * (constants, THC header, lane group instantiations), same table and action names as the
 * BMv2 program, so controller/jobs.py writes the same entries.
 *
 * Differences from thc.p4, all forced by the Tofino pipeline:
 *  - every register is read and written through RegisterActions; a register has several
 *    (write, add, read, reset) and each packet executes at most one of them, picked by a
 *    table on the lane operation (lane groups) or by the control flow (slot state);
 *  - each RegisterAction returns one value; comparisons the stateful ALU cannot make
 *    (serial order of sequence numbers) are made on the returned old value;
 *  - replies are rewritten for their worker in egress, which sees the ingress outcome
 *    through a bridged header;
 *  - payload headers are dropped from a reply by invalidating them in the lane controls
 *    (no header stack pop).
 * Not compiled in this repository yet: see docs/switch.md, "Tofino".
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

// zero-initialised, as v1model metadata is
@pa_auto_init_metadata
struct metadata_t {
    thc_bridge_h bridge;      // always emitted: egress parses it first
    // from thc_job
    bit<8>  job_index;
    bit<8>  n_workers;
    bit<16> pool_base;
    bit<16> pool_size;
    bit<32> full_bitmap;
    bit<16> mcast_grp;
    bit<1>  wide;
    bit<32> epoch;
    // from thc_worker
    bit<32> worker_bit;
    // state as seen by this packet
    bit<16> slot_idx;       // pool_base + slot
    bit<8>  room8;          // n_workers - worker_id, saturating at 0
    bit<16> room16;         // pool_size - slot, saturating at 0
    bit<32> mine;           // old_bitmap & worker_bit
    bit<32> reg_index;
    bit<32> jc_index;
    bit<1>  run_stale;
    bit<1>  run_new;
    bit<32> old_seq;
    bit<32> seq_diff;
    bit<1>  seq_newer;
    bit<32> old_bitmap;
    bit<32> bitmap;
    bit<8>  count;
    bit<1>  dup;
    bit<1>  first;
    bit<2>  lane_op;
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
 * thc_word_op picks, from the lane operation and the width, the one action that executes
 * one RegisterAction on each register the packet needs.
 */
control ThcLaneGroup(inout thc_idx_h idx, inout thc_sum8_h r8, inout thc_sum16_h r16,
                     in bit<16> job_id, in bit<32> reg_index, in bit<2> op, in bit<1> wide) {
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

#define THC_WORD_ACTIONS(K, V)                                                              \
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_sum_##K) thc_write_##K = {                  \
        void apply(inout bit<32> value, out bit<32> rv) { value = V; rv = value; }            \
    };                                                                                        \
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_sum_##K) thc_add_##K = {                    \
        void apply(inout bit<32> value, out bit<32> rv) { value = value + V; rv = value; }    \
    };                                                                                        \
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_sum_##K) thc_read_##K = {                   \
        void apply(inout bit<32> value, out bit<32> rv) { rv = value; }                       \
    };
    THC_WORD_ACTIONS(0, v0)
    THC_WORD_ACTIONS(1, v1)
    THC_WORD_ACTIONS(2, v2)
    THC_WORD_ACTIONS(3, v3)
#undef THC_WORD_ACTIONS

    // One table per word register, each action running one RegisterAction: Tofino takes
    // one stateful ALU operation per action, and addresses a register the same way in every
    // action of a table. Words 2-3 only for 16-bit jobs.
    bit<32> o0 = 0;
    bit<32> o1 = 0;
    bit<32> o2 = 0;
    bit<32> o3 = 0;
#define THC_WORD_TABLE(K)                                                                     \
    action thc_write_word_##K() { o##K = thc_write_##K.execute(reg_index); }                  \
    action thc_add_word_##K() { o##K = thc_add_##K.execute(reg_index); }                      \
    action thc_read_word_##K() { o##K = thc_read_##K.execute(reg_index); }                    \
    table thc_word_op_##K {                                                                   \
        key = { op: exact; }                                                                  \
        actions = { thc_write_word_##K; thc_add_word_##K; thc_read_word_##K; NoAction; }      \
        const entries = {                                                                     \
            THC_OP_WRITE: thc_write_word_##K();                                               \
            THC_OP_ADD: thc_add_word_##K();                                                   \
            THC_OP_READ: thc_read_word_##K();                                                 \
        }                                                                                     \
        const default_action = NoAction;                                                      \
        size = 4;                                                                             \
    }
    THC_WORD_TABLE(0)
    THC_WORD_TABLE(1)
    THC_WORD_TABLE(2)
    THC_WORD_TABLE(3)
#undef THC_WORD_TABLE

    apply {
        if (op == THC_OP_WRITE || op == THC_OP_ADD) {
            thc_lut_0.apply();
            thc_lut_1.apply();
            thc_lut_2.apply();
            thc_lut_3.apply();
            if (wide == 0) {
                v0 = v0 | v1;
                v1 = v2 | v3;
            }
        }
        thc_word_op_0.apply();
        thc_word_op_1.apply();
        if (op != THC_OP_NONE) {
            if (wide == 0) {
                r8.setValid();
                r8.w0 = o0;
                r8.w1 = o1;
            } else {
                thc_word_op_2.apply();
                thc_word_op_3.apply();
                r16.setValid();
                r16.w0 = o0;
                r16.w1 = o1;
                r16.w2 = o2;
                r16.w3 = o3;
            }
        }
        idx.setInvalid();
    }
}

/* One MAX lane: write, max or read of a 32-bit register; NONE drops the lane from a reply. */
control ThcMaxLane(inout thc_max_h m, in bit<32> reg_index, in bit<2> op) {
    Register<bit<32>, bit<32>>(THC_REG_SIZE) thc_max;
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_max) thc_max_write = {
        void apply(inout bit<32> value, out bit<32> rv) { value = m.v; rv = value; }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_max) thc_max_max = {
        void apply(inout bit<32> value, out bit<32> rv) {
            if (m.v > value) {
                value = m.v;
            }
            rv = value;
        }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_max) thc_max_read = {
        void apply(inout bit<32> value, out bit<32> rv) { rv = value; }
    };
    apply {
        if (op == THC_OP_WRITE) {
            m.v = thc_max_write.execute(reg_index);
        } else if (op == THC_OP_ADD) {
            m.v = thc_max_max.execute(reg_index);
        } else if (op == THC_OP_READ) {
            m.v = thc_max_read.execute(reg_index);
        } else {
            m.setInvalid();
        }
    }
}

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
    Register<bit<32>, bit<32>>(THC_REG_SIZE) thc_run;
    Register<bit<32>, bit<32>>(THC_REG_SIZE) thc_seq;
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
    RegisterAction<bit<32>, bit<32>, bit<1>>(thc_run) thc_run_ra = {
        void apply(inout bit<32> value, out bit<1> is_new) {
            if (value != hdr.thc.run) {
                value = hdr.thc.run;
                is_new = 1;
            } else {
                is_new = 0;
            }
        }
    };
    // returns the old seq; the serial order is judged on it outside the stateful ALU
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_seq) thc_seq_ra = {
        void apply(inout bit<32> value, out bit<32> old) {
            old = value;
            if (meta.run_new == 1 || (int<32>)(hdr.thc.seq - value) > 0) {
                value = hdr.thc.seq;
            }
        }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_bitmap) thc_bitmap_ra = {
        void apply(inout bit<32> value, out bit<32> old) {
            old = value;
            if (meta.seq_newer == 1) {
                value = meta.worker_bit;
            } else {
                value = value | meta.worker_bit;
            }
        }
    };
    RegisterAction<bit<8>, bit<32>, bit<8>>(thc_count) thc_count_ra = {
        void apply(inout bit<8> value, out bit<8> count) {
            if (meta.first == 1) {
                value = 1;
            } else if (meta.dup == 0) {
                value = value + 1;
            }
            count = value;
        }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_job_run) thc_job_run_reset = {
        void apply(inout bit<32> value) { value = 0; }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_run) thc_run_reset = {
        void apply(inout bit<32> value) { value = 0; }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_seq) thc_seq_reset = {
        void apply(inout bit<32> value) { value = THC_SEQ_RESET; }
    };
    RegisterAction<bit<32>, bit<32>, bit<32>>(thc_bitmap) thc_bitmap_reset = {
        void apply(inout bit<32> value) { value = 0; }
    };
    RegisterAction<bit<8>, bit<32>, bit<8>>(thc_count) thc_count_reset = {
        void apply(inout bit<8> value) { value = 0; }
    };

#include "generated/thc_groups.p4"

    action set_job(bit<8> job_index, bit<8> n_workers, bit<16> pool_base, bit<16> pool_size,
                   bit<32> full_bitmap, bit<16> mcast_grp, bit<8> sum_bits, bit<32> epoch) {
        meta.job_index = job_index;
        meta.n_workers = n_workers;
        meta.pool_base = pool_base;
        meta.pool_size = pool_size;
        meta.full_bitmap = full_bitmap;
        meta.mcast_grp = mcast_grp;
        meta.wide = (bit<1>)(sum_bits >> 4);
        meta.epoch = epoch;
    }
    table thc_job {
        key = { hdr.thc.job_id: exact @name("job_id"); }
        actions = { set_job; @defaultonly NoAction; }
        default_action = NoAction();
        size = THC_MAX_JOBS;
    }

    action set_worker(bit<32> worker_bit) {
        meta.worker_bit = worker_bit;
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

    // one ALU operation per action: an add, then a deposit of the sum and the version bit
    action thc_slot() {
        meta.slot_idx = meta.pool_base + hdr.thc.slot;
        meta.jc_index = (bit<32>)meta.job_index << 2;  // x THC_N_JOB_COUNTERS (4)
    }
    action thc_index() {
        meta.reg_index = 15w0 ++ meta.slot_idx ++ hdr.thc.version[0:0];
    }
    action thc_reply(bit<8> pkt_type) {
        hdr.thc.pkt_type = pkt_type;
        hdr.thc.count = meta.count;
        hdr.thc.bitmap = meta.bitmap;
        hdr.thc.epoch = meta.epoch;
        hdr.udp.checksum = 0;
        meta.bridge.is_reply = 1;
    }
    action thc_drop() {
        ig_dprsr_md.drop_ctl = 1;
    }

    apply {
        meta.bridge.setValid();
        meta.bridge.is_reply = 0;
        if (hdr.udp.isValid() && hdr.udp.dstPort == THC_UDP_PORT) {
            // one small condition per gateway: Tofino's compare a few bytes of PHV each
            if (!hdr.thc.isValid()) {
                meta.drop_reason = THC_DROP_MALFORMED;
            } else if (ig_prsr_md.parser_err != 0) {
                meta.drop_reason = THC_DROP_MALFORMED;
            } else if (hdr.udp.length < THC_UDP_LEN_HDR) {
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
            if (meta.drop_reason == 0) {
                if (!thc_job.apply().hit) {
                    meta.drop_reason = THC_DROP_UNKNOWN_JOB;
                }
            }
            if (meta.drop_reason == 0) {
                if ((hdr.thc.pkt_type == THC_DATA && !hdr.thc_data[0].isValid())
                        || (hdr.thc.pkt_type == THC_MAX && !hdr.thc_max[0].isValid())
                        || (hdr.thc.pkt_type == THC_RESET && hdr.udp.length != THC_UDP_LEN_HDR)) {
                    meta.drop_reason = THC_DROP_BAD_LANES;
                }
            }
            if (meta.drop_reason == 0 && hdr.thc.pkt_type != THC_RESET) {
                // worker_id >= n_workers, as a saturating difference compared with a constant
                meta.room8 = meta.n_workers |-| hdr.thc.worker_id;
                if (meta.room8 == 0) {
                    meta.drop_reason = THC_DROP_WORKER_OUTSIDE_JOB;
                } else if (!thc_worker.apply().hit) {
                    meta.drop_reason = THC_DROP_UNKNOWN_WORKER;
                }
            }
            meta.room16 = meta.pool_size |-| hdr.thc.slot;
            if (meta.drop_reason == 0 && meta.room16 == 0) {
                meta.drop_reason = THC_DROP_SLOT_OUTSIDE_POOL;
            }
            if (meta.drop_reason == 0) {
                thc_slot();
                thc_index();
                if (hdr.thc.pkt_type == THC_RESET) {
                    thc_job_run_reset.execute((bit<32>)meta.job_index);
                    thc_run_reset.execute(meta.reg_index);
                    thc_seq_reset.execute(meta.reg_index);
                    thc_bitmap_reset.execute(meta.reg_index);
                    thc_count_reset.execute(meta.reg_index);
                    thc_resets.count((bit<32>)meta.job_index);
                    thc_drop();
                } else {
                    meta.run_stale = thc_job_run_ra.execute((bit<32>)meta.job_index);
                    if (meta.run_stale == 1) {
                        meta.drop_reason = THC_DROP_STALE_RUN;
                    }
                }
            }
            if (meta.drop_reason == 0 && hdr.thc.pkt_type != THC_RESET) {
                meta.run_new = thc_run_ra.execute(meta.reg_index);
                meta.old_seq = thc_seq_ra.execute(meta.reg_index);
                meta.seq_diff = hdr.thc.seq - meta.old_seq;
                if (meta.run_new == 1) {
                    meta.seq_newer = 1;
                } else if (meta.seq_diff != 0) {
                    if (meta.seq_diff[31:31] == 0) {
                        meta.seq_newer = 1;
                    }
                }
                if (meta.seq_newer == 0) {
                    if (meta.seq_diff != 0) {
                        meta.drop_reason = THC_DROP_STALE;
                    }
                }
            }
            if (meta.drop_reason == 0 && hdr.thc.pkt_type != THC_RESET) {
                meta.old_bitmap = thc_bitmap_ra.execute(meta.reg_index);
                if (meta.seq_newer == 1) {
                    meta.first = 1;
                    meta.bitmap = meta.worker_bit;
                } else {
                    if (meta.old_bitmap == 0) {
                        meta.first = 1;
                    }
                    meta.mine = meta.old_bitmap & meta.worker_bit;
                    if (meta.mine != 0) {
                        meta.dup = 1;
                    }
                    meta.bitmap = meta.old_bitmap | meta.worker_bit;
                }
                meta.count = thc_count_ra.execute(meta.reg_index);
                if (meta.dup == 1) {
                    if (meta.count == meta.n_workers) {
                        meta.lane_op = THC_OP_READ;
                    } else {
                        meta.lane_op = THC_OP_NONE;
                    }
                } else {
                    if (meta.first == 1) {
                        meta.lane_op = THC_OP_WRITE;
                    } else {
                        meta.lane_op = THC_OP_ADD;
                    }
                }
                if (hdr.thc.pkt_type == THC_DATA) {
#include "generated/thc_groups_apply.p4"
                } else {
#include "generated/thc_max_apply.p4"
                }
                bit<32> jc_event = THC_JC_PACKETS;
                if (meta.count == meta.n_workers) {
                    if (hdr.thc.pkt_type == THC_DATA) {
                        if (meta.wide == 1) {
                            hdr.udp.length = THC_UDP_LEN_RESULT16;
                        } else {
                            hdr.udp.length = THC_UDP_LEN_RESULT8;
                        }
                        thc_reply(THC_RESULT);
                    } else {
                        thc_reply(THC_MAX_RESULT);
                    }
                    if (meta.dup == 1) {
                        jc_event = THC_JC_RETRANSMISSIONS;
                        ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port;
                        meta.bridge.dest_worker = hdr.thc.worker_id;
                    } else {
                        jc_event = THC_JC_COMPLETIONS;
                        ig_tm_md.mcast_grp_a = meta.mcast_grp;
                    }
                } else if (meta.dup == 1) {
                    hdr.udp.length = THC_UDP_LEN_HDR;
                    thc_reply(THC_PENDING);
                    jc_event = THC_JC_PENDING;
                    ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port;
                    meta.bridge.dest_worker = hdr.thc.worker_id;
                } else {
                    thc_drop();
                }
                hdr.ipv4.totalLen = hdr.udp.length + 20;
                meta.jc_index = meta.jc_index | jc_event;  // jc_event < 4: the low bits
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
