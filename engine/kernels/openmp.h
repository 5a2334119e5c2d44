/* Where a kernel library's OpenMP calls go: native.py asks the loader which runtime this address lies in.
 * Guarded, so a kernel that includes several headers (decode_layer.c) defines it once. */
#ifndef KVDOCTOR_OPENMP_H
#define KVDOCTOR_OPENMP_H
#include <omp.h>

void *kvdoctor_openmp_symbol(void) { return (void *)&omp_get_max_threads; }
#endif
