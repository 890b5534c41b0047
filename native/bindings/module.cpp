#include "bindings.h"

PYBIND11_MODULE(_native, m) {
  m.doc() = "datadist_aio engine: handles and ids only; the Python package holds all policy.";
  datadist::bindings::bind_request(m);
  datadist::bindings::bind_engine(m);
  datadist::bindings::bind_buffer(m);
  datadist::bindings::bind_bench(m);
}
