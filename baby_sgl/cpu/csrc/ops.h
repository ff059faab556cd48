// The Python path's CPU ops (ops.cpp), registered into the extension module by cpu_step.cpp.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace bsgl {

void register_ops(pybind11::module& m);

}  // namespace bsgl
