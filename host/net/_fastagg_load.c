/* The load generator: n workers of one job, one socket each, a window of chunks each, so that
 * `thc bench aggregator`'s clients are not its bottleneck (host/net/fastload.py). */
#include "_fastagg.h"

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
            /* one GSO send of the b equal-sized datagrams (_fastagg_udp.c) */
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
PyObject *fa_drive(PyObject *self, PyObject *args) {
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
    for (int t = 0; !bad && t < N_TYPES; t++) {
        tcodes[t] = PyLong_AsLong(PySequence_Fast_GET_ITEM(tseq, t));
        if (tcodes[t] == -1 && PyErr_Occurred()) {   /* not an integer: its own error */
            Py_DECREF(tseq);
            Py_DECREF(fseq);
            return NULL;
        }
        bad = tcodes[t] < 0 || tcodes[t] > 255;
    }
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
        if (bufs[w].len / data_bytes < chunks) { /* no product: chunks may be near 2^63 */
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
                    if ((long)s < l->base || (long)s >= l->hi || l->done[s])
                        continue;   /* a chunk not in flight: a stale or forged reply */
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

