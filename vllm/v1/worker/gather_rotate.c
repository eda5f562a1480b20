// SPDX-License-Identifier: Apache-2.0
// The chunk cache's CPU load of K in one pass (issue 52): gather pool rows by
// index, rotate the first rotary_dim values of each head in fp32 by the row's
// cos | sin table entry, round back to the pool's dtype, write the rows in
// order. The passes this replaces: index_select, a cast to fp32, vLLM's
// rotary_embedding op in place, a cast back (position_remapper.py).
//
// Built at first use by gather_rotate.py (cc -O3 -march=native
// -ffp-contract=off [-fopenmp]) and used only where a self-check finds it
// bit-identical to those passes on this machine. Rounding: `fused` computes
// x1*c - x2*s as fma(-x2, s, x1*c) (vLLM's op on AVX-512 neox bodies),
// otherwise each product is rounded on its own (-ffp-contract=off keeps the
// compiler from fusing them).

#include <stdint.h>
#include <string.h>
#include <math.h>

typedef uint16_t bf16_t;

static inline float load_bf16(const bf16_t *p, int64_t i) {
    uint32_t u = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Round to nearest even, as c10::BFloat16 does (NaN stays a quiet NaN).
static inline void store_bf16(bf16_t *p, int64_t i, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    p[i] = ((u & 0x7fffffffu) > 0x7f800000u)
               ? (bf16_t)0x7fc0
               : (bf16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float load_f16(const _Float16 *p, int64_t i) { return (float)p[i]; }
static inline void store_f16(_Float16 *p, int64_t i, float f) { p[i] = (_Float16)f; }
static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline void store_f32(float *p, int64_t i, float f) { p[i] = f; }

// One row: `heads` heads of `head_size` values; pairs (i, half + i) in neox
// style, (2i, 2i + 1) otherwise; values past rotary_dim copied as they are.
#define ROW(T, LOAD, STORE, HALF, NEOX, FUSED)                                   \
    for (int64_t h = 0; h < heads; ++h) {                                        \
        const T *restrict x = in + h * head_size;                                \
        T *restrict y = o + h * head_size;                                       \
        for (int64_t i = 0; i < (HALF); ++i) {                                   \
            const int64_t i1 = (NEOX) ? i : 2 * i;                               \
            const int64_t i2 = (NEOX) ? (HALF) + i : 2 * i + 1;                  \
            const float a = LOAD(x, i1), b = LOAD(x, i2);                        \
            float c1, c2;                                                        \
            if (FUSED) {                                                         \
                c1 = fmaf(-b, sn[i], a * cs[i]);                                 \
                c2 = fmaf(a, sn[i], b * cs[i]);                                  \
            } else {                                                             \
                c1 = a * cs[i] - b * sn[i];                                      \
                c2 = b * cs[i] + a * sn[i];                                      \
            }                                                                    \
            STORE(y, i1, c1);                                                    \
            STORE(y, i2, c2);                                                    \
        }                                                                        \
        for (int64_t i = 2 * (HALF); i < head_size; ++i) y[i] = x[i];            \
    }

#define ROWS(T, LOAD, STORE, HALF, NEOX, FUSED)                                  \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)") \
    for (int64_t r = 0; r < n; ++r) {                                            \
        const T *restrict in = pool + src[r] * row;                              \
        T *restrict o = out + r * row;                                           \
        const float *cs = table + index[r] * rotary_dim, *sn = cs + (HALF);      \
        ROW(T, LOAD, STORE, HALF, NEOX, FUSED)                                   \
    }

// A constant half for the common head sizes lets the compiler unroll and
// vectorise the pair loop (measured: 0.34x of the passes against 0.57x with
// the half a variable, 32,000 rows of 2 x 32 bf16 values, one thread).
#define BY_HALF(T, LOAD, STORE, NEOX, FUSED)                                     \
    switch (half) {                                                              \
    case 16: ROWS(T, LOAD, STORE, 16, NEOX, FUSED) break;                        \
    case 32: ROWS(T, LOAD, STORE, 32, NEOX, FUSED) break;                        \
    case 64: ROWS(T, LOAD, STORE, 64, NEOX, FUSED) break;                        \
    default: ROWS(T, LOAD, STORE, half, NEOX, FUSED) break;                      \
    }

#define ENTRY(NAME, T, LOAD, STORE)                                              \
    int64_t NAME(const T *restrict pool, int64_t pool_rows,                      \
                 const int64_t *restrict src, const int64_t *restrict index,     \
                 int64_t n, const float *restrict table, int64_t entries,        \
                 int64_t heads, int64_t head_size, int64_t rotary_dim,           \
                 int neox, int fused, int threads, T *restrict out) {            \
        const int64_t half = rotary_dim / 2, row = heads * head_size;            \
        /* Every index is checked before anything is read: a bad one is an    \
           error for the caller (its position + 1), never a stray read. */      \
        for (int64_t r = 0; r < n; ++r)                                          \
            if (src[r] < 0 || src[r] >= pool_rows || index[r] < 0 ||             \
                index[r] >= entries)                                             \
                return r + 1;                                                    \
        if (neox && fused) BY_HALF(T, LOAD, STORE, 1, 1)                         \
        else if (neox) BY_HALF(T, LOAD, STORE, 1, 0)                             \
        else if (fused) BY_HALF(T, LOAD, STORE, 0, 1)                            \
        else BY_HALF(T, LOAD, STORE, 0, 0)                                       \
        return 0;                                                                \
    }

ENTRY(gather_rotate_bf16, bf16_t, load_bf16, store_bf16)
ENTRY(gather_rotate_f16, _Float16, load_f16, store_f16)
ENTRY(gather_rotate_f32, float, load_f32, store_f32)
