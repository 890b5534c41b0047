// Error details: the reason for a refusal, in words, beside its Status.
//
// Each thread keeps the message of the last refusal it met. Every engine
// entry point clears it first, and the code that refuses records why, so
// right after a call returns a failure the calling thread reads the reason
// with error_detail(). An empty string means no reason was recorded.
// Threads: every function acts on the calling thread's message only.
#ifndef DATADIST_ERROR_DETAIL_H_
#define DATADIST_ERROR_DETAIL_H_

#include <sstream>
#include <string>
#include <utility>

#include "llm_datadist/llm_error_codes.h"

namespace datadist {

// Longest message kept; longer ones are cut.
constexpr size_t kMaxErrorDetail = 512;

void clear_error_detail();
const std::string &error_detail();
void set_error_detail(std::string message);

// Records `message` as the calling thread's reason and returns `status`.
llm_datadist::Status refuse(llm_datadist::Status status, std::string message);

// Concatenates the parts as a stream would print them.
template <typename... Parts>
std::string words(const Parts &...parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

// The upstream name of a status ("LLM_PARAM_INVALID"), or its number in hex.
std::string status_name(llm_datadist::Status status);

}  // namespace datadist

#endif  // DATADIST_ERROR_DETAIL_H_
