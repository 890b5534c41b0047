// Names the calling thread as `top -H`, gdb and /proc show it (at most 15
// characters). Threads of the engine are named "dd-<what>".
#ifndef DATADIST_THREAD_NAME_H_
#define DATADIST_THREAD_NAME_H_

#include <pthread.h>

namespace datadist {

inline void name_this_thread(const char *name) { ::pthread_setname_np(::pthread_self(), name); }

}  // namespace datadist

#endif  // DATADIST_THREAD_NAME_H_
