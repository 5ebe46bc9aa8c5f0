/* Tree attention over the committed cache where it lies: no per-layer copy of the cache.
 *
 * Exact by construction: every query adds up its visible keys in one order, the order of their
 * positions (the committed slots 0..length-1, then the step's own nodes it may see, in node order,
 * which is depth order for a tree in topological order), with the same instructions whatever the
 * key's origin. A token scored in a verify step therefore sees the same numbers in the same order
 * as when a plain step scores it after its ancestors were committed: its output is bit for bit
 * the same. Every score comes from one routine (16 lanes over the head dimension, then the lanes
 * added in one fixed order; on AVX-512 16 keys a pass, their lane sums in one butterfly that adds
 * each key's lanes in the same order), every exponential one polynomial, a row's softmax sum a fixed
 * function of its list of scores, and its value sum runs over its keys one at a time (vectorised
 * over the head dimension only, which no key shares with another), one fused multiply-add a value
 * where the instruction set has one (native_simd.h's vf_fma; a product then a sum on baseline x86-64).
 *
 * Layouts (float32, row-major):
 *   q       [B, Hq, T, D]  the step's queries, rotary applied
 *   k, v    [B, Hkv, T, D] the step's new keys and values
 *   cache_k, cache_v: element (slot s, row b, head h, d) at s * slot_stride + b * row_stride + h * D + d
 *   mask    uint8 [B, T, T] node i sees node j (ancestors and itself)
 *   lengths int64 [B]      committed slots of each row
 *   pos     int64 [B, T]   the nodes' positions (read only with a sliding window: committed slot s holds position s)
 *   window  a sliding window: a query at position p sees keys at positions > p - window (0: every key)
 *   softcap each scaled score s becomes softcap tanh(s / softcap) before the softmax (Gemma-2; 0: none)
 *   sinks   float [Hq] or NULL: each head's sink logit, a last term of its rows' softmax (in the max and the sum, no
 *           value): gpt-oss's attention sinks
 *   out     [B, T, Hq * D]
 *   scratch float, at least RB * (max(lengths) + 2 * T) elements (RB rows of scores and of the nodes' scores), times
 *           the pool's threads (native_pool.h: its tasks run in parallel, each in its worker's part)
 * Query head h reads key/value head h / (Hq / Hkv) (grouped-query attention).
 *
 * A sliding window keeps the order: a row's scores start at its first visible slot, a function of its own position
 * alone (never of the rows beside it), and the keys it cannot see are left out of its softmax and its value sums, not
 * weighted by zero. So a verify step still gives each node its plain step's numbers bit for bit. The rows of one
 * task share the keys they read from the lowest first slot among them; each row's sums start at its own.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native_pool.h"
#include "native_simd.h"

#define LANES 16
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

static inline vec load(const float *p) {
    vec x;
    memcpy(&x, p, sizeof x);
    return x;
}

typedef float half __attribute__((vector_size(LANES / 2 * sizeof(float))));
typedef float quarter __attribute__((vector_size(LANES / 4 * sizeof(float))));

static inline float lanes_sum(vec x) { /* one fixed order: lane l + 8 onto l, then l + 4, l + 2, l + 1 */
    half lo, hi;
    memcpy(&lo, &x, sizeof lo);
    memcpy(&hi, (const char *)&x + sizeof lo, sizeof hi);
    half h = lo + hi;
    quarter a, b;
    memcpy(&a, &h, sizeof a);
    memcpy(&b, (const char *)&h + sizeof a, sizeof b);
    quarter f = a + b;
    return (f[0] + f[2]) + (f[1] + f[3]);
}

static inline float dot(const float *q, const float *k, int n) {
    vec acc = {0};
    int d = 0;
    for (; d + LANES <= n; d += LANES) acc += load(q + d) * load(k + d);
    float s = lanes_sum(acc);
    for (; d < n; d++) s += q[d] * k[d];
    return s;
}

/* A value sum's step, acc + w v: native_simd.h's vf_fma on each of its VF-lane parts (fused where the set has an
 * FMA, a product then a sum on the baseline x86-64 set), and sf_fma, its scalar counterpart, in the scalar loop.
 * Every value sum of a build takes it, so a row's sum is the same chain over its keys whichever path runs it. */
static inline vec fma_vec(float w, vec v, vec acc) {
    const vf ws = vf_set1(w);
    for (int l = 0; l < LANES; l += VF) {
        vf a, x;
        memcpy(&a, (const char *)&acc + l * sizeof(float), sizeof a);
        memcpy(&x, (const char *)&v + l * sizeof(float), sizeof x);
        a = vf_fma(ws, x, a);
        memcpy((char *)&acc + l * sizeof(float), &a, sizeof a);
    }
    return acc;
}

static inline void add_scaled(float *restrict acc, const float *restrict v, float p, int n) {
    for (int d = 0; d < n; d++) acc[d] = sf_fma(p, v[d], acc[d]);
}

/* e^x for x <= 0 (x - max of a row), one polynomial whatever the lane: 2^n e^r, |r| <= ln2 / 2 */
static void exp_row(float *x, int64_t n) {
    for (int64_t m = 0; m < n; m++) {
        float v = x[m] < -87.0f ? -87.0f : x[m];
        float k = (v * 1.44269504f + 12582912.0f) - 12582912.0f; /* round(v / ln 2) */
        float r = (v - k * 0.693145752f) - k * 1.42860677e-6f;
        float p = 1.0f / 720.0f;
        p = p * r + 1.0f / 120.0f;
        p = p * r + 1.0f / 24.0f;
        p = p * r + 1.0f / 6.0f;
        p = p * r + 0.5f;
        p = p * r + 1.0f;
        p = p * r + 1.0f;
        int32_t bits = ((int32_t)k + 127) << 23;
        float scale;
        memcpy(&scale, &bits, sizeof scale);
        x[m] = p * scale;
    }
}

static float row_max(const float *x, int64_t n) { /* order-free: lanes of partial maxima */
    float part[LANES];
    for (int l = 0; l < LANES; l++) part[l] = -INFINITY;
    int64_t m = 0;
    for (; m + LANES <= n; m += LANES)
        for (int l = 0; l < LANES; l++) part[l] = x[m + l] > part[l] ? x[m + l] : part[l];
    for (int l = 0; m < n; m++, l++) part[l] = x[m] > part[l] ? x[m] : part[l];
    float top = -INFINITY;
    for (int l = 0; l < LANES; l++) top = part[l] > top ? part[l] : top;
    return top;
}

static float row_sum(const float *x, int64_t n) { /* LANES partial sums by index, then the lanes in one order */
    float part[LANES] = {0};
    int64_t m = 0;
    for (; m + LANES <= n; m += LANES)
        for (int l = 0; l < LANES; l++) part[l] += x[m + l];
    for (int l = 0; m < n; m++, l++) part[l] += x[m];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) part[l] += part[l + w];
    return part[0];
}

#define AHEAD 8 /* slots prefetched ahead: in a stacked cache a layer's slots lie a whole layer-stack apart */
#define RB 4    /* rows (query heads x nodes of one key/value head) that share each key they read */
#define MAXV 8  /* head dimensions up to MAXV * LANES keep a block's value sums in registers */

static inline void prefetch(const float *p, int n) { /* every cache line of one head's row */
    for (int d = 0; d < n; d += 64 / sizeof(float)) __builtin_prefetch(p + d);
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define TILE 16
#define MAXD_OR_1 MAXD
#define TILE_OR_1 TILE /* keys scored together: one FMA chain a key, then the 16 lane sums in one butterfly */
#define MAXD 256

/* The 16 sums of acc[j]'s lanes (key j's in some lane, lane_index's j-th): the same adds in the same order for every key. */
static inline __m512 butterfly(__m512 *acc) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]), _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

static __m512i lane_index; /* a permutation: key j's sum from the butterfly's lane to lane j */

/* Found once, when the library is loaded (before any thread can call in): the butterfly run on keys whose lanes all
 * hold their own index j, read back. */
__attribute__((constructor)) static void find_lanes(void) {
    __m512 acc[TILE];
    for (int j = 0; j < TILE; j++) acc[j] = _mm512_set1_ps((float)j);
    float out[TILE];
    _mm512_storeu_ps(out, butterfly(acc));
    int32_t index[TILE];
    for (int l = 0; l < TILE; l++) index[(int)(out[l] / TILE + 0.5f)] = l;
    lane_index = _mm512_loadu_si512(index);
}

/* Scores of one query row against a whole tile of 16 keys at keys + j * stride; the first count stored at dst. */
static inline void score_tile(const float *qr, const float *keys, int64_t stride, int count, float *dst, float scale,
                              const int D) {
    __m512 acc[TILE];
    for (int j = 0; j < TILE; j++) acc[j] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += LANES) {
        const __m512 qv = _mm512_loadu_ps(qr + d);
        for (int j = 0; j < TILE; j++) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys + j * stride + d), acc[j]);
    }
    const __m512 sums = _mm512_permutexvar_ps(lane_index, _mm512_mul_ps(butterfly(acc), _mm512_set1_ps(scale)));
    _mm512_mask_storeu_ps(dst, (__mmask16)((1u << count) - 1), sums);
}
#define TILED(D) ((D) % LANES == 0 && (D) <= MAXD)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TILE 8
#define MAXD 256
#define MAXD_OR_1 MAXD
#define TILE_OR_1 TILE /* keys scored together: one FMA chain a key over 8 lanes, then the 8 lane sums in one tree */

/* Scores of one query row against a whole tile of 8 keys at keys + j * stride; the first count stored at dst. Key j's
 * lanes are added as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) whatever j is. */
static inline void score_tile(const float *qr, const float *keys, int64_t stride, int count, float *dst, float scale,
                              const int D) {
    __m256 acc[TILE];
    for (int j = 0; j < TILE; j++) acc[j] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qr + d);
        for (int j = 0; j < TILE; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + j * stride + d), acc[j]);
    }
    /* pairs, then quads within each 128-bit half: lane order (k0 k1 k2 k3 | k4 k5 k6 k7) per half; then the halves */
    const __m256 p01 = _mm256_hadd_ps(acc[0], acc[1]), p23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 p45 = _mm256_hadd_ps(acc[4], acc[5]), p67 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 q0 = _mm256_hadd_ps(p01, p23), q1 = _mm256_hadd_ps(p45, p67); /* keys 0-3 (low half: lanes 0-3) */
    const __m256 lo = _mm256_permute2f128_ps(q0, q1, 0x20), hi = _mm256_permute2f128_ps(q0, q1, 0x31);
    const __m256 sums = _mm256_mul_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(scale));
    if (count == TILE) {
        _mm256_storeu_ps(dst, sums);
    } else {
        float all[TILE];
        _mm256_storeu_ps(all, sums);
        memcpy(dst, all, sizeof(float) * (size_t)count);
    }
}
#define TILED(D) ((D) % 8 == 0 && (D) <= MAXD)
#else
#define TILED(D) 0
#define TILE_OR_1 1
#define MAXD_OR_1 1
static inline void score_tile(const float *qr, const float *keys, int64_t stride, int count, float *dst, float scale,
                              const int D) {
    (void)qr, (void)keys, (void)stride, (void)count, (void)dst, (void)scale, (void)D;
}
#endif

/* Scores of nr <= RB rows against n keys at base + s * stride: dst[r][s]. One routine scores every key a
 * row sees, cached or new (TILED: 16 keys a pass; else one dot product a key). */
static inline __attribute__((always_inline)) void score_keys(const float *const *qr, int nr, const float *base,
                                                             int64_t stride, int64_t n, float *const *dst,
                                                             float scale, const int D) {
    if (TILED(D)) {
        for (int64_t s = 0; s < n; s += TILE_OR_1) {
            const int count = n - s < TILE_OR_1 ? (int)(n - s) : TILE_OR_1;
            for (int j = 0; j < count && s + TILE_OR_1 + j < n; j++) prefetch(base + (s + TILE_OR_1 + j) * stride, D);
            const float *keys = base + s * stride;
            int64_t step = stride;
            float tile[TILE_OR_1 * MAXD_OR_1]; /* a last, partial tile: its keys, then zeros (read once for every row) */
            if (count < TILE_OR_1) {
                memset(tile, 0, sizeof(float) * TILE_OR_1 * D);
                for (int j = 0; j < count; j++) memcpy(tile + j * D, keys + j * stride, sizeof(float) * D);
                keys = tile, step = D;
            }
            for (int r = 0; r < nr; r++) score_tile(qr[r], keys, step, count, dst[r] + s, scale, D);
        }
        return;
    }
    for (int64_t s = 0; s < n; s++) {
        const float *ks = base + s * stride;
        if (s + AHEAD < n) prefetch(ks + AHEAD * stride, D);
        for (int r = 0; r < nr; r++) dst[r][s] = dot(qr[r], ks, D) * scale;
    }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
/* AVX2 (16 ymm registers, too few for RB rows' 16-lane sums): one row at a time, 64 dimensions a pass in 8 ymm sums,
 * each weight broadcast once; the same order per lane as below (slots start..n-1, then the visible nodes). */
static void sum_values_avx2(float *const *o, int nr, const float *base, int64_t stride, int64_t n, const float *const *p,
                            const float *vn, const uint8_t *const *seen, int T, const int64_t *start,
                            const uint8_t *const *far, const int D) {
    for (int r = 0; r < nr; r++)
        for (int c0 = 0; c0 < D; c0 += 64) {
            const int nv = (D - c0 < 64 ? D - c0 : 64) / 8;
            __m256 acc[8];
            for (int c = 0; c < nv; c++) acc[c] = _mm256_setzero_ps();
            for (int64_t s = start[r]; s < n; s++) {
                const float *vs = base + s * stride + c0;
                const __m256 w = _mm256_set1_ps(p[r][s]);
                for (int c = 0; c < nv; c++) acc[c] = vf_fma(w, _mm256_loadu_ps(vs + 8 * c), acc[c]);
            }
            int64_t m = n;
            for (int j = 0; j < T; j++)
                if (seen[r][j] && !(far[r] && far[r][j])) {
                    const __m256 w = _mm256_set1_ps(p[r][m++]);
                    const float *vj = vn + (int64_t)j * D + c0;
                    for (int c = 0; c < nv; c++) acc[c] = vf_fma(w, _mm256_loadu_ps(vj + 8 * c), acc[c]);
                }
            for (int c = 0; c < nv; c++) _mm256_storeu_ps(o[r] + c0 + 8 * c, acc[c]);
        }
}
#define SUMS_AVX2(D) ((D) % 8 == 0)
#else
#define SUMS_AVX2(D) 0
static void sum_values_avx2(float *const *o, int nr, const float *base, int64_t stride, int64_t n, const float *const *p,
                            const float *vn, const uint8_t *const *seen, int T, const int64_t *start,
                            const uint8_t *const *far, const int D) {
    (void)o, (void)nr, (void)base, (void)stride, (void)n, (void)p, (void)vn, (void)seen, (void)T, (void)start, (void)far, (void)D;
}
#endif

_Static_assert(RB == 4, "sum_values unrolls rows 1, 2, 3 and RB");

/* acc[r] += p[r][s] v_s over slots s0..n-1 for rows r < nr (a constant where inlined), each slot's values loaded once */
static inline __attribute__((always_inline)) void slot_sums(vec (*acc)[MAXV], const int nr, const int nv, const float *base,
                                                            int64_t stride, int64_t s0, int64_t n, const float *const *p) {
    for (int64_t s = s0; s < n; s++) {
        const float *vs = base + s * stride;
        if (s + AHEAD < n) prefetch(vs + AHEAD * stride, nv * LANES);
        vec v[MAXV];
        for (int c = 0; c < nv; c++) v[c] = load(vs + c * LANES);
        for (int r = 0; r < nr; r++) {
            const float w = p[r][s];
            for (int c = 0; c < nv; c++) acc[r][c] = fma_vec(w, v[c], acc[r][c]);
        }
    }
}

/* o[r] = sum over the cache's slots start[r]..n-1 of p[r][s] v_s, then over the row's visible nodes (seen, and not
 * far: outside its window where far is set), in that order. */
static inline __attribute__((always_inline)) void sum_values(float *const *o, int nr, const float *base,
                                                             int64_t stride, int64_t n, const float *const *p,
                                                             const float *vn, const uint8_t *const *seen, int T,
                                                             const int64_t *start, const uint8_t *const *far,
                                                             const int D) {
    if (SUMS_AVX2(D)) {
        sum_values_avx2(o, nr, base, stride, n, p, vn, seen, T, start, far, D);
        return;
    }
    if (D % LANES == 0 && D / LANES <= MAXV) { /* the sums in registers across the slots */
        const int nv = D / LANES;
        vec acc[RB][MAXV];
        for (int r = 0; r < nr; r++)
            for (int c = 0; c < nv; c++) acc[r][c] = (vec){0};
        int64_t s0 = n, s1 = 0; /* the rows' lowest and highest first slots */
        for (int r = 0; r < nr; r++) s0 = start[r] < s0 ? start[r] : s0, s1 = start[r] > s1 ? start[r] : s1;
        if (s0 == s1) /* every row from the same slot (no window, or one it all sees): the rows unrolled */
            switch (nr) {
            case 1: slot_sums(acc, 1, nv, base, stride, s0, n, p); break;
            case 2: slot_sums(acc, 2, nv, base, stride, s0, n, p); break;
            case 3: slot_sums(acc, 3, nv, base, stride, s0, n, p); break;
            default: slot_sums(acc, RB, nv, base, stride, s0, n, p); break; /* nr == RB */
            }
        for (int64_t s = s0 == s1 ? n : s0; s < n; s++) {
            const float *vs = base + s * stride;
            if (s + AHEAD < n) prefetch(vs + AHEAD * stride, D);
            for (int r = 0; r < nr; r++) {
                if (s < start[r]) continue;
                const float w = p[r][s];
                for (int c = 0; c < nv; c++) acc[r][c] = fma_vec(w, load(vs + c * LANES), acc[r][c]);
            }
        }
        for (int r = 0; r < nr; r++) {
            int64_t m = n;
            for (int j = 0; j < T; j++)
                if (seen[r][j] && !(far[r] && far[r][j])) {
                    const float w = p[r][m++];
                    for (int c = 0; c < nv; c++) acc[r][c] = fma_vec(w, load(vn + (int64_t)j * D + c * LANES), acc[r][c]);
                }
            for (int c = 0; c < nv; c++) memcpy(o[r] + c * LANES, &acc[r][c], sizeof(vec));
        }
        return;
    }
    for (int r = 0; r < nr; r++) memset(o[r], 0, sizeof(float) * D);
    for (int64_t s = 0; s < n; s++)
        for (int r = 0; r < nr; r++)
            if (s >= start[r]) add_scaled(o[r], base + s * stride, p[r][s], D);
    for (int r = 0; r < nr; r++) {
        int64_t m = n;
        for (int j = 0; j < T; j++)
            if (seen[r][j] && !(far[r] && far[r][j])) add_scaled(o[r], vn + (int64_t)j * D, p[r][m++], D);
    }
}

/* The scratch (floats) a step of T nodes a row over at most `longest` committed slots needs on `threads` threads: RB
 * rows of scores (longest + T) and of the nodes' scores (T), and RB rows of T window flags (in floats' room) */
int64_t medusa_tree_attention_scratch(int B, int T, int64_t longest, int threads) {
    (void)B;
    return (int64_t)threads * RB * (longest + 2 * (int64_t)T + ((int64_t)T + 3) / 4);
}

typedef struct {
    int B, T, Hq, Hkv, D, groups, per_kv, blocks;
    float scale;
    const float *q, *k, *v, *cache_k, *cache_v;
    int64_t slot_stride, row_stride, per_thread, flags_at; /* flags_at: a worker's window flags, past its rows */
    const uint8_t *mask;
    const int64_t *lengths, *pos;
    int window;
    float softcap; /* each score s becomes c tanh(s / c) before the softmax (0: none) */
    const float *sinks; /* (Hq): each head's sink logit, one more term of its softmax's denominator (NULL: none) */
    float *out, *scratch;
} att_job;

/* tasks first..last: each RB rows of one key/value head of one sequence, writing its own rows of out, its scores in
 * the worker's part of the scratch */
static void attend(void *ctx, int64_t first_task, int64_t last_task, int worker) {
    const att_job *J = ctx;
    const int T = J->T, Hq = J->Hq, Hkv = J->Hkv, D = J->D, groups = J->groups, per_kv = J->per_kv, blocks = J->blocks;
    float *mine = J->scratch + (int64_t)worker * J->per_thread;
    for (int64_t task = first_task; task < last_task; task++) {
        const int b = (int)(task / ((int64_t)Hkv * blocks)), kv = (int)(task / blocks % Hkv), first = (int)(task % blocks) * RB;
        const float *qrow[RB];
        float *orow[RB], *prow[RB];
        const uint8_t *srow[RB];
        const uint8_t *far[RB] = {0}; /* window: which nodes lie outside a row's window (NULL: none do) */
        int64_t start[RB] = {0};         /* a row's first visible slot */
        const int64_t length = J->lengths[b], width = length + T; /* scratch: one row of scores a query */
        const float *kb = J->cache_k + b * J->row_stride + (int64_t)kv * D, *vb = J->cache_v + b * J->row_stride + (int64_t)kv * D;
        const float *kn = J->k + ((int64_t)(b * Hkv + kv) * T) * D, *vn = J->v + ((int64_t)(b * Hkv + kv) * T) * D;
        const int nr = per_kv - first < RB ? per_kv - first : RB;
        for (int x = 0; x < nr; x++) {
            const int r = first + x, h = kv * groups + r / T, i = r % T;
            qrow[x] = J->q + ((int64_t)(b * Hq + h) * T + i) * D;
            orow[x] = J->out + ((int64_t)b * T + i) * Hq * D + (int64_t)h * D;
            prow[x] = mine + (int64_t)x * (width + T);
            srow[x] = J->mask + ((int64_t)b * T + i) * T;
        }
        int64_t lo = 0; /* the lowest first visible slot of the task's rows */
        if (J->window > 0) {
            uint8_t *flags = (uint8_t *)(mine + J->flags_at);
            lo = length;
            for (int x = 0; x < nr; x++) {
                const int i = (first + x) % T;
                const int64_t p = J->pos[(int64_t)b * T + i], edge = p - J->window + 1; /* keys at positions >= edge */
                start[x] = edge < 0 ? 0 : edge > length ? length : edge;
                lo = start[x] < lo ? start[x] : lo;
                uint8_t *f = flags + (int64_t)x * T;
                for (int j = 0; j < T; j++) f[j] = J->pos[(int64_t)b * T + j] < edge;
                far[x] = f;
            }
        }
        float *from[RB]; /* each row's scores from slot lo */
        for (int x = 0; x < nr; x++) from[x] = prow[x] + lo;
        if (D == 64)
            score_keys(qrow, nr, kb + lo * J->slot_stride, J->slot_stride, length - lo, from, J->scale, 64);
        else
            score_keys(qrow, nr, kb + lo * J->slot_stride, J->slot_stride, length - lo, from, J->scale, D);
        float *fresh[RB]; /* scores of the step's own nodes, after the row's cache scores */
        for (int x = 0; x < nr; x++) fresh[x] = prow[x] + width;
        if (D == 64)
            score_keys(qrow, nr, kn, 64, T, fresh, J->scale, 64);
        else
            score_keys(qrow, nr, kn, D, T, fresh, J->scale, D);
        for (int x = 0; x < nr; x++) { /* the row's own visible nodes, then its softmax over its slots start..length */
            float *row = prow[x] + start[x];
            int64_t n = length - start[x];
            for (int j = 0; j < T; j++)
                if (srow[x][j] && !(far[x] && far[x][j])) row[n++] = fresh[x][j];
            if (J->softcap > 0.0f) /* per score, one function of it alone */
                for (int64_t m = 0; m < n; m++) row[m] = J->softcap * tanhf(row[m] / J->softcap);
            int64_t all = n; /* with the head's sink last (the row has room: its fresh scores are copied in by now) */
            if (J->sinks) row[all++] = J->sinks[kv * groups + (first + x) / T];
            const float top = row_max(row, all);
            for (int64_t m = 0; m < all; m++) row[m] -= top;
            exp_row(row, all);
            const float inv = all ? 1.0f / row_sum(row, all) : 0.0f;
            for (int64_t m = 0; m < n; m++) row[m] *= inv;
        }
        const float *const *pr = (const float *const *)prow;
        if (D == 64)
            sum_values(orow, nr, vb, J->slot_stride, length, pr, vn, srow, T, start, far, 64);
        else
            sum_values(orow, nr, vb, J->slot_stride, length, pr, vn, srow, T, start, far, D);
    }
}

/* The kernel on the pool's threads (NULL: the calling thread), with a scratch of scratch_floats floats (checked: 2
 * where too small for the pool's threads) */
int medusa_tree_attention_pool(int B, int T, int Hq, int Hkv, int D, float scale, const float *q, const float *k,
                               const float *v, const float *cache_k, const float *cache_v, int64_t slot_stride,
                               int64_t row_stride, const uint8_t *mask, const int64_t *lengths, const int64_t *pos,
                               int window, float softcap, const float *sinks, float *out, float *scratch,
                               int64_t scratch_floats, pool_t *pool) {
    if (Hkv <= 0 || Hq % Hkv != 0 || window < 0 || (window > 0 && !pos) || !(softcap >= 0.0f)) return 1;
    const int threads = medusa_pool_threads(pool);
    const int groups = Hq / Hkv, per_kv = groups * T; /* rows of a key/value head: query head kv * groups + g, node i */
    const int blocks = (per_kv + RB - 1) / RB;
    int64_t longest = 0;
    for (int b = 0; b < B; b++) longest = lengths[b] > longest ? lengths[b] : longest;
    if (threads <= 0 || longest < 0 || medusa_tree_attention_scratch(B, T, longest, threads) > scratch_floats) return 2;
    att_job J = {B, T, Hq, Hkv, D, groups, per_kv, blocks, scale, q, k, v, cache_k, cache_v, slot_stride, row_stride,
                 medusa_tree_attention_scratch(B, T, longest, 1), (int64_t)RB * (longest + 2 * T), mask, lengths, pos,
                 window, softcap, sinks, out, scratch};
    pool_run(pool, (int64_t)B * Hkv * blocks, 1, attend, &J);
    return 0;
}

/* One thread, the scratch sized by the caller for it (host_attention.py's HostAttention) */
int medusa_tree_attention(int B, int T, int Hq, int Hkv, int D, float scale, const float *q, const float *k,
                          const float *v, const float *cache_k, const float *cache_v, int64_t slot_stride,
                          int64_t row_stride, const uint8_t *mask, const int64_t *lengths, float *out,
                          float *scratch) {
    int64_t longest = 0;
    for (int b = 0; b < B; b++) longest = lengths[b] > longest ? lengths[b] : longest;
    return medusa_tree_attention_pool(B, T, Hq, Hkv, D, scale, q, k, v, cache_k, cache_v, slot_stride, row_stride, mask,
                                      lengths, NULL, 0, 0.0f, NULL, out, scratch, medusa_tree_attention_scratch(B, T, longest, 1), NULL);
}
