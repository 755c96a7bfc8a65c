/*
 * THC in-network aggregation switch (P4_16, v1model / BMv2 simple_switch_grpc).
 *
 * Workers send DATA packets (LANES 4-bit indices into the job's THC lookup table) or MAX
 * packets (MAX_LANES 32-bit values) over Eth/IPv4/UDP to port THC_UDP_PORT. The switch maps
 * every index through the job's table (per-lane tables thc_lut_<i>), adds the values into
 * per-lane registers of the slot (thc_sum_<i>), and when all workers of the job have
 * contributed, multicasts a RESULT (LANES sums) to every worker. Slots come in two versions
 * (SwitchML shadow copies); a worker bitmap per slot/version gives exactly-once aggregation
 * under loss, duplication and reordering. See docs/switch.md.
 *
 * Protocol constants, the header layout and everything per lane are generated from
 * host/wire/protocol.json by p4src/gen_p4.py into p4src/generated/.
 *
 * Written Tofino style: every register is touched by at most one register action per
 * packet (read-modify-write in one action), no loops, no variable shifts, arithmetic on
 * 32 bits at most, one register and one lookup table per lane.  The one exception is
 * RESET (controller packet-out), which clears both versions of a slot in one pass; a TNA
 * port sends one RESET per version or recirculates once.
 */
#include <core.p4>
#include <v1model.p4>

#include "generated/thc_constants.p4"
#include "generated/thc_headers.p4"

const bit<16> ETHERTYPE_IPV4 = 0x0800;
const bit<8> IPPROTO_UDP = 17;

header ethernet_h {
    bit<48> dstAddr;
    bit<48> srcAddr;
    bit<16> etherType;
}

header ipv4_h {
    bit<4>  version;
    bit<4>  ihl;
    bit<8>  diffserv;
    bit<16> totalLen;
    bit<16> identification;
    bit<3>  flags;
    bit<13> fragOffset;
    bit<8>  ttl;
    bit<8>  protocol;
    bit<16> hdrChecksum;
    bit<32> srcAddr;
    bit<32> dstAddr;
}

header udp_h {
    bit<16> srcPort;
    bit<16> dstPort;
    bit<16> length;
    bit<16> checksum;
}

struct headers_t {
    ethernet_h   ethernet;
    ipv4_h       ipv4;
    udp_h        udp;
    thc_h        thc;
    thc_data_h   thc_data;
    thc_result_h thc_result;
    thc_max_h    thc_max;
}

struct metadata_t {
    // from thc_job
    bit<8>  job_index;
    bit<8>  n_workers;
    bit<16> pool_base;
    bit<16> pool_size;
    bit<32> full_bitmap;
    bit<16> mcast_grp;
    // from thc_worker
    bit<32> worker_bit;
    // register addressing
    bit<32> reg_index;      // (pool_base + slot) * 2 + version
    bit<32> jc_base;        // job_index * THC_N_JOB_COUNTERS
    // slot state as seen by this packet
    bit<32> cur_seq;
    bit<32> seq_diff;
    bit<1>  seq_newer;
    bit<32> old_bitmap;
    bit<32> bitmap;
    bit<8>  count;
    bit<1>  dup;            // this worker's bit was already set: retransmission
    bit<1>  first;          // first contribution of this use of the slot: overwrite lanes
    // lane masks: new = (old & keep) + (value & add)
    bit<THC_SUM_BITS> keep_sum;
    bit<THC_SUM_BITS> add_sum;
    bit<32> keep_max;
    bit<32> add_max;
    // scratch of the lane register actions
    bit<THC_SUM_BITS> lane_sum;
    bit<32> lane_max;
    bit<32> lane_val;
    // outcome
    bit<8>  drop_reason;
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
            (THC_MAX, THC_UDP_LEN_MAX): parse_max;
            default: accept;
        }
    }
    state parse_data {
        packet.extract(hdr.thc_data);
        transition accept;
    }
    state parse_max {
        packet.extract(hdr.thc_max);
        transition accept;
    }
}

control ThcVerifyChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply { }
}

control ThcIngress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    counter(THC_N_DROP_REASONS, CounterType.packets) thc_drops;
    counter(THC_MAX_JOBS * THC_N_JOB_COUNTERS, CounterType.packets) thc_job_counters;
    counter(THC_MAX_JOBS, CounterType.packets) thc_resets;
    counter(1, CounterType.packets) l2_misses;

    // Slot state, index (pool_base + slot) * 2 + version.
    register<bit<32>>(THC_REG_SIZE) thc_seq;
    register<bit<32>>(THC_REG_SIZE) thc_bitmap;
    register<bit<8>>(THC_REG_SIZE) thc_count;

    // Per-lane registers, lookup tables and register actions (generated).
#include "generated/thc_lanes.p4"

    // ---- configuration tables (installed by controller/jobs.py) ----
    action set_job(bit<8> job_index, bit<8> n_workers, bit<16> pool_base, bit<16> pool_size,
                   bit<32> full_bitmap, bit<16> mcast_grp) {
        meta.job_index = job_index;
        meta.n_workers = n_workers;
        meta.pool_base = pool_base;
        meta.pool_size = pool_size;
        meta.full_bitmap = full_bitmap;
        meta.mcast_grp = mcast_grp;
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

    // RFC 1982 serial order: newer iff 0 < seq - cur < 2^31; stale iff bit 31 of the
    // difference is set; equal otherwise. A newer seq starts a new use of the slot.
    action thc_seq_ra() {
        thc_seq.read(meta.cur_seq, meta.reg_index);
        meta.seq_diff = hdr.thc.seq - meta.cur_seq;
        meta.seq_newer = (meta.seq_diff != 0 && meta.seq_diff[31:31] == 0) ? 1w1 : 1w0;
        thc_seq.write(meta.reg_index, (meta.seq_newer == 1) ? hdr.thc.seq : meta.cur_seq);
    }

    action thc_bitmap_ra() {
        thc_bitmap.read(meta.old_bitmap, meta.reg_index);
        meta.dup = (meta.seq_newer == 0 && (meta.old_bitmap & meta.worker_bit) != 0) ? 1w1 : 1w0;
        meta.first = (meta.seq_newer == 1 || meta.old_bitmap == 0) ? 1w1 : 1w0;
        meta.bitmap = (meta.seq_newer == 1) ? meta.worker_bit : (meta.old_bitmap | meta.worker_bit);
        thc_bitmap.write(meta.reg_index, meta.bitmap);
        // lane masks (see the lane register actions)
        meta.keep_sum = (meta.first == 1) ? (bit<THC_SUM_BITS>)0 : ~(bit<THC_SUM_BITS>)0;
        meta.add_sum = (meta.dup == 1) ? (bit<THC_SUM_BITS>)0 : ~(bit<THC_SUM_BITS>)0;
        meta.keep_max = (meta.first == 1) ? 32w0 : ~32w0;
        meta.add_max = (meta.dup == 1) ? 32w0 : ~32w0;
    }

    action thc_count_ra() {
        thc_count.read(meta.count, meta.reg_index);
        meta.count = (meta.first == 1) ? 8w1 : ((meta.dup == 1) ? meta.count : meta.count + 1);
        thc_count.write(meta.reg_index, meta.count);
    }

    // RESET (controller packet-out): both versions of the slot become unused.
    action thc_reset_ra() {
        thc_seq.write(meta.reg_index & ~32w1, THC_SEQ_RESET);
        thc_seq.write(meta.reg_index | 32w1, THC_SEQ_RESET);
        thc_bitmap.write(meta.reg_index & ~32w1, 0);
        thc_bitmap.write(meta.reg_index | 32w1, 0);
        thc_count.write(meta.reg_index & ~32w1, 0);
        thc_count.write(meta.reg_index | 32w1, 0);
    }

    // ---- replies ----
    action thc_reply(bit<8> pkt_type) {
        hdr.thc.pkt_type = pkt_type;
        hdr.thc.count = meta.count;
        hdr.thc.bitmap = meta.bitmap;
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

    apply {
        if (hdr.udp.isValid() && hdr.udp.dstPort == THC_UDP_PORT) {
            // 1. well-formed, right direction
            if (!hdr.thc.isValid() || sm.parser_error != error.NoError
                    || hdr.udp.length < THC_UDP_LEN_HDR) {
                meta.drop_reason = THC_DROP_MALFORMED;
            } else if (!(THC_KNOWN_TYPE(hdr.thc.pkt_type)) || hdr.thc.version > 1) {
                meta.drop_reason = THC_DROP_MALFORMED;
            } else if (THC_REPLY_TYPE(hdr.thc.pkt_type)) {
                meta.drop_reason = THC_DROP_WRONG_DIRECTION;
            } else if (hdr.thc.pkt_type == THC_RESET && sm.ingress_port != THC_CPU_PORT) {
                meta.drop_reason = THC_DROP_NOT_FROM_CPU;
            }
            // 2. job
            if (meta.drop_reason == 0) {
                if (!thc_job.apply().hit) {
                    meta.drop_reason = THC_DROP_UNKNOWN_JOB;
                }
            }
            // 3. payload length
            if (meta.drop_reason == 0) {
                if ((hdr.thc.pkt_type == THC_DATA && !hdr.thc_data.isValid())
                        || (hdr.thc.pkt_type == THC_MAX && !hdr.thc_max.isValid())
                        || (hdr.thc.pkt_type == THC_RESET && hdr.udp.length != THC_UDP_LEN_HDR)) {
                    meta.drop_reason = THC_DROP_BAD_LANES;
                }
            }
            // 4., 5. worker (RESET comes from the controller, not from a worker)
            if (meta.drop_reason == 0 && hdr.thc.pkt_type != THC_RESET) {
                if (hdr.thc.worker_id >= meta.n_workers) {
                    meta.drop_reason = THC_DROP_WORKER_OUTSIDE_JOB;
                } else if (!thc_worker.apply().hit) {
                    meta.drop_reason = THC_DROP_UNKNOWN_WORKER;
                }
            }
            // 6. slot
            if (meta.drop_reason == 0 && hdr.thc.slot >= meta.pool_size) {
                meta.drop_reason = THC_DROP_SLOT_OUTSIDE_POOL;
            }
            // 7. aggregation
            if (meta.drop_reason == 0) {
                thc_index();
                if (hdr.thc.pkt_type == THC_RESET) {
                    thc_reset_ra();
                    thc_resets.count((bit<32>)meta.job_index);
                    mark_to_drop(sm);
                } else {
                    thc_seq_ra();
                    if (meta.seq_newer == 0 && meta.seq_diff != 0) {
                        meta.drop_reason = THC_DROP_STALE;
                    } else {
                        thc_job_counters.count(meta.jc_base + THC_JC_PACKETS);
                        thc_bitmap_ra();
                        thc_count_ra();
                        if (meta.dup == 0 && hdr.thc.pkt_type == THC_DATA) {
                            hdr.thc_result.setValid();
#include "generated/thc_lanes_apply.p4"
                        }
                        if (meta.dup == 0 || meta.count == meta.n_workers) {
                            if (hdr.thc.pkt_type == THC_DATA) {
                                hdr.thc_result.setValid();
                                thc_sum_lanes();
                            } else {
                                thc_max_lanes();
                            }
                        }
                        if (meta.count == meta.n_workers) {
                            // complete: RESULT / MAX_RESULT with the stored lanes
                            if (hdr.thc.pkt_type == THC_DATA) {
                                hdr.thc_data.setInvalid();
                                hdr.udp.length = THC_UDP_LEN_RESULT;
                                thc_reply(THC_RESULT);
                            } else {
                                thc_reply(THC_MAX_RESULT);
                            }
                            if (meta.dup == 1) {
                                thc_job_counters.count(meta.jc_base + THC_JC_RETRANSMISSIONS);
                                thc_to_sender();
                            } else {
                                thc_job_counters.count(meta.jc_base + THC_JC_COMPLETIONS);
                                thc_to_job();
                            }
                        } else if (meta.dup == 1) {
                            // retransmission of an incomplete slot: tell the worker where it stands
                            hdr.thc_data.setInvalid();
                            hdr.thc_max.setInvalid();
                            hdr.udp.length = THC_UDP_LEN_HDR;
                            thc_reply(THC_PENDING);
                            thc_job_counters.count(meta.jc_base + THC_JC_PENDING);
                            thc_to_sender();
                        } else {
                            mark_to_drop(sm);   // consumed, waiting for the other workers
                        }
                        hdr.ipv4.totalLen = hdr.udp.length + 20;
                    }
                }
            }
            if (meta.drop_reason != 0) {
                thc_drops.count((bit<32>)meta.drop_reason);
                mark_to_drop(sm);
            }
        } else if (hdr.ethernet.isValid()) {
            l2_forward.apply();
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
        packet.emit(hdr.thc_result);
        packet.emit(hdr.thc_max);
    }
}

V1Switch(ThcParser(), ThcVerifyChecksum(), ThcIngress(), ThcEgress(), ThcComputeChecksum(),
         ThcDeparser()) main;
