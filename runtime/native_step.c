/* One step of a Llama-pattern decoder on the host: the whole step contract in one call, no graph executor.
 *
 * Compiled together with host_attention.c (its medusa_tree_attention is the attention here) by
 * runtime/native_step.py, which reads the weights out of an engine's step graph and packs them.
 *
 * Batch-invariant, so exact by construction: every number a row's output depends on is computed by the
 * same instructions in the same order whatever else shares the step (other rows, other tree nodes, the
 * step's width), which is what makes a verify step's logits a plain step's bit for bit:
 *   - a matmul output y[m, n] is one chain of multiply-adds over k = 0..K-1 in one lane of a vector of 16
 *     outputs; the tiling (how many rows, which thread) only decides which chains run side by side;
 *   - a norm, the rotary embedding, the activation and the residual adds work on one row at a time;
 *   - the attention adds a query's visible keys in position order (host_attention.c).
 *
 *   - an int8 matmul (an int8-channel engine's) quantizes each row on its own (its max |x|), and its integer sums
 *     are exact in any order; the float epilogue is per element, in the graph's order.
 *
 * Layouts (float32, row-major; M = B * T rows, row m = b * T + t):
 *   fp32 linear (K -> N): N / 32 blocks of [K][32], then ceil((N % 32) / 16) blocks of [K][16] (the last one
 *                         zero-padded past N)
 *   int8 linear (K -> N): ceil(N / 32) blocks of [Kpad / 4][32][4] int8 (K padded to a multiple of 4 and N to one of
 *                         32 with zeros), beside its (N) column scales and (N) 128 x column sums
 *   past_k, past_v: (S, L, B, Hkv, D), the committed cache (S bound slots)
 *   new_k, new_v:   (T, L, B, Hkv, D), the step's keys and values, every layer
 *   hidden: (M, H) the final norm's output; logits (M, V); next_ids (M); topk (M, k)
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

int medusa_tree_attention(int B, int T, int Hq, int Hkv, int D, float scale, const float *q, const float *k,
                          const float *v, const float *cache_k, const float *cache_v, int64_t slot_stride,
                          int64_t row_stride, const uint8_t *mask, const int64_t *lengths, float *out,
                          float *scratch);

#define W 16     /* outputs a vector holds */
#define BLOCK 32 /* outputs a packed block holds: two vectors (N = 576 is 18 blocks, even work for two threads) */
#define NV (BLOCK / W)
typedef float vec16 __attribute__((vector_size(W * sizeof(float))));
#define ROWS 8 /* input rows a tile multiplies against one block of weights: 16 accumulators */

typedef struct {
    int32_t int8, k, n, kpad; /* int8 0: fp32 packed weights; 1: rows quantized to uint8 x int8 columns */
    const void *w;
    const float *scale;     /* int8: (N) column scales */
    const int32_t *colsum;  /* int8: (N) 128 x sum over k of w[k, n] (the rows' zero point, taken out) */
    float tiny, divisor;    /* int8: a row's scale is max(max |x|, tiny) / divisor */
} linear_t;

typedef struct {
    int32_t layers, hidden, heads, kv_heads, head_dim, inter, vocab, pad;
    float eps, scale;
    const float *inv_freq;   /* (D / 2) */
    const float *embed;      /* (V, H) */
    const float *norm_final; /* (H) */
    const linear_t *lm_head; /* H -> V */
    const float *const *norm_in, *const *norm_post;                            /* L x (H) */
    const linear_t *const *qkv, *const *o, *const *gate_up, *const *down;      /* L x linear */
} model_t;

typedef struct { /* scratch, sized for the most rows a step has */
    float *x, *h, *qkv, *q, *k, *v, *attn, *gu, *act, *rot, *att_scratch; /* rot: (M, D) cos then sin */
    uint8_t *xq; /* (M, the widest Kpad): int8 linears' quantized rows */
    float *xs;   /* (M): their scales */
} work_t;

static inline vec16 vload(const float *p) {
    vec16 x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void vstore(float *p, vec16 x) { memcpy(p, &x, sizeof x); }

/* rows x[0..mb) (stride K) times one packed block of nv vectors: y[i, j * 16 + l] (stride N); the last vector
 * stores its first `last` lanes only (a block padded past N) */
static inline __attribute__((always_inline)) void tile(const float *restrict x, int64_t K, const float *restrict w,
                                                       float *restrict y, int64_t N, const int nv, const int mb,
                                                       const int last) {
    vec16 acc[ROWS][NV];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nv; j++) acc[i][j] = (vec16){0};
    for (int64_t k = 0; k < K; k++) {
        const float *wk = w + k * nv * W;
        vec16 wv[NV];
        for (int j = 0; j < nv; j++) wv[j] = vload(wk + j * W);
        for (int i = 0; i < mb; i++) {
            const float xs = x[i * K + k];
            const vec16 xv = {xs, xs, xs, xs, xs, xs, xs, xs, xs, xs, xs, xs, xs, xs, xs, xs};
            for (int j = 0; j < nv; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nv; j++) {
            if (j == nv - 1 && last < W)
                memcpy(y + i * N + j * W, &acc[i][j], last * sizeof(float));
            else
                vstore(y + i * N + j * W, acc[i][j]);
        }
}

#define TILE_CASES(NV)                                                                                                 \
    switch (M - m) {                                                                                                   \
    case 1: tile(x + m * K, K, w, y + m * N, N, NV, 1, last); break;                                                   \
    case 2: tile(x + m * K, K, w, y + m * N, N, NV, 2, last); break;                                                   \
    case 3: tile(x + m * K, K, w, y + m * N, N, NV, 3, last); break;                                                   \
    case 4: tile(x + m * K, K, w, y + m * N, N, NV, 4, last); break;                                                   \
    case 5: tile(x + m * K, K, w, y + m * N, N, NV, 5, last); break;                                                   \
    case 6: tile(x + m * K, K, w, y + m * N, N, NV, 6, last); break;                                                   \
    case 7: tile(x + m * K, K, w, y + m * N, N, NV, 7, last); break;                                                   \
    }

static void block_rows(const float *x, int64_t M, int64_t K, const float *w, float *y, int64_t N, int nv, int last) {
    int64_t m = 0;
    if (nv == NV) {
        for (; M - m >= ROWS; m += ROWS) tile(x + m * K, K, w, y + m * N, N, NV, ROWS, last);
        TILE_CASES(NV)
    } else {
        for (; M - m >= ROWS; m += ROWS) tile(x + m * K, K, w, y + m * N, N, 1, ROWS, last);
        TILE_CASES(1)
    }
}

/* y (M, N) = x (M, K) @ the packed fp32 weight */
static void matmul_f32(const float *x, int64_t M, int64_t K, const float *w, float *y, int64_t N) {
    const int64_t wide = N / BLOCK, narrow = (N % BLOCK + W - 1) / W;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < wide + narrow; b++) {
        if (b < wide) {
            block_rows(x, M, K, w + b * K * BLOCK, y + b * BLOCK, N, NV, W);
        } else {
            const int64_t first = wide * BLOCK + (b - wide) * W; /* the block's first output */
            const int last = N - first < W ? (int)(N - first) : W;
            block_rows(x, M, K, w + wide * K * BLOCK + (b - wide) * K * W, y + first, N, 1, last);
        }
    }
}

typedef int32_t ivec16 __attribute__((vector_size(W * sizeof(int32_t))));

/* acc[i][j] += the int8 block's 4 k's of 16 outputs (vector j) times row i's 4 uint8 values there */
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#include <immintrin.h>
static inline ivec16 dot4(ivec16 acc, int32_t quad, const int8_t *w) {
    return (ivec16)_mm512_dpbusd_epi32((__m512i)acc, _mm512_set1_epi32(quad), _mm512_loadu_si512(w));
}
#else
static inline ivec16 dot4(ivec16 acc, int32_t quad, const int8_t *w) {
    uint8_t a[4];
    memcpy(a, &quad, 4);
    for (int l = 0; l < W; l++)
        acc[l] += a[0] * w[4 * l] + a[1] * w[4 * l + 1] + a[2] * w[4 * l + 2] + a[3] * w[4 * l + 3];
    return acc;
}
#endif

static inline __attribute__((always_inline)) void tile_i8(const uint8_t *restrict xq, int64_t kpad, const int8_t *restrict w,
                                                          ivec16 (*acc)[NV], const int mb) {
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < NV; j++) acc[i][j] = (ivec16){0};
    for (int64_t k = 0; k < kpad; k += 4) {
        const int8_t *wk = w + k * BLOCK;
        for (int i = 0; i < mb; i++) {
            int32_t quad;
            memcpy(&quad, xq + i * kpad + k, 4);
            for (int j = 0; j < NV; j++) acc[i][j] = dot4(acc[i][j], quad, wk + j * W * 4);
        }
    }
}

/* y = ((float)(sum_k q[m, k] w[k, n] - 128 sum_k w[k, n]) * row scale) * column scale: MatMulInteger, Cast, Mul, Mul */
static void matmul_i8(const linear_t *L, const float *x, int64_t M, float *y, const work_t *wk) {
    const int64_t K = L->k, N = L->n, kpad = L->kpad, blocks = (N + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++) { /* QuantizeLinear: saturate(round_half_even(x / scale) + 128) */
        const float *r = x + m * K;
        float top = 0.0f;
        for (int64_t e = 0; e < K; e++) top = fabsf(r[e]) > top ? fabsf(r[e]) : top;
        const float s = (top > L->tiny ? top : L->tiny) / L->divisor;
        uint8_t *q = wk->xq + m * kpad;
        for (int64_t e = 0; e < K; e++) {
            const float v = nearbyintf(r[e] / s) + 128.0f;
            q[e] = (uint8_t)(v < 0.0f ? 0.0f : v > 255.0f ? 255.0f : v);
        }
        for (int64_t e = K; e < kpad; e++) q[e] = 128;
        wk->xs[m] = s;
    }
    const int8_t *w = (const int8_t *)L->w;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        ivec16 acc[ROWS][NV];
        const int64_t first = b * BLOCK, width = N - first < BLOCK ? N - first : BLOCK;
        for (int64_t m = 0; m < M; m += ROWS) {
            const int mb = M - m < ROWS ? (int)(M - m) : ROWS;
            switch (mb) {
            case 1: tile_i8(wk->xq + m * kpad, kpad, w + b * kpad * BLOCK, acc, 1); break;
            case 2: tile_i8(wk->xq + m * kpad, kpad, w + b * kpad * BLOCK, acc, 2); break;
            case 3: tile_i8(wk->xq + m * kpad, kpad, w + b * kpad * BLOCK, acc, 3); break;
            case 4: tile_i8(wk->xq + m * kpad, kpad, w + b * kpad * BLOCK, acc, 4); break;
            case 5: tile_i8(wk->xq + m * kpad, kpad, w + b * kpad * BLOCK, acc, 5); break;
            case 6: tile_i8(wk->xq + m * kpad, kpad, w + b * kpad * BLOCK, acc, 6); break;
            case 7: tile_i8(wk->xq + m * kpad, kpad, w + b * kpad * BLOCK, acc, 7); break;
            default: tile_i8(wk->xq + m * kpad, kpad, w + b * kpad * BLOCK, acc, ROWS); break;
            }
            for (int i = 0; i < mb; i++) {
                int32_t sums[BLOCK];
                memcpy(sums, acc[i], sizeof sums);
                float *out = y + (m + i) * N + first;
                for (int64_t e = 0; e < width; e++)
                    out[e] = ((float)(sums[e] - L->colsum[first + e]) * wk->xs[m + i]) * L->scale[first + e];
            }
        }
    }
}

static void matmul(const linear_t *L, const float *x, int64_t M, float *y, const work_t *wk) {
    if (L->int8)
        matmul_i8(L, x, M, y, wk);
    else
        matmul_f32(x, M, L->k, (const float *)L->w, y, L->n);
}

/* the lanes of x added in one fixed order */
static inline float lanes_total(vec16 x) {
    float part[W];
    memcpy(part, &x, sizeof part);
    for (int w = W / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) part[l] += part[l + w];
    return part[0];
}

/* y = x / sqrt(mean(x^2) + eps) * weight, one row at a time */
static void rms_norm(const float *x, int64_t M, int64_t H, const float *weight, float eps, float *y) {
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * H;
        vec16 acc = {0};
        int64_t d = 0;
        for (; d + W <= H; d += W) {
            vec16 v = vload(r + d);
            acc += v * v;
        }
        float s = lanes_total(acc);
        for (; d < H; d++) s += r[d] * r[d];
        const float inv = 1.0f / sqrtf(s / (float)H + eps);
        for (d = 0; d < H; d++) y[m * H + d] = r[d] * inv * weight[d];
    }
}

/* the cos and sin of position pos times each frequency: rot = (cos[D / 2], sin[D / 2]) */
static void rope_table(int D, int64_t pos, const float *inv_freq, float *rot) {
    const int half = D / 2;
    for (int i = 0; i < half; i++) {
        const float f = (float)pos * inv_freq[i];
        rot[i] = cosf(f);
        rot[half + i] = sinf(f);
    }
}

/* rotate_half rotary embedding of one head vector (D) with its row's table, into out */
static void rope(const float *x, int D, const float *rot, float *out) {
    const int half = D / 2;
    const float *c = rot, *s = rot + half;
    for (int i = 0; i < half; i++) {
        out[i] = x[i] * c[i] - x[i + half] * s[i];
        out[i + half] = x[i + half] * c[i] + x[i] * s[i];
    }
}

/* e^v, one polynomial (host_attention.c's, over the whole float range): 2^n e^r, |r| <= ln2 / 2 */
static inline vec16 exp16(vec16 v) {
    const vec16 lo = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f,
                      -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
    const vec16 hi = -lo;
    ivec16 below = v < lo, above = v > hi; /* lanes of -1 where true */
    v = (vec16)(((ivec16)v & ~below) | ((ivec16)lo & below));
    v = (vec16)(((ivec16)v & ~above) | ((ivec16)hi & above));
    const vec16 k = (v * 1.44269504f + 12582912.0f) - 12582912.0f; /* round(v / ln 2) */
    const vec16 r = (v - k * 0.693145752f) - k * 1.42860677e-6f;
    vec16 p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const ivec16 bits = (__builtin_convertvector(k, ivec16) + 127) << 23;
    return p * (vec16)bits;
}

/* a = gate * sigmoid(gate) * up over one row of I; the tail (I % 16) padded through the same vector code */
static void silu_row(const float *g, const float *u, float *a, int64_t I) {
    for (int64_t e = 0; e < I; e += W) {
        vec16 gv = {0}, uv = {0};
        const int64_t n = I - e < W ? I - e : W;
        memcpy(&gv, g + e, n * sizeof(float));
        memcpy(&uv, u + e, n * sizeof(float));
        const vec16 out = gv * (1.0f / (1.0f + exp16(-gv))) * uv;
        memcpy(a + e, &out, n * sizeof(float));
    }
}

/* best first; a tie keeps the lower index first (ONNX ArgMax / TopK) */
static void top_k(const float *row, int64_t V, int k, int64_t *ids) {
    float best[64];
    int64_t idx[64];
    int n = 0;
    for (int64_t j = 0; j < V; j++) {
        const float s = row[j];
        if (n == k && !(s > best[k - 1])) continue;
        int p = n < k ? n++ : k - 1;
        while (p > 0 && s > best[p - 1]) {
            best[p] = best[p - 1];
            idx[p] = idx[p - 1];
            p--;
        }
        best[p] = s;
        idx[p] = j;
    }
    for (int i = 0; i < k; i++) ids[i] = i < n ? idx[i] : 0;
}

/* One linear alone (tests): y (M, N) = x (M, K) through it */
int medusa_native_linear(const linear_t *L, const work_t *wk, const float *x, int64_t M, float *y) {
    matmul(L, x, M, y, wk);
    return 0;
}

int medusa_native_threads(int threads) {
#ifdef _OPENMP
    if (threads > 0) omp_set_num_threads(threads);
    return omp_get_max_threads();
#else
    (void)threads;
    return 1;
#endif
}

/* One step. logits NULL: the lm_head is skipped (next_ids, topk untouched). k: topk's width (0: none; at most 64). */
int medusa_native_step(const model_t *md, const work_t *wk, int B, int T, const int64_t *ids, const int64_t *pos,
                       const uint8_t *mask, const int64_t *lengths, const float *past_k, const float *past_v,
                       float *new_k, float *new_v, float *hidden, float *logits, int64_t *next_ids, int64_t *topk,
                       int k) {
    const int64_t M = (int64_t)B * T, H = md->hidden, D = md->head_dim, Hq = md->heads, Hkv = md->kv_heads;
    const int64_t L = md->layers, I = md->inter, V = md->vocab, QKV = (Hq + 2 * Hkv) * D;
    const int64_t row_stride = Hkv * D, layer_stride = B * Hkv * D, slot_stride = L * layer_stride;
    if (Hkv <= 0 || Hq % Hkv != 0 || D % 2 != 0 || k < 0 || k > 64) return 1;
    float *x = wk->x;
    for (int64_t m = 0; m < M; m++) {
        if (ids[m] < 0 || ids[m] >= V) return 2;
        memcpy(x + m * H, md->embed + ids[m] * H, H * sizeof(float));
        rope_table(D, pos[m], md->inv_freq, wk->rot + m * D);
    }
    for (int64_t l = 0; l < L; l++) {
        rms_norm(x, M, H, md->norm_in[l], md->eps, wk->h);
        matmul(md->qkv[l], wk->h, M, wk->qkv, wk);
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++) {
                const float *r = wk->qkv + (b * T + t) * QKV;
                const float *rot = wk->rot + (b * T + t) * D;
                for (int64_t h = 0; h < Hq; h++) rope(r + h * D, D, rot, wk->q + ((b * Hq + h) * T + t) * D);
                for (int64_t h = 0; h < Hkv; h++) {
                    float *kk = wk->k + ((b * Hkv + h) * T + t) * D, *vv = wk->v + ((b * Hkv + h) * T + t) * D;
                    rope(r + (Hq + h) * D, D, rot, kk);
                    memcpy(vv, r + (Hq + Hkv + h) * D, D * sizeof(float));
                    const int64_t at = t * L * layer_stride + l * layer_stride + b * row_stride + h * D;
                    memcpy(new_k + at, kk, D * sizeof(float));
                    memcpy(new_v + at, vv, D * sizeof(float));
                }
            }
        if (medusa_tree_attention(B, T, Hq, Hkv, D, md->scale, wk->q, wk->k, wk->v, past_k + l * layer_stride,
                                  past_v + l * layer_stride, slot_stride, row_stride, mask, lengths, wk->attn,
                                  wk->att_scratch))
            return 1;
        matmul(md->o[l], wk->attn, M, wk->h, wk);
        for (int64_t e = 0; e < M * H; e++) x[e] += wk->h[e];
        rms_norm(x, M, H, md->norm_post[l], md->eps, wk->h);
        matmul(md->gate_up[l], wk->h, M, wk->gu, wk);
#pragma omp parallel for schedule(static) if (M > 1)
        for (int64_t m = 0; m < M; m++) silu_row(wk->gu + m * 2 * I, wk->gu + m * 2 * I + I, wk->act + m * I, I);
        matmul(md->down[l], wk->act, M, wk->h, wk);
        for (int64_t e = 0; e < M * H; e++) x[e] += wk->h[e];
    }
    rms_norm(x, M, H, md->norm_final, md->eps, hidden);
    if (logits == NULL) return 0;
    matmul(md->lm_head, hidden, M, logits, wk);
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        int64_t first[1];
        top_k(logits + m * V, V, 1, first);
        next_ids[m] = first[0];
        if (k) top_k(logits + m * V, V, k, topk + m * k);
    }
    return 0;
}
