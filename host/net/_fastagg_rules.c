/* The software aggregator's per-packet rules in C: the reference model's (host/wire/model.py:
 * drops by reason, REFUSED replies, slots in two versions with their op, offset and
 * acknowledgements, runs, retransmission replies built from the use, 8/16-bit lane sums,
 * MAX, vote counts, FLUSH-closed slots, one shard of a shard map), in its order. The model is
 * the reference; tests compare the two byte for byte. Also the echo, the ceiling `thc bench
 * aggregator` compares with. */
#include "_fastagg_rules.h"

const char *REASON_NAMES[N_REASONS] = {
    "malformed", "bad_lanes", "unknown_job", "unknown_worker", "worker_outside_job",
    "slot_outside_pool", "stale", "not_from_cpu", "wrong_direction", "stale_run",
    "wrong_shard", "wrong_use", "wrong_slot", "reused_run", "stale_reset", "wrong_config",
    "bad_checksum"};
const char *COUNTER_NAMES[N_COUNTERS] = {"packets", "completions", "retransmissions",
                                         "pending", "held"};

void job_free(Job *j) {
    if (!j) return;
    free(j->run); free(j->seq); free(j->bitmap); free(j->count); free(j->closed);
    free(j->offset); free(j->acked); free(j->op);
    free(j->sum8); free(j->sum16); free(j->max); free(j);
}

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
    if (plen != (is_max ? 4 * (size_t)dp->max_lanes : is_flush ? 0 : (size_t)j->data_bytes))
        return drop(dp, BAD_LANES);
    int n = j->n;
    uint32_t pool = (uint32_t)j->pool;
    if (wid >= n) return drop(dp, WORKER_OUTSIDE_JOB);
    if (!j->addr_ok[wid] || j->ip[wid] != sip || j->port[wid] != sport)
        return drop(dp, UNKNOWN_WORKER);
    /* the sender's configuration tag (protocol.py's upstream_tag) against the install's */
    if ((rd32(d + 16) & ((1u << TAG_SHIFT) - 1)) != j->epoch >> TAG_SHIFT)
        return refuse(dp, j, WRONG_CONFIG, d, 0, sip, sport, out);
    if (slot >= pool) return drop(dp, SLOT_OUTSIDE_POOL);
    if (slot != seq % pool || version != ((seq / pool) & 1))
        return refuse(dp, j, WRONG_SLOT, d, 0, sip, sport, out);
    if (j->n_shards > 1 && seq % j->n_shards != j->shard)
        return refuse(dp, j, WRONG_SHARD, d, j->n_shards << SHARD_SHIFT | j->shard, sip, sport, out);
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
    if (same_run && seq == cur && (j->op[i] != op || j->offset[i] != offset))
        return refuse(dp, j, WRONG_USE, d, j->op[i], sip, sport, out);
    /* taken: the worker's RESULTs leave from the address of ours it sent this to */
    if (to) j->local[wid] = to;
    const uint8_t *payload = d + HDR;
    if (same_run && seq == cur) {
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
 * zeros, under the job's epoch (what a client of index-0 chunks takes). Only a worker's
 * upstream packet from its own address: an echo of anything else would answer a RESULT
 * (two echoes then answer each other for good) or a forged source. */
static int process_echo(Datapath *dp, const uint8_t *d, size_t len, uint32_t sip,
                        uint16_t sport, Out *out) {
    if (len < HDR) return drop(dp, MALFORMED);
    uint8_t type = d[0], wid = d[1];
    if (type != dp->types[T_DATA] && type != dp->types[T_MAX] && type != dp->types[T_FLUSH])
        return drop(dp, WRONG_DIRECTION);
    Job *j = dp->jobs[rd16(d + 2)];
    if (!j) return drop(dp, UNKNOWN_JOB);
    if (wid >= j->n) return drop(dp, WORKER_OUTSIDE_JOB);
    if (!j->addr_ok[wid] || j->ip[wid] != sip || j->port[wid] != sport)
        return drop(dp, UNKNOWN_WORKER);
    dp->echoed++;
    Out *o = out_header(out, sip, sport);
    uint32_t full = j->n == 32 ? 0xFFFFFFFFu : (1u << j->n) - 1;
    write_header(o->buf, dp->types[T_RESULT], d[1], rd16(d + 2), rd16(d + 4), d[6],
                 (uint8_t)j->n, rd32(d + 8), rd32(d + 12), full, rd32(d + 20), j->epoch);
    memset(o->buf + HDR, 0, j->result_bytes);
    o->len = HDR + (size_t)j->result_bytes;
    return 1;
}

int process_any(Datapath *dp, const uint8_t *d, size_t len, uint32_t sip, uint16_t sport,
                uint32_t to, Out *out, double now) {
    return dp->echo ? process_echo(dp, d, len, sip, sport, out)
                    : process(dp, d, len, sip, sport, to, out, now);
}
