/* im2col over a whole batch, every core: the patches a 2-D convolution reads.
 *
 * dpfx_im2col_{f32,f64}(x, out, B, C, H, W, kh, kw, dh, dw, ph, pw, sh, sw, oh, ow, scratch,
 * threads) writes out[b, (c*kh + i)*kw + j, y*ow + z] = x[b, c, y*sh - ph + i*dh, z*sw - pw + j*dw], zero
 * where that pixel lies in the padding: ATen's im2col layout (B, C*kh*kw, oh*ow), for a
 * contiguous x. Every output is a copy or a zero, so the result equals ATen's bit for bit.
 * scratch holds threads * sh*sw * ceil((H + 2ph)/sh) * ceil((W + 2pw)/sw) values (the caller
 * allocates it, so no allocation here can fail unseen).
 *
 * The B*C image planes are split across threads. Each plane is first laid out, zero-padded, as
 * its sh*sw stride phases, phase[qy][qx][a][b] = padded[a*sh + qy][b*sw + qx]: kernel tap (i, j)
 * then reads one (oh, ow) window of one phase, at row (i*dh)/sh and column (j*dw)/sw of phase
 * ((i*dh) % sh, (j*dw) % sw), so every output row of the patches is a run of contiguous copies
 * with no bounds tests and no per-pixel index arithmetic. The earlier kernel copied each output
 * row from the image directly, with two integer divisions per row for its in-image range and a
 * strided inner loop; on the benchmark CNN's stride-2 layers (rows of 4-16 pixels) that
 * bookkeeping cost more than the copies (Note [Patches by dpfx::im2col]). */
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* dst[i] = src[i * s], i < n; the strides 1 and 2 are constants in their loops, so they
 * vectorize as loads and shuffles instead of gathers */
#define DEFINE_STRIDED_COPY(NAME, T)                                                           \
static inline void NAME(T *restrict dst, const T *restrict src, int64_t n, int64_t s) {        \
    if (s == 1) for (int64_t i = 0; i < n; i++) dst[i] = src[i];                               \
    else if (s == 2) for (int64_t i = 0; i < n; i++) dst[i] = src[2 * i];                      \
    else for (int64_t i = 0; i < n; i++) dst[i] = src[s * i];                                  \
}

/* the (oh, ow) window at src, rows sub_w apart, into dst; the common narrow widths get loops
 * of constant length (a call per 4-8 values otherwise costs more than the values) */
#define DEFINE_WINDOW_COPY(NAME, T, COPY)                                                      \
static inline void NAME(T *restrict dst, const T *restrict src, int64_t oh, int64_t ow,        \
                        int64_t sub_w) {                                                       \
    if (ow == 4) {                                                                             \
        for (int64_t y = 0; y < oh; y++)                                                       \
            for (int64_t i = 0; i < 4; i++) dst[y * 4 + i] = src[y * sub_w + i];               \
    } else if (ow == 8) {                                                                      \
        for (int64_t y = 0; y < oh; y++)                                                       \
            for (int64_t i = 0; i < 8; i++) dst[y * 8 + i] = src[y * sub_w + i];              \
    } else if (ow == 16) {                                                                     \
        for (int64_t y = 0; y < oh; y++)                                                       \
            for (int64_t i = 0; i < 16; i++) dst[y * 16 + i] = src[y * sub_w + i];            \
    } else {                                                                                   \
        for (int64_t y = 0; y < oh; y++) COPY(dst + y * ow, src + y * sub_w, ow, 1);           \
    }                                                                                          \
}

#define DEFINE_IM2COL(NAME, T, COPY, WINDOW)                                                   \
DEFINE_STRIDED_COPY(COPY, T)                                                                   \
DEFINE_WINDOW_COPY(WINDOW, T, COPY)                                                            \
void NAME(const T *restrict x, T *restrict out, int64_t batch, int64_t channels,               \
          int64_t h, int64_t w, int64_t kh, int64_t kw, int64_t dh, int64_t dw,                \
          int64_t ph, int64_t pw, int64_t sh, int64_t sw, int64_t oh, int64_t ow,              \
          T *restrict scratch, int threads) {                                                  \
    /* one phase holds ceil((h + 2ph) / sh) x ceil((w + 2pw) / sw) values: every window lies  \
     * inside it, since the convolution's last tap reads padded row (oh-1)*sh + (kh-1)*dh <   \
     * h + 2ph (and so for columns) */                                                         \
    const int64_t sub_h = (h + 2 * ph + sh - 1) / sh, sub_w = (w + 2 * pw + sw - 1) / sw;      \
    const int64_t sub = sub_h * sub_w, planes = batch * channels, taps = kh * kw;              \
    /* for column phase qx, the b with 0 <= b*sw + qx - pw < w: [span[2qx], span[2qx+1]) */     \
    int64_t span[2 * sw];                                                                      \
    for (int64_t qx = 0; qx < sw; qx++) {                                                      \
        span[2 * qx] = qx >= pw ? 0 : (pw - qx + sw - 1) / sw;                                 \
        span[2 * qx + 1] = w + pw - qx <= 0 ? 0 : (w + pw - qx + sw - 1) / sw;                 \
    }                                                                                          \
    _Pragma("omp parallel num_threads(threads)")                                               \
    {                                                                                          \
        /* each thread's phases: threads * sh*sw*sub values of scratch, from the caller */     \
        T *phase = scratch + (int64_t)omp_get_thread_num() * sub * sh * sw;                    \
        _Pragma("omp for schedule(static)")                                                    \
        for (int64_t p = 0; p < planes; p++) {                                                 \
            memset(phase, 0, sizeof(T) * sub * sh * sw);                                       \
            /* image row iy is padded row iy + ph: row a of row phase qy */                   \
            for (int64_t iy = 0, qy = ph % sh, a = ph / sh; iy < h; iy++) {                    \
                const T *in = x + (p * h + iy) * w;                                            \
                T *row = phase + qy * sw * sub + a * sub_w;                                    \
                for (int64_t qx = 0; qx < sw; qx++) {                                          \
                    const int64_t first = span[2 * qx], end = span[2 * qx + 1];                \
                    if (end > first)                                                           \
                        COPY(row + qx * sub + first, in + first * sw + qx - pw, end - first, sw); \
                }                                                                              \
                if (++qy == sh) { qy = 0; a++; }                                               \
            }                                                                                  \
            T *dst = out + p * taps * oh * ow;                                                 \
            for (int64_t i = 0; i < kh; i++) {                                                 \
                const int64_t qy = i * dh % sh, a = i * dh / sh;                               \
                for (int64_t j = 0; j < kw; j++, dst += oh * ow) {                             \
                    const int64_t qx = j * dw % sw, b = j * dw / sw;                           \
                    WINDOW(dst, phase + (qy * sw + qx) * sub + a * sub_w + b, oh, ow, sub_w);  \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
}
DEFINE_IM2COL(dpfx_im2col_f32, float, strided_copy_f32, window_copy_f32)
DEFINE_IM2COL(dpfx_im2col_f64, double, strided_copy_f64, window_copy_f64)
