// SPDX-License-Identifier: Apache-2.0
// The chunk cache's CPU load of K in one pass (issue 52): gather pool rows by
// index, rotate the first rotary_dim values of each head in fp32 by the row's
// cos | sin table entry, round back to the pool's dtype, write the rows in
// order. The passes this replaces: index_select, a cast to fp32, vLLM's
// rotary_embedding op in place, a cast back (position_remapper.py,
// `load_key_passes`).
//
// Compiled when the CPU wheel is built (tools/forktool/cpu_kernel.py holds
// the flags; never -march=native) and shipped in it: one body per ISA
// (AVX-512, AVX2 + FMA + F16C, baseline x86-64), picked once at the first
// call by the CPU's features. The rounding is the same on every body:
// `fused` computes x1*c - x2*s as fmaf(-x2, s, x1*c) (vLLM's op on AVX-512
// neox bodies), otherwise each product is rounded on its own
// (-ffp-contract=off keeps the compiler from fusing them); the casts to and
// from the 16-bit types are integer code (round to nearest even), the same
// bits as torch's casts for every finite value, subnormals included.
//
// NaN and Inf: torch's casts write NaN patterns that depend on which of its
// loops (vector body or scalar tail) met the value, so no formula here can
// promise the passes' bytes. A call that meets a non-finite value (in a row
// it reads, or a rotated value that overflowed) returns -1 and the caller
// loads those rows with the passes (gather_rotate.py).
//
// Threads: with OpenMP (-fopenmp at compile time) the rows are split over
// `threads` threads of the OpenMP runtime already in the process: the
// library is linked without libgomp, its GOMP_* symbols resolve to torch's
// runtime, which gather_rotate.py makes global before loading it.

#include <stdint.h>
#include <string.h>

// The interface version gather_rotate.py checks before using the entries.
#define GATHER_ROTATE_ABI 2

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// An fp32 value with every exponent bit set (Inf or NaN).
#define NONFINITE32(u) (((u) & 0x7f800000u) == 0x7f800000u)

// bf16: the top half of an fp32 value.
static inline float load_bf16(const uint16_t *p, int64_t i) {
    return float_of((uint32_t)p[i] << 16);
}

// Round to nearest even (finite values; overflow gives Inf, as torch's cast).
static inline uint16_t bf16_of(uint32_t u) {
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// fp16 to fp32, exactly: normal values rebias the exponent, subnormal ones
// are m * 2^-24 (exact in fp32), Inf/NaN keep their payload.
static inline float load_f16(const uint16_t *p, int64_t i) {
    const uint32_t h = p[i];
    const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    const uint32_t normal = sign | ((e + 112u) << 23) | (m << 13);
    const uint32_t special = sign | 0x7f800000u | (m << 13);
    const uint32_t subnormal = sign | bits_of((float)m * 0x1p-24f);
    return float_of(e == 0 ? subnormal : (e == 31 ? special : normal));
}

// fp32 to fp16, round to nearest even (finite values; overflow gives Inf):
// below 2^-14 the fp32 addition to 0.5 rounds at the subnormal's ulp (2^-24);
// above, the mantissa is rounded in integer code, a carry moving into the
// exponent (up to Inf).
static inline uint16_t f16_of(uint32_t u) {
    const uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    uint32_t h;
    if (a >= 0x47800000u) {  // >= 65536 (and the caller never passes NaN)
        h = 0x7c00u;
    } else if (a < 0x38800000u) {  // < 2^-14: subnormal or zero
        h = bits_of(float_of(a) + 0.5f) - 0x3f000000u;
    } else {
        const uint32_t odd = (a >> 13) & 1u;
        a += ((uint32_t)(15 - 127) << 23) + 0xfffu + odd;
        h = a >> 13;
    }
    return (uint16_t)(h | sign);
}

#define LOAD_BF16(p, i) load_bf16(p, i)
#define STORE_BF16(p, i, f) ((p)[i] = bf16_of(bits_of(f)))
#define LOAD_F16(p, i) load_f16(p, i)
#define STORE_F16(p, i, f) ((p)[i] = f16_of(bits_of(f)))
#define LOAD_F32(p, i) ((p)[i])
#define STORE_F32(p, i, f) ((p)[i] = (f))
// The raw bits of a value passed through unrotated: non-finite or not.
#define RAW_BAD_16(v, mask) (((v) & (mask)) == (mask))

// fmaf without libm: __builtin_fmaf is an instruction on the FMA bodies and
// libm's exact fmaf on the baseline one (both round once).
#define FMA(a, b, c) __builtin_fmaf(a, b, c)

// One row: `heads` heads of `head_size` values; pairs (i, half + i) in neox
// style, (2i, 2i + 1) otherwise; values past rotary_dim copied as they are.
// `bad` collects whether a value met is Inf or NaN.
#define ROW(T, LOAD, STORE, RAWBAD, HALF, NEOX, FUSED)                           \
    for (int64_t h = 0; h < heads; ++h) {                                        \
        const T *restrict x = in + h * head_size;                                \
        T *restrict y = o + h * head_size;                                       \
        for (int64_t i = 0; i < (HALF); ++i) {                                   \
            const int64_t i1 = (NEOX) ? i : 2 * i;                               \
            const int64_t i2 = (NEOX) ? (HALF) + i : 2 * i + 1;                  \
            const float a = LOAD(x, i1), b = LOAD(x, i2);                        \
            float c1, c2;                                                        \
            if (FUSED) {                                                         \
                c1 = FMA(-b, sn[i], a * cs[i]);                                  \
                c2 = FMA(a, sn[i], b * cs[i]);                                   \
            } else {                                                             \
                c1 = a * cs[i] - b * sn[i];                                      \
                c2 = b * cs[i] + a * sn[i];                                      \
            }                                                                    \
            bad |= NONFINITE32(bits_of(c1)) | NONFINITE32(bits_of(c2));          \
            STORE(y, i1, c1);                                                    \
            STORE(y, i2, c2);                                                    \
        }                                                                        \
        for (int64_t i = 2 * (HALF); i < head_size; ++i) {                       \
            bad |= RAWBAD(x[i]);                                                 \
            y[i] = x[i];                                                         \
        }                                                                        \
    }

#define ROWS(T, LOAD, STORE, RAWBAD, HALF, NEOX, FUSED)                          \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1) reduction(|:bad)") \
    for (int64_t r = 0; r < n; ++r) {                                            \
        const T *restrict in = pool + src[r] * row;                              \
        T *restrict o = out + r * row;                                           \
        const float *cs = table + index[r] * rotary_dim, *sn = cs + (HALF);      \
        ROW(T, LOAD, STORE, RAWBAD, HALF, NEOX, FUSED)                           \
    }

// A constant half for the common head sizes lets the compiler unroll and
// vectorise the pair loop (measured: 0.34x of the passes against 0.57x with
// the half a variable, 32,000 rows of 2 x 32 bf16 values, one thread).
#define BY_HALF(T, LOAD, STORE, RAWBAD, NEOX, FUSED)                             \
    switch (half) {                                                              \
    case 16: ROWS(T, LOAD, STORE, RAWBAD, 16, NEOX, FUSED) break;                \
    case 32: ROWS(T, LOAD, STORE, RAWBAD, 32, NEOX, FUSED) break;                \
    case 64: ROWS(T, LOAD, STORE, RAWBAD, 64, NEOX, FUSED) break;                \
    default: ROWS(T, LOAD, STORE, RAWBAD, half, NEOX, FUSED) break;              \
    }

#define ARGS(T)                                                                  \
    const T *restrict pool, int64_t pool_rows, const int64_t *restrict src,      \
        const int64_t *restrict index, int64_t n, const float *restrict table,   \
        int64_t entries, int64_t heads, int64_t head_size, int64_t rotary_dim,   \
        int neox, int fused, int threads, T *restrict out

// The body of one dtype for one ISA: 0, or -1 if a non-finite value was met
// (the indices are checked by the entry before).
#define BODY(NAME, T, LOAD, STORE, RAWBAD)                                       \
    static int64_t NAME(ARGS(T)) {                                               \
        (void)pool_rows;                                                         \
        (void)entries;                                                           \
        const int64_t half = rotary_dim / 2, row = heads * head_size;            \
        int bad = 0;                                                             \
        if (neox && fused) BY_HALF(T, LOAD, STORE, RAWBAD, 1, 1)                 \
        else if (neox) BY_HALF(T, LOAD, STORE, RAWBAD, 1, 0)                     \
        else if (fused) BY_HALF(T, LOAD, STORE, RAWBAD, 0, 1)                    \
        else BY_HALF(T, LOAD, STORE, RAWBAD, 0, 0)                               \
        return bad ? -1 : 0;                                                     \
    }

#define RAW_BF16(v) RAW_BAD_16(v, 0x7f80u)
#define RAW_F16(v) RAW_BAD_16(v, 0x7c00u)
#define RAW_F32(v) NONFINITE32(bits_of(v))

#define BODIES(ISA)                                                              \
    BODY(bf16_##ISA, uint16_t, LOAD_BF16, STORE_BF16, RAW_BF16)                  \
    BODY(f16_##ISA, uint16_t, LOAD_F16, STORE_F16, RAW_F16)                      \
    BODY(f32_##ISA, float, LOAD_F32, STORE_F32, RAW_F32)

#if defined(__x86_64__) && defined(__GNUC__)
// NOTE: the ISAs of vLLM's CPU build (its _C_AVX512 / _C_AVX2 / _C
// extensions). A pragma, not a command-line -m flag: one object holds every
// body, and the functions OpenMP outlines from a body keep its target.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
BODIES(avx512)
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
BODIES(avx2)
#pragma GCC pop_options
#define HAVE_ISA_BODIES 1
#endif
BODIES(baseline)

enum { ISA_UNSET = -1, ISA_BASELINE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static int chosen_isa = ISA_UNSET;

static int pick_isa(void) {
#ifdef HAVE_ISA_BODIES
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2"))
        return ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("bmi2"))
        return ISA_AVX2;
#endif
    return ISA_BASELINE;
}

static int isa(void) {
    // NOTE: a benign race: every thread computes the same value.
    if (chosen_isa == ISA_UNSET) chosen_isa = pick_isa();
    return chosen_isa;
}

int gather_rotate_abi(void) { return GATHER_ROTATE_ABI; }

// Tests: run the body `which` (0 baseline, 1 AVX2, 2 AVX-512) from now on, if
// this CPU has its ISA (1) or not (0, nothing changed); -1 restores the pick.
int gather_rotate_use_isa(int which) {
    if (which < 0) {
        chosen_isa = pick_isa();
        return 1;
    }
    if (which > pick_isa()) return 0;
    chosen_isa = which;
    return 1;
}

// Which body the entries run on this CPU (for the start-up log).
const char *gather_rotate_isa(void) {
    static const char *const names[] = {"baseline x86-64", "AVX2", "AVX-512"};
#ifdef HAVE_ISA_BODIES
    return names[isa()];
#else
    (void)names;
    return "baseline";
#endif
}

// Returns 0, r + 1 if row r's indices are out of range (checked before
// anything is read or written), or -1 if a non-finite value was met (the
// caller then loads the rows with the passes).
#ifdef HAVE_ISA_BODIES
#define DISPATCH(NAME)                                                           \
    switch (isa()) {                                                             \
    case ISA_AVX512: return NAME##_avx512(pool, pool_rows, src, index, n, table, entries, heads, head_size, rotary_dim, neox, fused, threads, out); \
    case ISA_AVX2: return NAME##_avx2(pool, pool_rows, src, index, n, table, entries, heads, head_size, rotary_dim, neox, fused, threads, out); \
    default: return NAME##_baseline(pool, pool_rows, src, index, n, table, entries, heads, head_size, rotary_dim, neox, fused, threads, out); \
    }
#else
#define DISPATCH(NAME)                                                           \
    return NAME##_baseline(pool, pool_rows, src, index, n, table, entries, heads, head_size, rotary_dim, neox, fused, threads, out);
#endif

#define ENTRY(NAME, BODYNAME, T)                                                 \
    int64_t NAME(ARGS(T)) {                                                      \
        for (int64_t r = 0; r < n; ++r)                                          \
            if (src[r] < 0 || src[r] >= pool_rows || index[r] < 0 ||             \
                index[r] >= entries)                                             \
                return r + 1;                                                    \
        DISPATCH(BODYNAME)                                                       \
    }

ENTRY(gather_rotate_bf16, bf16, uint16_t)
ENTRY(gather_rotate_f16, f16, uint16_t)
ENTRY(gather_rotate_f32, f32, float)
