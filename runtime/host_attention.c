/* Tree attention over the committed cache where it lies: no per-layer copy of the cache.
 *
 * Exact by construction: every query adds up its visible keys in one order, the order of their
 * positions (the committed slots 0..length-1, then the step's own nodes it may see, in node order,
 * which is depth order for a tree in topological order), with the same instructions whatever the
 * key's origin. A token scored in a verify step therefore sees the same numbers in the same order
 * as when a plain step scores it after its ancestors were committed: its output is bit for bit
 * the same. Scores are dot products summed over the head dimension in LANES partial sums; the
 * softmax sum and the value sum run over the keys one at a time (vectorised over the head
 * dimension only, which no key shares with another).
 *
 * Layouts (float32, row-major):
 *   q       [B, Hq, T, D]  the step's queries, rotary applied
 *   k, v    [B, Hkv, T, D] the step's new keys and values
 *   cache_k, cache_v: element (slot s, row b, head h, d) at s * slot_stride + b * row_stride + h * D + d
 *   mask    uint8 [B, T, T] node i sees node j (ancestors and itself)
 *   lengths int64 [B]      committed slots of each row
 *   out     [B, T, Hq * D]
 *   scratch float, at least (Hq / Hkv) * T * (max(lengths) + T) elements
 * Query head h reads key/value head h / (Hq / Hkv) (grouped-query attention).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16

/* one compiled copy each: a cache key and a new key go through the same instructions */
__attribute__((noinline)) static float dot(const float *a, const float *b, int n) {
    float part[LANES] = {0};
    int d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int l = 0; l < LANES; l++) part[l] += a[d + l] * b[d + l];
    for (int l = 0; d < n; d++, l++) part[l] += a[d] * b[d];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) part[l] += part[l + width];
    return part[0];
}

__attribute__((noinline)) static void add_scaled(float *acc, const float *v, float p, int n) {
    for (int d = 0; d < n; d++) acc[d] += p * v[d];
}

int medusa_tree_attention(int B, int T, int Hq, int Hkv, int D, float scale, const float *q, const float *k,
                          const float *v, const float *cache_k, const float *cache_v, int64_t slot_stride,
                          int64_t row_stride, const uint8_t *mask, const int64_t *lengths, float *out,
                          float *scratch) {
    if (Hkv <= 0 || Hq % Hkv != 0) return 1;
    const int groups = Hq / Hkv, rows = groups * T; /* the queries of one key/value head: row g * T + i */
    for (int b = 0; b < B; b++) {
        const int64_t length = lengths[b], width = length + T; /* scratch: rows x width scores */
        const uint8_t *seen = mask + (int64_t)b * T * T;
        for (int kv = 0; kv < Hkv; kv++) {
            const float *kb = cache_k + b * row_stride + (int64_t)kv * D;
            const float *vb = cache_v + b * row_stride + (int64_t)kv * D;
            const float *kn = k + ((int64_t)(b * Hkv + kv) * T) * D;
            const float *vn = v + ((int64_t)(b * Hkv + kv) * T) * D;
            const float *qh = q + ((int64_t)(b * Hq + kv * groups) * T) * D; /* rows x D, contiguous */
            /* scores: the cache's keys, each read once for every row, then each row's own visible nodes */
            for (int64_t s = 0; s < length; s++)
                for (int r = 0; r < rows; r++) scratch[r * width + s] = dot(qh + (int64_t)r * D, kb + s * slot_stride, D) * scale;
            for (int r = 0; r < rows; r++) {
                const int i = r % T;
                float *row = scratch + r * width;
                int64_t n = length;
                for (int j = 0; j < T; j++)
                    if (seen[i * T + j]) row[n++] = dot(qh + (int64_t)r * D, kn + (int64_t)j * D, D) * scale;
                float top = -INFINITY, total = 0.0f;
                for (int64_t m = 0; m < n; m++) top = row[m] > top ? row[m] : top;
                for (int64_t m = 0; m < n; m++) total += (row[m] = expf(row[m] - top));
                const float inv = n ? 1.0f / total : 0.0f;
                for (int64_t m = 0; m < n; m++) row[m] *= inv;
                float *o = out + ((int64_t)b * T + i) * Hq * D + (int64_t)(kv * groups + r / T) * D;
                memset(o, 0, sizeof(float) * D);
            }
            /* values in the same order: the cache's slots, then each row's visible nodes */
            for (int64_t s = 0; s < length; s++) {
                const float *vs = vb + s * slot_stride;
                for (int r = 0; r < rows; r++) {
                    const int i = r % T;
                    add_scaled(out + ((int64_t)b * T + i) * Hq * D + (int64_t)(kv * groups + r / T) * D, vs, scratch[r * width + s], D);
                }
            }
            for (int r = 0; r < rows; r++) {
                const int i = r % T;
                float *o = out + ((int64_t)b * T + i) * Hq * D + (int64_t)(kv * groups + r / T) * D;
                int64_t n = length;
                for (int j = 0; j < T; j++)
                    if (seen[i * T + j]) add_scaled(o, vn + (int64_t)j * D, scratch[r * width + n++], D);
            }
        }
    }
    return 0;
}
