/* scratch.c's arena: the matmul and attention kernels' scratch, kept between calls. Private. */
#ifndef LLMC_SCRATCH_H
#define LLMC_SCRATCH_H

#include <stddef.h>

/* The arena's buffers, one per kind of scratch, so that a kernel can hold
   two at once. */
enum {
    LLMC_SCRATCH_PANELS,   /* a GEMM's packed panels, a slice per thread;
                              attention's panels and score blocks          */
    LLMC_SCRATCH_COPIES,   /* operands rounded or widened into float32 (the
                              bf16 matmul without vdpbf16ps), decoding rows  */
    LLMC_SCRATCH_SLOTS
};

/* Locks the arena and returns slot's buffer, 64-byte aligned, of at least
   `bytes` bytes (grown if it was smaller; its contents are undefined); or
   NULL, unlocked again, if it could not grow. Every non-NULL return is
   paired with one llmc_scratch_done. The lock is recursive: a holder may
   acquire another slot (never the one it holds), and calls from other
   threads wait. Call outside any OpenMP parallel region. */
void* llmc_scratch_acquire(int slot, size_t bytes);

/* Unlocks one llmc_scratch_acquire; the buffer stays for the next call. */
void llmc_scratch_done(void);

#endif
