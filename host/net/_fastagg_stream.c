/* The client's sliding window (host/net/pywindow.py's PythonWindow, but for impairments):
 * one worker's chunks out with sendmmsg, replies in with recvmmsg, each reply validated as the
 * Python loop validates it, retransmission on timeout with exponential backoff and the same
 * fast-retransmit rule, RFC 6298's estimator per shard, DLCP's bounded loss (FLUSH) and DSCP
 * marks (an IP_TOS control message), without the GIL. Python keeps the exceptions: stream()
 * returns an event (done, an epoch change, a deadline) for it to raise. */
#include "_fastagg.h"

#define CL_RECV_BYTES 4096 /* window.RECV_BYTES (cext.py checks) */
/* stream()'s arguments and timeout report: host/net/fastclient.py refuses another version */
#define CL_WINDOW_VERSION 12
#define CL_OUT_BYTES 2048
/* per chunk in the window: retransmitted (no RTT sample: Karn), overtaken by a later
 * chunk of its shard (a lost packet, not a missing worker: its timer does not back off),
 * resent once, by its timer, before any reply (a second RESULT then shows the timeout
 * spurious: host/net/window.py's RttEstimator) */
enum { M_RESENT = 1, M_OVERTAKEN = 2, M_LONE = 4, M_UNPAIRED = 8 };
/* M_UNPAIRED: its PENDINGs give no sample (resent twice, or a PENDING came already) */

enum { EV_DONE, EV_RESTARTED, EV_TIMEOUT, EV_OSERROR, EV_REFUSED, EV_SHORT, EV_MISCONFIGURED };
enum { S_SENT, S_RETRANSMITTED, S_RECEIVED, S_IGNORED, S_OTHER_RUN, S_PENDING, S_BYTES_SENT,
       S_BYTES_RECEIVED, S_REJECTED, S_SPURIOUS, S_ELSEWHERE, S_GSO_SENDS, S_GRO_BURSTS,
       S_STRAYS, S_QUEUE_FULL, S_FLUSHED, S_SHORT, N_CSTATS };

/* Control data room for a UDP_SEGMENT size and an IP_TOS byte, aligned for cmsghdr. */
typedef union {
    char buf[CMSG_SPACE(sizeof(uint16_t)) + CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
} Ctl;

/* What ended the round, for Python to raise (stream()'s info). */
typedef struct {
    int event;
    long chunk;
    long long old, new, bitmap, code; /* bitmap: -1 for none */
    int shard, unanswered;
    double silent;
    unsigned long long rejected, taken, not_float;
} Event;

typedef struct {
    int fd, n_shards, window, lanes, n_workers, is_data, chunk_bytes;
    uint8_t pkt_type, result_type, pending_type, worker;
    uint16_t job_id;
    uint32_t pool, run, incarnation; /* incarnation: sent in the epoch field upstream */
    uint32_t up_tag;                 /* the configuration tag, sent in the bitmap field */
    uint64_t base, offset_base;
    const uint8_t *chunks;
    struct sockaddr_in *aggs;
    double timeout, max_timeout;
    double *srtt, *rttvar;
    /* the send queue */
    uint8_t *sbuf;
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    uint8_t qtos[BATCH]; /* each queued datagram's TOS byte (0: unmarked) */
    Ctl qctl[BATCH];
    int nq;
    int gso; /* DATA to one shard leaves as one UDP GSO send; replies come in by GRO */
    unsigned long long st[N_CSTATS];
    int err; /* errno of a send the kernel refused for good */
    /* per shard (one shard's replies say nothing of another's): when it last answered, its
     * impossible replies, and the times of the first silent_after resends to it since */
    double *last_reply, *asked;
    int *nasked;
    unsigned long long *rejected, *taken; /* per shard: impossible replies, chunks it ended */
    unsigned long long *not_float; /* per shard: of them, MAX_RESULTs with a lane no float has */
    int silent_after;
    /* the job, as its replies are checked */
    uint8_t other_result, refused_type;
    unsigned long tag, tag_mask; /* an epoch learnt holds the tag: epoch & tag_mask == tag */
    uint32_t top, full;          /* the largest table value (MAX: float bits); every worker */
    int vote, wire_bytes, out_itemsize, expect_payload;
    uint32_t lut[16];            /* the job's table, for the check of our own value */
    const uint8_t *reach;        /* Job.reachable_sums, rows of reach_stride (the call's) */
    uint32_t reach_stride;
    uint8_t *out;                /* total * lanes results of out_itemsize bytes */
    uint8_t *counts;             /* per chunk: workers its result counts (filled with all) */
    uint32_t *bitmaps;           /* per chunk: which (filled with all) */
    /* DLCP: per chunk its DATA's TOS byte (NULL: none, and the head's backoff capped), the
     * FLUSH's; the chunks this worker may close short (0: no loss bound) and that may end
     * short in all (window.py's flush_budget and Round.short_cap); per shard, whether its
     * epoch was known before the round (only such a shard is asked to close a chunk) */
    const uint8_t *tos, *heard;
    uint8_t flush_tos, flush_type;
    long budget, short_cap;
    long n_short, ended_short; /* chunks marked short; chunks ended short */
    uint8_t *is_short; /* per chunk: flushed by us (until it ends full) or ended short */
    /* window.py's timing rules */
    double deadline;
    int fast_after, backoff_cap, recv_batch;
    /* the round: chunks [lo, hi) of total are in flight */
    long total, lo, hi;
    long long *epoch; /* per shard: the epoch learnt, -1 before */
    uint8_t *done;    /* per chunk */
    /* per chunk resent M_LONE: its first send's round trip, -1 for none, and when the
     * second RESULT may come (the resend's delay after the first, halved: a duplicate of
     * one answer comes at once) */
    double *answered, *earliest;
    /* per window slot: its chunk's marks, due time, backoff, first send, overtakes, last
     * PENDING (bit 32: held; -1 none), and when its first resend went (for that delay, and
     * the PENDING that answers it: window.py's RttEstimator) */
    uint8_t *mark;
    double *due, *backoff, *started, *resent_at;
    int *later;
    long long *pend;
    /* receiving: nmsg buffers of rbytes (GRO bursts where gso) */
    int nmsg;
    size_t rbytes;
    uint8_t *rbuf;
    struct mmsghdr *rmsgs;
    struct iovec *riov;
    struct sockaddr_in *rsrc;
    char (*rctl)[GRO_CTL];
    Event ev;
} Client;

static inline int cl_shard(Client *c, long i) {
    return (int)((uint32_t)(c->base + (uint64_t)i) % (uint32_t)c->n_shards);
}

static double cl_rto(Client *c, int shard) {
    if (c->srtt[shard] < 0) return c->timeout;
    double margin = 4 * c->rttvar[shard];
    double r = c->srtt[shard] + (margin > c->timeout ? margin : c->timeout);
    return r < c->max_timeout ? r : c->max_timeout;
}

static void cl_sample_rtt(Client *c, int shard, double rtt) {
    if (c->srtt[shard] < 0) {
        c->srtt[shard] = rtt;
        c->rttvar[shard] = rtt / 2;
    } else {
        c->rttvar[shard] = 0.75 * c->rttvar[shard] + 0.25 * fabs(c->srtt[shard] - rtt);
        c->srtt[shard] = 0.875 * c->srtt[shard] + 0.125 * rtt;
    }
}

/* A send the kernel refused for good is remembered; a full queue loses the n datagrams, as
 * the network may (counted: a round that times out names them): the timer resends them. */
static void cl_refused(Client *c, int e, size_t n) {
    if (e == EAGAIN || e == EWOULDBLOCK || e == ENOBUFS || e == ENOMEM) c->st[S_QUEUE_FULL] += n;
    else if (!c->err) c->err = e;
}

/* h's control data: a UDP_SEGMENT of seg bytes where seg > 0, an IP_TOS where tos > 0. */
static void cl_control(struct msghdr *h, Ctl *ctl, uint16_t seg, uint8_t tos) {
    h->msg_control = NULL;
    h->msg_controllen = 0;
    if (!seg && !tos) return;
    memset(ctl, 0, sizeof *ctl);
    h->msg_control = ctl->buf;
    h->msg_controllen = sizeof ctl->buf;
    struct cmsghdr *cm = CMSG_FIRSTHDR(h);
    size_t used = 0;
    if (seg) {
        cm->cmsg_level = SOL_UDP;
        cm->cmsg_type = UDP_SEGMENT;
        cm->cmsg_len = CMSG_LEN(sizeof seg);
        memcpy(CMSG_DATA(cm), &seg, sizeof seg);
        used += CMSG_SPACE(sizeof seg);
        cm = CMSG_NXTHDR(h, cm);
    }
    if (tos) {
        int t = tos;
        cm->cmsg_level = IPPROTO_IP;
        cm->cmsg_type = IP_TOS;
        cm->cmsg_len = CMSG_LEN(sizeof t);
        memcpy(CMSG_DATA(cm), &t, sizeof t);
        used += CMSG_SPACE(sizeof t);
    }
    h->msg_controllen = used;
}

/* The queue as one GSO send per shard, length and TOS byte (order kept within each); 0
 * where GSO is off or was refused, and the caller sends the queue datagram by datagram. */
static int cl_flush_gso(Client *c) {
    if (!c->gso || c->nq < 2 || !__atomic_load_n(&gso_ok, __ATOMIC_RELAXED)) return 0;
    struct mmsghdr g[BATCH];
    struct iovec iov[BATCH];
    Ctl ctl[BATCH];
    uint8_t taken[BATCH] = {0}, gtos[BATCH];
    int ng = 0, niov = 0;
    for (int k = 0; k < c->nq; k++) {
        if (taken[k]) continue;
        size_t len = c->iov[k].iov_len;
        int max_segs = (int)(GSO_BYTES / len);
        if (max_segs > GSO_SEGS) max_segs = GSO_SEGS;
        struct msghdr *h = &g[ng].msg_hdr;
        memset(h, 0, sizeof *h);
        h->msg_name = c->msgs[k].msg_hdr.msg_name;
        h->msg_namelen = sizeof(struct sockaddr_in);
        h->msg_iov = &iov[niov];
        gtos[ng] = c->qtos[k];
        for (int j = k; j < c->nq && (int)h->msg_iovlen < max_segs; j++)
            if (!taken[j] && c->msgs[j].msg_hdr.msg_name == h->msg_name &&
                c->iov[j].iov_len == len && c->qtos[j] == gtos[ng]) {
                taken[j] = 1;
                iov[niov++] = c->iov[j];
                h->msg_iovlen++;
            }
        cl_control(h, &ctl[ng], h->msg_iovlen > 1 ? (uint16_t)len : 0, gtos[ng]);
        ng++;
    }
    int done = 0;
    while (done < ng) {
        int r = sendmmsg(c->fd, g + done, (unsigned)(ng - done), 0);
        if (r >= 0) {
            for (int m = done; m < done + r; m++)
                if (g[m].msg_hdr.msg_iovlen > 1) c->st[S_GSO_SENDS]++;
            done += r;
            continue;
        }
        int e = errno;
        if (e == EINTR) continue;
        if (g[done].msg_hdr.msg_iovlen > 1 && gso_refused(e)) {
            __atomic_store_n(&gso_ok, 0, __ATOMIC_RELAXED);
            if (done == 0) return 0;
            /* the groups not sent, datagram by datagram */
            int nq = 0;
            for (int m = done; m < ng; m++)
                for (size_t v = 0; v < g[m].msg_hdr.msg_iovlen; v++) {
                    c->iov[nq] = g[m].msg_hdr.msg_iov[v];
                    c->qtos[nq] = gtos[m];
                    struct msghdr *h = &c->msgs[nq].msg_hdr;
                    memset(h, 0, sizeof *h);
                    h->msg_name = g[m].msg_hdr.msg_name;
                    h->msg_namelen = sizeof(struct sockaddr_in);
                    h->msg_iov = &c->iov[nq];
                    h->msg_iovlen = 1;
                    cl_control(h, &c->qctl[nq], 0, gtos[m]);
                    nq++;
                }
            c->nq = nq;
            return 0;
        }
        cl_refused(c, e, g[done].msg_hdr.msg_iovlen);
        done++;
    }
    c->nq = 0;
    return 1;
}

static void cl_flush(Client *c) {
    if (cl_flush_gso(c)) return;
    int done = 0;
    while (done < c->nq) {
        int r = sendmmsg(c->fd, c->msgs + done, (unsigned)(c->nq - done), 0);
        if (r >= 0) {
            done += r;
            continue;
        }
        int e = errno;
        if (e == EINTR) continue;
        cl_refused(c, e, 1);
        done++;
    }
    c->nq = 0;
}

/* Queue chunk i's DATA/MAX datagram (a first send or a retransmission) in its class, or
 * its FLUSH (the header alone) in the FLUSH's. */
static void cl_send(Client *c, long i, int flush) {
    if (c->nq == BATCH) cl_flush(c);
    uint64_t s = c->base + (uint64_t)i;
    uint8_t *p = c->sbuf + (size_t)c->nq * CL_OUT_BYTES;
    write_header(p, flush ? c->flush_type : c->pkt_type, c->worker, c->job_id,
                 (uint16_t)(s % c->pool), (uint8_t)((s / c->pool) % 2), 0, (uint32_t)s,
                 (uint32_t)(c->offset_base + (uint64_t)i * (uint64_t)c->lanes), c->up_tag,
                 c->run, c->incarnation);
    size_t len = HDR;
    if (!flush) {
        memcpy(p + HDR, c->chunks + (size_t)i * c->chunk_bytes, (size_t)c->chunk_bytes);
        len += (size_t)c->chunk_bytes;
    }
    c->iov[c->nq].iov_base = p;
    c->iov[c->nq].iov_len = len;
    struct msghdr *h = &c->msgs[c->nq].msg_hdr;
    memset(h, 0, sizeof *h);
    h->msg_name = &c->aggs[cl_shard(c, i)];
    h->msg_namelen = sizeof(struct sockaddr_in);
    h->msg_iov = &c->iov[c->nq];
    h->msg_iovlen = 1;
    c->qtos[c->nq] = flush ? c->flush_tos : c->tos ? c->tos[i] : 0;
    cl_control(h, &c->qctl[c->nq], 0, c->qtos[c->nq]);
    c->nq++;
    c->st[S_SENT]++;
    c->st[S_BYTES_SENT] += len;
}

/* Queue a retransmission of chunk i, or its FLUSH while the loss bound allows: a chunk
 * flushed before, or (may_flush: a timer's resend, not a fast retransmit, whose chunk may
 * merely wait in a lower class's queue) one more within the budget, at a shard heard before
 * the round. A held chunk resends its DATA: a FLUSH could only close the use empty. The first
 * silent_after since its shard last answered are remembered: a live shard answers each. */
static void cl_resend(Client *c, long i, double now, int may_flush) {
    int s = cl_shard(c, i);
    long long pend = c->pend[i % c->window];
    int held = pend >= 0 && ((pend >> 32) & 1);
    if (!held && c->budget > 0 &&
        (c->is_short[i] || (may_flush && c->n_short < c->budget && c->heard[s]))) {
        if (!c->is_short[i]) {
            c->is_short[i] = 1;
            c->n_short++;
        }
        c->st[S_FLUSHED]++;
        cl_send(c, i, 1);
    } else {
        c->st[S_RETRANSMITTED]++;
        cl_send(c, i, 0);
    }
    if (c->nasked[s] < c->silent_after) c->asked[s * c->silent_after + c->nasked[s]++] = now;
}

/* Of those resends to shard s, the ones that had an RTO to be answered. */
static int cl_unanswered(Client *c, int s, double now) {
    double rto = cl_rto(c, s);
    int n = 0;
    for (int k = 0; k < c->nasked[s]; k++) n += now - c->asked[s * c->silent_after + k] >= rto;
    return n;
}

static PyObject *list_of_doubles(const double *v, int n) {
    PyObject *l = PyList_New(n);
    for (int k = 0; l && k < n; k++) {
        PyObject *x = v[k] < 0 ? (Py_INCREF(Py_None), Py_None) : PyFloat_FromDouble(v[k]);
        if (!x) {
            Py_DECREF(l);
            return NULL;
        }
        PyList_SET_ITEM(l, k, x);
    }
    return l;
}

/* A reply no aggregator of this job sends: counted, and newer than any PENDING of its chunk
 * (the timeout names the impossible replies). */
static void cl_impossible(Client *c, int shard, long r) {
    c->st[S_IGNORED]++;
    c->st[S_REJECTED]++;
    c->rejected[shard]++;
    c->pend[r] = -1;
}

/* A RESULT of DATA: each lane (host order, `itemsize` bytes), less the worker's own table
 * value (a vote job's sign bit) where `own` is given (the result counts this worker), is a
 * sum the other contributors' table values can make: set in `row` (a row of
 * Job.reachable_sums, `stride` long). One unsigned difference also tests a lane below its
 * own value: it wraps past the row. */
static int cl_sums_bad(const uint8_t *o, int itemsize, const uint8_t *own, int lanes,
                       const uint32_t *lut, int vote, const uint8_t *row, uint32_t stride) {
    uint32_t bad = 0;
    for (int l = 0; l < lanes; l++) {
        uint32_t v = itemsize == 2 ? ((const uint16_t *)o)[l] : ((const uint32_t *)o)[l];
        if (own)
            v -= vote ? (uint32_t)(own[l >> 3] >> (7 - (l & 7))) & 1u
                      : lut[(own[l >> 1] >> (l & 1 ? 0 : 4)) & 15];
        bad |= v >= stride || !row[v < stride ? v : 0];
    }
    return bad != 0;
}


/* Send the chunks the window has room for. */
static void cl_open(Client *c, double now) {
    while (c->hi < c->total && c->hi < c->lo + c->window) {
        long r = c->hi % c->window;
        cl_send(c, c->hi, 0);
        c->due[r] = now + cl_rto(c, cl_shard(c, c->hi));
        if (c->due[r] > now + c->deadline) c->due[r] = now + c->deadline;
        c->backoff[r] = c->timeout;
        c->started[r] = now;
        c->later[r] = 0;
        c->pend[r] = -1;
        c->mark[r] = 0;
        c->hi++;
    }
}

/* When the first timer of the window is due (a timeout from now where none is). */
static double cl_next_due(Client *c, double now) {
    double next = now + c->timeout;
    int any = 0;
    for (long i = c->lo; i < c->hi; i++)
        if (!c->done[i] && (!any || c->due[i % c->window] < next)) {
            next = c->due[i % c->window];
            any = 1;
        }
    return next;
}

/* Copy a RESULT's lanes to chunk i's row of out while checking them (the row is rewritten by
 * the result that is taken): no sum above what the contributors can make, no max below ours;
 * then (cl_sums_bad) a sum that counts us holds our own value (a wrong sum where the
 * aggregator lost or overwrote it) and every sum is one the table's values make. No early
 * exit: the copy loop vectorizes. Whether one fails; *above: a MAX lane no float has. */
static int cl_lanes_bad(Client *c, const uint8_t *d, long i, int *above_out) {
    uint8_t r_count = d[7];
    uint32_t r_bitmap = rd32(d + 16);
    int lanes = c->lanes, is_data = c->is_data, wire_bytes = c->wire_bytes;
    int out_itemsize = c->out_itemsize;
    const uint8_t *q = d + HDR, *own = c->chunks + (size_t)i * c->chunk_bytes;
    uint8_t *o = c->out + (size_t)i * lanes * out_itemsize;
    /* DATA: what the contributors can sum to; MAX: the largest float's bits */
    uint32_t bound = is_data ? (uint32_t)r_count * c->top : c->top;
    int bad = 0, above = 0;
    if (wire_bytes == 1 && out_itemsize == 2) { /* 8-bit sums: the common case */
        uint16_t *o16 = (uint16_t *)o; /* numpy aligns its elements */
        uint8_t top8 = 0;
        for (int l = 0; l < lanes; l++) {
            o16[l] = q[l];
            top8 = q[l] > top8 ? q[l] : top8;
        }
        bad = top8 > bound; /* 8-bit lanes: a RESULT of DATA */
    } else {
        for (int l = 0; l < lanes; l++) {
            uint32_t v = wire_bytes == 1 ? q[l] : wire_bytes == 2 ? rd16(q + 2 * l)
                                                                 : rd32(q + 4 * l);
            above |= !is_data && v > bound;
            bad |= v > bound || (!is_data && v < rd32(own + 4 * l));
            if (out_itemsize == 2) {
                uint16_t v16 = (uint16_t)v;
                memcpy(o + 2 * l, &v16, 2);
            } else {
                memcpy(o + 4 * l, &v, 4);
            }
        }
    }
    if (is_data && !bad) {
        int ours = c->worker < 32 && (r_bitmap >> c->worker & 1);
        bad = cl_sums_bad(o, out_itemsize, ours ? own : NULL, lanes, c->lut, c->vote,
                          c->reach + (size_t)(r_count - ours) * c->reach_stride,
                          c->reach_stride);
    }
    *above_out = above;
    return bad;
}

/* Later chunks of shard overtook those before chunk i: every worker's chunks get through,
 * so these or their results were lost. Fast retransmit, and from now on resend every RTO:
 * the backoff a chunk built up while it waited for the others must not delay recovering
 * its lost result. Only a chunk of i's class is such evidence: a lower class may merely
 * wait in its queue. */
static void cl_overtaken(Client *c, long i, int shard, double now) {
    double rto = cl_rto(c, shard);
    for (long j = c->lo; j < i; j++) {
        if (c->done[j] || cl_shard(c, j) != shard || (c->tos && c->tos[j] != c->tos[i]))
            continue;
        long rj = j % c->window;
        if (++c->later[rj] == c->fast_after) {
            /* overtaken this often: lost, not merely reordered */
            cl_resend(c, j, now, 0);
            if (c->mark[rj] & M_RESENT) c->mark[rj] |= M_UNPAIRED;
            else c->resent_at[rj] = now;
            c->mark[rj] = (uint8_t)((c->mark[rj] & ~M_LONE) | M_RESENT | M_OVERTAKEN);
            c->backoff[rj] = rto;
            c->due[rj] = now + rto;
            if (c->due[rj] > c->started[rj] + c->deadline)
                c->due[rj] = c->started[rj] + c->deadline;
            c->later[rj] = -4 * c->fast_after;
        }
    }
}

/* Chunk i of shard ended by a RESULT of r_count workers: every one, or closed short (a
 * FLUSH's) within the round's cap, and its count and bitmap say who it holds. */
static void cl_ended(Client *c, long i, int shard, double now, uint8_t r_count,
                     uint32_t r_bitmap) {
    long r = i % c->window;
    if (r_count != c->n_workers) {
        if (c->ended_short >= c->short_cap) {
            c->ev.event = EV_SHORT;
            c->ev.chunk = i;
            c->ev.code = r_count;
            c->ev.bitmap = r_bitmap;
            return;
        }
        c->ended_short++;
        c->st[S_SHORT]++;
        if (!c->is_short[i]) {
            c->is_short[i] = 1;
            c->n_short++;
        }
        c->counts[i] = r_count;
        c->bitmaps[i] = r_bitmap;
    } else if (c->is_short[i]) { /* flushed, but every worker's DATA came first */
        c->is_short[i] = 0;
        c->n_short--;
    }
    c->done[i] = 1;
    c->taken[shard]++;
    if (!(c->mark[r] & M_RESENT)) cl_sample_rtt(c, shard, now - c->started[r]);
    else if (c->mark[r] & M_LONE) {
        c->answered[i] = now - c->started[r];
        c->earliest[i] = now + (c->resent_at[r] - c->started[r]) / 2;
    }
    if (i == c->lo) {
        while (c->lo < c->total && c->done[c->lo]) c->lo++;
        if (c->lo < c->hi && !c->tos) { /* the new head: the whole window waits for it */
            long rh = c->lo % c->window;
            double rto = cl_rto(c, cl_shard(c, c->lo));
            if (c->backoff[rh] > rto) c->backoff[rh] = rto;
            if (c->due[rh] > now + rto) c->due[rh] = now + rto;
        }
    }
    if (i > c->lo) cl_overtaken(c, i, shard, now);
}

static int cl_from(const struct sockaddr_in *src, const struct sockaddr_in *agg) {
    return src->sin_family == AF_INET && src->sin_addr.s_addr == agg->sin_addr.s_addr &&
           src->sin_port == agg->sin_port;
}

/* One reply of n bytes from src, taken at time now: ignored and counted, or it ends its
 * chunk, or it ends the round (c->ev). */
static void cl_take(Client *c, const uint8_t *d, size_t n, const struct sockaddr_in *src,
                    double now) {
    if (n < HDR) {
        c->st[S_IGNORED]++;
        return;
    }
    uint8_t r_type = d[0], r_count = d[7];
    uint32_t r_seq = rd32(d + 8), r_bitmap = rd32(d + 16), r_run = rd32(d + 20),
             r_epoch = rd32(d + 24);
    int shard = (int)(r_seq % (uint32_t)c->n_shards);
    uint32_t full = c->full;
    /* only the address that owns the chunk answers for it */
    if (rd16(d + 2) != c->job_id || d[1] != c->worker ||
        (r_type != c->pending_type && r_type != c->result_type && r_type != c->other_result &&
         r_type != c->refused_type)) {
        c->st[S_IGNORED]++;
        if (cl_from(src, &c->aggs[shard])) c->st[S_STRAYS]++; /* for no chunk here */
        return;
    }
    if (!cl_from(src, &c->aggs[shard])) {
        c->st[S_IGNORED]++;
        if (src->sin_family == AF_INET && src->sin_port == c->aggs[shard].sin_port)
            c->st[S_ELSEWHERE]++; /* the port, from another IP */
        return;
    }
    if (r_run != c->run) {
        c->st[S_OTHER_RUN]++;
        return;
    }
    long i = (long)(uint32_t)(r_seq - (uint32_t)c->base);
    uint64_t g = c->base + (uint64_t)i; /* the chunk's seq before the wrap */
    int ours = i < c->hi && rd16(d + 4) == r_seq % c->pool && d[6] == (uint8_t)((g / c->pool) & 1) &&
               rd32(d + 12) == (uint32_t)(c->offset_base + (uint64_t)i * c->lanes);
    if (!ours || c->done[i]) {
        c->st[S_IGNORED]++;
        if (!ours && i < c->hi) c->st[S_STRAYS]++; /* of this round */
        if (ours && c->answered[i] >= 0 && r_type == c->result_type &&
            n - HDR == (size_t)c->expect_payload && !(r_bitmap & ~full) &&
            __builtin_popcount(r_bitmap) == r_count && now >= c->earliest[i]) {
            c->st[S_SPURIOUS]++;
            cl_sample_rtt(c, shard, c->answered[i]);
            c->answered[i] = -1;
        }
        return;
    }
    c->last_reply[shard] = now;
    c->nasked[shard] = 0;
    int learn = 0; /* the shard's first epoch, taken from a reply that passes */
    if ((long long)r_epoch != c->epoch[shard]) {
        if (c->epoch[shard] >= 0) {
            c->ev.event = EV_RESTARTED;
            c->ev.shard = shard;
            c->ev.old = c->epoch[shard];
            c->ev.new = r_epoch;
            return;
        }
        if ((r_epoch & c->tag_mask) != c->tag) {
            c->ev.event = EV_MISCONFIGURED; /* another job configuration's epoch */
            c->ev.shard = shard;
            c->ev.new = r_epoch;
            return;
        }
        learn = 1;
    }
    long r = i % c->window;
    if (r_type == c->refused_type) {
        if (learn) c->epoch[shard] = r_epoch;
        c->ev.event = EV_REFUSED;
        c->ev.chunk = i;
        c->ev.code = r_count;
        c->ev.bitmap = r_bitmap;
        return;
    }
    if (r_type == c->pending_type) {
        if ((r_bitmap & ~full) || c->worker >= 32 || !(r_bitmap >> c->worker & 1) ||
            (r_count == 0 ? r_bitmap == full
                          : r_count >= c->n_workers || __builtin_popcount(r_bitmap) != r_count)) {
            /* a PENDING no aggregator sends: one without our bit (it answers our packet,
             * which acknowledged the use before and joined this one), a held one that every
             * worker acknowledged, or a wait for a chunk that has every worker */
            cl_impossible(c, shard, r);
            return;
        }
        if (learn) c->epoch[shard] = r_epoch;
        c->st[S_PENDING]++;
        /* bit 32: held (count 0: the previous use of the slot version is not yet
         * acknowledged by the workers outside the bitmap) */
        c->pend[r] = (long long)(r_bitmap & full) | ((long long)(r_count == 0) << 32);
        c->mark[r] &= (uint8_t)~M_LONE;
        if (r_count && (c->mark[r] & M_RESENT) && !(c->mark[r] & M_UNPAIRED))
            cl_sample_rtt(c, shard, now - c->resent_at[r]);
        c->mark[r] |= M_UNPAIRED;
        return;
    }
    int above = 0;
    if (r_type != c->result_type || n - HDR != (size_t)c->expect_payload ||
        (r_bitmap & ~full) || __builtin_popcount(r_bitmap) != r_count ||
        (r_count != c->n_workers && !c->is_data) || cl_lanes_bad(c, d, i, &above)) {
        cl_impossible(c, shard, r);
        c->not_float[shard] += (unsigned long long)above;
        return;
    }
    if (learn) c->epoch[shard] = r_epoch;
    cl_ended(c, i, shard, now, r_count, r_bitmap);
}

/* Take up to recv_batch waiting datagrams (then the timers, even under a flood). */
static void cl_receive(Client *c) {
    long taken = 0;
    while (c->ev.event == EV_DONE && taken < c->recv_batch) {
        rx_arm(c->rmsgs, c->riov, c->rctl, c->rbuf, c->nmsg, c->rbytes, c->rsrc);
        int got = recvmmsg(c->fd, c->rmsgs, (unsigned)c->nmsg, MSG_DONTWAIT, NULL);
        if (got <= 0) break;
        double now = now_s();
        for (int k = 0; k < got && c->ev.event == EV_DONE; k++) {
            size_t len = c->rmsgs[k].msg_len;
            size_t seg = gro_segment(&c->rmsgs[k].msg_hdr, &len, CL_RECV_BYTES);
            if (seg == 0) seg = 1; /* an empty datagram: looked at once */
            if (seg < len) c->st[S_GRO_BURSTS]++;
            for (size_t off = 0; (off == 0 || off < len) && c->ev.event == EV_DONE;
                 off += seg) {
                size_t n = len - off < seg ? len - off : seg;
                c->st[S_RECEIVED]++;
                c->st[S_BYTES_RECEIVED] += n;
                taken++;
                cl_take(c, c->rbuf + (size_t)k * c->rbytes + off, n, &c->rsrc[k], now);
            }
        }
        if (got < c->nmsg) break;
    }
}

/* The chunks whose timers are due at now: resent with backoff, or the round's timeout. */
static void cl_timers(Client *c, double now) {
    for (long i = c->lo; i < c->hi && c->ev.event == EV_DONE; i++) {
        long r = i % c->window;
        if (c->done[i] || c->due[r] > now) continue;
        if (now - c->started[r] >= c->deadline) {
            int s = cl_shard(c, i);
            c->ev.event = EV_TIMEOUT;
            c->ev.chunk = i;
            c->ev.bitmap = c->pend[r];
            c->ev.silent = now - c->last_reply[s];
            c->ev.unanswered = cl_unanswered(c, s, now);
            c->ev.rejected = c->rejected[s];
            c->ev.not_float = c->not_float[s];
            c->ev.taken = c->taken[s];
            return;
        }
        int lone = !(c->mark[r] & M_RESENT) && c->pend[r] < 0;
        cl_resend(c, i, now, 1);
        lone &= !c->is_short[i]; /* a DATA, not a FLUSH */
        if (c->mark[r] & M_RESENT) c->mark[r] |= M_UNPAIRED;
        else c->resent_at[r] = now;
        c->mark[r] = (uint8_t)((c->mark[r] & ~M_LONE) | M_RESENT | (lone ? M_LONE : 0));
        /* exponential backoff, capped at backoff_cap RTOs for the window's head (every chunk
         * behind it waits for it; with classes it may merely wait in a lower class's queue,
         * and keeps the full backoff), for a chunk that later ones overtook fast_after times
         * (a lost packet, not a missing worker) and for a held chunk; a cap, not none: a head
         * that waits for a straggler, or a chunk that is only reordered, would otherwise
         * resend every RTO */
        double b = cl_rto(c, cl_shard(c, i));
        int held = c->pend[r] >= 0 && ((c->pend[r] >> 32) & 1);
        double cap = ((i == c->lo && !c->tos) || (c->mark[r] & M_OVERTAKEN) || held)
                         ? c->backoff_cap * b
                         : c->max_timeout;
        if (c->backoff[r] > b) b = c->backoff[r];
        b *= 2;
        if (b > cap) b = cap;
        if (b > c->max_timeout) b = c->max_timeout;
        c->backoff[r] = b;
        c->due[r] = now + b;
        /* a backoff never waits past the deadline: the chunk's timeout is raised then */
        if (c->due[r] > c->started[r] + c->deadline) c->due[r] = c->started[r] + c->deadline;
    }
}

/* The round, without the GIL, until it ends (c->ev) or a signal's handler raised (1). */
static int cl_run(Client *c, int main) {
    double now = now_s(), last_check = now;
    for (int s = 0; s < c->n_shards; s++) c->last_reply[s] = now;
    while (c->lo < c->total && c->ev.event == EV_DONE) {
        cl_open(c, now);
        cl_flush(c);
        if (c->err) {
            c->ev.event = EV_OSERROR;
            break;
        }
        double next_due = cl_next_due(c, now);
        double wait = next_due - now_s();
        if (wait < 0) wait = 0;
        if (wait > 0.05) wait = 0.05; /* look at Python's signals now and then */
        struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
        struct timespec ts = {.tv_sec = (time_t)wait,
                              .tv_nsec = (long)((wait - (double)(time_t)wait) * 1e9)};
        if (ppoll(&pfd, 1, &ts, NULL) > 0) cl_receive(c);
        cl_flush(c);
        if (c->ev.event != EV_DONE) break;
        if (c->err) {
            c->ev.event = EV_OSERROR;
            break;
        }
        now = now_s();
        if (signalled(main, now, &last_check)) return 1;
        if (now < next_due) continue;
        cl_timers(c, now);
        cl_flush(c);
        if (c->ev.event == EV_DONE && c->err) c->ev.event = EV_OSERROR;
    }
    return 0;
}

/* The job's header tuple read into c, and every argument checked. */
static int cl_configure(Client *c, PyObject *hdr, Py_ssize_t chunks_len, Py_ssize_t out_len,
                        Py_ssize_t n_epochs, Py_ssize_t n_srtt, Py_ssize_t n_rttvar) {
    int pkt_type, result_type, pending_type, other_result, is_data, worker, job_id, lanes,
        n_workers, refused_type, top, vote;
    unsigned long incarnation, tag, tag_mask, up_tag, pool, run;
    unsigned long long base, offset_base;
    const char *lut_bytes, *reach;
    Py_ssize_t lut_len, reach_len;
    if (!PyArg_ParseTuple(hdr, "iiiiiiiO&kKKiiiik(kkk)y#py#", &pkt_type, &result_type,
                          &pending_type, &other_result, &is_data, &worker, &job_id, as_ulong,
                          &pool, &run, &base, &offset_base, &lanes, &n_workers, &refused_type,
                          &top, &incarnation, &tag, &tag_mask, &up_tag, &lut_bytes, &lut_len,
                          &vote, &reach, &reach_len))
        return -1;
    if (lut_len == sizeof c->lut) memcpy(c->lut, lut_bytes, sizeof c->lut);
    int chunk_bytes = c->chunk_bytes, window = c->window, out_itemsize = c->out_itemsize;
    int expect_payload = c->expect_payload, wire_bytes = lanes > 0 ? expect_payload / lanes : 0;
    if (chunk_bytes > 0) c->total = (long)(chunks_len / chunk_bytes);
    if (c->n_shards < 1 || n_epochs != c->n_shards || n_srtt != c->n_shards ||
        n_rttvar != c->n_shards || window < 1 || pool < 1 || pool > 65536 ||
        (pool & (pool - 1)) || (unsigned long)window > pool || chunk_bytes < 1 ||
        chunks_len % chunk_bytes || HDR + chunk_bytes > CL_OUT_BYTES || lanes < 1 ||
        expect_payload % lanes || (wire_bytes != 1 && wire_bytes != 2 && wire_bytes != 4) ||
        (out_itemsize != 2 && out_itemsize != 4) || out_itemsize < wire_bytes ||
        (uintptr_t)c->out % (uintptr_t)out_itemsize || /* written through typed pointers */
        n_workers < 1 || n_workers > MAX_WORKERS || worker < 0 || worker > 255 ||
        c->silent_after < 1 || c->silent_after > 64 || c->recv_batch < 1 ||
        lut_len != sizeof c->lut || top < 0 ||
        /* DATA: n_workers + 1 rows of n_workers x top + 1 sums */
        (is_data &&
         reach_len != (Py_ssize_t)(n_workers + 1) * ((Py_ssize_t)n_workers * top + 1)) ||
        (is_data ? (long long)chunk_bytes * (vote ? 8 : 2) != lanes
                 : (long long)chunk_bytes != 4LL * lanes) ||
        out_len < (Py_ssize_t)c->total * lanes * out_itemsize) {
        PyErr_SetString(PyExc_ValueError, "stream: bad arguments");
        return -1;
    }
    c->pkt_type = (uint8_t)pkt_type;
    c->result_type = (uint8_t)result_type;
    c->pending_type = (uint8_t)pending_type;
    c->other_result = (uint8_t)other_result;
    c->refused_type = (uint8_t)refused_type;
    c->is_data = is_data;
    c->worker = (uint8_t)worker;
    c->job_id = (uint16_t)job_id;
    c->pool = (uint32_t)pool;
    c->run = (uint32_t)run;
    c->base = base;
    c->offset_base = offset_base;
    c->lanes = lanes;
    c->n_workers = n_workers;
    c->full = n_workers == 32 ? 0xffffffffu : ((1u << n_workers) - 1);
    c->top = (uint32_t)top;
    c->reach = (const uint8_t *)reach;
    c->reach_stride = (uint32_t)n_workers * (uint32_t)top + 1;
    c->incarnation = (uint32_t)incarnation;
    c->tag = tag;
    c->tag_mask = tag_mask;
    c->up_tag = (uint32_t)up_tag;
    c->vote = vote;
    c->wire_bytes = wire_bytes;
    return 0;
}

static int cl_alloc(Client *c) {
    size_t shards = (size_t)c->n_shards, chunks = (size_t)c->total + 1, w = (size_t)c->window;
    c->aggs = calloc(shards, sizeof(struct sockaddr_in));
    c->srtt = calloc(shards, sizeof(double));
    c->rttvar = calloc(shards, sizeof(double));
    c->last_reply = calloc(shards, sizeof(double));
    c->asked = calloc(shards * (size_t)c->silent_after, sizeof(double));
    c->nasked = calloc(shards, sizeof(int));
    c->rejected = calloc(shards, sizeof(unsigned long long));
    c->not_float = calloc(shards, sizeof(unsigned long long));
    c->taken = calloc(shards, sizeof(unsigned long long));
    c->epoch = calloc(shards, sizeof(long long));
    c->sbuf = malloc((size_t)BATCH * CL_OUT_BYTES);
    c->done = calloc(chunks, 1);
    c->answered = malloc(chunks * sizeof(double));
    c->is_short = calloc(chunks, 1);
    c->earliest = calloc(chunks, sizeof(double));
    c->resent_at = calloc(w, sizeof(double));
    c->mark = calloc(w, 1);
    c->due = calloc(w, sizeof(double));
    c->backoff = calloc(w, sizeof(double));
    c->started = calloc(w, sizeof(double));
    c->later = calloc(w, sizeof(int));
    c->pend = calloc(w, sizeof(long long));
    c->nmsg = c->gso ? GRO_BATCH : BATCH;
    c->rbytes = c->gso ? GRO_BYTES : CL_RECV_BYTES;
    c->rbuf = malloc((size_t)c->nmsg * c->rbytes);
    c->rmsgs = calloc(BATCH, sizeof(struct mmsghdr));
    c->riov = calloc(BATCH, sizeof(struct iovec));
    c->rctl = calloc(BATCH, GRO_CTL);
    c->rsrc = calloc(BATCH, sizeof(struct sockaddr_in));
    if (!c->rsrc || !c->aggs || !c->srtt || !c->rttvar || !c->last_reply || !c->asked ||
        !c->nasked || !c->rejected || !c->not_float || !c->taken || !c->epoch || !c->sbuf ||
        !c->done || !c->mark || !c->due || !c->backoff || !c->started || !c->later ||
        !c->pend || !c->rbuf || !c->rmsgs || !c->riov || !c->rctl || !c->answered ||
        !c->earliest || !c->resent_at || !c->is_short) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < chunks; i++) c->answered[i] = -1;
    return 0;
}

/* Each shard's address, epoch and RTT estimate, from copies of the caller's lists (tuples of
 * n_shards items each, checked by cl_configure). */
static int cl_shards(Client *c, PyObject *aggs_t, PyObject *epochs_t, PyObject *srtt_t,
                     PyObject *rttvar_t) {
    int ok = 1;
    for (int s = 0; ok && s < c->n_shards; s++) {
        unsigned long ip;
        int port;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(aggs_t, s), "O&i", as_ulong, &ip, &port)) {
            ok = 0;
            break;
        }
        if (ip > 0xFFFFFFFFul || port < 0 || port > 65535) {
            PyErr_SetString(PyExc_ValueError,
                            "stream: an aggregator is an IPv4 address and a port");
            ok = 0;
            break;
        }
        c->aggs[s].sin_family = AF_INET;
        c->aggs[s].sin_addr.s_addr = htonl((uint32_t)ip);
        c->aggs[s].sin_port = htons((uint16_t)port);
        PyObject *e = PyTuple_GET_ITEM(epochs_t, s), *r = PyTuple_GET_ITEM(srtt_t, s);
        c->epoch[s] = e == Py_None ? -1 : (long long)PyLong_AsUnsignedLong(e);
        c->srtt[s] = r == Py_None ? -1.0 : PyFloat_AsDouble(r);
        c->rttvar[s] = PyFloat_AsDouble(PyTuple_GET_ITEM(rttvar_t, s));
        if (PyErr_Occurred()) ok = 0;
    }
    return ok ? 0 : -1;
}

/* The epochs learnt, written back to the caller's list, and stream()'s result. */
static PyObject *cl_report(Client *c, PyObject *epochs) {
    for (int s = 0; s < c->n_shards; s++) {
        PyObject *e = c->epoch[s] < 0 ? (Py_INCREF(Py_None), Py_None)
                                      : PyLong_FromLongLong(c->epoch[s]);
        if (!e || PyList_SetItem(epochs, s, e) < 0) return NULL; /* a list cut meanwhile */
    }
    const Event *v = &c->ev;
    PyObject *info;
    if (v->event == EV_RESTARTED)
        info = Py_BuildValue("(iLL)", v->shard, v->old, v->new);
    else if (v->event == EV_MISCONFIGURED)
        info = Py_BuildValue("(iL)", v->shard, v->new);
    else if (v->event == EV_TIMEOUT)
        info = v->bitmap < 0 ? Py_BuildValue("(lOdiKKK)", v->chunk, Py_None, v->silent,
                                             v->unanswered, v->rejected, v->taken,
                                             v->not_float)
                             : Py_BuildValue("(lLdiKKK)", v->chunk, v->bitmap, v->silent,
                                             v->unanswered, v->rejected, v->taken,
                                             v->not_float);
    else if (v->event == EV_OSERROR)
        info = PyLong_FromLong(c->err);
    else if (v->event == EV_REFUSED || v->event == EV_SHORT)
        info = Py_BuildValue("(lLL)", v->chunk, v->code, v->bitmap);
    else
        info = (Py_INCREF(Py_None), Py_None);
    PyObject *res = NULL, *st = PyTuple_New(N_CSTATS);
    for (int k = 0; st && k < N_CSTATS; k++)
        PyTuple_SET_ITEM(st, k, PyLong_FromUnsignedLongLong(c->st[k]));
    PyObject *srtt_l = list_of_doubles(c->srtt, c->n_shards);
    PyObject *rttvar_l = list_of_doubles(c->rttvar, c->n_shards);
    if (info && st && srtt_l && rttvar_l)
        res = Py_BuildValue("(iOOOO)", v->event, info, st, srtt_l, rttvar_l);
    Py_XDECREF(info); Py_XDECREF(st); Py_XDECREF(srtt_l); Py_XDECREF(rttvar_l);
    return res;
}

static void cl_free(Client *c) {
    free(c->aggs); free(c->srtt); free(c->rttvar); free(c->sbuf);
    free(c->last_reply); free(c->asked); free(c->nasked); free(c->rejected);
    free(c->not_float); free(c->taken); free(c->epoch); free(c->done); free(c->answered);
    free(c->earliest); free(c->resent_at); free(c->is_short); free(c->mark); free(c->due);
    free(c->backoff);
    free(c->started); free(c->later); free(c->pend); free(c->rbuf); free(c->rmsgs);
    free(c->riov); free(c->rctl); free(c->rsrc); free(c);
}

/* stream(fd, header, chunks, chunk_bytes, aggs, epochs, window, timing, srtt, rttvar, out,
 *        out_itemsize, expect_payload, gso, dlcp, counts, bitmaps)
 *   header: (pkt_type, result_type, pending_type, other_result_type, is_data, worker, job_id,
 *            pool, run, base, offset_base, lanes, n_workers, refused_type, top,
 *            incarnation, (tag, tag_mask, up_tag), own_lut, vote, reach): own_lut, 16
 *            host-order uint32, the job's table; vote: DATA lanes are sign bits; reach:
 *            Job.reachable_sums's bytes for DATA (top: the granularity), else empty.
 *            Replies of the three types are this job's, a result of the other type is
 *            counted as ignored; an epoch learnt must hold the job's configuration tag:
 *            epoch & tag_mask == tag (protocol.py's EPOCH_TAG_SHIFT); up_tag: that tag as
 *            every packet sent carries it in its bitmap field (protocol.py's upstream_tag)
 *   aggs: [(ipv4 as int, port)] per shard; epochs: [int or None] per shard (updated in place)
 *   timing: (timeout, max_timeout, deadline, fast_retransmit_after, fast_backoff_cap,
 *           silent_after, recv_batch), the last four host/net/window.py's rules (results of
 *           later chunks that mean a chunk was lost; the backoff cap in RTOs of the head and
 *           of lost chunks; unanswered resends that make a shard silent; datagrams taken in
 *           before the timers are looked at); srtt/rttvar: [float or None] / [float] per
 *           shard
 *   out: total * lanes elements of out_itemsize bytes (host order)
 *   dlcp: (tos, flush_tos, flush_type, budget, short_cap, heard): tos, a TOS byte per chunk
 *         (b"" for none); the FLUSH's TOS and packet type; the chunks this worker may close
 *         short (0: no loss bound) and that may end short in all; heard, a byte per shard
 *   counts, bitmaps: per chunk (uint8, uint32), filled with every worker by the caller; a
 *   chunk that ends short gets its result's
 * -> (event, info, stats, srtt, rttvar) with event 0 done, 1 restarted (shard, old, new),
 *    2 timeout (chunk, PENDING bitmap or None, seconds since its shard's last reply, the
 *    shard's unanswered resends, its impossible replies, the chunks it ended this round),
 *    3 OS error (errno), 4 refused (chunk, reason code, detail), 5 a chunk closed short
 *    (chunk, count, bitmap), 6 an epoch of another configuration (shard, epoch) */
PyObject *fa_stream(PyObject *self, PyObject *args) {
    PyObject *hdr, *aggs_o, *epochs, *srtt_o, *rttvar_o;
    Py_buffer chunks = {0}, out = {0}, counts = {0}, bitmaps = {0};
    int fd, chunk_bytes, window, out_itemsize, expect_payload, gso;
    double timeout, max_timeout, deadline;
    int fast_after, backoff_cap, silent_after, recv_batch, flush_tos, flush_type;
    const char *tos, *heard;
    Py_ssize_t tos_len, heard_len;
    long budget, short_cap;
    if (!PyArg_ParseTuple(args, "iOy*iO!O!i(dddiiii)O!O!w*iip(y#iilly#)w*w*", &fd, &hdr,
                          &chunks, &chunk_bytes, &PyList_Type, &aggs_o, &PyList_Type, &epochs,
                          &window, &timeout, &max_timeout, &deadline, &fast_after,
                          &backoff_cap, &silent_after, &recv_batch, &PyList_Type, &srtt_o,
                          &PyList_Type, &rttvar_o, &out, &out_itemsize, &expect_payload,
                          &gso, &tos, &tos_len, &flush_tos, &flush_type, &budget, &short_cap,
                          &heard, &heard_len, &counts, &bitmaps))
        return NULL;
    PyObject *res = NULL;
    /* copies, taken before any of the caller's code runs (converting the header's items or a
     * shard's may change the lists): their lengths are checked, their items read */
    PyObject *aggs_t = PySequence_Tuple(aggs_o), *epochs_t = PySequence_Tuple(epochs),
             *srtt_t = PySequence_Tuple(srtt_o), *rttvar_t = PySequence_Tuple(rttvar_o);
    Client *c = calloc(1, sizeof(Client));
    if (!aggs_t || !epochs_t || !srtt_t || !rttvar_t) goto cleanup;
    if (!c) {
        PyErr_NoMemory();
        goto cleanup;
    }
    c->fd = fd;
    c->gso = gso;
    c->n_shards = (int)PyTuple_GET_SIZE(aggs_t);
    c->window = window;
    c->chunk_bytes = chunk_bytes;
    c->chunks = chunks.buf;
    c->out = out.buf;
    c->out_itemsize = out_itemsize;
    c->expect_payload = expect_payload;
    c->timeout = timeout;
    c->max_timeout = max_timeout;
    c->deadline = deadline;
    c->fast_after = fast_after;
    c->backoff_cap = backoff_cap;
    c->silent_after = silent_after;
    c->recv_batch = recv_batch;
    c->ev.bitmap = -1;
    if (cl_configure(c, hdr, chunks.len, out.len, PyTuple_GET_SIZE(epochs_t),
                     PyTuple_GET_SIZE(srtt_t), PyTuple_GET_SIZE(rttvar_t)) < 0)
        goto cleanup;
    if ((tos_len != 0 && tos_len != c->total) || heard_len != c->n_shards ||
        flush_tos < 0 || flush_tos > 255 || flush_type < 0 || flush_type > 255 || budget < 0 ||
        short_cap < 0 || counts.len < c->total || bitmaps.len < 4 * (Py_ssize_t)c->total ||
        (uintptr_t)bitmaps.buf % 4) {
        PyErr_SetString(PyExc_ValueError, "stream: bad arguments");
        goto cleanup;
    }
    c->tos = tos_len ? (const uint8_t *)tos : NULL;
    c->heard = (const uint8_t *)heard;
    c->flush_tos = (uint8_t)flush_tos;
    c->flush_type = (uint8_t)flush_type;
    c->budget = budget;
    c->short_cap = short_cap;
    c->counts = counts.buf;
    c->bitmaps = bitmaps.buf;
    if (cl_alloc(c) < 0 || cl_shards(c, aggs_t, epochs_t, srtt_t, rttvar_t) < 0)
        goto cleanup;
    if (gso) gro_set(fd, 1);
    int main = on_main_thread();
    if (main < 0) goto cleanup; /* a pending signal's handler raised */
    int interrupted;
    Py_BEGIN_ALLOW_THREADS
    interrupted = cl_run(c, main);
    Py_END_ALLOW_THREADS
    if (!interrupted) res = cl_report(c, epochs);
cleanup:
    if (c) cl_free(c);
    Py_XDECREF(aggs_t); Py_XDECREF(epochs_t); Py_XDECREF(srtt_t); Py_XDECREF(rttvar_t);
    if (gso) gro_set(fd, 0);
    PyBuffer_Release(&chunks);
    if (out.obj) PyBuffer_Release(&out);
    if (counts.obj) PyBuffer_Release(&counts);
    if (bitmaps.obj) PyBuffer_Release(&bitmaps);
    return res;
}

int fa_add_stream(PyObject *m) {
    if (PyModule_AddIntConstant(m, "CLIENT_MAX_DATAGRAM", CL_OUT_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "CLIENT_RECV_BYTES", CL_RECV_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "CLIENT_WINDOW", CL_WINDOW_VERSION) < 0)
        return -1;
    return 0;
}
