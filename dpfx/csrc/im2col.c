/* im2col over a whole batch, every core: the patches a 2-D convolution reads.
 *
 * dpfx_im2col_{f32,f64}(x, out, B, C, H, W, kh, kw, dh, dw, ph, pw, sh, sw, oh, ow, threads)
 * writes out[b, (c*kh + i)*kw + j, y*ow + z] = x[b, c, y*sh - ph + i*dh, z*sw - pw + j*dw], zero
 * where that pixel lies in the padding: ATen's im2col layout (B, C*kh*kw, oh*ow), for a
 * contiguous x. ATen's own kernel runs the batch in a serial loop of per-example calls; here the
 * B*C*kh*kw output rows are split across threads, and within a row the range of z whose pixel is
 * inside the image is computed once, so the inner loop is a branch-free strided copy (a memcpy
 * at stride 1). Every output is a copy or a zero: the result equals ATen's bit for bit. */
#include <stdint.h>
#include <string.h>
#define DEFINE_IM2COL(NAME, T)                                                                 \
void NAME(const T *restrict x, T *restrict out, int64_t batch, int64_t channels,               \
          int64_t h, int64_t w, int64_t kh, int64_t kw, int64_t dh, int64_t dw,                \
          int64_t ph, int64_t pw, int64_t sh, int64_t sw, int64_t oh, int64_t ow,              \
          int threads) {                                                                       \
    const int64_t rows = batch * channels * kh * kw;                                           \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                          \
    for (int64_t r = 0; r < rows; r++) {                                                       \
        const int64_t kj = r % kw, ki = (r / kw) % kh, bc = r / (kw * kh);                     \
        const T *src = x + bc * h * w;                                                         \
        T *dst = out + r * oh * ow;                                                            \
        for (int64_t oy = 0; oy < oh; oy++) {                                                  \
            const int64_t iy = oy * sh - ph + ki * dh;                                         \
            T *row = dst + oy * ow;                                                            \
            if (iy < 0 || iy >= h) { memset(row, 0, sizeof(T) * ow); continue; }               \
            const T *in = src + iy * w;                                                        \
            const int64_t x0 = kj * dw - pw;                                                   \
            /* ox range whose column ix = ox*sw + x0 lies in [0, w) */                         \
            int64_t lo = x0 >= 0 ? 0 : (-x0 + sw - 1) / sw;                                   \
            int64_t hi = w - 1 - x0 < 0 ? 0 : (w - 1 - x0) / sw + 1;                           \
            if (hi > ow) hi = ow;                                                              \
            if (lo > hi) lo = hi;                                                              \
            for (int64_t ox = 0; ox < lo; ox++) row[ox] = 0;                                   \
            if (sw == 1) memcpy(row + lo, in + lo + x0, sizeof(T) * (hi - lo));                \
            else for (int64_t ox = lo; ox < hi; ox++) row[ox] = in[ox * sw + x0];              \
            for (int64_t ox = hi; ox < ow; ox++) row[ox] = 0;                                  \
        }                                                                                      \
    }                                                                                          \
}
DEFINE_IM2COL(dpfx_im2col_f32, float)
DEFINE_IM2COL(dpfx_im2col_f64, double)
