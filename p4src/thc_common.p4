/*
 * Headers shared by the BMv2 program (thc.p4) and the Tofino one (thc_tna.p4): the
 * Ethernet/IPv4/UDP headers, the lane-group payload headers and the parsed header set.
 * Included after generated/thc_constants.p4 and generated/thc_headers.p4.
 */
#ifndef THC_COMMON_P4
#define THC_COMMON_P4

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

// DATA payload of one lane group: 8 lanes, two 4-bit indices a byte, the first lane in the
// high nibble of b0.
header thc_idx_h {
    bit<8> b0;
    bit<8> b1;
    bit<8> b2;
    bit<8> b3;
}

// DATA payload of one lane group of a vote job: 8 sign bits (1 = +1), the first lane in
// the high bit. Ingress widens it to a thc_idx_h of 0/1 indices (ThcVoteGroup in thc.p4).
header thc_vote_h {
    bit<8> b;
}

// RESULT payload of one lane group of an 8-bit job: 8 sums, four a word, big-endian.
header thc_sum8_h {
    bit<32> w0;
    bit<32> w1;
}

// RESULT payload of one lane group of a 16-bit job: 8 sums, two a word, big-endian.
header thc_sum16_h {
    bit<32> w0;
    bit<32> w1;
    bit<32> w2;
    bit<32> w3;
}

// MAX / MAX_RESULT payload: one 32-bit value (raw float bits) per max lane.
header thc_max_h {
    bit<32> v;
}

struct headers_t {
    ethernet_h  ethernet;
    ipv4_h      ipv4;
    udp_h       udp;
    thc_h       thc;
    thc_idx_h[THC_GROUPS]     thc_data;
    thc_vote_h[THC_GROUPS]    thc_vote;
    thc_sum8_h[THC_GROUPS]    thc_result8;
    thc_sum16_h[THC_GROUPS]   thc_result16;
    thc_max_h[THC_MAX_LANES]  thc_max;
}

#endif
