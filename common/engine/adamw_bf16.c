/* AdamW with bf16 moments and fp32 parameters, one pass over memory (common/engine/adamw_bf16.py
 * compiles and loads this file; nothing else calls it).
 *
 * Each element: the moments widened to fp32, the fp32 AdamW arithmetic, the moments rounded back to
 * bf16 (round to nearest even, as torch's copy_ rounds), the parameter updated from the fp32 moments.
 * The arithmetic is that of torch's fused CPU AdamW kernel in the same order (decoupled decay first,
 * the first moment as a lerp by (1 - beta1), the second moment's grad term contracted into one fma as
 * torch's build contracts it, the bias corrections in double), so the step gives the numbers of
 * "upcast, torch._fused_adamw_, round back" — compiled with -ffp-contract=off so that only the fmaf
 * calls written here fuse. It reads 12 and writes 8 bytes an element, where that three-pass step
 * moves 52 (and fp32 AdamW 28).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  float decay;      /* 1 - lr * weight_decay */
  float weight;     /* the lerp weight, 1 - beta1 */
  int small_weight; /* |weight| < 0.5: lerp from the moment, else from the gradient (torch's two forms) */
  float beta2, grad_sq_coefficient, bias_correction2_sqrt, eps, neg_step_size;
} Hyper;

typedef struct {
  float *param;
  const float *grad;
  uint16_t *exp_avg, *exp_avg_sq;
  int64_t numel;
  Hyper hyper;
} Tensors;

typedef struct {
  const Tensors *tensors;
  int count;
  int64_t begin, end; /* this thread's elements, counted over the tensors one after another */
} Share;

static inline float widen(uint16_t bits) {
  uint32_t word = (uint32_t)bits << 16;
  float value;
  memcpy(&value, &word, sizeof value);
  return value;
}

static inline uint16_t round_to_bf16(float value) {
  uint32_t word;
  memcpy(&word, &value, sizeof word);
  if (isnan(value)) return 0x7FC0;
  return (uint16_t)((word + 0x7FFFu + ((word >> 16) & 1u)) >> 16);
}

static void step_range(const Tensors *t, int64_t begin, int64_t end) {
  const Hyper h = t->hyper;
  /* torch's two lerp forms, as one: fma(coefficient, g - m, base), base the moment or the gradient */
  const float coefficient = h.small_weight ? h.weight : h.weight - 1.0f;
  float *restrict param = t->param;
  const float *restrict grad = t->grad;
  uint16_t *restrict exp_avg = t->exp_avg, *restrict exp_avg_sq = t->exp_avg_sq;
  for (int64_t i = begin; i < end; i++) {
    float p = param[i] * h.decay, g = grad[i];
    float m = widen(exp_avg[i]), v = widen(exp_avg_sq[i]);
    m = fmaf(coefficient, g - m, h.small_weight ? m : g);
    v = fmaf(h.grad_sq_coefficient * g, g, v * h.beta2);
    exp_avg[i] = round_to_bf16(m);
    exp_avg_sq[i] = round_to_bf16(v);
    param[i] = p + (h.neg_step_size * m) / (sqrtf(v) / h.bias_correction2_sqrt + h.eps);
  }
}

static void *step_share(void *arg) {
  const Share *share = arg;
  int64_t offset = 0;
  for (int i = 0; i < share->count && offset < share->end; i++) {
    int64_t numel = share->tensors[i].numel;
    int64_t begin = share->begin > offset ? share->begin - offset : 0;
    int64_t end = share->end - offset < numel ? share->end - offset : numel;
    if (begin < end) step_range(&share->tensors[i], begin, end);
    offset += numel;
  }
  return NULL;
}

/* One AdamW step over `count` tensors (steps[i]: tensor i's step count, already incremented) on up
 * to `threads` threads, each a contiguous share of all the elements (a thread that cannot be started
 * leaves its share to this one). 0 on success, -1 when no memory could be had (nothing stepped). */
int critic_adamw_bf16_step(int count, float **params, const float **grads, uint16_t **exp_avgs,
                           uint16_t **exp_avg_sqs, const int64_t *numels, const double *steps, double lr,
                           double beta1, double beta2, double weight_decay, double eps, int threads) {
  Tensors *tensors = malloc(sizeof(Tensors) * (count > 0 ? count : 1));
  if (tensors == NULL) return -1;
  int64_t total = 0;
  const float weight = (float)(1.0 - beta1);
  for (int i = 0; i < count; i++) {
    double bias_correction1 = 1.0 - pow(beta1, steps[i]);
    double bias_correction2 = 1.0 - pow(beta2, steps[i]);
    Hyper h = {(float)(1.0 - lr * weight_decay), weight, fabsf(weight) < 0.5f, (float)beta2,
               (float)(1.0 - beta2), (float)sqrt(bias_correction2), (float)eps,
               (float)(-(lr / bias_correction1))};
    Tensors t = {params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], numels[i], h};
    tensors[i] = t;
    total += numels[i];
  }
  const int64_t line = 64; /* shares start on a cache line of every array */
  if (threads < 1) threads = 1;
  if (threads > 64) threads = 64;
  if (total < (int64_t)threads * 16384) threads = 1; /* small steps: not worth a thread */
  Share shares[64];
  pthread_t ids[64];
  int64_t chunk = ((total + threads - 1) / threads + line - 1) / line * line;
  for (int t = 0; t < threads; t++) {
    int64_t begin = t * chunk < total ? t * chunk : total;
    int64_t end = begin + chunk < total ? begin + chunk : total;
    Share s = {tensors, count, begin, end};
    shares[t] = s;
  }
  int started[64] = {0};
  for (int t = 1; t < threads; t++) {
    started[t] = pthread_create(&ids[t], NULL, step_share, &shares[t]) == 0;
    if (!started[t]) step_share(&shares[t]); /* no thread to be had: this one does the share */
  }
  step_share(&shares[0]);
  for (int t = 1; t < threads; t++)
    if (started[t]) pthread_join(ids[t], NULL);
  free(tensors);
  return 0;
}
