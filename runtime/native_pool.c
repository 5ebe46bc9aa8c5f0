/* The native step's thread pool (native_pool.h says what it promises). */
#include "native_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#elif defined(__aarch64__)
#define RELAX() __asm__ __volatile__("yield")
#else
#define RELAX() ((void)0)
#endif

#define MAX_THREADS 1024
#define SLOTS 4             /* jobs in a ring: a late worker reads its job's slot, which is rewritten 4 jobs later */
#ifndef IDLE_SPIN_NS /* -D for an A/B */
#define IDLE_SPIN_NS 30000 /* a worker spins at most this long for the next job, then sleeps (a step's jobs are
                              microseconds apart; the loop's host work between a step and its heads call, or the heads
                              and the next step, 0.3-0.6 ms). Spinning through that instead (1 ms) saved a heads call
                              0.02-0.04 ms on a quiet machine, but beside one busy process cost a drafted step 12-17 %. */
#endif
#define PAUSE_NS 20000      /* past this much of a spin, a worker yields its core at every check (a busy machine) */
#define LATE_NS 50000       /* a worker that sees a job this long after it was posted was descheduled meanwhile */
#define WAIT_SPIN_NS 20000  /* the caller spins this long for a worker's last chunk, then yields its core */
#define WARM_CHUNK 65536    /* a read-ahead's task: a worker checks for a new job between two */
#define WARM_MAX (8LL << 20) /* the largest region pool_set_warm takes: a read-ahead is for what caches hold */

typedef struct {
    pool_task fn;
    void *ctx;
    int64_t tasks, grain;
    int64_t posted;       /* now_ns() when the job was posted */
    _Atomic int64_t next; /* the next unclaimed task */
    _Atomic int64_t done; /* tasks finished */
    _Atomic int active;   /* workers inside this job */
} job_t;

typedef struct { /* one posted read-ahead (pool_warm): its job's generation, its region */
    struct pool *pool;
    uint64_t generation;
    const char *base;
    int64_t bytes;
} warm_t;

struct pool {
    int threads;
    pid_t pid; /* a forked child has none of the workers: it runs every chunk itself */
    pthread_t *ids;
    int started;
    _Atomic uint64_t generation; /* the current job's number; its slot is jobs[generation % SLOTS] */
    _Atomic int sleeping;
    _Atomic int stop;
    _Atomic int busy; /* a step is running (pool_enter) */
    pthread_mutex_t lock;
    pthread_cond_t wake;
    job_t jobs[SLOTS];
    warm_t warms[SLOTS]; /* a posted read-ahead's region, beside its job's slot */
    const char *warm_base; /* the region pool_warm reads (pool_set_warm) */
    int64_t warm_bytes;
    _Atomic int warm_asked; /* pool_ask_warm since the last pool_warm */
};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* claim chunks of the job until none is left, then count the tasks run as done (one atomic add a thread) */
static void work(job_t *j, int worker) {
    int64_t ran = 0;
    for (;;) {
        const int64_t first = atomic_fetch_add(&j->next, j->grain);
        if (first >= j->tasks) break;
        const int64_t last = first + j->grain < j->tasks ? first + j->grain : j->tasks;
        j->fn(j->ctx, first, last, worker);
        ran += last - first;
    }
    if (ran) atomic_fetch_add(&j->done, ran);
}

typedef struct {
    pool_t *pool;
    int worker;
} start_t;

static void *worker_main(void *arg) {
    start_t *s = arg;
    pool_t *p = s->pool;
    const int worker = s->worker;
    uint64_t seen = atomic_load(&p->generation);
    /* How long to spin for the next job, adapted: halved each time this worker, spinning, sees a job late (it was
     * descheduled: a busy machine, where spinning only takes cores the caller needs), doubled back each time it is on
     * time. A job that woke it from sleep is on time (the wake-up's latency says nothing of the machine). */
    int64_t spin_ns = IDLE_SPIN_NS;
    while (!atomic_load(&p->stop)) {
        uint64_t g = atomic_load(&p->generation);
        int slept = 0;
        if (g == seen) { /* spin a while, then sleep until the next job */
            const int64_t start = now_ns(), until = start + spin_ns;
            for (int spins = 0; (g = atomic_load(&p->generation)) == seen && !atomic_load(&p->stop); spins++) {
                RELAX();
                if ((spins & 63) != 63) continue;
                const int64_t now = now_ns();
                if (now - start > PAUSE_NS) sched_yield();
                if (now > until) {
                    pthread_mutex_lock(&p->lock);
                    atomic_fetch_add(&p->sleeping, 1);
                    while ((g = atomic_load(&p->generation)) == seen && !atomic_load(&p->stop)) {
                        pthread_cond_wait(&p->wake, &p->lock);
                        slept = 1;
                    }
                    atomic_fetch_sub(&p->sleeping, 1);
                    pthread_mutex_unlock(&p->lock);
                    break;
                }
            }
            if (g == seen) continue; /* stopped */
        }
        seen = g;
        job_t *j = &p->jobs[g % SLOTS];
        atomic_fetch_add(&j->active, 1);
        int late = 1;
        if (atomic_load(&p->generation) == g) { /* else the caller moved on: the slot may be rewritten */
            late = !slept && now_ns() - j->posted > LATE_NS;
            work(j, worker);
        }
        atomic_fetch_sub(&j->active, 1);
        spin_ns = late ? spin_ns / 2 : (spin_ns * 2 + 1000 < IDLE_SPIN_NS ? spin_ns * 2 + 1000 : IDLE_SPIN_NS);
    }
    free(s);
    return NULL;
}

int medusa_pool_threads(const pool_t *p) { return p ? p->threads : 1; }

void medusa_pool_free(pool_t *p) {
    if (!p) return;
    if (p->pid == getpid()) {
        pthread_mutex_lock(&p->lock);
        atomic_store(&p->stop, 1);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->lock);
        for (int i = 0; i < p->started; i++) pthread_join(p->ids[i], NULL);
    }
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->wake);
    free(p->ids);
    free(p);
}

pool_t *medusa_pool_new(int threads) {
    if (threads < 1 || threads > MAX_THREADS) return NULL;
    pool_t *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->threads = threads;
    p->pid = getpid();
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    p->ids = calloc(threads, sizeof *p->ids);
    if (!p->ids) {
        medusa_pool_free(p);
        return NULL;
    }
    for (int w = 1; w < threads; w++) {
        start_t *s = malloc(sizeof *s);
        if (!s) break;
        s->pool = p, s->worker = w;
        if (pthread_create(&p->ids[p->started], NULL, worker_main, s)) {
            free(s);
            break;
        }
        p->started++;
    }
    if (p->started != threads - 1) {
        medusa_pool_free(p);
        return NULL;
    }
    return p;
}

int pool_enter(pool_t *p) {
    int idle = 0;
    return !p || atomic_compare_exchange_strong(&p->busy, &idle, 1);
}

void pool_leave(pool_t *p) {
    if (p) atomic_store(&p->busy, 0);
}

/* The next job's slot, free: the generation it will have in *g */
static job_t *next_slot(pool_t *p, uint64_t *g) {
    *g = atomic_load(&p->generation) + 1;
    job_t *j = &p->jobs[*g % SLOTS];
    while (atomic_load(&j->active)) /* a worker of the job SLOTS back still leaving the slot: practically never */
        sched_yield();
    return j;
}

/* publishes job j (generation g) to the workers, waking those asleep */
static void post(pool_t *p, job_t *j, uint64_t g, pool_task fn, void *ctx, int64_t tasks, int64_t grain) {
    j->fn = fn, j->ctx = ctx, j->tasks = tasks, j->grain = grain, j->posted = now_ns();
    atomic_store(&j->next, 0);
    atomic_store(&j->done, 0);
    atomic_store(&p->generation, g); /* publishes the slot */
    if (atomic_load(&p->sleeping)) {
        pthread_mutex_lock(&p->lock);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->lock);
    }
}

void pool_run(pool_t *p, int64_t tasks, int64_t grain, pool_task fn, void *ctx) {
    if (tasks <= 0) return;
    if (grain < 1) grain = 1;
    if (!p || p->threads == 1 || p->pid != getpid() || tasks <= grain) { /* one chunk, or no workers here */
        for (int64_t first = 0; first < tasks; first += grain) fn(ctx, first, first + grain < tasks ? first + grain : tasks, 0);
        return;
    }
    uint64_t g;
    job_t *j = next_slot(p, &g);
    post(p, j, g, fn, ctx, tasks, grain);
    work(j, 0);
    const int64_t until = now_ns() + WAIT_SPIN_NS;
    for (int spins = 0; atomic_load(&j->done) < tasks; spins++) { /* chunks workers claimed and are still running */
        if (spins < 256 || now_ns() < until)
            RELAX();
        else
            sched_yield();
    }
}

/* ---- read-ahead ---- */

int pool_set_warm(pool_t *p, const void *base, int64_t bytes) {
    if (!p) return 1;
    if (bytes < 0 || bytes > WARM_MAX || (bytes > 0 && !base)) return 0;
    p->warm_base = bytes ? base : NULL, p->warm_bytes = bytes;
    return 1;
}

void pool_ask_warm(pool_t *p) {
    if (p) atomic_store(&p->warm_asked, 1);
}

/* chunks [first, last) of the region: a load of each cache line, until the caller posts another job */
static void warm_chunks(void *ctx, int64_t first, int64_t last, int worker) {
    (void)worker;
    const warm_t *w = ctx;
    uint64_t seen = 0;
    for (int64_t c = first; c < last; c++) {
        if (atomic_load(&w->pool->generation) != w->generation || atomic_load(&w->pool->stop)) return; /* the caller is back */
        const int64_t from = c * WARM_CHUNK, to = from + WARM_CHUNK < w->bytes ? from + WARM_CHUNK : w->bytes;
        for (int64_t o = from; o < to; o += 64) seen += *(const volatile unsigned char *)(w->base + o);
    }
    __asm__ __volatile__("" : : "r"(seen)); /* the loads are the point */
}

void pool_warm(pool_t *p) {
    if (!p || !atomic_exchange(&p->warm_asked, 0) || !p->warm_base || p->threads == 1 || p->pid != getpid()) return;
    uint64_t g;
    job_t *j = next_slot(p, &g);
    warm_t *w = &p->warms[g % SLOTS]; /* its job's slot is free, so is this */
    w->pool = p, w->generation = g, w->base = p->warm_base, w->bytes = p->warm_bytes;
    post(p, j, g, warm_chunks, w, (w->bytes + WARM_CHUNK - 1) / WARM_CHUNK, 1); /* nobody waits for it */
}
