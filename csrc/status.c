/* Status texts and thread control. */
#include "llmc.h"
#include "common.h"

const char* llmc_status_string(int status) {
    switch (status) {
        case LLMC_OK: return "ok";
        case LLMC_ERR_SHAPE:
            return "a size is not positive, sizes disagree, or no array could be that large";
        case LLMC_ERR_RANGE: return "an index (such as a token id) is out of range";
        case LLMC_ERR_NOMEM: return "out of memory for kernel scratch space";
        case LLMC_ERR_NULL: return "a required pointer is NULL";
        case LLMC_ERR_UNSUPPORTED: return "not supported by this CPU or build";
        case LLMC_ERR_VALUE:
            return "a scalar argument is outside its domain (such as a negative eps, "
                   "or a RoPE theta that is not positive and finite)";
        default: return "unknown status";
    }
}

int llmc_set_num_threads(int n) {
    LLMC_REQUIRE(n > 0, LLMC_ERR_SHAPE);
    omp_set_num_threads(n);
    return LLMC_OK;
}

int llmc_get_num_threads(void) {
    return omp_get_max_threads();
}

int llmc_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
