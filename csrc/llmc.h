/* What every .c file includes: the public API with the headers it needs. */
#ifndef LLMC_H
#define LLMC_H

#include <stddef.h>
#include <stdint.h>
#include "llmc_api.h"

#endif
