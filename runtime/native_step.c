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
 *   - the attention adds a query's visible keys in position order (host_attention.c); a sliding window starts a
 *     query's keys at a slot given by its own position alone;
 *   - biases, q/k norms (one head vector at a time) and the rotary embedding work on one row at a time.
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
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "native_pool.h"
#include "native_simd.h"

/* host_attention.c's kernel on the pool's threads, its scratch `scratch_floats` long (checked there) */
int medusa_tree_attention_pool(int B, int T, int Hq, int Hkv, int D, float scale, const float *q, const float *k,
                               const float *v, const float *cache_k, const float *cache_v, int64_t slot_stride,
                               int64_t row_stride, const uint8_t *mask, const int64_t *lengths, const int64_t *pos,
                               int window, float softcap, const float *sinks, float *out, float *scratch,
                               int64_t scratch_floats, pool_t *pool);
int64_t medusa_tree_attention_scratch(int B, int T, int64_t longest, int threads);

/* error codes of the exported functions (runtime/native_step.py names them) */
enum { OK = 0, BAD_SHAPE = 1, BAD_TOKEN = 2, BAD_LENGTH = 3, TOO_LARGE = 4, BAD_MODEL = 5, BAD_WORK = 6, BUSY = 7, NO_THREADS = 8,
       BAD_POSITION = 9 };

#define W 16     /* outputs a generic vector (vec16) holds */
#define BLOCK 32 /* outputs a packed block holds (N = 576 is 18 blocks, even work for two threads) */
#define NARROW 16 /* outputs a narrow block holds (the N % 32 rest, the last one zero-padded) */
typedef float vec16 __attribute__((vector_size(W * sizeof(float))));
#define MAX_TOPK 64

/* A tile: ROWS input rows times PANEL vectors of one packed block's outputs, ROWS x PANEL accumulators in registers. */
#if VF == 16
#define PANEL 2 /* 32 outputs: a wide block */
#define ROWS 8
#elif VF == 8
#define PANEL 2 /* 16 outputs: half a wide block (16 ymm registers: 12 sums, 2 weights, 1 input) */
#define ROWS 6
#elif VF == 4 && defined(__aarch64__)
#define PANEL 4 /* 16 outputs (32 NEON registers: 16 sums) */
#define ROWS 4
#elif VF == 4
#define PANEL 2 /* 8 outputs (16 xmm registers) */
#define ROWS 6
#else
#define PANEL 4
#define ROWS 4
#endif

enum { LIN_F32 = 0, LIN_INT8 = 1, LIN_NBITS4 = 4, LIN_NBITS8 = 8 };

typedef struct {
    int32_t kind, k, n, kpad; /* LIN_F32: packed fp32 weights; LIN_INT8: rows quantized to uint8 x int8 columns;
                                 LIN_NBITS4 / 8: MatMulNBits' 4- or 8-bit blocks (kpad: K padded to whole blocks) */
    const void *w;
    const float *scale;     /* int8: (N) column scales; nbits: (groups, blocks, 32) block scales */
    const int32_t *colsum;  /* int8: (N) 128 x sum over k of w[k, n] (the rows' zero point, taken out);
                               nbits: (groups, blocks, 32) uint8 block zero points */
    float tiny, divisor;    /* int8: a row's scale is max(max |x|, tiny) / divisor */
    int32_t block, blocks;  /* nbits: weights a block along K, and blocks (kpad / block) */
} linear_t;

#define MAX_EXPERTS 256 /* experts a layer, at most (runtime/native_weights.py's MAX_EXPERTS) */

typedef struct { /* one layer's routed experts (runtime/native_experts.py reads them) */
    int32_t experts, top_k, normalize, inter, shared_inter; /* normalize: the k weights over their sum */
    int32_t topk_first; /* the softmax over the k largest logits (gpt-oss), not the k largest of the softmax over all */
    const linear_t *router;                       /* H -> E */
    const linear_t *const *gate_up, *const *down; /* E x: H -> 2 inter (gate then up), inter -> H */
    const linear_t *shared_gate_up, *shared_down, *shared_gate; /* a shared expert (H -> 2 Is, Is -> H, H -> 1), or NULL */
    const float *router_bias;                          /* (E) added to the router's logits, or NULL (gpt-oss) */
    const float *const *gate_up_bias, *const *down_bias; /* E x (2 inter) / (H): each expert's biases, entries NULL: none */
} experts_t;

typedef struct {
    int32_t layers, hidden, heads, kv_heads, head_dim, inter, vocab, pad;
    float eps, scale;
    const float *inv_freq;   /* (rope_tables, D / 2): each rotary table's inverse frequencies */
    const float *embed;      /* (V, H) */
    const float *norm_final; /* (H) */
    const linear_t *lm_head; /* H -> V */
    const float *const *norm_in, *const *norm_post; /* L x (H); NULL: the next matmul reads the residual stream itself */
    const linear_t *const *qkv, *const *o, *const *gate_up, *const *down;      /* L x linear */
    /* per layer, each entry NULL where the layer has none: */
    const float *const *qkv_bias;          /* L x ((Hq + 2 Hkv) D): q, k and v biases, added after the q/k/v matmul */
    const float *const *q_norm, *const *k_norm; /* L x (D), (Hq D) / (Hkv D): norms of the query / key heads, before the
                                                   rotary (qk_norm_span says which) */
    const int32_t *window;                 /* L: sliding window in positions (0: every key) */
    float qk_eps;                          /* the q/k norms' epsilon */
    int32_t act;                           /* the MLP gate: ACT_SILU, ACT_GELU_TANH, ACT_GELU; ACT_RELU2: ungated */
    float embed_scale;                     /* the token embedding times this (Gemma: sqrt(H); else 1) */
    int32_t rope_tables;                   /* rotary tables (local and global bases: 2) */
    const int32_t *rope_of;                /* L: each layer's rotary table */
    const float *const *attn_out_norm, *const *mlp_out_norm; /* L x (H): norms of the attention's and the MLP's
                                                                outputs before their residual adds (Gemma-2/3) */
    float residual_scale; /* each attention and MLP output times this before its residual add (Granite; else 1) */
    float logit_divisor;  /* the logits: the lm_head's output over this (Granite's logits scaling; else 1) */
    int32_t qk_norm_span; /* QK_SHARED: one (D) weight every head; QK_WHOLE: one norm of the whole (Hq D) / (Hkv D)
                             projection (OLMo-2); QK_EACH: each head's own (D) weight of the (Hq D) / (Hkv D) (StableLM-2 12B) */
    const experts_t *const *experts; /* L: the layer's routed experts, NULL where its MLP is dense (gate_up, down) */
    float attn_softcap;  /* each scaled score s becomes c tanh(s / c) before the mask and softmax (Gemma-2; 0: none) */
    float final_softcap; /* each logit z becomes c tanh(z / c) (Gemma-2; 0: none) */
    int32_t layer_norm;  /* norm_in, norm_post and norm_final are layer norms (mean and variance; StableLM), not RMS */
    int32_t rotary_dim;  /* the leading dims of each head the rotary turns (partial rotary); the rest pass (D: all) */
    const float *const *norm_in_bias, *const *norm_post_bias; /* L x (H) a layer norm's bias, NULL: none */
    const float *norm_final_bias;                             /* (H), NULL: none */
    const float *const *o_bias; /* L x (H): the attention output projection's bias, NULL: none (gpt-oss) */
    const float *const *sinks;  /* L x (Hq): each head's sink logit, one more term of every softmax's denominator (gpt-oss) */
    float rope_factor;          /* the rotary tables' cos and sin times this (YaRN's attention factor; else 1) */
    float act_alpha, act_limit; /* ACT_SWIGLU_LIMIT's sigmoid slope and clamp */
    const float *const *gate_up_bias, *const *down_bias; /* L x (I) / (H): an ungated MLP's biases, NULL: none (GPT-NeoX) */
    int32_t parallel_residual; /* x + (mlp(norm_post(x)) + attention(norm_in(x))): both read the layer's input (GPT-NeoX) */
    int32_t rope_interleaved;  /* the rotary turns pairs (2i, 2i + 1), not halves (i, i + R / 2) (Helium) */
    int32_t qk_layer_norm;     /* the q/k norms are layer norms without a bias (mean and variance), not RMS (StableLM) */
    int32_t shared_norm; /* (x + attention(norm_in(x))) + mlp(norm_in(x)): the MLP reads the input norm's output, no
                            norm_post (StableLM-2 12B's parallel residual) */
} model_t;

enum { QK_SHARED = 0, QK_WHOLE = 1, QK_EACH = 2 };

/* RELU2: gate_up is up alone (I wide), relu(up)^2; GELU_UNGATED: gelu(up) (erf's). SWIGLU_LIMIT (gpt-oss): g = min(gate, limit), u = clamp(up, -limit,
 * limit), (u + 1) * g * sigmoid(alpha g) */
enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_GELU = 2, ACT_RELU2 = 3, ACT_SWIGLU_LIMIT = 4, ACT_GELU_UNGATED = 5 };
#define UNGATED(act) ((act) == ACT_RELU2 || (act) == ACT_GELU_UNGATED) /* gate_up is up alone (I wide) */

typedef struct { /* scratch carved out of two arenas by medusa_native_work_init, for what it was sized for */
    int64_t rows, slots, threads; /* the most rows (batch x tokens) and cache slots a step may have; its threads */
    int64_t att_floats;           /* att_scratch's length */
    float *x, *h, *qkv, *q, *k, *v, *attn, *gu, *act, *rot, *att_scratch; /* rot: (tables, M, D) cos then sin */
    uint8_t *xq; /* (M, the widest Kpad): int8 linears' quantized rows */
    float *xs;   /* (M): their scales */
    float *bs;   /* (M, max_blocks): an nbits linear's rows' block scales */
    int32_t *bsum; /* (M, max_blocks): the sums of their quantized blocks */
    int64_t max_blocks;
    pool_t *pool; /* `threads` threads (native_pool.h); NULL: the calling thread alone */
    /* routed experts' scratch (NULL in a model without): router logits (M, E), the rows an expert takes (M, H) and
     * its outputs (M, H), the layer's sum (M, H), each row's k weights and expert ids (M, k), an expert's rows (M) and
     * their weights (M) */
    float *moe_logits, *moe_x, *moe_y, *moe_sum, *moe_w;
    int32_t *moe_ids, *moe_rows;
    float *moe_rw;
    float *par; /* (M, H): a parallel residual's attention output while its MLP runs (NULL: the model has none) */
} work_t;

#ifndef CHUNKS /* settable at build time for an A/B (scripts/build_native.py --flags=-DCHUNKS=8): no number changes */
#define CHUNKS 4 /* chunks a parallel loop is cut into per thread: late or slow threads leave theirs to the others */
#endif

static int64_t grain(int64_t tasks, const work_t *wk) {
    const int64_t g = tasks / (CHUNKS * (wk->threads > 0 ? wk->threads : 1));
    return g > 1 ? g : 1;
}

/* A step reads each weight once, from memory. Each kernel asks for the cache lines it will read AHEAD_BYTES further
 * on in its stream, so the loads of a wide tile (whose sums keep the core busy) overlap the memory's latency rather
 * than wait on it (docs/benchmarks.md, "Weights read ahead"). A hint: no number changes. */
#ifndef AHEAD_BYTES
#define AHEAD_BYTES 4096
#endif
#ifndef AHEAD_LOCALITY /* __builtin_prefetch's locality: 3 every cache level, 0 non-temporal (an A/B: docs/benchmarks.md) */
#define AHEAD_LOCALITY 3
#endif
static inline __attribute__((always_inline)) void ahead(const void *p, const int bytes) {
    for (int b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + AHEAD_BYTES + b, 0, AHEAD_LOCALITY);
}

static inline vec16 vload(const float *p) {
    vec16 x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* rows x[0..mb) (stride K) times nv vectors of a packed block (stride ws floats a k): y[i, j * VF + l] (stride N),
 * the first `valid` outputs stored. Output (i, c) is one chain of fused multiply-adds over k = 0..K-1 in one lane,
 * whatever mb, nv or the thread: the tiling only decides which chains run side by side. */
static inline __attribute__((always_inline)) void tile(const float *restrict x, int64_t K, const float *restrict w,
                                                       int64_t ws, float *restrict y, int64_t N, const int nv,
                                                       const int mb, const int valid) {
    vf acc[ROWS][PANEL];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nv; j++) acc[i][j] = vf_zero();
    for (int64_t k = 0; k < K; k++) {
        const float *wk = w + k * ws;
        ahead(wk, nv * VF * (int)sizeof(float));
        vf wv[PANEL];
        for (int j = 0; j < nv; j++) wv[j] = vf_load(wk + j * VF);
        for (int i = 0; i < mb; i++) {
            const vf xv = vf_set1(x[i * K + k]);
            for (int j = 0; j < nv; j++) acc[i][j] = vf_fma(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mb; i++) {
        if (valid == nv * VF) {
            for (int j = 0; j < nv; j++) vf_store(y + i * N + j * VF, acc[i][j]);
        } else {
            float row[PANEL * VF];
            for (int j = 0; j < nv; j++) vf_store(row + j * VF, acc[i][j]);
            memcpy(y + i * N, row, valid * sizeof(float));
        }
    }
}

#define MIN_(a, b) ((a) < (b) ? (a) : (b))
#define TILE_ROWS(NV)                                                                                                  \
    for (; M - m >= ROWS; m += ROWS) tile(x + m * K, K, w, ws, y + m * N, N, NV, ROWS, valid);                       \
    switch (M - m) {                                                                                                   \
    case 1: tile(x + m * K, K, w, ws, y + m * N, N, NV, 1, valid); break;                                              \
    case 2: tile(x + m * K, K, w, ws, y + m * N, N, NV, MIN_(2, ROWS), valid); break;                                  \
    case 3: tile(x + m * K, K, w, ws, y + m * N, N, NV, MIN_(3, ROWS), valid); break;                                  \
    case 4: tile(x + m * K, K, w, ws, y + m * N, N, NV, MIN_(4, ROWS), valid); break;                                  \
    case 5: tile(x + m * K, K, w, ws, y + m * N, N, NV, MIN_(5, ROWS), valid); break;                                  \
    case 6: tile(x + m * K, K, w, ws, y + m * N, N, NV, MIN_(6, ROWS), valid); break;                                  \
    case 7: tile(x + m * K, K, w, ws, y + m * N, N, NV, MIN_(7, ROWS), valid); break;                                  \
    }

/* every row of x times one panel of a packed block: nv vectors at w (stride ws a k), `valid` outputs at y */
static void panel_rows(const float *x, int64_t M, int64_t K, const float *w, int64_t ws, float *y, int64_t N, int nv,
                       int valid) {
    int64_t m = 0;
    if (nv == PANEL) {
        TILE_ROWS(PANEL)
    } else { /* a narrow block narrower than a panel (AVX-512: 16 outputs, one vector) */
        TILE_ROWS(MIN_(PANEL, NARROW / VF))
    }
}

typedef struct {
    const float *x, *w;
    float *y;
    int64_t M, K, N, wide;
} f32_job;

/* y (M, N) = x (M, K) @ the packed fp32 weight: wide blocks of [K][32], then narrow ones of [K][16]; a block's
 * outputs in panels of PANEL vectors. One task a block. */
static void f32_blocks(void *ctx, int64_t b0, int64_t b1, int worker) {
    (void)worker;
    const f32_job *J = ctx;
    const float *x = J->x, *w = J->w;
    float *y = J->y;
    const int64_t M = J->M, K = J->K, N = J->N, wide = J->wide;
    for (int64_t b = b0; b < b1; b++) {
        const int64_t first = b < wide ? b * BLOCK : wide * BLOCK + (b - wide) * NARROW; /* the block's first output */
        const int64_t ws = b < wide ? BLOCK : NARROW;
        const float *wb = w + (b < wide ? b * K * BLOCK : wide * K * BLOCK + (b - wide) * K * NARROW);
        const int64_t width = N - first < ws ? N - first : ws; /* outputs the block holds (the last one padded) */
        for (int64_t p = 0; p < ws; p += PANEL * VF) {
            const int cols = (int)(ws - p < PANEL * VF ? ws - p : PANEL * VF);
            const int64_t valid = width - p;
            if (valid <= 0) break;
            panel_rows(x, M, K, wb + p, ws, y + first + p, N, cols / VF, (int)(valid < cols ? valid : cols));
        }
    }
}

static void matmul_f32(const float *x, int64_t M, int64_t K, const float *w, float *y, int64_t N, const work_t *wk) {
    f32_job J = {x, w, y, M, K, N, N / BLOCK};
    const int64_t blocks = N / BLOCK + (N % BLOCK + NARROW - 1) / NARROW;
    pool_run(wk->pool, blocks, grain(blocks, wk), f32_blocks, &J);
}

typedef int32_t ivec16 __attribute__((vector_size(W * sizeof(int32_t))));
#define I8ROWS 8             /* rows an int8 tile multiplies against one block */
#define I8NV (BLOCK / W)     /* vectors of 16 int32 sums a block holds */

/* acc[i][j] += the int8 block's 4 k's of 16 outputs (vector j) times row i's 4 uint8 values there (exact integers) */
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
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

/* Off VNNI, on AVX2: the int8 sums with vpmaddwd over int16-widened values (exact: every product and pair sum fits;
 * vpmaddubsw would saturate). sums[i][0..32) of rows i < mb (1 or 2) of one block, 16 outputs at a time. Integer sums
 * are exact in any order, so these are the VNNI build's sums, bit for bit. */
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512F__))
#define I8_MADD 1
#if defined(__AVXVNNI__)
/* AVX-VNNI (the avx2_vnni set: VEX vpdpbusd on 8 lanes, Intel's client cores from Alder Lake, AMD's from Zen 5):
 * unsigned activations x signed weights, 4 products a lane into its sum, as the AVX-512 VNNI tile does 16 lanes at a
 * time; rows i < mb (1 or 2), the block's 32 outputs in 4 vectors. The same exact integers as every other build. */
static inline void sums_madd(const uint8_t *xq, int64_t kpad, const int8_t *w, int mb, int32_t (*sums)[BLOCK]) {
    __m256i acc[2][4];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_si256();
    for (int64_t k = 0; k < kpad; k += 4) {
        const int8_t *wk = w + k * BLOCK; /* 32 outputs x 4 k's: output o's at 4o */
        ahead(wk, 128);
        __m256i wv[4];
        for (int j = 0; j < 4; j++) wv[j] = _mm256_loadu_si256((const __m256i *)(wk + 32 * j)); /* outputs 8j..8j+7 */
        for (int i = 0; i < mb; i++) {
            int32_t quad;
            memcpy(&quad, xq + i * kpad + k, 4);
            const __m256i a = _mm256_set1_epi32(quad); /* the row's 4 values in every lane */
            for (int j = 0; j < 4; j++) acc[i][j] = _mm256_dpbusd_avx_epi32(acc[i][j], a, wv[j]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < 4; j++) _mm256_storeu_si256((__m256i *)(sums[i] + 8 * j), acc[i][j]);
}
#else
static inline void sums_madd(const uint8_t *xq, int64_t kpad, const int8_t *w, int mb, int32_t (*sums)[BLOCK]) {
    for (int half = 0; half < 2; half++) {
        __m256i acc[2][4];
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_si256();
        for (int64_t k = 0; k < kpad; k += 4) {
            const int8_t *wk = w + k * BLOCK + half * 64; /* 16 outputs x 4 k's */
            ahead(wk, 64);
            __m256i wv[4];
            for (int j = 0; j < 4; j++) wv[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wk + 16 * j)));
            for (int i = 0; i < mb; i++) {
                int32_t quad;
                memcpy(&quad, xq + i * kpad + k, 4);
                const __m256i a = _mm256_cvtepu8_epi16(_mm_set1_epi32(quad)); /* the row's 4 values, 4 times */
                for (int j = 0; j < 4; j++) acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(wv[j], a));
            }
        }
        for (int i = 0; i < mb; i++)
            for (int j = 0; j < 4; j++) { /* lanes: output 4j + o's two pair sums at 2o, 2o + 1 */
                int32_t lanes[8];
                _mm256_storeu_si256((__m256i *)lanes, acc[i][j]);
                for (int o = 0; o < 4; o++) sums[i][half * 16 + 4 * j + o] = lanes[2 * o] + lanes[2 * o + 1];
            }
    }
}
#endif
#else
#define I8_MADD 0
#endif

static inline __attribute__((always_inline)) void tile_i8(const uint8_t *restrict xq, int64_t kpad, const int8_t *restrict w,
                                                          ivec16 (*acc)[I8NV], const int mb) {
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < I8NV; j++) acc[i][j] = (ivec16){0};
    for (int64_t k = 0; k < kpad; k += 4) {
        const int8_t *wk = w + k * BLOCK;
        ahead(wk, I8NV * W * 4);
        for (int i = 0; i < mb; i++) {
            int32_t quad;
            memcpy(&quad, xq + i * kpad + k, 4);
            for (int j = 0; j < I8NV; j++) acc[i][j] = dot4(acc[i][j], quad, wk + j * W * 4);
        }
    }
}

typedef struct {
    const linear_t *L;
    const float *x;
    float *y;
    int64_t M;
    const work_t *wk;
    int last_first; /* the chunks' blocks taken from the last outputs back (each chunk still in order) */
} i8_job;

/* The row quantizers' pieces, a vector at a time where the set has one: the same numbers as the scalar loops after
 * them, bit for bit. The largest |x| is exact in any order, and a NaN is skipped as the scalar compare skips it (max
 * returns its second operand, the running top, when either is NaN). x / s and x * inv are IEEE operations; rounding
 * to nearest even is nearbyintf's default mode; the clamps and conversions of whole numbers are exact. */
#if defined(__AVX512F__) /* vf (native_simd.h) is __m512 */
#define QV VF
static inline vf qf_abs(vf x) { return _mm512_abs_ps(x); }
static inline float qf_max_lanes(vf x) { return _mm512_reduce_max_ps(x); }
static inline vf qf_round(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline void qf_store_u8(uint8_t *q, vf v) { _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v))); }
static inline vf qf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf qf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf qf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf qf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf qf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline int32_t qf_sum_ints(vf v) { return _mm512_reduce_add_epi32(_mm512_cvtps_epi32(v)); }
static inline int qf_any_above(vf v, vf t) { return _mm512_cmp_ps_mask(v, t, _CMP_GT_OQ) != 0; } /* NaN: not above */
#elif defined(__AVX2__) && defined(__FMA__) /* vf is __m256 */
#define QV VF
static inline vf qf_abs(vf x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
static inline float qf_max_lanes(vf x) {
    float lanes[8], top = 0.0f;
    _mm256_storeu_ps(lanes, x);
    for (int l = 0; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
    return top;
}
static inline vf qf_round(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline void qf_store_u8(uint8_t *q, vf v) {
    const __m256i i = _mm256_cvtps_epi32(v); /* whole numbers in 0..255 (or -127..127 as two's complement bytes) */
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    const __m128i lo = _mm_and_si128(w, _mm_set1_epi16(0xFF)); /* each value's low byte, as a cast keeps it */
    _mm_storel_epi64((__m128i *)q, _mm_packus_epi16(lo, lo));
}
static inline vf qf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf qf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf qf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf qf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf qf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline int32_t qf_sum_ints(vf v) {
    int32_t lanes[8], sum = 0;
    _mm256_storeu_si256((__m256i *)lanes, _mm256_cvtps_epi32(v));
    for (int l = 0; l < 8; l++) sum += lanes[l];
    return sum;
}
static inline int qf_any_above(vf v, vf t) { return _mm256_movemask_ps(_mm256_cmp_ps(v, t, _CMP_GT_OQ)) != 0; }
#else
#define QV 0
#endif

/* max |x| over r[0..n), from 0 (NaN skipped) */
static inline float abs_top(const float *r, int64_t n) {
    float top = 0.0f;
    int64_t e = 0;
#if QV
    if (n >= QV) {
        vf t = vf_set1(0.0f);
        for (; e + QV <= n; e += QV) t = qf_max(qf_abs(vf_load(r + e)), t);
        top = qf_max_lanes(t);
    }
#endif
    for (; e < n; e++) top = fabsf(r[e]) > top ? fabsf(r[e]) : top;
    return top;
}

/* QuantizeLinear of rows m0..m1: saturate(round_half_even(x / scale) + 128) */
static void i8_quantize(void *ctx, int64_t m0, int64_t m1, int worker) {
    (void)worker;
    const i8_job *J = ctx;
    const linear_t *L = J->L;
    const int64_t K = L->k, kpad = L->kpad;
    for (int64_t m = m0; m < m1; m++) {
        const float *r = J->x + m * K;
        const float top = abs_top(r, K);
        const float s = (top > L->tiny ? top : L->tiny) / L->divisor;
        uint8_t *q = J->wk->xq + m * kpad;
        int64_t e = 0;
#if QV
        const vf vs = vf_set1(s), zero = vf_set1(0.0f), full = vf_set1(255.0f), offset = vf_set1(128.0f);
        for (; e + QV <= K; e += QV) /* max(v, 0) also takes a NaN to 0 */
            qf_store_u8(q + e, qf_min(qf_max(qf_add(qf_round(qf_div(vf_load(r + e), vs)), offset), zero), full));
#endif
        for (; e < K; e++) {
            const float v = nearbyintf(r[e] / s) + 128.0f;
            q[e] = (uint8_t)(v < 0.0f ? 0.0f : v > 255.0f ? 255.0f : v);
        }
        for (int64_t e = K; e < kpad; e++) q[e] = 128;
        J->wk->xs[m] = s;
    }
}

/* One row's outputs out[0..width) from its block's integer sums: ((float)(sum - colsum) * xs) * scale, a vector of
 * W at a time, each lane the scalar expression's operations (an exact integer difference, its conversion rounded to
 * nearest, two products; -ffp-contract=off), so the same bits as the scalar loop that finishes a partial block. */
static inline void i8_epilogue(const int32_t *sums, const int32_t *colsum, const float *scale, const float xs,
                               float *out, const int64_t width) {
    int64_t e = 0;
    for (; e + W <= width; e += W) {
        ivec16 s, c;
        vec16 f;
        memcpy(&s, sums + e, sizeof s);
        memcpy(&c, colsum + e, sizeof c);
        memcpy(&f, scale + e, sizeof f);
        const vec16 v = (__builtin_convertvector(s - c, vec16) * xs) * f;
        memcpy(out + e, &v, sizeof v);
    }
    for (; e < width; e++) out[e] = ((float)(sums[e] - colsum[e]) * xs) * scale[e];
}

/* y = ((float)(sum_k q[m, k] w[k, n] - 128 sum_k w[k, n]) * row scale) * column scale over blocks b0..b1 */
static void i8_blocks(void *ctx, int64_t b0, int64_t b1, int worker) {
    (void)worker;
    const i8_job *J = ctx;
    const linear_t *L = J->L;
    const work_t *wk = J->wk;
    const int64_t N = L->n, kpad = L->kpad, M = J->M;
    float *y = J->y;
    const int8_t *w = (const int8_t *)L->w;
    if (J->last_first) { /* chunk [b0, b1) of the tasks is blocks [blocks - b1, blocks - b0) */
        const int64_t blocks = (N + BLOCK - 1) / BLOCK, end = blocks - b0;
        b0 = blocks - b1, b1 = end;
    }
    for (int64_t b = b0; b < b1; b++) {
        const int64_t first = b * BLOCK, width = N - first < BLOCK ? N - first : BLOCK;
        const int8_t *wb = w + b * kpad * BLOCK;
        const int32_t *colsum = L->colsum + first;
        const float *scale = L->scale + first;
        for (int64_t m = 0; m < M; m += I8ROWS) {
            const int mb = M - m < I8ROWS ? (int)(M - m) : I8ROWS;
            int32_t sums[I8ROWS][BLOCK];
#if I8_MADD
            for (int i = 0; i < mb; i += 2) sums_madd(wk->xq + (m + i) * kpad, kpad, wb, mb - i < 2 ? 1 : 2, sums + i);
#else
            ivec16 acc[I8ROWS][I8NV];
            switch (mb) {
            case 1: tile_i8(wk->xq + m * kpad, kpad, wb, acc, 1); break;
            case 2: tile_i8(wk->xq + m * kpad, kpad, wb, acc, 2); break;
            case 3: tile_i8(wk->xq + m * kpad, kpad, wb, acc, 3); break;
            case 4: tile_i8(wk->xq + m * kpad, kpad, wb, acc, 4); break;
            case 5: tile_i8(wk->xq + m * kpad, kpad, wb, acc, 5); break;
            case 6: tile_i8(wk->xq + m * kpad, kpad, wb, acc, 6); break;
            case 7: tile_i8(wk->xq + m * kpad, kpad, wb, acc, 7); break;
            default: tile_i8(wk->xq + m * kpad, kpad, wb, acc, I8ROWS); break;
            }
            for (int i = 0; i < mb; i++) memcpy(sums[i], acc[i], sizeof sums[i]);
#endif
            for (int i = 0; i < mb; i++) i8_epilogue(sums[i], colsum, scale, wk->xs[m + i], y + (m + i) * N + first, width);
        }
    }
}

/* The rows' quantizer as one chunk on the calling thread where the rows are few: a row of a few thousand values
 * quantizes in well under a microsecond, less than waking the pool and waiting for its last chunk costs. */
#define QUANTIZE_ALONE 16384 /* values (rows x K) at most */
static int64_t quantize_grain(int64_t M, int64_t K) { return M * K <= QUANTIZE_ALONE ? M : 1; }

static void matmul_i8(const linear_t *L, const float *x, int64_t M, float *y, const work_t *wk, int last_first) {
    i8_job J = {L, x, y, M, wk, last_first};
    pool_run(wk->pool, M, quantize_grain(M, L->k), i8_quantize, &J);
    const int64_t blocks = (L->n + BLOCK - 1) / BLOCK;
    pool_run(wk->pool, blocks, grain(blocks, wk), i8_blocks, &J);
}

/* ---- MatMulNBits' blocks (int4 and int8-block engines, accuracy level 4): each row quantized a block of K at a time
 * to int8 (scale max |x| / 127, round half to even), each block's integer sums exact, then per output the blocks in
 * order: y += (float)(sum_k q_k w_k - zero * sum_k q_k) * (row's block scale * weight's block scale), one FMA each.
 * A row's outputs depend on its own values alone, in the same order whatever the tile, thread or instruction set.
 * Packed: groups of 32 outputs, each (blocks, block / 4 quads, 32 outputs x 4 k's); 4-bit: a quad's 128 values in
 * 64 bytes, outputs 0-15 in the low nibbles and 16-31 in the high ones; 8-bit: 128 bytes, outputs 0-15 then 16-31. */

#define NBROWS 8 /* rows an nbits tile multiplies against one group (each quad's weights unpacked once for all) */

typedef struct { /* one group of 32 outputs of an nbits linear, where its bytes lie */
    int64_t blocks, quads, kpad;
    int four, qbytes;      /* 4-bit (64 bytes a quad) or 8-bit (128) */
    int narrow;            /* block <= 256: a block's row sum (at most 127 x block) fits int16 */
    const uint8_t *w, *wz; /* the group's packed quads; its (blocks, 32) zero points */
    const float *ws;       /* its (blocks, 32) scales */
} nb_group;

static inline nb_group nb_at(const linear_t *L, int64_t g) {
    nb_group G = {L->blocks, L->block / 4, L->kpad, L->kind == LIN_NBITS4, 0, L->block <= 256, NULL, NULL, NULL};
    G.qbytes = G.four ? 64 : 128;
    G.w = (const uint8_t *)L->w + g * G.blocks * G.quads * G.qbytes;
    G.wz = (const uint8_t *)L->colsum + g * G.blocks * BLOCK;
    G.ws = L->scale + g * G.blocks * BLOCK;
    return G;
}

/* one output's block added to its float sum: (float)(sum - zero x row sum) x (row scale x weight scale), one FMA */
static inline float nb_add(float f, int32_t sum, const nb_group *G, const work_t *wk, int64_t row, int64_t b, int o) {
    return fmaf((float)(sum - G->wz[b * BLOCK + o] * wk->bsum[row]), wk->bs[row] * G->ws[b * BLOCK + o], f);
}

static void nb_quantize(void *ctx, int64_t m0, int64_t m1, int worker) {
    (void)worker;
    const i8_job *J = ctx;
    const linear_t *L = J->L;
    const work_t *wk = J->wk;
    const int64_t K = L->k, kpad = L->kpad, block = L->block, blocks = L->blocks;
    for (int64_t m = m0; m < m1; m++) {
        const float *r = J->x + m * K;
        int8_t *q = (int8_t *)wk->xq + m * kpad;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t k0 = b * block, k1 = k0 + block < K ? k0 + block : K;
            const float top = abs_top(r + k0, k1 - k0);
            const float inv = top != 0.0f ? 127.0f / top : 0.0f;
            int32_t sum = 0;
            int64_t e = k0;
#if QV
            const vf vinv = vf_set1(inv), lo = vf_set1(-127.0f), hi = vf_set1(127.0f);
            for (; e + QV <= k1; e += QV) {
                const vf v = qf_min(qf_max(qf_round(qf_mul(vf_load(r + e), vinv)), lo), hi);
                qf_store_u8((uint8_t *)q + e, v);
                sum += qf_sum_ints(v);
            }
#endif
            for (; e < k1; e++) {
                float v = nearbyintf(r[e] * inv);
                v = v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v;
                q[e] = (int8_t)v;
                sum += (int32_t)v;
            }
            for (int64_t e = k1; e < k0 + block; e++) q[e] = 0;
            wk->bs[m * wk->max_blocks + b] = top / 127.0f;
            wk->bsum[m * wk->max_blocks + b] = sum;
        }
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
/* rows i < mb of one group of 32 outputs: out[i][0..32). Up to 8 rows' integer sums in registers (16 of the 32), each
 * quad's weights loaded and unpacked once for all of them; the float sums in out, one FMA a block (nb_add's order).
 * zero x row sum: one vpmaddwd where a block's row sum fits int16 (|sum| <= 127 x block, block <= 256; the zero point's
 * high half is 0), else vpmulld: the same integer either way. */
static inline __attribute__((always_inline)) void tile_nb_of(const linear_t *L, const work_t *wk, int64_t m, int64_t g,
                                                             const int mb, const int four, float (*out)[BLOCK]) {
    const nb_group G = nb_at(L, g);
    const int64_t blocks = G.blocks, quads = G.quads, kpad = G.kpad;
    const int qbytes = four ? 64 : 128, narrow = G.narrow;
    const uint8_t *w = G.w, *wz = G.wz;
    const float *ws = G.ws;
    const int8_t *xq = (const int8_t *)wk->xq + m * kpad;
    for (int i = 0; i < mb; i++) _mm512_storeu_ps(out[i], _mm512_setzero_ps()), _mm512_storeu_ps(out[i] + 16, _mm512_setzero_ps());
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; b++) {
        /* the rows' sums as named variables, not an array: GCC then keeps each in one register across the quads */
        __m512i a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7;
        a0 = b0 = a1 = b1 = a2 = b2 = a3 = b3 = a4 = b4 = a5 = b5 = a6 = b6 = a7 = b7 = _mm512_setzero_si512();
        const int8_t *xb = xq + b * L->block;
        for (int64_t q = 0; q < quads; q++, w += qbytes) {
            ahead(w, qbytes);
            __m512i w0, w1;
            if (four) {
                const __m512i v = _mm512_loadu_si512(w);
                w0 = _mm512_and_si512(v, low);
                w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            } else {
                w0 = _mm512_loadu_si512(w);
                w1 = _mm512_loadu_si512(w + 64);
            }
#define NB_ROW(i, A, B)                                                                                                    \
    if (i < mb) { /* row i's 4 values against the quad's 32 outputs: unsigned weights x signed activations */              \
        int32_t quad;                                                                                                      \
        memcpy(&quad, xb + i * kpad + q * 4, 4);                                                                           \
        const __m512i x = _mm512_set1_epi32(quad);                                                                         \
        A = _mm512_dpbusd_epi32(A, w0, x);                                                                                 \
        B = _mm512_dpbusd_epi32(B, w1, x);                                                                                 \
    }
            NB_ROW(0, a0, b0) NB_ROW(1, a1, b1) NB_ROW(2, a2, b2) NB_ROW(3, a3, b3)
            NB_ROW(4, a4, b4) NB_ROW(5, a5, b5) NB_ROW(6, a6, b6) NB_ROW(7, a7, b7)
#undef NB_ROW
        }
        _Static_assert(NBROWS == 8, "tile_nb names 8 rows' sums");
        const __m512i s[NBROWS][2] = {{a0, b0}, {a1, b1}, {a2, b2}, {a3, b3}, {a4, b4}, {a5, b5}, {a6, b6}, {a7, b7}};
        for (int j = 0; j < 2; j++) {
            const __m512 scale = _mm512_loadu_ps(ws + b * BLOCK + 16 * j);
            const __m512i zero = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wz + b * BLOCK + 16 * j)));
            for (int i = 0; i < mb; i++) {
                const int64_t at = (m + i) * wk->max_blocks + b;
                const __m512i rs = _mm512_set1_epi32(wk->bsum[at]);
                const __m512i shift = narrow ? _mm512_madd_epi16(zero, rs) : _mm512_mullo_epi32(zero, rs);
                const __m512 both = _mm512_mul_ps(_mm512_set1_ps(wk->bs[at]), scale);
                const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(s[i][j], shift));
                _mm512_storeu_ps(out[i] + 16 * j, _mm512_fmadd_ps(f, both, _mm512_loadu_ps(out[i] + 16 * j)));
            }
        }
    }
}

/* the tile for 4-bit or 8-bit weights, each its own code (the width a compile-time constant in its loops) */
static inline __attribute__((always_inline)) void tile_nb(const linear_t *L, const work_t *wk, int64_t m, int64_t g,
                                                          const int mb, float (*out)[BLOCK]) {
    if (L->kind == LIN_NBITS4)
        tile_nb_of(L, wk, m, g, mb, 1, out);
    else
        tile_nb_of(L, wk, m, g, mb, 0, out);
}
#elif I8_MADD
/* AVX2: the epilogue of half a group (16 outputs, acc[i][e]: outputs half * 16 + 8e .. + 8, one a lane) of rows
 * m..m + R of block b, added to their float sums in out: (float)(sum - zero x row sum) x (row scale x weight scale), one
 * FMA (nb_add's arithmetic, 8 outputs a vector; zero x row sum one vpmaddwd where it fits int16, as tile_nb above), the
 * block's zero points and scales loaded once for all rows */
static inline __attribute__((always_inline)) void nb_epilogue_rows_avx2(const nb_group *G, const work_t *wk, int64_t m,
                                                                        int64_t b, int half, const int R,
                                                                        __m256i (*acc)[2], float (*out)[BLOCK]) {
    __m256i zero[2];
    __m256 scale[2];
    for (int e = 0; e < 2; e++) {
        const int o = half * 16 + 8 * e;
        zero[e] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(G->wz + b * BLOCK + o)));
        scale[e] = _mm256_loadu_ps(G->ws + b * BLOCK + o);
    }
    for (int i = 0; i < R; i++) {
        const int64_t at = (m + i) * wk->max_blocks + b;
        const __m256i rs = _mm256_set1_epi32(wk->bsum[at]);
        const __m256 xs = _mm256_set1_ps(wk->bs[at]);
        for (int e = 0; e < 2; e++) {
            const __m256i shift = G->narrow ? _mm256_madd_epi16(zero[e], rs) : _mm256_mullo_epi32(zero[e], rs);
            float *y = out[i] + half * 16 + 8 * e;
            const __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[i][e], shift));
            _mm256_storeu_ps(y, _mm256_fmadd_ps(f, _mm256_mul_ps(xs, scale[e]), _mm256_loadu_ps(y)));
        }
    }
}

/* AVX2: each block's integer sums with vpmaddwd over int16-widened values (exact, as sums_madd), 16 outputs (one half
 * of the group) for R rows at a time, each weight vector widened once for all R; the pair sums added (exact integers),
 * then the float epilogue 8 outputs a vector, (float)(sum - zero x row sum) x (row scale x weight scale) in one FMA:
 * the same bits as every other build. */
static inline __attribute__((always_inline)) void nb_rows_avx2(const nb_group *G, const linear_t *L, const work_t *wk,
                                                               int64_t m, const int R, float (*out)[BLOCK]) {
    const int64_t blocks = G->blocks, quads = G->quads, kpad = G->kpad;
    const int four = G->four, qbytes = G->qbytes;
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; b++) {
        for (int half = 0; half < 2; half++) {
            __m256i acc[3][4];
            for (int i = 0; i < R; i++)
                for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_si256();
            for (int64_t q = 0; q < quads; q++) {
                const uint8_t *w = G->w + (b * quads + q) * qbytes + (four ? 0 : half * 64);
                ahead(w, 64);
                __m256i x[3];
                for (int i = 0; i < R; i++) { /* row m + i's 4 values, 4 times */
                    int32_t quad;
                    memcpy(&quad, (const int8_t *)wk->xq + (m + i) * kpad + b * L->block + q * 4, 4);
                    x[i] = _mm256_cvtepi8_epi16(_mm_set1_epi32(quad));
                }
                for (int j = 0; j < 4; j++) { /* outputs 4j..4j+3 of this half, 4 k's each */
                    __m128i v = _mm_loadu_si128((const __m128i *)(w + 16 * j));
                    if (four) v = half ? _mm_and_si128(_mm_srli_epi16(v, 4), low) : _mm_and_si128(v, low);
                    const __m256i wide = _mm256_cvtepu8_epi16(v);
                    for (int i = 0; i < R; i++) acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(wide, x[i]));
                }
            }
            __m256i sums[3][2]; /* lanes 2o, 2o + 1 of acc[j]: output 4j + o; hadd then 64-bit lanes in order */
            for (int i = 0; i < R; i++)
                for (int e = 0; e < 2; e++) /* outputs half * 16 + 8e .. + 8 */
                    sums[i][e] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[i][2 * e], acc[i][2 * e + 1]), 0xD8);
            nb_epilogue_rows_avx2(G, wk, m, b, half, R, sums, out);
        }
    }
}

/* One quad's exact integer sums into acc, 8 outputs a lane each: unsigned weights x signed activations, 4 products a
 * lane. AVX-VNNI: one vpdpbusd (4- and 8-bit weights). AVX2: vpmaddubsw (pairs to int16: at most 2 x 15 x 127 for 4-bit
 * weights, no saturation; 8-bit weights would saturate and take nb_rows_avx2) then vpmaddwd by ones, added. */
static inline __m256i nb_dot_avx2(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

/* AVX2 and AVX-VNNI: each block's integer sums with nb_dot_avx2, 8 outputs a vector with no widening, R rows at a time,
 * half a group (16 outputs, one a lane) a pass; the same exact integer sums, the same float epilogue. 4-bit weights:
 * the low nibbles, then the high ones; 8-bit (AVX-VNNI only): bytes 0-63 of each quad, then 64-127. */
static inline __attribute__((always_inline)) void nb_dot_rows(const nb_group *G, const linear_t *L, const work_t *wk,
                                                              int64_t m, const int R, const int four, float (*out)[BLOCK]) {
    const int64_t blocks = G->blocks, quads = G->quads, kpad = G->kpad;
    const int qbytes = four ? 64 : 128; /* four: a compile-time constant in each inlined copy */
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; b++) {
        for (int half = 0; half < 2; half++) {
            __m256i acc[4][2];
            for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
            for (int64_t q = 0; q < quads; q++) {
                const uint8_t *w = G->w + (b * quads + q) * qbytes + (four ? 0 : half * 64); /* 16 outputs x 4 k's */
                ahead(w, 64);
                __m256i v0 = _mm256_loadu_si256((const __m256i *)w), v1 = _mm256_loadu_si256((const __m256i *)(w + 32));
                if (four) {
                    if (half) v0 = _mm256_srli_epi16(v0, 4), v1 = _mm256_srli_epi16(v1, 4);
                    v0 = _mm256_and_si256(v0, low), v1 = _mm256_and_si256(v1, low);
                }
                for (int i = 0; i < R; i++) {
                    int32_t quad;
                    memcpy(&quad, (const int8_t *)wk->xq + (m + i) * kpad + b * L->block + q * 4, 4);
                    const __m256i x = _mm256_set1_epi32(quad);
                    acc[i][0] = nb_dot_avx2(acc[i][0], v0, x);
                    acc[i][1] = nb_dot_avx2(acc[i][1], v1, x);
                }
            }
            nb_epilogue_rows_avx2(G, wk, m, b, half, R, acc, out); /* outputs half * 16 + 8e .. + 8, one a lane */
        }
    }
}

static inline void tile_nb(const linear_t *L, const work_t *wk, int64_t m, int64_t g, const int mb, float (*out)[BLOCK]) {
    const nb_group G = nb_at(L, g);
    memset(out, 0, sizeof(float) * BLOCK * (size_t)mb);
    int i = 0;
#define NB_DOT(four)                                                                                                       \
    do { /* four: a constant in each inlined copy */                                                                     \
        for (; i + 4 <= mb; i += 4) nb_dot_rows(&G, L, wk, m + i, 4, four, out + i);                                      \
        if (mb - i == 3) nb_dot_rows(&G, L, wk, m + i, 3, four, out + i);                                                  \
        if (mb - i == 2) nb_dot_rows(&G, L, wk, m + i, 2, four, out + i);                                                  \
        if (mb - i == 1) nb_dot_rows(&G, L, wk, m + i, 1, four, out + i);                                                  \
    } while (0)
    if (G.four) {
        NB_DOT(1);
        return;
    }
#if defined(__AVXVNNI__)
    NB_DOT(0); /* 8-bit weights: vpdpbusd takes them as they are */
#else
    for (; i + 3 <= mb; i += 3) nb_rows_avx2(&G, L, wk, m + i, 3, out + i); /* 8-bit weights widened to int16 */
    if (mb - i == 2) nb_rows_avx2(&G, L, wk, m + i, 2, out + i);
    if (mb - i == 1) nb_rows_avx2(&G, L, wk, m + i, 1, out + i);
#endif
#undef NB_DOT
}
#else
static inline void tile_nb(const linear_t *L, const work_t *wk, int64_t m, int64_t g, const int mb, float (*out)[BLOCK]) {
    const nb_group G = nb_at(L, g);
    const int64_t blocks = G.blocks, quads = G.quads, kpad = G.kpad;
    const int four = G.four, qbytes = G.qbytes;
    const uint8_t *wg = G.w;
    for (int i = 0; i < mb; i++) {
        const int8_t *xq = (const int8_t *)wk->xq + (m + i) * kpad;
        for (int o = 0; o < BLOCK; o++) {
            const int half = o / 16, lane = o % 16;
            float f = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                int32_t s = 0;
                for (int64_t q = 0; q < quads; q++) {
                    const uint8_t *w = wg + (b * quads + q) * qbytes;
                    for (int r = 0; r < 4; r++) {
                        const int at = lane * 4 + r;
                        const int v = four ? (half ? w[at] >> 4 : w[at] & 0x0F) : w[half * 64 + at];
                        s += v * xq[b * L->block + q * 4 + r];
                    }
                }
                f = nb_add(f, s, &G, wk, (m + i) * wk->max_blocks + b, b, o);
            }
            out[i][o] = f;
        }
    }
}
#endif

static void nb_groups(void *ctx, int64_t g0, int64_t g1, int worker) {
    (void)worker;
    const i8_job *J = ctx;
    const linear_t *L = J->L;
    const int64_t N = L->n, M = J->M;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t first = g * BLOCK, width = N - first < BLOCK ? N - first : BLOCK;
        for (int64_t m = 0; m < M; m += NBROWS) {
            float out[NBROWS][BLOCK];
            const int mb = M - m < NBROWS ? (int)(M - m) : NBROWS;
            switch (mb) { /* each height its own unrolled tile */
            case 1: tile_nb(L, J->wk, m, g, 1, out); break;
            case 2: tile_nb(L, J->wk, m, g, 2, out); break;
            case 3: tile_nb(L, J->wk, m, g, 3, out); break;
            case 4: tile_nb(L, J->wk, m, g, 4, out); break;
            case 5: tile_nb(L, J->wk, m, g, 5, out); break;
            case 6: tile_nb(L, J->wk, m, g, 6, out); break;
            case 7: tile_nb(L, J->wk, m, g, 7, out); break;
            default: tile_nb(L, J->wk, m, g, NBROWS, out); break;
            }
            for (int i = 0; i < mb; i++) memcpy(J->y + (m + i) * N + first, out[i], width * sizeof(float));
        }
    }
}

static void matmul_nb(const linear_t *L, const float *x, int64_t M, float *y, const work_t *wk) {
    i8_job J = {L, x, y, M, wk};
    pool_run(wk->pool, M, quantize_grain(M, L->k), nb_quantize, &J);
    const int64_t groups = (L->n + BLOCK - 1) / BLOCK;
    pool_run(wk->pool, groups, grain(groups, wk), nb_groups, &J);
}

static void matmul_order(const linear_t *L, const float *x, int64_t M, float *y, const work_t *wk, int last_first) {
    if (L->kind == LIN_INT8)
        matmul_i8(L, x, M, y, wk, last_first);
    else if (L->kind == LIN_NBITS4 || L->kind == LIN_NBITS8)
        matmul_nb(L, x, M, y, wk);
    else
        matmul_f32(x, M, L->k, (const float *)L->w, y, L->n, wk);
}

static void matmul(const linear_t *L, const float *x, int64_t M, float *y, const work_t *wk) { matmul_order(L, x, M, y, wk, 0); }

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

/* a layer norm of each row: (x - mean) / sqrt(variance + eps) x weight (+ bias), the sums in index order */
static void layer_norm(const float *x, int64_t M, int64_t H, const float *weight, const float *bias, float eps, float *y) {
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * H;
        float s = 0.0f, v = 0.0f;
        for (int64_t d = 0; d < H; d++) s += r[d];
        const float mean = s / (float)H;
        for (int64_t d = 0; d < H; d++) v += (r[d] - mean) * (r[d] - mean);
        const float inv = 1.0f / sqrtf(v / (float)H + eps);
        for (int64_t d = 0; d < H; d++) y[m * H + d] = (r[d] - mean) * inv * weight[d] + (bias ? bias[d] : 0.0f);
    }
}

/* the residual stream's norm (input, post-attention, final): RMS or layer norm, as the model's */
static void norm_rows(const model_t *md, const float *x, int64_t M, const float *weight, const float *bias, float *y) {
    if (md->layer_norm)
        layer_norm(x, M, md->hidden, weight, bias, md->eps, y);
    else
        rms_norm(x, M, md->hidden, weight, md->eps, y);
}

/* the q or k heads of one row, r (heads D), normed in place as qk_norm_span says */
static void qk_norm(const model_t *md, float *r, int64_t heads, const float *weight) {
    const int64_t D = md->head_dim, n = md->qk_norm_span == QK_WHOLE ? heads * D : D;
    for (int64_t h = 0; h < (md->qk_norm_span == QK_WHOLE ? 1 : heads); h++) {
        const float *w = weight + (md->qk_norm_span == QK_EACH ? h * D : 0);
        if (md->qk_layer_norm)
            layer_norm(r + h * n, 1, n, w, NULL, md->qk_eps, r + h * n);
        else
            rms_norm(r + h * n, 1, n, w, md->qk_eps, r + h * n);
    }
}

/* the cos and sin of position pos times each frequency: rot = (cos[D / 2], sin[D / 2]) (D: the rotary dims) */
static void rope_table(int D, int64_t pos, const float *inv_freq, float factor, float *rot) {
    const int half = D / 2;
    for (int i = 0; i < half; i++) {
        const float f = (float)pos * inv_freq[i];
        rot[i] = cosf(f) * factor; /* x 1: exact */
        rot[half + i] = sinf(f) * factor;
    }
}

/* rotate_half rotary embedding of one head vector (D) with its row's table, into out: its leading R dims turned, the
 * rest copied (partial rotary; R = D: all). interleaved: pairs (2i, 2i + 1) turned by angle i (Helium's
 * rotate_every_two, whose x * cos + (-x') * sin is this x * cos - x' * sin bit for bit) */
static void rope(const float *x, int D, int R, const float *rot, int interleaved, float *out) {
    const int half = R / 2;
    const float *c = rot, *s = rot + half;
    if (interleaved)
        for (int i = 0; i < half; i++) {
            out[2 * i] = x[2 * i] * c[i] - x[2 * i + 1] * s[i];
            out[2 * i + 1] = x[2 * i + 1] * c[i] + x[2 * i] * s[i];
        }
    else
        for (int i = 0; i < half; i++) {
            out[i] = x[i] * c[i] - x[i + half] * s[i];
            out[i + half] = x[i + half] * c[i] + x[i] * s[i];
        }
    for (int i = R; i < D; i++) out[i] = x[i];
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

static inline vec16 silu16(vec16 gv, vec16 uv) { return gv * (1.0f / (1.0f + exp16(-gv))) * uv; }

/* a = gate * sigmoid(gate) * up over one row of I; the tail (I % 16) padded through the same vector code */
static void silu_row(const float *g, const float *u, float *a, int64_t I) {
    int64_t e = 0;
    for (; e + W <= I; e += W) { /* whole vectors: fixed-size copies, which compile to plain loads and stores */
        vec16 gv, uv;
        memcpy(&gv, g + e, sizeof gv);
        memcpy(&uv, u + e, sizeof uv);
        const vec16 out = silu16(gv, uv);
        memcpy(a + e, &out, sizeof out);
    }
    if (e < I) {
        vec16 gv = {0}, uv = {0};
        const int64_t n = I - e;
        memcpy(&gv, g + e, n * sizeof(float));
        memcpy(&uv, u + e, n * sizeof(float));
        const vec16 out = silu16(gv, uv);
        memcpy(a + e, &out, n * sizeof(float));
    }
}

/* gpt-oss's clamped SwiGLU over one row of I (as the graph's Clip, Mul, Sigmoid, Mul, Add, Mul) */
static void swiglu_limit_row(const float *g, const float *u, float *a, int64_t I, float alpha, float limit) {
    for (int64_t e = 0; e < I; e++) {
        const float gc = g[e] < limit ? g[e] : limit;
        const float uc = u[e] < -limit ? -limit : u[e] > limit ? limit : u[e];
        a[e] = (uc + 1.0f) * (gc * (1.0f / (1.0f + expf(-(gc * alpha)))));
    }
}

/* y[m] += bias over M rows of N (a linear's bias, after its matmul) */
static void add_bias_rows(float *y, int64_t M, int64_t N, const float *bias) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) y[m * N + n] += bias[n];
}

/* x += h * scale, as the graph's Mul then Add (-ffp-contract=off: never fused into one FMA); scale 1: x += h */
static void add_scaled_rows(float *x, const float *h, int64_t n, float scale) {
    for (int64_t e = 0; e < n; e++) x[e] += h[e] * scale;
}

/* a = gelu(gate) * up over one row of I, one element at a time (ONNX Gelu: tanh's approximation, or erf's exact) */
static void gelu_row(const float *g, const float *u, float *a, int64_t I, int tanh_form) {
    for (int64_t e = 0; e < I; e++) {
        const float x = g[e];
        const float inner = tanh_form ? tanhf(0.7978845608f * (x + 0.044715f * x * x * x)) : erff(x * 0.70710678f);
        a[e] = 0.5f * x * (1.0f + inner) * u[e];
    }
}

/* best first; a tie keeps the lower index first (ONNX ArgMax / TopK) */
static void top_k(const float *row, int64_t V, int k, int64_t *ids) {
    float best[MAX_TOPK];
    int64_t idx[MAX_TOPK];
    int n = 0;
    for (int64_t j = 0; j < V; j++) {
#if QV /* a whole vector none of whose values passes the test below: skipped at once (the same ids, in order) */
        while (n == k && j % QV == 0 && j + QV <= V && !qf_any_above(vf_load(row + j), vf_set1(best[k - 1]))) j += QV;
        if (j >= V) break;
#endif
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

/* ---- the exported functions (runtime/native_step.py): every size a pointer is read or written with is checked here
 * against what the buffers were sized for; a bad size is an error code, never a read or a write ---- */

#define ABI 18 /* runtime/native_step.py's ABI: bumped whenever a struct or a signature below changes */

int medusa_native_abi(void) { return ABI; }

int medusa_native_isa(void) { return MEDUSA_ISA; }

#ifndef MEDUSA_SOURCE
#define MEDUSA_SOURCE ""
#endif
const char *medusa_native_source(void) { return MEDUSA_SOURCE; } /* native_isa.source_hash of what this was built from */

/* The instruction sets this CPU and its operating system run, as bits of runtime/native_isa.py's ISAS indices
 * (0 avx512_vnni, 1 avx512, 2 avx2, 3 baseline, 4 neon). */
int medusa_native_cpu(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    const int v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512cd");
    const int v3_vnni = v3 && __builtin_cpu_supports("avxvnni");
    return (v4 && __builtin_cpu_supports("avx512vnni")) << 0 | v4 << 1 | v3_vnni << 2 | v3 << 3 | 1 << 4;
#elif defined(__aarch64__)
    return 1 << 5;
#else
    return 0;
#endif
}

/* The CPUs this process may run on (its affinity mask; runtime/native_step.py caps it by a container's CPU quota) */
int medusa_native_default_threads(void) {
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    return online > 0 ? (int)online : 1;
}

static int linear_ok(const linear_t *L, int64_t k, int64_t n) {
    if (L == NULL || L->w == NULL || L->k != k || L->n != n || k <= 0 || n <= 0) return 0;
    if (L->kind == LIN_F32) return L->kpad == k;
    if (L->kind == LIN_NBITS4 || L->kind == LIN_NBITS8)
        return L->block >= 16 && L->block % 16 == 0 && L->blocks == (k + L->block - 1) / L->block &&
               L->kpad == (int64_t)L->blocks * L->block && L->scale != NULL && L->colsum != NULL;
    if (L->kind != LIN_INT8) return 0;
    return L->kpad == (k + 3) / 4 * 4 && L->scale != NULL && L->colsum != NULL && L->tiny > 0.0f && L->divisor > 0.0f;
}

static int experts_ok(const experts_t *ex, int64_t H) {
    const int64_t E = ex->experts, I = ex->inter, S = ex->shared_inter;
    if (E <= 0 || E > MAX_EXPERTS || ex->top_k <= 0 || ex->top_k > E || I <= 0 || !linear_ok(ex->router, H, E)) return 0;
    if (!ex->gate_up || !ex->down) return 0;
    for (int64_t e = 0; e < E; e++)
        if (!linear_ok(ex->gate_up[e], H, 2 * I) || !linear_ok(ex->down[e], I, H)) return 0;
    if (!ex->shared_gate_up && !ex->shared_down && !ex->shared_gate) return S == 0;
    return S > 0 && linear_ok(ex->shared_gate_up, H, 2 * S) && linear_ok(ex->shared_down, S, H) &&
           linear_ok(ex->shared_gate, H, 1);
}

/* 0 where every linear's K and N fit the dims and every pointer is set */
int medusa_native_check_model(const model_t *md) {
    const int64_t L = md->layers, H = md->hidden, Hq = md->heads, Hkv = md->kv_heads, D = md->head_dim;
    const int64_t I = md->inter, V = md->vocab;
    if (L <= 0 || H <= 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv != 0 || D <= 0 || D % 2 != 0 || I <= 0 || V <= 0)
        return BAD_MODEL;
    if (!(md->eps > 0.0f) || !(md->scale > 0.0f) || !isfinite(md->eps) || !isfinite(md->scale)) return BAD_MODEL;
    if (!md->inv_freq || !md->embed || !md->norm_final || !md->norm_in || !md->norm_post) return BAD_MODEL; /* entries may be NULL */
    if (!md->qkv || !md->o || !md->gate_up || !md->down || !linear_ok(md->lm_head, H, V)) return BAD_MODEL;
    if (!md->qkv_bias || !md->q_norm || !md->k_norm || !md->window || !md->rope_of) return BAD_MODEL;
    if (!md->attn_out_norm || !md->mlp_out_norm || md->act < ACT_SILU || md->act > ACT_GELU_UNGATED || !md->experts) return BAD_MODEL;
    if (!md->o_bias || !md->sinks || !isfinite(md->rope_factor) || !isfinite(md->act_alpha) || !(md->act_limit > 0.0f))
        return BAD_MODEL;
    if (!md->gate_up_bias || !md->down_bias || md->qk_norm_span < QK_SHARED || md->qk_norm_span > QK_EACH) return BAD_MODEL;
    if (md->rope_tables <= 0 || !isfinite(md->embed_scale) || !isfinite(md->residual_scale)) return BAD_MODEL;
    if (!isfinite(md->logit_divisor) || md->logit_divisor == 0.0f) return BAD_MODEL;
    if (md->rotary_dim <= 0 || md->rotary_dim > D || md->rotary_dim % 2 || !md->norm_in_bias || !md->norm_post_bias)
        return BAD_MODEL;
    if (!(md->attn_softcap >= 0.0f) || !isfinite(md->attn_softcap) || !(md->final_softcap >= 0.0f) || !isfinite(md->final_softcap))
        return BAD_MODEL;
    for (int64_t l = 0; l < L; l++) {
        if (!linear_ok(md->qkv[l], H, (Hq + 2 * Hkv) * D) || !linear_ok(md->o[l], Hq * D, H)) return BAD_MODEL;
        if (md->experts[l] ? !experts_ok(md->experts[l], H) || md->gate_up[l] || md->down[l] || UNGATED(md->act)
                           : !linear_ok(md->gate_up[l], H, (UNGATED(md->act) ? 1 : 2) * I) || !linear_ok(md->down[l], I, H))
            return BAD_MODEL;
        if (md->window[l] < 0 || md->rope_of[l] < 0 || md->rope_of[l] >= md->rope_tables) return BAD_MODEL;
        if ((md->q_norm[l] || md->k_norm[l]) && !(md->qk_eps > 0.0f && isfinite(md->qk_eps))) return BAD_MODEL;
        if (md->shared_norm && (!md->norm_in[l] || md->norm_post[l] || md->parallel_residual)) return BAD_MODEL;
    }
    return OK;
}

typedef struct { /* the widest of a checked model's linears and MLPs */
    int64_t kpad, blocks; /* the linears' padded K, and their nbits blocks along K (0: none) */
    int64_t inter;        /* the MLPs' width: dense, routed or shared experts' */
    int64_t experts, k;   /* the routed experts a layer and a row (0: no layer has any) */
} widest_t;

static void widen(widest_t *w, const linear_t *L) {
    if (!L) return;
    w->kpad = L->kpad > w->kpad ? L->kpad : w->kpad;
    w->blocks = L->blocks > w->blocks ? L->blocks : w->blocks;
}

static widest_t widest(const model_t *md) {
    widest_t w = {.inter = md->inter};
    widen(&w, md->lm_head);
    for (int64_t l = 0; l < md->layers; l++) {
        widen(&w, md->qkv[l]), widen(&w, md->o[l]), widen(&w, md->gate_up[l]), widen(&w, md->down[l]);
        const experts_t *ex = md->experts[l];
        if (!ex) continue;
        widen(&w, ex->router), widen(&w, ex->shared_gate_up), widen(&w, ex->shared_down), widen(&w, ex->shared_gate);
        for (int64_t e = 0; e < ex->experts; e++) widen(&w, ex->gate_up[e]), widen(&w, ex->down[e]);
        w.inter = ex->inter > w.inter ? ex->inter : w.inter;
        w.inter = ex->shared_inter > w.inter ? ex->shared_inter : w.inter;
        w.experts = ex->experts > w.experts ? ex->experts : w.experts;
        w.k = ex->top_k > w.k ? ex->top_k : w.k;
    }
    return w;
}

/* x, h, qkv, q, k, v, attn, gu, act, rot, xs; then the experts' logits, x, y, sum, weights, ids, rows, row weights;
 * then a parallel residual's attention output */
static int64_t row_floats(const model_t *md) {
    const int64_t H = md->hidden, D = md->head_dim, Hq = md->heads, Hkv = md->kv_heads;
    const widest_t w = widest(md);
    const int64_t moe = w.experts ? w.experts + 3 * H + 2 * w.k + 2 : 0;
    return 2 * H + (Hq + 2 * Hkv) * D + Hq * D + 2 * Hkv * D + Hq * D + 3 * w.inter + md->rope_tables * D + 1 + moe +
           (md->parallel_residual || md->shared_norm ? H : 0);
}

static int64_t widest_kpad(const model_t *md) { return widest(md).kpad; } /* the int8 linears' padded K, at most */

static int64_t most_blocks(const model_t *md) { return widest(md).blocks; } /* the nbits linears' blocks (0: none) */

static int64_t xq_bytes(const model_t *md, int64_t rows) { /* the quantized rows' room, a whole number of cache lines */
    return (rows * widest_kpad(md) + 63) / 64 * 64;
}

/* The arenas a work_t for `rows` rows over `slots` slots on `threads` threads needs: floats, and bytes (-1: bad sizes) */
int64_t medusa_native_work_floats(const model_t *md, int64_t rows, int64_t slots, int threads) {
    if (medusa_native_check_model(md) || rows <= 0 || slots < 0 || threads <= 0) return -1;
    return rows * row_floats(md) + medusa_tree_attention_scratch(1, (int)rows, slots, threads);
}

int64_t medusa_native_work_bytes(const model_t *md, int64_t rows) {
    if (medusa_native_check_model(md) || rows <= 0) return -1;
    return xq_bytes(md, rows) + 2 * rows * most_blocks(md) * 4; /* then the block scales and sums */
}

/* Carve the work buffers out of the two arenas (sized by the two functions above) */
int medusa_native_work_init(const model_t *md, work_t *wk, float *arena, int64_t floats, uint8_t *bytes, int64_t nbytes,
                            int64_t rows, int64_t slots, int threads) {
    const int64_t need = medusa_native_work_floats(md, rows, slots, threads);
    if (need < 0 || floats < need || nbytes < medusa_native_work_bytes(md, rows) || !arena || !bytes) return BAD_WORK;
    const int64_t H = md->hidden, D = md->head_dim, Hq = md->heads, Hkv = md->kv_heads;
    const widest_t w = widest(md);
    const int64_t I = w.inter;
    float *at = arena;
#define CARVE(field, n)                                                                                                \
    wk->field = (void *)at;                                                                                            \
    at += rows * (n);
    CARVE(x, H) CARVE(h, H) CARVE(qkv, (Hq + 2 * Hkv) * D) CARVE(q, Hq * D) CARVE(k, Hkv * D) CARVE(v, Hkv * D)
    CARVE(attn, Hq * D) CARVE(gu, 2 * I) CARVE(act, I) CARVE(rot, md->rope_tables * D) CARVE(xs, 1)
    wk->moe_logits = wk->moe_x = wk->moe_y = wk->moe_sum = wk->moe_w = wk->moe_rw = NULL;
    wk->moe_ids = wk->moe_rows = NULL;
    if (w.experts) {
        CARVE(moe_logits, w.experts) CARVE(moe_x, H) CARVE(moe_y, H) CARVE(moe_sum, H) CARVE(moe_w, w.k)
        CARVE(moe_ids, w.k) CARVE(moe_rows, 1) CARVE(moe_rw, 1) /* int32 ids and rows in float-sized slots */
    }
    wk->par = NULL;
    if (md->parallel_residual || md->shared_norm) {
        CARVE(par, H)
    }
#undef CARVE
    wk->att_scratch = at;
    wk->att_floats = need - (at - arena);
    wk->xq = bytes;
    wk->max_blocks = most_blocks(md);
    wk->bs = (float *)(bytes + xq_bytes(md, rows));
    wk->bsum = (int32_t *)(wk->bs + rows * wk->max_blocks);
    wk->rows = rows, wk->slots = slots, wk->threads = threads;
    if (!(wk->pool = medusa_pool_new(threads))) return NO_THREADS; /* also one thread's: its busy flag */
    return OK;
}

/* Stops the work's threads (medusa_native_work_init started them); the arenas are the caller's */
void medusa_native_work_free(work_t *wk) {
    medusa_pool_free(wk->pool);
    wk->pool = NULL;
}

/* The work's pool taken for one call: OK, BAD_WORK (a pool of more threads than its scratch), BUSY (another call runs) */
static int enter(const work_t *wk) {
    if (medusa_pool_threads(wk->pool) > wk->threads) return BAD_WORK;
    return pool_enter(wk->pool) ? OK : BUSY;
}

/* One linear alone (tests, timing): y (M, N) = x (M, K) through it; wk needs rows, threads, xq and xs (M rows) and a
 * pool of at most `threads` threads (or NULL) */
int medusa_native_linear(const linear_t *L, const work_t *wk, const float *x, int64_t M, float *y, int64_t nbytes) {
    if (!linear_ok(L, L->k, L->n) || M <= 0 || M > wk->rows || wk->threads <= 0 || M * L->kpad > nbytes) return BAD_SHAPE;
    if (L->blocks > 0 && (L->blocks > wk->max_blocks || !wk->bs || !wk->bsum)) return BAD_WORK;
    const int rc = enter(wk);
    if (rc) return rc;
    matmul(L, x, M, y, wk);
    pool_leave(wk->pool);
    return OK;
}

typedef struct {
    float *logits;
    int64_t V, I;
    float *gu, *act;
    int64_t *next_ids, *topk;
    int k, kind;   /* kind: the gate's activation */
    float divisor; /* the logits over this first (1: untouched) */
    float softcap; /* then c tanh(z / c) (0: none) */
    float alpha, limit; /* ACT_SWIGLU_LIMIT's */
    float *conf; /* (M, k): each top-k id's softmax probability over its row (NULL: not asked) */
} rows_job;

/* e^x for x <= 0, W lanes at a time (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-7 polynomial in r,
 * times 2^n from the exponent bits; about 2 ulp). Below -87 it answers e^-87 (a float's smallest normal is e^-87.3),
 * a NaN stays NaN. For the heads' confidence, a ranking heuristic: no step's number depends on it. */
static inline void exp16_neg(vec16 *px) { /* in place (a vector argument or result would change the ABI off AVX-512) */
    vec16 x = *px;
    const vec16 zero = {0}, lo = zero - 87.0f, magic = zero + 12582912.0f; /* 1.5 * 2^23: adding it rounds to a whole number */
    const ivec16 below = x < lo; /* -inf too; a NaN is not below */
    x = (vec16)(((ivec16)x & ~below) | ((ivec16)lo & below));
    const vec16 n = (x * 1.44269504088896341f + magic) - magic;
    const vec16 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    vec16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const ivec16 bits = (__builtin_convertvector(n, ivec16) + 127) << 23;
    *px = p * (vec16)bits;
}

/* each top-k id's probability under the softmax of row[0..V) (its largest value first: ids[0]'s) into conf[0..k) */
static void confidence(const float *row, int64_t V, const int64_t *ids, int k, float *conf) {
    const float peak = row[ids[0]];
    double total = 0.0; /* each lane sums at most 16 terms in float, then the lanes go into a double: within ~1e-7 */
    int64_t e = 0;
    while (e + W <= V) {
        vec16 acc = {0};
        for (int i = 0; i < 16 && e + W <= V; i++, e += W) {
            vec16 v;
            memcpy(&v, row + e, sizeof v);
            v -= peak;
            exp16_neg(&v);
            acc += v;
        }
        for (int i = 0; i < W; i++) total += acc[i];
    }
    for (; e < V; e++) total += expf(row[e] - peak);
    for (int i = 0; i < k; i++) conf[i] = (float)(expf(row[ids[i]] - peak) / total);
}

static void gate_rows(void *ctx, int64_t m0, int64_t m1, int worker) {
    (void)worker;
    const rows_job *J = ctx;
    for (int64_t m = m0; m < m1; m++) {
        const float *g = J->gu + m * (UNGATED(J->kind) ? 1 : 2) * J->I, *u = g + J->I;
        float *a = J->act + m * J->I;
        if (J->kind == ACT_RELU2)
            for (int64_t i = 0; i < J->I; i++) a[i] = g[i] > 0.0f ? g[i] * g[i] : 0.0f;
        else if (J->kind == ACT_GELU_UNGATED)
            for (int64_t i = 0; i < J->I; i++) a[i] = 0.5f * g[i] * (1.0f + erff(g[i] * 0.70710678f));
        else if (J->kind == ACT_SILU)
            silu_row(g, u, a, J->I);
        else if (J->kind == ACT_SWIGLU_LIMIT)
            swiglu_limit_row(g, u, a, J->I, J->alpha, J->limit);
        else
            gelu_row(g, u, a, J->I, J->kind == ACT_GELU_TANH);
    }
}

static void rank_rows(void *ctx, int64_t m0, int64_t m1, int worker) { /* next_ids where asked, the top k where k > 0 */
    (void)worker;
    const rows_job *J = ctx;
    for (int64_t m = m0; m < m1; m++) {
        if (J->divisor != 1.0f)
            for (int64_t e = 0; e < J->V; e++) J->logits[m * J->V + e] /= J->divisor;
        if (J->softcap > 0.0f)
            for (int64_t e = 0; e < J->V; e++) J->logits[m * J->V + e] = J->softcap * tanhf(J->logits[m * J->V + e] / J->softcap);
        if (J->next_ids) {
            int64_t first[1];
            top_k(J->logits + m * J->V, J->V, 1, first);
            J->next_ids[m] = first[0];
        }
        if (J->k) top_k(J->logits + m * J->V, J->V, J->k, J->topk + m * J->k);
        if (J->k && J->conf) confidence(J->logits + m * J->V, J->V, J->topk + m * J->k, J->k, J->conf + m * J->k);
    }
}

/* the k largest of p (E) into ids, best first; a tie keeps the lower expert (ONNX TopK). k is small. */
static void pick(const float *p, int64_t E, int64_t k, int32_t *ids) {
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        ids[j] = (int32_t)best;
    }
}

/* Each row's routing (runtime/native_experts.py): softmax over the router's E logits (in place), the k largest (a tie:
 * the lower expert first) into ids, their probabilities into w, optionally over their sum (taken in rank order) */
static void route(const experts_t *ex, float *logits, int64_t M, int32_t *ids, float *w) {
    const int64_t E = ex->experts, k = ex->top_k;
    for (int64_t m = 0; m < M; m++) {
        float *p = logits + m * E, top = p[0], total = 0.0f;
        if (ex->router_bias)
            for (int64_t e = 0; e < E; e++) p[e] += ex->router_bias[e];
        if (ex->topk_first) { /* the k largest logits, then the softmax over them alone (in rank order) */
            pick(p, E, k, ids + m * k);
            const float best = p[ids[m * k]];
            for (int64_t j = 0; j < k; j++) total += (w[m * k + j] = expf(p[ids[m * k + j]] - best));
            for (int64_t j = 0; j < k; j++) w[m * k + j] /= total;
            continue;
        }
        for (int64_t e = 1; e < E; e++) top = p[e] > top ? p[e] : top;
        for (int64_t e = 0; e < E; e++) total += (p[e] = expf(p[e] - top));
        for (int64_t e = 0; e < E; e++) p[e] /= total;
        pick(p, E, k, ids + m * k);
        for (int64_t j = 0; j < k; j++) w[m * k + j] = p[ids[m * k + j]];
        if (ex->normalize) {
            float sum = 0.0f;
            for (int64_t j = 0; j < k; j++) sum += w[m * k + j];
            for (int64_t j = 0; j < k; j++) w[m * k + j] /= sum;
        }
    }
}

/* One layer's routed experts on `in` (M, H) into `out` (M, H): expert after expert (0 .. E - 1), the rows routed to it
 * gathered, its gate/up, activation and down, each row's output times its weight added to that row's sum; then the
 * shared expert's output times the sigmoid of its gate. A row's sum depends on its own routing alone. */
static void experts(const model_t *md, const experts_t *ex, const work_t *wk, int64_t M, const float *in, float *out) {
    const int64_t H = md->hidden, k = ex->top_k;
    matmul(ex->router, in, M, wk->moe_logits, wk);
    route(ex, wk->moe_logits, M, wk->moe_ids, wk->moe_w);
    memset(out, 0, (size_t)(M * H) * sizeof(float));
    rows_job gate = {.gu = wk->gu, .act = wk->act, .I = ex->inter, .kind = md->act, .alpha = md->act_alpha, .limit = md->act_limit};
    for (int64_t e = 0; e < ex->experts; e++) {
        int64_t n = 0;
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < k; j++)
                if (wk->moe_ids[m * k + j] == e) {
                    wk->moe_rows[n] = (int32_t)m, wk->moe_rw[n] = wk->moe_w[m * k + j];
                    memcpy(wk->moe_x + n * H, in + m * H, (size_t)H * sizeof(float));
                    n++;
                    break;
                }
        if (n == 0) continue;
        matmul(ex->gate_up[e], wk->moe_x, n, wk->gu, wk);
        if (ex->gate_up_bias && ex->gate_up_bias[e]) add_bias_rows(wk->gu, n, 2 * ex->inter, ex->gate_up_bias[e]);
        pool_run(wk->pool, n, 1, gate_rows, &gate);
        matmul(ex->down[e], wk->act, n, wk->moe_y, wk);
        if (ex->down_bias && ex->down_bias[e]) add_bias_rows(wk->moe_y, n, H, ex->down_bias[e]);
        for (int64_t i = 0; i < n; i++) {
            float *sum = out + (int64_t)wk->moe_rows[i] * H;
            const float *y = wk->moe_y + i * H, r = wk->moe_rw[i];
            for (int64_t d = 0; d < H; d++) sum[d] += y[d] * r;
        }
    }
    if (!ex->shared_down) return;
    gate.I = ex->shared_inter;
    matmul(ex->shared_gate_up, in, M, wk->gu, wk);
    pool_run(wk->pool, M, 1, gate_rows, &gate);
    matmul(ex->shared_down, wk->act, M, wk->moe_y, wk);
    matmul(ex->shared_gate, in, M, wk->moe_logits, wk); /* (M, 1) */
    for (int64_t m = 0; m < M; m++) {
        const float s = 1.0f / (1.0f + expf(-wk->moe_logits[m]));
        for (int64_t d = 0; d < H; d++) out[m * H + d] += s * wk->moe_y[m * H + d];
    }
}

static int step(const model_t *md, const work_t *wk, int B, int T, const int64_t *ids, const int64_t *pos,
                const uint8_t *mask, const int64_t *lengths, const float *past_k, const float *past_v, int64_t past_slots,
                float *new_k, float *new_v, float *hidden, float *logits, int64_t *next_ids, int64_t *topk, int k) {
    const int64_t M = (int64_t)B * T, H = md->hidden, D = md->head_dim, Hq = md->heads, Hkv = md->kv_heads;
    const int64_t L = md->layers, I = md->inter, V = md->vocab, QKV = (Hq + 2 * Hkv) * D;
    const int R = md->rotary_dim;
    const int64_t row_stride = Hkv * D, layer_stride = B * Hkv * D, slot_stride = L * layer_stride;
    const int threads = (int)wk->threads;
    if (B <= 0 || T <= 0 || M > wk->rows || k < 0 || k > MAX_TOPK || past_slots < 0 || threads <= 0) return BAD_SHAPE;
    if (logits != NULL && (next_ids == NULL || (k > 0 && topk == NULL))) return BAD_SHAPE;
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) {
        if (lengths[b] < 0 || lengths[b] > past_slots || lengths[b] > wk->slots) return BAD_LENGTH;
        longest = lengths[b] > longest ? lengths[b] : longest;
    }
    if (medusa_tree_attention_scratch(B, T, longest, threads) > wk->att_floats) return TOO_LARGE;
    for (int64_t m = 0; m < M; m++)
        if (ids[m] < 0 || ids[m] >= V) return BAD_TOKEN;
    for (int64_t m = 0; m < M; m++) /* a node lies past its row's committed slots (a window reads slot s as position s) */
        if (pos[m] < lengths[m / T]) return BAD_POSITION;
    float *x = wk->x;
    rows_job rows = {.gu = wk->gu, .act = wk->act, .I = I, .V = V, .kind = md->act, .alpha = md->act_alpha, .limit = md->act_limit,
                     .divisor = md->logit_divisor,
                     .softcap = md->final_softcap};
    for (int64_t m = 0; m < M; m++) {
        const float *e = md->embed + ids[m] * H;
        for (int64_t d = 0; d < H; d++) x[m * H + d] = e[d] * md->embed_scale; /* x 1: exact */
        for (int r = 0; r < md->rope_tables; r++) rope_table(R, pos[m], md->inv_freq + r * (R / 2), md->rope_factor, wk->rot + (r * M + m) * D);
    }
    for (int64_t l = 0; l < L; l++) {
        if (md->norm_in[l]) norm_rows(md, x, M, md->norm_in[l], md->norm_in_bias[l], wk->h);
        matmul(md->qkv[l], md->norm_in[l] ? wk->h : x, M, wk->qkv, wk);
        const float *bias = md->qkv_bias[l], *qn = md->q_norm[l], *kn = md->k_norm[l];
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++) { /* per row, per head: the bias, the q/k norms, the rotary */
                float *r = wk->qkv + (b * T + t) * QKV;
                const float *rot = wk->rot + (md->rope_of[l] * M + b * T + t) * D;
                if (bias)
                    for (int64_t e = 0; e < QKV; e++) r[e] += bias[e];
                if (qn) qk_norm(md, r, Hq, qn);
                if (kn) qk_norm(md, r + Hq * D, Hkv, kn);
                for (int64_t h = 0; h < Hq; h++) rope(r + h * D, D, R, rot, md->rope_interleaved, wk->q + ((b * Hq + h) * T + t) * D);
                for (int64_t h = 0; h < Hkv; h++) {
                    float *kk = wk->k + ((b * Hkv + h) * T + t) * D, *vv = wk->v + ((b * Hkv + h) * T + t) * D;
                    rope(r + (Hq + h) * D, D, R, rot, md->rope_interleaved, kk);
                    memcpy(vv, r + (Hq + Hkv + h) * D, D * sizeof(float));
                    const int64_t at = t * L * layer_stride + l * layer_stride + b * row_stride + h * D;
                    memcpy(new_k + at, kk, D * sizeof(float));
                    memcpy(new_v + at, vv, D * sizeof(float));
                }
            }
        if (medusa_tree_attention_pool(B, T, Hq, Hkv, D, md->scale, wk->q, wk->k, wk->v, past_k + l * layer_stride,
                                       past_v + l * layer_stride, slot_stride, row_stride, mask, lengths, pos,
                                       md->window[l], md->attn_softcap, md->sinks[l], wk->attn, wk->att_scratch, wk->att_floats,
                                       wk->pool))
            return TOO_LARGE;
        /* parallel: kept until the MLP's is added; shared norm: h keeps the input norm's output for the MLP */
        float *attn_out = md->parallel_residual || md->shared_norm ? wk->par : wk->h;
        matmul(md->o[l], wk->attn, M, attn_out, wk);
        if (md->o_bias[l]) add_bias_rows(attn_out, M, H, md->o_bias[l]);
        if (md->attn_out_norm[l]) rms_norm(attn_out, M, H, md->attn_out_norm[l], md->eps, attn_out);
        if (!md->parallel_residual) add_scaled_rows(x, attn_out, M * H, md->residual_scale);
        if (md->norm_post[l]) norm_rows(md, x, M, md->norm_post[l], md->norm_post_bias[l], wk->h);
        const float *mlp_in = md->norm_post[l] || md->shared_norm ? wk->h : x;
        float *mlp_out = wk->h;
        if (md->experts[l]) {
            experts(md, md->experts[l], wk, M, mlp_in, wk->moe_sum);
            mlp_out = wk->moe_sum;
        } else {
            matmul(md->gate_up[l], mlp_in, M, wk->gu, wk);
            if (md->gate_up_bias[l]) add_bias_rows(wk->gu, M, (UNGATED(md->act) ? 1 : 2) * I, md->gate_up_bias[l]);
            pool_run(wk->pool, M, 1, gate_rows, &rows);
            matmul(md->down[l], wk->act, M, wk->h, wk);
            if (md->down_bias[l]) add_bias_rows(wk->h, M, H, md->down_bias[l]);
        }
        if (md->mlp_out_norm[l]) rms_norm(mlp_out, M, H, md->mlp_out_norm[l], md->eps, mlp_out);
        if (md->parallel_residual) /* the graph's Add(mlp, attention), then its Add with the layer's input */
            for (int64_t e = 0; e < M * H; e++) mlp_out[e] += wk->par[e];
        add_scaled_rows(x, mlp_out, M * H, md->residual_scale);
    }
    norm_rows(md, x, M, md->norm_final, md->norm_final_bias, hidden);
    if (logits == NULL) return OK;
    /* int8 lm_head: its first outputs last, so the heads, which may share them (native_step.py's NativeStep.lm_prefix:
     * the draft vocabulary's rows), find them in cache right after the step. Each output's sums are the same. */
    matmul_order(md->lm_head, hidden, M, logits, wk, 1);
    rows.logits = logits, rows.next_ids = next_ids, rows.topk = topk, rows.k = k;
    pool_run(wk->pool, M, 1, rank_rows, &rows);
    pool_warm(wk->pool); /* where the heads ran after the last step: their weights, while the caller commits this one */
    return OK;
}

/* ---- the Medusa heads (runtime/native_weights.py's read_heads says which heads graphs these are) ----
 *   x = hidden, or [hidden | rms(embed[root])] for heads that read the next token (no norm weight)
 *   y = x @ fused (one linear for every head, n * H wide), head j: h_j = hidden + silu(y_j + bias_j)
 *   head_logits (B, n, Vd) = h (B * n rows) @ lm; head_topk (B, n, K) the top K of each (a tie: the lower id first) */
typedef struct {
    int32_t hidden, heads, draft_vocab, top_k, reads_roots, vocab;
    float eps;
    const float *embed; /* (vocab, H) where reads_roots */
    const float *bias;  /* (heads * H) */
    const linear_t *fused, *lm;
} heads_t;

static int64_t heads_floats_per_row(const heads_t *hd) { /* x, y, h (n rows), their int8 scales (n rows) */
    const int64_t H = hd->hidden, n = hd->heads;
    return (hd->reads_roots ? 2 : 1) * H + n * H + n * H + n;
}

int medusa_native_heads_check(const heads_t *hd) {
    const int64_t H = hd->hidden, n = hd->heads, K = hd->top_k;
    if (H <= 0 || n <= 0 || hd->draft_vocab <= 0 || K <= 0 || K > MAX_TOPK || K > hd->draft_vocab || !hd->bias) return BAD_MODEL;
    if (hd->reads_roots && (!hd->embed || hd->vocab <= 0 || !(hd->eps > 0.0f))) return BAD_MODEL;
    if (!linear_ok(hd->fused, (hd->reads_roots ? 2 : 1) * H, n * H) || !linear_ok(hd->lm, H, hd->draft_vocab)) return BAD_MODEL;
    return OK;
}

/* the scratch a heads call on B rows needs: floats, bytes (-1: bad heads or rows) */
int64_t medusa_native_heads_floats(const heads_t *hd, int64_t B) {
    return medusa_native_heads_check(hd) || B <= 0 ? -1 : B * heads_floats_per_row(hd);
}

static int64_t heads_xq_bytes(const heads_t *hd, int64_t B) { /* the quantized rows, whole cache lines */
    const int64_t a = hd->fused->kpad, b = hd->lm->kpad * hd->heads;
    return (B * (a > b ? a : b) + 63) / 64 * 64;
}

static int64_t heads_blocks(const heads_t *hd) { /* the nbits linears' blocks, at most (0: none) */
    return hd->fused->blocks > hd->lm->blocks ? hd->fused->blocks : hd->lm->blocks;
}

int64_t medusa_native_heads_bytes(const heads_t *hd, int64_t B) {
    if (medusa_native_heads_check(hd) || B <= 0) return -1;
    return heads_xq_bytes(hd, B) + 2 * B * hd->heads * heads_blocks(hd) * 4; /* then B n rows' block scales and sums */
}

static int heads(const heads_t *hd, const work_t *wk, int64_t B, const float *hidden, const int64_t *roots,
                 float *head_logits, int64_t *head_topk, float *head_conf, float *scratch, uint8_t *bytes) {
    const int64_t H = hd->hidden, n = hd->heads, Kin = (hd->reads_roots ? 2 : 1) * H;
    float *x = scratch, *y = x + B * Kin, *h = y + B * n * H, *xs = h + B * n * H;
    work_t hw = *wk; /* the step's threads, the heads' scratch */
    hw.xq = bytes, hw.xs = xs, hw.rows = B * n, hw.max_blocks = heads_blocks(hd);
    hw.bs = (float *)(bytes + heads_xq_bytes(hd, B));
    hw.bsum = (int32_t *)(hw.bs + B * n * hw.max_blocks);
    for (int64_t b = 0; b < B; b++) {
        memcpy(x + b * Kin, hidden + b * H, H * sizeof(float));
        if (!hd->reads_roots) continue;
        if (roots[b] < 0 || roots[b] >= hd->vocab) return BAD_TOKEN;
        const float *e = hd->embed + roots[b] * H; /* Pow, ReduceMean, Add eps, Sqrt, Reciprocal, Mul */
        float s = 0.0f;
        for (int64_t d = 0; d < H; d++) s += e[d] * e[d];
        const float inv = 1.0f / sqrtf(s / (float)H + hd->eps);
        for (int64_t d = 0; d < H; d++) x[b * Kin + H + d] = e[d] * inv;
    }
    matmul(hd->fused, x, B, y, &hw); /* (B, n H) */
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j < n; j++)
            for (int64_t d = 0; d < H; d++) { /* Add bias, Sigmoid, Mul, Add hidden */
                const float z = y[b * n * H + j * H + d] + hd->bias[j * H + d];
                h[(b * n + j) * H + d] = hidden[b * H + d] + z * (1.0f / (1.0f + expf(-z)));
            }
    matmul(hd->lm, h, B * n, head_logits, &hw); /* (B n, Vd) */
    rows_job R = {.logits = head_logits, .V = hd->draft_vocab, .topk = head_topk, .k = hd->top_k, .divisor = 1.0f,
                  .conf = head_conf}; /* no next_ids */
    pool_run(wk->pool, B * n, 1, rank_rows, &R);
    return OK;
}

/* The heads on B rows of hidden (B, H) (and roots (B) where they read the next token) into head_logits (B, n, Vd),
 * head_topk (B, n, K) and, where head_conf is not NULL, each top-K id's softmax probability under its head into
 * head_conf (B, n, K), on the step's threads (never beside its step: BUSY), scratch sized by the two functions above */
int medusa_native_heads(const heads_t *hd, const work_t *wk, int64_t B, const float *hidden, const int64_t *roots,
                        float *head_logits, int64_t *head_topk, float *head_conf, float *scratch, int64_t floats,
                        uint8_t *bytes, int64_t nbytes) {
    if (medusa_native_heads_check(hd) || B <= 0 || B * hd->heads > wk->rows || !hidden || !head_logits || !head_topk)
        return BAD_SHAPE;
    if ((hd->reads_roots && !roots) || floats < medusa_native_heads_floats(hd, B) || nbytes < medusa_native_heads_bytes(hd, B))
        return BAD_WORK;
    int rc = enter(wk);
    if (rc) return rc;
    rc = heads(hd, wk, B, hidden, roots, head_logits, head_topk, head_conf, scratch, bytes);
    if (rc == OK) pool_ask_warm(wk->pool); /* the loop calls the heads after each step: read them ahead after the next */
    pool_leave(wk->pool);
    return rc;
}

/* The region the step's workers read ahead after a step that follows a heads call (native_pool.h's pool_warm): the
 * heads' fused weights, which the step's own weights push out of the caches. OK, BUSY (a call runs), BAD_SHAPE (a
 * region past 8 MB). base must outlive the work. */
int medusa_native_work_warm(const work_t *wk, const void *base, int64_t bytes) {
    int rc = enter(wk);
    if (rc) return rc;
    rc = pool_set_warm(wk->pool, base, bytes) ? OK : BAD_SHAPE;
    pool_leave(wk->pool);
    return rc;
}

/* One step. logits NULL: the lm_head is skipped (next_ids, topk untouched). k: topk's width (0: none; at most 64).
 * past_k / past_v hold past_slots slots; new_k / new_v T. One step at a time on a work_t: BUSY while another runs. */
int medusa_native_step(const model_t *md, const work_t *wk, int B, int T, const int64_t *ids, const int64_t *pos,
                       const uint8_t *mask, const int64_t *lengths, const float *past_k, const float *past_v,
                       int64_t past_slots, float *new_k, float *new_v, float *hidden, float *logits, int64_t *next_ids,
                       int64_t *topk, int k) {
    int rc = enter(wk);
    if (rc) return rc;
    rc = step(md, wk, B, T, ids, pos, mask, lengths, past_k, past_v, past_slots, new_k, new_v, hidden, logits,
                        next_ids, topk, k);
    pool_leave(wk->pool);
    return rc;
}
