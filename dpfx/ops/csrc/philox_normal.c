/* Standard normal samples on the CPU: Philox4x32-10 counters, Box-Muller, all cores.
 *
 * dpfx_philox_normal(out, n, key, threads) fills out[0..n) with N(0, 1) samples. Block b in
 * 0..n/4 runs Philox4x32-10 (Salmon et al., SC'11: the counter-based generator behind cuRAND and
 * PyTorch's CUDA randn) on counter (b_lo, b_hi, 0, 0) under the 64-bit key and gets four 32-bit
 * words x0..x3. Each word becomes a uniform in (0, 1], u = (x + 1/2) * 2^-32 (never 0, so the
 * log is finite; the largest |z| is sqrt(-2 ln 2^-33) = 6.76), and Box-Muller turns (u0, u1)
 * and (u2, u3) into four normals, written to out[b], out[b + m], out[b + 2m], out[b + 3m] with
 * m = n / 4 so that every store is contiguous across SIMD lanes. The n % 4 trailing entries
 * come from block m. A block depends on nothing but (key, b): the output is the same for any
 * thread count. Each thread takes tiles of 2048 blocks: Philox in AVX-512 (sixteen blocks a
 * step, each step prefetching its blocks' output lines) or AVX2 (eight), a scalar loop
 * elsewhere, then Box-Muller in a loop GCC vectorizes, its logarithm, sine and cosine written
 * out below (no libm call). dpfx_philox4x32_10 exposes one raw block for the known-answer
 * tests. */
#include <stdint.h>
#include <math.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
/* Where AVX-512 exists, GCC vectorizes this file's loops (Box-Muller) 512 bits wide, not at the
 * 256 bits native.py asks for everywhere else: a third less time a sample. The normals move by
 * a few ulps (-ffast-math contracts the polynomials differently at each width); the Philox
 * words do not change. */
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("prefer-vector-width=512")
#endif

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

/* One Philox round on (a0, a1, a2, a3) with the round-r key (k0 + r W0, k1 + r W1). */
#define PHILOX_ROUND(r) {                                                          \
    uint64_t p0 = (uint64_t)PHILOX_M0 * a0, p1 = (uint64_t)PHILOX_M1 * a2;        \
    uint32_t n0 = (uint32_t)(p1 >> 32) ^ a1 ^ (k0 + (uint32_t)(r) * PHILOX_W0);   \
    uint32_t n2 = (uint32_t)(p0 >> 32) ^ a3 ^ (k1 + (uint32_t)(r) * PHILOX_W1);   \
    a1 = (uint32_t)p1; a3 = (uint32_t)p0; a0 = n0; a2 = n2; }

#define PHILOX_10_ROUNDS                                                           \
    PHILOX_ROUND(0) PHILOX_ROUND(1) PHILOX_ROUND(2) PHILOX_ROUND(3) PHILOX_ROUND(4) \
    PHILOX_ROUND(5) PHILOX_ROUND(6) PHILOX_ROUND(7) PHILOX_ROUND(8) PHILOX_ROUND(9)

/* uint32 -> float, rounded to 24 bits: AVX-512 converts unsigned words directly; AVX2 has no
 * unsigned conversion (a branchy one would stop the loop from vectorizing), so there it goes
 * through two exact int32 halves and one rounding add. */
#if defined(__AVX512F__)
#define U32_TO_FLOAT(x) ((float)(uint32_t)(x))
#else
#define U32_TO_FLOAT(x) ((float)(int32_t)((x) >> 16) * 65536.0f + (float)(int32_t)((x) & 0xFFFFu))
#endif
/* (x + 1/2) 2^-32 as one multiply-add: scaling by a power of two commutes with rounding (no
 * value here is subnormal), so this is the same float as rounding x + 1/2, then scaling. */
#define UNIFORM(x) (U32_TO_FLOAT(x) * 2.3283064365386963e-10f + 1.1641532182693481e-10f)
#define TWO_PI 6.28318530717958647692f
#define BLOCKS_PER_TASK 2048

void dpfx_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t a0 = counter[0], a1 = counter[1], a2 = counter[2], a3 = counter[3];
    uint32_t k0 = key[0], k1 = key[1];
    PHILOX_10_ROUNDS
    out[0] = a0; out[1] = a1; out[2] = a2; out[3] = a3;
}

/* Philox words of the blocks lo..lo+count into x[0..3][0..count). The tile's output lies in four
 * runs, block b's entries at out + b, out + b + m, out + b + 2m, out + b + 3m (elements of `size`
 * bytes; `quarter` = m * size bytes apart); each vector step asks for the lines of its blocks in
 * those runs (a prefetch into L2, a hint: no value depends on it), so that the memory fetches
 * them while the words are computed. Without it the Philox phase leaves the memory idle and the
 * Box-Muller loop that follows waits on it: 10^8 samples added in place took 0.85 ns each on one
 * thread (Philox alone 0.30, Box-Muller 0.20, the read-and-write bound 0.41), 0.70 with it. */
#define PREFETCH_BLOCKS(b, n_blocks) {                                             \
    if (out) for (int q = 0; q < 4; q++)                                           \
        for (int64_t o = 0; o < (n_blocks) * size; o += 64)                        \
            __builtin_prefetch(out + (b) * size + q * quarter + o, 0, 2); }

static void philox_tile(uint32_t x[4][BLOCKS_PER_TASK], int64_t lo, int64_t count,
                        uint32_t k0, uint32_t k1, uint32_t stream,
                        const char *out, int64_t quarter, int64_t size) {
    int64_t j = 0;
#if defined(__AVX512F__)
    /* Sixteen blocks per step, as two sets of eight whose 32-bit words sit in the low halves of
     * 64-bit lanes: _mm512_mul_epu32 multiplies exactly those, so each product's low half is
     * already the next round's word in place and its high half comes down by one in-lane
     * shuffle; the high halves of the lanes carry garbage that no multiply or store reads. */
    const __m512i m0x8 = _mm512_set1_epi64((long long)PHILOX_M0), m1x8 = _mm512_set1_epi64((long long)PHILOX_M1);
    const __m512i lane8 = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i lows = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    __m512i key0[10], key1[10];
    for (uint32_t r = 0; r < 10; r++) {
        key0[r] = _mm512_set1_epi32((int)(k0 + r * PHILOX_W0));
        key1[r] = _mm512_set1_epi32((int)(k1 + r * PHILOX_W1));
    }
    for (; j + 16 <= count; j += 16) {
        const int64_t b = lo + j;
        PREFETCH_BLOCKS(b, 16)
        /* b..b+15 never carry into the high word: tiles start at multiples of 16. */
        __m512i a0 = _mm512_add_epi64(_mm512_set1_epi64((long long)(uint32_t)b), lane8);
        __m512i c0 = _mm512_add_epi64(a0, _mm512_set1_epi64(8));
        __m512i a1 = _mm512_set1_epi32((int)(uint32_t)((uint64_t)b >> 32)), c1 = a1;
        __m512i a2 = _mm512_set1_epi32((int)stream), c2 = a2;
        __m512i a3 = _mm512_setzero_si512(), c3 = a3;
        for (uint32_t r = 0; r < 10; r++) {
            const __m512i pa0 = _mm512_mul_epu32(a0, m0x8), pa2 = _mm512_mul_epu32(a2, m1x8);
            const __m512i pc0 = _mm512_mul_epu32(c0, m0x8), pc2 = _mm512_mul_epu32(c2, m1x8);
            a0 = _mm512_ternarylogic_epi32(_mm512_shuffle_epi32(pa2, _MM_PERM_CDAB), a1, key0[r], 0x96);
            a2 = _mm512_ternarylogic_epi32(_mm512_shuffle_epi32(pa0, _MM_PERM_CDAB), a3, key1[r], 0x96);
            c0 = _mm512_ternarylogic_epi32(_mm512_shuffle_epi32(pc2, _MM_PERM_CDAB), c1, key0[r], 0x96);
            c2 = _mm512_ternarylogic_epi32(_mm512_shuffle_epi32(pc0, _MM_PERM_CDAB), c3, key1[r], 0x96);
            a1 = pa2; a3 = pa0; c1 = pc2; c3 = pc0;
        }
        _mm512_storeu_si512((void *)&x[0][j], _mm512_permutex2var_epi32(a0, lows, c0));
        _mm512_storeu_si512((void *)&x[1][j], _mm512_permutex2var_epi32(a1, lows, c1));
        _mm512_storeu_si512((void *)&x[2][j], _mm512_permutex2var_epi32(a2, lows, c2));
        _mm512_storeu_si512((void *)&x[3][j], _mm512_permutex2var_epi32(a3, lows, c3));
    }
#endif
#if defined(__AVX2__)
    /* Eight blocks per step, the AVX-512 step above on 256-bit registers (two sets of four
     * blocks in 64-bit lanes; no three-way xor instruction). */
    const __m256i m0x4 = _mm256_set1_epi64x((long long)PHILOX_M0), m1x4 = _mm256_set1_epi64x((long long)PHILOX_M1);
    const __m256i lane4 = _mm256_setr_epi64x(0, 1, 2, 3);
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    for (; j + 8 <= count; j += 8) {
        const int64_t b = lo + j;
        PREFETCH_BLOCKS(b, 8)
        /* b..b+7 never carry into the high word: tiles start at multiples of 8. */
        __m256i a0 = _mm256_add_epi64(_mm256_set1_epi64x((long long)(uint32_t)b), lane4);
        __m256i c0 = _mm256_add_epi64(a0, _mm256_set1_epi64x(4));
        __m256i a1 = _mm256_set1_epi32((int)(uint32_t)((uint64_t)b >> 32)), c1 = a1;
        __m256i a2 = _mm256_set1_epi32((int)stream), c2 = a2;
        __m256i a3 = _mm256_setzero_si256(), c3 = a3;
        for (uint32_t r = 0; r < 10; r++) {
            const __m256i key0 = _mm256_set1_epi32((int)(k0 + r * PHILOX_W0));
            const __m256i key1 = _mm256_set1_epi32((int)(k1 + r * PHILOX_W1));
            const __m256i pa0 = _mm256_mul_epu32(a0, m0x4), pa2 = _mm256_mul_epu32(a2, m1x4);
            const __m256i pc0 = _mm256_mul_epu32(c0, m0x4), pc2 = _mm256_mul_epu32(c2, m1x4);
            a0 = _mm256_xor_si256(_mm256_xor_si256(_mm256_shuffle_epi32(pa2, 0xB1), a1), key0);
            a2 = _mm256_xor_si256(_mm256_xor_si256(_mm256_shuffle_epi32(pa0, 0xB1), a3), key1);
            c0 = _mm256_xor_si256(_mm256_xor_si256(_mm256_shuffle_epi32(pc2, 0xB1), c1), key0);
            c2 = _mm256_xor_si256(_mm256_xor_si256(_mm256_shuffle_epi32(pc0, 0xB1), c3), key1);
            a1 = pa2; a3 = pa0; c1 = pc2; c3 = pc0;
        }
        /* the low halves of a's four lanes, then c's: even words of each 128-bit half, put in
         * order across the halves */
#define PHILOX_LOWS(p, q) _mm256_permutevar8x32_epi32(_mm256_castps_si256(_mm256_shuffle_ps( \
            _mm256_castsi256_ps(p), _mm256_castsi256_ps(q), _MM_SHUFFLE(2, 0, 2, 0))), order)
        _mm256_storeu_si256((__m256i *)&x[0][j], PHILOX_LOWS(a0, c0));
        _mm256_storeu_si256((__m256i *)&x[1][j], PHILOX_LOWS(a1, c1));
        _mm256_storeu_si256((__m256i *)&x[2][j], PHILOX_LOWS(a2, c2));
        _mm256_storeu_si256((__m256i *)&x[3][j], PHILOX_LOWS(a3, c3));
#undef PHILOX_LOWS
    }
#endif
#undef PREFETCH_BLOCKS
    for (; j < count; j++) {
        const int64_t b = lo + j;
        uint32_t a0 = (uint32_t)b, a1 = (uint32_t)((uint64_t)b >> 32), a2 = stream, a3 = 0;
        PHILOX_10_ROUNDS
        x[0][j] = a0; x[1][j] = a1; x[2][j] = a2; x[3][j] = a3;
    }
}

/* Box-Muller's transcendental functions, written out so that the loop vectorizes with no call
 * on any libc (GCC vectorizes logf/cosf only through glibc's libmvec; elsewhere the loop would
 * call scalar logf per element) and the angle keeps full precision. On AMD Zen 1 with 256-bit
 * vectors this is 5% faster than libmvec's logf/cosf (1.28M normals, 2 threads: 2.85 vs 3.0
 * ms), where those calls and their scalar remainder loop took 33% of the time.
 *
 * neg2_log(u) = -2 ln u for u in (0, 1]: u = 2^e m with m in [sqrt(1/2), sqrt(2)) from the
 * float's bits (u is never 0 or subnormal: u >= 2^-33), ln(1 + f), f = m - 1, by the Cephes
 * single-precision minimax polynomial (S. Moshier; about 1 ulp), and e ln 2 added in two parts
 * (ln 2 = 0.693359375 - 2.12194440e-4, the first exact in few bits).
 *
 * sin_cos_turns(u) = (cos 2 pi u, sin 2 pi u) for u in (0, 1): the quadrant q = round(4u) and
 * the rest r = u - q/4 in [-1/8, 1/8] are exact in float (r = u for q = 0; otherwise u >= 1/8
 * is a multiple of 2^-26, as q/4 is, and so is r, which needs no more than 24 bits), so the
 * reduction loses nothing, unlike cosf(2 pi u) on a rounded 2 pi u; then
 * a = 2 pi r in [-pi/4, pi/4] and Cephes's sine and cosine polynomials on that interval (about
 * 1 ulp), and the quadrant rotates (cos a, sin a) by q quarter turns. */
typedef union { float f; uint32_t u; } float_bits;

static inline float neg2_log(float u) {
    float_bits b = {.f = u};
    int32_t e = (int32_t)((b.u >> 23) & 0xFFu) - 126;         /* u = 2^e * m, m in [1/2, 1) */
    b.u = (b.u & 0x807FFFFFu) | 0x3F000000u;
    float m = b.f;
    const int small = m < 0.70710678118654752f;               /* m < sqrt(1/2): use 2m, e - 1 */
    e -= small;
    const float f = (small ? m + m : m) - 1.0f;               /* in [sqrt(1/2) - 1, sqrt(2) - 1) */
    const float z = f * f;
    float y = 7.0376836292e-2f;
    y = y * f - 1.1514610310e-1f;
    y = y * f + 1.1676998740e-1f;
    y = y * f - 1.2420140846e-1f;
    y = y * f + 1.4249322787e-1f;
    y = y * f - 1.6668057665e-1f;
    y = y * f + 2.0000714765e-1f;
    y = y * f - 2.4999993993e-1f;
    y = y * f + 3.3333331174e-1f;
    y = y * f * z;
    const float fe = (float)e;
    y += -2.12194440e-4f * fe;
    y += -0.5f * z;
    return -2.0f * ((f + y) + 0.693359375f * fe);
}

static inline void sin_cos_turns(float u, float *c, float *s) {
    const float q = (float)(int32_t)(4.0f * u + 0.5f);      /* 0..4, u > 0 */
    const float r = u - 0.25f * q;                            /* exact, in [-1/8, 1/8] */
    const float a = TWO_PI * r, z = a * a;
    const float sa = a + a * z * (-1.6666654611e-1f + z * (8.3321608736e-3f
                                                           + z * -1.9515295891e-4f));
    const float ca = 1.0f - 0.5f * z + z * z * (4.166664568298827e-2f + z * (
                                                -1.388731625493765e-3f + z * 2.443315711809948e-5f));
    const uint32_t k = (uint32_t)(int32_t)q & 3u;
    const float c1 = (k & 1) ? sa : ca, s1 = (k & 1) ? ca : sa;   /* a quarter turn swaps */
    float_bits cb = {.f = c1}, sb = {.f = s1};                      /* and negates cos for */
    cb.u ^= ((k + 1u) & 2u) << 30;                                  /* k = 1, 2, sin for */
    sb.u ^= (k & 2u) << 30;                                         /* k = 2, 3 */
    *c = cb.f;
    *s = sb.f;
}

/* Box-Muller on two pairs of words: (r cos t, r sin t) with r = sqrt(-2 ln u0), t = 2 pi u1. */
#define BOX_MULLER(w0, w1, w2, w3, z0, z1, z2, z3) {                               \
    const float r0 = sqrtf(neg2_log(UNIFORM(w0))), r1 = sqrtf(neg2_log(UNIFORM(w2)));  \
    float c0, s0, c1, s1;                                                          \
    sin_cos_turns(UNIFORM(w1), &c0, &s0);                                          \
    sin_cos_turns(UNIFORM(w3), &c1, &s1);                                          \
    z0 = r0 * c0; z1 = r0 * s0; z2 = r1 * c1; z3 = r1 * s1; }

void dpfx_philox_normal(float *restrict out, int64_t n, uint64_t key, int threads) {
    const uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    const int64_t m = n / 4, blocks = m + (n % 4 != 0);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t lo = 0; lo < blocks; lo += BLOCKS_PER_TASK) {
        const int64_t count = lo + BLOCKS_PER_TASK < blocks ? BLOCKS_PER_TASK : blocks - lo;
        uint32_t x[4][BLOCKS_PER_TASK];
        philox_tile(x, lo, count, k0, k1, 0, (const char *)out, m * 4, 4);
        const int64_t full = lo + count <= m ? count : m - lo;   /* blocks below m */
        #pragma omp simd
        for (int64_t j = 0; j < full; j++) {
            float z0, z1, z2, z3;
            BOX_MULLER(x[0][j], x[1][j], x[2][j], x[3][j], z0, z1, z2, z3)
            const int64_t b = lo + j;
            out[b] = z0; out[b + m] = z1; out[b + 2 * m] = z2; out[b + 3 * m] = z3;
        }
        if (full < count) {            /* block m: the n % 4 trailing entries */
            float z[4];
            BOX_MULLER(x[0][full], x[1][full], x[2][full], x[3][full], z[0], z[1], z[2], z[3])
            for (int64_t i = 0; i < n % 4; i++) out[4 * m + i] = z[i];
        }
    }
}

/* dpfx_philox_add_noise_{f32,f64}(xs, sizes, count, key, std, mult, div, threads) noises
 * `count` tensors in place under one key: x_t[i] <- ((x_t[i] + std * z_t[i]) * mult) / div for
 * t in 0..count, where z_t is dpfx_philox_normal's layout of sizes[t] normals drawn from the
 * Philox counters (b_lo, b_hi, t, 0): the third counter word names the tensor, so every tensor
 * has a stream of its own and no two share a counter. The work is one list of (tensor, tile)
 * tasks handed out dynamically, so a bias of ten entries costs no parallel region of its own and
 * thirty of them do not leave one thread all of a large table's tiles (as a static split by
 * count would); as for
 * dpfx_philox_normal, the output does not depend on the thread count. */
#define DEFINE_ADD_NOISE(T, NAME)                                                        \
void NAME(T *const *xs, const int64_t *sizes, int64_t count, uint64_t key, double std,   \
          double mult, double div, int threads) {                                        \
    const uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);                       \
    const T s = (T)std, a = (T)mult, d = (T)div;                                         \
    int64_t first[count + 1], total = 0;      /* first task of each tensor */            \
    for (int64_t t = 0; t < count; t++) {                                                \
        const int64_t blocks = sizes[t] / 4 + (sizes[t] % 4 != 0);                       \
        first[t] = total;                                                                \
        total += (blocks + BLOCKS_PER_TASK - 1) / BLOCKS_PER_TASK;                       \
    }                                                                                    \
    first[count] = total;                                                                \
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic)")                   \
    for (int64_t task = 0; task < total; task++) {                                       \
        int64_t t = 0, hi = count;               /* the last t with first[t] <= task */  \
        while (hi - t > 1) {                                                             \
            const int64_t mid = (t + hi) / 2;                                            \
            if (first[mid] <= task) t = mid; else hi = mid;                              \
        }                                                                                \
        T *restrict x = xs[t];                                                           \
        const int64_t n = sizes[t], m = n / 4, blocks = m + (n % 4 != 0);                \
        const int64_t lo = (task - first[t]) * BLOCKS_PER_TASK;                          \
        const int64_t cnt = lo + BLOCKS_PER_TASK < blocks ? BLOCKS_PER_TASK : blocks - lo; \
        uint32_t w[4][BLOCKS_PER_TASK];                                                  \
        philox_tile(w, lo, cnt, k0, k1, (uint32_t)t, (const char *)x,                    \
                    m * (int64_t)sizeof(T), (int64_t)sizeof(T));                         \
        const int64_t full = lo + cnt <= m ? cnt : m - lo;                               \
        _Pragma("omp simd")                                                              \
        for (int64_t j = 0; j < full; j++) {                                             \
            float z0, z1, z2, z3;                                                        \
            BOX_MULLER(w[0][j], w[1][j], w[2][j], w[3][j], z0, z1, z2, z3)               \
            const int64_t b = lo + j;                                                    \
            x[b] = (x[b] + s * (T)z0) * a / d;                                           \
            x[b + m] = (x[b + m] + s * (T)z1) * a / d;                                   \
            x[b + 2 * m] = (x[b + 2 * m] + s * (T)z2) * a / d;                           \
            x[b + 3 * m] = (x[b + 3 * m] + s * (T)z3) * a / d;                           \
        }                                                                                \
        if (full < cnt) {                        /* block m: the n % 4 trailing entries */ \
            float z[4];                                                                  \
            BOX_MULLER(w[0][full], w[1][full], w[2][full], w[3][full], z[0], z[1], z[2], z[3]) \
            for (int64_t i = 0; i < n % 4; i++)                                          \
                x[4 * m + i] = (x[4 * m + i] + s * (T)z[i]) * a / d;                     \
        }                                                                                \
    }                                                                                    \
}

DEFINE_ADD_NOISE(float, dpfx_philox_add_noise_f32)
DEFINE_ADD_NOISE(double, dpfx_philox_add_noise_f64)
