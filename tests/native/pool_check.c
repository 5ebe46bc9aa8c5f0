/* runtime/native_pool.c on its own, for ThreadSanitizer (tests/test_native_pool.py builds and runs it):
 * many jobs of every size on pools of 1 to 8 threads, each task's output written once by whichever thread claims it
 * and checked after its job; jobs run back to back (the ring of job slots wraps thousands of times) and after pauses
 * long enough for the workers to fall asleep; read-aheads (pool_warm) posted between jobs, after pauses and right
 * before a pool is freed. Prints "ok" and exits 0, or names the first wrong job and exits 1. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "native_pool.h"

#define MOST 4096

typedef struct {
    int64_t *out;
    int64_t salt;
    int threads;
    int bad_worker;
} ctx_t;

static void fill(void *arg, int64_t first, int64_t last, int worker) {
    ctx_t *c = arg;
    if (worker < 0 || worker >= c->threads) c->bad_worker = 1; /* racy flag, but only ever set to 1 */
    for (int64_t t = first; t < last; t++) c->out[t] = t * 31 + c->salt;
}

static unsigned char region[3 << 20]; /* a read-ahead's region: 3 MB, 48 chunks */

int main(void) {
    static int64_t out[MOST];
    unsigned seed = 12345;
    if (!pool_set_warm(NULL, region, sizeof region)) {
        printf("no pool: a read-ahead region refused\n");
        return 1;
    }
    pool_ask_warm(NULL), pool_warm(NULL); /* no pool: nothing */
    for (int threads = 1; threads <= 8; threads++) {
        pool_t *p = medusa_pool_new(threads);
        if (!p || medusa_pool_threads(p) != threads) {
            printf("pool of %d threads not made\n", threads);
            return 1;
        }
        if (pool_set_warm(p, region, (8 << 20) + 1) || pool_set_warm(p, NULL, 64) || !pool_set_warm(p, region, sizeof region)) {
            printf("pool of %d threads: a read-ahead region past 8 MB or at NULL taken, or one of 3 MB refused\n", threads);
            return 1;
        }
        for (int job = 0; job < 3000; job++) {
            seed = seed * 1103515245u + 12345u;
            const int64_t tasks = (seed >> 8) % MOST + 1, grain = (seed >> 20) % 7 + 1;
            ctx_t c = {out, job, threads, 0};
            for (int64_t t = 0; t < tasks; t++) out[t] = -1;
            if (!pool_enter(p)) {
                printf("pool busy with no step running\n");
                return 1;
            }
            pool_run(p, tasks, grain, fill, &c);
            if (job % 3 == 0) pool_ask_warm(p);
            pool_warm(p); /* posted every third job: the next job takes the workers back */
            pool_leave(p);
            for (int64_t t = 0; t < tasks; t++)
                if (out[t] != t * 31 + job || c.bad_worker) {
                    printf("threads %d, job %d: task %lld of %lld wrong\n", threads, job, (long long)t, (long long)tasks);
                    return 1;
                }
            if (job % 500 == 499) { /* long enough for the workers to sleep: the next job must wake them */
                struct timespec pause = {0, 3000000};
                nanosleep(&pause, NULL);
            }
        }
        pool_ask_warm(p), pool_warm(p); /* freed while its workers read ahead: they stop and are joined */
        medusa_pool_free(p);
    }
    printf("ok\n");
    return 0;
}
