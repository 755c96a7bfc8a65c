/* The compiled datapath: one extension whose parts each sit behind a Python module:
 *   _fastagg_rules.c, _fastagg_serve.c  the software aggregator: the reference model's
 *                                       per-packet rules behind a recvmmsg/sendmmsg loop
 *                                       that runs without the GIL (host/net/fastagg.py)
 *   _fastagg_stream.c                   one client's sliding window (host/net/fastclient.py)
 *   _fastagg_load.c                     a load generator that plays n workers
 *                                       (host/net/fastload.py)
 *   _fastagg_udp.c                      the UDP GSO/GRO batching they share
 * This file: the module, and the helpers for loops that run without the GIL. */
#include "_fastagg.h"

double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* PyArg_ParseTuple's "O&" converter to an unsigned long: an OverflowError beyond its range
 * (or for a negative int), where "k" would mask the value into range. */
int as_ulong(PyObject *o, void *out) {
    unsigned long v = PyLong_AsUnsignedLong(o);
    if (v == (unsigned long)-1 && PyErr_Occurred()) return 0;
    *(unsigned long *)out = v;
    return 1;
}

/* Whether the calling thread, holding the GIL, is the interpreter's main thread: the only
 * one whose signal handlers run. A loop on another thread must not take the GIL back before it
 * ends: a daemon thread that does so while the interpreter finalizes crashes the process.
 * -1, its exception set: a pending signal's handler raised in the calls it makes (Ctrl-C). */
int on_main_thread(void) {
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
PyObject *items_of(PyObject *o, const char *what) {
    PyObject *t = PySequence_Tuple(o);
    if (!t && PyErr_ExceptionMatches(PyExc_TypeError)) PyErr_SetString(PyExc_TypeError, what);
    return t;
}

/* For loops run without the GIL: every 50 ms on the main thread (``main``: on_main_thread),
 * whether a signal's handler raised (Ctrl-C); the exception is set then. */
int signalled(int main, double now, double *last_check) {
    if (main < 0) return 1; /* raised in on_main_thread */
    if (!main || now - *last_check <= 0.05) return 0;
    *last_check = now;
    PyGILState_STATE g = PyGILState_Ensure();
    int raised = PyErr_CheckSignals() < 0;
    PyGILState_Release(g);
    return raised;
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
    "The compiled datapath: the software aggregator, a client window and a load generator "
    "(host/net/cext.py).", -1,
    module_methods,
};

#ifndef SOURCE_SHA256
#define SOURCE_SHA256 "" /* setup.py defines both: thc.built compares the files' hash with it */
#define SOURCE_FILES ""
#endif

PyMODINIT_FUNC PyInit__fastagg(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *layout = Py_BuildValue(
        "((si)(si)(si)(si)(si)(si)(si)(si)(si)(si)(si))", "pkt_type", 8, "worker_id", 8,
        "job_id", 16, "slot", 16, "version", 8, "count", 8, "seq", 32, "offset", 32,
        "bitmap", 32, "run", 32, "epoch", 32);
    if (!layout || fa_add_datapath(m) < 0 || fa_add_stream(m) < 0 ||
        PyModule_AddObject(m, "HEADER_LAYOUT", layout) < 0 ||
        PyModule_AddIntConstant(m, "MAX_WORKERS", MAX_WORKERS) < 0 ||
        PyModule_AddIntConstant(m, "BATCH", BATCH) < 0 ||
        PyModule_AddIntConstant(m, "RECV_BYTES", RECV_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "TAG_SHIFT", TAG_SHIFT) < 0 ||
        PyModule_AddIntConstant(m, "SHARD_SHIFT", SHARD_SHIFT) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE_SHA256", SOURCE_SHA256) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE_FILES", SOURCE_FILES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
