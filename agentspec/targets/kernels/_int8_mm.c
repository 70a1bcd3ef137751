/* int8 x int8 products summed in int32 for few rows: the one-row decode step and short
   verifies of w8a8 / w8a16 (each activation row one or two int8 digits).

   Why: a decode step multiplies every weight once by one or two rows; that is a
   matrix-vector product bound by memory, and a GEMM library's int8 path packs or reorders
   its operands per call. Here each thread walks its weight rows one after another, straight
   from the layer's buffer (one sequential stream, which the hardware prefetcher follows at
   the memory's speed; reading four rows side by side, four streams 896 bytes apart, ran at
   less than half of it), and dots each row with every activation row while it is in L1.

   Same bits as torch._int_mm: an int32 sum of int8 products has one value whatever order
   adds it, so which path, vector width or thread computes a column never changes an output.

   Vector paths, chosen when the extension is compiled for the installing CPU:
   - AVX-512 VNNI with BW (vpdpbusd on 512-bit lanes): vpdpbusd multiplies unsigned by
     signed bytes, so the activation is offset to unsigned (a + 128, one xor) and 128 times
     the weight row's sum (one more vpdpbusd of the row with ones, per weight row, not per
     activation row) is subtracted: sum (a + 128) w - 128 sum w = sum a w. vpdpbusd adds
     without saturating, and int32 arithmetic wraps, so the result is exact whenever the
     true sum fits int32 (it does: |a|, |w| <= 127).
   - AVX-512 VNNI on 256-bit lanes, AVX-VNNI, AVX2 (vpmaddubsw + vpmaddwd): the activation's
     sign moves onto the weight (|a| * (w * sign a), both within 127), so vpmaddubsw's int16
     pair sums (at most 2 * 127 * 127) cannot saturate.
   - else plain C. */
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "_native.h"

typedef struct {
    const void *a;   /* [m, k]: int8, or uint8 offset by 128 (OFFSET_ROWS) */
    const int8_t *w; /* [n, k] */
    int32_t *out;    /* [m, n] */
    int64_t m, k, n;
} mm_args;

#if defined(__AVX2__)
static inline int32_t hsum256(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* acc += sum of |a| * (w * sign a) over 32 bytes, in int32 lanes. */
static inline __m256i dot32(__m256i acc, __m256i a, __m256i w) {
    __m256i ua = _mm256_sign_epi8(a, a);
    __m256i sw = _mm256_sign_epi8(w, a);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, ua, sw);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, ua, sw);
#else
    __m256i pairs = _mm256_maddubs_epi16(ua, sw); /* [16] int16, no saturation */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
#endif

/* Rows a [g, k] (g <= GROUP) dotted with one weight row wr [k]: sums [g]. */
#define GROUP 4

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define OFFSET_ROWS 1 /* the activations are offset to unsigned once per call */
/* `g` is a constant in each caller below (row_sums), so the loops unroll and the
   accumulators stay in registers. `a` holds the activations already offset (a + 128). */
static inline __attribute__((always_inline)) void row_sums_n(
        const uint8_t *a, int64_t k, const int g, const int8_t *wr, int32_t *sums) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i acc[GROUP], ws = _mm512_setzero_si512();
    for (int r = 0; r < g; r++) acc[r] = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        __m512i vw = _mm512_loadu_si512((const void *)(wr + i));
        ws = _mm512_dpbusd_epi32(ws, ones, vw);
        for (int r = 0; r < g; r++)
            acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_loadu_si512((const void *)(a + r * k + i)),
                                         vw);
    }
    if (i < k) { /* the tail: masked-off weight lanes are 0, so their products are 0 */
        __mmask64 keep = (__mmask64)((~0ULL) >> (64 - (k - i)));
        __m512i vw = _mm512_maskz_loadu_epi8(keep, wr + i);
        ws = _mm512_dpbusd_epi32(ws, ones, vw);
        for (int r = 0; r < g; r++)
            acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_maskz_loadu_epi8(keep, a + r * k + i), vw);
    }
    uint32_t offset = 128u * (uint32_t)_mm512_reduce_add_epi32(ws); /* wraps, as the sums */
    for (int r = 0; r < g; r++)
        sums[r] = (int32_t)((uint32_t)_mm512_reduce_add_epi32(acc[r]) - offset);
}

static void row_sums(const uint8_t *a, int64_t k, int g, const int8_t *wr, int32_t *sums) {
    switch (g) {
    case 1: row_sums_n(a, k, 1, wr, sums); break;
    case 2: row_sums_n(a, k, 2, wr, sums); break;
    case 3: row_sums_n(a, k, 3, wr, sums); break;
    default: row_sums_n(a, k, 4, wr, sums); break;
    }
}
#else
#define OFFSET_ROWS 0
static void row_sums(const int8_t *a, int64_t k, int g, const int8_t *wr, int32_t *sums) {
    int64_t tail = 0;
#if defined(__AVX2__)
    __m256i acc[GROUP];
    for (int r = 0; r < GROUP; r++) acc[r] = _mm256_setzero_si256();
    for (; tail + 32 <= k; tail += 32) {
        __m256i vw = _mm256_loadu_si256((const __m256i *)(wr + tail));
        for (int r = 0; r < g; r++)
            acc[r] = dot32(acc[r], _mm256_loadu_si256((const __m256i *)(a + r * k + tail)), vw);
    }
    for (int r = 0; r < g; r++) sums[r] = hsum256(acc[r]);
#else
    for (int r = 0; r < g; r++) sums[r] = 0;
#endif
    for (int r = 0; r < g; r++) {
        int32_t s = 0;
        for (int64_t i = tail; i < k; i++) s += (int32_t)a[r * k + i] * wr[i];
        sums[r] += s;
    }
}
#endif

/* Tasks are blocks of 4 output columns: columns [4 * begin, 4 * end), each weight row read
   once, in order, and dotted with the activation rows GROUP at a time (a later group reads
   the row from L1). */
static void mm_task(void *ctx, int64_t begin, int64_t end) {
    const mm_args *p = (const mm_args *)ctx;
    int64_t j0 = 4 * begin, j1 = 4 * end < p->n ? 4 * end : p->n;
    int32_t sums[GROUP];
    for (int64_t j = j0; j < j1; j++) {
        const int8_t *wr = p->w + j * p->k;
        for (int64_t r0 = 0; r0 < p->m; r0 += GROUP) {
            int g = p->m - r0 < GROUP ? (int)(p->m - r0) : GROUP;
            row_sums((const void *)((const int8_t *)p->a + r0 * p->k), p->k, g, wr, sums);
            for (int r = 0; r < g; r++) p->out[(r0 + r) * p->n + j] = sums[r];
        }
    }
}

/* out [m, n] = a [m, k] @ w [n, k]^T in int32, over `threads` threads. */
void agentspec_int8_mm(const int8_t *a, const int8_t *w, int32_t *out, int64_t m, int64_t k,
                       int64_t n, int threads) {
#if OFFSET_ROWS
    /* a + 128 as unsigned bytes (an xor of the sign bit), once per call, not per weight row */
    uint8_t stack[20480], *flipped = m * k <= (int64_t)sizeof stack ? stack : malloc((size_t)(m * k));
    if (flipped == NULL) { /* no memory for the copy: the exact scalar sums */
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < n; j++) {
                int32_t s = 0;
                for (int64_t i = 0; i < k; i++) s += (int32_t)a[r * k + i] * w[j * k + i];
                out[r * n + j] = s;
            }
        return;
    }
    for (int64_t i = 0; i < m * k; i++) flipped[i] = (uint8_t)a[i] ^ 0x80u;
    mm_args args = {flipped, w, out, m, k, n};
#else
    mm_args args = {a, w, out, m, k, n};
#endif
    agentspec_parallel(mm_task, &args, (n + 3) / 4, threads);
#if OFFSET_ROWS
    if (flipped != stack) free(flipped);
#endif
}

/* A whole w8a8 / w8a16 linear layer over few rows in one call: the rows quantized into
   their digits (agentspec_quantize), the int8 products, and each output recombined from its
   exact sums right where a thread has them: ((254 * high + low) * s[j]) * u[r] + bias[j],
   each operation rounded on its own, as agentspec_combine does (the same bits: the same
   IEEE operations in the same order, no fused multiply-add). One call instead of three, no
   int32 sums written out and read back, and the recombination split over the threads.

   Why: a decode step runs ~100 such layers; from Python each took three calls into C,
   five tensors allocated and a few checks, ~15 us a layer on top of the arithmetic. */
#define LINEAR_MAX_ROWS 128 /* activation digit rows (digits x rows) one call takes */

typedef struct {
    const void *a;   /* [m, k] digits (offset to unsigned where OFFSET_ROWS) */
    const int8_t *w; /* [n, k] */
    int64_t m, k, n, rows;
    const float *s, *u, *bias;
    void *out; /* [rows, n] fp32 or bf16 */
    int bf16;
} linear_args;

static void linear_task(void *ctx, int64_t begin, int64_t end) {
    const linear_args *p = (const linear_args *)ctx;
    int64_t j0 = 4 * begin, j1 = 4 * end < p->n ? 4 * end : p->n;
    int32_t sums[LINEAR_MAX_ROWS + GROUP];
    for (int64_t j = j0; j < j1; j++) {
        const int8_t *wr = p->w + j * p->k;
        for (int64_t r0 = 0; r0 < p->m; r0 += GROUP) {
            int g = p->m - r0 < GROUP ? (int)(p->m - r0) : GROUP;
            row_sums((const void *)((const int8_t *)p->a + r0 * p->k), p->k, g, wr, sums + r0);
        }
        int two = p->m > p->rows; /* two digits: the low digit's rows follow the high's */
        for (int64_t r = 0; r < p->rows; r++) {
            float y = agentspec_recombine(sums[r], two ? sums[p->rows + r] : 0, two, p->s[j],
                                          p->u[r], p->bias ? p->bias + j : NULL);
            if (p->bf16)
                ((uint16_t *)p->out)[r * p->n + j] = agentspec_to_bf16(y);
            else
                ((float *)p->out)[r * p->n + j] = y;
        }
    }
}

/* out [rows, n] = the layer of int8 weights w [n, k] (scales s [n], optional bias [n])
   over x [rows, k] (fp32, or bf16 when x_bf16), its rows as `digits` int8 digits, in fp32
   or bf16 (out_bf16). Returns 0, or -1 (nothing written) where digits x rows exceeds
   LINEAR_MAX_ROWS or the scratch memory cannot be had: the caller takes the three calls. */
int agentspec_int8_linear(const void *x, int x_bf16, int64_t rows, int64_t k, int digits,
                          const int8_t *w, int64_t n, const float *s, const float *bias,
                          void *out, int out_bf16, int threads) {
    int64_t m = digits * rows;
    if (rows < 1 || m > LINEAR_MAX_ROWS) return -1;
    size_t q_bytes = (size_t)(m * k), need = q_bytes + 64 + sizeof(float) * (size_t)(rows +
                     (x_bf16 ? k : 0));
    unsigned char stack[24576], *mem = need <= sizeof stack ? stack : malloc(need);
    if (mem == NULL) return -1;
    int8_t *q = (int8_t *)mem;
    float *u = (float *)(mem + ((q_bytes + 63) & ~(size_t)63));
    float *scratch = x_bf16 ? u + rows : NULL;
    agentspec_quantize(x, x_bf16, rows, k, digits, q, u, scratch);
#if OFFSET_ROWS
    for (size_t i = 0; i < q_bytes; i++) q[i] = (int8_t)((uint8_t)q[i] ^ 0x80u);
#endif
    linear_args args = {q, w, m, k, n, rows, s, u, bias, out, out_bf16};
    agentspec_parallel(linear_task, &args, (n + 3) / 4, threads);
    if (mem != stack) free(mem);
    return 0;
}

/* Which vector path this build took (reported by the Python side). */
const char *agentspec_int8_mm_path(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return "avx512vnni";
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "avx512vnni-256";
#elif defined(__AVXVNNI__)
    return "avxvnni";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "c";
#endif
}
