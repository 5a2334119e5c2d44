/* The boundary between decode_layer.py and decode_layer.c: the one argument of kvdoctor_decode_layers.
 *
 * A call with dozens of positional arguments crashes the process on the first one out of place; here every
 * argument is a named field of one struct, listed once (DECODE_ARGS), which decode_layer.py mirrors as a
 * ctypes.Structure. The library exports the struct's size, each field's offset and the fields' names
 * (kvdoctor_decode_args_layout, kvdoctor_decode_args_names), and decode_layer.py refuses a library whose
 * layout is not its own with an error that names the difference. decode_layer.c says what each field means. */
#ifndef KVDOCTOR_DECODE_LAYER_H
#define KVDOCTOR_DECODE_LAYER_H
#include "attn_stats.h"
#include <stdint.h>

/* One layer's weights: what Python builds once per model (decode_layer.py's _LayerC). */
typedef struct {
  const void *norm1, *qkv, *o, *norm2, *gate_up, *down;
  float eps1, eps2, scale;
} layer_weights;

/* X(type, name) for every field of decode_args, in order. Integers are int64_t and pointers are pointers,
 * so the struct has no padding a mirror could place differently. */
#define DECODE_ARGS(X)                                                                                   \
  X(int64_t, is_bf16) X(int64_t, L) X(int64_t, M) X(int64_t, hidden) X(int64_t, H) X(int64_t, Hkv)            \
  X(int64_t, D) X(int64_t, I) X(const layer_weights *, layers) X(void *const *, kv) X(void *, x)          \
  X(void *, qkv) X(const void *, cos) X(const void *, sin) X(const int64_t *, rows)                        \
  X(const int64_t *, kv_rows) X(int64_t, nb) X(int64_t, bs) X(const int32_t *, lens) X(float *, newest)    \
  X(int64_t, keep) X(int64_t, T) X(Head *, heads) X(int64_t, sink) X(float *, summary) X(float *, hent)    \
  X(float *, hmax) X(int64_t *, counts) X(const int64_t *, wk) X(const int64_t *, wv) X(uint64_t *, units) \
  X(const int64_t *, mix) X(int64_t, U) X(uint64_t *, shares) X(const int64_t *, vblock)                  \
  X(int64_t, vk) X(uint64_t *, vsums) X(uint64_t *, vtotal) X(const void *, final_w) X(float *, scratch)  \
  X(double, final_eps) X(int64_t, threads)

#define DECODE_FIELD(T, name) T name;
typedef struct {
  DECODE_ARGS(DECODE_FIELD)
} decode_args;
#undef DECODE_FIELD

void kvdoctor_decode_layers(const decode_args *args);
const int64_t *kvdoctor_decode_args_layout(void); /* the field count, sizeof(decode_args), each field's offset */
const char *kvdoctor_decode_args_names(void);     /* the fields' names in order, each followed by a space */
#endif
