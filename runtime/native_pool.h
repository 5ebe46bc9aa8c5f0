/* The native step's threads: a pool whose caller takes every task no worker has claimed.
 *
 * pool_run(p, tasks, grain, fn, ctx) runs fn(ctx, first, last, worker) over [0, tasks) in chunks of `grain` tasks,
 * claimed one chunk at a time from an atomic counter by the calling thread (worker 0) and by whichever of the pool's
 * threads are awake (workers 1..threads-1), and returns when every chunk is done. Nothing waits for a thread that has
 * not started: a worker the operating system has descheduled (a busy machine, a container's CPU quota below the
 * thread count) costs the caller at most the chunk it was in the middle of, never a barrier's wait for its turn.
 * OpenMP's static loops and barriers waited for every thread of the team (measured: a one-token step 2.5x slower, an
 * eight-token one several hundred times, beside one busy process on two cores).
 *
 * Which thread computes a chunk never changes a number: every task writes its own outputs with the same operations.
 * A pool runs one job at a time (a read-ahead, below, is dropped for the next) and belongs to one step object; p NULL
 * runs every chunk on the calling thread. Idle workers spin up to 30 us for the next job (less where they find
 * themselves descheduled), then sleep.
 */
#ifndef MEDUSA_NATIVE_POOL_H
#define MEDUSA_NATIVE_POOL_H

#include <stdint.h>

typedef struct pool pool_t;
typedef void (*pool_task)(void *ctx, int64_t first, int64_t last, int worker);

pool_t *medusa_pool_new(int threads); /* threads - 1 workers; NULL where threads are out of range or cannot start */
void medusa_pool_free(pool_t *p);     /* stops and joins the workers */
int medusa_pool_threads(const pool_t *p);
void pool_run(pool_t *p, int64_t tasks, int64_t grain, pool_task fn, void *ctx);
int pool_enter(pool_t *p); /* 0 where another thread is running a step on this pool (then nothing was taken) */
void pool_leave(pool_t *p);

/* Read-ahead: a region the workers load into their caches while the caller is away, for a call that will read it
 * after the caller's own work (the Medusa heads' weights, after a step pushed them out and the loop commits it).
 * pool_set_warm names the region (NULL, 0: none; at most 8 MB; 0 where refused) while no job runs; pool_ask_warm
 * asks for one read-ahead; pool_warm, where one was asked since the last, posts it as a job nobody waits for and
 * returns at once. The next pool_run takes the workers back within one 64 KB chunk. The region must outlive the pool.
 * Reads only: no number changes. */
int pool_set_warm(pool_t *p, const void *base, int64_t bytes);
void pool_ask_warm(pool_t *p);
void pool_warm(pool_t *p);

#endif
