/* The compiled aggregator's state, shared by its per-packet rules (_fastagg_rules.c) and
 * its Python type and serving loop (_fastagg_serve.c). */
#ifndef THC_FASTAGG_RULES_H
#define THC_FASTAGG_RULES_H

#include "_fastagg.h"

#define OUT_CAP 512
#define N_JOB_IDS 65536

enum { MALFORMED, BAD_LANES, UNKNOWN_JOB, UNKNOWN_WORKER, WORKER_OUTSIDE_JOB,
       SLOT_OUTSIDE_POOL, STALE, NOT_FROM_CPU, WRONG_DIRECTION, STALE_RUN, WRONG_SHARD,
       WRONG_USE, WRONG_SLOT, REUSED_RUN, STALE_RESET, WRONG_CONFIG,
       BAD_CHECKSUM /* the switch's alone: the kernel drops such datagrams */, N_REASONS };
extern const char *REASON_NAMES[N_REASONS];
enum { C_PACKETS, C_COMPLETIONS, C_RETRANSMISSIONS, C_PENDING, C_HELD, N_COUNTERS };
extern const char *COUNTER_NAMES[N_COUNTERS];

/* Register state of one job, laid out as the switch's registers (slot x version). */
typedef struct {
    uint16_t job_id;
    int n, pool, lanes, sum_bits, data_bytes, result_bytes;
    int vote; /* DATA carries one sign bit a lane, counted (the first lane in the high bit) */
    uint32_t n_shards, shard; /* this aggregator owns the chunks with seq % n_shards == shard */
    uint16_t lut[256][2]; /* packed byte -> its two lanes' table values */
    uint32_t ip[MAX_WORKERS]; /* network order */
    uint16_t port[MAX_WORKERS]; /* network order */
    uint8_t addr_ok[MAX_WORKERS]; /* 0: the configured address is no IPv4 literal */
    uint32_t local[MAX_WORKERS]; /* ours, where each worker's last taken datagram went; 0: none */
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

void job_free(Job *j);

/* One datagram from (sip, sport) to our address to (network order; 0: not known) at time
 * now, through the job's rules, or the echo's where the datapath echoes; replies go to
 * out[0..], which has room for MAX_WORKERS. Returns the number of replies. */
int process_any(Datapath *dp, const uint8_t *d, size_t len, uint32_t sip, uint16_t sport,
                uint32_t to, Out *out, double now);

#endif
