#include "log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace datadist {

namespace {
bool enabled() {
  static const bool on = [] {
    const char *value = std::getenv("DATADIST_AIO_LOG");
    return value == nullptr || std::strcmp(value, "off") != 0;
  }();
  return on;
}
}  // namespace

void log_warning(const std::string &message) {
  if (enabled()) std::fprintf(stderr, "[datadist_aio] %s\n", message.c_str());
}

}  // namespace datadist
