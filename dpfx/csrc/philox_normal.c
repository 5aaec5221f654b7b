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
 * thread count, and the loops vectorize (GCC with -O3 -ffast-math uses glibc's libmvec for
 * logf and cosf). dpfx_philox4x32_10 exposes one raw block for the known-answer tests. */
#include <stdint.h>
#include <math.h>

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

/* uint32 -> float through two exact int32 halves: AVX2 has no unsigned conversion, and a
 * branchy one would stop the loop from vectorizing. Rounds once, to 24 bits. */
#define U32_TO_FLOAT(x) ((float)(int32_t)((x) >> 16) * 65536.0f + (float)(int32_t)((x) & 0xFFFFu))
#define UNIFORM(x) ((U32_TO_FLOAT(x) + 0.5f) * 2.3283064365386963e-10f)   /* * 2^-32 */
#define TWO_PI 6.28318530717958647692f
#define HALF_PI 1.57079632679489661923f
#define BLOCKS_PER_TASK 2048

void dpfx_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t a0 = counter[0], a1 = counter[1], a2 = counter[2], a3 = counter[3];
    uint32_t k0 = key[0], k1 = key[1];
    PHILOX_10_ROUNDS
    out[0] = a0; out[1] = a1; out[2] = a2; out[3] = a3;
}

/* The four normals of block b. sin(t) is written cos(t - pi/2) so that GCC does not fuse the
 * pair into sincosf, which has no vector variant. */
#define BLOCK_NORMALS(b, z0, z1, z2, z3) {                                         \
    uint32_t a0 = (uint32_t)(b), a1 = (uint32_t)((uint64_t)(b) >> 32), a2 = 0, a3 = 0; \
    PHILOX_10_ROUNDS                                                               \
    float r0 = sqrtf(-2.0f * logf(UNIFORM(a0))), t0 = TWO_PI * UNIFORM(a1);        \
    float r1 = sqrtf(-2.0f * logf(UNIFORM(a2))), t1 = TWO_PI * UNIFORM(a3);        \
    z0 = r0 * cosf(t0); z1 = r0 * cosf(t0 - HALF_PI);                              \
    z2 = r1 * cosf(t1); z3 = r1 * cosf(t1 - HALF_PI); }

void dpfx_philox_normal(float *restrict out, int64_t n, uint64_t key, int threads) {
    const uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    const int64_t m = n / 4;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t lo = 0; lo < m; lo += BLOCKS_PER_TASK) {
        const int64_t hi = lo + BLOCKS_PER_TASK < m ? lo + BLOCKS_PER_TASK : m;
        #pragma omp simd
        for (int64_t b = lo; b < hi; b++) {
            float z0, z1, z2, z3;
            BLOCK_NORMALS(b, z0, z1, z2, z3)
            out[b] = z0; out[b + m] = z1; out[b + 2 * m] = z2; out[b + 3 * m] = z3;
        }
    }
    if (n % 4) {
        float z[4];
        BLOCK_NORMALS(m, z[0], z[1], z[2], z[3])
        for (int64_t i = 0; i < n % 4; i++) out[4 * m + i] = z[i];
    }
}
