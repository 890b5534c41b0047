// Minimal logging to stderr for events a user must be able to see (a
// malformed frame, a link going down). Silence with DATADIST_AIO_LOG=off.
#ifndef DATADIST_LOG_H_
#define DATADIST_LOG_H_

#include <string>

namespace datadist {

void log_warning(const std::string &message);

}  // namespace datadist

#endif  // DATADIST_LOG_H_
