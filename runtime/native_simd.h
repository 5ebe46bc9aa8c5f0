/* The native step's vectors, one definition per instruction set (runtime/native_isa.py builds one library per set).
 *
 * vf is the widest float vector the set has, VF floats. vf_fma(a, b, c) is a * b + c: fused (one rounding) where the
 * set has a fused multiply-add, a product then a sum elsewhere (SSE2, plain C). Every library is compiled with
 * -ffp-contract=off, so the compiler never fuses on its own: which operations are fused is written here, once, and
 * does not depend on how a kernel was inlined or tiled. That is what keeps a row's numbers the same whatever else
 * shares its step (native_step.c's promise); numbers may differ between instruction sets, never within one.
 */
#ifndef MEDUSA_NATIVE_SIMD_H
#define MEDUSA_NATIVE_SIMD_H

#if defined(__AVX512F__)
#include <immintrin.h>
#define VF 16
typedef __m512 vf;
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VF 8
typedef __m256 vf;
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define VF 4
typedef float32x4_t vf;
static inline vf vf_load(const float *p) { return vld1q_f32(p); }
static inline void vf_store(float *p, vf x) { vst1q_f32(p, x); }
static inline vf vf_set1(float x) { return vdupq_n_f32(x); }
static inline vf vf_zero(void) { return vdupq_n_f32(0.0f); }
static inline vf vf_fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); } /* FMLA: fused, one rounding */
#elif defined(__SSE2__)
#include <emmintrin.h>
#define VF 4
typedef __m128 vf;
static inline vf vf_load(const float *p) { return _mm_loadu_ps(p); }
static inline void vf_store(float *p, vf x) { _mm_storeu_ps(p, x); }
static inline vf vf_set1(float x) { return _mm_set1_ps(x); }
static inline vf vf_zero(void) { return _mm_setzero_ps(); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm_add_ps(_mm_mul_ps(a, b), c); } /* no FMA here: two roundings */
#else
#define VF 1
typedef float vf;
static inline vf vf_load(const float *p) { return *p; }
static inline void vf_store(float *p, vf x) { *p = x; }
static inline vf vf_set1(float x) { return x; }
static inline vf vf_zero(void) { return 0.0f; }
static inline vf vf_fma(vf a, vf b, vf c) { return a * b + c; } /* -ffp-contract=off: two roundings */
#endif

/* The scalar counterpart of vf_fma, for a kernel's scalar loop that must match its vector one: one rounding where
 * the set fuses (fmaf, a single instruction there), a product then a sum where it does not. */
#if defined(__FMA__) || (defined(__aarch64__) && defined(__ARM_NEON))
#include <math.h>
static inline float sf_fma(float a, float b, float c) { return fmaf(a, b, c); }
#else
static inline float sf_fma(float a, float b, float c) { return a * b + c; } /* -ffp-contract=off: two roundings */
#endif

/* The instruction set this library was built for (runtime/native_isa.py's ISAS, by index), set by its build. */
#ifndef MEDUSA_ISA
#define MEDUSA_ISA -1
#endif

#endif
