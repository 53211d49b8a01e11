/* The instruction set the kernels run on (isa.h says how each family is
   built per instruction set): one global choice, like the thread count. */
#include "llmc.h"
#include "common.h"
#include "isa.h"

/* 1 if this build has the kernels for isa and the CPU (and OS) can run them. */
static int isa_supported(int isa) {
    switch (isa) {
        case LLMC_ISA_PORTABLE: return 1;
#ifdef LLMC_X86_DISPATCH
        // libgcc's check also asks the OS (XGETBV) whether it saves the
        // ymm / zmm registers
        case LLMC_ISA_AVX2:
            __builtin_cpu_init();
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        case LLMC_ISA_AVX512:
            __builtin_cpu_init();
            return __builtin_cpu_supports("avx512f") && isa_supported(LLMC_ISA_AVX2);
        case LLMC_ISA_AVX512BF16:
            __builtin_cpu_init();
            return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512dq")
                   && isa_supported(LLMC_ISA_AVX512);
#endif
        default: return 0;
    }
}

static int best_isa(void) {
    if (isa_supported(LLMC_ISA_AVX512BF16)) { return LLMC_ISA_AVX512BF16; }
    if (isa_supported(LLMC_ISA_AVX512)) { return LLMC_ISA_AVX512; }
    if (isa_supported(LLMC_ISA_AVX2)) { return LLMC_ISA_AVX2; }
    return LLMC_ISA_PORTABLE;
}

/* The chosen instruction set; LLMC_ISA_AUTO until the first use picks the
   best. Atomic loads and stores, so that a Python thread calling
   llmc_set_isa while another runs a kernel is no data race: each kernel
   reads it once, before its parallel region. */
static int active_isa = LLMC_ISA_AUTO;

int llmc_isa_supported(int isa) {
    return isa_supported(isa);
}

int llmc_set_isa(int isa) {
    LLMC_REQUIRE(isa >= LLMC_ISA_AUTO && isa <= LLMC_ISA_AVX512BF16, LLMC_ERR_RANGE);
    if (isa == LLMC_ISA_AUTO) { isa = best_isa(); }
    LLMC_REQUIRE(isa_supported(isa), LLMC_ERR_UNSUPPORTED);
    __atomic_store_n(&active_isa, isa, __ATOMIC_RELAXED);
    return LLMC_OK;
}

int llmc_get_isa(void) {
    int isa = __atomic_load_n(&active_isa, __ATOMIC_RELAXED);
    if (isa == LLMC_ISA_AUTO) {
        isa = best_isa();
        __atomic_store_n(&active_isa, isa, __ATOMIC_RELAXED);
    }
    return isa;
}
