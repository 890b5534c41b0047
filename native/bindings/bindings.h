// Entry points of the pybind11 module, one per bound type group.
#ifndef DATADIST_BINDINGS_H_
#define DATADIST_BINDINGS_H_

#include <pybind11/pybind11.h>

namespace datadist::bindings {

void bind_engine(pybind11::module_ &m);
void bind_request(pybind11::module_ &m);
void bind_buffer(pybind11::module_ &m);
void bind_bench(pybind11::module_ &m);

}  // namespace datadist::bindings

#endif  // DATADIST_BINDINGS_H_
