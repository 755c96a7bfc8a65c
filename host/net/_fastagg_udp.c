/* UDP batching shared by the aggregator, the load generator and the client window.
 *
 * Sending: datagrams to one destination with one length leave as one UDP GSO send
 * (UDP_SEGMENT) where the kernel has it and the caller was made with gso: one trip down
 * the stack for up to GSO_SEGS datagrams, each still delivered as its own datagram, in
 * order per destination. A NIC (or the stack before the driver) cuts them into packets; an
 * emulated link (veth, as in Mininet) carries the burst as one skb, as it does TCP's
 * segments, so the testbed turns GSO off where a loss rule would drop it whole. Otherwise,
 * or where GSO is refused, every datagram is sent alone (sendmmsg batches).
 *
 * Receiving with UDP GRO: the kernel hands a peer's GSO burst up as one buffer of
 * equal-sized datagrams (the last may be shorter) and says their size in a UDP_GRO control
 * message. One trip up the stack for the burst, as for TCP's segments. A datagram without it
 * is one datagram, truncated as the plain receive buffer would. */
#include "_fastagg.h"

/* Cleared, for the process, at the first GSO send the kernel refuses. */
int gso_ok = 1;

/* Why the kernel may refuse a UDP GSO send it would take datagram by datagram: no
 * checksum offload (EIO), no UDP_SEGMENT (ENOPROTOOPT, EOPNOTSUPP), a segment larger than
 * the route's MTU (EINVAL before Linux 6.x, EMSGSIZE since). */
int gso_refused(int err) {
    return err == EIO || err == EINVAL || err == EMSGSIZE || err == ENOPROTOOPT ||
           err == EOPNOTSUPP;
}

void gro_set(int fd, int on) {
    (void)setsockopt(fd, SOL_UDP, UDP_GRO, &on, sizeof on); /* refused: plain datagrams */
}

/* The size of the datagrams in a received buffer of len bytes, and the bytes to read of it
 * (len, or plain_cap where it came without a UDP_GRO message). */
size_t gro_segment(struct msghdr *h, size_t *len, size_t plain_cap) {
    if (h->msg_controllen)
        for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c; c = CMSG_NXTHDR(h, c))
            if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) {
                int v;
                memcpy(&v, CMSG_DATA(c), sizeof v);
                if (v > 0) return (size_t)v < *len ? (size_t)v : *len;
            }
    if (*len > plain_cap) *len = plain_cap;
    return *len;
}

/* Point msgs[0..n) at n receive buffers of bytes each, with room for a UDP_GRO message and,
 * where src is given, the sender's address. */
void rx_arm(struct mmsghdr *msgs, struct iovec *iov, char (*ctl)[GRO_CTL], uint8_t *buf,
            int n, size_t bytes, struct sockaddr_in *src) {
    for (int k = 0; k < n; k++) {
        iov[k].iov_base = buf + (size_t)k * bytes;
        iov[k].iov_len = bytes;
        struct msghdr *h = &msgs[k].msg_hdr;
        memset(h, 0, sizeof *h);
        if (src) {
            h->msg_name = &src[k];
            h->msg_namelen = sizeof src[k];
        }
        h->msg_iov = &iov[k];
        h->msg_iovlen = 1;
        h->msg_control = ctl[k];
        h->msg_controllen = GRO_CTL;
    }
}
