/*
 * THC in-network aggregation switch (P4_16, v1model / BMv2 simple_switch_grpc).
 *
 * Workers send DATA packets (LANES 4-bit indices into the job's THC lookup table) or MAX
 * packets (MAX_LANES 32-bit values) over Eth/IPv4/UDP to port THC_UDP_PORT. Lanes are
 * processed in groups of eight (ThcLaneGroup, one instance per group): each DATA byte is
 * looked up whole (two indices -> two table values, packed), and the sums live in 32-bit
 * register words, four 8-bit or two 16-bit lanes a word (the job's width, set_job's
 * sum_bits). When all workers of the job have contributed, the switch multicasts a RESULT
 * (LANES sums of the job's width) to every worker. Slots come in two versions (SwitchML
 * shadow copies); a worker bitmap per slot/version gives exactly-once aggregation under
 * loss, duplication and reordering, and the run beside it keeps one training run's
 * contributions out of another's. A FLUSH (DLCP's bounded loss) closes a slot use with the
 * workers it has: the frozen RESULT (count, bitmap) goes to every worker and later packets
 * of that use get it unchanged. A slot use keeps its op and offset, a new use of a slot
 * version waits until every worker has shown it holds the previous one's result, and
 * stale or out-of-step packets are answered with REFUSED: the rules of the reference model,
 * host/wire/model.py. Every IPv4 packet's DSCP picks its egress queue priority (thc_dscp).
 * See docs/switch.md and docs/protocol.md.
 *
 * Protocol constants, the THC header and the group instantiations are generated from
 * host/wire/protocol.json by p4src/gen_p4.py into p4src/generated/; thc_tna.p4 is the
 * Tofino (TNA) variant of this program over the same generated files.
 *
 * No loops outside the parser, no variable shifts, arithmetic on 32 bits (the run clock on
 * 48); a slot's state is read in one action and written in others, which BMv2 allows and
 * thc_tna.p4 recasts as register actions.
 */
#include <core.p4>
#include <v1model.p4>

#include "generated/thc_constants.p4"
#include "generated/thc_headers.p4"
#include "thc_common.p4"

// What every lane group does with a packet (meta.group_op, set once per packet so that a
// group tests one condition): look its bytes up and add, read its words for a
// retransmission's reply, or add zeros for a FLUSH
const bit<2> THC_GROUP_LOOKUP = 0;
const bit<2> THC_GROUP_READ = 1;
const bit<2> THC_GROUP_FLUSH = 2;

struct metadata_t {
    // from thc_job
    bit<8>  job_index;
    bit<8>  n_workers;
    bit<16> pool_base;
    bit<16> pool_size;
    bit<32> full_bitmap;
    bit<16> mcast_grp;
    bit<1>  wide;           // the job's sums are 16 bits wide (two lanes a word), else 8
    bit<1>  vote;           // a vote job: DATA lanes are sign bits, the sums count the +1s
    bit<32> epoch;          // the job's epoch, returned in every reply
    // from thc_worker
    bit<32> worker_bit;     // the bit this packet sets in the use's bitmap (0 for a FLUSH)
    bit<32> ack_bit;        // the sender's bit, which its packets acknowledge with
    // register addressing
    bit<32> reg_index;      // (pool_base + slot) * 2 + version
    bit<32> jc_base;        // job_index * THC_N_JOB_COUNTERS
    // run state as seen by this packet
    bit<32> job_run;
    bit<48> job_seen;       // when the job's run was last heard
    bit<32> run_diff;
    bit<1>  run_stale;      // another run holds the job, live: drop stale_run
    bit<32> slot_run;
    bit<1>  run_new;        // the slot version last served another run: start a new use
    // the slot use as this packet finds it, and the slot's other version
    bit<8>  pkt_op;         // THC_DATA (DATA, FLUSH) or THC_MAX: the use this packet joins
    bit<8>  slot_op;
    bit<32> slot_offset;
    bit<32> acked;          // workers known to hold the use's result
    bit<32> reg_other;
    bit<32> other_run;
    bit<32> other_seq;
    bit<32> other_acked;
    bit<32> past;           // seq - pool: the sender holds every result up to this seq
    bit<32> ack_diff;
    bit<1>  held;           // a new use while a worker may still need the previous result
    bit<1>  refuse;         // a drop answered with REFUSED (reason in count, detail in bitmap)
    bit<32> worker_index;   // job_index * THC_MAX_WORKERS + worker_id
    bit<32> worker_run;
    bit<32> worker_epoch;
    bit<32> worker_nonce;
    bit<1>  reused;         // another incarnation of this worker already sent under this run
    bit<32> detail;
    // slot state as seen by this packet
    bit<32> cur_seq;
    bit<32> seq_diff;
    bit<1>  seq_newer;
    bit<32> old_bitmap;
    bit<32> bitmap;
    bit<8>  count;
    bit<1>  dup;            // retransmission (bit set), or the use is complete or closed
    bit<1>  flush;          // a FLUSH: contributes nothing, closes the use
    bit<1>  closed_old;     // the use was closed by an earlier FLUSH
    bit<1>  closed;         // ... or by this packet
    bit<6>  dscp;           // the IPv4 DSCP: picks the egress queue priority
    bit<1>  first;          // first contribution of this use of the slot: overwrite lanes
    bit<2>  lane_op;        // THC_OP_WRITE / THC_OP_ADD / THC_OP_READ for every lane word
    bit<2>  group_op;       // THC_GROUP_LOOKUP / _READ / _FLUSH: what every lane group does
    bit<32> keep;           // lane words keep their sums (ADD: all ones) or not (WRITE: 0)
    // outcome
    bit<8>  drop_reason;
    bit<16> zero16;         // never written: what a checksum over its own field must give
    bit<1>  is_reply;       // egress rewrites addresses for the destination worker
    bit<8>  dest_worker;    // destination of a unicast reply (multicast: egress_rid - 1)
}

parser ThcParser(packet_in packet, out headers_t hdr, inout metadata_t meta,
                 inout standard_metadata_t sm) {
    state start {
        packet.extract(hdr.ethernet);
        transition select(hdr.ethernet.etherType) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }
    state parse_ipv4 {
        packet.extract(hdr.ipv4);
        transition select(hdr.ipv4.ihl, hdr.ipv4.fragOffset, hdr.ipv4.protocol) {
            (5, 0, IPPROTO_UDP): parse_udp;
            default: accept;
        }
    }
    state parse_udp {
        packet.extract(hdr.udp);
        transition select(hdr.udp.dstPort) {
            THC_UDP_PORT: parse_thc;
            default: accept;
        }
    }
    state parse_thc {
        packet.extract(hdr.thc);
        // A payload is parsed only when the UDP length is exactly right for the type;
        // ingress turns a missing payload into drop reason bad_lanes.
        transition select(hdr.thc.pkt_type, hdr.udp.length) {
            (THC_DATA, THC_UDP_LEN_DATA): parse_data;
            (THC_DATA, THC_UDP_LEN_VOTE): parse_vote;
            (THC_MAX, THC_UDP_LEN_MAX): parse_max;
            default: accept;
        }
    }
    state parse_data {
#include "generated/thc_parse_data.p4"
        transition accept;
    }
    state parse_vote {
#include "generated/thc_parse_vote.p4"
        transition accept;
    }
    state parse_max {
#include "generated/thc_parse_max.p4"
        transition accept;
    }
}

/*
 * A THC frame a host's network stack would drop (damaged after its checksums were computed)
 * is dropped as bad_checksum before any field of it is read. The UDP checksum is checked
 * where the sender set one (not 0) and the parser took the whole datagram (any other is
 * malformed or of the wrong length, and dropped as such). Each sum takes its checksum field
 * in and must come to zero, as a kernel checks it: a computed 0 holds whether the sender
 * wrote it 0x0000 or 0xFFFF (RFC 768 writes a UDP one so).
 */
control ThcVerifyChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply {
        verify_checksum(hdr.thc.isValid(), { hdr.ipv4 }, meta.zero16, HashAlgorithm.csum16);
        verify_checksum((hdr.thc_data[0].isValid() || hdr.thc_vote[0].isValid()
                         || hdr.thc_max[0].isValid()
                         || (hdr.thc.isValid() && hdr.udp.length == THC_UDP_LEN_HDR))
                        && hdr.udp.checksum != 0, {
            hdr.ipv4.srcAddr, hdr.ipv4.dstAddr, 8w0, hdr.ipv4.protocol, hdr.udp.length,
            hdr.udp,
#include "generated/thc_udp_sum.p4"
            }, meta.zero16, HashAlgorithm.csum16);
    }
}

/*
 * One lane group: THC_GROUP_LANES (8) lanes = 4 DATA bytes, written once and instantiated
 * THC_GROUPS times (generated/thc_groups.p4), like SwitchML's Processor.
 *
 * thc_lut_<b> maps DATA byte b of the group (two 4-bit indices) to the two lanes' table
 * values, already placed where they sit in a 32-bit sum word: the controller writes
 * T[hi] << 24 | T[lo] << 16 (even b) or T[hi] << 8 | T[lo] (odd b) for 8-bit jobs, and
 * T[hi] << 16 | T[lo] for 16-bit jobs. Lanes never carry into each other (a job's sums fit
 * its width), so one 32-bit add sums four 8-bit or two 16-bit lanes.
 *
 * Each sum word register is read and written at most once per packet, by one action: the
 * last byte's lookup action (thc_lut_sum8 / thc_lut_sum16, write on the slot's first use,
 * add otherwise) or, on a retransmission, thc_read8 / thc_read16. thc_tna.p4 keeps these
 * names but leaves the words to RegisterActions chosen by its thc_word_op table.
 */
control ThcLaneGroup(in thc_idx_h idx, inout thc_sum8_h r8, inout thc_sum16_h r16,
                     in bit<16> job_id, in bit<32> reg_index, in bit<2> group_op,
                     in bit<32> keep, in bit<1> wide) {
    register<bit<32>>(THC_REG_SIZE) thc_sum_0;
    register<bit<32>>(THC_REG_SIZE) thc_sum_1;
    register<bit<32>>(THC_REG_SIZE) thc_sum_2;
    register<bit<32>>(THC_REG_SIZE) thc_sum_3;
    // the group's DATA bytes as lookup keys, and the table values of the first three
    bit<8> k0;
    bit<8> k1;
    bit<8> k2;
    bit<8> k3;
    bit<32> v0;
    bit<32> v1;
    bit<32> v2;
    bit<32> old;

    // p4c copies a key taken from a header stack element into a scratch field, one table
    // of its own per key; copying the four keys in one action saves BMv2 three table runs
    action thc_keys() {
        k0 = idx.b0;
        k1 = idx.b1;
        k2 = idx.b2;
        k3 = idx.b3;
    }
    action thc_lut_set_0(bit<32> value) { v0 = value; }
    action thc_lut_set_1(bit<32> value) { v1 = value; }
    action thc_lut_set_2(bit<32> value) { v2 = value; }
    // The last byte's lookup also adds the group's words: BMv2 pays for every table and
    // every action call outside one (p4c turns each into a table), so the group costs four
    // table applies and nothing else. The controller picks the action by the job's width.
    // keep is 0 on a slot's first use (the words are written) and all ones otherwise.
    action thc_lut_sum8(bit<32> value) {
        r8.setValid();
        thc_sum_0.read(old, reg_index);
        r8.w0 = (old & keep) + (v0 | v1);
        thc_sum_0.write(reg_index, r8.w0);
        thc_sum_1.read(old, reg_index);
        r8.w1 = (old & keep) + (v2 | value);
        thc_sum_1.write(reg_index, r8.w1);
    }
    action thc_lut_sum16(bit<32> value) {
        r16.setValid();
        thc_sum_0.read(old, reg_index);
        r16.w0 = (old & keep) + v0;
        thc_sum_0.write(reg_index, r16.w0);
        thc_sum_1.read(old, reg_index);
        r16.w1 = (old & keep) + v1;
        thc_sum_1.write(reg_index, r16.w1);
        thc_sum_2.read(old, reg_index);
        r16.w2 = (old & keep) + v2;
        thc_sum_2.write(reg_index, r16.w2);
        thc_sum_3.read(old, reg_index);
        r16.w3 = (old & keep) + value;
        thc_sum_3.write(reg_index, r16.w3);
    }
    table thc_lut_0 {
        key = { job_id: exact @name("job_id"); k0: exact @name("idx"); }
        actions = { thc_lut_set_0; }
        default_action = thc_lut_set_0(0);
        size = THC_LUT_SIZE;
    }
    table thc_lut_1 {
        key = { job_id: exact @name("job_id"); k1: exact @name("idx"); }
        actions = { thc_lut_set_1; }
        default_action = thc_lut_set_1(0);
        size = THC_LUT_SIZE;
    }
    table thc_lut_2 {
        key = { job_id: exact @name("job_id"); k2: exact @name("idx"); }
        actions = { thc_lut_set_2; }
        default_action = thc_lut_set_2(0);
        size = THC_LUT_SIZE;
    }
    // No default: the controller installs all 256 entries of every lookup table before a
    // job's workers go live; a miss would leave the group's RESULT words out, and the
    // reply's length would make every receiver drop it.
    table thc_lut_3 {
        key = { job_id: exact @name("job_id"); k3: exact @name("idx"); }
        actions = { thc_lut_sum8; thc_lut_sum16; @defaultonly NoAction; }
        default_action = NoAction();
        size = THC_LUT_SIZE;
    }

    // A retransmitted packet's reply: the words as they are
    action thc_read8() {
        r8.setValid();
        thc_sum_0.read(r8.w0, reg_index);
        thc_sum_1.read(r8.w1, reg_index);
    }
    action thc_read16() {
        r16.setValid();
        thc_sum_0.read(r16.w0, reg_index);
        thc_sum_1.read(r16.w1, reg_index);
        thc_sum_2.read(r16.w2, reg_index);
        thc_sum_3.read(r16.w3, reg_index);
    }

    // a FLUSH carries no indices: it adds (or, on a new use, writes) zero
    action thc_flush8() {
        v0 = 0;
        v1 = 0;
        v2 = 0;
        thc_lut_sum8(0);
    }
    action thc_flush16() {
        v0 = 0;
        v1 = 0;
        v2 = 0;
        thc_lut_sum16(0);
    }

    apply {
        if (group_op == THC_GROUP_LOOKUP) {
            thc_keys();
            thc_lut_0.apply();
            thc_lut_1.apply();
            thc_lut_2.apply();
            thc_lut_3.apply();
        } else if (group_op == THC_GROUP_READ) {
            if (wide == 0) {
                thc_read8();
            } else {
                thc_read16();
            }
        } else if (wide == 0) {
            thc_flush8();
        } else {
            thc_flush16();
        }
    }
}

/*
 * One lane group of a vote job's DATA: its 8 sign bits become 8 4-bit indices 0 or 1 (the
 * group's thc_idx_h), which the job's lookup table (VOTE_TABLE: 0 -> 0, 1 -> 1) turns into
 * counts, so a vote runs on the THC lane groups and their registers unchanged.
 */
control ThcVoteGroup(inout thc_vote_h v, out thc_idx_h idx) {
    apply {
        idx.setValid();
        idx.b0 = 3w0 ++ v.b[7:7] ++ 3w0 ++ v.b[6:6];
        idx.b1 = 3w0 ++ v.b[5:5] ++ 3w0 ++ v.b[4:4];
        idx.b2 = 3w0 ++ v.b[3:3] ++ 3w0 ++ v.b[2:2];
        idx.b3 = 3w0 ++ v.b[1:1] ++ 3w0 ++ v.b[0:0];
        v.setInvalid();
    }
}

/* One MAX lane: a 32-bit register of raw float bits, max instead of add. */
control ThcMaxLane(inout thc_max_h m, in bit<32> reg_index, in bit<2> op) {
    register<bit<32>>(THC_REG_SIZE) thc_max;
    bit<32> old;

    action thc_max_ra() {
        thc_max.read(old, reg_index);
        m.v = (op == THC_OP_WRITE) ? m.v
            : ((op == THC_OP_ADD) ? ((old > m.v) ? old : m.v) : old);
        thc_max.write(reg_index, m.v);
    }
    apply {
        thc_max_ra();
    }
}

control ThcIngress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    counter(THC_N_DROP_REASONS, CounterType.packets) thc_drops;
    counter(THC_MAX_JOBS * THC_N_JOB_COUNTERS, CounterType.packets) thc_job_counters;
    counter(THC_MAX_JOBS, CounterType.packets) thc_resets;
    counter(1, CounterType.packets) l2_misses;

    // The run that owns each job (0: none yet) and when it was last heard, index job_index.
    register<bit<32>>(THC_MAX_JOBS) thc_job_run;
    register<bit<48>>(THC_MAX_JOBS) thc_job_seen;
    // Each worker's incarnation of the job's run (the nonce its packets carry in the epoch
    // field), with the run and the install epoch it was recorded under; index worker_index.
    register<bit<32>>(THC_MAX_JOBS * THC_MAX_WORKERS) thc_worker_run;
    register<bit<32>>(THC_MAX_JOBS * THC_MAX_WORKERS) thc_worker_epoch;
    register<bit<32>>(THC_MAX_JOBS * THC_MAX_WORKERS) thc_worker_nonce;
    // Slot state, index (pool_base + slot) * 2 + version.
    register<bit<32>>(THC_REG_SIZE) thc_run;
    register<bit<32>>(THC_REG_SIZE) thc_seq;
    register<bit<8>>(THC_REG_SIZE) thc_op;
    register<bit<32>>(THC_REG_SIZE) thc_offset;
    register<bit<32>>(THC_REG_SIZE) thc_acked;
    register<bit<32>>(THC_REG_SIZE) thc_bitmap;
    register<bit<8>>(THC_REG_SIZE) thc_count;
    register<bit<1>>(THC_REG_SIZE) thc_closed;
    // DSCPs outside protocol.json's priority_dscp (and not 0): sent best effort, counted
    counter(1, CounterType.packets) thc_dscp_unknown;

    // Lane groups and max lanes (generated instantiations).
#include "generated/thc_groups.p4"
#include "generated/thc_vote.p4"

    // ---- configuration tables (installed by controller/jobs.py) ----
    action set_job(bit<8> job_index, bit<8> n_workers, bit<16> pool_base, bit<16> pool_size,
                   bit<32> full_bitmap, bit<16> mcast_grp, bit<8> sum_bits, bit<32> epoch,
                   bit<8> aggregation) {
        meta.job_index = job_index;
        meta.n_workers = n_workers;
        meta.pool_base = pool_base;
        meta.pool_size = pool_size;
        meta.full_bitmap = full_bitmap;
        meta.mcast_grp = mcast_grp;
        meta.wide = (bit<1>)(sum_bits >> 4);    // 8 -> 0, 16 -> 1
        meta.epoch = epoch;
        meta.vote = (bit<1>)aggregation;       // THC_AGG_THC -> 0, THC_AGG_VOTE -> 1
    }
    table thc_job {
        key = { hdr.thc.job_id: exact @name("job_id"); }
        actions = { set_job; @defaultonly NoAction; }
        default_action = NoAction();
        size = THC_MAX_JOBS;
    }

    // The install a RESET belongs to: the controller writes (job_id, epoch) beside the job
    // entry, so a RESET still queued from an earlier install of the job (another epoch)
    // misses, clears nothing and is not counted in thc_resets (stale_reset).
    action set_install() { }
    table thc_install {
        key = {
            hdr.thc.job_id: exact @name("job_id");
            hdr.thc.epoch: exact @name("epoch");
        }
        actions = { set_install; @defaultonly NoAction; }
        default_action = NoAction();
        size = THC_MAX_JOBS;
    }

    action set_worker(bit<32> worker_bit) {
        meta.worker_bit = worker_bit;
        meta.ack_bit = worker_bit;
    }
    // A worker is known by its switch port as well as its addresses: a host on another
    // port that sends with them is no worker (unknown_worker), and gets no reply.
    table thc_worker {
        key = {
            hdr.thc.job_id: exact @name("job_id");
            hdr.thc.worker_id: exact @name("worker_id");
            hdr.ipv4.srcAddr: exact @name("src_ip");
            hdr.udp.srcPort: exact @name("src_port");
            sm.ingress_port: exact @name("ingress_port");
        }
        actions = { set_worker; @defaultonly NoAction; }
        default_action = NoAction();
        size = THC_MAX_JOBS * THC_MAX_WORKERS;
    }

    // ---- DLCP: DSCP -> egress queue priority (simple_switch --priority-queues) ----
    action thc_set_priority(bit<3> priority) {
        sm.priority = priority;
    }
    action thc_dscp_miss() {
        thc_dscp_unknown.count(0);
        sm.priority = 0;
    }
    table thc_dscp {
        key = { meta.dscp: exact @name("dscp"); }
        actions = { thc_set_priority; thc_dscp_miss; }
        default_action = thc_dscp_miss();
        const entries = { THC_DSCP_ENTRIES }
    }

    action l2_set_port(bit<9> port) {
        sm.egress_spec = port;
    }
    action l2_miss() {
        l2_misses.count(0);
        mark_to_drop(sm);
    }
    table l2_forward {
        key = { hdr.ethernet.dstAddr: exact @name("dst_mac"); }
        actions = { l2_set_port; l2_miss; }
        default_action = l2_miss();
        size = 1024;
    }

    // ---- slot state: one register action per register ----
    action thc_index() {
        meta.reg_index = ((bit<32>)(meta.pool_base + hdr.thc.slot) << 1) | (bit<32>)hdr.thc.version;
        meta.jc_base = (bit<32>)meta.job_index * THC_N_JOB_COUNTERS;
    }

    // A run takes the job when the job has none, when it is newer (RFC 1982) by at most
    // THC_RUN_JUMP, or when the job's run has not been heard for THC_RUN_IDLE_US; any other
    // run is stale_run. Every packet of the job's run marks it heard.
    action thc_job_run_ra() {
        thc_job_run.read(meta.job_run, (bit<32>)meta.job_index);
        thc_job_seen.read(meta.job_seen, (bit<32>)meta.job_index);
        meta.run_diff = hdr.thc.run - meta.job_run;
        meta.run_stale = (meta.job_run != 0 && meta.run_diff != 0
                          && meta.run_diff > THC_RUN_JUMP
                          && sm.ingress_global_timestamp - meta.job_seen < THC_RUN_IDLE_US)
                         ? 1w1 : 1w0;
        thc_job_run.write((bit<32>)meta.job_index,
                          (meta.run_stale == 1) ? meta.job_run : hdr.thc.run);
        thc_job_seen.write((bit<32>)meta.job_index,
                           (meta.run_stale == 1) ? meta.job_seen : sm.ingress_global_timestamp);
    }

    // One incarnation of each worker per run and install: a process restarted under the same
    // run id would meet its predecessor's slot uses (and their results) at the same seqs.
    action thc_incarnation_ra() {
        meta.worker_index = (bit<32>)meta.job_index * THC_MAX_WORKERS
                            + (bit<32>)hdr.thc.worker_id;
        thc_worker_run.read(meta.worker_run, meta.worker_index);
        thc_worker_epoch.read(meta.worker_epoch, meta.worker_index);
        thc_worker_nonce.read(meta.worker_nonce, meta.worker_index);
        meta.reused = (meta.worker_run == hdr.thc.run && meta.worker_epoch == meta.epoch
                       && meta.worker_nonce != hdr.thc.epoch) ? 1w1 : 1w0;
        thc_worker_run.write(meta.worker_index, hdr.thc.run);
        thc_worker_epoch.write(meta.worker_index, meta.epoch);
        thc_worker_nonce.write(meta.worker_index,
                               (meta.reused == 1) ? meta.worker_nonce : hdr.thc.epoch);
    }

    // The slot's use in this packet's version, and the other version. The packet shows its
    // sender holds the result of every use of its run up to seq - pool (a window never
    // exceeds the pool): it acknowledges such uses in either version.
    action thc_slot_read() {
        meta.reg_other = meta.reg_index ^ 1;
        thc_run.read(meta.slot_run, meta.reg_index);
        thc_seq.read(meta.cur_seq, meta.reg_index);
        thc_op.read(meta.slot_op, meta.reg_index);
        thc_offset.read(meta.slot_offset, meta.reg_index);
        thc_acked.read(meta.acked, meta.reg_index);
        thc_run.read(meta.other_run, meta.reg_other);
        thc_seq.read(meta.other_seq, meta.reg_other);
        thc_acked.read(meta.other_acked, meta.reg_other);
        meta.past = hdr.thc.seq - (bit<32>)meta.pool_size;
        meta.ack_diff = meta.cur_seq - meta.past;
        meta.acked = (meta.slot_run == hdr.thc.run
                      && (meta.ack_diff == 0 || meta.ack_diff[31:31] == 1))
                     ? meta.acked | meta.ack_bit : meta.acked;
        thc_acked.write(meta.reg_index, meta.acked);
        meta.ack_diff = meta.other_seq - meta.past;
        meta.other_acked = (meta.other_run == hdr.thc.run
                            && (meta.ack_diff == 0 || meta.ack_diff[31:31] == 1))
                           ? meta.other_acked | meta.ack_bit : meta.other_acked;
        thc_acked.write(meta.reg_other, meta.other_acked);
        // RFC 1982: newer iff 0 < seq - cur < 2^31, stale iff bit 31 of the difference is
        // set. A newer seq or another run starts a new use.
        meta.run_new = (meta.slot_run != hdr.thc.run) ? 1w1 : 1w0;
        meta.seq_diff = hdr.thc.seq - meta.cur_seq;
        meta.seq_newer = (meta.run_new == 1 || (meta.seq_diff != 0 && meta.seq_diff[31:31] == 0))
                         ? 1w1 : 1w0;
        meta.held = (meta.seq_newer == 1 && meta.run_new == 0 && meta.slot_op != 0
                     && meta.acked != meta.full_bitmap) ? 1w1 : 1w0;
    }

    // A new use: this packet's run, seq, op and offset; nobody has its result yet.
    action thc_use_start() {
        thc_run.write(meta.reg_index, hdr.thc.run);
        thc_seq.write(meta.reg_index, hdr.thc.seq);
        thc_op.write(meta.reg_index, meta.pkt_op);
        thc_offset.write(meta.reg_index, hdr.thc.offset);
        thc_acked.write(meta.reg_index, 0);
    }

    // closed by a FLUSH: frozen until the slot version's next use
    action thc_closed_ra() {
        thc_closed.read(meta.closed_old, meta.reg_index);
        meta.closed_old = (meta.seq_newer == 1) ? 1w0 : meta.closed_old;
        meta.closed = meta.closed_old | meta.flush;
        thc_closed.write(meta.reg_index, meta.closed);
    }

    // A FLUSH has worker_bit 0: it adds no bit, and it is a retransmission of a use that is
    // already complete or closed.
    action thc_bitmap_ra() {
        thc_bitmap.read(meta.old_bitmap, meta.reg_index);
        meta.dup = (meta.seq_newer == 0 && ((meta.old_bitmap & meta.worker_bit) != 0
                    || meta.closed_old == 1 || meta.old_bitmap == meta.full_bitmap)) ? 1w1 : 1w0;
        meta.first = (meta.seq_newer == 1 || meta.old_bitmap == 0) ? 1w1 : 1w0;
        meta.bitmap = (meta.seq_newer == 1) ? meta.worker_bit
                    : ((meta.dup == 1) ? meta.old_bitmap : (meta.old_bitmap | meta.worker_bit));
        thc_bitmap.write(meta.reg_index, meta.bitmap);
        meta.lane_op = (meta.dup == 1) ? THC_OP_READ : ((meta.first == 1) ? THC_OP_WRITE : THC_OP_ADD);
        meta.keep = (meta.first == 1) ? 32w0 : 32w0xFFFFFFFF;
        meta.group_op = (meta.dup == 1) ? THC_GROUP_READ
                      : (hdr.thc_data[0].isValid() ? THC_GROUP_LOOKUP : THC_GROUP_FLUSH);
    }

    action thc_count_ra() {
        thc_count.read(meta.count, meta.reg_index);
        meta.count = (meta.dup == 1) ? meta.count
                   : ((meta.first == 1) ? (bit<8>)(meta.flush ^ 1) : meta.count + (bit<8>)(meta.flush ^ 1));
        thc_count.write(meta.reg_index, meta.count);
    }

    // RESET (controller packet-out): the slot version named in the header becomes unused,
    // and the job index forgets its run (a job installed at a reused index starts with none).
    action thc_reset_ra() {
        thc_job_run.write((bit<32>)meta.job_index, 0);
        thc_job_seen.write((bit<32>)meta.job_index, 0);
        thc_run.write(meta.reg_index, 0);
        thc_seq.write(meta.reg_index, THC_SEQ_RESET);
        thc_op.write(meta.reg_index, 0);
        thc_offset.write(meta.reg_index, 0);
        thc_acked.write(meta.reg_index, 0);
        thc_bitmap.write(meta.reg_index, 0);
        thc_count.write(meta.reg_index, 0);
        thc_closed.write(meta.reg_index, 0);
    }

    // ---- replies ----
    action thc_reply(bit<8> pkt_type) {
        hdr.thc.pkt_type = pkt_type;
        hdr.thc.count = meta.count;
        hdr.thc.bitmap = meta.bitmap;
        hdr.thc.epoch = meta.epoch;
        hdr.udp.checksum = 0;
        meta.is_reply = 1;
    }
    action thc_to_sender() {
        sm.egress_spec = sm.ingress_port;
        meta.dest_worker = hdr.thc.worker_id;
    }
    action thc_to_job() {
        sm.mcast_grp = meta.mcast_grp;
    }
    action thc_result_len() {
        hdr.udp.length = (meta.wide == 1) ? THC_UDP_LEN_RESULT16 : THC_UDP_LEN_RESULT8;
    }
    // a drop the sender is told of, so its client fails at once naming the reason
    action thc_refuse(bit<8> reason, bit<32> detail) {
        meta.drop_reason = reason;
        meta.refuse = 1;
        meta.detail = detail;
    }

    apply {
        bit<32> jc_event = THC_JC_PACKETS;
        if (hdr.udp.isValid() && hdr.udp.dstPort == THC_UDP_PORT) {
            // 1. intact (ThcVerifyChecksum), well-formed, right direction
            if (sm.checksum_error == 1) {
                meta.drop_reason = THC_DROP_BAD_CHECKSUM;
            } else if (!hdr.thc.isValid() || sm.parser_error != error.NoError
                    || hdr.udp.length < THC_UDP_LEN_HDR) {
                meta.drop_reason = THC_DROP_MALFORMED;
            } else if (hdr.ipv4.version != 4 || hdr.ipv4.flags[0:0] == 1
                    || hdr.ipv4.totalLen != hdr.udp.length + 20) {
                // no host delivers it as one UDP datagram: another IP version, a first
                // fragment (more fragments), an IPv4 length other than the datagram's
                meta.drop_reason = THC_DROP_MALFORMED;
            } else if (!(THC_KNOWN_TYPE(hdr.thc.pkt_type)) || hdr.thc.version > 1) {
                meta.drop_reason = THC_DROP_MALFORMED;
            } else if (THC_REPLY_TYPE(hdr.thc.pkt_type)) {
                meta.drop_reason = THC_DROP_WRONG_DIRECTION;
            } else if (hdr.thc.pkt_type == THC_RESET && sm.ingress_port != THC_CPU_PORT) {
                meta.drop_reason = THC_DROP_NOT_FROM_CPU;
            } else if (hdr.thc.pkt_type != THC_RESET && hdr.thc.run == 0) {
                meta.drop_reason = THC_DROP_MALFORMED;
            }
            // 2. job
            if (meta.drop_reason == 0) {
                if (!thc_job.apply().hit) {
                    meta.drop_reason = THC_DROP_UNKNOWN_JOB;
                }
            }
            // 3. payload length
            if (meta.drop_reason == 0) {
                if ((hdr.thc.pkt_type == THC_DATA && meta.vote == 0
                            && !hdr.thc_data[0].isValid())
                        || (hdr.thc.pkt_type == THC_DATA && meta.vote == 1
                            && !hdr.thc_vote[0].isValid())
                        || (hdr.thc.pkt_type == THC_MAX && !hdr.thc_max[0].isValid())
                        || ((hdr.thc.pkt_type == THC_RESET || hdr.thc.pkt_type == THC_FLUSH)
                            && hdr.udp.length != THC_UDP_LEN_HDR)) {
                    meta.drop_reason = THC_DROP_BAD_LANES;
                }
            }
            // a vote job's sign bits become 0/1 indices of the lane groups
            if (meta.drop_reason == 0 && hdr.thc.pkt_type == THC_DATA && meta.vote == 1) {
#include "generated/thc_vote_apply.p4"
            }
            // 4., 5. worker and its configuration tag (RESET comes from the controller)
            if (meta.drop_reason == 0 && hdr.thc.pkt_type != THC_RESET) {
                if (hdr.thc.worker_id >= meta.n_workers) {
                    meta.drop_reason = THC_DROP_WORKER_OUTSIDE_JOB;
                } else if (!thc_worker.apply().hit) {
                    meta.drop_reason = THC_DROP_UNKNOWN_WORKER;
                } else if (hdr.thc.bitmap[15:0] != meta.epoch[31:16]) {
                    // the sender's configuration tag is not this install's
                    thc_refuse(THC_DROP_WRONG_CONFIG, 0);
                } else if (hdr.thc.pkt_type == THC_FLUSH) {
                    meta.flush = 1;
                    meta.worker_bit = 0;
                }
            }
            // 6. slot, and the slot and version its seq names (pool_size is a power of two)
            if (meta.drop_reason == 0 && hdr.thc.slot >= meta.pool_size) {
                meta.drop_reason = THC_DROP_SLOT_OUTSIDE_POOL;
            } else if (meta.drop_reason == 0 && hdr.thc.pkt_type != THC_RESET
                    && (hdr.thc.slot != ((bit<16>)hdr.thc.seq & (meta.pool_size - 1))
                        || hdr.thc.version != (((hdr.thc.seq & (bit<32>)meta.pool_size) != 0)
                                               ? 8w1 : 8w0))) {
                thc_refuse(THC_DROP_WRONG_SLOT, 0);
            }
            // 7. run
            if (meta.drop_reason == 0) {
                thc_index();
                if (hdr.thc.pkt_type == THC_RESET) {
                    if (thc_install.apply().hit) {
                        thc_reset_ra();
                        thc_resets.count((bit<32>)meta.job_index);
                        mark_to_drop(sm);
                    } else {
                        meta.drop_reason = THC_DROP_STALE_RESET;
                    }
                } else {
                    thc_job_run_ra();
                    if (meta.run_stale == 1) {
                        thc_refuse(THC_DROP_STALE_RUN, meta.job_run);
                    } else {
                        thc_incarnation_ra();
                        if (meta.reused == 1) {
                            thc_refuse(THC_DROP_REUSED_RUN, meta.worker_nonce);
                        }
                    }
                }
            }
            // 8. aggregation
            if (meta.drop_reason == 0 && hdr.thc.pkt_type != THC_RESET) {
                meta.pkt_op = (hdr.thc.pkt_type == THC_MAX) ? THC_MAX : THC_DATA;
                thc_slot_read();
                if (meta.seq_newer == 0 && meta.seq_diff != 0) {
                    thc_refuse(THC_DROP_STALE, meta.cur_seq);
                } else if (meta.seq_newer == 0 && (meta.slot_op != meta.pkt_op
                                                   || meta.slot_offset != hdr.thc.offset)) {
                    thc_refuse(THC_DROP_WRONG_USE, (bit<32>)meta.slot_op);
                } else if (meta.held == 1) {
                    // wait: a worker may still need the previous use's result; the PENDING
                    // names who holds it (count 0: nothing of this use yet)
                    hdr.thc_data.pop_front(THC_GROUPS);
                    hdr.thc_max.pop_front(THC_MAX_LANES);
                    hdr.udp.length = THC_UDP_LEN_HDR;
                    meta.count = 0;
                    meta.bitmap = meta.acked;
                    thc_reply(THC_PENDING);
                    thc_to_sender();
                    hdr.ipv4.totalLen = hdr.udp.length + 20;
                    thc_job_counters.count(meta.jc_base + THC_JC_HELD);
                } else {
                    if (meta.seq_newer == 1) {
                        thc_use_start();
                    }
                    thc_closed_ra();
                    thc_bitmap_ra();
                    thc_count_ra();
                    if (meta.dup == 0 || meta.count == meta.n_workers || meta.closed == 1) {
                        if (hdr.thc.pkt_type != THC_MAX) {
#include "generated/thc_groups_apply.p4"
                        } else {
#include "generated/thc_max_apply.p4"
                        }
                    }
                    if (meta.count == meta.n_workers || meta.closed == 1) {
                        // complete or closed: RESULT / MAX_RESULT with the stored lanes
                        if (hdr.thc.pkt_type != THC_MAX) {
                            hdr.thc_data.pop_front(THC_GROUPS);
                            thc_result_len();
                            thc_reply(THC_RESULT);
                        } else {
                            thc_reply(THC_MAX_RESULT);
                        }
                        if (meta.dup == 1) {
                            jc_event = THC_JC_RETRANSMISSIONS;
                            thc_to_sender();
                        } else {
                            jc_event = THC_JC_COMPLETIONS;
                            thc_to_job();
                        }
                    } else if (meta.dup == 1) {
                        // retransmission of an incomplete slot: tell the worker where it stands
                        hdr.thc_data.pop_front(THC_GROUPS);
                        hdr.thc_max.pop_front(THC_MAX_LANES);
                        hdr.udp.length = THC_UDP_LEN_HDR;
                        thc_reply(THC_PENDING);
                        jc_event = THC_JC_PENDING;
                        thc_to_sender();
                    } else {
                        mark_to_drop(sm);   // consumed, waiting for the other workers
                    }
                    hdr.ipv4.totalLen = hdr.udp.length + 20;
                    // the one counter access of an aggregated packet: cell "packets" counts
                    // those without a reply (controller.counters adds the reply cells)
                    thc_job_counters.count(meta.jc_base + jc_event);
                }
            }
            if (meta.drop_reason != 0) {
                thc_drops.count((bit<32>)meta.drop_reason);
                if (meta.refuse == 1) {
                    hdr.thc_data.pop_front(THC_GROUPS);
                    hdr.thc_max.pop_front(THC_MAX_LANES);
                    hdr.udp.length = THC_UDP_LEN_HDR;
                    hdr.ipv4.totalLen = hdr.udp.length + 20;
                    meta.count = meta.drop_reason;
                    meta.bitmap = meta.detail;
                    thc_reply(THC_REFUSED);
                    thc_to_sender();
                } else {
                    mark_to_drop(sm);
                }
            }
        } else if (hdr.ethernet.isValid()) {
            l2_forward.apply();
        }
        if (hdr.ipv4.isValid()) {
            meta.dscp = hdr.ipv4.diffserv[7:2];
            thc_dscp.apply();
        }
    }
}

control ThcEgress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
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
        mark_to_drop(sm);
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
        if (meta.is_reply == 1) {
            // multicast replicas carry egress_rid = worker_id + 1; unicast replies name
            // their worker in metadata
            if (sm.egress_rid != 0) {
                hdr.thc.worker_id = (bit<8>)(sm.egress_rid - 1);
            } else {
                hdr.thc.worker_id = meta.dest_worker;
            }
            thc_worker_addr.apply();
        }
    }
}

control ThcComputeChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply {
        update_checksum(hdr.ipv4.isValid() && meta.is_reply == 1,
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.totalLen,
              hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.fragOffset, hdr.ipv4.ttl,
              hdr.ipv4.protocol, hdr.ipv4.srcAddr, hdr.ipv4.dstAddr },
            hdr.ipv4.hdrChecksum, HashAlgorithm.csum16);
    }
}

control ThcDeparser(packet_out packet, in headers_t hdr) {
    apply {
        packet.emit(hdr.ethernet);
        packet.emit(hdr.ipv4);
        packet.emit(hdr.udp);
        packet.emit(hdr.thc);
        packet.emit(hdr.thc_data);
        packet.emit(hdr.thc_result8);
        packet.emit(hdr.thc_result16);
        packet.emit(hdr.thc_max);
    }
}

V1Switch(ThcParser(), ThcVerifyChecksum(), ThcIngress(), ThcEgress(), ThcComputeChecksum(),
         ThcDeparser()) main;
