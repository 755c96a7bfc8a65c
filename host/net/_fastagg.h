/* What the parts of the compiled datapath (_fastagg.c) share: the packet header as this
 * extension reads and writes it, the UDP batching helpers, and the helpers for loops that run
 * without the GIL. */
#ifndef THC_FASTAGG_H
#define THC_FASTAGG_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

/* The header this extension parses: protocol.json's field order and widths. cext.py compares
 * HEADER_LAYOUT with protocol.json and refuses the module if they differ. */
#define HDR 28
#define MAX_WORKERS 32 /* the bitmap field is 32 bits */
#define BATCH 64
/* protocol.py's EPOCH_TAG_SHIFT and SHARD_DETAIL_SHIFT (cext.py checks): the bits of an
 * epoch above its nonce (the configuration tag), of a wrong_shard detail above its shard */
#define TAG_SHIFT 16
#define SHARD_SHIFT 16
#define RECV_BYTES 2048 /* server.DATAGRAM_BYTES (cext.py checks): longer datagrams truncate */
#define OUT_BYTES 1536

/* The packet types, in the order Python passes their codes (cext.TYPE_CODES). */
enum { T_DATA, T_MAX, T_RESULT, T_MAX_RESULT, T_PENDING, T_RESET, T_FLUSH, T_REFUSED,
       N_TYPES };

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static inline uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static inline void wr16(uint8_t *p, uint16_t v) { p[0] = v >> 8; p[1] = (uint8_t)v; }
static inline void wr32(uint8_t *p, uint32_t v) {
    p[0] = v >> 24; p[1] = (uint8_t)(v >> 16); p[2] = (uint8_t)(v >> 8); p[3] = (uint8_t)v;
}
/* RFC 1982 order on 32 bits: is a newer than b? */
static inline int newer(uint32_t a, uint32_t b) {
    uint32_t d = a - b;
    return d != 0 && d < 0x80000000u;
}

static inline void write_header(uint8_t *p, uint8_t type, uint8_t worker, uint16_t job,
                                uint16_t slot, uint8_t version, uint8_t count, uint32_t seq,
                                uint32_t offset, uint32_t bitmap, uint32_t run,
                                uint32_t epoch) {
    p[0] = type; p[1] = worker; wr16(p + 2, job); wr16(p + 4, slot); p[6] = version;
    p[7] = count; wr32(p + 8, seq); wr32(p + 12, offset); wr32(p + 16, bitmap);
    wr32(p + 20, run); wr32(p + 24, epoch);
}

/* _fastagg.c: helpers for the loops and their arguments */
double now_s(void);
int as_ulong(PyObject *o, void *out);
int on_main_thread(void);
PyObject *items_of(PyObject *o, const char *what);
int signalled(int main, double now, double *last_check);

/* _fastagg_udp.c: UDP GSO sends and GRO receives */
#define GSO_SEGS 64
#define GSO_BYTES 65000
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#define GRO_BATCH 16
#define GRO_BYTES 65536
#define GRO_CTL (CMSG_SPACE(sizeof(int)) + CMSG_SPACE(sizeof(struct in_pktinfo)))
extern int gso_ok;
int gso_refused(int err);
void gro_set(int fd, int on);
size_t gro_segment(struct msghdr *h, size_t *len, size_t plain_cap);
void rx_arm(struct mmsghdr *msgs, struct iovec *iov, char (*ctl)[GRO_CTL], uint8_t *buf,
            int n, size_t bytes, struct sockaddr_in *src);

/* The parts: each adds its names to the module. */
int fa_add_datapath(PyObject *module); /* _fastagg_serve.c: the aggregator */
PyObject *fa_drive(PyObject *self, PyObject *args); /* _fastagg_load.c */
PyObject *fa_stream(PyObject *self, PyObject *args); /* _fastagg_stream.c */
int fa_add_stream(PyObject *module);

#endif
