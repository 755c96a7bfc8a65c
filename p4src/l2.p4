/*
 * Plain L2 forwarding (P4_16, v1model): the BMv2 throughput ceiling that `thc bench switch`
 * compares the aggregation program against. Same l2_forward table as thc.p4 (key dst_mac,
 * actions l2_set_port / l2_miss), so controller/forwarding.py programs both.
 */
#include <core.p4>
#include <v1model.p4>

header ethernet_h {
    bit<48> dstAddr;
    bit<48> srcAddr;
    bit<16> etherType;
}

struct headers_t {
    ethernet_h ethernet;
}

struct metadata_t { }

parser L2Parser(packet_in packet, out headers_t hdr, inout metadata_t meta,
                inout standard_metadata_t sm) {
    state start {
        packet.extract(hdr.ethernet);
        transition accept;
    }
}

control L2VerifyChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply { }
}

control L2Ingress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    counter(1, CounterType.packets) l2_misses;

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

    apply {
        l2_forward.apply();
    }
}

control L2Egress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    apply { }
}

control L2ComputeChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply { }
}

control L2Deparser(packet_out packet, in headers_t hdr) {
    apply {
        packet.emit(hdr.ethernet);
    }
}

V1Switch(L2Parser(), L2VerifyChecksum(), L2Ingress(), L2Egress(), L2ComputeChecksum(),
         L2Deparser()) main;
