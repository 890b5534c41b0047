#include "error_detail.h"

#include <cstdio>

namespace datadist {

namespace {
thread_local std::string detail;
}  // namespace

void clear_error_detail() { detail.clear(); }

const std::string &error_detail() { return detail; }

void set_error_detail(std::string message) {
  if (message.size() > kMaxErrorDetail) message.resize(kMaxErrorDetail);
  detail = std::move(message);
}

llm_datadist::Status refuse(llm_datadist::Status status, std::string message) {
  set_error_detail(std::move(message));
  return status;
}

std::string status_name(llm_datadist::Status status) {
  using namespace llm_datadist;
  switch (status) {
    case LLM_SUCCESS: return "LLM_SUCCESS";
    case LLM_FAILED: return "LLM_FAILED";
    case LLM_WAIT_PROC_TIMEOUT: return "LLM_WAIT_PROC_TIMEOUT";
    case LLM_KV_CACHE_NOT_EXIST: return "LLM_KV_CACHE_NOT_EXIST";
    case LLM_REPEAT_REQUEST: return "LLM_REPEAT_REQUEST";
    case LLM_REQUEST_ALREADY_COMPLETED: return "LLM_REQUEST_ALREADY_COMPLETED";
    case LLM_PARAM_INVALID: return "LLM_PARAM_INVALID";
    case LLM_ENGINE_FINALIZED: return "LLM_ENGINE_FINALIZED";
    case LLM_NOT_YET_LINK: return "LLM_NOT_YET_LINK";
    case LLM_ALREADY_LINK: return "LLM_ALREADY_LINK";
    case LLM_LINK_FAILED: return "LLM_LINK_FAILED";
    case LLM_UNLINK_FAILED: return "LLM_UNLINK_FAILED";
    case LLM_NOTIFY_PROMPT_UNLINK_FAILED: return "LLM_NOTIFY_PROMPT_UNLINK_FAILED";
    case LLM_CLUSTER_NUM_EXCEED_LIMIT: return "LLM_CLUSTER_NUM_EXCEED_LIMIT";
    case LLM_PROCESSING_LINK: return "LLM_PROCESSING_LINK";
    case LLM_DEVICE_OUT_OF_MEMORY: return "LLM_DEVICE_OUT_OF_MEMORY";
    case LLM_PREFIX_ALREADY_EXIST: return "LLM_PREFIX_ALREADY_EXIST";
    case LLM_PREFIX_NOT_EXIST: return "LLM_PREFIX_NOT_EXIST";
    case LLM_SEQ_LEN_OVER_LIMIT: return "LLM_SEQ_LEN_OVER_LIMIT";
    case LLM_NO_FREE_BLOCK: return "LLM_NO_FREE_BLOCK";
    case LLM_BLOCKS_OUT_OF_MEMORY: return "LLM_BLOCKS_OUT_OF_MEMORY";
    case LLM_EXIST_LINK: return "LLM_EXIST_LINK";
    case LLM_FEATURE_NOT_ENABLED: return "LLM_FEATURE_NOT_ENABLED";
    case LLM_TIMEOUT: return "LLM_TIMEOUT";
    case LLM_LINK_BUSY: return "LLM_LINK_BUSY";
    case LLM_OUT_OF_MEMORY: return "LLM_OUT_OF_MEMORY";
    default: {
      char text[16];
      std::snprintf(text, sizeof text, "%#x", status);
      return text;
    }
  }
}

}  // namespace datadist
