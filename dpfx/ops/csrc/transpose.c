/* A batch of matrix transposes, every core: the layout changes around dpfx's channels-last
 * convolution calls (NCHW <-> NHWC is a transpose of each example's (C, H*W) matrix).
 *
 * dpfx_transpose_{f32,f64}(src, dst, batch, rows, cols, threads) writes
 * dst[b, j, i] = src[b, i, j] for contiguous src (batch, rows, cols) and dst (batch, cols, rows).
 * The matrices are cut into TILE x TILE tiles split across threads, so a tile's reads and writes
 * stay within cache lines it owns. Every output is a copy: the result equals torch's bit for
 * bit. */
#include <stdint.h>
#define TILE 32
#define DEFINE_TRANSPOSE(NAME, T)                                                              \
void NAME(const T *restrict src, T *restrict dst, int64_t batch, int64_t rows, int64_t cols,   \
          int threads) {                                                                       \
    const int64_t row_tiles = (rows + TILE - 1) / TILE, col_tiles = (cols + TILE - 1) / TILE;  \
    const int64_t tiles = batch * row_tiles * col_tiles;                                       \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                          \
    for (int64_t t = 0; t < tiles; t++) {                                                      \
        const int64_t b = t / (row_tiles * col_tiles), rest = t % (row_tiles * col_tiles);     \
        const int64_t i0 = rest / col_tiles * TILE, j0 = rest % col_tiles * TILE;              \
        const int64_t i1 = i0 + TILE < rows ? i0 + TILE : rows;                                \
        const int64_t j1 = j0 + TILE < cols ? j0 + TILE : cols;                                \
        const T *s = src + b * rows * cols;                                                    \
        T *d = dst + b * rows * cols;                                                          \
        for (int64_t j = j0; j < j1; j++)                                                      \
            for (int64_t i = i0; i < i1; i++) d[j * rows + i] = s[i * cols + j];               \
    }                                                                                          \
}
DEFINE_TRANSPOSE(dpfx_transpose_f32, float)
DEFINE_TRANSPOSE(dpfx_transpose_f64, double)
