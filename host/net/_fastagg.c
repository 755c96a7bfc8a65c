/* The software aggregator's datapath in C: the reference model's per-packet rules
 * (host/wire/model.py: drops by reason, REFUSED replies, slots in two versions with their op,
 * offset and acknowledgements, runs, retransmission replies built from the use, 8/16-bit
 * lane sums, MAX, vote counts, FLUSH-closed slots, one shard of a shard map) behind a
 * recvmmsg/sendmmsg loop that runs without the GIL.
 *
 * Control stays in Python (host/net/fastagg.py): it validates jobs, passes the protocol's
 * packet type codes and run rules in, names the drop reasons and counters, and reads
 * counters out. The model is the reference; tests compare the two byte for byte.
 *
 * Also here, with the same batching: a UDP echo (the ceiling `thc bench aggregator`
 * compares with) and a load generator that plays n workers (so the benchmark's clients are
 * not the bottleneck).
 */
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

/* The header this file parses: protocol.json's field order and widths. fastagg.py compares
 * HEADER_LAYOUT with protocol.json and refuses the module if they differ. */
#define HDR 28
#define MAX_WORKERS 32 /* the bitmap field is 32 bits */
#define BATCH 64
#define RECV_BYTES 2048 /* as the Python loop's receive buffer: longer datagrams truncate */
#define OUT_BYTES 1536
#define OUT_CAP 512
#define N_JOB_IDS 65536

enum { MALFORMED, BAD_LANES, UNKNOWN_JOB, UNKNOWN_WORKER, WORKER_OUTSIDE_JOB,
       SLOT_OUTSIDE_POOL, STALE, NOT_FROM_CPU, WRONG_DIRECTION, STALE_RUN, WRONG_SHARD,
       WRONG_USE, WRONG_SLOT, REUSED_RUN, STALE_RESET, WRONG_CONFIG, N_REASONS };
static const char *REASON_NAMES[N_REASONS] = {
    "malformed", "bad_lanes", "unknown_job", "unknown_worker", "worker_outside_job",
    "slot_outside_pool", "stale", "not_from_cpu", "wrong_direction", "stale_run",
    "wrong_shard", "wrong_use", "wrong_slot", "reused_run", "stale_reset", "wrong_config"};
enum { C_PACKETS, C_COMPLETIONS, C_RETRANSMISSIONS, C_PENDING, C_HELD, N_COUNTERS };
static const char *COUNTER_NAMES[N_COUNTERS] = {"packets", "completions", "retransmissions",
                                                "pending", "held"};
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

static void write_header(uint8_t *p, uint8_t type, uint8_t worker, uint16_t job, uint16_t slot,
                         uint8_t version, uint8_t count, uint32_t seq, uint32_t offset,
                         uint32_t bitmap, uint32_t run, uint32_t epoch) {
    p[0] = type; p[1] = worker; wr16(p + 2, job); wr16(p + 4, slot); p[6] = version;
    p[7] = count; wr32(p + 8, seq); wr32(p + 12, offset); wr32(p + 16, bitmap);
    wr32(p + 20, run); wr32(p + 24, epoch);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* PyArg_ParseTuple's "O&" converter to an unsigned long: an OverflowError beyond its range
 * (or for a negative int), where "k" would mask the value into range. */
static int as_ulong(PyObject *o, void *out) {
    unsigned long v = PyLong_AsUnsignedLong(o);
    if (v == (unsigned long)-1 && PyErr_Occurred()) return 0;
    *(unsigned long *)out = v;
    return 1;
}

/* Whether the calling thread, holding the GIL, is the interpreter's main thread: the only
 * one whose signal handlers run. A loop on another thread must not take the GIL back before it
 * ends: a daemon thread that does so while the interpreter finalizes crashes the process.
 * -1, its exception set: a pending signal's handler raised in the calls it makes (Ctrl-C). */
static int on_main_thread(void) {
    PyObject *threading = PyImport_ImportModule("threading");
    PyObject *main = threading ? PyObject_CallMethod(threading, "main_thread", NULL) : NULL;
    PyObject *ident = main ? PyObject_GetAttrString(main, "ident") : NULL;
    unsigned long id = ident ? PyLong_AsUnsignedLong(ident) : 0;
    Py_XDECREF(ident);
    Py_XDECREF(main);
    Py_XDECREF(threading);
    if (PyErr_Occurred()) return -1;
    return id == PyThread_get_thread_ident();
}

/* A tuple of o's items (TypeError naming ``what`` where o has none): a list's items read
 * one by one could be taken out of it by the calls that convert them (an __index__), and
 * counters() reads them again after it let go of the GIL. */
static PyObject *items_of(PyObject *o, const char *what) {
    PyObject *t = PySequence_Tuple(o);
    if (!t && PyErr_ExceptionMatches(PyExc_TypeError)) PyErr_SetString(PyExc_TypeError, what);
    return t;
}

/* For loops run without the GIL: every 50 ms on the main thread (``main``: on_main_thread),
 * whether a signal's handler raised (Ctrl-C); the exception is set then. */
static int signalled(int main, double now, double *last_check) {
    if (main < 0) return 1; /* raised in on_main_thread */
    if (!main || now - *last_check <= 0.05) return 0;
    *last_check = now;
    PyGILState_STATE g = PyGILState_Ensure();
    int raised = PyErr_CheckSignals() < 0;
    PyGILState_Release(g);
    return raised;
}

/* ---------------------------------------------------------------------------------------- */
/* Register state of one job, laid out as the switch's registers (slot x version).          */

typedef struct {
    uint16_t job_id;
    int n, pool, lanes, sum_bits, data_bytes, result_bytes;
    int vote; /* DATA carries one sign bit a lane, counted (the first lane in the high bit) */
    uint32_t n_shards, shard; /* this aggregator owns the chunks with seq % n_shards == shard */
    uint16_t lut[256][2]; /* packed byte -> its two lanes' table values */
    uint32_t ip[MAX_WORKERS]; /* network order */
    uint16_t port[MAX_WORKERS]; /* network order */
    uint8_t addr_ok[MAX_WORKERS]; /* 0: the configured address is no IPv4 literal */
    uint32_t local[MAX_WORKERS]; /* the address of ours each worker last sent to; 0: none */
    uint32_t job_run, epoch;
    double run_seen; /* when a packet of job_run last passed the run check */
    uint32_t worker_run[MAX_WORKERS], worker_nonce[MAX_WORKERS]; /* one incarnation a run */
    uint32_t full; /* every worker's bit */
    uint32_t *run, *seq, *bitmap, *count, *offset, *acked; /* [slot * 2 + version] */
    uint8_t *closed; /* a FLUSH closed the use short: it answers as complete */
    uint8_t *op; /* the use's kind: 0 none, else the type code of DATA or MAX */
    uint8_t *sum8; /* 8-bit jobs: [(slot * 2 + version) * lanes + lane] */
    uint16_t *sum16; /* 16-bit jobs, host order */
    uint32_t *max; /* [(slot * 2 + version) * max_lanes + lane], host order */
    unsigned long long counters[N_COUNTERS];
} Job;

static void job_free(Job *j) {
    if (!j) return;
    free(j->run); free(j->seq); free(j->bitmap); free(j->count); free(j->closed);
    free(j->offset); free(j->acked); free(j->op);
    free(j->sum8); free(j->sum16); free(j->max); free(j);
}

typedef struct {
    uint8_t *buf;
    size_t len;
    struct sockaddr_in dst;
    uint32_t from; /* the source address to send from; 0: the datagram's (see dp_serve) */
} Out;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    Job **jobs; /* by job_id */
    uint32_t run_jump; /* a run this much newer takes an active job over */
    double run_idle; /* seconds after which any run takes the job over */
    uint8_t types[N_TYPES];
    uint8_t is_type[256];
    uint8_t reason_code[N_REASONS]; /* protocol.json's code of each drop reason */
    int max_lanes;
    uint32_t seq_reset;
    int echo;
    int gso; /* may send replies to one destination as one UDP GSO send */
    unsigned long long drops[N_REASONS];
    unsigned long long send_errors, echoed;
    int stop;
    int serving;
} Datapath;

static int drop(Datapath *dp, int reason) {
    dp->drops[reason]++;
    return 0;
}

static Out *out_header(Out *o, uint32_t ip, uint16_t port) {
    memset(&o->dst, 0, sizeof o->dst);
    o->from = 0;
    o->dst.sin_family = AF_INET;
    o->dst.sin_addr.s_addr = ip;
    o->dst.sin_port = port;
    return o;
}

/* The result datagram of slot use i for worker w, built from the use (op, seq, offset, run),
 * never from the packet that asked (payload serialized in network order). */
static size_t write_result(Datapath *dp, Job *j, uint8_t *p, int w, uint16_t slot,
                           uint8_t version) {
    size_t i = (size_t)slot * 2 + version;
    int is_max = j->op[i] == dp->types[T_MAX];
    write_header(p, dp->types[is_max ? T_MAX_RESULT : T_RESULT], (uint8_t)w, j->job_id, slot,
                 version, (uint8_t)j->count[i], j->seq[i], j->offset[i], j->bitmap[i],
                 j->run[i], j->epoch);
    uint8_t *q = p + HDR;
    if (is_max) {
        const uint32_t *m = j->max + i * dp->max_lanes;
        for (int k = 0; k < dp->max_lanes; k++) wr32(q + 4 * k, m[k]);
        return HDR + 4 * (size_t)dp->max_lanes;
    }
    if (j->sum_bits == 8) {
        memcpy(q, j->sum8 + i * j->lanes, j->lanes);
    } else {
        const uint16_t *s = j->sum16 + i * j->lanes;
        for (int k = 0; k < j->lanes; k++) wr16(q + 2 * k, s[k]);
    }
    return HDR + (size_t)j->result_bytes;
}

static void accumulate(Datapath *dp, Job *j, int is_max, size_t i, const uint8_t *payload,
                       int first) {
    if (is_max) {
        uint32_t *m = j->max + i * dp->max_lanes;
        for (int k = 0; k < dp->max_lanes; k++) {
            uint32_t v = rd32(payload + 4 * k);
            if (first || v > m[k]) m[k] = v;
        }
        return;
    }
    int nb = j->data_bytes;
    if (j->vote) {
        /* a lane's sign bit counts as is (VOTE_TABLE maps b to b) */
        for (int b = 0; b < nb; b++) {
            for (int k = 0; k < 8; k++) {
                unsigned v = (payload[b] >> (7 - k)) & 1u;
                size_t l = i * j->lanes + 8 * (size_t)b + k;
                if (j->sum_bits == 8) j->sum8[l] = (uint8_t)(first ? v : j->sum8[l] + v);
                else j->sum16[l] = (uint16_t)(first ? v : j->sum16[l] + v);
            }
        }
        return;
    }
    if (j->sum_bits == 8) {
        uint8_t *s = j->sum8 + i * j->lanes;
        if (first) {
            for (int b = 0; b < nb; b++) {
                s[2 * b] = (uint8_t)j->lut[payload[b]][0];
                s[2 * b + 1] = (uint8_t)j->lut[payload[b]][1];
            }
        } else {
            for (int b = 0; b < nb; b++) {
                s[2 * b] = (uint8_t)(s[2 * b] + j->lut[payload[b]][0]);
                s[2 * b + 1] = (uint8_t)(s[2 * b + 1] + j->lut[payload[b]][1]);
            }
        }
    } else {
        uint16_t *s = j->sum16 + i * j->lanes;
        if (first) {
            for (int b = 0; b < nb; b++) {
                s[2 * b] = j->lut[payload[b]][0];
                s[2 * b + 1] = j->lut[payload[b]][1];
            }
        } else {
            for (int b = 0; b < nb; b++) {
                s[2 * b] = (uint16_t)(s[2 * b] + j->lut[payload[b]][0]);
                s[2 * b + 1] = (uint16_t)(s[2 * b + 1] + j->lut[payload[b]][1]);
            }
        }
    }
}

/* A one-reply answer to the sender: PENDING or REFUSED (no payload). */
static int reply_header(Out *out, uint32_t sip, uint16_t sport, uint8_t type, const uint8_t *d,
                        uint8_t count, uint32_t bitmap, uint32_t epoch) {
    Out *o = out_header(out, sip, sport);
    write_header(o->buf, type, d[1], rd16(d + 2), rd16(d + 4), d[6], count, rd32(d + 8),
                 rd32(d + 12), bitmap, rd32(d + 20), epoch);
    o->len = HDR;
    return 1;
}

/* A drop answered with REFUSED (the reason's code in count, a detail in bitmap), so the
 * verified worker's client fails at once. */
static int refuse(Datapath *dp, Job *j, int reason, const uint8_t *d, uint32_t detail,
                  uint32_t sip, uint16_t sport, Out *out) {
    dp->drops[reason]++;
    return reply_header(out, sip, sport, dp->types[T_REFUSED], d, dp->reason_code[reason],
                        detail, j->epoch);
}

/* One datagram from (sip, sport) to our address to (network order; 0: not known) at time
 * now; replies go to out[0..], which has room for MAX_WORKERS. Returns the number of
 * replies. The rules and their order are host/wire/model.py's. */
static int process(Datapath *dp, const uint8_t *d, size_t len, uint32_t sip, uint16_t sport,
                   uint32_t to, Out *out, double now) {
    if (len < HDR) return drop(dp, MALFORMED);
    uint8_t type = d[0], wid = d[1], version = d[6];
    uint16_t job_id = rd16(d + 2), slot = rd16(d + 4);
    uint32_t seq = rd32(d + 8), offset = rd32(d + 12), run = rd32(d + 20), nonce = rd32(d + 24);
    int is_up = type == dp->types[T_DATA] || type == dp->types[T_MAX] ||
                type == dp->types[T_FLUSH];
    if (!dp->is_type[type] || version > 1 || (run == 0 && is_up)) return drop(dp, MALFORMED);
    if (type == dp->types[T_RESET]) return drop(dp, NOT_FROM_CPU);
    if (!is_up) return drop(dp, WRONG_DIRECTION);
    Job *j = dp->jobs[job_id];
    if (!j) return drop(dp, UNKNOWN_JOB);
    int is_max = type == dp->types[T_MAX], is_flush = type == dp->types[T_FLUSH];
    size_t plen = len - HDR;
    if (plen != (size_t)(is_max ? 4 * dp->max_lanes : is_flush ? 0 : j->data_bytes))
        return drop(dp, BAD_LANES);
    int n = j->n;
    uint32_t pool = (uint32_t)j->pool;
    if (wid >= n) return drop(dp, WORKER_OUTSIDE_JOB);
    if (!j->addr_ok[wid] || j->ip[wid] != sip || j->port[wid] != sport)
        return drop(dp, UNKNOWN_WORKER);
    /* the sender's configuration tag (protocol.py's upstream_tag) against the install's */
    if ((rd32(d + 16) & 0xFFFF) != j->epoch >> 16)
        return refuse(dp, j, WRONG_CONFIG, d, 0, sip, sport, out);
    if (to) j->local[wid] = to;
    if (slot >= pool) return drop(dp, SLOT_OUTSIDE_POOL);
    if (slot != seq % pool || version != ((seq / pool) & 1))
        return refuse(dp, j, WRONG_SLOT, d, 0, sip, sport, out);
    if (j->n_shards > 1 && seq % j->n_shards != j->shard)
        return refuse(dp, j, WRONG_SHARD, d, j->n_shards << 16 | j->shard, sip, sport, out);
    if (run != j->job_run) {
        if (j->job_run && !((newer(run, j->job_run) && run - j->job_run <= dp->run_jump) ||
                            now - j->run_seen >= dp->run_idle))
            return refuse(dp, j, STALE_RUN, d, j->job_run, sip, sport, out);
        j->job_run = run;
    }
    j->run_seen = now;
    /* one incarnation of each worker per run (a restart under the same run id is refused) */
    if (j->worker_run[wid] != run) {
        j->worker_run[wid] = run;
        j->worker_nonce[wid] = nonce;
    } else if (j->worker_nonce[wid] != nonce) {
        return refuse(dp, j, REUSED_RUN, d, j->worker_nonce[wid], sip, sport, out);
    }
    size_t i = (size_t)slot * 2 + version;
    uint32_t bit = 1u << wid;
    /* this packet proves its worker holds every result of the run up to seq - pool */
    uint32_t past = seq - pool;
    for (size_t u = i & ~(size_t)1; u <= (i | 1); u++)
        if (j->run[u] == run && !newer(j->seq[u], past)) j->acked[u] |= bit;
    uint8_t op = is_max ? dp->types[T_MAX] : dp->types[T_DATA];
    uint32_t cur = j->seq[i];
    int same_run = j->run[i] == run;
    if (same_run && seq != cur && !newer(seq, cur))
        return refuse(dp, j, STALE, d, cur, sip, sport, out);
    const uint8_t *payload = d + HDR;
    if (same_run && seq == cur) {
        if (j->op[i] != op || j->offset[i] != offset)
            return refuse(dp, j, WRONG_USE, d, j->op[i], sip, sport, out);
        j->counters[C_PACKETS]++;
        uint32_t count = j->count[i];
        if (count == (uint32_t)n || j->closed[i]) {
            j->counters[C_RETRANSMISSIONS]++;
            Out *o = out_header(out, sip, sport);
            o->len = write_result(dp, j, o->buf, wid, slot, version);
            return 1;
        }
        if (is_flush) {
            j->closed[i] = 1;
        } else if (j->bitmap[i] & bit) {
            j->counters[C_PENDING]++;
            return reply_header(out, sip, sport, dp->types[T_PENDING], d, (uint8_t)count,
                                j->bitmap[i], j->epoch);
        } else {
            accumulate(dp, j, is_max, i, payload, 0);
            j->bitmap[i] |= bit;
            j->count[i] = count + 1;
        }
    } else {
        j->counters[C_PACKETS]++;
        if (same_run && j->op[i] && j->acked[i] != j->full) {
            /* a worker may still need the previous use's result: wait for its ack */
            j->counters[C_HELD]++;
            return reply_header(out, sip, sport, dp->types[T_PENDING], d, 0, j->acked[i],
                                j->epoch);
        }
        j->run[i] = run;
        j->seq[i] = seq;
        j->op[i] = op;
        j->acked[i] = 0;
        j->offset[i] = offset;
        if (is_flush) {
            /* closed before anyone contributed: every lane sums nothing, count 0 */
            if (j->sum_bits == 8) memset(j->sum8 + i * j->lanes, 0, (size_t)j->lanes);
            else memset(j->sum16 + i * j->lanes, 0, (size_t)j->lanes * 2);
            j->bitmap[i] = 0;
            j->count[i] = 0;
            j->closed[i] = 1;
        } else {
            accumulate(dp, j, is_max, i, payload, 1);
            j->bitmap[i] = bit;
            j->count[i] = 1;
            j->closed[i] = 0;
        }
    }
    if (j->count[i] < (uint32_t)n && !j->closed[i]) return 0;
    j->counters[C_COMPLETIONS]++;
    size_t rlen = write_result(dp, j, out[0].buf, 0, slot, version);
    for (int w = 0; w < n; w++) {
        Out *o = out_header(&out[w], j->ip[w], j->port[w]);
        o->from = j->local[w]; /* each worker hears from the address it sends to */
        if (w) {
            memcpy(o->buf, out[0].buf, rlen);
            o->buf[1] = (uint8_t)w;
        }
        o->len = rlen;
    }
    return n;
}

/* The ceiling: answer every packet of an installed job at once with a result-sized RESULT of
 * zeros, under the job's epoch (what a client of index-0 chunks takes). */
static int process_echo(Datapath *dp, const uint8_t *d, size_t len, uint32_t sip,
                        uint16_t sport, Out *out) {
    if (len < HDR) return drop(dp, MALFORMED);
    Job *j = dp->jobs[rd16(d + 2)];
    if (!j) return drop(dp, UNKNOWN_JOB);
    dp->echoed++;
    Out *o = out_header(out, sip, sport);
    uint32_t full = j->n == 32 ? 0xFFFFFFFFu : (1u << j->n) - 1;
    write_header(o->buf, dp->types[T_RESULT], d[1], rd16(d + 2), rd16(d + 4), d[6],
                 (uint8_t)j->n, rd32(d + 8), rd32(d + 12), full, rd32(d + 20), j->epoch);
    memset(o->buf + HDR, 0, j->result_bytes);
    o->len = HDR + (size_t)j->result_bytes;
    return 1;
}

/* ---------------------------------------------------------------------------------------- */
/* The Python type                                                                           */

static int dp_init(Datapath *dp, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"types", "reason_codes", "max_lanes", "seq_reset", "run_jump",
                             "run_idle", "echo", "gso", NULL};
    unsigned long seq_reset, run_jump;
    double run_idle;
    PyObject *types, *codes;
    int max_lanes, echo = 0, gso = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOikkd|pp", kwlist, &types, &codes, &max_lanes,
                                     &seq_reset, &run_jump, &run_idle, &echo, &gso))
        return -1;
    if (dp->jobs) {
        PyErr_SetString(PyExc_RuntimeError, "a datapath is initialised once");
        return -1;
    }
    PyObject *seq = items_of(types, "types must be a sequence");
    if (!seq) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != N_TYPES) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "types: expected %d codes (DATA, MAX, RESULT, "
                     "MAX_RESULT, PENDING, RESET, FLUSH, REFUSED)", N_TYPES);
        return -1;
    }
    memset(dp->is_type, 0, sizeof dp->is_type);
    for (int t = 0; t < N_TYPES; t++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, t));
        if (v < 0 || v > 255) {
            Py_DECREF(seq);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "type codes are 8-bit");
            return -1;
        }
        dp->types[t] = (uint8_t)v;
        dp->is_type[v] = 1;
    }
    Py_DECREF(seq);
    seq = items_of(codes, "reason_codes must be a sequence");
    if (!seq) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != N_REASONS) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "reason_codes: expected %d codes, in REASONS order",
                     N_REASONS);
        return -1;
    }
    for (int r = 0; r < N_REASONS; r++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, r));
        if (v < 0 || v > 255) {
            Py_DECREF(seq);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "reason codes are 8-bit");
            return -1;
        }
        dp->reason_code[r] = (uint8_t)v;
    }
    Py_DECREF(seq);
    if (max_lanes < 1 || HDR + 4 * max_lanes > OUT_BYTES) {
        PyErr_SetString(PyExc_ValueError, "max_lanes out of range");
        return -1;
    }
    dp->run_jump = (uint32_t)run_jump;
    dp->run_idle = run_idle;
    dp->max_lanes = max_lanes;
    dp->seq_reset = (uint32_t)seq_reset;
    dp->echo = echo;
    dp->gso = gso;
    dp->jobs = calloc(N_JOB_IDS, sizeof(Job *));
    if (!dp->jobs) {
        PyErr_NoMemory();
        return -1;
    }
    pthread_mutex_init(&dp->mu, NULL);
    return 0;
}

static void dp_dealloc(Datapath *dp) {
    if (dp->jobs) {
        for (int k = 0; k < N_JOB_IDS; k++) job_free(dp->jobs[k]);
        free(dp->jobs);
        pthread_mutex_destroy(&dp->mu);
    }
    Py_TYPE(dp)->tp_free((PyObject *)dp);
}

static int ready(Datapath *dp) {
    if (!dp->jobs) PyErr_SetString(PyExc_RuntimeError, "datapath not initialised");
    return dp->jobs != NULL;
}

static void lock(Datapath *dp) {
    if (pthread_mutex_trylock(&dp->mu) == 0) return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&dp->mu);
    Py_END_ALLOW_THREADS
}

/* install(job_id, n, pool, lanes, sum_bits, table, addrs, vote, n_shards, shard, epoch):
 * addrs is a list of (ip as a 32-bit host-order int or None when it is no IPv4 literal,
 * port); vote: DATA carries sign bits; the aggregator owns the chunks with seq % n_shards ==
 * shard; epoch: what every reply of the job carries until it is installed again. The slots
 * start as the controller's reset leaves a switch pool. */
static PyObject *dp_install(Datapath *dp, PyObject *args) {
    int job_id, n, pool, lanes, sum_bits, vote, n_shards, shard;
    unsigned long epoch;
    PyObject *table, *addrs;
    if (!ready(dp)) return NULL;
    if (!PyArg_ParseTuple(args, "iiiiiOOpiiO&", &job_id, &n, &pool, &lanes, &sum_bits, &table,
                          &addrs, &vote, &n_shards, &shard, as_ulong, &epoch))
        return NULL;
    if (epoch < 1 || epoch > 0xFFFFFFFFul) { /* "k" would cut it to 32 bits */
        PyErr_SetString(PyExc_ValueError, "an epoch is a nonzero 32-bit value");
        return NULL;
    }
    if (job_id < 0 || job_id >= N_JOB_IDS || n < 1 || n > MAX_WORKERS || pool < 1 ||
        lanes < 2 || lanes % (vote ? 8 : 2) || (sum_bits != 8 && sum_bits != 16) ||
        lanes > (OUT_BYTES - HDR) * 8 / sum_bits || n_shards < 1 || shard < 0 ||
        shard >= n_shards) {
        PyErr_SetString(PyExc_ValueError, "job outside what the compiled datapath holds");
        return NULL;
    }
    PyObject *tab = items_of(table, "table must be a sequence");
    if (!tab) return NULL;
    PyObject *ad = items_of(addrs, "addrs must be a sequence");
    if (!ad) {
        Py_DECREF(tab);
        return NULL;
    }
    Job *j = calloc(1, sizeof(Job));
    size_t uses = (size_t)pool * 2;
    int ok = j != NULL;
    if (ok) {
        j->run = calloc(uses, 4); j->seq = calloc(uses, 4);
        j->bitmap = calloc(uses, 4); j->count = calloc(uses, 4); j->closed = calloc(uses, 1);
        j->offset = calloc(uses, 4); j->acked = calloc(uses, 4); j->op = calloc(uses, 1);
        j->max = calloc(uses * dp->max_lanes, 4);
        if (sum_bits == 8) j->sum8 = calloc(uses * lanes, 1);
        else j->sum16 = calloc(uses * lanes, 2);
        ok = j->run && j->seq && j->bitmap && j->count && j->closed && j->max &&
             j->offset && j->acked && j->op && (j->sum8 || j->sum16);
    }
    if (!ok) {
        job_free(j);
        Py_DECREF(tab); Py_DECREF(ad);
        PyErr_NoMemory();
        return NULL;
    }
    j->job_id = (uint16_t)job_id; j->n = n; j->pool = pool; j->lanes = lanes;
    j->sum_bits = sum_bits; j->data_bytes = vote ? lanes / 8 : lanes / 2;
    j->result_bytes = lanes * sum_bits / 8;
    j->vote = vote; j->n_shards = (uint32_t)n_shards; j->shard = (uint32_t)shard;
    j->epoch = (uint32_t)epoch;
    j->full = n == 32 ? 0xFFFFFFFFu : (1u << n) - 1;
    for (size_t u = 0; u < uses; u++) j->seq[u] = dp->seq_reset;
    const char *err = NULL;
    if (PySequence_Fast_GET_SIZE(tab) != 16) err = "table needs 16 entries";
    if (!err && PySequence_Fast_GET_SIZE(ad) != n) err = "addrs needs one entry per worker";
    long vals[16];
    for (int k = 0; !err && k < 16; k++) {
        vals[k] = PyLong_AsLong(PySequence_Fast_GET_ITEM(tab, k));
        if (vals[k] < 0 || vals[k] >= (1L << sum_bits)) err = "table value outside the sum width";
    }
    for (int b = 0; !err && b < 256; b++) {
        j->lut[b][0] = (uint16_t)vals[b >> 4];
        j->lut[b][1] = (uint16_t)vals[b & 15];
    }
    for (int w = 0; !err && w < n; w++) {
        PyObject *a = PySequence_Fast_GET_ITEM(ad, w);
        PyObject *ip, *port;
        if (!PyTuple_Check(a) || PyTuple_GET_SIZE(a) != 2) {
            err = "addrs entries are (ip, port)";
            break;
        }
        ip = PyTuple_GET_ITEM(a, 0);
        port = PyTuple_GET_ITEM(a, 1);
        long p = PyLong_AsLong(port);
        if (p < 0 || p > 65535) {
            err = "port outside 0..65535";
            break;
        }
        j->port[w] = htons((uint16_t)p);
        if (ip == Py_None) continue;
        unsigned long v = PyLong_AsUnsignedLong(ip);
        if (PyErr_Occurred()) break;
        if (v > 0xFFFFFFFFul) { /* handle() refuses such a source; it is no IPv4 address */
            err = "an address is an IPv4 address as an int below 2^32";
            break;
        }
        j->ip[w] = htonl((uint32_t)v);
        j->addr_ok[w] = 1;
    }
    Py_DECREF(tab);
    Py_DECREF(ad);
    if (err || PyErr_Occurred()) {
        job_free(j);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    lock(dp);
    Job *old = dp->jobs[job_id];
    /* A re-install over the installed job keeps the address each worker sends to: a worker
     * silent since then still hears the result from it. (The Python engine keeps it through
     * a remove too; here a worker silent since a remove and install hears its first result
     * from another local address, drops it, and retransmits.) */
    for (int w = 0; old && w < n; w++)
        for (int v = 0; v < old->n; v++)
            if (old->local[v] && j->addr_ok[w] && old->addr_ok[v] && old->ip[v] == j->ip[w] &&
                old->port[v] == j->port[w])
                j->local[w] = old->local[v];
    dp->jobs[job_id] = j;
    pthread_mutex_unlock(&dp->mu);
    job_free(old);
    Py_RETURN_NONE;
}

static PyObject *dp_remove(Datapath *dp, PyObject *args) {
    int job_id;
    if (!ready(dp) || !PyArg_ParseTuple(args, "i", &job_id)) return NULL;
    if (job_id < 0 || job_id >= N_JOB_IDS) {
        PyErr_Format(PyExc_KeyError, "job %d is not installed", job_id);
        return NULL;
    }
    lock(dp);
    Job *old = dp->jobs[job_id];
    dp->jobs[job_id] = NULL;
    pthread_mutex_unlock(&dp->mu);
    if (!old) {
        PyErr_Format(PyExc_KeyError, "job %d is not installed", job_id);
        return NULL;
    }
    job_free(old);
    Py_RETURN_NONE;
}

/* counters(job_ids) -> (drops tuple in REASONS order, {job_id: counters tuple}, send_errors,
 * echoed), read at one instant. */
static PyObject *dp_counters(Datapath *dp, PyObject *args) {
    PyObject *ids;
    if (!ready(dp) || !PyArg_ParseTuple(args, "O", &ids)) return NULL;
    PyObject *seq = items_of(ids, "job ids must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t nj = PySequence_Fast_GET_SIZE(seq);
    unsigned long long drops[N_REASONS], send_errors, echoed;
    unsigned long long *jc = calloc((size_t)(nj ? nj : 1), sizeof(unsigned long long) * N_COUNTERS);
    int *found = calloc((size_t)(nj ? nj : 1), sizeof(int));
    long *idv = calloc((size_t)(nj ? nj : 1), sizeof(long));
    if (!jc || !found || !idv) {
        free(jc); free(found); free(idv);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t k = 0; k < nj; k++) {
        idv[k] = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, k));
        if (idv[k] < 0 || idv[k] >= N_JOB_IDS) idv[k] = -1;
    }
    PyErr_Clear();
    lock(dp);
    memcpy(drops, dp->drops, sizeof drops);
    send_errors = dp->send_errors;
    echoed = dp->echoed;
    for (Py_ssize_t k = 0; k < nj; k++) {
        Job *j = idv[k] >= 0 ? dp->jobs[idv[k]] : NULL;
        if (j) {
            found[k] = 1;
            memcpy(jc + k * N_COUNTERS, j->counters, sizeof j->counters);
        }
    }
    pthread_mutex_unlock(&dp->mu);
    PyObject *d = PyTuple_New(N_REASONS), *jobs = PyDict_New(), *res = NULL;
    if (d && jobs) {
        for (int r = 0; r < N_REASONS; r++)
            PyTuple_SET_ITEM(d, r, PyLong_FromUnsignedLongLong(drops[r]));
        for (Py_ssize_t k = 0; k < nj; k++) {
            if (!found[k]) continue;
            PyObject *c = PyTuple_New(N_COUNTERS);
            for (int r = 0; c && r < N_COUNTERS; r++)
                PyTuple_SET_ITEM(c, r, PyLong_FromUnsignedLongLong(jc[k * N_COUNTERS + r]));
            if (!c || PyDict_SetItem(jobs, PySequence_Fast_GET_ITEM(seq, k), c) < 0) {
                Py_XDECREF(c);
                goto done;
            }
            Py_DECREF(c);
        }
        res = Py_BuildValue("(OOKK)", d, jobs, send_errors, echoed);
    }
done:
    Py_XDECREF(d);
    Py_XDECREF(jobs);
    Py_DECREF(seq);
    free(jc); free(found); free(idv);
    return res;
}

static int process_any(Datapath *dp, const uint8_t *d, size_t len, uint32_t sip,
                       uint16_t sport, uint32_t to, Out *out, double now) {
    return dp->echo ? process_echo(dp, d, len, sip, sport, out)
                    : process(dp, d, len, sip, sport, to, out, now);
}

/* handle(datagram, ip, port[, now]) -> [(bytes, ip, port)]: one datagram through the same
 * per-packet code the loop runs (ip in host order), for packet-trace comparisons; now: the
 * time in seconds (default: the monotonic clock the loop reads). */
static PyObject *dp_handle(Datapath *dp, PyObject *args) {
    Py_buffer buf;
    unsigned long ip;
    int port;
    double now = NAN; /* the model's clock may have any origin: only NaN means "none given" */
    if (!ready(dp) || !PyArg_ParseTuple(args, "y*O&i|d", &buf, as_ulong, &ip, &port, &now))
        return NULL;
    if (ip > 0xFFFFFFFFul || port < 0 || port > 65535) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "handle: the source is an IPv4 address and a port");
        return NULL;
    }
    if (isnan(now)) now = now_s();
    uint8_t *space = malloc((size_t)MAX_WORKERS * OUT_BYTES);
    if (!space) {
        PyBuffer_Release(&buf);
        return PyErr_NoMemory();
    }
    Out out[MAX_WORKERS];
    for (int k = 0; k < MAX_WORKERS; k++) out[k].buf = space + (size_t)k * OUT_BYTES;
    lock(dp);
    size_t len = (size_t)buf.len > RECV_BYTES ? RECV_BYTES : (size_t)buf.len;
    int nout = process_any(dp, buf.buf, len, htonl((uint32_t)ip), htons((uint16_t)port), 0,
                           out, now);
    PyObject *res = PyList_New(nout);
    for (int k = 0; res && k < nout; k++) {
        PyObject *item = Py_BuildValue("(y#kH)", out[k].buf, (Py_ssize_t)out[k].len,
                                       (unsigned long)ntohl(out[k].dst.sin_addr.s_addr),
                                       ntohs(out[k].dst.sin_port));
        if (!item) {
            Py_CLEAR(res);
            break;
        }
        PyList_SET_ITEM(res, k, item);
    }
    pthread_mutex_unlock(&dp->mu);
    free(space);
    PyBuffer_Release(&buf);
    return res;
}

/* Sending. Datagrams to one destination with one length leave as one UDP GSO send
 * (UDP_SEGMENT) where the kernel has it and the datapath was made with gso: one trip down
 * the stack for up to GSO_SEGS datagrams, each still delivered as its own datagram, in
 * order per destination. A NIC (or the stack before the driver) cuts them into packets; an
 * emulated link (veth, as in Mininet) carries the burst as one skb, as it does TCP's
 * segments, so the testbed turns GSO off where a loss rule would drop it whole. Otherwise,
 * or where GSO is refused, every datagram is sent alone (sendmmsg batches). */
#define GSO_SEGS 64
#define GSO_BYTES 65000
static int gso_ok = 1;

typedef struct {
    int head, tail, count;
    size_t len;
    uint32_t ip, from;
    uint16_t port;
} Group;

#define TX_CTL (CMSG_SPACE(sizeof(uint16_t)) + CMSG_SPACE(sizeof(struct in_pktinfo)))

typedef struct {
    struct mmsghdr msgs[BATCH];
    struct iovec iov[OUT_CAP];
    char cmsg[BATCH][TX_CTL];
    int gso[BATCH]; /* whether msgs[k] is a GSO send */
    Group groups[OUT_CAP];
    int next[OUT_CAP];
    int emit[OUT_CAP];
    int open[OUT_CAP];
} SendSpace;

/* Why the kernel may refuse a UDP GSO send it would take datagram by datagram: no
 * checksum offload (EIO), no UDP_SEGMENT (ENOPROTOOPT, EOPNOTSUPP), a segment larger than
 * the route's MTU (EINVAL before Linux 6.x, EMSGSIZE since). */
static int gso_refused(int err) {
    return err == EIO || err == EINVAL || err == EMSGSIZE || err == ENOPROTOOPT ||
           err == EOPNOTSUPP;
}

/* Receiving with UDP GRO (datapaths made with gso): the kernel hands a peer's GSO burst up
 * as one buffer of equal-sized datagrams (the last may be shorter) and says their size in a
 * UDP_GRO control message. One trip up the stack for the burst, as for TCP's segments. A
 * datagram without it is one datagram, truncated as the plain receive buffer would. */
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#define GRO_BATCH 16
#define GRO_BYTES 65536
#define GRO_CTL (CMSG_SPACE(sizeof(int)) + CMSG_SPACE(sizeof(struct in_pktinfo)))

static void gro_set(int fd, int on) {
    (void)setsockopt(fd, SOL_UDP, UDP_GRO, &on, sizeof on); /* refused: plain datagrams */
}

/* The size of the datagrams in a received buffer of len bytes, and the bytes to read of it
 * (len, or plain_cap where it came without a UDP_GRO message). */
static size_t gro_segment(struct msghdr *h, size_t *len, size_t plain_cap) {
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

/* The local address a received datagram came in on (an IP_PKTINFO message's ipi_spec_dst:
 * the header's destination, or for a broadcast or multicast one, the interface's address),
 * or 0. */
static uint32_t rx_destination(struct msghdr *h) {
    if (h->msg_controllen)
        for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c; c = CMSG_NXTHDR(h, c))
            if (c->cmsg_level == IPPROTO_IP && c->cmsg_type == IP_PKTINFO) {
                struct in_pktinfo pi;
                memcpy(&pi, CMSG_DATA(c), sizeof pi);
                return pi.ipi_spec_dst.s_addr;
            }
    return 0;
}

/* Append an IP_PKTINFO message that sends from ``from`` (where it is not 0) to h's control
 * buffer ctl, after what h holds. */
static void tx_from(struct msghdr *h, char *ctl, uint32_t from) {
    if (!from) return;
    h->msg_control = ctl;
    struct cmsghdr *c = (struct cmsghdr *)(ctl + h->msg_controllen);
    h->msg_controllen += CMSG_SPACE(sizeof(struct in_pktinfo));
    c->cmsg_level = IPPROTO_IP;
    c->cmsg_type = IP_PKTINFO;
    c->cmsg_len = CMSG_LEN(sizeof(struct in_pktinfo));
    struct in_pktinfo pi;
    memset(&pi, 0, sizeof pi);
    pi.ipi_spec_dst.s_addr = from;
    memcpy(CMSG_DATA(c), &pi, sizeof pi);
}

/* Point msgs[0..n) at n receive buffers of bytes each, with room for a UDP_GRO message and,
 * where src is given, the sender's address. */
static void rx_arm(struct mmsghdr *msgs, struct iovec *iov, char (*ctl)[GRO_CTL], uint8_t *buf,
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

/* Send groups[emit[0..ng)] (linked through next[]); a datagram the kernel refuses is
 * counted and skipped. */
static void send_groups(int fd, Out *out, SendSpace *sp, int ng, int use_gso,
                        unsigned long long *errors) {
    int g = 0, seg = 0; /* next group, and next datagram within it when sent one by one */
    int cursor = -1, single = 0;
    while (g < ng) {
        int m = 0, niov = 0, first_group[BATCH], first_seg[BATCH], cur_entry[BATCH];
        int gso = use_gso && !single && __atomic_load_n(&gso_ok, __ATOMIC_RELAXED);
        int gi = g, si = seg, ci = cursor;
        while (gi < ng && m < BATCH) {
            Group *gr = &sp->groups[sp->emit[gi]];
            struct msghdr *h = &sp->msgs[m].msg_hdr;
            memset(h, 0, sizeof *h);
            h->msg_name = &out[gr->head].dst;
            h->msg_namelen = sizeof out[gr->head].dst;
            h->msg_iov = &sp->iov[niov];
            first_group[m] = gi;
            first_seg[m] = si;
            cur_entry[m] = ci;
            if (gso && gr->count > 1 && si == 0) {
                for (int e = gr->head; e >= 0; e = sp->next[e]) {
                    sp->iov[niov].iov_base = out[e].buf;
                    sp->iov[niov++].iov_len = out[e].len;
                }
                h->msg_iovlen = (size_t)gr->count;
                h->msg_control = sp->cmsg[m];
                h->msg_controllen = CMSG_SPACE(sizeof(uint16_t));
                struct cmsghdr *c = CMSG_FIRSTHDR(h);
                c->cmsg_level = SOL_UDP;
                c->cmsg_type = UDP_SEGMENT;
                c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
                uint16_t size = (uint16_t)gr->len;
                memcpy(CMSG_DATA(c), &size, sizeof size);
                sp->gso[m] = 1;
                gi++;
            } else {
                int e = si == 0 ? gr->head : sp->next[ci];
                sp->iov[niov].iov_base = out[e].buf;
                sp->iov[niov++].iov_len = out[e].len;
                h->msg_iovlen = 1;
                h->msg_name = &out[e].dst;
                sp->gso[m] = 0;
                ci = e;
                if (++si == gr->count) {
                    gi++;
                    si = 0;
                    ci = -1;
                }
            }
            tx_from(h, sp->cmsg[m], gr->from);
            m++;
        }
        int sent = sendmmsg(fd, sp->msgs, (unsigned)m, 0);
        if (sent < 0) {
            int err = errno;
            if (err == EINTR) continue;
            if (sp->gso[0] && gso_refused(err)) {
                /* EINVAL with a source address may be the address's (one the route cannot
                 * send from), not GSO's: this flush alone goes one by one */
                if (err == EINVAL && sp->groups[sp->emit[first_group[0]]].from)
                    single = 1;
                else
                    __atomic_store_n(&gso_ok, 0, __ATOMIC_RELAXED);
                continue; /* the same datagrams again, one by one */
            }
            sent = 1; /* skip the refused message */
            Group *gr = &sp->groups[sp->emit[first_group[0]]];
            *errors += sp->gso[0] ? (unsigned long long)gr->count : 1;
        }
        /* resume after the messages sent */
        if (sent == m) {
            g = gi;
            seg = si;
            cursor = ci;
        } else {
            g = first_group[sent];
            seg = first_seg[sent];
            cursor = cur_entry[sent];
        }
    }
}

/* Send out[0..n): grouped by destination, source and length, order kept per destination and
 * source. */
static void flush(int fd, Out *out, int n, SendSpace *sp, int use_gso,
                  unsigned long long *errors) {
    int ng = 0, nemit = 0, nopen = 0;
    for (int k = 0; k < n; k++) {
        uint32_t ip = out[k].dst.sin_addr.s_addr, from = out[k].from;
        uint16_t port = out[k].dst.sin_port;
        sp->next[k] = -1;
        int o = 0;
        while (o < nopen && (sp->groups[sp->open[o]].ip != ip || sp->groups[sp->open[o]].port != port
                             || sp->groups[sp->open[o]].from != from))
            o++;
        if (o < nopen) {
            Group *gr = &sp->groups[sp->open[o]];
            if (gr->len == out[k].len && gr->count < GSO_SEGS &&
                (size_t)(gr->count + 1) * gr->len <= GSO_BYTES) {
                sp->next[gr->tail] = k;
                gr->tail = k;
                gr->count++;
                continue;
            }
            sp->emit[nemit++] = sp->open[o]; /* closed: its successor opens below */
            sp->open[o] = sp->open[--nopen];
        }
        Group *gr = &sp->groups[ng];
        gr->head = gr->tail = k;
        gr->count = 1;
        gr->len = out[k].len;
        gr->ip = ip;
        gr->from = from;
        gr->port = port;
        sp->open[nopen++] = ng++;
    }
    for (int o = 0; o < nopen; o++) sp->emit[nemit++] = sp->open[o];
    send_groups(fd, out, sp, nemit, use_gso, errors);
}

/* serve(fd, duration): receive and answer until stop() or duration seconds (+inf: no limit).
 * Runs without the GIL; the lock guards the registers against install/remove/counters. */
static PyObject *dp_serve(Datapath *dp, PyObject *args) {
    int fd;
    double duration;
    if (!ready(dp) || !PyArg_ParseTuple(args, "id", &fd, &duration)) return NULL;
    if (__atomic_exchange_n(&dp->serving, 1, __ATOMIC_SEQ_CST)) {
        PyErr_SetString(PyExc_RuntimeError, "this datapath is already serving");
        return NULL;
    }
    int nmsg = dp->gso ? GRO_BATCH : BATCH;
    size_t rbytes = dp->gso ? GRO_BYTES : RECV_BYTES;
    uint8_t *rbuf = malloc((size_t)nmsg * rbytes);
    uint8_t *obuf = malloc((size_t)OUT_CAP * OUT_BYTES);
    Out *out = malloc(sizeof(Out) * OUT_CAP);
    struct mmsghdr *rmsgs = calloc(BATCH, sizeof(struct mmsghdr));
    SendSpace *sp = calloc(1, sizeof(SendSpace));
    struct iovec *riov = calloc(BATCH, sizeof(struct iovec));
    struct sockaddr_in *src = calloc(BATCH, sizeof(struct sockaddr_in));
    char (*rctl)[GRO_CTL] = calloc(BATCH, GRO_CTL);
    int err = 0, interrupted = 0;
    if (!rbuf || !obuf || !out || !rmsgs || !sp || !riov || !src || !rctl) {
        err = ENOMEM;
        goto cleanup;
    }
    for (int k = 0; k < OUT_CAP; k++) out[k].buf = obuf + (size_t)k * OUT_BYTES;
    if (dp->gso) gro_set(fd, 1);
    /* A socket on the wildcard address answers each datagram from the address it was sent
     * to, not from the route's (workers take replies only from the address they send to). */
    struct sockaddr_in me;
    socklen_t me_len = sizeof me;
    int wildcard = getsockname(fd, (struct sockaddr *)&me, &me_len) == 0 &&
                   me.sin_family == AF_INET && me.sin_addr.s_addr == htonl(INADDR_ANY);
    int on = 1;
    if (wildcard && setsockopt(fd, IPPROTO_IP, IP_PKTINFO, &on, sizeof on) != 0) wildcard = 0;
    int main = on_main_thread();
    if (main < 0) { /* a pending signal's handler raised: a loop that never looks would hide it */
        interrupted = 1;
        goto cleanup;
    }
    Py_BEGIN_ALLOW_THREADS
    double end = now_s() + duration; /* duration: +inf for no limit; negative: already over */
    double last_check = now_s();
    unsigned long long send_errors = 0;
    while (!__atomic_load_n(&dp->stop, __ATOMIC_SEQ_CST) && now_s() < end) {
        /* served on the main thread: Ctrl-C, or a handler's stop(), is heard */
        if ((interrupted = signalled(main, now_s(), &last_check))) break;
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int r = poll(&pfd, 1, 50);
        if (r < 0) {
            if (errno == EINTR) continue;
            err = errno;
            break;
        }
        if (r == 0) continue;
        if (pfd.revents & (POLLERR | POLLNVAL)) {
            err = pfd.revents & POLLNVAL ? EBADF : EIO;
            break;
        }
        for (int rounds = 0; rounds < 64; rounds++) {
            rx_arm(rmsgs, riov, rctl, rbuf, nmsg, rbytes, src);
            int got = recvmmsg(fd, rmsgs, (unsigned)nmsg, MSG_DONTWAIT, NULL);
            if (got <= 0) break;
            int nout = 0;
            double now = now_s();
            pthread_mutex_lock(&dp->mu);
            for (int k = 0; k < got; k++) {
                if (src[k].sin_family != AF_INET) continue;
                size_t len = rmsgs[k].msg_len;
                size_t seg = gro_segment(&rmsgs[k].msg_hdr, &len, RECV_BYTES);
                if (seg == 0) seg = 1; /* an empty datagram: looked at once */
                uint32_t to = wildcard ? rx_destination(&rmsgs[k].msg_hdr) : 0;
                for (size_t off = 0; off == 0 || off < len; off += seg) {
                    if (nout > OUT_CAP - MAX_WORKERS) {
                        pthread_mutex_unlock(&dp->mu);
                        flush(fd, out, nout, sp, dp->gso, &send_errors);
                        nout = 0;
                        pthread_mutex_lock(&dp->mu);
                    }
                    size_t n = len - off < seg ? len - off : seg;
                    int made = process_any(dp, rbuf + (size_t)k * rbytes + off, n,
                                           src[k].sin_addr.s_addr, src[k].sin_port, to,
                                           out + nout, now);
                    for (int j = 0; j < made; j++)
                        if (!out[nout + j].from) out[nout + j].from = to;
                    nout += made;
                }
            }
            pthread_mutex_unlock(&dp->mu);
            flush(fd, out, nout, sp, dp->gso, &send_errors);
            if (got < nmsg) break;
        }
        if (send_errors) {
            pthread_mutex_lock(&dp->mu);
            dp->send_errors += send_errors;
            pthread_mutex_unlock(&dp->mu);
            send_errors = 0;
        }
    }
    Py_END_ALLOW_THREADS
cleanup:
    if (dp->gso) gro_set(fd, 0);
    free(rbuf); free(obuf); free(out); free(rmsgs); free(sp); free(riov); free(src); free(rctl);
    __atomic_store_n(&dp->serving, 0, __ATOMIC_SEQ_CST);
    if (interrupted) return NULL; /* the handler's exception */
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *dp_stop(Datapath *dp, PyObject *unused) {
    __atomic_store_n(&dp->stop, 1, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *dp_clear_stop(Datapath *dp, PyObject *unused) {
    __atomic_store_n(&dp->stop, 0, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyMethodDef dp_methods[] = {
    {"install", (PyCFunction)dp_install, METH_VARARGS, "install(job_id, n, pool, lanes, "
     "sum_bits, table, addrs, vote, n_shards, shard): install or re-install a job, its "
     "slots reset"},
    {"remove", (PyCFunction)dp_remove, METH_VARARGS, "remove(job_id)"},
    {"counters", (PyCFunction)dp_counters, METH_VARARGS,
     "counters(job_ids) -> (drops, {job_id: counters}, send_errors, echoed)"},
    {"handle", (PyCFunction)dp_handle, METH_VARARGS,
     "handle(datagram, ip, port) -> [(bytes, ip, port)]"},
    {"serve", (PyCFunction)dp_serve, METH_VARARGS,
     "serve(fd, duration): the receive/answer loop, without the GIL, until stop()"},
    {"stop", (PyCFunction)dp_stop, METH_NOARGS, "ask serve() to return"},
    {"clear_stop", (PyCFunction)dp_clear_stop, METH_NOARGS, "allow serve() to run again"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject DatapathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "thc.net._fastagg.Datapath",
    .tp_basicsize = sizeof(Datapath),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Registers and the serving loop of the compiled aggregator (or echo).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)dp_init,
    .tp_dealloc = (destructor)dp_dealloc,
    .tp_methods = dp_methods,
};

/* ---------------------------------------------------------------------------------------- */
/* Load generator: n workers of one job, one socket each, a window of chunks each.           */

typedef struct {
    int fd, wid;
    const uint8_t *data; /* chunks * data_bytes */
    uint8_t *done;
    long base, hi;
    double last;
} Lane;

static void send_chunks(Lane *l, long *seqs, int m, struct sockaddr_in *agg,
                        int job_id, int pool, int lanes, uint32_t run, uint32_t tag,
                        uint8_t data_type,
                        int data_bytes, uint8_t *sbuf, struct mmsghdr *msgs,
                        struct iovec *iov, long *sent) {
    int done = 0;
    while (done < m) {
        int b = m - done > BATCH ? BATCH : m - done;
        for (int k = 0; k < b; k++) {
            long s = seqs[done + k];
            uint8_t *p = sbuf + (size_t)k * OUT_BYTES;
            write_header(p, data_type, (uint8_t)l->wid, (uint16_t)job_id, (uint16_t)(s % pool),
                         (uint8_t)((s / pool) % 2), 0, (uint32_t)s, (uint32_t)(s * lanes), tag,
                         run, 0);
            memcpy(p + HDR, l->data + (size_t)s * data_bytes, data_bytes);
            iov[k].iov_base = p;
            iov[k].iov_len = HDR + (size_t)data_bytes;
            memset(&msgs[k].msg_hdr, 0, sizeof msgs[k].msg_hdr);
            msgs[k].msg_hdr.msg_name = agg;
            msgs[k].msg_hdr.msg_namelen = sizeof *agg;
            msgs[k].msg_hdr.msg_iov = &iov[k];
            msgs[k].msg_hdr.msg_iovlen = 1;
        }
        if (b > 1 && __atomic_load_n(&gso_ok, __ATOMIC_RELAXED)) {
            /* one GSO send of the b equal-sized datagrams (see send_groups) */
            char cbuf[CMSG_SPACE(sizeof(uint16_t))];
            struct msghdr h = {.msg_name = agg, .msg_namelen = sizeof *agg, .msg_iov = iov,
                               .msg_iovlen = (size_t)b, .msg_control = cbuf,
                               .msg_controllen = sizeof cbuf};
            struct cmsghdr *c = CMSG_FIRSTHDR(&h);
            c->cmsg_level = SOL_UDP;
            c->cmsg_type = UDP_SEGMENT;
            c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
            uint16_t size = (uint16_t)(HDR + data_bytes);
            memcpy(CMSG_DATA(c), &size, sizeof size);
            if (sendmsg(l->fd, &h, 0) >= 0) {
                done += b;
                *sent += b;
                continue;
            }
            if (errno == EINTR) continue;
            if (gso_refused(errno)) {
                __atomic_store_n(&gso_ok, 0, __ATOMIC_RELAXED);
            } else {
                done += b; /* lost: the retransmission timer resends them */
                continue;
            }
        }
        int r = sendmmsg(l->fd, msgs, (unsigned)b, 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            done++; /* lost: the retransmission timer resends it */
        } else {
            done += r;
            *sent += r;
        }
    }
}

/* drive(workers, agg_ip, agg_port, job_id, pool, lanes, run, tag, chunks, window, payloads,
 *       types, rto, deadline) -> (seconds, results, sent, retransmitted, complete); tag: the
 *       job's configuration tag, sent in the bitmap field */
static PyObject *fa_drive(PyObject *self, PyObject *args) {
    PyObject *fds, *payloads, *types;
    unsigned long agg_ip, run, tag;
    int agg_port, job_id, pool, lanes, window;
    long chunks;
    double rto, deadline;
    if (!PyArg_ParseTuple(args, "OkiiiikkliOOdd", &fds, &agg_ip, &agg_port, &job_id, &pool,
                          &lanes, &run, &tag, &chunks, &window, &payloads, &types, &rto, &deadline))
        return NULL;
    PyObject *fseq = items_of(fds, "workers must be a sequence of (fd, worker_id)");
    if (!fseq) return NULL;
    int n = (int)PySequence_Fast_GET_SIZE(fseq);
    int data_bytes = lanes / 2;
    long tcodes[N_TYPES];
    PyObject *tseq = items_of(types, "types must be a sequence");
    if (!tseq) {
        Py_DECREF(fseq);
        return NULL;
    }
    int bad = PySequence_Fast_GET_SIZE(tseq) != N_TYPES || n < 1 || n > MAX_WORKERS ||
              window < 1 || window > pool || chunks < 1 || lanes < 2 || lanes % 2 ||
              HDR + data_bytes > OUT_BYTES || PySequence_Size(payloads) != n ||
              !(rto > 0 && rto < INFINITY) || !(deadline > 0 && deadline < INFINITY);
    for (int t = 0; !bad && t < N_TYPES; t++)
        tcodes[t] = PyLong_AsLong(PySequence_Fast_GET_ITEM(tseq, t));
    Py_DECREF(tseq);
    if (bad) {
        Py_DECREF(fseq);
        PyErr_SetString(PyExc_ValueError, "drive: bad arguments");
        return NULL;
    }
    Lane *ls = calloc((size_t)n, sizeof(Lane));
    Py_buffer *bufs = calloc((size_t)n, sizeof(Py_buffer));
    int nbufs = 0;
    for (int w = 0; ls && bufs && w < n; w++) {
        int fd, wid;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fseq, w), "ii", &fd, &wid)) break;
        if (wid < 0 || wid >= MAX_WORKERS) {
            PyErr_SetString(PyExc_ValueError, "drive: worker id outside 0..31");
            break;
        }
        ls[w].fd = fd;
        ls[w].wid = wid;
        PyObject *p = PySequence_GetItem(payloads, w);
        if (!p || PyObject_GetBuffer(p, &bufs[w], PyBUF_SIMPLE) < 0) {
            Py_XDECREF(p);
            break;
        }
        Py_DECREF(p);
        nbufs++;
        if (bufs[w].len < chunks * data_bytes) {
            PyErr_SetString(PyExc_ValueError, "drive: a payload is shorter than chunks");
            break;
        }
        ls[w].data = bufs[w].buf;
        ls[w].done = calloc((size_t)chunks, 1);
        if (!ls[w].done) {
            PyErr_NoMemory();
            break;
        }
    }
    Py_DECREF(fseq);
    uint8_t *rbuf = malloc((size_t)BATCH * RECV_BYTES);
    uint8_t *sbuf = malloc((size_t)BATCH * OUT_BYTES);
    struct mmsghdr *msgs = calloc(BATCH, sizeof(struct mmsghdr));
    struct iovec *iov = calloc(BATCH, sizeof(struct iovec));
    long *seqs = malloc(sizeof(long) * (size_t)(chunks > window ? chunks : window));
    struct pollfd *pfds = calloc((size_t)n, sizeof(struct pollfd));
    PyObject *res = NULL;
    if (!PyErr_Occurred() && (!ls || !bufs || !rbuf || !sbuf || !msgs || !iov || !seqs || !pfds))
        PyErr_NoMemory();
    if (PyErr_Occurred()) goto cleanup;
    struct sockaddr_in agg = {.sin_family = AF_INET};
    agg.sin_addr.s_addr = htonl((uint32_t)agg_ip);
    agg.sin_port = htons((uint16_t)agg_port);
    struct sockaddr_in from[BATCH];
    long results = 0, sent = 0, retransmitted = 0;
    int complete = 0;
    double t0 = 0, t1 = 0, last_check = 0;
    int interrupted = 0;
    int main = on_main_thread();
    if (main < 0) goto cleanup; /* a pending signal's handler raised */
    Py_BEGIN_ALLOW_THREADS
    t0 = now_s();
    for (int w = 0; w < n; w++) {
        ls[w].last = t0;
        pfds[w].fd = ls[w].fd;
        pfds[w].events = POLLIN;
    }
    uint8_t result_type = (uint8_t)tcodes[T_RESULT];
    last_check = t0;
    for (;;) {
        int finished = 0;
        double now = now_s();
        if ((interrupted = signalled(main, now, &last_check))) break;
        for (int w = 0; w < n; w++) {
            Lane *l = &ls[w];
            if (l->base >= chunks) {
                finished++;
                continue;
            }
            int m = 0;
            while (l->hi < chunks && l->hi < l->base + window) seqs[m++] = l->hi++;
            if (m)
                send_chunks(l, seqs, m, &agg, job_id, pool, lanes, (uint32_t)run, (uint32_t)tag,
                            (uint8_t)tcodes[T_DATA], data_bytes, sbuf, msgs, iov, &sent);
            if (now - l->last > rto) {
                m = 0;
                for (long s = l->base; s < l->hi; s++)
                    if (!l->done[s]) seqs[m++] = s;
                retransmitted += m;
                send_chunks(l, seqs, m, &agg, job_id, pool, lanes, (uint32_t)run, (uint32_t)tag,
                            (uint8_t)tcodes[T_DATA], data_bytes, sbuf, msgs, iov, &sent);
                l->last = now;
            }
        }
        if (finished == n) {
            complete = 1;
            break;
        }
        if (now - t0 > deadline) break;
        if (poll(pfds, (nfds_t)n, 5) <= 0) continue;
        now = now_s();
        for (int w = 0; w < n; w++) {
            if (!(pfds[w].revents & POLLIN)) continue;
            Lane *l = &ls[w];
            for (;;) {
                for (int k = 0; k < BATCH; k++) {
                    iov[k].iov_base = rbuf + (size_t)k * RECV_BYTES;
                    iov[k].iov_len = RECV_BYTES;
                    memset(&msgs[k].msg_hdr, 0, sizeof msgs[k].msg_hdr);
                    msgs[k].msg_hdr.msg_iov = &iov[k];
                    msgs[k].msg_hdr.msg_iovlen = 1;
                    msgs[k].msg_hdr.msg_name = &from[k];
                    msgs[k].msg_hdr.msg_namelen = sizeof from[k];
                }
                int got = recvmmsg(l->fd, msgs, BATCH, MSG_DONTWAIT, NULL);
                if (got <= 0) break;
                for (int k = 0; k < got; k++) {
                    const uint8_t *d = rbuf + (size_t)k * RECV_BYTES;
                    /* the aggregator's RESULT of this lane's chunk: its address, this job,
                     * worker and run (another sender's datagram counts nothing) */
                    if (msgs[k].msg_len < HDR || d[0] != result_type || d[1] != l->wid ||
                        rd16(d + 2) != (uint16_t)job_id || rd32(d + 20) != (uint32_t)run ||
                        from[k].sin_addr.s_addr != agg.sin_addr.s_addr ||
                        from[k].sin_port != agg.sin_port)
                        continue;
                    uint32_t s = rd32(d + 8);
                    if ((long)s >= chunks || l->done[s]) continue;
                    l->done[s] = 1;
                    results++;
                    l->last = now;
                }
                while (l->base < chunks && l->done[l->base]) l->base++;
                if (got < BATCH) break;
            }
        }
    }
    t1 = now_s();
    Py_END_ALLOW_THREADS
    if (!interrupted)
        res = Py_BuildValue("(dlllO)", t1 - t0, results, sent, retransmitted,
                            complete ? Py_True : Py_False);
cleanup:
    for (int w = 0; ls && w < n; w++) free(ls[w].done);
    for (int w = 0; w < nbufs; w++) PyBuffer_Release(&bufs[w]);
    free(ls); free(bufs); free(rbuf); free(sbuf); free(msgs); free(iov); free(seqs); free(pfds);
    return res;
}

/* ---------------------------------------------------------------------------------------- */
/* The client's sliding window (host/net/pywindow.py's PythonWindow, common case):
 * one worker's chunks out with sendmmsg, replies in with recvmmsg, each reply validated as the
 * Python loop validates it, retransmission on timeout with exponential backoff and the same
 * fast-retransmit rule, RFC 6298's estimator per shard, without the GIL. Python keeps the
 * exceptions: stream() returns an event (done, an epoch change, a deadline) for it to raise. */

#define CL_RECV_BYTES 4096 /* the Python loop's receive buffer */
/* stream()'s arguments and timeout report: host/net/fastclient.py refuses another version */
#define CL_WINDOW_VERSION 11
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
       S_STRAYS, S_QUEUE_FULL, N_CSTATS };

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

/* The queue as one GSO send per shard (order kept per shard); 0 where GSO is off or was
 * refused, and the caller sends the queue datagram by datagram. */
static int cl_flush_gso(Client *c) {
    if (!c->gso || c->nq < 2 || !__atomic_load_n(&gso_ok, __ATOMIC_RELAXED)) return 0;
    struct mmsghdr g[BATCH];
    struct iovec iov[BATCH];
    char ctl[BATCH][CMSG_SPACE(sizeof(uint16_t))];
    uint8_t taken[BATCH] = {0};
    size_t len = c->iov[0].iov_len;
    int max_segs = (int)(GSO_BYTES / len);
    if (max_segs > GSO_SEGS) max_segs = GSO_SEGS;
    int ng = 0, niov = 0;
    for (int k = 0; k < c->nq; k++) {
        if (taken[k]) continue;
        struct msghdr *h = &g[ng].msg_hdr;
        memset(h, 0, sizeof *h);
        h->msg_name = c->msgs[k].msg_hdr.msg_name;
        h->msg_namelen = sizeof(struct sockaddr_in);
        h->msg_iov = &iov[niov];
        for (int j = k; j < c->nq && (int)h->msg_iovlen < max_segs; j++)
            if (!taken[j] && c->msgs[j].msg_hdr.msg_name == h->msg_name) {
                taken[j] = 1;
                iov[niov++] = c->iov[j];
                h->msg_iovlen++;
            }
        if (h->msg_iovlen > 1) {
            h->msg_control = ctl[ng];
            h->msg_controllen = sizeof ctl[ng];
            struct cmsghdr *cm = CMSG_FIRSTHDR(h);
            cm->cmsg_level = SOL_UDP;
            cm->cmsg_type = UDP_SEGMENT;
            cm->cmsg_len = CMSG_LEN(sizeof(uint16_t));
            uint16_t size = (uint16_t)len;
            memcpy(CMSG_DATA(cm), &size, sizeof size);
        }
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
        if (g[done].msg_hdr.msg_controllen && gso_refused(e)) {
            __atomic_store_n(&gso_ok, 0, __ATOMIC_RELAXED);
            if (done == 0) return 0;
            /* the groups not sent, datagram by datagram */
            int nq = 0;
            for (int m = done; m < ng; m++)
                for (size_t v = 0; v < g[m].msg_hdr.msg_iovlen; v++) {
                    c->iov[nq] = g[m].msg_hdr.msg_iov[v];
                    struct msghdr *h = &c->msgs[nq].msg_hdr;
                    memset(h, 0, sizeof *h);
                    h->msg_name = g[m].msg_hdr.msg_name;
                    h->msg_namelen = sizeof(struct sockaddr_in);
                    h->msg_iov = &c->iov[nq];
                    h->msg_iovlen = 1;
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

/* Queue chunk i's DATA/MAX datagram (a first send or a retransmission). */
static void cl_send(Client *c, long i) {
    if (c->nq == BATCH) cl_flush(c);
    uint64_t s = c->base + (uint64_t)i;
    uint8_t *p = c->sbuf + (size_t)c->nq * CL_OUT_BYTES;
    write_header(p, c->pkt_type, c->worker, c->job_id, (uint16_t)(s % c->pool),
                 (uint8_t)((s / c->pool) % 2), 0, (uint32_t)s,
                 (uint32_t)(c->offset_base + (uint64_t)i * (uint64_t)c->lanes), c->up_tag,
                 c->run, c->incarnation);
    memcpy(p + HDR, c->chunks + (size_t)i * c->chunk_bytes, (size_t)c->chunk_bytes);
    c->iov[c->nq].iov_base = p;
    c->iov[c->nq].iov_len = HDR + (size_t)c->chunk_bytes;
    struct msghdr *h = &c->msgs[c->nq].msg_hdr;
    memset(h, 0, sizeof *h);
    h->msg_name = &c->aggs[cl_shard(c, i)];
    h->msg_namelen = sizeof(struct sockaddr_in);
    h->msg_iov = &c->iov[c->nq];
    h->msg_iovlen = 1;
    c->nq++;
    c->st[S_SENT]++;
    c->st[S_BYTES_SENT] += HDR + (unsigned long long)c->chunk_bytes;
}

/* Queue a retransmission of chunk i; the first silent_after since its shard last answered
 * are remembered: a live shard answers each. */
static void cl_resend(Client *c, long i, double now) {
    int s = cl_shard(c, i);
    c->st[S_RETRANSMITTED]++;
    cl_send(c, i);
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
static void cl_impossible(Client *c, int shard, long long *pend, long r) {
    c->st[S_IGNORED]++;
    c->st[S_REJECTED]++;
    c->rejected[shard]++;
    pend[r] = -1;
}

/* A RESULT of DATA that counts this worker: each lane (host order, `itemsize` bytes) holds
 * the worker's own table value (a vote job's sign bit) and at most `span` more. One unsigned
 * difference tests both: below its own value it wraps past any span. */
static int cl_own_bad(const uint8_t *o, int itemsize, const uint8_t *own, int lanes,
                      const uint32_t *lut, int vote, uint32_t span) {
    uint32_t bad = 0;
    if (vote) {
        for (int l = 0; l < lanes; l++) {
            uint32_t v = itemsize == 2 ? ((const uint16_t *)o)[l] : ((const uint32_t *)o)[l];
            bad |= v - ((uint32_t)(own[l >> 3] >> (7 - (l & 7))) & 1u) > span;
        }
    } else if (itemsize == 2) {
        const uint16_t *o16 = (const uint16_t *)o; /* numpy aligns its elements */
        for (int k = 0; k < lanes / 2; k++) {
            uint8_t b = own[k];
            bad |= ((uint32_t)o16[2 * k] - lut[b >> 4] > span) |
                   ((uint32_t)o16[2 * k + 1] - lut[b & 15] > span);
        }
    } else {
        const uint32_t *o32 = (const uint32_t *)o;
        for (int k = 0; k < lanes / 2; k++) {
            uint8_t b = own[k];
            bad |= (o32[2 * k] - lut[b >> 4] > span) | (o32[2 * k + 1] - lut[b & 15] > span);
        }
    }
    return bad != 0;
}

/* stream(fd, header, chunks, chunk_bytes, aggs, epochs, window, timing, srtt, rttvar, out,
 *        out_itemsize, expect_payload, gso)
 *   header: (pkt_type, result_type, pending_type, other_result_type, is_data, worker, job_id,
 *            pool, run, base, offset_base, lanes, n_workers, refused_type, top,
 *            incarnation, (tag, tag_mask, up_tag), own_lut, vote): own_lut, 16 host-order
 *            uint32, the job's table; vote: DATA lanes are sign bits. Replies of the three
 *            types are this job's, a result of the other type is counted as ignored; an epoch
 *            learnt must hold the job's configuration tag: epoch & tag_mask == tag
 *            (protocol.py's EPOCH_TAG_SHIFT); up_tag: that tag as every packet sent carries it
 *            in its bitmap field (protocol.py's upstream_tag)
 *   aggs: [(ipv4 as int, port)] per shard; epochs: [int or None] per shard (updated in place)
 *   timing: (timeout, max_timeout, deadline, fast_retransmit_after, fast_backoff_cap,
 *           silent_after, recv_batch), the last four host/net/window.py's rules (results of
 *           later chunks that mean a chunk was lost; the backoff cap in RTOs of the head and
 *           of lost chunks; unanswered resends that make a shard silent; datagrams taken in
 *           before the timers are looked at); srtt/rttvar: [float or None] / [float] per
 *           shard
 *   out: total * lanes elements of out_itemsize bytes (host order). Its rounds have no
 *   loss bound (the Python window's): a chunk closed short ends the round
 * -> (event, info, stats, srtt, rttvar) with event 0 done, 1 restarted (shard, old, new),
 *    2 timeout (chunk, PENDING bitmap or None, seconds since its shard's last reply, the
 *    shard's unanswered resends, its impossible replies, the chunks it ended this round),
 *    3 OS error (errno), 4 refused (chunk, reason code, detail), 5 a chunk closed short
 *    (chunk, count, bitmap), 6 an epoch of another configuration (shard, epoch) */
static PyObject *fa_stream(PyObject *self, PyObject *args) {
    PyObject *hdr, *aggs_o, *epochs, *srtt_o, *rttvar_o;
    Py_buffer chunks = {0}, out = {0};
    int fd, chunk_bytes, window, out_itemsize, expect_payload, gso;
    double timeout, max_timeout, deadline;
    int fast_after, backoff_cap, silent_after, recv_batch;
    if (!PyArg_ParseTuple(args, "iOy*iO!O!i(dddiiii)O!O!w*iip", &fd, &hdr, &chunks,
                          &chunk_bytes, &PyList_Type, &aggs_o, &PyList_Type, &epochs, &window,
                          &timeout, &max_timeout, &deadline, &fast_after,
                          &backoff_cap, &silent_after, &recv_batch, &PyList_Type, &srtt_o,
                          &PyList_Type, &rttvar_o, &out, &out_itemsize, &expect_payload,
                          &gso))
        return NULL;
    Client *c = calloc(1, sizeof(Client));
    PyObject *res = NULL;
    int n_shards = (int)PyList_GET_SIZE(aggs_o);
    int pkt_type, result_type, pending_type, other_result, is_data, worker, job_id, lanes,
        n_workers, refused_type, top;
    unsigned long incarnation, tag, tag_mask, up_tag;
    unsigned long pool, run;
    const char *lut_bytes;
    Py_ssize_t lut_len;
    int vote;
    uint32_t lut[16];
    unsigned long long base, offset_base;
    long total = 0;
    uint8_t *done = NULL, *mark = NULL;
    double *due = NULL, *backoff = NULL, *started = NULL;
    /* per chunk resent M_LONE: its first send's round trip, -1 for none, and when the
     * second RESULT may come (the resend's delay after the first, halved: a duplicate of
     * one answer comes at once) */
    double *answered = NULL, *earliest = NULL;
    /* per window slot: when the chunk's first resend went (for that delay, and the PENDING
     * that answers it: window.py's RttEstimator) */
    double *resent_at = NULL;
    int *later = NULL;
    long long *pend = NULL;
    long long *epoch = NULL;
    PyObject *aggs_t = NULL, *epochs_t = NULL, *srtt_t = NULL, *rttvar_t = NULL;
    uint8_t *rbuf = NULL;
    struct mmsghdr *rmsgs = NULL;
    struct iovec *riov = NULL;
    struct sockaddr_in *rsrc = NULL;
    char (*rctl)[GRO_CTL] = NULL;
    if (!c) {
        PyErr_NoMemory();
        goto cleanup;
    }
    if (!PyArg_ParseTuple(hdr, "iiiiiiiO&kKKiiiik(kkk)y#p", &pkt_type, &result_type,
                          &pending_type, &other_result, &is_data, &worker, &job_id, as_ulong,
                          &pool, &run,
                          &base, &offset_base, &lanes, &n_workers, &refused_type, &top,
                          &incarnation, &tag, &tag_mask, &up_tag, &lut_bytes, &lut_len, &vote))
        goto cleanup;
    if (lut_len == sizeof lut) memcpy(lut, lut_bytes, sizeof lut);
    int wire_bytes = lanes > 0 ? expect_payload / lanes : 0;
    if (chunk_bytes > 0) total = (long)(chunks.len / chunk_bytes);
    if (n_shards < 1 || PyList_GET_SIZE(epochs) != n_shards ||
        PyList_GET_SIZE(srtt_o) != n_shards || PyList_GET_SIZE(rttvar_o) != n_shards ||
        window < 1 || pool < 1 || pool > 65536 || (pool & (pool - 1)) ||
        (unsigned long)window > pool || chunk_bytes < 1 ||
        chunks.len % chunk_bytes || HDR + chunk_bytes > CL_OUT_BYTES || lanes < 1 ||
        expect_payload % lanes || (wire_bytes != 1 && wire_bytes != 2 && wire_bytes != 4) ||
        (out_itemsize != 2 && out_itemsize != 4) || out_itemsize < wire_bytes ||
        n_workers < 1 || n_workers > MAX_WORKERS || worker < 0 || worker > 255 ||
        silent_after < 1 || silent_after > 64 || recv_batch < 1 || lut_len != sizeof lut ||
        (is_data ? chunk_bytes * (vote ? 8 : 2) != lanes : chunk_bytes != 4 * lanes) ||
        out.len < (Py_ssize_t)total * lanes * out_itemsize) {
        PyErr_SetString(PyExc_ValueError, "stream: bad arguments");
        goto cleanup;
    }
    c->aggs = calloc((size_t)n_shards, sizeof(struct sockaddr_in));
    c->srtt = calloc((size_t)n_shards, sizeof(double));
    c->rttvar = calloc((size_t)n_shards, sizeof(double));
    c->last_reply = calloc((size_t)n_shards, sizeof(double));
    c->asked = calloc((size_t)n_shards * (size_t)silent_after, sizeof(double));
    c->nasked = calloc((size_t)n_shards, sizeof(int));
    c->rejected = calloc((size_t)n_shards, sizeof(unsigned long long));
    c->not_float = calloc((size_t)n_shards, sizeof(unsigned long long));
    c->taken = calloc((size_t)n_shards, sizeof(unsigned long long));
    c->silent_after = silent_after;
    epoch = calloc((size_t)n_shards, sizeof(long long));
    c->sbuf = malloc((size_t)BATCH * CL_OUT_BYTES);
    done = calloc((size_t)total + 1, 1);
    answered = malloc(((size_t)total + 1) * sizeof(double));
    earliest = calloc((size_t)total + 1, sizeof(double));
    resent_at = calloc((size_t)window, sizeof(double));
    mark = calloc((size_t)window, 1);
    due = calloc((size_t)window, sizeof(double));
    backoff = calloc((size_t)window, sizeof(double));
    started = calloc((size_t)window, sizeof(double));
    later = calloc((size_t)window, sizeof(int));
    pend = calloc((size_t)window, sizeof(long long));
    int nmsg = gso ? GRO_BATCH : BATCH;
    size_t rbytes = gso ? GRO_BYTES : CL_RECV_BYTES;
    rbuf = malloc((size_t)nmsg * rbytes);
    rmsgs = calloc(BATCH, sizeof(struct mmsghdr));
    riov = calloc(BATCH, sizeof(struct iovec));
    rctl = calloc(BATCH, GRO_CTL);
    rsrc = calloc(BATCH, sizeof(struct sockaddr_in));
    if (!rsrc || !c->aggs || !c->srtt || !c->rttvar || !c->last_reply || !c->asked ||
        !c->nasked || !c->rejected || !c->not_float || !c->taken || !epoch || !c->sbuf ||
        !done || !mark || !due || !backoff || !started || !later || !pend || !rbuf || !rmsgs ||
        !riov || !rctl || !answered || !earliest || !resent_at) {
        PyErr_NoMemory();
        goto cleanup;
    }
    /* copies: converting an item may run code that changes the caller's lists */
    aggs_t = PySequence_Tuple(aggs_o);
    epochs_t = PySequence_Tuple(epochs);
    srtt_t = PySequence_Tuple(srtt_o);
    rttvar_t = PySequence_Tuple(rttvar_o);
    if (!aggs_t || !epochs_t || !srtt_t || !rttvar_t) goto cleanup;
    for (int s = 0; s < n_shards; s++) {
        unsigned long ip;
        int port;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(aggs_t, s), "O&i", as_ulong, &ip, &port))
            goto cleanup;
        if (ip > 0xFFFFFFFFul || port < 0 || port > 65535) {
            PyErr_SetString(PyExc_ValueError,
                            "stream: an aggregator is an IPv4 address and a port");
            goto cleanup;
        }
        c->aggs[s].sin_family = AF_INET;
        c->aggs[s].sin_addr.s_addr = htonl((uint32_t)ip);
        c->aggs[s].sin_port = htons((uint16_t)port);
        PyObject *e = PyTuple_GET_ITEM(epochs_t, s), *r = PyTuple_GET_ITEM(srtt_t, s);
        epoch[s] = e == Py_None ? -1 : (long long)PyLong_AsUnsignedLong(e);
        c->srtt[s] = r == Py_None ? -1.0 : PyFloat_AsDouble(r);
        c->rttvar[s] = PyFloat_AsDouble(PyTuple_GET_ITEM(rttvar_t, s));
        if (PyErr_Occurred()) goto cleanup;
    }
    for (long i = 0; i <= total; i++) answered[i] = -1;
    c->fd = fd;
    c->gso = gso;
    if (gso) gro_set(fd, 1);
    c->n_shards = n_shards;
    c->window = window;
    c->lanes = lanes;
    c->n_workers = n_workers;
    c->is_data = is_data;
    c->chunk_bytes = chunk_bytes;
    c->pkt_type = (uint8_t)pkt_type;
    c->result_type = (uint8_t)result_type;
    c->pending_type = (uint8_t)pending_type;
    c->worker = (uint8_t)worker;
    c->job_id = (uint16_t)job_id;
    c->pool = (uint32_t)pool;
    c->run = (uint32_t)run;
    c->incarnation = (uint32_t)incarnation;
    c->up_tag = (uint32_t)up_tag;
    c->base = base;
    c->offset_base = offset_base;
    c->chunks = chunks.buf;
    c->timeout = timeout;
    c->max_timeout = max_timeout;

    uint8_t *outp = out.buf;
    uint32_t full = n_workers == 32 ? 0xffffffffu : ((1u << n_workers) - 1);
    int event = EV_DONE, interrupted = 0;
    long ev_chunk = 0;
    long long ev_old = 0, ev_new = 0, ev_bitmap = -1, ev_code = 0;
    int ev_shard = 0, ev_unanswered = 0;
    double ev_silent = 0;
    unsigned long long ev_rejected = 0, ev_taken = 0, ev_not_float = 0;

    int main = on_main_thread();
    if (main < 0) goto cleanup; /* a pending signal's handler raised */
    Py_BEGIN_ALLOW_THREADS
    long lo = 0, hi = 0;
    double now = now_s(), last_check = now;
    for (int s = 0; s < n_shards; s++) c->last_reply[s] = now;
    while (lo < total && event == EV_DONE) {
        while (hi < total && hi < lo + window) {
            long r = hi % window;
            cl_send(c, hi);
            due[r] = now + cl_rto(c, cl_shard(c, hi));
            if (due[r] > now + deadline) due[r] = now + deadline;
            backoff[r] = timeout;
            started[r] = now;
            later[r] = 0;
            pend[r] = -1;
            mark[r] = 0;
            hi++;
        }
        cl_flush(c);
        if (c->err) {
            event = EV_OSERROR;
            break;
        }
        double next_due = now + timeout;
        int any = 0;
        for (long i = lo; i < hi; i++)
            if (!done[i] && (!any || due[i % window] < next_due)) {
                next_due = due[i % window];
                any = 1;
            }
        double wait = next_due - now_s();
        if (wait < 0) wait = 0;
        if (wait > 0.05) wait = 0.05; /* look at Python's signals now and then */
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        struct timespec ts = {.tv_sec = (time_t)wait,
                              .tv_nsec = (long)((wait - (double)(time_t)wait) * 1e9)};
        int ready = ppoll(&pfd, 1, &ts, NULL);
        long taken = 0; /* up to recv_batch datagrams, then the timers, even under a flood */
        while (ready > 0 && event == EV_DONE && taken < recv_batch) {
            rx_arm(rmsgs, riov, rctl, rbuf, nmsg, rbytes, rsrc);
            int got = recvmmsg(fd, rmsgs, (unsigned)nmsg, MSG_DONTWAIT, NULL);
            if (got <= 0) break;
            now = now_s();
            for (int k = 0; k < got && event == EV_DONE; k++) {
                size_t len = rmsgs[k].msg_len;
                size_t seg = gro_segment(&rmsgs[k].msg_hdr, &len, CL_RECV_BYTES);
                if (seg == 0) seg = 1; /* an empty datagram: looked at once */
                if (seg < len) c->st[S_GRO_BURSTS]++;
                for (size_t off = 0; off == 0 || off < len; off += seg) {
                    const uint8_t *d = rbuf + (size_t)k * rbytes + off;
                    size_t n = len - off < seg ? len - off : seg;
                    c->st[S_RECEIVED]++;
                    c->st[S_BYTES_RECEIVED] += n;
                    taken++;
                    if (n < HDR) {
                        c->st[S_IGNORED]++;
                        continue;
                    }
                    uint8_t r_type = d[0], r_count = d[7];
                    uint32_t r_seq = rd32(d + 8), r_bitmap = rd32(d + 16), r_run = rd32(d + 20),
                             r_epoch = rd32(d + 24);
                    int shard = (int)(r_seq % (uint32_t)n_shards);
                    /* only the address that owns the chunk answers for it */
                    if (rd16(d + 2) != c->job_id || d[1] != c->worker ||
                        (r_type != c->pending_type && r_type != c->result_type &&
                         r_type != (uint8_t)other_result && r_type != (uint8_t)refused_type)) {
                        c->st[S_IGNORED]++;
                        if (rsrc[k].sin_family == AF_INET &&
                            rsrc[k].sin_addr.s_addr == c->aggs[shard].sin_addr.s_addr &&
                            rsrc[k].sin_port == c->aggs[shard].sin_port)
                            c->st[S_STRAYS]++;   /* from the aggregator, for no chunk here */
                        continue;
                    }
                    if (rsrc[k].sin_family != AF_INET ||
                        rsrc[k].sin_addr.s_addr != c->aggs[shard].sin_addr.s_addr ||
                        rsrc[k].sin_port != c->aggs[shard].sin_port) {
                        c->st[S_IGNORED]++;
                        if (rsrc[k].sin_family == AF_INET &&
                            rsrc[k].sin_port == c->aggs[shard].sin_port)
                            c->st[S_ELSEWHERE]++;   /* the port, from another IP */
                        continue;
                    }
                    if (r_run != c->run) {
                        c->st[S_OTHER_RUN]++;
                        continue;
                    }
                    long i = (long)(uint32_t)(r_seq - (uint32_t)c->base);
                    uint64_t g = c->base + (uint64_t)i; /* the chunk's seq before the wrap */
                    int ours = i < hi && rd16(d + 4) == r_seq % c->pool &&
                               d[6] == (uint8_t)((g / c->pool) & 1) &&
                               rd32(d + 12) == (uint32_t)(c->offset_base + (uint64_t)i * lanes);
                    if (!ours || done[i]) {
                        c->st[S_IGNORED]++;
                        if (!ours && i < hi) c->st[S_STRAYS]++;   /* of this round */
                        if (ours && answered[i] >= 0 && r_type == c->result_type &&
                            n - HDR == (size_t)expect_payload && !(r_bitmap & ~full) &&
                            __builtin_popcount(r_bitmap) == r_count && now >= earliest[i]) {
                            c->st[S_SPURIOUS]++;
                            cl_sample_rtt(c, shard, answered[i]);
                            answered[i] = -1;
                        }
                        continue;
                    }
                    c->last_reply[shard] = now;
                    c->nasked[shard] = 0;
                    int learn = 0; /* the shard's first epoch, taken from a reply that passes */
                    if ((long long)r_epoch != epoch[shard]) {
                        if (epoch[shard] >= 0) {
                            event = EV_RESTARTED;
                            ev_shard = shard;
                            ev_old = epoch[shard];
                            ev_new = r_epoch;
                            break;
                        }
                        if ((r_epoch & tag_mask) != tag) {
                            event = EV_MISCONFIGURED; /* another job configuration's epoch */
                            ev_shard = shard;
                            ev_new = r_epoch;
                            break;
                        }
                        learn = 1;
                    }
                    long r = i % window;
                    if (r_type == (uint8_t)refused_type) {
                        if (learn) epoch[shard] = r_epoch;
                        event = EV_REFUSED;
                        ev_chunk = i;
                        ev_code = r_count;
                        ev_bitmap = r_bitmap;
                        break;
                    }
                    if (r_type == c->pending_type &&
                        ((r_bitmap & ~full) || c->worker >= 32 ||
                         !(r_bitmap >> c->worker & 1) ||
                         (r_count == 0 ? r_bitmap == full
                                       : r_count >= n_workers ||
                                         __builtin_popcount(r_bitmap) != r_count))) {
                        /* a PENDING no aggregator sends: one without our bit (it answers our
                         * packet, which acknowledged the use before and joined this one), a
                         * held one that every worker acknowledged, or a wait for a chunk that
                         * has every worker */
                        cl_impossible(c, shard, pend, r);
                        continue;
                    }
                    if (r_type == c->pending_type) {
                        if (learn) epoch[shard] = r_epoch;
                        c->st[S_PENDING]++;
                        /* bit 32: held (count 0: the previous use of the slot version
                         * is not yet acknowledged by the workers outside the bitmap) */
                        pend[r] = (long long)(r_bitmap & full) | ((long long)(r_count == 0) << 32);
                        mark[r] &= (uint8_t)~M_LONE;
                        if (r_count && (mark[r] & M_RESENT) && !(mark[r] & M_UNPAIRED))
                            cl_sample_rtt(c, shard, now - resent_at[r]);
                        mark[r] |= M_UNPAIRED;
                        continue;
                    }
                    if (r_type != c->result_type || n - HDR != (size_t)expect_payload ||
                        (r_bitmap & ~full) || __builtin_popcount(r_bitmap) != r_count ||
                        (r_count != n_workers && !is_data)) {
                        cl_impossible(c, shard, pend, r);
                        continue;
                    }
                    /* Copy the lanes out while checking them (the row is rewritten by the
                     * result that is taken): no sum above what the contributors can make, no
                     * max below ours, and a sum that counts us holds our own value (a wrong
                     * sum where the aggregator lost or overwrote it). No early exit: the
                     * common loop vectorizes. */
                    const uint8_t *q = d + HDR, *own = c->chunks + (size_t)i * chunk_bytes;
                    uint8_t *o = outp + (size_t)i * lanes * out_itemsize;
                    /* DATA: what the contributors can sum to; MAX: the largest float's bits */
                    uint32_t bound = is_data ? (uint32_t)r_count * (uint32_t)top : (uint32_t)top;
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
                            uint32_t v = wire_bytes == 1 ? q[l]
                                         : wire_bytes == 2 ? rd16(q + 2 * l) : rd32(q + 4 * l);
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
                    if (is_data && !bad && c->worker < 32 && (r_bitmap >> c->worker & 1))
                        bad = cl_own_bad(o, out_itemsize, own, lanes, lut, vote,
                                         (uint32_t)(r_count - 1) * (uint32_t)top);
                    if (bad) {
                        cl_impossible(c, shard, pend, r);
                        c->not_float[shard] += (unsigned long long)above;
                        continue;
                    }
                    if (learn) epoch[shard] = r_epoch;
                    if (r_count != n_workers) {
                        /* closed short (a peer's FLUSH): no chunk of this round may be */
                        event = EV_SHORT;
                        ev_chunk = i;
                        ev_code = r_count;
                        ev_bitmap = r_bitmap;
                        break;
                    }
                    done[i] = 1;
                    c->taken[shard]++;
                    if (!(mark[r] & M_RESENT)) cl_sample_rtt(c, shard, now - started[r]);
                    else if (mark[r] & M_LONE) {
                        answered[i] = now - started[r];
                        earliest[i] = now + (resent_at[r] - started[r]) / 2;
                    }
                    if (i == lo) {
                        while (lo < total && done[lo]) lo++;
                        if (lo < hi) { /* the new head: the whole window waits for it */
                            long rh = lo % window;
                            double rto = cl_rto(c, cl_shard(c, lo));
                            if (backoff[rh] > rto) backoff[rh] = rto;
                            if (due[rh] > now + rto) due[rh] = now + rto;
                        }
                    }
                    if (i > lo) {
                        /* later chunks of the same shard overtook these: every worker's chunks
                         * get through, so these or their results were lost. Fast retransmit,
                         * and from now on resend every RTO: the backoff a chunk built up while
                         * it waited for the others must not delay recovering its lost result */
                        double rto = cl_rto(c, shard);
                        for (long j = lo; j < i; j++) {
                            if (done[j] || cl_shard(c, j) != shard) continue;
                            long rj = j % window;
                            if (++later[rj] == fast_after) {
                                /* overtaken this often: lost, not merely reordered */
                                cl_resend(c, j, now);
                                if (mark[rj] & M_RESENT) mark[rj] |= M_UNPAIRED;
                                else resent_at[rj] = now;
                                mark[rj] = (uint8_t)((mark[rj] & ~M_LONE) | M_RESENT |
                                                     M_OVERTAKEN);
                                backoff[rj] = rto;
                                due[rj] = now + rto;
                                if (due[rj] > started[rj] + deadline)
                                    due[rj] = started[rj] + deadline;
                                later[rj] = -4 * fast_after;
                            }
                        }
                    }
                }
            }
            if (got < nmsg) break;
        }
        cl_flush(c);
        if (event != EV_DONE) break;
        if (c->err) {
            event = EV_OSERROR;
            break;
        }
        now = now_s();
        if ((interrupted = signalled(main, now, &last_check))) break;
        if (now < next_due) continue;
        for (long i = lo; i < hi && event == EV_DONE; i++) {
            long r = i % window;
            if (done[i] || due[r] > now) continue;
            if (now - started[r] >= deadline) {
                event = EV_TIMEOUT;
                ev_chunk = i;
                ev_bitmap = pend[r];
                int s = cl_shard(c, i);
                ev_silent = now - c->last_reply[s];
                ev_unanswered = cl_unanswered(c, s, now);
                ev_rejected = c->rejected[s];
                ev_not_float = c->not_float[s];
                ev_taken = c->taken[s];
                break;
            }
            int lone = !(mark[r] & M_RESENT) && pend[r] < 0;
            cl_resend(c, i, now);
            if (mark[r] & M_RESENT) mark[r] |= M_UNPAIRED;
            else resent_at[r] = now;
            mark[r] = (uint8_t)((mark[r] & ~M_LONE) | M_RESENT | (lone ? M_LONE : 0));
            double b = cl_rto(c, cl_shard(c, i));
            /* exponential backoff, capped at backoff_cap RTOs for the window's head
             * (every chunk behind it waits for it) and for a chunk that later ones
             * overtook fast_after times (a lost packet, not a missing worker);
             * a cap, not none: a head that waits for a straggler, or a chunk that is only
             * reordered, would otherwise resend every RTO */
            {
                int held = pend[r] >= 0 && ((pend[r] >> 32) & 1);
                double cap = (i == lo || (mark[r] & M_OVERTAKEN) || held) ? backoff_cap * b
                                                                          : max_timeout;
                if (backoff[r] > b) b = backoff[r];
                b *= 2;
                if (b > cap) b = cap;
                if (b > max_timeout) b = max_timeout;
            }
            backoff[r] = b;
            due[r] = now + b;
            /* a backoff never waits past the deadline: the chunk's timeout is raised then */
            if (due[r] > started[r] + deadline) due[r] = started[r] + deadline;
        }
        cl_flush(c);
        if (event == EV_DONE && c->err) event = EV_OSERROR;
    }
    Py_END_ALLOW_THREADS
    if (interrupted) goto cleanup;
    for (int s = 0; s < n_shards; s++) {
        PyObject *e = epoch[s] < 0 ? (Py_INCREF(Py_None), Py_None)
                                   : PyLong_FromLongLong(epoch[s]);
        if (!e || PyList_SetItem(epochs, s, e) < 0) goto cleanup; /* a list cut meanwhile */
    }
    PyObject *info;
    if (event == EV_RESTARTED)
        info = Py_BuildValue("(iLL)", ev_shard, ev_old, ev_new);
    else if (event == EV_MISCONFIGURED)
        info = Py_BuildValue("(iL)", ev_shard, ev_new);
    else if (event == EV_TIMEOUT)
        info = ev_bitmap < 0 ? Py_BuildValue("(lOdiKKK)", ev_chunk, Py_None, ev_silent,
                                             ev_unanswered, ev_rejected, ev_taken,
                                             ev_not_float)
                             : Py_BuildValue("(lLdiKKK)", ev_chunk, ev_bitmap, ev_silent,
                                             ev_unanswered, ev_rejected, ev_taken,
                                             ev_not_float);
    else if (event == EV_OSERROR)
        info = PyLong_FromLong(c->err);
    else if (event == EV_REFUSED || event == EV_SHORT)
        info = Py_BuildValue("(lLL)", ev_chunk, ev_code, ev_bitmap);
    else
        info = (Py_INCREF(Py_None), Py_None);
    PyObject *st = PyTuple_New(N_CSTATS);
    for (int k = 0; st && k < N_CSTATS; k++)
        PyTuple_SET_ITEM(st, k, PyLong_FromUnsignedLongLong(c->st[k]));
    PyObject *srtt_l = list_of_doubles(c->srtt, n_shards);
    PyObject *rttvar_l = list_of_doubles(c->rttvar, n_shards);
    if (info && st && srtt_l && rttvar_l)
        res = Py_BuildValue("(iOOOO)", event, info, st, srtt_l, rttvar_l);
    Py_XDECREF(info); Py_XDECREF(st); Py_XDECREF(srtt_l); Py_XDECREF(rttvar_l);
cleanup:
    if (c) {
        free(c->aggs); free(c->srtt); free(c->rttvar); free(c->sbuf);
        free(c->last_reply); free(c->asked); free(c->nasked); free(c->rejected);
        free(c->not_float); free(c->taken); free(c);
    }
    free(epoch); free(done); free(answered); free(earliest); free(resent_at); free(mark);
    free(due); free(backoff); free(started); free(later);
    if (gso) gro_set(fd, 0);
    free(pend); free(rbuf); free(rmsgs); free(riov); free(rctl); free(rsrc);
    Py_XDECREF(aggs_t); Py_XDECREF(epochs_t); Py_XDECREF(srtt_t); Py_XDECREF(rttvar_t);
    PyBuffer_Release(&chunks);
    if (out.obj) PyBuffer_Release(&out);
    return res;
}

static PyMethodDef module_methods[] = {
    {"drive", fa_drive, METH_VARARGS,
     "drive(workers, agg_ip, agg_port, job_id, pool, lanes, run, tag, chunks, window, payloads, "
     "types, rto, deadline) -> (seconds, results, sent, retransmitted, complete): the workers, "
     "(fd, worker_id) pairs, stream "
     "`chunks` DATA chunks each with a window, resending after `rto` seconds without progress"},
    {"stream", fa_stream, METH_VARARGS,
     "stream(fd, header, chunks, chunk_bytes, aggs, epochs, window, (timeout, max_timeout, "
     "deadline, fast_after, backoff_cap, silent_after, recv_batch), srtt, rttvar, out, "
     "out_itemsize, expect_payload, gso) -> (event, info, stats, srtt, "
     "rttvar): one client's sliding window (host/net/fastclient.py)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastagg",
    "The compiled datapath of the software aggregator (see host/net/fastagg.py).", -1,
    module_methods,
};

#ifndef SOURCE_SHA256
#define SOURCE_SHA256 "" /* setup.py defines it: thc.built compares it with this file's */
#endif

PyMODINIT_FUNC PyInit__fastagg(void) {
    if (PyType_Ready(&DatapathType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *reasons = PyTuple_New(N_REASONS), *counters = PyTuple_New(N_COUNTERS);
    for (int r = 0; reasons && r < N_REASONS; r++)
        PyTuple_SET_ITEM(reasons, r, PyUnicode_FromString(REASON_NAMES[r]));
    for (int r = 0; counters && r < N_COUNTERS; r++)
        PyTuple_SET_ITEM(counters, r, PyUnicode_FromString(COUNTER_NAMES[r]));
    PyObject *layout = Py_BuildValue(
        "((si)(si)(si)(si)(si)(si)(si)(si)(si)(si)(si))", "pkt_type", 8, "worker_id", 8,
        "job_id", 16, "slot", 16, "version", 8, "count", 8, "seq", 32, "offset", 32,
        "bitmap", 32, "run", 32, "epoch", 32);
    Py_INCREF(&DatapathType);
    if (!reasons || !counters || !layout ||
        PyModule_AddObject(m, "Datapath", (PyObject *)&DatapathType) < 0 ||
        PyModule_AddObject(m, "REASONS", reasons) < 0 ||
        PyModule_AddObject(m, "COUNTERS", counters) < 0 ||
        PyModule_AddObject(m, "HEADER_LAYOUT", layout) < 0 ||
        PyModule_AddIntConstant(m, "MAX_WORKERS", MAX_WORKERS) < 0 ||
        PyModule_AddIntConstant(m, "BATCH", BATCH) < 0 ||
        PyModule_AddIntConstant(m, "CLIENT_MAX_DATAGRAM", CL_OUT_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "CLIENT_WINDOW", CL_WINDOW_VERSION) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE_SHA256", SOURCE_SHA256) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
