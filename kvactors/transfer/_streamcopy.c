/* The native CPU copy loop behind kvactors.transfer.native (loaded with ctypes).
 *
 * A copier is a fixed set of threads taking copy jobs from one FIFO queue. Each
 * job is a list of runs (source offset, destination offset, bytes) between two
 * base addresses; its runs are cut into pieces that the threads claim one at a
 * time, so a thread that loses its core to other work (the frontend's control
 * code) holds back one piece, not half of every copy as a static split would.
 * The threads never touch the GIL. A job ends when its last claimed piece is
 * copied; it then joins the copier's list of finished jobs, which the Python
 * side's completer thread takes in order with kvc_wait (a blocking call: ctypes
 * releases the GIL around it). No file descriptor is involved: nothing blocks a
 * copy thread but the mutex, and a forked child inherits nothing to close.
 *
 * Pieces of at least STREAM_MIN bytes are copied with non-temporal stores on
 * x86-64 with AVX2 (four pages at a time, as glibc's large copies do), others
 * with memcpy: a copy of many MiB would only evict the control code's data
 * from the caches, and writes that bypass them skip the read for ownership.
 *
 * A job's deadline (CLOCK_MONOTONIC seconds, as Python's time.monotonic; NaN
 * for none) is checked before each of its pieces is claimed and once its last
 * piece is copied; past it, no further piece is claimed and the job ends with
 * STATUS_DEADLINE once the pieces in progress are copied.
 *
 * Threading: kvc_submit and kvc_wake may be called from any thread at once;
 * kvc_wait from one thread (the completer); kvc_stop once, when no job is queued
 * or in progress (it joins the copy threads and ends the waits once the finished
 * jobs are taken); kvc_free once, by the completer, after its last kvc_wait. All
 * shared state is under one mutex; the copies run outside it.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_STREAM 1
#endif

#define STATUS_OK 0
#define STATUS_DEADLINE 1
#define MAX_THREADS 64
#define STREAM_MIN (256u << 10)
#define PAGE 4096u

typedef struct job {
    struct job *next; /* in the queue, then in the finished list */
    uint64_t id;
    uint64_t status;
    char *src, *dst;
    uint64_t *runs; /* triples: source offset, destination offset, bytes */
    size_t nruns;
    double deadline; /* NaN: none (every comparison with it is false) */
    size_t run, off; /* the next piece to claim */
    size_t claimed, copied;
    int closed; /* no piece is claimed any more (all claimed, or past the deadline) */
    int late;
} job_t;

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;     /* the copy threads: a job was queued, or stop */
    pthread_cond_t finished; /* the completer: a job finished, or stop */
    job_t *head, *tail;      /* queued jobs with pieces left to claim */
    job_t *done_head, *done_tail;
    int stopping; /* the copy threads end once the queue is empty */
    int stopped;  /* they have: kvc_wait ends once the finished list is empty */
    int woken;    /* kvc_wake: the next kvc_wait returns even with nothing finished */
    int nthreads;
    pthread_t threads[MAX_THREADS];
    size_t piece;
    int stream;
} copier_t;

static double monotonic_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#ifdef HAVE_STREAM
/* Four pages at a time, 64 bytes from each in turn: more DRAM pages open at once. */
__attribute__((target("avx2"))) static void copy_streaming(char *d, const char *s, size_t n) {
    size_t head = (PAGE - ((uintptr_t)d & (PAGE - 1))) & (PAGE - 1);
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t chunks = n / (4 * PAGE);
    for (size_t c = 0; c < chunks; c++) {
        for (size_t off = 0; off < PAGE; off += 64) {
            for (size_t p = 0; p < 4; p++) {
                const char *sp = s + p * PAGE + off;
                char *dp = d + p * PAGE + off;
                __builtin_prefetch(sp + 256);
                __m256i a = _mm256_loadu_si256((const __m256i *)sp);
                __m256i b = _mm256_loadu_si256((const __m256i *)(sp + 32));
                _mm256_stream_si256((__m256i *)dp, a);
                _mm256_stream_si256((__m256i *)(dp + 32), b);
            }
        }
        s += 4 * PAGE;
        d += 4 * PAGE;
    }
    _mm_sfence(); /* the streamed bytes are visible before the job is reported */
    memcpy(d, s, n - chunks * 4 * PAGE);
}
#endif

static void copy_piece(const copier_t *c, char *d, const char *s, size_t n) {
#ifdef HAVE_STREAM
    if (c->stream && n >= STREAM_MIN) {
        copy_streaming(d, s, n);
        return;
    }
#endif
    (void)c;
    memcpy(d, s, n);
}

static void append(job_t **head, job_t **tail, job_t *j) { /* a FIFO list; under the lock */
    j->next = NULL;
    if (*tail)
        (*tail)->next = j;
    else
        *head = j;
    *tail = j;
}

static void finish(copier_t *c, job_t *j, uint64_t status) { /* under the lock */
    free(j->runs);
    j->runs = NULL;
    j->status = status;
    append(&c->done_head, &c->done_tail, j);
    pthread_cond_signal(&c->finished);
}

static void close_job(copier_t *c, job_t *j) { /* under the lock; j is the queue's head */
    j->closed = 1;
    c->head = j->next;
    if (!c->head)
        c->tail = NULL;
}

static void *worker(void *arg) {
    copier_t *c = arg;
    pthread_mutex_lock(&c->lock);
    for (;;) {
        while (!c->head && !c->stopping)
            pthread_cond_wait(&c->wake, &c->lock);
        job_t *j = c->head;
        if (!j)
            break;
        if (monotonic_now() > j->deadline) {
            j->late = 1;
            close_job(c, j);
            if (j->copied == j->claimed)
                finish(c, j, STATUS_DEADLINE);
            continue;
        }
        const uint64_t *r = j->runs + 3 * j->run;
        size_t len = (size_t)r[2] - j->off;
        if (len > c->piece)
            len = c->piece;
        char *d = j->dst + r[1] + j->off;
        const char *s = j->src + r[0] + j->off;
        j->off += len;
        if (j->off == r[2]) {
            j->run++;
            j->off = 0;
        }
        j->claimed++;
        if (j->run == j->nruns)
            close_job(c, j);
        pthread_mutex_unlock(&c->lock);

        copy_piece(c, d, s, len);

        pthread_mutex_lock(&c->lock);
        j->copied++;
        if (j->closed && j->copied == j->claimed) {
            int late = j->late || monotonic_now() > j->deadline;
            finish(c, j, late ? STATUS_DEADLINE : STATUS_OK);
        }
    }
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

/* A copier of nthreads threads; NULL if it cannot be made. */
void *kvc_start(int nthreads, size_t piece, int stream) {
    if (nthreads < 1 || nthreads > MAX_THREADS || piece == 0)
        return NULL;
    copier_t *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->wake, NULL);
    pthread_cond_init(&c->finished, NULL);
    c->piece = piece;
#ifdef HAVE_STREAM
    c->stream = stream && __builtin_cpu_supports("avx2");
#else
    (void)stream;
#endif
    for (int i = 0; i < nthreads; i++) {
        if (pthread_create(&c->threads[i], NULL, worker, c) != 0) {
            pthread_mutex_lock(&c->lock);
            c->stopping = 1;
            pthread_cond_broadcast(&c->wake);
            pthread_mutex_unlock(&c->lock);
            for (int k = 0; k < i; k++)
                pthread_join(c->threads[k], NULL);
            pthread_mutex_destroy(&c->lock);
            pthread_cond_destroy(&c->wake);
            pthread_cond_destroy(&c->finished);
            free(c);
            return NULL;
        }
        c->nthreads = i + 1;
    }
    return c;
}

/* Whether the copier streams its large pieces (x86-64 with AVX2, and asked to). */
int kvc_streams(void *handle) { return ((copier_t *)handle)->stream; }

/* Queue one job; 0, or -1 (out of memory: nothing queued). Runs of 0 bytes are not allowed. */
int kvc_submit(void *handle, uint64_t id, char *src, char *dst, const uint64_t *runs, size_t nruns,
               double deadline) {
    copier_t *c = handle;
    if (nruns == 0)
        return -1;
    job_t *j = calloc(1, sizeof *j);
    uint64_t *copy = malloc(3 * sizeof(uint64_t) * nruns);
    if (!j || !copy) {
        free(j);
        free(copy);
        return -1;
    }
    memcpy(copy, runs, 3 * sizeof(uint64_t) * nruns);
    for (size_t i = 0; i < nruns; i++) {
        if (copy[3 * i + 2] == 0) {
            free(j);
            free(copy);
            return -1;
        }
    }
    j->id = id;
    j->src = src;
    j->dst = dst;
    j->runs = copy;
    j->nruns = nruns;
    j->deadline = deadline;
    pthread_mutex_lock(&c->lock);
    append(&c->head, &c->tail, j);
    pthread_cond_broadcast(&c->wake);
    pthread_mutex_unlock(&c->lock);
    return 0;
}

/* Make the completer's kvc_wait return (0 records if none finished): the caller has something
 * of its own for it to report. Allocates nothing. */
void kvc_wake(void *handle) {
    copier_t *c = handle;
    pthread_mutex_lock(&c->lock);
    c->woken = 1;
    pthread_cond_signal(&c->finished);
    pthread_mutex_unlock(&c->lock);
}

/* Up to max finished jobs, oldest first, as (id, status) pairs in out; waits for one, or for a
 * kvc_wake (then possibly 0). -1 once kvc_stop was called and every finished job was taken: the
 * completer's last call. 0 at once if max < 1. */
int kvc_wait(void *handle, uint64_t *out, int max) {
    copier_t *c = handle;
    int n = 0;
    if (max < 1)
        return 0;
    pthread_mutex_lock(&c->lock);
    while (!c->done_head && !c->stopped && !c->woken)
        pthread_cond_wait(&c->finished, &c->lock);
    c->woken = 0;
    while (c->done_head && n < max) {
        job_t *j = c->done_head;
        c->done_head = j->next;
        if (!c->done_head)
            c->done_tail = NULL;
        out[2 * n] = j->id;
        out[2 * n + 1] = j->status;
        n++;
        free(j);
    }
    int last = !n && c->stopped && !c->done_head;
    pthread_mutex_unlock(&c->lock);
    return last ? -1 : n;
}

/* Stop and join the copy threads (nothing may be queued), and end the completer's waits once
 * it has taken every finished job. */
void kvc_stop(void *handle) {
    copier_t *c = handle;
    pthread_mutex_lock(&c->lock);
    c->stopping = 1;
    pthread_cond_broadcast(&c->wake);
    pthread_mutex_unlock(&c->lock);
    for (int i = 0; i < c->nthreads; i++)
        pthread_join(c->threads[i], NULL);
    pthread_mutex_lock(&c->lock);
    c->stopped = 1;
    pthread_cond_broadcast(&c->finished);
    pthread_mutex_unlock(&c->lock);
}

/* Free a stopped copier, after its completer's last kvc_wait. */
void kvc_free(void *handle) {
    copier_t *c = handle;
    pthread_mutex_destroy(&c->lock);
    pthread_cond_destroy(&c->wake);
    pthread_cond_destroy(&c->finished);
    free(c);
}

/* An importable (empty) module, so that setuptools builds the library and the loader finds it
 * under its module name; the functions above are called through ctypes, which releases the
 * GIL around each call. */
static struct PyModuleDef streamcopy_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_streamcopy",
    .m_doc = "kvactors' native CPU copy loop (called through ctypes).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__streamcopy(void) { return PyModule_Create(&streamcopy_module); }
