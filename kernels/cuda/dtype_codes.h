// The kernels' codes of torch's high-precision dtypes (kernels/cuda/cast.py's
// HP_CODES and launchers.cuh's type codes), for the C++ entries that take tensors.
#pragma once

#include <c10/core/ScalarType.h>

namespace te_fuser {

// float32 0, bfloat16 1, float16 2; -1 for another dtype.
inline int hp_code_or_none(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: return -1;
  }
}

}  // namespace te_fuser
