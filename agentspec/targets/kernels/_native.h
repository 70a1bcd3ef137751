/* Shared declarations of the native kernels (one extension, agentspec.targets.kernels._native). */
#ifndef AGENTSPEC_NATIVE_H
#define AGENTSPEC_NATIVE_H
#include <stdint.h>
#include <string.h>

/* A task range [begin, end) of a parallel call; ctx is the kernel's own arguments. */
typedef void (*agentspec_task)(void *ctx, int64_t begin, int64_t end);

/* Run fn over [0, n) split into `threads` contiguous parts (the caller runs the first). */
void agentspec_parallel(agentspec_task fn, void *ctx, int64_t n, int threads);

/* c10::BFloat16's round to nearest even; NaN becomes the canonical quiet NaN. */
static inline uint16_t agentspec_to_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

/* One output of a w8a8 / w8a16 layer from its exact int32 sums (the low digit's only with
   two digits): ((254 * high + low) * s) * u + bias, each operation rounded on its own (built
   without fused multiply-add): the one definition agentspec_combine and the one-call layer
   both use, so their bits are the same. */
static inline float agentspec_recombine(int32_t high, int32_t low, int two, float s, float u,
                                        const float *bias) {
    float y = (float)high;
    if (two) {
        y = y * 254.0f;
        y = y + (float)low;
    }
    y = y * s;
    y = y * u;
    if (bias) y = y + *bias;
    return y;
}

/* Rows x [m, k] (fp32, or bf16 when bf16 != 0) as int8 digits q [digits*m, k] and units u [m]
   (_digits.c; scratch: k floats when bf16). */
void agentspec_quantize(const void *x, int bf16, int64_t m, int64_t k, int digits,
                        int8_t *q, float *u, float *scratch);

#endif
