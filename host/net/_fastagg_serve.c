/* The compiled aggregator's Python type: jobs installed and removed under a lock, counters
 * read out, one datagram handled for packet-trace comparisons, and the serving loop:
 * recvmmsg/sendmmsg batches, without the GIL, through the rules of _fastagg_rules.c.
 *
 * Control stays in Python (host/net/fastagg.py): it validates jobs, passes the protocol's
 * packet type codes and run rules in, names the drop reasons and counters, and reads
 * counters out. */
#include "_fastagg_rules.h"

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
    if (max_lanes < 1 || max_lanes > (OUT_BYTES - HDR) / 4) { /* no product that overflows */
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


/* Sending replies (GSO: _fastagg_udp.c) */
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


int fa_add_datapath(PyObject *m) {
    if (PyType_Ready(&DatapathType) < 0) return -1;
    PyObject *reasons = PyTuple_New(N_REASONS), *counters = PyTuple_New(N_COUNTERS);
    for (int r = 0; reasons && r < N_REASONS; r++)
        PyTuple_SET_ITEM(reasons, r, PyUnicode_FromString(REASON_NAMES[r]));
    for (int r = 0; counters && r < N_COUNTERS; r++)
        PyTuple_SET_ITEM(counters, r, PyUnicode_FromString(COUNTER_NAMES[r]));
    Py_INCREF(&DatapathType);
    if (!reasons || !counters ||
        PyModule_AddObject(m, "Datapath", (PyObject *)&DatapathType) < 0 ||
        PyModule_AddObject(m, "REASONS", reasons) < 0 ||
        PyModule_AddObject(m, "COUNTERS", counters) < 0)
        return -1;
    return 0;
}
