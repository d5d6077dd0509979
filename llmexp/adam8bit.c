/* One AdamW step with 8-bit blockwise moments over many tensors: llmexp.optim.AdamW8bit's CPU kernel.
 *
 * The algorithm is bitsandbytes' (dynamic maps, blocks of 256 values with one fp32 absmax each),
 * written out as `adam8bit_update` in llmexp/optim.py; this file computes exactly what that
 * function computes, operation for operation (built with -ffp-contract=off, so no fused
 * multiply-adds change the rounding; only torch's vectorised sqrt, not correctly rounded, can
 * differ by an ulp), but in one pass over memory: each block is dequantised,
 * updated and re-quantised while it sits in L1. Threads split the blocks of all tensors evenly.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256
#define CELL_SHIFT 15
#define CELL_MASK ((1u << (32 - CELL_SHIFT)) - 1)
#define LOW_MASK ((1u << CELL_SHIFT) - 1)
#define MAX_THREADS 256

typedef struct {
    float *p;           /* parameters, fp32, contiguous */
    const float *g;     /* gradients, fp32, contiguous */
    uint8_t *q1, *q2;   /* 8-bit moments (codes) */
    float *a1, *a2;     /* absmax per block */
    int64_t n;          /* values */
    float hyper[6];     /* beta1, beta2, eps, decay (1 - lr*wd), step size (lr / bc1), sqrt(bc2) */
} Tensor8;

typedef struct {
    const float *code;      /* 256 map values, sorted */
    const int32_t *table;   /* 2^17 cells: below << 16 | threshold (see nearest_table in optim.py) */
} Map;

typedef struct {
    const Tensor8 *tensors;
    int64_t count;
    const Map *maps;        /* [signed (first moment), unsigned (second moment)] */
    int64_t first, last;    /* global block range [first, last) of this thread */
} Work;

/* The largest |x|: integer max over the bit patterns with the sign cleared orders floats as their
 * values do (and a NaN above all of them, as torch's amax keeps it); this form vectorises. */
static float absmax_of(const float *restrict x, int64_t len) {
    uint32_t most = 0;
    for (int64_t i = 0; i < len; i++) {
        uint32_t bits;
        memcpy(&bits, &x[i], sizeof bits);
        bits &= 0x7fffffffu;
        most = bits > most ? bits : most;
    }
    float out;
    memcpy(&out, &most, sizeof out);
    return out;
}

/* q = the index of the nearest map value to x / absmax: the float's top 17 bits pick a cell, which
 * holds at most one midpoint; its low 15 bits, compared with that midpoint's, finish the search. */
static void quantize(const float *restrict x, int64_t len, float absmax, const int32_t *restrict table,
                     uint8_t *restrict q) {
    const float denom = absmax > 1e-30f ? absmax : 1e-30f;
    for (int64_t i = 0; i < len; i++) {
        const float s = x[i] / denom;
        uint32_t bits;
        memcpy(&bits, &s, sizeof bits);
        const uint32_t entry = (uint32_t)table[(bits >> CELL_SHIFT) & CELL_MASK];
        const uint32_t key = (bits & LOW_MASK) ^ ((bits >> 31) ? LOW_MASK : 0u);  /* negatives: reversed */
        q[i] = (uint8_t)((entry >> 16) + (key > (entry & 0xFFFFu)));
    }
}

/* The moments and the weight update of one block; m and v are left in fp32 for quantize().
 * A function of its own: gcc honours `restrict` on parameters, so this loop vectorises. */
static void update(int64_t len, const float hyper[6], const float *restrict g, float *restrict p,
                   const uint8_t *restrict q1, float a1, const float *restrict code1,
                   const uint8_t *restrict q2, float a2, const float *restrict code2,
                   float *restrict m, float *restrict v) {
    const float beta1 = hyper[0], beta2 = hyper[1], eps = hyper[2];
    const float decay = hyper[3], step_size = hyper[4], correction2 = hyper[5];
    const float one_minus_beta1 = 1.0f - beta1, one_minus_beta2 = 1.0f - beta2;
    for (int64_t i = 0; i < len; i++) {
        const float grad = g[i];
        m[i] = code1[q1[i]] * a1 * beta1 + grad * one_minus_beta1;
        v[i] = code2[q2[i]] * a2 * beta2 + grad * grad * one_minus_beta2;
        p[i] = p[i] * decay - step_size * m[i] / (sqrtf(v[i]) / correction2 + eps);
    }
}

static void step_block(const Tensor8 *t, int64_t block, const Map *maps) {
    const int64_t start = block * BLOCK;
    const int64_t len = t->n - start < BLOCK ? t->n - start : BLOCK;
    float m[BLOCK], v[BLOCK];
    update(len, t->hyper, t->g + start, t->p + start, t->q1 + start, t->a1[block], maps[0].code,
           t->q2 + start, t->a2[block], maps[1].code, m, v);
    const float max1 = absmax_of(m, len), max2 = absmax_of(v, len);
    quantize(m, len, max1, maps[0].table, t->q1 + start);
    quantize(v, len, max2, maps[1].table, t->q2 + start);
    t->a1[block] = max1;
    t->a2[block] = max2;
}

static void *run(void *arg) {
    const Work *w = (const Work *)arg;
    int64_t offset = 0;  /* global index of the current tensor's first block */
    for (int64_t k = 0; k < w->count && offset < w->last; k++) {
        const int64_t blocks = (w->tensors[k].n + BLOCK - 1) / BLOCK;
        for (int64_t b = w->first > offset ? w->first - offset : 0; b < blocks && offset + b < w->last; b++)
            step_block(&w->tensors[k], b, w->maps);
        offset += blocks;
    }
    return NULL;
}

void adam8bit_step(const Tensor8 *tensors, int64_t count, const Map *maps, int threads) {
    int64_t total = 0;
    for (int64_t k = 0; k < count; k++) total += (tensors[k].n + BLOCK - 1) / BLOCK;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > total) threads = total > 0 ? (int)total : 1;
    Work work[MAX_THREADS];
    for (int t = 0; t < threads; t++)
        work[t] = (Work){tensors, count, maps, total * t / threads, total * (t + 1) / threads};
#ifdef _OPENMP
    /* Built against the libgomp torch has loaded: its pool's threads, still spinning after the
     * last torch op, take the work at once instead of competing with threads of our own. */
    #pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) run(&work[t]);
#else
    pthread_t ids[MAX_THREADS];
    int started = 1;
    for (; started < threads; started++)
        if (pthread_create(&ids[started], NULL, run, &work[started]) != 0) break;
    run(&work[0]);
    for (int t = 1; t < started; t++) pthread_join(ids[t], NULL);
    for (int t = started; t < threads; t++) run(&work[t]);  /* a thread failed to start: its share runs here */
#endif
}
