/*
 * The matmul kernels' scratch arena (contract in scratch.h and llmc_api.h).
 *
 * A GEMM packs its operands into a few MiB of scratch per thread. Allocated
 * and freed per call, that memory came back from glibc's heap still
 * resident once glibc had raised its mmap threshold (after any large free),
 * so a training step's peak grew by the freed blocks; here each kind of
 * scratch is one buffer, kept from call to call and grown only when a call
 * needs more, so the kernels allocate nothing in a steady state.
 *
 * One process-wide recursive mutex guards the buffers: a kernel holds it
 * from llmc_scratch_acquire to llmc_scratch_done, so kernels called from two
 * threads at once (cffi releases the GIL) take turns instead of sharing a
 * buffer, and a kernel may acquire a second slot inside the first (the
 * widened bf16 path: its copies, then the float32 GEMM's panels). Inside a
 * kernel, each OpenMP thread works in its own slice of the buffer.
 */
#define _POSIX_C_SOURCE 200809L   /* PTHREAD_MUTEX_RECURSIVE under -std=c11 */
#include <pthread.h>
#include <stdlib.h>
#include "llmc.h"
#include "scratch.h"

static pthread_mutex_t arena_lock;
static pthread_once_t arena_once = PTHREAD_ONCE_INIT;
static void* buffers[LLMC_SCRATCH_SLOTS];
static size_t sizes[LLMC_SCRATCH_SLOTS];

static void make_lock(void) {
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&arena_lock, &attr);
    pthread_mutexattr_destroy(&attr);
}

static void lock(void) {
    pthread_once(&arena_once, make_lock);
    pthread_mutex_lock(&arena_lock);
}

void* llmc_scratch_acquire(int slot, size_t bytes) {
    lock();
    if (bytes > sizes[slot]) {
        // the old contents are not needed: free first, so the two never coexist
        free(buffers[slot]);
        const size_t rounded = (bytes + 63) / 64 * 64;
        buffers[slot] = rounded >= bytes ? aligned_alloc(64, rounded) : NULL;
        sizes[slot] = buffers[slot] != NULL ? rounded : 0;
        if (buffers[slot] == NULL) {
            pthread_mutex_unlock(&arena_lock);
            return NULL;
        }
    }
    return buffers[slot];
}

void llmc_scratch_done(void) {
    pthread_mutex_unlock(&arena_lock);
}

int llmc_scratch_release(void) {
    lock();
    for (int slot = 0; slot < LLMC_SCRATCH_SLOTS; slot++) {
        free(buffers[slot]);
        buffers[slot] = NULL;
        sizes[slot] = 0;
    }
    pthread_mutex_unlock(&arena_lock);
    return LLMC_OK;
}

size_t llmc_scratch_bytes(void) {
    lock();
    size_t total = 0;
    for (int slot = 0; slot < LLMC_SCRATCH_SLOTS; slot++) { total += sizes[slot]; }
    pthread_mutex_unlock(&arena_lock);
    return total;
}
